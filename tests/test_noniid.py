"""Non-IID partitions (types 1-4) and the FPDGD remedies (FedProx, FedPer, data sharing)."""

import asyncio
import copy

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.ltr.clicks import CascadeModel, PositionBasedModel, cascade
from foltr_async.ltr.pdgd import pdgd_gradient, sample_ranking
from foltr_async.observe.observer import Observer
from foltr_async.protocols.noniid import MixtureClickModel, stack_views
from foltr_async.protocols.users import K
from foltr_async.runtime.clock import run
from foltr_async.runtime.wire import Envelope
from foltr_async.scenario.load import revise, validate
from foltr_async.simulation import Simulation

INTENTS = {"profile": "intent-change-like", "n_queries": 150}
GRADED = {"profile": "mq2007-like", "n_queries": 150}


def config(partition=None, dataset=INTENTS, protocol="fpdgd", **fed):
    raw = {
        "scenario": {"seed": 3},
        "dataset": dataset,
        "clicks": {"model": "informational"},
        "federation": {
            "protocol": protocol,
            "clients": 8,
            "queries_per_client": 3,
            "rounds": 4,
            **fed,
        },
        "evaluation": {"every": 2},
    }
    if partition is not None:
        raw["federation"]["partition"] = partition
    return validate(raw, "t")


def build(cfg, seed=3):
    sim = Simulation(cfg, seed, Observer())
    sim.build()
    return sim


def clients(sim):
    return [sim.agents[a] for a in sim.groups["clients"]]


def base_query(train_view, q, base):
    """The number, in the base training set, of the query a view's query ``q`` came from."""
    return int(np.flatnonzero(base.qids == train_view.qids[q])[0])


# ------------------------------------------------------------------------------ partitions


def test_type1_non_iid_gives_each_client_one_intent_in_turn():
    sim = build(config({"intents": [0, 1, 2, 3]}))
    base = sim.ctx.data.train
    seen_base = []
    for i, c in enumerate(clients(sim)):
        users = c.learner.users
        view = users.train
        intent = i % 4  # "cycle": in turn
        for q in users.queries.tolist():
            bq = base_query(view, q, base)
            seen_base.append(bq)
            np.testing.assert_array_equal(
                view.labels[view.doc_range(q)], base.intent_labels[intent][base.doc_range(bq)]
            )
            np.testing.assert_array_equal(
                view.features[view.doc_range(q)], base.features[base.doc_range(bq)]
            )
    # disjoint partition of the base queries (federation.data = "partition")
    assert sorted(seen_base) == list(range(base.n_queries))
    # the global model is scored on every intent's labels of the held-out queries
    views = sim.ctx.partition.test_sets
    assert [v.name for v in views] == ["intent0", "intent1", "intent2", "intent3"]
    test = sim.ctx.data.test
    for k, v in enumerate(views):
        np.testing.assert_array_equal(v.labels, test.intent_labels[k])
        assert v.features is test.features  # a label view, no copy


def test_type1_iid_gives_every_client_all_intents_of_its_queries():
    sim = build(config({"intents": [0, 1, 2, 3], "iid": True}))
    base = sim.ctx.data.train
    for c in clients(sim):
        users = c.learner.users
        by_base = {}
        for q in users.queries.tolist():
            by_base.setdefault(base_query(users.train, q, base), []).append(q)
        assert all(len(qs) == 4 for qs in by_base.values())  # each query under 4 intents
        for bq, qs in by_base.items():
            got = sorted(tuple(users.train.labels[users.train.doc_range(q)]) for q in qs)
            want = sorted(tuple(base.intent_labels[k][base.doc_range(bq)]) for k in range(4))
            assert got == want


def test_type1_single_intent_baseline_and_errors():
    sim = build(config({"intents": [2]}))
    train = clients(sim)[0].learner.users.train
    np.testing.assert_array_equal(train.labels, sim.ctx.data.train.intent_labels[2])
    assert train.features is sim.ctx.data.train.features
    with pytest.raises(ScenarioError, match="no intents"):
        build(config({"intents": [0, 1]}, dataset=GRADED))
    with pytest.raises(ScenarioError, match=r"intents\[1\]: expected an intent in 0..3"):
        build(config({"intents": [0, 9]}))


@pytest.mark.parametrize("r", [1, 2])
def test_type2_clients_hold_documents_of_r_grades_only(r):
    sim = build(config({"grades": r}, dataset=GRADED, data="shared"))
    base = sim.ctx.data.train
    subsets = [tuple(s) for s in sim.ctx.partition.facts["grade_subsets"]]
    assert len(subsets) == 3 and all(len(s) == r for s in subsets)  # C(3, r) subsets
    for i, c in enumerate(clients(sim)):
        users = c.learner.users
        own = subsets[i % len(subsets)]
        labels = users.train.labels[
            np.concatenate(
                [np.arange(users.train.qptr[q], users.train.qptr[q + 1]) for q in users.queries]
            )
        ]
        assert set(np.unique(labels)) <= set(own)
        # every document of the client's grades is there, none other, rows unchanged
        for q in users.queries[:20].tolist():
            bq = base_query(users.train, q, base)
            keep = np.isin(base.labels[base.doc_range(bq)], own)
            np.testing.assert_array_equal(
                users.train.features[users.train.doc_range(q)],
                base.features[base.doc_range(bq)][keep],
            )
        # shared pool: every base query holding such documents
        n_with = sum(
            np.isin(base.labels[base.doc_range(q)], own).any() for q in range(base.n_queries)
        )
        assert users.queries.size == n_with


def test_type2_iid_counterpart_is_the_whole_data_and_too_many_grades_is_an_error():
    sim = build(config({"grades": 1, "iid": True}, dataset=GRADED))
    assert clients(sim)[0].learner.users.train is sim.ctx.data.train
    with pytest.raises(ScenarioError, match="grades: expected at most 3"):
        build(config({"grades": 4}, dataset=GRADED))


def test_type3_click_models_per_client_and_the_iid_mixture():
    part = {"click_models": ["perfect", "navigational", "informational"], "pbm_eta": [1.0]}
    sim = build(config(part, dataset=GRADED))
    models = [c.learner.users.click_model for c in clients(sim)]
    names = ["perfect", "navigational", "informational", "pbm"]
    assert [m.name for m in models] == [names[i % 4] for i in range(8)]
    assert isinstance(models[3], PositionBasedModel) and models[3].gamma_user == 1.0
    iid = build(config({**part, "iid": True}, dataset=GRADED))
    mixed = {id(c.learner.users.click_model) for c in clients(iid)}
    assert len(mixed) == 1
    mixture = clients(iid)[0].learner.users.click_model
    assert isinstance(mixture, MixtureClickModel) and len(mixture.models) == 4
    with pytest.raises(ScenarioError, match=r"click_models\[0\]: expected a cascade model"):
        build(config({"click_models": ["pbm"]}, dataset=GRADED))


def test_mixture_draws_each_model_equally_often():
    perfect, poison = cascade("perfect", 3), cascade("poison", 3)
    mix = MixtureClickModel((perfect, poison))
    rng = np.random.default_rng(0)
    labels = np.array([2, 0])  # perfect clicks only the first, poison only the second
    clicks = np.array([mix.simulate(labels, rng) for _ in range(4000)])
    assert abs(clicks[:, 0].mean() - 0.5) < 0.03
    assert abs(clicks[:, 1].mean() - 0.5) < 0.03
    assert not (clicks[:, 0] & clicks[:, 1]).any()  # one model per interaction


def test_type4_queries_per_round_per_client_and_the_iid_mean():
    sim = build(config({"queries_per_round": [1, 3, 5, 7, 9]}, clients=10))
    assert [c.batch for c in clients(sim)] == [1, 3, 5, 7, 9] * 2
    iid = build(config({"queries_per_round": [1, 3, 5, 7, 9], "iid": True}, clients=10))
    assert {c.batch for c in clients(iid)} == {5}
    with pytest.raises(ScenarioError, match=r"queries_per_round\[1\]: expected an integer"):
        build(config({"queries_per_round": [1, 0]}))


def test_type4_mixed_with_type1_and_weights_follow_the_interactions():
    cfg = config({"queries_per_round": [1, 9], "intents": [0, 1]}, clients=4)
    result = run(Simulation(cfg, 3, Observer()).run())
    # online interactions: per round 1 + 9 + 1 + 9
    assert result["online"]["interactions"] == 4 * 20
    assert result["partition"]["intents"] == [0, 1]
    assert set(result["offline"]) == {"ndcg@10", "ndcg@10/intent0", "ndcg@10/intent1"}
    mean = np.mean(
        [result["offline"]["ndcg@10/intent0"], result["offline"]["ndcg@10/intent1"]], axis=0
    )
    np.testing.assert_allclose(result["offline"]["ndcg@10"], mean)


def test_stack_views_matches_per_query_filtering():
    train = build(config()).ctx.data.train
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, train.n_docs).astype(np.int8)
    keep = labels > 0
    qs, maps = stack_views(train, [(train.labels, None), (labels, keep)])
    assert qs.n_queries == train.n_queries + int(
        sum(keep[train.doc_range(q)].any() for q in range(train.n_queries))
    )
    for q in range(0, train.n_queries, 7):
        np.testing.assert_array_equal(
            qs.labels[qs.doc_range(int(maps[0][q]))], train.labels[train.doc_range(q)]
        )
        m = int(maps[1][q])
        k = keep[train.doc_range(q)]
        if m < 0:
            assert not k.any()
            continue
        np.testing.assert_array_equal(
            qs.features[qs.doc_range(m)], train.features[train.doc_range(q)][k]
        )
        np.testing.assert_array_equal(qs.labels[qs.doc_range(m)], labels[train.doc_range(q)][k])


def test_partition_needs_a_protocol_that_reads_client_data_and_known_keys():
    with pytest.raises(ScenarioError, match="protocol 'foltr_es' does not read per-client data"):
        config({"intents": [0]}, protocol="foltr_es")
    with pytest.raises(
        ScenarioError,
        match=r"federation.partition.intent: unknown key "
        r"\(did you mean 'intents'\?\)",
    ):
        config({"intent": [0]})


def test_cascade_clients_of_a_partition_still_train_in_one_batch():
    sim = Simulation(config({"intents": [0, 1, 2, 3]}), 3, Observer())
    run(sim.run())
    pool = sim.ctx._shared["fpdgd.train_pool"]
    assert pool.batches == 4 and pool.largest == 8  # one batch per round, every client
    assert all(isinstance(c.learner.users.click_model, CascadeModel) for c in clients(sim))


# ------------------------------------------------------------------------------ remedies


def remedy(partition=None, dataset=INTENTS, ranker=None, **params):
    cfg = config(partition, dataset=dataset, protocol="fpdgd_remedies")
    return revise(cfg, {"federation": {"params": params}, "ranker": ranker or {}})


def test_without_remedies_the_protocol_is_fpdgd():
    a = run(Simulation(config({"intents": [0, 1, 2, 3]}), 3, Observer()).run())
    b = run(Simulation(remedy({"intents": [0, 1, 2, 3]}), 3, Observer()).run())
    np.testing.assert_allclose(a["offline"]["ndcg@10"], b["offline"]["ndcg@10"], atol=1e-12)
    assert a["online"] == pytest.approx(b["online"])


def test_fedprox_step_adds_the_proximal_gradient():
    mu, n = 0.7, 6
    client = clients(build(remedy(fedprox_mu=mu)))[0]
    learner = client.learner
    start = np.linspace(-0.5, 0.5, learner.ranker.n_params)
    rng, users = copy.deepcopy(learner.rng), learner.users
    # the reference: replay the same draws with w += lr (g - mu (w - start))
    w = start.copy()
    ranker = learner.ranker.copy()
    for _ in range(n):
        q = int(users.queries[rng.integers(len(users.queries))])
        features, labels = users.train.query(q)
        ranker.set_params(w)
        scores = ranker.score(features)
        ranking = sample_ranking(scores, K, rng)
        clicks = users.click_model.simulate(labels[ranking], rng)
        g = pdgd_gradient(ranker, features, ranking, clicks, scores)
        w = w + learner.lr * (g - mu * (w - start))
    np.testing.assert_allclose(learner.train(start, n), w, rtol=1e-12, atol=1e-12)
    # the proximal term keeps local models closer to the global one than plain PDGD
    plain = clients(build(remedy(fedprox_mu=0.0)))[0].learner
    strong = clients(build(remedy(fedprox_mu=5.0)))[0].learner
    zero = np.zeros(plain.ranker.n_params)
    assert np.linalg.norm(strong.train(zero, 200)) < 0.5 * np.linalg.norm(plain.train(zero, 200))


def test_fedper_keeps_the_output_layer_on_the_device():
    cfg = remedy({"intents": [0, 1, 2, 3]}, ranker={"kind": "mlp", "hidden": [8]}, fedper=True)
    sim = build(cfg)
    client = clients(sim)[1]
    out = client.learner.ranker.layer_slices()["output"]
    start = sim.proto.strategy.model.copy()

    async def two_rounds():
        first = await client.make_update(1, start)
        head = client.head.copy()
        second_start = start + 0.01  # a new global model
        client.learner.users.issued = None
        second = await client.make_update(2, second_start)
        return first, head, second, second_start

    first, head, second, second_start = asyncio.run(two_rounds())
    np.testing.assert_array_equal(first[out], start[out])  # the personal layer never leaves
    np.testing.assert_array_equal(second[out], second_start[out])
    assert not np.allclose(head, start[out])  # it was trained
    assert not np.allclose(client.head, head)  # and goes on from where it was
    base = np.ones(start.size, dtype=bool)
    base[out] = False
    assert not np.allclose(first[base], start[base])  # the base layers travel
    with pytest.raises(ScenarioError, match="fedper: needs ranker.kind"):
        build(remedy(fedper=True))


def test_fedper_reports_personal_models_and_the_global_one():
    cfg = remedy({"intents": [0, 1, 2, 3]}, ranker={"kind": "mlp", "hidden": [8]}, fedper=True)
    result = run(Simulation(cfg, 3, Observer()).run())
    off = result["offline"]
    assert off["personal_models"] == [8, 8]
    assert off["ndcg@10"] != off["ndcg@10_global"]


def test_data_sharing_warms_up_and_sends_every_client_its_share():
    cfg = remedy({"intents": [0, 1, 2, 3]}, share_alpha=0.5, share_size=0.2, warmup=300)
    sim = Simulation(cfg, 3, Observer())
    result = run(sim.run())
    strategy = sim.proto.strategy
    g = strategy.shared
    assert g.size == round(0.2 * 4 * sim.ctx.data.train.n_queries)  # every intent's queries
    assert result["remedies"]["shared_queries"] == g.size
    for c in clients(sim):
        share = c.learner.shared_users.queries
        assert share.size == round(0.5 * g.size) and np.isin(share, g).all()
        assert c.learner.shared_users.train is sim.ctx.partition.global_data.train
    # shared data trains, but no user saw those rankings: they are not in the online metric
    assert 0 < result["online"]["interactions"] < 8 * 3 * 4
    assert result["messages"]["kinds"]["noniid.shared"]["sent"] == 8
    # the warm-up moved the initial model
    fresh = build(cfg).proto.strategy
    fresh._warm_up()
    assert np.linalg.norm(fresh.model) > 0


def test_shared_queries_mix_into_local_training_uniformly_and_unseen():
    sim = build(remedy({"intents": [0, 1, 2, 3]}, share_alpha=0.5, warmup=0))
    client = clients(sim)[0]
    g = sim.ctx.partition.global_data
    share = g.queries[::3][:30]
    asyncio.run(
        client.on_shared(Envelope("noniid.shared", "server", client.id, {"queries": share}))
    )
    learner = client.learner
    own, shared = learner.users, learner.shared_users
    own.issued, shared.issued = [], []
    probe = sim.ctx.probe
    before = len(probe._shown)
    learner.train(np.zeros(learner.ranker.n_params), 400)
    assert len(own.issued) + len(shared.issued) == 400
    assert len(probe._shown) - before == len(own.issued)  # only the users' own rankings
    expected = 30 / (30 + len(own.queries))
    assert abs(len(shared.issued) / 400 - expected) < 0.08
    assert set(shared.issued) <= set(share.tolist())


def test_type1_merged_intents_baseline_judges_by_any_intent():
    sim = build(config({"intents": [0, 1, 2, 3], "merge_intents": True}))
    base, test = sim.ctx.data.train, sim.ctx.data.test
    merged = base.intent_labels.max(axis=0)
    for c in clients(sim):
        users = c.learner.users
        for q in users.queries.tolist():
            bq = base_query(users.train, q, base)
            np.testing.assert_array_equal(
                users.train.labels[users.train.doc_range(q)], merged[base.doc_range(bq)]
            )
    (view,) = sim.ctx.partition.test_sets
    assert view.name == "merged"
    np.testing.assert_array_equal(view.labels, test.intent_labels.max(axis=0))
    assert sim.ctx.partition.facts["merged_intents"] is True
    with pytest.raises(ScenarioError, match="merge_intents: needs intents"):
        build(config({"merge_intents": True}, dataset=GRADED))


def test_fedper_study_mode_sends_the_head_and_scores_the_global_model():
    cfg = remedy(
        {"intents": [0, 1, 2, 3]},
        ranker={"kind": "mlp", "hidden": [8]},
        fedper=True,
        fedper_mode="study",
    )
    sim = build(cfg)
    client = clients(sim)[1]
    out = client.learner.ranker.layer_slices()["output"]
    start = sim.proto.strategy.model.copy()
    first = asyncio.run(client.make_update(1, start))
    np.testing.assert_array_equal(first[out], client.head)  # the head travels too
    assert not np.allclose(first[out], start[out])
    result = run(Simulation(cfg, 3, Observer()).run())
    off = result["offline"]
    assert off["personal_models"] == [8, 8]
    assert "ndcg@10_personal" in off and "ndcg@10/intent0" in off
    assert off["ndcg@10"] != off["ndcg@10_personal"]


def sharing_with_fedprox():
    """Type 2 (one grade per client) on shared documents, data sharing and FedProx: the
    clients' and the shared data's queries index one training set."""
    cfg = remedy({"grades": 1}, dataset=GRADED, share_alpha=0.5, warmup=50, fedprox_mu=0.3)
    return revise(cfg, {"federation": {"data": "shared"}})


@pytest.mark.parametrize(
    ("make", "path"),
    [
        (
            lambda: config(
                {"click_models": ["navigational", "poison"], "pbm_eta": [0.5, 1.5]}, dataset=GRADED
            ),
            "batched",
        ),  # fmt: skip
        (
            lambda: config(
                {"click_models": ["perfect", "informational"], "pbm_eta": [1.0], "iid": True},
                dataset=GRADED,
            ),
            "batched",
        ),  # fmt: skip
        (sharing_with_fedprox, "batched"),  # fmt: skip
        (lambda: remedy({"intents": [0, 1, 2, 3]}, share_alpha=0.5, warmup=50), None),
    ],
)
def test_remedy_runs_are_the_same_batched_or_one_query_at_a_time(monkeypatch, make, path):
    """Position-based and cascade users per client, their IID mixture, data sharing with
    FedProx: the run on the batched path is the run one query at a time (float rounding),
    and its results name the path."""
    import foltr_async.protocols.learner as pdgd_learner

    batched = run(Simulation(make(), 3, Observer()).run())
    monkeypatch.setattr(pdgd_learner, "train_pool", lambda ctx: None)
    one = run(Simulation(make(), 3, Observer()).run())
    paths = {p: n for p, n in batched["learner_interactions"].items() if n}
    if path is not None:
        assert list(paths) == [path]
    np.testing.assert_allclose(batched["offline"]["ndcg@10"], one["offline"]["ndcg@10"], rtol=1e-9)
    assert batched["online"]["interactions"] == one["online"]["interactions"]
    assert batched["online"]["ndcg@10_discounted"] == pytest.approx(
        one["online"]["ndcg@10_discounted"], rel=1e-12
    )
    assert set(one["learner_interactions"].values()) == {0, sum(paths.values())}

"""Batched PDGD: the same draws, rankings, clicks and weights as one learner at a time."""

import warnings

import numpy as np
import pytest

import foltr_async.protocols.learner as pdgd_learner
from foltr_async.ltr import pdgd_batch
from foltr_async.ltr.clicks import cascade
from foltr_async.ltr.pdgd_batch import PDGDJob, train_linear_batch, train_mlp_batch
from foltr_async.ltr.queryset import QuerySet
from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import validate
from foltr_async.simulation import Datasets, Probe, RunContext, Simulation

N_FEATURES = 12


def make_queryset(n_grades: int, seed: int = 0) -> QuerySet:
    """Queries of 0, 1, few, exactly 10 and many documents; some all-zero, some all-top grade."""
    rng = np.random.default_rng(seed)
    sizes = np.concatenate(([0, 1, 2, 5, 9, 10, 11, 40, 150, 7, 12], rng.integers(1, 60, 40)))
    qptr = np.concatenate(([0], np.cumsum(sizes)))
    features = rng.normal(size=(qptr[-1], N_FEATURES)).astype(np.float32)
    labels = rng.integers(0, n_grades, size=qptr[-1]).astype(np.int8)
    labels[qptr[9] : qptr[10]] = 0  # nobody clicks under "perfect"; everything under "poison"
    labels[qptr[10] : qptr[11]] = n_grades - 1
    return QuerySet(features, labels, qptr, np.array([f"q{i}" for i in range(len(sizes))]))


def make_ctx(train: QuerySet, n_grades: int, ranker: dict | None = None, **params) -> RunContext:
    raw = {"federation": {"protocol": "fpdgd", "params": params}, "ranker": ranker or {}}
    cfg = validate(raw, "test")
    return RunContext(cfg, 0, Datasets(train, train, n_grades), None, Probe(), lambda *a, **k: None)


class Shown:
    """A probe that keeps the nDCG of every ranking shown, in order."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def displayed(self, ndcg_value: float, *_where) -> None:
        self.values.append(ndcg_value)


def learner(ctx, queries, seed, model, mu=0.0):
    """An FPDGD client's PDGD learner with its own probe (to compare what its users were
    shown); ``mu``: FedProx's proximal weight."""
    p = ctx.params
    clip = (p.clip_bound, p.clip_order) if p.dp else None
    rng = np.random.default_rng(seed)
    lrn = pdgd_learner.PDGDLearner(ctx, queries, rng, click_model=model, lr=p.lr, clip=clip, mu=mu)
    lrn.users.probe = Shown()
    lrn.users.issued = []
    return lrn


def random_cases(train: QuerySet, n_grades: int, n: int, seed: int):
    """(queries, steps, start weights, click model) of many learners, in every regime."""
    rng = np.random.default_rng(seed)
    models = [cascade(m, n_grades) for m in ("perfect", "navigational", "informational", "poison")]
    out = []
    for j in range(n):
        if j % 7 == 0:  # only the no-click / all-click / tiny queries
            queries = np.array([0, 1, 2, 9, 10])
        else:
            queries = rng.choice(train.n_queries, size=int(rng.integers(1, 25)), replace=False)
        scale = rng.choice([0.0, 0.1, 1.0, 30.0, 300.0, 1e4])  # up to extreme score spreads
        out.append(
            (
                queries,
                int(rng.integers(0, 6)),
                rng.normal(size=N_FEATURES) * scale,
                models[j % len(models)],
            )
        )
    return out


@pytest.mark.parametrize("alone", [False, True])  # True: batches of one (staggered arrivals)
@pytest.mark.parametrize(
    ("n_grades", "dp", "lr", "norm"),
    [
        (3, False, 0.1, "l2"),
        (5, False, 1.0, "l2"),
        (3, True, 0.5, "l2"),
        (5, True, 0.1, "l2"),
        (3, True, 0.5, "l1"),
    ],
)
def test_batch_equals_the_sequential_learner_draw_for_draw(n_grades, dp, lr, norm, alone):
    train = make_queryset(n_grades)
    ctx = make_ctx(train, n_grades, dp=dp, lr=lr, sensitivity=2.0, clip_norm=norm)
    cases = random_cases(train, n_grades, 120, seed=n_grades + 10 * dp)
    seq = [learner(ctx, q, 1000 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    bat = [learner(ctx, q, 1000 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    expected = [lrn.train(start, n) for lrn, (_, n, start, _) in zip(seq, cases, strict=True)]
    jobs = [lrn.job(start, n) for lrn, (_, n, start, _) in zip(bat, cases, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # extreme spreads are handled, not warned about
        if alone:
            each = [train_linear_batch(train, [job]) for job in jobs]
            width = max(r.queries.shape[1] for r in each)
            res = pdgd_batch.BatchResult(
                np.concatenate([r.weights for r in each]),
                np.array(
                    [
                        np.pad(r.queries[0], (0, width - r.queries.shape[1]), constant_values=-1)
                        for r in each
                    ]
                ),
                np.array(
                    [
                        np.pad(r.ndcg[0], (0, width - r.ndcg.shape[1]), constant_values=np.nan)
                        for r in each
                    ]
                ),
            )
        else:
            res = train_linear_batch(train, jobs)

    moved = 0
    for j, (s, b, (_, n, start, _)) in enumerate(zip(seq, bat, cases, strict=True)):
        # the same draws: both generators end in the same state
        assert s.rng.bit_generator.state == b.rng.bit_generator.state, j
        np.testing.assert_allclose(res.weights[j], expected[j], rtol=1e-9, atol=1e-12)
        assert res.queries[j, :n].tolist() == s.users.issued and (res.queries[j, n:] == -1).all()
        # what the users were shown scores the same
        np.testing.assert_allclose(res.ndcg[j, :n], s.users.probe.values, rtol=1e-12, atol=1e-15)
        assert np.isnan(res.ndcg[j, n:]).all()
        if dp:  # clipped to Delta / 2 in the scenario's norm after every step that moved
            order = 1 if norm == "l1" else 2
            bound = max(1.0, np.linalg.norm(start, ord=order))
            assert np.linalg.norm(res.weights[j], ord=order) <= bound + 1e-9
        moved += not np.array_equal(res.weights[j], start)
    assert moved > len(cases) // 3  # many learned something (extreme spreads give ~0 weights)


@pytest.mark.parametrize("chunk", [None, 7])  # 7: the batch goes to the kernel in chunks
def test_batched_serving_shows_what_serve_shows_draw_for_draw(monkeypatch, chunk):
    """Centralised PDGD's loggers: ``serve_linear_batch`` shows the rankings, sees the clicks
    and reports the nDCG that ``PDGDLearner.serve`` one query at a time does, from the same
    draws, and leaves the weights as they were; no-click, all-click and short lists included."""
    if chunk:
        monkeypatch.setattr(pdgd_batch, "CHUNK", chunk)
    train = make_queryset(3)
    ctx = make_ctx(train, 3)
    cases = random_cases(train, 3, 40, seed=5)
    seq = [learner(ctx, q, 50 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    bat = [learner(ctx, q, 50 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    expected = []
    for lrn, (_, n, start, _) in zip(seq, cases, strict=True):
        lrn.ranker.set_params(start)
        expected.append(run(lrn.show(n)))  # no pool: one query at a time
    jobs = [
        PDGDJob(start, q, n, lrn.rng, m, 0.1)  # a serving job's lr is not used
        for lrn, (q, n, start, m) in zip(bat, cases, strict=True)
    ]
    res = pdgd_batch.serve_linear_batch(train, jobs)
    shown = 0
    for j, (s, (_, n, start, _), (queries, rankings, clicks)) in enumerate(
        zip(seq, cases, expected, strict=True)
    ):
        assert s.rng.bit_generator.state == bat[j].rng.bit_generator.state, j
        assert res.queries[j, :n].tolist() == queries.tolist()
        assert res.rankings[j, :n].tolist() == rankings.tolist(), j
        assert res.clicks[j, :n].tolist() == clicks.tolist(), j
        assert (res.rankings[j, n:] == -1).all() and not res.clicks[j, n:].any()
        np.testing.assert_allclose(res.ndcg[j, :n], s.users.probe.values, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(res.weights[j], start)
        shown += int(clicks.any(axis=1).sum())
    assert shown > 10  # clicked lists (with gradients a learner would step on) were served


@pytest.mark.parametrize("hidden", [1, 16])
@pytest.mark.parametrize(("n_grades", "dp", "lr"), [(3, False, 0.1), (5, True, 0.5)])
def test_mlp_batch_equals_the_sequential_mlp_learner(n_grades, dp, lr, hidden):
    train = make_queryset(n_grades, seed=2)
    ctx = make_ctx(train, n_grades, {"kind": "mlp", "hidden": [hidden]}, dp=dp, lr=lr)
    cases = random_cases(train, n_grades, 60, seed=5 + hidden)
    init = np.random.default_rng(hidden)
    n_params = N_FEATURES * hidden + 2 * hidden
    starts = [init.normal(size=n_params) * init.choice([0.01, 0.3, 1.0, 5.0]) for _ in cases]
    seq = [learner(ctx, q, 500 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    bat = [learner(ctx, q, 500 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    assert pdgd_learner.batch_kind(bat[0].ranker) == ("mlp", hidden)
    expected = [lrn.train(w, n) for lrn, w, (_, n, _, _) in zip(seq, starts, cases, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = train_mlp_batch(
            train,
            [lrn.job(w, n) for lrn, w, (_, n, _, _) in zip(bat, starts, cases, strict=True)],
            hidden,
        )
    moved = 0
    for j, (s, b, w, (_, n, _, _)) in enumerate(zip(seq, bat, starts, cases, strict=True)):
        assert s.rng.bit_generator.state == b.rng.bit_generator.state, j
        np.testing.assert_allclose(res.weights[j], expected[j], rtol=1e-9, atol=1e-12)
        assert res.queries[j, :n].tolist() == s.users.issued
        np.testing.assert_allclose(res.ndcg[j, :n], s.users.probe.values, rtol=1e-12, atol=1e-15)
        moved += not np.array_equal(res.weights[j], w)
    assert moved > len(cases) // 3
    two_layers = make_ctx(train, 3, {"kind": "mlp", "hidden": [4, 4]}).new_ranker()
    deeper = pdgd_learner.batch_kind(two_layers)
    assert deeper is None  # two hidden layers: one query at a time
    with pytest.raises(ValueError, match="MLP with 16 hidden"):
        train_mlp_batch(train, [bat[0].job(np.zeros(5), 1)], 16)


@pytest.mark.parametrize("hidden", [0, 5])  # 0: linear rankers
@pytest.mark.parametrize(
    ("mu", "dp", "norm", "lr"),
    [
        (0.1, False, "l2", 0.1),
        (1.0, True, "l2", 0.5),
        (5.0, True, "l1", 0.1),
        (0.7, True, "l2", 1.0),
        (2.0, False, "l2", 0.05),
    ],
)
def test_fedprox_batch_equals_the_sequential_learner(mu, dp, norm, lr, hidden):
    """FedProx (mu > 0) on the batched path: every step also pulls back to the start weights,
    a query without a click still takes that step and the DP clipping (either norm), as
    ``PDGDLearner.train`` does: the same draws, nDCG and weights up to float rounding."""
    n_grades = 5 if hidden else 3
    train = make_queryset(n_grades, seed=6)
    ranker = {"kind": "mlp", "hidden": [hidden]} if hidden else None
    ctx = make_ctx(train, n_grades, ranker, dp=dp, lr=lr, sensitivity=3.0, clip_norm=norm)
    cases = random_cases(train, n_grades, 70, seed=int(10 * mu) + hidden)
    init = np.random.default_rng(int(mu * 10))
    n_params = N_FEATURES * hidden + 2 * hidden if hidden else N_FEATURES
    starts = [init.normal(size=n_params) * init.choice([0.01, 0.3, 1.0, 5.0]) for _ in cases]
    seq = [learner(ctx, q, 900 + j, m, mu) for j, (q, _, _, m) in enumerate(cases)]
    bat = [learner(ctx, q, 900 + j, m, mu) for j, (q, _, _, m) in enumerate(cases)]
    assert all(b.batched for b in bat)
    steps = [n + 3 for _, n, _, _ in cases]  # 3 to 8 steps: the proximal pull accumulates
    expected = [lrn.train(w, n) for lrn, w, n in zip(seq, starts, steps, strict=True)]
    jobs = [lrn.job(w, n) for lrn, w, n in zip(bat, starts, steps, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = train_mlp_batch(train, jobs, hidden) if hidden else train_linear_batch(train, jobs)
    plain = [lrn.job(w, n) for lrn, w, n in zip(
        [learner(ctx, q, 900 + j, m) for j, (q, _, _, m) in enumerate(cases)], starts, steps,
        strict=True,
    )]  # fmt: skip
    without = train_mlp_batch(train, plain, hidden) if hidden else train_linear_batch(train, plain)
    differs = 0
    for j, (s, b, n) in enumerate(zip(seq, bat, steps, strict=True)):
        assert s.rng.bit_generator.state == b.rng.bit_generator.state, j
        np.testing.assert_allclose(res.weights[j], expected[j], rtol=1e-9, atol=1e-12)
        assert res.queries[j, :n].tolist() == s.users.issued
        np.testing.assert_allclose(res.ndcg[j, :n], s.users.probe.values, rtol=1e-12, atol=1e-15)
        differs += not np.allclose(res.weights[j], without.weights[j], rtol=1e-6, atol=1e-9)
    assert differs > len(cases) // 3  # the proximal term changed what was learned


def test_fedprox_steps_on_queries_without_clicks():
    """A query nobody clicks: plain PDGD takes no step (the weights stay, unclipped), FedProx
    still takes its proximal step and the DP clipping after it."""
    train = make_queryset(3)
    ctx = make_ctx(train, 3, lr=0.5, dp=True, sensitivity=2.0)
    start = np.full(N_FEATURES, 3.0)  # outside the clip ball of radius 1
    nobody = cascade("perfect", 3)  # query 9 is all grade 0: no clicks
    plain = learner(ctx, np.array([9]), 1, nobody)
    res = train_linear_batch(train, [plain.job(start, 3)])
    assert np.array_equal(res.weights[0], start)  # no click, no step, no clipping
    prox = learner(ctx, np.array([9]), 1, nobody, mu=0.5)
    res = train_linear_batch(train, [prox.job(start, 3)])
    ref = learner(ctx, np.array([9]), 1, nobody, mu=0.5).train(start, 3)
    np.testing.assert_allclose(res.weights[0], ref, rtol=1e-12)
    assert np.linalg.norm(res.weights[0]) <= 1.0 + 1e-12  # a step was taken: it was clipped


def test_gradient_ascent_batched_equals_the_sequential_learner_and_reverses_descent():
    """PGA's unlearning steps (``ascend``) on the batched path: the one-query learner's draws
    and weights up to float rounding; from the same draws a single step goes exactly the other
    way from a descent step."""
    train = make_queryset(3, seed=8)
    ctx = make_ctx(train, 3, lr=0.3)
    cases = random_cases(train, 3, 30, seed=8)
    start = np.random.default_rng(8).normal(size=N_FEATURES)
    seq = [learner(ctx, q, 70 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    bat = [learner(ctx, q, 70 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    steps = [n + 2 for _, n, _, _ in cases]
    expected = [lrn.train(start, n, ascend=True) for lrn, n in zip(seq, steps, strict=True)]
    res = train_linear_batch(
        train, [b.job(start, n, ascend=True) for b, n in zip(bat, steps, strict=True)]
    )
    for j, s in enumerate(seq):
        assert s.rng.bit_generator.state == bat[j].rng.bit_generator.state, j
        np.testing.assert_allclose(res.weights[j], expected[j], rtol=1e-9, atol=1e-12)
    q, _, _, m = cases[0]
    up = learner(ctx, q, 5, m).train(start, 1, ascend=True)
    down = learner(ctx, q, 5, m).train(start, 1)
    np.testing.assert_allclose(up - start, start - down, rtol=1e-12, atol=1e-15)


def test_clicks_regimes_no_click_all_click_and_short_lists():
    train = make_queryset(3)
    ctx = make_ctx(train, 3, lr=1.0)
    start = np.ones(N_FEATURES)
    # perfect users never click grade 0 (query 9): no update at all
    lrn = learner(ctx, np.array([9]), 1, cascade("perfect", 3))
    res = train_linear_batch(train, [lrn.job(start, 3)])
    assert np.array_equal(res.weights[0], start) and res.ndcg[0].tolist() == [0.0] * 3
    # poison users click every grade-0 document without stopping: no unclicked document, no pair
    lrn = learner(ctx, np.array([9]), 1, cascade("poison", 3))
    assert np.array_equal(train_linear_batch(train, [lrn.job(start, 3)]).weights[0], start)
    # a 2-document query: one pair at most; perfect users click the relevant one only
    lrn = learner(ctx, np.array([2]), 3, cascade("perfect", 3))
    res = train_linear_batch(train, [lrn.job(np.zeros(N_FEATURES), 4)])
    s = learner(ctx, np.array([2]), 3, cascade("perfect", 3))
    np.testing.assert_allclose(res.weights[0], s.train(np.zeros(N_FEATURES), 4), rtol=1e-12)


@pytest.mark.parametrize("n_jobs", [1, 2, 3, 4])
def test_small_batches_agree_with_the_learner(n_jobs):
    train = make_queryset(5, seed=1)
    ctx = make_ctx(train, 5, dp=True, sensitivity=4.0, lr=0.5)
    cases = random_cases(train, 5, n_jobs, seed=11)
    bat = [learner(ctx, q, 7 + j, m) for j, (q, _, _, m) in enumerate(cases)]
    res = train_linear_batch(
        train, [b.job(w, n) for b, (_, n, w, _) in zip(bat, cases, strict=True)]
    )
    for j, (q, n, w, m) in enumerate(cases):
        s = learner(ctx, q, 7 + j, m)
        np.testing.assert_allclose(res.weights[j], s.train(w, n), rtol=1e-9, atol=1e-12)
        assert res.ndcg[j, :n].tolist() == s.users.probe.values
        assert res.queries[j, :n].tolist() == s.users.issued
        assert s.rng.bit_generator.state == bat[j].rng.bit_generator.state


def test_a_job_does_not_depend_on_its_batch():
    train = make_queryset(5, seed=3)
    ctx = make_ctx(train, 5)
    cases = random_cases(train, 5, 40, seed=7)

    def jobs():
        return [learner(ctx, q, 50 + j, m).job(w, n) for j, (q, n, w, m) in enumerate(cases)]

    together = train_linear_batch(train, jobs())
    alone = [train_linear_batch(train, [job]) for job in jobs()]
    for j, r in enumerate(alone):
        np.testing.assert_allclose(together.weights[j], r.weights[0], rtol=1e-12, atol=1e-14)
        steps = cases[j][1]
        np.testing.assert_allclose(together.ndcg[j, :steps], r.ndcg[0, :steps], rtol=1e-12)


@pytest.mark.parametrize("hidden", [0, 3])
def test_batches_run_in_chunks_give_the_same_results_bit_for_bit(monkeypatch, hidden):
    """Large batches run CHUNK jobs per kernel call (bounded buffers): the same weights,
    queries and nDCGs, also when jobs in different chunks share one generator."""
    train = make_queryset(5, seed=4)
    cases = random_cases(train, 5, 23, seed=9)
    model_size = N_FEATURES * hidden + 2 * hidden if hidden else N_FEATURES

    def result():
        gens = [np.random.default_rng(j // 2) for j in range(len(cases))]  # pairs share one
        start = np.random.default_rng(1)
        jobs = [
            PDGDJob(start.normal(size=model_size) * 0.1, q, n, gens[j], m, 0.1)
            for j, (q, n, _, m) in enumerate(cases)
        ]
        run = train_mlp_batch(train, jobs, hidden) if hidden else train_linear_batch(train, jobs)
        return run, [g.bit_generator.state for g in gens]

    whole, states = result()
    monkeypatch.setattr(pdgd_batch, "CHUNK", 5)
    chunked, chunked_states = result()
    assert np.array_equal(chunked.weights, whole.weights)
    assert np.array_equal(chunked.queries, whole.queries)
    assert np.array_equal(chunked.ndcg, whole.ndcg, equal_nan=True)
    assert chunked_states == states


def test_empty_batch_and_bad_input():
    train = make_queryset(3)
    res = train_linear_batch(train, [])
    assert res.weights.shape == (0, N_FEATURES) and res.ndcg.shape == (0, 0)
    rng = np.random.default_rng(0)
    job = PDGDJob(np.zeros(N_FEATURES + 1), np.arange(3), 1, rng, cascade("perfect", 3), 0.1)
    with pytest.raises(ValueError, match="weights"):
        train_linear_batch(train, [job])


def test_batched_pdgd_learns_on_real_data(mq2008_dir):
    from foltr_async.ltr.data import load_fold
    from foltr_async.ltr.metrics import mean_ndcg

    splits = load_fold(mq2008_dir)
    train, test = splits["train"], splits["test"]
    model = cascade("navigational", 3)
    rng = np.random.default_rng(0)
    w = np.zeros(train.n_features)
    for _ in range(40):  # 40 rounds of 20 clients x 5 queries, FedAvg of the local weights
        jobs = [
            PDGDJob(w, rng.choice(train.n_queries, 30), 5, np.random.default_rng(seed), model, 0.1)
            for seed in rng.integers(2**32, size=20)
        ]
        w = train_linear_batch(train, jobs).weights.mean(axis=0)
    assert mean_ndcg(test.features @ w, test) > mean_ndcg(np.zeros(test.n_docs), test) + 0.05


def scenario(
    data_dir,
    params: dict | None = None,
    ranker: dict | None = None,
    network: dict | None = None,
    protocol: str = "fpdgd",
) -> dict:
    raw = {
        "dataset": {"path": str(data_dir)},
        "clicks": {"model": "informational"},
        "federation": {
            "protocol": protocol,
            "clients": 6,
            "queries_per_client": 3,
            "rounds": 6,
            "params": params or {},
        },
        "evaluation": {"every": 3},
        "ranker": ranker or {},
        "network": network or {},
    }
    return validate(raw, "test")


def simulate(cfg, batched: bool, monkeypatch):
    if not batched:
        monkeypatch.setattr(pdgd_learner, "train_pool", lambda ctx: None)
    sim = Simulation(cfg, 3, Observer())
    result = run(sim.run())
    monkeypatch.undo()
    return result, sim


@pytest.mark.parametrize(
    ("dp", "staggered", "ranker"),
    [
        (False, False, None),
        (True, False, None),
        (False, True, None),
        (False, False, {"kind": "mlp", "hidden": [16]}),
        (True, True, {"kind": "mlp", "hidden": [16]}),
    ],
)
def test_fpdgd_run_is_the_same_batched_or_one_client_at_a_time(
    mq2008_dir, monkeypatch, dp, staggered, ranker
):
    # staggered: lognormal latencies, so models arrive one by one and batches are tiny
    net = {"latency": {"kind": "lognormal", "median": 1.0, "sigma": 0.5}} if staggered else None
    cfg = scenario(mq2008_dir, {"dp": dp}, ranker, network=net)
    a, sim = simulate(cfg, True, monkeypatch)
    b, _ = simulate(cfg, False, monkeypatch)
    pool = sim.ctx.shared("fpdgd.train_pool", lambda: None)
    if staggered:
        assert pool.jobs == 6 * 6 and pool.largest < 3
    else:
        assert pool.batches == 6 and pool.largest == 6  # zero latency: one batch per round
    np.testing.assert_allclose(a["offline"]["ndcg@10"], b["offline"]["ndcg@10"], rtol=1e-9)
    assert a["online"]["interactions"] == b["online"]["interactions"] == 6 * 6 * 3
    assert a["online"]["ndcg@10_discounted"] == pytest.approx(
        b["online"]["ndcg@10_discounted"], rel=1e-12
    )


@pytest.mark.parametrize("staggered", [False, True])
def test_centralised_pdgd_run_is_the_same_with_batched_serving(mq2008_dir, monkeypatch, staggered):
    """Centralised PDGD's clients show their rankings through the show pool (one compiled pass
    for every client of an instant) or one query at a time: the same run, bit for bit."""
    net = {"latency": {"kind": "lognormal", "median": 1.0, "sigma": 0.5}} if staggered else None
    cfg = scenario(mq2008_dir, network=net, protocol="pdgd_central")
    a, sim = simulate(cfg, True, monkeypatch)
    monkeypatch.setattr(pdgd_learner, "show_pool", lambda ctx: None)
    b, _ = simulate(cfg, True, monkeypatch)
    pool = sim.ctx.shared("pdgd.show_pool", lambda: None)
    assert pool.jobs == 6 * 6
    assert pool.largest < 3 if staggered else pool.batches == 6 and pool.largest == 6
    assert a["offline"] == b["offline"] and a["online"] == b["online"]
    assert a["online"]["interactions"] == 6 * 6 * 3
    assert a["offline"]["ndcg@10"][-1] != a["offline"]["ndcg@10"][0]  # the server learned


def test_compute_time_delays_replies_in_simulated_time(mq2008_dir, monkeypatch):
    base, _ = simulate(scenario(mq2008_dir), True, monkeypatch)
    slow = scenario(mq2008_dir, {"compute_time": 2.5})
    batched, _ = simulate(slow, True, monkeypatch)
    one_by_one, _ = simulate(slow, False, monkeypatch)
    mlp_cfg = scenario(mq2008_dir, {"compute_time": 2.5}, {"kind": "mlp", "hidden": [4]})
    mlp, _ = simulate(mlp_cfg, True, monkeypatch)
    extra = 6 * 3 * 2.5  # rounds x queries per client x seconds per interaction
    for r in (batched, one_by_one, mlp):
        assert r["sim_s"] == pytest.approx(base["sim_s"] + extra)
    assert batched["offline"] == base["offline"]


def logged_round(train: QuerySet, weights: np.ndarray, n: int, seed: int):
    """``n`` interactions as centralised PDGD's clients log them: rankings sampled from
    ``weights``' scores, cascade clicks, -1 padding lists shorter than 10."""
    from foltr_async.ltr.pdgd import sample_ranking

    rng = np.random.default_rng(seed)
    model = cascade("informational", 3)
    sizes = np.diff(train.qptr)
    queries = rng.choice(np.flatnonzero(sizes > 0), n)
    rankings = np.full((n, 10), -1)
    clicks = np.zeros((n, 10), dtype=bool)
    for t, q in enumerate(queries):
        features = train.features[train.doc_range(q)]
        ranking = sample_ranking(features @ weights, 10, rng)
        rankings[t, : ranking.size] = ranking
        clicks[t, : ranking.size] = model.simulate(train.labels[train.doc_range(q)][ranking], rng)
    return queries, rankings, clicks


@pytest.mark.parametrize("every", [0, 1, 3])
def test_logged_pdgd_equals_the_one_query_at_a_time_reference(every):
    """Centralised PDGD's server step in one compiled call is the per-interaction numpy PDGD
    (``pdgd.pdgd_gradient``: BLAS scores, numpy pair weights) up to float rounding, whatever the
    step schedule; no-click and short lists included."""
    from foltr_async.ltr.pdgd import pdgd_gradient
    from foltr_async.ltr.rankers import LinearRanker

    train = make_queryset(3)
    start = np.random.default_rng(2).normal(size=N_FEATURES)
    queries, rankings, clicks = logged_round(train, start, 60, 3)
    assert (~clicks.any(axis=1)).any() and (rankings < 0).any()
    ranker = LinearRanker(N_FEATURES)
    ranker.set_params(start)
    pending = np.zeros(N_FEATURES)
    for t, (q, r, c) in enumerate(zip(queries, rankings, clicks, strict=True), 1):
        f = train.features[train.doc_range(q)]
        pending += pdgd_gradient(ranker, f, r[r >= 0], c[r >= 0], ranker.score(f))
        if every and t % every == 0:
            ranker.set_params(ranker.get_params() + 0.1 * pending)
            pending[:] = 0.0
    expected = ranker.get_params() + 0.1 * 0.5 * pending
    got = pdgd_batch.learn_logged_linear(train, start, queries, rankings, clicks, 0.1, every, 0.5)
    assert not np.array_equal(got, start)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_logged_pdgd_rejects_logs_outside_their_queries():
    """Offsets beyond a query's documents, or -1 before a shown one, never reach the kernel
    (which does not check bounds)."""
    train = make_queryset(3)
    queries, rankings, clicks = logged_round(train, np.zeros(N_FEATURES), 4, 0)
    w = np.zeros(N_FEATURES)
    for bad in (np.diff(train.qptr)[queries[0]], -2):
        wrong = rankings.copy()
        wrong[0, 0] = bad
        with pytest.raises(ValueError, match="offsets in their query"):
            pdgd_batch.learn_logged_linear(train, w, queries, wrong, clicks, 0.1)
    gap = rankings.copy()
    gap[0, 0] = -1
    with pytest.raises(ValueError, match="-1 only at the end"):
        pdgd_batch.learn_logged_linear(train, w, queries, gap, clicks, 0.1)
    with pytest.raises(ValueError, match="queries must be in"):
        pdgd_batch.learn_logged_linear(train, w, queries + train.n_queries, rankings, clicks, 0.1)


@pytest.mark.parametrize(
    ("params", "ranker", "no_pool", "path"),
    [
        ({}, None, False, "batched"),
        ({"dp": True}, {"kind": "mlp", "hidden": [4]}, False, "batched"),
        ({}, None, True, "one query at a time: no batched pool in this run"),
        (
            {},
            {"kind": "mlp", "hidden": [4], "activation": "relu"},
            False,
            "one query at a time: a ranker other than linear or an MLP of one tanh hidden layer",
        ),
    ],
)
def test_the_learner_path_is_named_in_results_and_console(
    mq2008_dir, monkeypatch, params, ranker, no_pool, path
):
    """Which path the PDGD learners trained by, and why when not batched: a repeat's
    ``learner_interactions`` (interactions per path), the variant summary's ``learner.path``,
    the repeat's console lines."""
    import io

    import structlog.testing

    from foltr_async.observe.console import PlainReporter
    from foltr_async.observe.progress import ProgressLines
    from foltr_async.observe.results import learner_path, summarise_variant

    result, _ = simulate(scenario(mq2008_dir, params, ranker), not no_pool, monkeypatch)
    counts = result["learner_interactions"]
    assert set(counts) == set(pdgd_learner.PATHS)
    assert counts[path] == 6 * 6 * 3 and sum(counts.values()) == 6 * 6 * 3
    assert learner_path(counts) == path
    assert summarise_variant([result, result], "ndcg@10")["learner"] == {"path": path}
    out = io.StringIO()
    lines = ProgressLines(out)
    lines.run_started({"variants": ["v"], "rounds": {"v": 6}, "metric": "ndcg@10"})
    lines.repeat_done("v", 0, result)
    assert f"learner {path};" in out.getvalue()
    with structlog.testing.capture_logs() as logged:
        PlainReporter().repeat_done("v", 0, result)
    assert logged[0]["learner"] == path


def test_mixed_learner_paths_are_each_named():
    from foltr_async.observe.results import learner_path

    assert learner_path({}) is None and learner_path({"batched": 0}) is None
    mixed = learner_path({"batched": 90, "one query at a time: shared data": 10, "x": 0})
    assert mixed == (
        "mixed: batched (90 interactions); one query at a time: shared data (10 interactions)"
    )


def user_models(n_grades: int) -> list:
    """Every kind of users the batched path draws for: cascades (the poison model too),
    position-based users of several examination exponents, and mixtures of both."""
    from foltr_async.ltr.clicks import MixtureClickModel, click_model

    cascades = [cascade(m, n_grades) for m in ("perfect", "navigational", "poison")]
    pbms = [click_model("pbm", n_grades, gamma_user=g) for g in (0.5, 1.0, 2.0)]
    pbms.append(click_model("pbm", n_grades, relevant=[0, 1], noise=0.3))
    return [
        *cascades,
        *pbms,
        MixtureClickModel((cascades[1], pbms[0])),
        MixtureClickModel(tuple(cascades)),
        MixtureClickModel((pbms[2],)),  # a mixture of one: integers(1) draws nothing
    ]


def assert_same_as_train(seq, bat, weights, expected):
    """Learners ``bat``, batched, ended at ``weights`` where ``train`` took ``seq``: the same
    draws, queries, shown nDCG, replay positions and weights up to float rounding."""
    for j, (s, b) in enumerate(zip(seq, bat, strict=True)):
        assert s.rng.bit_generator.state == b.rng.bit_generator.state, j
        np.testing.assert_allclose(weights[j], expected[j], rtol=1e-9, atol=1e-12)
        assert b.users.issued == s.users.issued, j
        assert b.users.probe.values == pytest.approx(s.users.probe.values, rel=1e-12, abs=1e-15)
        assert b.users.played == s.users.played, j


def run_pool_batch(bat, starts, steps):
    """The pool's batch function on these learners' jobs (recording as a run would)."""
    jobs = [(b, b.job(w, n)) for b, w, n in zip(bat, starts, steps, strict=True)]
    return pdgd_learner._train_jobs(jobs)


@pytest.mark.parametrize("hidden", [0, 3])
@pytest.mark.parametrize("n_grades", [3, 5])
def test_every_click_model_batched_equals_the_sequential_learner(n_grades, hidden):
    """Position-based users, the poison model and mixtures (a model drawn per interaction, the
    chosen one's uniforms after it) on the batched path: what ``train`` shows, sees and learns,
    draw for draw, with DP clipping and FedProx mixed in."""
    train = make_queryset(n_grades, seed=8)
    ranker = {"kind": "mlp", "hidden": [hidden]} if hidden else None
    ctx = make_ctx(train, n_grades, ranker, dp=True, lr=0.5, sensitivity=6.0)
    models = user_models(n_grades)
    cases = random_cases(train, n_grades, 90, seed=n_grades + hidden)
    init = np.random.default_rng(3)
    n_params = N_FEATURES * hidden + 2 * hidden if hidden else N_FEATURES
    starts = [init.normal(size=n_params) * init.choice([0.01, 0.3, 1.0, 5.0]) for _ in cases]
    steps = [n + 2 for _, n, _, _ in cases]

    def make(j, q):
        return learner(ctx, q, 300 + j, models[j % len(models)], mu=[0.0, 0.5][j % 2])

    seq = [make(j, q) for j, (q, _, _, _) in enumerate(cases)]
    bat = [make(j, q) for j, (q, _, _, _) in enumerate(cases)]
    assert all(b.batched for b in bat)
    expected = [s.train(w, n) for s, w, n in zip(seq, starts, steps, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = run_pool_batch(bat, starts, steps)
    assert_same_as_train(seq, bat, res, expected)
    clicked = sum(1 for b, w in zip(bat, starts, strict=True) if not np.array_equal(
        b.ranker.get_params(), w))  # fmt: skip
    assert clicked > len(cases) // 2


@pytest.mark.parametrize("hidden", [0, 4])
def test_replayed_logs_and_shared_data_batched_equal_the_sequential_learner(hidden):
    """A replayed log (its queries in order from where it stands, nothing drawn for them) and
    shared data (each step ``integers(own + shared) >= own`` picks the shared users, with
    their queries and click model; their rankings are not the client's users') on the
    batched path: what ``train`` does, draw for draw."""
    from foltr_async.protocols.users import Users

    train = make_queryset(5, seed=9)
    ranker = {"kind": "mlp", "hidden": [hidden]} if hidden else None
    ctx = make_ctx(train, 5, ranker, lr=0.3)
    models = user_models(5)
    cases = random_cases(train, 5, 60, seed=21 + hidden)
    init = np.random.default_rng(4)
    n_params = N_FEATURES * hidden + 2 * hidden if hidden else N_FEATURES
    starts = [init.normal(size=n_params) for _ in cases]
    steps = [n + 1 for _, n, _, _ in cases]

    def make(j, q):
        lrn = learner(ctx, q, 700 + j, models[j % len(models)], mu=[0.0, 0.2, 0.0][j % 3])
        users = lrn.users
        if j % 2:  # a replayed log with room for every step, some of it already played
            users.queries = np.resize(q, 3 * len(q) + 12)
            users.arrivals = np.arange(len(users.queries), dtype=np.float64)
            users.played = j % 4
        if j % 3:
            seen = Shown()
            lrn.shared_users = Users(train, np.array(q[: j % 5 + 1]), models[(j + 1) % 9],
                                     lrn.rng, seen, "shared")  # fmt: skip
            lrn.shared_users.issued = []
        return lrn

    seq = [make(j, q) for j, (q, _, _, _) in enumerate(cases)]
    bat = [make(j, q) for j, (q, _, _, _) in enumerate(cases)]
    assert all(b.batched for b in bat)
    expected = [s.train(w, n) for s, w, n in zip(seq, starts, steps, strict=True)]
    res = run_pool_batch(bat, starts, steps)
    assert_same_as_train(seq, bat, res, expected)
    shared_steps = 0
    for s, b in zip(seq, bat, strict=True):
        if s.shared_users is not None:
            assert b.shared_users.issued == s.shared_users.issued
            assert b.shared_users.probe.values == pytest.approx(s.shared_users.probe.values)
            shared_steps += len(s.shared_users.issued)
    assert shared_steps > 10
    other = make(1, cases[1][0])
    other.shared_users.train = make_queryset(5, seed=10)  # shared data in another set
    assert not other.batched and other.path.endswith("shared data in another training set")

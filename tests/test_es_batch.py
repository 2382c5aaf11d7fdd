"""Batched FOLtR-ES serving: the same rankings, clicks, metrics and model as one query at a time."""

import numpy as np
import pytest

import foltr_async.protocols.foltr_es as es
from foltr_async.ltr import serve_batch
from foltr_async.ltr.clicks import cascade
from foltr_async.ltr.metrics import dcg_at_k, ideal_dcg, maxrr
from foltr_async.ltr.serve_batch import serve_linear
from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import validate
from foltr_async.simulation import Simulation
from tests.test_pdgd_batch import N_FEATURES, make_queryset


@pytest.mark.parametrize("n_grades", [3, 5])
def test_serve_linear_equals_one_query_at_a_time(n_grades):
    """Exact equality on queries of 1 to 150 documents, tied (zero weights) and NaN scores."""
    train = make_queryset(n_grades, seed=n_grades)
    rng = np.random.default_rng(1)
    weights = rng.normal(size=(40, N_FEATURES)) * rng.choice([0.0, 1.0, 1e3], size=(40, 1))
    weights[7, 3] = np.nan
    for name in ("perfect", "navigational", "informational", "poison"):
        model = cascade(name, n_grades)
        queries = rng.choice(np.flatnonzero(np.diff(train.qptr)), size=300)  # (maxrr needs docs)
        which = rng.integers(len(weights), size=300)
        ideal = ideal_dcg(train, 10)
        expect = {"ndcg": [], "maxrr": [], "click_dcg": []}
        clicking, uniforms = np.random.default_rng(9), []
        drawing = np.random.default_rng(9)  # the same stream, drawn as the batch gets it
        for q, w in zip(queries.tolist(), which.tolist(), strict=True):
            scores = train.features[train.doc_range(q)] @ weights[w]
            ranking = np.argsort(-scores, kind="stable")[:10]
            labels = train.labels[train.doc_range(q)][ranking]
            clicks = model.simulate(labels, clicking)
            uniforms.append(drawing.random((2, ranking.size)))
            best = ideal[q]
            expect["ndcg"].append(float(dcg_at_k(labels, 10)) / best if best > 0 else 0.0)
            expect["maxrr"].append(maxrr(clicks, 10))
            expect["click_dcg"].append(dcg_at_k(clicks, 10))
        got = serve_linear(
            train, queries, weights, which, uniforms, model.p_click, model.p_stop, 10
        )
        for key, values in expect.items():
            assert getattr(got, key).tolist() == values, (name, key)


def test_stable_top_is_the_head_of_a_stable_argsort():
    rng = np.random.default_rng(3)
    keys = rng.integers(-3, 3, size=(300, 40)).astype(np.float64)  # many ties
    keys[rng.random(keys.shape) < 0.1] = np.inf
    keys[rng.random(keys.shape) < 0.05] = -0.0
    keys[:5] = 0.0
    for k in (1, 10, 39, 40, 50):
        got = serve_batch._stable_top(keys, k)
        assert np.array_equal(got, np.argsort(keys, axis=1, kind="stable")[:, :k]), k


def scenario(
    data_dir, params: dict | None = None, network: dict | None = None, ranker: dict | None = None
) -> dict:
    raw = {
        "ranker": ranker or {"kind": "linear"},
        "dataset": {"path": str(data_dir)},
        "clicks": {"model": "informational"},
        "federation": {
            "protocol": "foltr_es",
            "clients": 8,
            "queries_per_client": 5,
            "rounds": 6,
            "data": "shared",
            "params": {"sigma": 0.1, "lr": 0.05, **(params or {})},
        },
        "evaluation": {"every": 2},
        "network": network or {},
    }
    return validate(raw, "test")


def simulate(cfg, batched: bool, monkeypatch):
    if not batched:
        monkeypatch.setattr(es, "BatchPool", lambda fn: None)
    sim = Simulation(cfg, 3, Observer())
    result = run(sim.run())
    monkeypatch.undo()
    return result, sim


@pytest.mark.parametrize(
    ("params", "staggered"),
    [({}, False), ({"p": 0.7}, False), ({"metric": "dcg", "antithetic": False}, False),
     ({"p": 0.7}, True), ({"p": 0.7, "privatise": "mean"}, False),
     ({"p": 0.7, "ranker": {"kind": "mlp", "hidden": [10]}}, False),
     ({"ranker": {"kind": "mlp", "hidden": [10]}}, True)],
)  # fmt: skip
def test_foltr_es_run_is_equal_batched_or_one_query_at_a_time(
    mq2008_dir, monkeypatch, params, staggered
):
    # staggered: lognormal latencies, so models arrive one by one and batches are tiny
    net = {"latency": {"kind": "lognormal", "median": 1.0, "sigma": 0.5}} if staggered else None
    params = dict(params)
    cfg = scenario(mq2008_dir, params, net, params.pop("ranker", None))
    a, sim_a = simulate(cfg, True, monkeypatch)
    b, sim_b = simulate(cfg, False, monkeypatch)
    pool = sim_a.ctx.shared("foltr_es.serve_pool", lambda: None)
    if staggered:
        assert pool.jobs == 8 * 6 and pool.largest < 3
    else:
        assert pool.batches == 6 and pool.largest == 8  # zero latency: one batch per round
    assert np.array_equal(sim_a.proto.strategy.model, sim_b.proto.strategy.model)
    assert np.any(sim_a.proto.strategy.model != 0.0)
    for key in ("offline", "online", "messages"):
        assert a[key] == b[key], key


def test_groups_cover_the_rows_in_order_within_the_cell_budget():
    sizes = sorted(np.random.default_rng(0).integers(1, 1300, 1000).tolist())
    groups = serve_batch.size_groups(sizes, 10)
    assert groups[0][0] == 0 and groups[-1][1] == len(sizes)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
    budget = serve_batch._CHUNK_CELLS
    for lo, hi in groups:
        assert hi - lo == 1 or (hi - lo) * max(sizes[hi - 1], 10) <= budget
        assert hi == len(sizes) or (hi + 1 - lo) * max(sizes[hi], 10) > budget  # maximal
    assert serve_batch.size_groups([], 10) == [] and serve_batch.size_groups([10**7] * 2, 10) == [
        (0, 1),
        (1, 2),
    ]


def test_perturbations_drawn_together_equal_each_seeds_own_generator():
    """The batch's seeding (numpy's seed hashing for all seeds at once) gives every seed's
    ``PCG64(seed)`` normal draw bit for bit: one- and two-word seeds, the extremes."""
    rng = np.random.default_rng(4)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 - 2, *rng.integers(2**63 - 1, size=300).tolist()]
    seeds += rng.integers(2**32, size=50).tolist()
    got = es.perturbations(seeds, 46, 0.01)
    for seed, e in zip(seeds, got, strict=True):
        want = np.random.Generator(np.random.PCG64(seed)).normal(0.0, 0.01, 46)
        assert np.array_equal(e, want), seed
        assert not e.flags.writeable
    assert es.perturbation(seeds[5], 46, 0.01) is got[5]  # the server takes the drawn vector

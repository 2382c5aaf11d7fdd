"""The compiled PDGD kernel against numpy and the reference PDGD, over many seeds and shapes."""

import os

import numpy as np
import pytest

from foltr_async.ltr import pdgd_kernel
from foltr_async.ltr.clicks import CascadeModel, cascade
from foltr_async.ltr.metrics import dcg_at_k, ideal_dcg
from foltr_async.ltr.pdgd import pdgd_gradient, sample_ranking
from foltr_async.ltr.pdgd_batch import PDGDJob, train_linear_batch, train_mlp_batch
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import LinearRanker
from tests.test_pdgd_batch import make_queryset

BIT_GENERATORS = [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox]
BIT_GENERATORS.append(np.random.SFC64)


def numpy_draws(rng, owned, n_steps, sizes, k):
    """What the sequential path draws: query, Gumbel noise, click uniforms per step."""
    out = []
    for _ in range(n_steps):
        q = int(owned[rng.integers(len(owned))])
        n = int(sizes[q])
        out.append((q, rng.gumbel(size=n), rng.random((2, min(k, n))).ravel()))
    return out


@pytest.mark.parametrize("bit_generator", BIT_GENERATORS)
def test_kernel_draws_are_numpys_streams(bit_generator):
    sizes = np.concatenate(([0, 1, 3, 10, 11], np.random.default_rng(0).integers(0, 300, 60)))
    n_jobs = 300
    cases = []
    for seed in range(n_jobs):
        pick = np.random.default_rng(seed)
        n_owned = [1, 2, 3, 7, 65, 2**20 + 3][seed % 6]  # the last: Lemire rejections happen
        owned = pick.integers(0, sizes.size, n_owned)
        cases.append((seed, owned, int(pick.integers(0, 7)), [1, 3, 10, 400][seed % 4]))
    for k in (1, 3, 10, 400):
        jobs = [c for c in cases if c[3] == k]
        ref = [np.random.Generator(bit_generator(seed)) for seed, *_ in jobs]
        got = [np.random.Generator(bit_generator(seed)) for seed, *_ in jobs]
        for i, (a, b) in enumerate(zip(ref, got, strict=True)):
            if i % 3 == 1:  # leave half of a 64-bit draw buffered for the next 32-bit draw
                a.integers(5, dtype=np.int32)
                b.integers(5, dtype=np.int32)
        expected = [
            numpy_draws(r, owned, n, sizes, k)
            for r, (_, owned, n, _) in zip(ref, jobs, strict=True)
        ]
        owned_ptr = np.cumsum([0] + [len(o) for _, o, _, _ in jobs])
        n_jobs = len(jobs)
        none, each = np.zeros(0, dtype=np.int64), np.zeros(n_jobs + 1, dtype=np.int64)
        one_cascade = np.zeros(n_jobs, dtype=np.int64), np.arange(n_jobs + 1, dtype=np.int64)
        # users: queries at random, no shared data, one cascade model each
        grp = (np.full(n_jobs, -1, dtype=np.int64), none, each, *one_cascade, none, each)
        query, gptr, uptr, gumbel, uniform, ndcg, model_at, from_shared = pdgd_kernel.draw(
            pdgd_kernel.generator_pointers(got),
            np.concatenate([o for _, o, _, _ in jobs]),
            owned_ptr,
            np.array([n for _, _, n, _ in jobs], dtype=np.int64),
            sizes,
            k,
            False,  # every job its own generator: they draw in parallel
            (*grp, np.zeros(1, dtype=np.int64)),
        )
        assert np.isnan(ndcg).all() and ndcg.shape == query.shape
        assert not model_at.any() and not from_shared.any()
        for j, steps in enumerate(expected):
            assert (query[j, len(steps) :] == -1).all()
            for s, (q, g, u) in enumerate(steps):
                assert query[j, s] == q
                assert np.array_equal(gumbel[gptr[j, s] : gptr[j, s] + g.size], g)  # bitwise
                assert np.array_equal(uniform[uptr[j, s] : uptr[j, s] + u.size], u)
            np.testing.assert_equal(ref[j].bit_generator.state, got[j].bit_generator.state)


def one_hot_queryset(n_grades: int) -> QuerySet:
    """Every document its own feature: a weight update shows exactly which documents moved."""
    sizes = np.array([0, 1, 2, 4, 9, 10, 11, 25])
    qptr = np.concatenate(([0], np.cumsum(sizes)))
    rng = np.random.default_rng(n_grades)
    labels = rng.integers(0, n_grades, qptr[-1]).astype(np.int8)
    labels[qptr[4] : qptr[5]] = 0  # no relevant document
    features = np.eye(qptr[-1], dtype=np.float32)
    return QuerySet(features, labels, qptr, np.array([f"q{i}" for i in range(sizes.size)]))


def reference(train, job: PDGDJob, k: int):
    """The one-query-at-a-time PDGD of ``pdgd.py`` (LocalLearner.train at any ``k``)."""
    ranker = LinearRanker(train.n_features)
    ranker.set_params(job.weights)
    ideal = ideal_dcg(train, k)
    queries, shown = [], []
    for _ in range(job.n_steps):
        q = int(job.queries[job.rng.integers(len(job.queries))])
        features, labels = train.query(q)
        scores = ranker.score(features)
        ranking = sample_ranking(scores, k, job.rng)
        clicks = job.click_model.simulate(labels[ranking], job.rng)
        queries.append(q)
        shown.append(float(dcg_at_k(labels[ranking], k)) / ideal[q] if ideal[q] > 0 else 0.0)
        if clicks.any():
            theta = ranker.get_params() + job.lr * pdgd_gradient(
                ranker, features, ranking, clicks, scores
            )
            if job.clip is not None:
                norm = float(np.linalg.norm(theta))
                theta = theta if norm <= job.clip else theta * (job.clip / norm)
            ranker.set_params(theta)
    return ranker.get_params(), queries, shown


@pytest.mark.parametrize("k", [1, 3, 10, 30, 200])  # 200: nDCG sums of > 128 terms
@pytest.mark.parametrize("n_grades", [3, 5])
@pytest.mark.parametrize("data", ["random", "one_hot"])
def test_kernel_equals_the_reference_pdgd(k, n_grades, data):
    train = make_queryset(n_grades, seed=k) if data == "random" else one_hot_queryset(n_grades)
    names = ("perfect", "navigational", "informational", "poison")
    models = [cascade(m, n_grades) for m in names]
    # a model with more grades than the data has, one with fewer (labels clamp to its top)
    models.append(CascadeModel("wide", np.linspace(0.1, 0.9, 7), np.linspace(0.0, 0.6, 7)))
    models.append(CascadeModel("narrow", np.array([0.2, 0.9]), np.array([0.1, 0.5])))
    rng = np.random.default_rng(100 * k + n_grades)
    specs = []
    for j in range(150):
        queries = rng.choice(train.n_queries, size=int(rng.integers(1, 6)), replace=False)
        scale = rng.choice([0.0, 0.1, 1.0, 30.0, 1e3])
        specs.append(
            (
                rng.normal(size=train.n_features) * scale,
                queries,
                int(rng.integers(0, 5)),
                models[j % len(models)],
                float(rng.choice([0.0, 0.1, 2.0])),
                None if j % 3 else float(rng.choice([0.5, 5.0])),
            )
        )

    def jobs():
        return [
            PDGDJob(w, q, n, np.random.default_rng(5000 + j), m, lr, clip)
            for j, (w, q, n, m, lr, clip) in enumerate(specs)
        ]

    batch, alone = jobs(), jobs()
    res = train_linear_batch(train, batch, k)
    for j, job in enumerate(alone):
        weights, queries, shown = reference(train, job, k)
        n = job.n_steps
        assert res.queries[j, :n].tolist() == queries and (res.queries[j, n:] == -1).all()
        assert res.ndcg[j, :n].tolist() == shown  # bitwise: the same rankings, same sums
        assert np.isnan(res.ndcg[j, n:]).all()
        # the same clicks and pairs: with one-hot features any other pair moves other weights
        np.testing.assert_allclose(res.weights[j], weights, rtol=1e-9, atol=1e-12)
        assert batch[j].rng.bit_generator.state == job.rng.bit_generator.state


def test_degenerate_batches():
    train = make_queryset(3)
    model = cascade("informational", 3)
    start = np.arange(train.n_features, dtype=np.float64)
    # no steps at all: weights come back, no query issued, nothing drawn
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    res = train_linear_batch(train, [PDGDJob(start, np.arange(3), 0, rng, model, 0.1)] * 2)
    assert res.queries.shape == (2, 0) and res.ndcg.shape == (2, 0)
    assert np.array_equal(res.weights, [start, start]) and rng.bit_generator.state == before
    # a job with no queries may run no step; one that must draw raises (as integers(0) does)
    idle = PDGDJob(start, np.zeros(0, dtype=np.int64), 0, rng, model, 0.1)
    assert np.array_equal(train_linear_batch(train, [idle]).weights[0], start)
    with pytest.raises(ValueError, match="queries"):
        train_linear_batch(train, [PDGDJob(start, np.zeros(0), 1, rng, model, 0.1)])
    # only the empty query: nothing shown, nDCG 0, no update
    res = train_linear_batch(train, [PDGDJob(start, np.array([0]), 3, rng, model, 0.1)])
    assert res.ndcg.tolist() == [[0.0] * 3] and np.array_equal(res.weights[0], start)
    with pytest.raises(IndexError, match="query"):
        train_linear_batch(train, [PDGDJob(start, np.array([train.n_queries]), 1, rng, model, 0.1)])
    with pytest.raises(TypeError, match="cascade"):
        train_linear_batch(train, [PDGDJob(start, np.array([1]), 1, rng, object(), 0.1)])
    with pytest.raises(ValueError, match="k must"):
        train_linear_batch(train, [PDGDJob(start, np.array([1]), 1, rng, model, 0.1)], k=0)


def test_uncachable_functions_still_compile():
    # functions without a source file (here: exec) cannot be cached; they compile in memory
    namespace: dict = {}
    exec("def twice(x):\n    return 2 * x\n", namespace)
    assert pdgd_kernel.jit(namespace["twice"])(21) == 42


def run_small_elsewhere(code: str = "run_small", **env: str) -> list[float]:
    """``run_small`` (or another function of this module) in a fresh interpreter with extra
    environment variables."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import json\n"
        f"from tests.test_pdgd_kernel import {code}\n"
        f"print(json.dumps({code}().tolist()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_kernel_runs_as_python_under_numba_disable_jit():
    # NUMBA_DISABLE_JIT (debuggers, coverage) runs the same code uncompiled: the same result
    # up to rounding (uncompiled, np.exp / np.log1p of a scalar are numpy's own SIMD functions,
    # which differ from the C library's the compiled code calls in the last bit of ~5% of
    # arguments)
    np.testing.assert_allclose(
        run_small_elsewhere(NUMBA_DISABLE_JIT="1"), run_small(), rtol=1e-9, atol=1e-12
    )


def cache_hits() -> np.ndarray:
    """``run_small`` and ``run_threads_batch`` (serial and parallel kernels, two threads), then
    how many of the entry points' compiled versions came from numba's disk cache."""
    from foltr_async.ltr.threads import set_threads

    set_threads(2)
    run_small()
    run_threads_batch()
    kernels = [pdgd_kernel.train_linear, pdgd_kernel._train_linear_serial, pdgd_kernel.step]
    return np.array([sum(f.stats.cache_hits.values()) for f in kernels])


def test_the_compiled_kernel_is_cached_and_loads_from_the_cache(tmp_path):
    # the first process compiles into an empty cache, the second loads what it wrote, the
    # parallel kernels (numba's parallel=True) included
    expected = run_small().tolist()
    assert run_small_elsewhere(NUMBA_CACHE_DIR=str(tmp_path)) == expected
    cached = sorted(p.name for p in tmp_path.rglob("*.nbi"))
    assert any("_train_linear_serial-" in name for name in cached)
    assert run_small_elsewhere(NUMBA_CACHE_DIR=str(tmp_path)) == expected
    assert run_small_elsewhere("cache_hits", NUMBA_CACHE_DIR=str(tmp_path)) == [0, 1, 0]
    assert run_small_elsewhere("cache_hits", NUMBA_CACHE_DIR=str(tmp_path)) == [1, 1, 1]


def test_pairwise_sum_is_numpys():
    rng = np.random.default_rng(0)
    for n in [*range(0, 300), 511, 1000, 1024, 4099]:
        a = rng.normal(size=n) * rng.choice([1.0, 1e-9, 1e9], n)
        assert pdgd_kernel._pairwise_sum(a, n) == a.sum()


def run_small() -> np.ndarray:
    """A few jobs' weights and shown nDCG after three steps (compiled or not)."""
    train = make_queryset(5, seed=2)
    model = cascade("informational", 5)
    jobs = [
        PDGDJob(
            np.full(train.n_features, 0.3), np.arange(3, 12), 3, np.random.Generator(bg), model, 0.5
        )
        for bg in (np.random.PCG64(1), np.random.MT19937(2))
    ]
    res = train_linear_batch(train, jobs)
    return np.concatenate((res.weights.ravel(), res.ndcg.ravel()))


def test_prepare_loads_what_real_data_calls():
    from foltr_async.ltr.pdgd_batch import learn_logged_linear, prepare

    prepare()
    kernels = (
        pdgd_kernel.train_linear,
        pdgd_kernel.step,
        pdgd_kernel.draw,
        pdgd_kernel.logged_linear,
    )
    compiled = [len(f.signatures) for f in kernels]
    train = make_queryset(3)  # float32 features and int8 labels, as the loaders make
    job = PDGDJob(
        np.zeros(train.n_features),
        np.arange(4),
        2,
        np.random.default_rng(0),
        cascade("perfect", 3),
        0.1,
    )
    train_linear_batch(train, [job])
    shown = np.array([[1, 0, 2, -1], [0, -1, -1, -1]])
    lr, every, scale = 0.1, 0, 0.5  # as centralised PDGD's server passes them
    learn_logged_linear(train, job.weights, np.array([3, 4]), shown, shown == 0, lr, every, scale)
    assert [len(f.signatures) for f in kernels] == compiled


@pytest.mark.parametrize("seed", range(200))
def test_per_query_pair_weights_equal_the_reference_for_any_ranker(seed):
    """The one-query path (MLP rankers, PBM users, FedProx): the compiled pair weights are the
    reference's up to rounding, for short and long queries, score spreads up to thousands and
    every click pattern; through an MLP's grad the gradients agree too."""
    from foltr_async.ltr.pdgd import pair_weights
    from foltr_async.ltr.pdgd_batch import compiled_pair_weights
    from foltr_async.ltr.rankers import MLPRanker

    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 5, 10, 11, 40, 300]))
    spread = [0.01, 1.0, 30.0, 3000.0][seed % 4]
    scores = rng.normal(size=n) * spread
    ranking = sample_ranking(scores, 10, rng)
    clicks = rng.random(ranking.size) < [0.0, 0.2, 0.6, 1.0][seed // 4 % 4]
    got = pdgd_kernel.pair_weights(scores, ranking.astype(np.int64), clicks)
    want = pair_weights(scores, ranking, clicks)
    # to rounding of the largest weight (a document's weight sums its pairs': it may cancel);
    # a pair whose rho is below ~1e-15 is only accurate in absolute terms (pdgd_batch's doc)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max() + 1e-20)
    features = rng.normal(size=(n, 6))
    mlp = MLPRanker(6, [4], rng=np.random.default_rng(seed))
    mlp_scores = mlp.score(features)
    want = pdgd_gradient(mlp, features, ranking, clicks, mlp_scores)
    np.testing.assert_allclose(
        pdgd_gradient(mlp, features, ranking, clicks, mlp_scores, compiled_pair_weights),
        want,
        rtol=1e-9,
        atol=1e-9 * np.abs(want).max(initial=0) + 1e-20,
    )


def run_threads_batch() -> np.ndarray:
    """A batch of 64 linear and 16 MLP jobs (many queries each), weights and shown nDCG."""
    train = make_queryset(5, seed=3)
    model = cascade("informational", 5)
    rng = np.random.default_rng(7)

    def jobs(n_params: int, n: int, seed: int) -> list[PDGDJob]:
        return [
            PDGDJob(
                rng.normal(size=n_params) * 0.3,
                rng.choice(train.n_queries, 20, replace=False),
                int(rng.integers(1, 6)),
                np.random.default_rng([seed, j]),
                model,
                0.5,
            )
            for j in range(n)
        ]

    linear = train_linear_batch(train, jobs(train.n_features, 64, 1))
    mlp = train_mlp_batch(train, jobs(train.n_features * 4 + 8, 16, 2), 4)
    return np.concatenate([r.ravel() for r in (linear.weights, linear.ndcg, mlp.weights, mlp.ndcg)])


def test_results_do_not_depend_on_the_thread_count():
    # every job draws from its own generator and writes only its own rows: 1, 2 or 4 threads
    # (numba's pool sized for 4 even on a smaller machine) give the same bits
    got = [
        run_small_elsewhere(
            code="run_threads_batch", FOLTR_ASYNC_THREADS=str(n), NUMBA_NUM_THREADS="4"
        )
        for n in (1, 2, 4)
    ]
    assert all(np.array_equal(got[0], other, equal_nan=True) for other in got[1:])
    assert np.array_equal(got[0], run_threads_batch(), equal_nan=True)


def test_jobs_sharing_a_generator_draw_one_after_the_other():
    # the same generator in two jobs of one batch: job 0's draws, then job 1's, as two batches
    train = make_queryset(3)
    model = cascade("informational", 3)
    start = np.full(train.n_features, 0.2)

    def pair(rng):
        return [PDGDJob(start, np.arange(5, 30), 4, rng, model, 0.3) for _ in range(2)]

    rng = np.random.default_rng(4)
    together = train_linear_batch(train, pair(rng))
    alone_rng = np.random.default_rng(4)
    first, second = pair(alone_rng)
    alone = [train_linear_batch(train, [job]) for job in (first, second)]
    assert np.array_equal(together.weights, np.concatenate([r.weights for r in alone]))
    assert np.array_equal(together.queries, np.concatenate([r.queries for r in alone]))
    assert rng.bit_generator.state == alone_rng.bit_generator.state

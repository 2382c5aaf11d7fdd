"""PDGD for many independent learners at once (linear rankers, and MLPs of one hidden layer):
FPDGD's local training, batched.

A FPDGD round asks every client for a few PDGD interactions. Here J *jobs* (one client's learner
each: its own weights, queries, click model and ``numpy.random.Generator``) run in compiled code
(``foltr_async.ltr.pdgd_kernel``), each with its DP clipping and FedProx proximal weight.
Linear learners: one call, without the GIL, draws every job's random numbers and runs every
job's interactions (score, rank, click, measure, update), jobs spread over
``foltr_async.ltr.threads``' threads. One-hidden-layer MLPs: one call draws,
then per step numpy scores each job and one call ranks, clicks, measures and updates every job
(jobs in parallel). One query at a time (the reference, the protocols' ``PDGDLearner.train``)
an interaction is ~20 small numpy calls; here it is a share of one or two compiled calls,
whatever the batch size, so staggered arrivals (batches of one or two jobs) are as cheap per
query as full rounds. Jobs share nothing but read-only data, so results do not depend on the
number of threads.

Same draws, same result. Every random number a job uses comes from its own generator in exactly
the sequential path's order: per interaction, with shared data
``rng.integers(n_own + n_shared)`` (which users: ``PDGDLearner.train``), then
``rng.integers(len(queries))`` (``Users.next_query``; nothing for a replayed log, which issues
its next query), ``rng.gumbel(size=n_docs)`` (``sample_ranking``), for a mixture of click models
``rng.integers(len(models))`` (``MixtureClickModel.simulate``) and the clicking model's uniforms:
``rng.random((2, n_shown))`` for a cascade (``CascadeModel.simulate``), ``rng.random(n_shown)``
for position-based users (``PositionBasedModel.simulate``, whose click probabilities are
tabulated per position and label with its own numpy arithmetic). None of these sizes depends on
the weights, so all of a job's draws are made before any scoring, and the batched path shows the
same rankings, sees the same clicks, reports the same online nDCG and ends with the same weights
as the sequential one up to float rounding (summation order only). Ties between
Gumbel-perturbed scores (probability zero for finite scores) put the lower document first.

Linear scoring runs in the kernel: float64 sums of the float32 feature rows times the weights
(no float64 copy of the rows), in another order than the BLAS product of ``LinearRanker.score``,
so scores differ from the reference's in the last bits (~1e-15 relative), which changes a
ranking only where two Gumbel-perturbed scores are that close. A one-hidden-layer MLP
(``train_mlp_batch``) is scored with ``MLPRanker.score``'s numpy products per job (a compiled
forward pass with numba's scalar ``tanh`` was ~4x slower), so its rankings are the reference's;
its backward pass runs in the kernel and sums in another order than BLAS, so its weights match
to float rounding.

Debiasing without the swapped rankings. With ``D(p)`` the sum of ``exp(score)`` over the
documents not placed before position ``p`` (see ``foltr_async.ltr.pdgd``), swapping the
documents at positions ``lo < hi`` changes exactly ``D(p)`` for ``lo < p <= hi``, into
``D(p) - exp(s_hi) + exp(s_lo)``. So ``log P(swapped) - log P(shown)`` is
``-sum_{lo < p <= hi} log1p(exp(s_lo - log D(p)) - exp(s_hi - log D(p)))``: one term per
position between the pair, no per-pair re-accumulation. ``exp(s_hi - log D(p)) <= 1`` always;
the subtraction loses precision only when ``s_hi`` dominates ``D(p)``, and then the log-ratio is
large and the sigmoid that turns it into ``rho`` is flat, so ``rho`` stays accurate to a few
ulps (checked against the sequential path, scores spread up to thousands).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from foltr_async.ltr.clicks import CascadeModel, MixtureClickModel, PositionBasedModel
from foltr_async.ltr.metrics import _discount, _gain, ideal_dcg
from foltr_async.ltr.queryset import QuerySet

__all__ = [
    "BatchResult",
    "PDGDJob",
    "compiled_pair_weights",
    "learn_logged_linear",
    "prepare",
    "serve_linear_batch",
    "train_linear_batch",
    "train_mlp_batch",
]

SERP_LENGTH = 10
#: jobs per kernel call: a call's buffers grow with its jobs times their largest owned query
#: (62,500 clients sharing a 1,200-query pool: ~1.5 GB in one call), and jobs are independent
CHUNK = 4096


@dataclass(frozen=True, eq=False)
class _Data:
    """What the kernel reads of a QuerySet, derived once per (QuerySet, k)."""

    starts: list[int]  # first document of each query
    sizes: list[int]  # document count of each query
    size_arr: np.ndarray  # the same, int64
    gains: np.ndarray  # 2^label - 1 per document, as metrics.dcg_at_k computes it
    ideal: np.ndarray  # ideal DCG@k per query
    discount: np.ndarray  # (k + 1, k): row m is metrics._discount(m)


_DATA: weakref.WeakKeyDictionary[QuerySet, dict[int, _Data]] = weakref.WeakKeyDictionary()


def _data(qs: QuerySet, k: int) -> _Data:
    got = _DATA.setdefault(qs, {}).get(k)
    if got is None:
        sizes = np.diff(qs.qptr).astype(np.int64)
        discount = np.zeros((k + 1, max(k, 1)))
        for m in range(1, k + 1):
            discount[m, :m] = _discount(m)
        got = _DATA[qs][k] = _Data(
            qs.qptr[:-1].tolist(),
            sizes.tolist(),
            sizes,
            _gain(qs.labels),
            ideal_dcg(qs, k),
            discount,
        )
    return got


@dataclass(eq=False)
class PDGDJob:
    """One learner's local training: ``n_steps`` PDGD interactions from ``weights`` (its
    ranker's flat parameters).

    ``rng`` is the learner's own generator (also its users'), consumed exactly as the sequential
    path would; ``click_model`` a cascade or position-based model or a mixture of them
    (``batchable_clicks``); ``clip`` is the DP norm bound applied after every update (None: no
    clipping), in the L``clip_order`` norm (2 or 1); ``mu`` is FedProx's proximal weight: every
    step also takes ``-lr mu (w - weights)``, and a query without a click still takes that part
    (and the clipping), as ``PDGDLearner.train`` does.
    """

    weights: np.ndarray
    queries: np.ndarray
    n_steps: int
    rng: np.random.Generator
    click_model: CascadeModel
    lr: float
    clip: float | None = None
    clip_order: int = 2
    mu: float = 0.0
    #: a replayed log: the position in ``queries`` of the next query (its queries are issued in
    #: order, nothing drawn); -1: drawn at random
    replay_from: int = -1
    #: shared data (non-IID data sharing): its queries (in the same training set) and users'
    #: click model; each step picks them with ``integers(len(queries) + len(shared_queries))``
    #: ``>= len(queries)``, as ``PDGDLearner.train`` does
    shared_queries: np.ndarray | None = None
    shared_model: object = None


@dataclass(frozen=True)
class BatchResult:
    """Per job (rows): final weights, and per interaction the query and the shown nDCG@k;
    from ``serve_linear_batch`` also the shown rankings and their clicks.

    Step ``s`` of a job that ran fewer steps holds query -1 and nDCG ``nan``.
    """

    weights: np.ndarray  # (jobs, n_features) float64
    queries: np.ndarray  # (jobs, steps) int64
    ndcg: np.ndarray  # (jobs, steps) float64
    #: (jobs, steps, k) int64: shown documents (offsets in the query), -1 past the list
    rankings: np.ndarray | None = None
    clicks: np.ndarray | None = None  # (jobs, steps, k) bool, False past the list
    #: (jobs, steps) bool: the step's users were the shared data's (None: no job shares)
    shared: np.ndarray | None = None


def batchable_clicks(model) -> bool:
    """Whether the kernel draws and clicks as ``model.simulate`` does: a cascade model, a
    position-based one (relevant grades >= 0), or a mixture of those."""
    if isinstance(model, MixtureClickModel):
        return bool(model.models) and all(
            not isinstance(m, MixtureClickModel) and batchable_clicks(m) for m in model.models
        )
    if isinstance(model, PositionBasedModel):
        return all(int(r) == r and r >= 0 for r in model.relevant)
    return isinstance(model, CascadeModel)


def _components(model) -> tuple:
    """The models a job's users click with: a mixture's, or the one."""
    if not batchable_clicks(model):
        raise TypeError(
            "batched PDGD needs cascade or position-based click models or a mixture of them, "
            f"got {type(model).__name__}"
        )
    return model.models if isinstance(model, MixtureClickModel) else (model,)


@dataclass(frozen=True, eq=False)
class _Clicks:
    """The click models of a batch, as the kernel reads them: per model its kind (0 cascade,
    1 position-based), a cascade's (P(click | grade), P(stop | click, grade)) rows (padded) and
    grade count, a position-based model's P(click) per position and label (``pbm``: its last
    column for labels past the table)."""

    kinds: np.ndarray
    tables: np.ndarray
    n_grades: np.ndarray
    pbm: np.ndarray


_TABLES: weakref.WeakKeyDictionary[object, tuple[int, _Clicks]] = weakref.WeakKeyDictionary()


def _clicks(models: list, k: int) -> _Clicks:
    """``_Clicks`` of ``models`` for SERPs of ``k`` (one model's: cached on it)."""
    if len(models) == 1 and models[0] in _TABLES and _TABLES[models[0]][0] == k:
        return _TABLES[models[0]][1]
    cascades = [m for m in models if isinstance(m, CascadeModel)]
    width = max((len(m.p_click) for m in cascades), default=1)
    tables = np.zeros((len(models), 2, width))
    n_grades = np.ones(len(models), dtype=np.int64)
    kinds = np.zeros(len(models), dtype=np.int64)
    position = [m for m in models if isinstance(m, PositionBasedModel)]
    past = max((max(m.relevant, default=-1) + 1 for m in position), default=0)
    pbm = np.zeros((len(models), k if position else 1, past + 1))
    for i, m in enumerate(models):
        if isinstance(m, CascadeModel):
            tables[i, 0, : len(m.p_click)] = m.p_click
            tables[i, 1, : len(m.p_stop)] = m.p_stop
            n_grades[i] = len(m.p_click)
        else:  # PositionBasedModel.click_probability, position by position, label by label
            kinds[i] = 1
            rel = np.isin(np.arange(past), np.fromiter(m.relevant, dtype=np.int64))
            exam = m.examination(k)
            pbm[i, :, :past] = exam[:, None] * np.where(rel, 1.0, m.noise)[None, :]
            pbm[i, :, past] = exam * m.noise
    got = _Clicks(kinds, tables, n_grades, pbm)
    if len(models) == 1:
        _TABLES[models[0]] = (k, got)
    return got


def _params(jobs: Sequence[PDGDJob], k: int) -> tuple[np.ndarray, _Clicks, tuple]:
    """Per job (lr, clip norm or inf, its first click model's number, clip order, mu); the
    batch's click models (``_Clicks``); the kernel's users tuple (``pdgd_kernel._draws``:
    replay positions, shared queries, each job's own and shared users' model numbers, the
    models' kinds)."""
    number: dict[int, int] = {}
    models: list = []

    def numbers(model) -> list[int]:
        out = []
        for m in _components(model):
            i = number.get(id(m))
            if i is None:
                i = number[id(m)] = len(models)
                models.append(m)
            out.append(i)
        return out

    rows, order = [], []
    mix: list[int] = []
    smix: list[int] = []
    mix_ptr, smix_ptr, sh_ptr = [0], [0], [0]
    shared: list[np.ndarray] = []
    for job in jobs:
        own = numbers(job.click_model)
        mix += own
        mix_ptr.append(len(mix))
        if job.shared_queries is not None and len(job.shared_queries):
            smix += numbers(job.shared_model)
            shared.append(job.shared_queries)
            sh_ptr.append(sh_ptr[-1] + len(job.shared_queries))
        else:
            sh_ptr.append(sh_ptr[-1])
        smix_ptr.append(len(smix))
        order.append(job.replay_from)
        clip = np.inf if job.clip is None else job.clip
        rows.append((job.lr, clip, own[0], job.clip_order, job.mu))
    clicks = _clicks(models, k)

    def ints(values) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    sh = np.concatenate(shared).astype(np.int64, copy=False) if shared else ints([])
    grp = (ints(order), sh, ints(sh_ptr), ints(mix), ints(mix_ptr), ints(smix), ints(smix_ptr))
    return np.array(rows, dtype=np.float64), clicks, (*grp, clicks.kinds)


def train_linear_batch(
    train: QuerySet, jobs: Sequence[PDGDJob], k: int = SERP_LENGTH
) -> BatchResult:
    """Run every job's interactions: the batched ``PDGDLearner.train`` of many linear
    learners.

    Step ``s`` of every job runs before step ``s + 1`` of any. Jobs are independent: the result
    of one never depends on the others in the batch.
    """
    return _chunked(train, jobs, k, 0)


def serve_linear_batch(
    train: QuerySet, jobs: Sequence[PDGDJob], k: int = SERP_LENGTH
) -> BatchResult:
    """Show every job's users ``n_steps`` rankings from its (linear) weights without learning:
    the batched ``PDGDLearner.show`` of centralised PDGD's logging clients (the jobs' ``lr``
    and ``clip`` are not used). Each job draws what ``serve`` would (query, Gumbel noise, click
    uniforms), in its order. The result's ``rankings`` and ``clicks`` hold what was shown."""
    return _chunked(train, jobs, k, 0, record=True)


def train_mlp_batch(
    train: QuerySet, jobs: Sequence[PDGDJob], hidden: int, k: int = SERP_LENGTH
) -> BatchResult:
    """``train_linear_batch`` for learners with a one-hidden-layer MLP ranker of ``hidden``
    tanh units (``MLPRanker(n_features, (hidden,))``'s flat parameters). Scoring is
    ``MLPRanker.score``'s numpy products per job (the same scores, bit for bit); the backward
    pass runs in the kernel, its sums in another order than BLAS (equal to float rounding)."""
    return _chunked(train, jobs, k, hidden)


def _chunked(
    train: QuerySet, jobs: Sequence[PDGDJob], k: int, hidden: int, record: bool = False
) -> BatchResult:
    """``_train`` on at most ``CHUNK`` jobs at a time, in job order: the same draws and results
    (jobs sharing a generator still draw one after the other), with bounded buffers."""
    if len(jobs) <= CHUNK:
        return _train(train, jobs, k, hidden, record)
    parts = [
        _train(train, jobs[i : i + CHUNK], k, hidden, record) for i in range(0, len(jobs), CHUNK)
    ]
    steps = max(r.queries.shape[1] for r in parts)
    queries = np.full((len(jobs), steps), -1, dtype=np.int64)
    ndcg = np.full((len(jobs), steps), np.nan)
    rankings = np.full((len(jobs), steps, k), -1, dtype=np.int64) if record else None
    clicks = np.zeros((len(jobs), steps, k), dtype=np.bool_) if record else None
    sharing = any(r.shared is not None for r in parts)
    from_shared = np.zeros((len(jobs), steps), dtype=np.bool_) if sharing else None
    at = 0
    for r in parts:
        n, m = r.queries.shape
        queries[at : at + n, :m] = r.queries
        ndcg[at : at + n, :m] = r.ndcg
        if record:
            rankings[at : at + n, :m] = r.rankings
            clicks[at : at + n, :m] = r.clicks
        if r.shared is not None:
            from_shared[at : at + n, :m] = r.shared
        at += n
    weights = np.concatenate([r.weights for r in parts])
    return BatchResult(weights, queries, ndcg, rankings, clicks, from_shared)


def _train(
    train: QuerySet, jobs: Sequence[PDGDJob], k: int, hidden: int, record: bool = False
) -> BatchResult:
    """Both trainers: ``hidden`` 0 for linear rankers; ``record`` (linear only): keep the
    shown rankings and clicks."""
    n_feat = train.n_features
    n_params = n_feat * hidden + 2 * hidden if hidden else n_feat
    if not jobs:
        return BatchResult(
            np.empty((0, n_params)), np.zeros((0, 0), dtype=np.int64), np.empty((0, 0))
        )
    w = np.array([job.weights for job in jobs], dtype=np.float64)
    if w.shape[1:] != (n_params,):
        what = f"an MLP with {hidden} hidden units" if hidden else "one per feature"
        raise ValueError(f"job weights must have {n_params} entries ({what}), got {w.shape[1:]}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    owned_ptr = [0]
    for job in jobs:
        size = len(job.queries)
        if job.n_steps > 0 and not 0 < size < 2**32:
            raise ValueError(f"a job needs 1 to 2^32 - 1 queries to draw from, got {size}")
        owned_ptr.append(owned_ptr[-1] + size)
    from foltr_async.ltr import pdgd_kernel  # numba: imported (and compiled) on first use

    data = _data(train, k)
    params, clicks, grp = _params(jobs, k)
    tables, n_grades, pbm = clicks.tables, clicks.n_grades, clicks.pbm
    ptrs = pdgd_kernel.generator_pointers([job.rng for job in jobs])
    # jobs sharing a generator draw one after the other, as the sequential path would
    shared = len(set(ptrs[:, 2].tolist())) < len(jobs)
    sharing = len(grp[1]) > 0  # some job's users include shared data's
    owned = np.concatenate([job.queries for job in jobs]).astype(np.int64, copy=False)
    owned_ptr = np.array(owned_ptr, dtype=np.int64)
    steps = np.array([job.n_steps for job in jobs], dtype=np.int64)
    train_linear, draw, step, n_threads = pdgd_kernel.use_threads(len(jobs), int(steps.sum()))
    # FedProx's anchor: the start weights (read by the kernel only for jobs with mu != 0)
    w0 = w.copy() if params[:, 4].any() else np.empty((0, n_params))
    features = train.features
    if not hidden:
        n_rec = len(jobs) if record else 0
        served = np.full((n_rec, int(steps.max()), k), -1, dtype=np.int64)
        seen = np.zeros(served.shape, dtype=np.bool_)
        query, shown, from_shared = train_linear(
            ptrs, owned, owned_ptr, steps, data.size_arr, k, shared, train.qptr, train.labels,
            features, data.gains, data.discount, data.ideal, tables, n_grades, params, w, w0,
            n_threads, served, seen, grp, pbm,
        )  # fmt: skip
        if not record:
            served = seen = None
        return BatchResult(w, query, shown, served, seen, from_shared if sharing else None)
    query, gptr, uptr, gumbel, uniform, shown, model_at, from_shared = draw(
        ptrs, owned, owned_ptr, steps, data.size_arr, k, shared, grp
    )
    max_docs = int(data.size_arr.max(initial=0))
    scores = np.empty_like(gumbel)
    starts, sizes = data.starts, data.sizes
    # per job, views into w (which the kernel updates): W (n_feat, hidden), b, v
    o_b = n_feat * hidden
    layers = [(wj[:o_b].reshape(n_feat, hidden), wj[o_b:-hidden], wj[-hidden:]) for wj in w]
    per_step = [sum(sizes[q] for q in col if q >= 0) for col in query.T.tolist()]
    acts = np.empty((max(per_step, default=0), hidden))
    aptr = np.zeros(len(jobs), dtype=np.int64)
    rows = list(enumerate(zip(layers, query.tolist(), gptr.tolist(), strict=True)))
    for s in range(query.shape[1]):
        at = 0
        for j, ((W, b, v), qj, oj) in rows:
            q = qj[s]
            if q < 0:
                continue
            first, n, o = starts[q], sizes[q], oj[s]
            a = acts[at : at + n]
            x = np.asarray(features[first : first + n], dtype=np.float64)
            np.tanh(x @ W + b, out=a)
            np.matmul(a, v, out=scores[o : o + n])
            aptr[j] = at
            at += n
        step(
            s, query, gptr, uptr, scores, gumbel, uniform, train.qptr, train.labels, features,
            data.gains, data.discount, data.ideal, tables, n_grades, params, w, w0, shown, k,
            acts, aptr, max_docs, n_threads, model_at, clicks.kinds, pbm,
        )  # fmt: skip
    return BatchResult(w, query, shown, shared=from_shared if sharing else None)


def learn_logged_linear(
    train: QuerySet,
    weights: np.ndarray,
    queries: np.ndarray,
    rankings: np.ndarray,
    clicks: np.ndarray,
    lr: float,
    every: int = 0,
    scale: float = 1.0,
) -> np.ndarray:
    """PDGD of a linear ranker from interactions other users had, in one compiled call (the
    protocols' ``PDGDLearner.learn_logged``, centralised PDGD's server): query ``queries[t]``
    of ``train`` showed the documents ``rankings[t]`` (offsets in the query, -1 padding the
    end) with ``clicks[t]``. Their gradients at the current weights are summed and a step of
    ``lr`` times the sum taken every ``every`` interactions, the remainder's scaled by
    ``scale`` at the end (``every`` 0: one step on all of them). Returns the new weights, which
    equal the one-query-at-a-time ``pdgd_gradient`` sums up to float rounding (the kernel's
    scores and pair weights, module doc)."""
    queries = np.ascontiguousarray(queries, dtype=np.int64)
    rankings = np.ascontiguousarray(rankings, dtype=np.int64)
    clicks = np.ascontiguousarray(clicks, dtype=np.bool_)
    n = len(queries)
    if rankings.ndim != 2 or len(rankings) != n or clicks.shape != rankings.shape:
        raise ValueError(
            f"logged rankings and clicks must be {n} x K alike, got {rankings.shape} and "
            f"{clicks.shape}"
        )
    if n and not (queries.min() >= 0 and queries.max() < train.n_queries):
        raise ValueError(f"logged queries must be in 0..{train.n_queries - 1}")
    sizes = np.diff(train.qptr)[queries]
    padded = rankings < 0
    bad = (rankings < -1) | (rankings >= sizes[:, None])
    bad[:, :-1] |= padded[:, :-1] & ~padded[:, 1:]  # a shown document after the padding
    if bad.any():
        raise ValueError("logged rankings must be offsets in their query, -1 only at the end")
    from foltr_async.ltr import pdgd_kernel  # numba: imported (and compiled) on first use

    w = np.array(weights, dtype=np.float64)
    qptr = np.asarray(train.qptr, dtype=np.int64)
    pdgd_kernel.logged_linear(qptr, queries, rankings, clicks, train.features, w, lr, every, scale)
    return w


def compiled_pair_weights(
    scores: np.ndarray, ranking: np.ndarray, clicks: np.ndarray
) -> np.ndarray:
    """``pdgd.pair_weights`` from the kernel (equal up to float rounding, 20-40x cheaper), for
    ``pdgd.pdgd_gradient(..., weights=compiled_pair_weights)``: the one-query-at-a-time path of
    what the batched path does not cover (other rankers and click models, shared data in another
    training set)."""
    from foltr_async.ltr import pdgd_kernel  # numba: imported (and compiled) on first use

    return pdgd_kernel.pair_weights(
        np.ascontiguousarray(scores, dtype=np.float64),
        np.ascontiguousarray(ranking, dtype=np.int64),
        np.ascontiguousarray(clicks, dtype=np.bool_),
    )


def prepare() -> None:
    """Import and load (or compile) the compiled kernel now instead of on the first training.

    For real-time runs (ZeroMQ workers), whose first round has a wall-clock deadline: numba's
    import and cache load take ~0.5 CPU s. Uses a float32 / int8 set like the loaders make, so
    the functions loaded are the ones real data calls: the serial kernels, and the parallel
    ones too when more than one thread is in force, and the logged-interaction one.
    """
    from foltr_async.ltr.pdgd_kernel import PARALLEL_FROM

    qptr = np.array([0, 3], dtype=np.int64)
    tiny = QuerySet(
        np.zeros((3, 2), dtype=np.float32),
        np.array([0, 1, 2], dtype=np.int8),
        qptr,
        np.array(["q"]),
    )
    model = CascadeModel("prepare", np.array([0.5, 0.9]), np.array([0.1, 0.5]))
    for steps in (1, PARALLEL_FROM):  # two jobs: the serial kernels, then the parallel ones
        job = PDGDJob(np.zeros(2), np.array([0]), steps, np.random.default_rng(0), model, 0.1)
        train_linear_batch(tiny, [job, job])
        job.weights = np.zeros(2 * 2 + 2 * 2)
        train_mlp_batch(tiny, [job, job], 2)
    shown = np.array([[2, 0, -1]])
    learn_logged_linear(tiny, np.zeros(2), np.array([0]), shown, shown == 2, 0.1)

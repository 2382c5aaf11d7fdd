"""PDGD for many independent linear learners at once: FPDGD's local training, batched.

A FPDGD round asks every client for a few PDGD interactions. Run one query at a time
(``protocols.fpdgd.LocalLearner.train``), each interaction is ~20 tiny numpy calls, so a
1000-client round is dominated by call overhead. Here J *jobs* (one client's learner each: its
own weights, queries, click model and ``numpy.random.Generator``) advance together, one
interaction step at a time; everything after scoring is a handful of array operations over all
jobs (the displayed lists padded to ``k`` positions, the preference pairs flattened across
jobs).

Same draws, same result. Every random number a job uses comes from its own generator through
exactly the calls, sizes and order of the sequential path: per interaction
``rng.integers(len(queries))`` (``Users.next_query``), ``rng.gumbel(size=n_docs)``
(``sample_ranking``) and ``rng.random((2, n_shown))`` (``CascadeModel.simulate``). None of these
sizes depends on the weights, so all of a job's draws are made before any scoring, and the
batched path shows the same rankings, sees the same clicks and ends with the same weights as the
sequential one up to float rounding (summation order only). Ties between Gumbel-perturbed scores
(probability zero for finite scores) may be broken differently.

Scoring is one ``features[query] @ weights`` per job on the query's contiguous document block:
the same product as ``LinearRanker.score``, no gather and no float64 copy of the feature matrix
(it is memory-bound and the largest cost left). Each step's jobs are grouped by query size so
that one long query never pads many short ones in the ``(jobs, docs)`` matrices (``-inf``
beyond a query's documents), and a group stays cache-sized.

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

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from foltr_async.ltr.clicks import CascadeModel
from foltr_async.ltr.metrics import dcg_at_k, ideal_dcg
from foltr_async.ltr.pdgd import sample_ranking
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import LinearRanker

__all__ = ["MIN_BATCH", "BatchResult", "LinearJob", "size_groups", "train_linear_batch"]

SERP_LENGTH = 10
#: Padded (jobs x documents) cells per group of jobs: small enough to stay in cache.
_CHUNK_CELLS = 1 << 16
#: Fewer jobs than this run one query at a time: the vectorised step has a fixed cost of ~100
#: numpy calls, which only pays off from ~6 jobs on (measured against the one-at-a-time loop
#: with its closed-form gradient, 2 steps per job: 1 job 2-3x slower, 4 jobs 1.2x slower, 6 jobs
#: even, 12 jobs 1.5x faster). Staggered network latencies make such small batches common.
MIN_BATCH = 6

_SIZES: weakref.WeakKeyDictionary[QuerySet, tuple[list[int], list[int]]] = (
    weakref.WeakKeyDictionary()
)


def _offsets(qs: QuerySet) -> tuple[list[int], list[int]]:
    """(first document, document count) per query as Python ints (cached per QuerySet)."""
    got = _SIZES.get(qs)
    if got is None:
        got = _SIZES[qs] = (qs.qptr[:-1].tolist(), np.diff(qs.qptr).tolist())
    return got


@dataclass(eq=False)
class LinearJob:
    """One learner's local training: ``n_steps`` PDGD interactions from ``weights``.

    ``rng`` is the learner's own generator (also its users'), consumed exactly as the sequential
    path would; ``clip`` is the DP norm bound applied after every update (None: no clipping).
    """

    weights: np.ndarray
    queries: np.ndarray
    n_steps: int
    rng: np.random.Generator
    click_model: CascadeModel
    lr: float
    clip: float | None = None


@dataclass(frozen=True)
class BatchResult:
    """Per job (rows): final weights, and per interaction the query and the shown nDCG@k.

    Step ``s`` of a job that ran fewer steps holds query -1 and nDCG ``nan``.
    """

    weights: np.ndarray  # (jobs, n_features) float64
    queries: np.ndarray  # (jobs, steps) int64
    ndcg: np.ndarray  # (jobs, steps) float64


def _draws(
    jobs: Sequence[LinearJob], sizes: list[int], k: int, n_steps: int
) -> tuple[np.ndarray, list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Every job's queries, Gumbel noise and click uniforms, in the sequential call order.

    The same draws as the sequential calls, at less call overhead: ``gumbel(0.0, 1.0, n)`` is
    ``gumbel(size=n)``, ``random(2 * m)`` is the raveled ``random((2, m))``, and a learner with
    one query skips ``integers(1)``, which draws nothing.
    """
    query: list[list[int]] = [[-1] * len(jobs) for _ in range(n_steps)]
    gumbel: list[list[np.ndarray]] = [[] for _ in range(n_steps)]
    uniform: list[list[np.ndarray]] = [[] for _ in range(n_steps)]
    for j, job in enumerate(jobs):
        integers, gum, rand = job.rng.integers, job.rng.gumbel, job.rng.random
        owned = job.queries
        n_owned = len(owned)
        only = int(owned[0]) if n_owned == 1 else None
        for s in range(job.n_steps):
            q = only if only is not None else int(owned[integers(n_owned)])
            n = sizes[q]
            query[s][j] = q
            gumbel[s].append(gum(0.0, 1.0, n))
            uniform[s].append(rand(2 * min(k, n)))
    return np.array(query, dtype=np.int64).reshape(n_steps, len(jobs)), gumbel, uniform


def _click_tables(jobs: Sequence[LinearJob]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-job P(click | grade) and P(stop | click, grade) rows (padded) and grade counts."""
    models: dict[int, int] = {}
    distinct: list[CascadeModel] = []
    which = np.empty(len(jobs), dtype=np.int64)
    for j, job in enumerate(jobs):
        m = job.click_model
        if not isinstance(m, CascadeModel):
            raise TypeError(f"batched PDGD needs cascade click models, got {type(m).__name__}")
        i = models.get(id(m))
        if i is None:
            i = models[id(m)] = len(distinct)
            distinct.append(m)
        which[j] = i
    width = max(len(m.p_click) for m in distinct)
    pc = np.zeros((len(distinct), width))
    ps = np.zeros((len(distinct), width))
    for i, m in enumerate(distinct):
        pc[i, : len(m.p_click)] = m.p_click
        ps[i, : len(m.p_stop)] = m.p_stop
    n_grades = np.array([len(m.p_click) for m in distinct], dtype=np.int64)
    return pc[which], ps[which], n_grades[which]


def _log_sum_exp_rows(a: np.ndarray) -> np.ndarray:
    """Row-wise log(sum(exp(a))) with -inf for rows that are all -inf."""
    mx = a.max(axis=1)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(a - safe[:, None]).sum(axis=1)) + safe


def _log_tail_sums(cols: np.ndarray, log_rest: np.ndarray) -> np.ndarray:
    """log D(p) = log(sum of exp over positions >= p, plus exp(log_rest)), per column.

    ``cols`` is (positions, lists). The same reversed log-add-exp accumulation as
    ``np.logaddexp.accumulate(x[::-1])[::-1]``, one vectorised call per position (the ufunc's
    own accumulate runs one short row at a time, ~30x slower here).
    """
    acc = np.empty_like(cols)
    acc[-1] = cols[-1]
    for p in range(cols.shape[0] - 2, -1, -1):
        np.logaddexp(acc[p + 1], cols[p], out=acc[p])
    return np.logaddexp(acc, log_rest, out=acc)


def _step(
    train: QuerySet,
    w: np.ndarray,
    q: np.ndarray,
    gumbel: list[np.ndarray],
    uniform: list[np.ndarray],
    pc: np.ndarray,
    ps: np.ndarray,
    n_grades: np.ndarray,
    lr: np.ndarray,
    clip: np.ndarray,
    k: int,
    starts: list[int],
    sizes: list[int],
    ideal: np.ndarray,
) -> np.ndarray:
    """One interaction for each row of ``w`` (updated in place); returns the shown nDCG@k."""
    a_n = w.shape[0]
    q_list = q.tolist()
    first_l = [starts[x] for x in q_list]
    n_l = [sizes[x] for x in q_list]
    first = np.array(first_l, dtype=np.int64)
    n = np.array(n_l, dtype=np.int64)
    width = max(max(n_l), 1)
    features = train.features

    # Scores: the same product per query as LinearRanker.score, padded with -inf.
    flat = np.concatenate(
        [features[x : x + size] @ wi for x, size, wi in zip(first_l, n_l, w, strict=True)]
    )
    docs = np.arange(width)
    real = docs < n[:, None]
    scores = np.full((a_n, width), -np.inf)
    scores[real] = flat
    z = np.full((a_n, width), -np.inf)
    z[real] = flat + np.concatenate(gumbel)

    # Plackett-Luce top-k (Gumbel-top-k) of every row; padding (-inf) sorts last.
    kk = min(k, width)
    if kk < width:
        top = np.argpartition(-z, kk - 1, axis=1)[:, :kk]
    else:
        top = np.broadcast_to(docs, (a_n, width))
    order = np.argsort(-np.take_along_axis(z, top, axis=1), axis=1, kind="stable")
    ranking = np.take_along_axis(top, order, axis=1)  # (jobs, kk) document offsets
    pos = np.arange(kk)
    valid = pos < np.minimum(n, kk)[:, None]
    doc = first[:, None] + np.where(valid, ranking, 0)
    labels = np.where(valid, train.labels[doc], 0).astype(np.int64)

    # Cascade clicks from each job's own uniforms.
    u = np.zeros((a_n, 2, kk))
    u[np.broadcast_to(valid[:, None, :], u.shape)] = np.concatenate(uniform, axis=None)
    g = np.clip(labels, 0, n_grades[:, None] - 1)
    rows = np.arange(a_n)[:, None]
    clicks = valid & (u[:, 0] < pc[rows, g])
    stops = clicks & (u[:, 1] < ps[rows, g])
    stopped = stops.any(axis=1)
    clicks &= ~(stopped[:, None] & (pos > np.argmax(stops, axis=1)[:, None]))

    # Online metric: nDCG@k of what was shown (0 when the query has no relevant document).
    discount = 1.0 / np.log2(np.arange(2, kk + 2, dtype=np.float64))
    dcg = ((np.exp2(labels.astype(np.float64)) - 1.0) * discount).sum(axis=1)
    best = ideal[q]
    shown_ndcg = np.divide(dcg, best, out=np.zeros(a_n), where=best > 0)

    # Preference pairs: each click over every unclicked position up to one below the last
    # click, listed job by job, then by clicked and unclicked position (the sequential order).
    clicked_any = clicks.any(axis=1)
    last = kk - 1 - np.argmax(clicks[:, ::-1], axis=1)
    other = valid & ~clicks & (pos <= last[:, None] + 1)
    pj, pa, pb = np.nonzero(clicks[:, :, None] & other[:, None, :])
    if pj.size:
        # rho per pair by the module doc's closed form: only lists with pairs need log D(p),
        # and only positions lo < p <= hi of a pair contribute.
        has = np.flatnonzero(clicked_any)
        inv = np.zeros(a_n, dtype=np.int64)
        inv[has] = np.arange(has.size)
        pl = inv[pj]  # pair -> its list among ``has``
        shown = np.where(
            valid[has], np.take_along_axis(scores[has], ranking[has], axis=1), -np.inf
        ).T  # (positions, lists)
        rest = scores[has]
        np.put_along_axis(rest, ranking[has], -np.inf, axis=1)  # invalid slots hit padding
        log_d = _log_tail_sums(np.ascontiguousarray(shown), _log_sum_exp_rows(rest))
        sa, sb = shown[pa, pl], shown[pb, pl]
        lo, hi = np.minimum(pa, pb), np.maximum(pa, pb)
        span = hi - lo
        term_pair = np.repeat(np.arange(pj.size), span)
        p = np.arange(term_pair.size) - np.repeat(np.cumsum(span) - span, span) + lo[term_pair] + 1
        log_dp = log_d[p, pl[term_pair]]
        s_lo, s_hi = shown[lo, pl], shown[hi, pl]
        # Extreme spreads give terms of +-inf (exp overflow, or log1p(-1) once exp(s_lo - L)
        # underflows): rho is then exactly 0 or 1, as its exact value rounds to.
        with np.errstate(over="ignore", divide="ignore"):
            d_ratio = np.exp(s_lo[term_pair] - log_dp) - np.exp(s_hi[term_pair] - log_dp)
            terms = -np.log1p(d_ratio)
        log_ratio = np.bincount(term_pair, weights=terms, minlength=pj.size)
        rho = 0.5 * (1.0 + np.tanh(0.5 * log_ratio))
        e = np.exp(-np.abs(sa - sb))
        pw = e / (1.0 + e) ** 2 * rho
        coef = np.bincount(
            np.concatenate((pj * kk + pa, pj * kk + pb)),
            weights=np.concatenate((pw, -pw)),
            minlength=a_n * kk,
        ).reshape(a_n, kk)
        up = np.flatnonzero(coef.any(axis=1))
        # Linear gradient: coefficient-weighted sum of the shown documents' features.
        shown_x = features.take(doc[up].ravel(), axis=0).reshape(up.size, kk, features.shape[1])
        grad = np.einsum("uk,ukf->uf", coef[up], shown_x)
        w[up] += lr[up, None] * grad

    # DP: clip after every update (a step with clicks), exactly when the sequential path does.
    bounded = np.flatnonzero(clicked_any & np.isfinite(clip))
    if bounded.size:
        norm = np.sqrt(np.einsum("ij,ij->i", w[bounded], w[bounded]))
        over = norm > clip[bounded]
        sel = bounded[over]
        w[sel] *= (clip[sel] / norm[over])[:, None]
    return shown_ndcg


@functools.lru_cache(maxsize=1 << 12)
def _pair_layout(pattern: bytes) -> tuple[np.ndarray, ...]:
    """What a click pattern (one list's clicks as bytes) fixes, shared by every list with it:
    the pairs' positions ``pa`` (clicked) and ``pb``, per position between a pair (``lo < p <=
    hi``) its pair and ``lo``, ``hi``, ``p``, and ``pa`` then ``pb`` (where the pair weights go)."""
    clicks = np.frombuffer(pattern, dtype=bool)
    pos = np.arange(clicks.size)
    other = ~clicks & (pos <= np.flatnonzero(clicks)[-1] + 1)
    pa, pb = np.nonzero(clicks[:, None] & other[None, :])
    lo, hi = np.minimum(pa, pb), np.maximum(pa, pb)
    pair, p = np.nonzero((pos > lo[:, None]) & (pos <= hi[:, None]))
    out = (pa, pb, pair, lo[pair], hi[pair], p, np.concatenate((pa, pb)))
    for arr in out:
        arr.setflags(write=False)
    return out


def _gradient_one(
    features: np.ndarray, scores: np.ndarray, ranking: np.ndarray, clicks: np.ndarray
) -> np.ndarray:
    """The PDGD ascent direction of one shown list with clicks, by the module doc's closed form
    (what ``_step`` computes for many lists): a dozen small numpy calls instead of the
    reference's swapped ranking per pair (``pdgd.debias_weights``)."""
    kk = ranking.size
    pa, pb, pair, lo, hi, p, ends = _pair_layout(clicks.tobytes())
    shown = scores[ranking]
    rest = np.ones(scores.size, dtype=bool)
    rest[ranking] = False
    log_rest = np.logaddexp.reduce(scores[rest]) if scores.size > kk else -np.inf
    log_d = np.logaddexp(np.logaddexp.accumulate(shown[::-1])[::-1], log_rest)
    with np.errstate(over="ignore", divide="ignore"):  # rho exactly 0 or 1 (see ``_step``)
        d_ratio = np.exp(shown[lo] - log_d[p]) - np.exp(shown[hi] - log_d[p])
        terms = -np.log1p(d_ratio)
    rho = 0.5 * (1.0 + np.tanh(0.5 * np.bincount(pair, weights=terms, minlength=pa.size)))
    e = np.exp(-np.abs(shown[pa] - shown[pb]))
    pw = e / (1.0 + e) ** 2 * rho
    coef = np.bincount(ends, weights=np.concatenate((pw, -pw)), minlength=kk)
    return coef @ features[ranking].astype(np.float64)


def _one_at_a_time(train: QuerySet, jobs: Sequence[LinearJob], k: int) -> BatchResult:
    """The sequential PDGD loop (as ``LocalLearner.train``, same draws) for batches too small to
    vectorise, with the closed-form gradient of ``_gradient_one``."""
    steps = max((job.n_steps for job in jobs), default=0)
    weights = np.empty((len(jobs), train.n_features))
    queries = np.full((len(jobs), steps), -1, dtype=np.int64)
    shown = np.full((len(jobs), steps), np.nan)
    ideal = ideal_dcg(train, k)
    ranker = LinearRanker(train.n_features)
    for j, job in enumerate(jobs):
        theta = np.array(job.weights, dtype=np.float64)
        rng = job.rng
        for s in range(job.n_steps):
            q = int(job.queries[rng.integers(len(job.queries))])
            docs = train.doc_range(q)
            features = train.features[docs]
            ranker.set_params(theta)
            scores = ranker.score(features)
            ranking = sample_ranking(scores, k, rng)
            labels = train.labels[docs][ranking]
            clicks = job.click_model.simulate(labels, rng)
            queries[j, s] = q
            shown[j, s] = float(dcg_at_k(labels, k)) / ideal[q] if ideal[q] > 0 else 0.0
            if clicks.any():
                theta = theta + job.lr * _gradient_one(features, scores, ranking, clicks)
                if job.clip is not None:
                    norm = float(np.linalg.norm(theta))
                    if norm > job.clip:
                        theta *= job.clip / norm
        weights[j] = theta
    return BatchResult(weights, queries, shown)


def size_groups(n_sorted: list[int], k: int) -> list[tuple[int, int]]:
    """Runs of jobs (sorted by document count) whose padded (jobs x docs) block fits the budget.

    Sorting first keeps one long query from padding many short ones (real query sizes are
    long-tailed), and blocks of ~``_CHUNK_CELLS`` cells stay in cache.
    """
    out = []
    start, n = 0, len(n_sorted)
    while start < n:
        # the largest end whose block fits (cells grow with end): bisect, at least one job
        lo, hi = start + 1, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - start) * max(n_sorted[mid - 1], k) <= _CHUNK_CELLS:
                lo = mid
            else:
                hi = mid - 1
        out.append((start, lo))
        start = lo
    return out


def train_linear_batch(
    train: QuerySet, jobs: Sequence[LinearJob], k: int = SERP_LENGTH
) -> BatchResult:
    """Run every job's interactions: the batched ``LocalLearner.train`` of many learners.

    Step ``s`` of every job runs before step ``s + 1`` of any. Jobs are independent: the result
    of one never depends on the others in the batch (nor on how they are grouped).
    """
    n_jobs = len(jobs)
    n_feat = train.n_features
    max_steps = max((job.n_steps for job in jobs), default=0)
    shown = np.full((n_jobs, max_steps), np.nan)
    if n_jobs == 0:
        return BatchResult(np.empty((0, n_feat)), np.zeros((0, 0), dtype=np.int64), shown)
    w = np.array([np.asarray(job.weights, dtype=np.float64) for job in jobs])
    if w.shape[1:] != (n_feat,):
        raise ValueError(f"job weights must have {n_feat} entries, got shape {w.shape[1:]}")
    if n_jobs < MIN_BATCH:
        return _one_at_a_time(train, jobs, k)
    starts, sizes = _offsets(train)
    ideal = ideal_dcg(train, k)
    steps = np.array([job.n_steps for job in jobs], dtype=np.int64)
    lr = np.array([job.lr for job in jobs], dtype=np.float64)
    clip = np.array([np.inf if job.clip is None else job.clip for job in jobs])
    pc, ps, n_grades = _click_tables(jobs)
    query, gumbel, uniform = _draws(jobs, sizes, k, max_steps)
    for s in range(max_steps):
        act = np.flatnonzero(steps > s)  # gumbel[s] and uniform[s] list these jobs in order
        q = query[s, act]
        by_size = np.argsort(np.array([sizes[x] for x in q.tolist()]), kind="stable")
        n_sorted = [sizes[x] for x in q[by_size].tolist()]
        for lo, hi in size_groups(n_sorted, k):
            pick = by_size[lo:hi]  # positions within ``act``
            rows = act[pick]
            sub = w[rows]
            shown[rows, s] = _step(
                train,
                sub,
                q[pick],
                [gumbel[s][i] for i in pick.tolist()],
                [uniform[s][i] for i in pick.tolist()],
                pc[rows],
                ps[rows],
                n_grades[rows],
                lr[rows],
                clip[rows],
                k,
                starts,
                sizes,
                ideal,
            )
            w[rows] = sub
    return BatchResult(w, query.T.copy(), shown)

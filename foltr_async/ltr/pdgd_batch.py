"""PDGD for many independent linear learners at once: FPDGD's local training, batched.

A FPDGD round asks every client for a few PDGD interactions. Here J *jobs* (one client's learner
each: its own weights, queries, click model and ``numpy.random.Generator``) advance together,
one interaction step at a time, and everything but scoring runs in compiled code
(``foltr_async.ltr.pdgd_kernel``): one call draws every job's random numbers, then per step one
call ranks, clicks, measures and updates every job. One query at a time (the reference,
``protocols.fpdgd.LocalLearner.train``) an interaction is ~20 small numpy calls; here it is one
product and a share of two compiled calls, whatever the batch size, so staggered arrivals
(batches of one or two jobs) are as cheap per query as full rounds.

Same draws, same result. Every random number a job uses comes from its own generator in exactly
the sequential path's order: per interaction ``rng.integers(len(queries))``
(``Users.next_query``), ``rng.gumbel(size=n_docs)`` (``sample_ranking``) and
``rng.random((2, n_shown))`` (``CascadeModel.simulate``). None of these sizes depends on the
weights, so all of a job's draws are made before any scoring, and the batched path shows the
same rankings, sees the same clicks, reports the same online nDCG and ends with the same weights
as the sequential one up to float rounding (summation order only). Ties between
Gumbel-perturbed scores (probability zero for finite scores) put the lower document first.

Scoring is one ``features[query] @ weights`` per job on the query's contiguous document block:
the same numpy product as ``LinearRanker.score``, so the scores, and with them the rankings,
are bit-identical to the reference's. (It is memory bound: a float64 copy of the features reads
twice the bytes and was no faster; a compiled dot product would sum in another order than BLAS.)

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

from foltr_async.ltr.clicks import CascadeModel
from foltr_async.ltr.metrics import _discount, _gain, ideal_dcg
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import _CHUNK

__all__ = ["BatchResult", "LinearJob", "train_linear_batch"]

SERP_LENGTH = 10


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


def _click_tables(jobs: Sequence[LinearJob]) -> tuple[np.ndarray, np.ndarray]:
    """Per job (P(click | grade), P(stop | click, grade)) rows, padded, and its grade count."""
    rows: dict[int, int] = {}
    distinct: list[CascadeModel] = []
    which = np.empty(len(jobs), dtype=np.int64)
    for j, job in enumerate(jobs):
        m = job.click_model
        i = rows.get(id(m))
        if i is None:
            if not isinstance(m, CascadeModel):
                raise TypeError(f"batched PDGD needs cascade click models, got {type(m).__name__}")
            i = rows[id(m)] = len(distinct)
            distinct.append(m)
        which[j] = i
    width = max(len(m.p_click) for m in distinct)
    tab = np.zeros((len(distinct), 2, width))
    for i, m in enumerate(distinct):
        tab[i, 0, : len(m.p_click)] = m.p_click
        tab[i, 1, : len(m.p_stop)] = m.p_stop
    n_grades = np.array([len(m.p_click) for m in distinct], dtype=np.int64)
    return tab[which], n_grades[which]


def _score(features: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``LinearRanker.score`` of one query's documents into ``out`` (the same row chunks)."""
    n = features.shape[0]
    if n <= _CHUNK:
        out[:] = features @ w
    else:
        for i in range(0, n, _CHUNK):
            out[i : i + _CHUNK] = features[i : i + _CHUNK] @ w


def train_linear_batch(
    train: QuerySet, jobs: Sequence[LinearJob], k: int = SERP_LENGTH
) -> BatchResult:
    """Run every job's interactions: the batched ``LocalLearner.train`` of many learners.

    Step ``s`` of every job runs before step ``s + 1`` of any. Jobs are independent: the result
    of one never depends on the others in the batch.
    """
    n_jobs = len(jobs)
    n_feat = train.n_features
    max_steps = max((job.n_steps for job in jobs), default=0)
    shown = np.full((n_jobs, max_steps), np.nan)
    query = np.full((max_steps, n_jobs), -1, dtype=np.int64)
    if n_jobs == 0:
        return BatchResult(np.empty((0, n_feat)), query.T.copy(), shown)
    w = np.array([np.asarray(job.weights, dtype=np.float64) for job in jobs])
    if w.shape[1:] != (n_feat,):
        raise ValueError(f"job weights must have {n_feat} entries, got shape {w.shape[1:]}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    owned = [np.asarray(job.queries, dtype=np.int64) for job in jobs]
    steps = np.array([job.n_steps for job in jobs], dtype=np.int64)
    for job, o in zip(jobs, owned, strict=True):
        if job.n_steps > 0 and not 0 < o.size < 2**32:
            raise ValueError(f"a job needs 1 to 2^32 - 1 queries to draw from, got {o.size}")
    if max_steps == 0:
        return BatchResult(w, query.T.copy(), shown)
    from foltr_async.ltr import pdgd_kernel  # numba: imported (and compiled) on first use

    data = _data(train, k)
    clicks, n_grades = _click_tables(jobs)
    rates = np.array([(job.lr, np.inf if job.clip is None else job.clip) for job in jobs])
    owned_ptr = np.zeros(n_jobs + 1, dtype=np.int64)
    np.cumsum([o.size for o in owned], out=owned_ptr[1:])
    gptr = np.zeros((max_steps, n_jobs), dtype=np.int64)
    uptr = np.zeros((max_steps, n_jobs), dtype=np.int64)
    ptrs = pdgd_kernel.generator_pointers([job.rng for job in jobs])
    gumbel, uniform = pdgd_kernel.draw(
        ptrs, np.concatenate(owned), owned_ptr, steps, data.size_arr, k, query, gptr, uptr
    )
    scores = np.empty_like(gumbel)
    features, starts, sizes = train.features, data.starts, data.sizes
    for s in range(max_steps):
        for j, (q, o) in enumerate(zip(query[s].tolist(), gptr[s].tolist(), strict=True)):
            if q >= 0:
                first, n = starts[q], sizes[q]
                _score(features[first : first + n], w[j], scores[o : o + n])
        pdgd_kernel.step(
            s,
            query,
            gptr,
            uptr,
            scores,
            gumbel,
            uniform,
            train.qptr,
            train.labels,
            features,
            data.gains,
            data.discount,
            data.ideal,
            clicks,
            rates,
            n_grades,
            w,
            shown,
            k,
        )
    return BatchResult(w, query.T.copy(), shown)

"""Deterministic rankings served in batch: many (query, linear weights) rows at once.

FOLtR-ES clients show every query a stable sort of a perturbed linear ranker's scores, and their
users click by a cascade model. One query at a time that is a dozen small numpy calls, so a round
of thousands of clients is mostly call overhead. Here every row (one query served with some
weights) of a round goes through a handful of array operations.

Equal, not close, to one query at a time: each row's scores are the same per-query product as
``LinearRanker.score``; rows are grouped by document count and each group's top ``k`` is that of a
stable ``argsort`` of the negated scores padded with ``+inf`` (padding sorts after every real
document, ties keep document order), so the shown lists are the sequential ones; clicks come from
the uniforms the users' generators drew, in the sequential order; and every per-list DCG sums
exactly the list's own entries, so numpy adds the same numbers in the same order. A row whose
scores hold NaN is sorted on its own (NaN sorts after the padding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from foltr_async.ltr.metrics import _discount, _gain, ideal_dcg
from foltr_async.ltr.queryset import QuerySet

__all__ = ["Served", "linear_score", "serve_linear", "size_groups"]

#: Padded (rows x documents) cells per group of rows: small enough to stay in cache.
_CHUNK_CELLS = 1 << 16


@dataclass(frozen=True)
class Served:
    """Per row: the shown list's nDCG@k (0 without a relevant document) and its click metrics."""

    ndcg: np.ndarray  # (rows,) float64
    maxrr: np.ndarray  # (rows,) 1 / rank of the first click, 0 without clicks
    click_dcg: np.ndarray  # (rows,) DCG@k of the clicks as 0/1 gains


def size_groups(n_sorted: list[int], k: int) -> list[tuple[int, int]]:
    """Runs of rows (sorted by document count) whose padded (rows x docs) block fits the budget.

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


def _dcg_per_length(gains: np.ndarray, m: np.ndarray) -> np.ndarray:
    """DCG of every row's first ``m`` gains, summed over exactly those (as a list alone is)."""
    out = np.zeros(gains.shape[0])
    for length in np.unique(m).tolist():
        if length:
            rows = np.flatnonzero(m == length)
            out[rows] = (gains[rows, :length] * _discount(length)).sum(axis=1)
    return out


def _stable_top(keys: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` columns of every row's stable ascending argsort, without sorting whole
    rows: the ``k`` smallest keys are those at or below the row's ``k``-th smallest (one
    partition); those candidates, packed to the left of a row in column order (padded with
    ``+inf`` after them), get one small stable argsort per row."""
    n_rows, width = keys.shape
    if k >= width:
        return np.argsort(keys, axis=1, kind="stable")
    kth = np.partition(keys, k - 1, axis=1)[:, k - 1]
    taken = keys <= kth[:, None]
    count = taken.sum(axis=1)
    r, c = np.nonzero(taken)  # row by row, columns ascending
    slot = np.arange(r.size) - np.repeat(np.cumsum(count) - count, count)
    packed = np.full((n_rows, max(int(count.max(initial=0)), k)), np.inf)
    column = np.zeros(packed.shape, dtype=np.int64)
    packed[r, slot] = keys[r, c]
    column[r, slot] = c
    return np.take_along_axis(column, np.argsort(packed, axis=1, kind="stable")[:, :k], axis=1)


def linear_score(block: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A linear ranker's scores of one query (its float64 features): ``block @ w``."""
    return block @ w


def _scores(
    features: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    weights: np.ndarray,
    which: np.ndarray,
    score: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> list[np.ndarray]:
    """``score(features[a : a + s] as float64, weights[w])`` per row, for rows in query order.

    A float32 block times float64 weights is converted to float64 inside every product (the
    bulk of its cost, memory bound); converting once per query for its consecutive rows gives
    the same product (the same float64 operands, one ``gemv`` per row) at a third of the cost.
    """
    out, last, block = [], -1, features[:0]
    for a, s, w in zip(starts.tolist(), sizes.tolist(), which.tolist(), strict=True):
        if a != last:
            block, last = features[a : a + s].astype(np.float64), a
        out.append(score(block, weights[w]))
    return out


def _rankings(
    train: QuerySet,
    starts: np.ndarray,
    sizes: np.ndarray,
    weights: np.ndarray,
    which: np.ndarray,
    k: int,
    score: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """(rows, k) document offsets of every row's stable top-k by its scores."""
    ranking = np.zeros((len(sizes), k), dtype=np.int64)
    by_size = np.lexsort((starts, sizes))  # a query's rows together: its block is read once
    n_sorted = sizes[by_size].tolist()
    for lo, hi in size_groups(n_sorted, k):
        rows = by_size[lo:hi]
        n = sizes[rows]
        width = max(n_sorted[hi - 1], 1)
        flat = np.concatenate(_scores(train.features, starts[rows], n, weights, which[rows], score))
        keys = np.full((rows.size, width), np.inf)
        keys[np.arange(width) < n[:, None]] = -flat
        order = _stable_top(keys, k)
        if np.isnan(flat).any():
            for i in np.flatnonzero(np.isnan(keys).any(axis=1)).tolist():
                own = np.argsort(keys[i, : n[i]], kind="stable")[:k]
                order[i, : own.size] = own
        ranking[rows, : order.shape[1]] = order
    return ranking


def serve_linear(
    train: QuerySet,
    queries: np.ndarray,
    weights: np.ndarray,
    which: np.ndarray,
    uniforms: Sequence[np.ndarray],
    p_click: np.ndarray,
    p_stop: np.ndarray,
    k: int = 10,
    score: Callable[[np.ndarray, np.ndarray], np.ndarray] = linear_score,
) -> Served:
    """Serve row ``r``: query ``queries[r]`` ranked by ``features @ weights[which[r]]`` (stable
    sort, top ``k``); cascade clicks from ``uniforms[r]`` (``2 * min(k, docs)`` values: the click
    then the stop uniforms, ``CascadeModel.simulate``'s ``random((2, m))`` raveled) with one
    model's tables. ``score(block, w)`` gives a row's scores from its query's float64 features
    and its weights (default the linear product; a network's own forward pass serves it)."""
    n_rows = len(queries)
    starts = train.qptr[queries]
    sizes = train.qptr[queries + 1] - starts
    m = np.minimum(sizes, k)
    ranking = _rankings(train, starts, sizes, weights, which, k, score)
    pos = np.arange(k)
    shown = pos < m[:, None]
    labels = np.where(shown, train.labels[starts[:, None] + np.where(shown, ranking, 0)], 0)

    u = np.zeros((n_rows, 2, k))
    u[np.broadcast_to(shown[:, None, :], u.shape)] = np.concatenate(uniforms, axis=None)
    g = np.clip(labels.astype(np.int64), 0, len(p_click) - 1)
    clicks = shown & (u[:, 0] < p_click[g])
    stops = clicks & (u[:, 1] < p_stop[g])
    clicks &= ~(stops.any(axis=1)[:, None] & (pos > np.argmax(stops, axis=1)[:, None]))

    best = ideal_dcg(train, k)[queries]
    dcg = _dcg_per_length(_gain(labels), m)
    ndcg = np.divide(dcg, best, out=np.zeros(n_rows), where=best > 0)
    maxrr = np.where(clicks.any(axis=1), 1.0 / (np.argmax(clicks, axis=1) + 1), 0.0)
    return Served(ndcg, maxrr, _dcg_per_length(_gain(clicks), m))

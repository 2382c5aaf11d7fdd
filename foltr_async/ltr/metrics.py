"""Ranking metrics, vectorised across all queries of a QuerySet.

Held-out evaluation runs every few rounds on thousands of queries, so ``ndcg`` and ``err`` never
loop over queries: one stable ordering by (query, -score) over the whole document axis orders
every query at once (ties keep document order), the top ``k`` rows of each query are kept by their
within-query position, and per-query sums are ``np.bincount`` over the query index.

nDCG (Jarvelin & Kekalainen 2002) uses gain ``2^rel - 1`` and discount ``1 / log2(rank + 1)``; the
ideal ranking is over all the query's judged documents. Queries without a relevant document have
no defined nDCG: ``no_relevant="skip"`` gives nan and ``mean_ndcg`` leaves them out (the FPDGD
authors' convention, Wang et al. 2021), ``"zero"`` counts them as 0 (the PDGD authors' convention,
Oosterhuis & de Rijke 2018). Tie-breaking differs from trec_eval (which breaks score ties by docid
descending): compare with it on distinct scores only.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np

from foltr_async.ltr.clicks import _grade_index
from foltr_async.ltr.queryset import QuerySet

NO_RELEVANT = ("skip", "zero")


@functools.lru_cache(maxsize=64)
def _discount(n: int) -> np.ndarray:
    """``1 / log2(rank + 1)`` for ranks 1..n (read-only: one array per length, shared)."""
    out = 1.0 / np.log2(np.arange(2, n + 2, dtype=np.float64))
    out.setflags(write=False)
    return out


def _gain(labels: np.ndarray) -> np.ndarray:
    return np.exp2(np.asarray(labels, dtype=np.float64)) - 1.0


def dcg_at_k(labels_in_order: np.ndarray, k: int = 10) -> np.ndarray | float:
    """DCG@k of labels in displayed order (over the last axis, so a batch of lists works too)."""
    top = np.asarray(labels_in_order)[..., :k]
    out = (_gain(top) * _discount(top.shape[-1])).sum(axis=-1)
    return float(out) if out.ndim == 0 else out


# Per-QuerySet derived arrays (query index per document, ideal DCG per cutoff) depend only on
# the read-only arrays, so they are computed once per QuerySet.
_CACHE: weakref.WeakKeyDictionary[QuerySet, dict] = weakref.WeakKeyDictionary()


def _query_index(qs: QuerySet) -> np.ndarray:
    cache = _CACHE.setdefault(qs, {})
    if "qidx" not in cache:
        # The smallest dtype lets numpy's stable sort use radix sort (16 bits or less).
        dtype = np.int16 if qs.n_queries < 2**15 else np.int64
        cache["qidx"] = np.repeat(np.arange(qs.n_queries, dtype=dtype), np.diff(qs.qptr))
        cache["qidx"].setflags(write=False)
    return cache["qidx"]


def _descending(key: np.ndarray) -> np.ndarray:
    """Stable descending order: the fast unstable sort unless ties make it ambiguous."""
    order = np.argsort(-key)
    sk = key[order]
    if np.any(sk[1:] == sk[:-1]):
        order = np.argsort(-key, kind="stable")
    return order


def _top_k_rows(key: np.ndarray, qs: QuerySet, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, query index, 0-based rank) of each query's top ``k`` by descending key.

    Ties keep document order. Sorting by key over the whole set, then stably by query, equals a
    lexsort by (query, -key) at a fraction of its cost.
    """
    qidx = _query_index(qs)
    order = _descending(key)
    order = order[np.argsort(qidx[order], kind="stable")]
    rank = np.arange(qs.n_docs) - qs.qptr[qidx]  # qidx is already grouped, so it survives sorting
    keep = rank < k
    return order[keep], qidx[keep].astype(np.int64), rank[keep]


def ideal_dcg(qs: QuerySet, k: int = 10) -> np.ndarray:
    """Per-query DCG@k of the label-sorted ranking of all the query's documents."""
    cache = _CACHE.setdefault(qs, {})
    if ("ideal", k) not in cache:
        doc, q, rank = _top_k_rows(qs.labels.astype(np.float64), qs, k)
        w = _gain(qs.labels[doc]) * _discount(k)[rank]
        ideal = np.bincount(q, weights=w, minlength=qs.n_queries)
        ideal.setflags(write=False)  # shared by every caller
        cache[("ideal", k)] = ideal
    return cache[("ideal", k)]


def _check_scores(scores: np.ndarray, qs: QuerySet) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.shape != (qs.n_docs,):
        raise ValueError(
            f"expected {qs.n_docs} scores (one per document), got shape {scores.shape}"
        )
    return scores


def ndcg(scores: np.ndarray, qs: QuerySet, k: int = 10, no_relevant: str = "skip") -> np.ndarray:
    """nDCG@k per query (float64, one per query); see the module doc for ``no_relevant``."""
    if no_relevant not in NO_RELEVANT:
        raise ValueError(f"no_relevant must be one of {NO_RELEVANT}, got {no_relevant!r}")
    scores = _check_scores(scores, qs)
    doc, q, rank = _top_k_rows(scores, qs, k)
    dcg = np.bincount(q, weights=_gain(qs.labels[doc]) * _discount(k)[rank], minlength=qs.n_queries)
    ideal = ideal_dcg(qs, k)
    out = np.full(qs.n_queries, np.nan if no_relevant == "skip" else 0.0)
    has = ideal > 0
    out[has] = dcg[has] / ideal[has]
    return out


def count_judged(qs: QuerySet) -> int:
    """Queries with at least one relevant document: the only ones whose nDCG is defined (with
    none, every ranking scores 0 under either ``no_relevant`` convention: nothing is measured)."""
    return int(np.count_nonzero(ideal_dcg(qs, 10) > 0))


def mean_ndcg(scores: np.ndarray, qs: QuerySet, k: int = 10, no_relevant: str = "skip") -> float:
    """Mean nDCG@k over queries, skipped (nan) queries left out; nan if every query is skipped."""
    vals = ndcg(scores, qs, k, no_relevant)
    vals = vals[~np.isnan(vals)]
    return float(vals.mean()) if vals.size else float("nan")


def err(scores: np.ndarray, qs: QuerySet, k: int = 10, max_grade: int | None = None) -> np.ndarray:
    """ERR@k per query (Chapelle et al., CIKM 2009): sum_r R_r / r * prod_{i<r} (1 - R_i).

    ``R = (2^g - 1) / 2^max_grade`` with ``max_grade`` the dataset's top grade unless given
    (gdeval, the usual reference, fixes it at 4).
    """
    scores = _check_scores(scores, qs)
    gmax = qs.max_grade if max_grade is None else int(max_grade)
    doc, q, rank = _top_k_rows(scores, qs, k)
    r = _gain(qs.labels[doc]) / 2.0**gmax
    log_keep = np.log1p(-np.minimum(r, 1.0))
    before = np.cumsum(log_keep) - log_keep  # global exclusive prefix, re-based per query below
    first = rank == 0
    base = np.zeros(qs.n_queries)
    base[q[first]] = before[first]
    before -= base[q]
    return np.bincount(q, weights=r / (rank + 1) * np.exp(before), minlength=qs.n_queries)


def expected_maxrr(
    scores: np.ndarray, qs: QuerySet, p_click: np.ndarray, k: int = 10
) -> np.ndarray:
    """Expected MaxRR@k per query of the ranking by ``scores`` under a cascade user.

    ``p_click[g]`` is P(click | grade g). The cascade only stops after a click, so the first
    click is at rank r with probability c_r prod_{i<r} (1 - c_i) and the expectation of 1/r is
    exact (no sampled clicks): the offline counterpart of FOLtR-ES's MaxRR (Kharitonov, WSDM 2019).
    """
    scores = _check_scores(scores, qs)
    doc, q, rank = _top_k_rows(scores, qs, k)
    pc = np.asarray(p_click, dtype=np.float64)
    c = np.zeros((qs.n_queries, k))  # ranks a short query lacks: no document, no click
    c[q, rank] = pc[_grade_index(qs.labels[doc], pc.size)]
    reach = np.cumprod(np.hstack([np.ones((qs.n_queries, 1)), 1.0 - c[:, :-1]]), axis=1)
    return (c * reach / np.arange(1, k + 1)).sum(axis=1)


def offline_metrics(
    scores: np.ndarray,
    qs: QuerySet,
    names: tuple[str, ...],
    *,
    no_relevant: str = "skip",
    p_click: np.ndarray | None = None,
    max_grade: int | None = None,
) -> dict[str, float]:
    """The held-out metrics ``names`` of one scoring of ``qs``, each a mean over its queries.

    Every protocol's offline evaluation goes through here, so one metric name means one number:
    ``ndcg@K`` (under ``no_relevant="skip"`` queries without a relevant document are left out,
    0.0 when none is left), ``ndcg`` (over every candidate of the longest query), ``err@K``
    (``max_grade`` as in ``err``) and ``maxrr@K`` (expected, users clicking grade g with
    ``p_click[g]``).
    """
    out = {}
    for name in names:
        metric, _, depth = name.partition("@")
        if metric == "ndcg":
            k = int(depth) if depth else (int(np.diff(qs.qptr).max()) if qs.n_queries else 10)
            values = ndcg(scores, qs, k, no_relevant)
            out[name] = float(np.nanmean(values)) if np.isfinite(values).any() else 0.0
        elif metric == "err" and depth:
            out[name] = float(np.mean(err(scores, qs, int(depth), max_grade)))
        elif metric == "maxrr" and depth and p_click is not None:
            out[name] = float(expected_maxrr(scores, qs, p_click, int(depth)).mean())
        else:
            raise ValueError(f"unknown offline metric {name!r} (or maxrr without p_click)")
    return out


def ndcg_of_ranking(ranked_labels: np.ndarray, all_labels: np.ndarray, k: int = 10) -> float:
    """nDCG@k of one displayed list against all the query's labels; 0 if none is relevant."""
    ideal = dcg_at_k(np.sort(np.asarray(all_labels))[::-1], k)
    return dcg_at_k(ranked_labels, k) / ideal if ideal > 0 else 0.0


def maxrr(clicks: np.ndarray, k: int = 10) -> np.ndarray | float:
    """Max reciprocal rank of a click in the top k (1/rank of the first click), 0 if none.

    The FOLtR-ES metric (Kharitonov, WSDM 2019): 11 possible values at k = 10. Works on a batch
    of click lists over the last axis.
    """
    top = np.asarray(clicks, dtype=bool)[..., :k]
    out = np.where(top.any(axis=-1), 1.0 / (np.argmax(top, axis=-1) + 1), 0.0)
    return float(out) if out.ndim == 0 else out


#: The online metric's discount per displayed ranking (the PDGD and FPDGD authors').
ONLINE_GAMMA = 0.9995


class OnlineDiscounted:
    """Online performance: sum over displayed rankings, in order, of gamma^t * nDCG@10 (t from 0).

    The cumulative discounted measure of Hofmann et al. (2011) as reported by PDGD and FPDGD.
    """

    def __init__(self, gamma: float = ONLINE_GAMMA, k: int = 10) -> None:
        self.gamma = float(gamma)
        self.k = int(k)
        self.t = 0
        self.value = 0.0

    def add(self, ndcg_value: float) -> None:
        self.value += self.gamma**self.t * float(ndcg_value)
        self.t += 1

    def add_ranking(self, ranked_labels: np.ndarray, all_labels: np.ndarray) -> float:
        """Score one displayed list, add it, and return its nDCG@k."""
        v = ndcg_of_ranking(ranked_labels, all_labels, self.k)
        self.add(v)
        return v

"""Pure functions both roles and the cost benchmark call: a ListNet or pointwise step and the
evaluation of a linear model, and the owner's and querier's halves of a reverse top-K by
RTK-Sketch and by NAIVE (``foltr_async.protocols.rtk_cost`` times them on one collection)."""

from __future__ import annotations

import numpy as np

from foltr_async.ltr.metrics import offline_metrics
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.sketch import (
    DocSketch,
    RTKSketch,
    median_estimate,
    noisy_answer,
    soft_intersection,
    top_k,
)


def listnet_step(w: np.ndarray, qs: QuerySet, lr: float) -> np.ndarray:
    """One full-batch ListNet ascent step (top-one cross entropy, Cao et al. 2007).

    Per query, softmax over scores against the target distribution of gains 2^grade - 1 (a
    softmax over raw grades is nearly uniform on long candidate lists, most of them irrelevant,
    and teaches little); the gradient is X^T (P_target - P_scores) / n_queries, with segment
    sums by ``reduceat`` (no query loop). Every query needs a relevant document.
    """
    if qs.n_queries == 0:
        return w
    x = qs.features
    starts, sizes = qs.qptr[:-1], np.diff(qs.qptr)

    def softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - np.repeat(np.maximum.reduceat(v, starts), sizes))
        return e / np.repeat(np.add.reduceat(e, starts), sizes)

    gain = np.exp2(qs.labels.astype(np.float64)) - 1.0
    target = gain / np.repeat(np.add.reduceat(gain, starts), sizes)
    pred = softmax(x @ w)
    return w + lr * (x.T.astype(np.float64) @ (target - pred)) / qs.n_queries


def pointwise_step(w: np.ndarray, qs: QuerySet, lr: float) -> np.ndarray:
    """One full-batch least-squares step on the grades (a pointwise model): the gradient of
    half the mean squared error over all instances, X^T (y - X w) / n_docs."""
    if qs.n_docs == 0:
        return w
    x = qs.features.astype(np.float64)
    return w + lr * (x.T @ (qs.labels.astype(np.float64) - x @ w)) / qs.n_docs


STEPS = {"listnet": listnet_step, "pointwise": pointwise_step}


def evaluate(w: np.ndarray, test: QuerySet) -> dict[str, float]:
    """nDCG@10, ERR@10 (grades 0-2) and nDCG (all candidates) of a linear model on the test set."""
    return offline_metrics(test.features @ w, test, ("ndcg@10", "err@10", "ndcg"), max_grade=2)


def rtk_answer(rtk: RTKSketch, cols: np.ndarray, eps: float, rng: np.random.Generator) -> dict:
    """Owner: the requested RTK cells, every count shifted by one shared Laplace(1/eps) draw."""
    ptr, docs, counts, full = rtk.cells(cols)
    return {"ptr": ptr, "docs": docs, "counts": noisy_answer(counts, eps, rng), "full": full}


def rtk_top(
    answer: dict, private: np.ndarray, k: int, beta: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Querier: each term's top-k documents and count bounds from its private cells only."""
    m, z = private.shape
    ptr = answer["ptr"]
    found, bounds = [], []
    for i in range(m):  # a handful of query terms; each term's cells are vectorised
        lo, hi = ptr[i * z], ptr[(i + 1) * z]
        docs, est = soft_intersection(
            ptr[i * z : (i + 1) * z + 1] - lo,
            answer["docs"][lo:hi],
            answer["counts"][lo:hi],
            answer["full"][i * z : (i + 1) * z],
            private[i],
            k,
            beta,
        )
        found.append(docs)
        bounds.append(np.maximum(est, 0.0))
    return found, bounds


def naive_answer(
    sketch: DocSketch, cols: np.ndarray, signs: np.ndarray, eps: float, rng: np.random.Generator
) -> np.ndarray:
    """Owner: one term's z signed entries in every document, each document with its own noise
    (NAIVE asks every document, each a query of its own)."""
    vals = sketch.lookup(np.arange(sketch.n_docs), cols[0]) * signs[0]  # (n, z)
    return noisy_answer(vals, eps, rng, per="row").astype(np.float32)


def naive_top(values: np.ndarray, private: np.ndarray, k: int) -> np.ndarray:
    """Querier: the top-k documents by the median over its private rows."""
    est = median_estimate(values.astype(np.float64)[:, None, :], private)
    return top_k(est[:, 0], k)

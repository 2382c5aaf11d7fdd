"""Compiled (numba) local SGD of a linear ranker: FedIPS's client training
(``protocols/fedips.py``) on IPS-weighted hinge losses, and its full-information LambdaRank
skyline, one call per client and round; and the relevance regression of its federated EM.

The numpy path takes ~6 calls per query (score, the margins or lambdas, the gradient over the
scores, the ranker's gradient, the step), a few microseconds each on MQ-sized queries; this is
one call for a client's whole round. It computes the same quantities in the same sequence of
steps (one step per query in order, ``epochs`` passes), so it equals the numpy path up to float
rounding: scores are the PDGD kernel's ``linear_scores`` (four partial sums per row) and
gradients are summed in loop order, rather than BLAS's or numpy's pairwise order (tests compare
the two on random rounds).

Imported on first use (numba's import and the disk cache load cost ~0.4 s), as ``pdgd_kernel``.
"""

from __future__ import annotations

import numpy as np

from foltr_async.ltr.pdgd_kernel import jit, linear_scores

__all__ = ["hinge_sgd_linear", "lambdarank_sgd_linear", "logistic_ascent"]


@jit
def _widest(qptr, qs):
    """The most documents of any query of ``qs`` (the size of a round's scratch arrays)."""
    widest = 0
    for b in range(qs.size):
        widest = max(widest, qptr[qs[b] + 1] - qptr[qs[b]])
    return widest


@jit
def _step(w, features, first, n, weights, lr, grad):
    """``w += lr * X^T weights`` over the query's rows ``first ..`` with a non-zero weight (the
    linear ranker's gradient of ``sum_i weights_i * score_i``)."""
    grad[:] = 0.0
    for i in range(n):
        if weights[i] != 0.0:
            row = features[first + i]
            for f in range(w.size):
                grad[f] += np.float64(row[f]) * weights[i]
    for f in range(w.size):
        w[f] = w[f] + lr * grad[f]


@jit
def hinge_sgd_linear(w, features, qptr, table, qs, clicks, prop, lr, epochs):
    """``w`` (float64, updated in place) after ``epochs`` passes of one SGD step per query of
    ``qs`` on ``sum_c (n_c / p_c) sum_{d'} max(0, 1 - (s_c - s_d'))``.

    ``clicks[b, r]``: clicks on rank ``r`` of query ``qs[b]`` (a count, or 0 / 1), whose
    document is ``table[q, r]`` (an offset within the query; -1 pads a short query);
    ``prop[r]``: the propensity of rank ``r``. A query without clicks takes no step. The
    ``d' = c`` term is the constant 1 with zero gradient, as in ``hinge_score_gradient``.
    """
    k = table.shape[1]
    widest = _widest(qptr, qs)
    scores = np.empty(widest)
    g = np.empty(widest)
    grad = np.empty(w.size)
    for _ in range(epochs):
        for b in range(qs.size):
            q = qs[b]
            clicked = False
            for r in range(k):
                if clicks[b, r] != 0 and table[q, r] >= 0:
                    clicked = True
            if not clicked:
                continue
            first = qptr[q]
            n = qptr[q + 1] - first
            linear_scores(features, first, n, w, scores, 0)
            g[:n] = 0.0
            for r in range(k):
                c = clicks[b, r]
                d = table[q, r]
                if c == 0 or d < 0:
                    continue
                inv = 1.0 / (prop[r] / c)  # a slot clicked n times weighs n / p
                top = scores[d]
                active = 0
                for j in range(n):
                    if 1.0 - (top - scores[j]) > 0.0:
                        g[j] += inv  # each active d' is pushed up by 1/p ...
                        active += 1
                g[d] -= inv * active  # ... and the clicked one down by the same total
            _step(w, features, first, n, g, -lr, grad)  # descent on the loss
    return w


@jit
def lambdarank_sgd_linear(w, features, labels, qptr, qs, lr, epochs, k):
    """``w`` (float64, updated in place) after ``epochs`` passes of one LambdaRank ascent step
    per query of ``qs`` (in the given order), as ``train_lambdarank`` and ``lambda_weights``:
    pairs with a member in the current top ``k`` and different grades, |Delta nDCG@k| / (1 +
    exp(s_better - s_worse)), added to the better document, taken from the worse."""
    widest = _widest(qptr, qs)
    s = np.empty(widest)
    lam = np.empty(widest)
    grad = np.empty(w.size)
    rank = np.empty(widest, dtype=np.int64)
    gains = np.empty(widest)
    for _ in range(epochs):
        for b in range(qs.size):
            q = qs[b]
            first = qptr[q]
            n = qptr[q + 1] - first
            cut = min(k, n)
            for i in range(n):
                gains[i] = 2.0 ** np.float64(labels[first + i]) - 1.0
            best = np.sort(gains[:n])
            ideal = 0.0
            for a in range(cut):
                ideal += best[n - 1 - a] * (1.0 / np.log2(a + 2.0))
            if ideal <= 0.0:
                continue
            linear_scores(features, first, n, w, s, 0)
            order = np.argsort(-s[:n], kind="mergesort")  # stable, as the numpy path's
            for r in range(n):
                rank[order[r]] = r
            lam[:n] = 0.0
            moved = False
            for a in range(cut):
                i = order[a]
                yi = np.float64(labels[first + i])
                di = 1.0 / np.log2(a + 2.0)
                for j in range(n):
                    if rank[j] <= a:
                        continue
                    yj = np.float64(labels[first + j])
                    if yi == yj:
                        continue
                    dj = 1.0 / np.log2(rank[j] + 2.0) if rank[j] < cut else 0.0
                    sign = 1.0 if yi > yj else -1.0
                    delta = abs((gains[i] - gains[j]) * (di - dj))
                    v = delta / ideal * 0.5 * (1.0 - np.tanh(0.5 * sign * (s[i] - s[j])))
                    lam[i] += v * sign
                    lam[j] -= v * sign
                    moved = moved or v != 0.0
            if not moved:
                continue
            _step(w, features, first, n, lam, lr, grad)  # ascent on the lambdas
    return w


@jit
def logistic_ascent(w, x, targets, steps, lr):
    """``w = [weights, bias]`` (float64, updated in place) after ``steps`` full-batch ascent
    steps of the mean soft-label log-likelihood of sigmoid(w . x + b) on ``targets``."""
    rows, n_feat = x.shape
    n = max(rows, 1)
    r = np.empty(rows)
    g = np.empty(n_feat)
    for _ in range(steps):
        linear_scores(x, 0, rows, w[:n_feat], r, 0)
        for i in range(rows):
            r[i] = targets[i] - 0.5 * (1.0 + np.tanh(0.5 * (r[i] + w[n_feat])))
        g[:] = 0.0
        total = 0.0
        for i in range(rows):
            total += r[i]
            for f in range(n_feat):
                g[f] += np.float64(x[i, f]) * r[i]
        for f in range(n_feat):
            w[f] += lr * g[f] / n
        w[n_feat] += lr * total / n
    return w

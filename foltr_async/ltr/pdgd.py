"""Pairwise Differentiable Gradient Descent (Oosterhuis & de Rijke, CIKM 2018), per query.

One interaction: score every candidate document, sample the displayed top ``k`` from the
Plackett-Luce distribution of the scores, observe clicks, infer preferences (each clicked document
over every unclicked one above the last click, plus the unclicked one just below it, as the
authors' code does), weight each pair by ``e^si e^sj / (e^si + e^sj)^2`` times the debiasing factor

    rho = P(swapped ranking) / (P(shown ranking) + P(swapped ranking)),

and ascend ``sum_pairs w * rho * (grad s_i - grad s_j)``. FPDGD (Wang et al., ICTIR 2021) runs
exactly this on every client, so everything here is per query, numpy only, with no per-pair loop.

Why rho is cheap: swapping two displayed documents at positions ``lo < hi`` only permutes the
numerators of the Plackett-Luce product, and only the denominators of the positions strictly
between ``lo`` and ``hi`` see a different set of remaining documents. So
``log P(swapped) - log P(shown) = sum_{lo < p <= hi} log D(p) - log D'(p)``, with ``D(p)`` the sum
of ``exp(score)`` over the query's documents not yet placed before position ``p``. Both ``D`` and
``D'`` (one row per pair) come from reversed log-add-exp accumulations, which stay exact for any
score range (no overflow, no cancellation).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from foltr_async.ltr.metrics import OnlineDiscounted, mean_ndcg
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import Ranker

SERP_LENGTH = 10


def sample_ranking(scores: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Plackett-Luce top-``k`` without replacement (all documents if the query has fewer).

    Gumbel-top-k: the ``k`` largest of ``score + Gumbel noise`` are distributed exactly as
    sequential softmax sampling without replacement, and no exponential is ever taken.
    """
    z = np.asarray(scores, dtype=np.float64) + rng.gumbel(size=len(scores))
    n = z.size
    if k < n:
        top = np.argpartition(-z, k - 1)[:k]
        return top[np.argsort(-z[top], kind="stable")]
    return np.argsort(-z, kind="stable")


def preference_pairs(clicks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Display positions (preferred, other) of the inferred pairs.

    Each clicked position over every unclicked position up to one below the last click.
    """
    clicks = np.asarray(clicks, dtype=bool)
    clicked = np.flatnonzero(clicks)
    if clicked.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    upto = np.arange(min(int(clicked[-1]) + 2, clicks.size))
    unclicked = upto[~clicks[upto]]
    return np.repeat(clicked, unclicked.size), np.tile(unclicked, clicked.size)


def debias_weights(
    scores: np.ndarray, ranking: np.ndarray, pos: np.ndarray, neg: np.ndarray
) -> np.ndarray:
    """rho = P(swapped) / (P(shown) + P(swapped)) for each pair of display positions."""
    scores = np.asarray(scores, dtype=np.float64)
    shown = scores[ranking]
    k = shown.size
    rest = np.ones(scores.size, dtype=bool)
    rest[ranking] = False
    log_rest = np.logaddexp.reduce(scores[rest]) if rest.any() else -np.inf
    # log D(p): documents at positions >= p plus the undisplayed ones.
    log_d = np.logaddexp(np.logaddexp.accumulate(shown[::-1])[::-1], log_rest)
    rows = np.arange(pos.size)
    swapped = np.broadcast_to(shown, (pos.size, k)).copy()
    swapped[rows, pos] = shown[neg]
    swapped[rows, neg] = shown[pos]
    log_d_swapped = np.logaddexp(
        np.logaddexp.accumulate(swapped[:, ::-1], axis=1)[:, ::-1], log_rest
    )
    p = np.arange(k)
    between = (p > np.minimum(pos, neg)[:, None]) & (p <= np.maximum(pos, neg)[:, None])
    log_ratio = np.where(between, log_d - log_d_swapped, 0.0).sum(axis=1)
    return 0.5 * (1.0 + np.tanh(0.5 * log_ratio))  # sigmoid, stable for any magnitude


def pair_weights(scores: np.ndarray, ranking: np.ndarray, clicks: np.ndarray) -> np.ndarray:
    """Per-document weights (n_docs,) whose ``ranker.grad`` is the PDGD gradient."""
    scores = np.asarray(scores, dtype=np.float64)
    pos, neg = preference_pairs(clicks)
    if pos.size == 0:
        return np.zeros(scores.size)
    di, dj = ranking[pos], ranking[neg]
    e = np.exp(-np.abs(scores[di] - scores[dj]))
    w = e / (1.0 + e) ** 2 * debias_weights(scores, ranking, pos, neg)
    return np.bincount(
        np.concatenate((di, dj)), weights=np.concatenate((w, -w)), minlength=scores.size
    )


def pdgd_gradient(
    ranker: Ranker,
    features: np.ndarray,
    ranking: np.ndarray,
    clicks: np.ndarray,
    scores: np.ndarray,
    weights: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """The PDGD ascent direction (flat, ``ranker.n_params``) for one displayed ranking.

    ``scores`` are the ones the ranking was sampled from (all of the query's documents);
    ``weights(scores, ranking, clicks)`` computes the per-document pair weights (default
    ``pair_weights``; the compiled twin is ``pdgd_batch.compiled_pair_weights``).
    """
    if not np.any(clicks):
        return np.zeros(ranker.n_params)
    return ranker.grad(features, (weights or pair_weights)(scores, ranking, clicks))


def pdgd_update(
    ranker: Ranker,
    features: np.ndarray,
    ranking: np.ndarray,
    clicks: np.ndarray,
    scores: np.ndarray,
    lr: float,
) -> np.ndarray:
    """One ascent step in place; returns the gradient (before scaling by ``lr``)."""
    g = pdgd_gradient(ranker, features, ranking, clicks, scores)
    if np.any(g):
        ranker.set_params(ranker.get_params() + lr * g)
    return g


def interaction_gradient(
    ranker: Ranker,
    features: np.ndarray,
    labels: np.ndarray,
    click_model,
    rng: np.random.Generator,
    k: int = SERP_LENGTH,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Score, sample, simulate clicks: returns (ranking, clicks, gradient) without stepping."""
    scores = ranker.score(features)
    ranking = sample_ranking(scores, k, rng)
    clicks = click_model.simulate(labels[ranking], rng)
    return ranking, clicks, pdgd_gradient(ranker, features, ranking, clicks, scores)


def pdgd_interaction(
    ranker: Ranker,
    features: np.ndarray,
    labels: np.ndarray,
    click_model,
    rng: np.random.Generator,
    *,
    lr: float = 0.1,
    k: int = SERP_LENGTH,
) -> tuple[np.ndarray, np.ndarray]:
    """One full PDGD interaction on a query, updating ``ranker``; returns (ranking, clicks)."""
    ranking, clicks, g = interaction_gradient(ranker, features, labels, click_model, rng, k)
    if np.any(g):
        ranker.set_params(ranker.get_params() + lr * g)
    return ranking, clicks


def run_centralised(
    train: QuerySet,
    test: QuerySet,
    ranker: Ranker,
    click_model,
    *,
    n_interactions: int,
    lr: float = 0.1,
    eval_every: int,
    batch: int = 1,
    rng: np.random.Generator,
    k: int = SERP_LENGTH,
    no_relevant: str = "skip",
) -> dict:
    """A centralised PDGD learning curve: the single-client baseline every FOLTR paper reports.

    Queries are drawn uniformly from ``train``; every ``eval_every`` interactions (and at 0 and
    the end) the offline nDCG@k of ``ranker`` on ``test`` is recorded. With ``batch > 1`` the
    gradients of ``batch`` interactions (all made with the same weights) are summed before one
    step, as a FPDGD client with a local batch would. ``ranker`` is trained in place.
    """
    if n_interactions < 0 or eval_every < 1 or batch < 1:
        raise ValueError("need n_interactions >= 0, eval_every >= 1 and batch >= 1")

    def evaluate() -> float:
        return mean_ndcg(ranker.score(test.features), test, k, no_relevant)

    eval_at, offline = [0], [evaluate()]
    online = OnlineDiscounted(k=k)
    online_ndcg = np.empty(n_interactions)
    pending = np.zeros(ranker.n_params)
    queries = rng.integers(train.n_queries, size=n_interactions)
    for t, q in enumerate(queries, start=1):
        features, labels = train.query(int(q))
        ranking, _, g = interaction_gradient(ranker, features, labels, click_model, rng, k)
        online_ndcg[t - 1] = online.add_ranking(labels[ranking], labels)
        pending += g
        if t % batch == 0 or t == n_interactions:
            ranker.set_params(ranker.get_params() + lr * pending)
            pending[:] = 0.0
        if t % eval_every == 0 or t == n_interactions:
            eval_at.append(t)
            offline.append(evaluate())
    return {
        "eval_at": np.array(eval_at),
        "offline_ndcg": np.array(offline),
        "online_ndcg": online_ndcg,
        "online_discounted": online.value,
        "no_relevant": no_relevant,
        "ranker": ranker,
    }

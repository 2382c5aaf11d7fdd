"""The pieces of FPDGD's unlearning strategies that are not messages: FedEraser's calibration,
PGA's reference model and projection, FedRemove's replay of stored updates, and the relevance
reset check (the forgotten clients' hardest queries relabelled before training, to see whether
the unlearned model still reflects the relabelling).

PGA follows Halimi et al. (2022) as the unlearning-for-FOLTR study (SIGIR 2025) generalised it to
several forgotten clients: the reference model is the global model without the client's own last
contribution, the client ascends its own loss (reversed PDGD steps) inside a ball around it, and
the remaining clients then train on. The ball's radius is the study code's rule: a factor times
the mean distance of the reference model to ten random N(0, 0.01^2) models.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from foltr_async.ltr.queryset import QuerySet
from foltr_async.runtime.engine import Strategy

#: how many random models PGA's radius is measured against, and their scale (the study's code)
RANDOM_MODELS = 10
RANDOM_SCALE = 0.01
#: documents of a query the relevance-reset loss compares (the displayed top K)
LOSS_DEPTH = 10


def calibrate(stored: np.ndarray, new: np.ndarray) -> np.ndarray:
    """FedEraser calibration: the new update's direction with the stored update's length."""
    norm_new = float(np.linalg.norm(new))
    if norm_new == 0.0:
        return np.zeros_like(new)
    return float(np.linalg.norm(stored)) * new / norm_new


def reference_model(global_model: np.ndarray, own: np.ndarray, n_clients: int) -> np.ndarray:
    """The global model without one of its ``n_clients`` equally weighted contributions
    (``own``): what the others' average was (Halimi et al.'s reference model)."""
    if n_clients < 2:
        return global_model.copy()
    return (n_clients * global_model - own) / (n_clients - 1)


def pga_radius(reference: np.ndarray, factor: float, rng: np.random.Generator) -> float:
    """The ball PGA stays in: ``factor`` times the mean distance of the reference model to
    random models."""
    draws = rng.standard_normal((RANDOM_MODELS, reference.size)) * RANDOM_SCALE
    return factor * float(np.linalg.norm(draws - reference, axis=1).mean())


def project(theta: np.ndarray, centre: np.ndarray, radius: float) -> np.ndarray:
    """``theta`` moved onto the L2 ball of ``radius`` around ``centre`` when outside it."""
    away = theta - centre
    norm = float(np.linalg.norm(away))
    return theta if norm <= radius else centre + away * (radius / norm)


class ReplayStrategy(Strategy):
    """FedRemove: the server rebuilds the global model from the updates it stored, leaving the
    forgotten clients' out; one replayed round per training round, no client asked.

    ``history[t]`` is training round t's model before aggregation and its replies as (client,
    model sent, weight). ``replay = "updates"`` applies the remaining clients' updates (what they
    sent minus the model they started from) to the rebuilt model, from the initial one;
    ``"models"`` (the study's code) sets the model to the remaining clients' stored models of
    each round, which were trained from the original, unforgotten global model.
    """

    broadcast_kind = reply_kind = ""
    asks_clients = False

    def __init__(self, base, history: list, forgotten: set[str], replay: str) -> None:
        self.base = base
        self.history = history
        self.forgotten = forgotten
        self.replay = replay
        self.first_round = 0
        self.replayed = 0  # rounds in which a remaining client's update was replayed
        base.model = base.ctx.new_ranker().get_params()

    def select(self, round, candidates, rng, plan) -> list[str]:
        """Replay the stored round (the server's own work) and ask nobody."""
        start, replies = self.history[round - self.first_round]
        kept = [(m, w) for c, m, w in replies if c not in self.forgotten]
        if kept:
            base = self.base
            models = np.stack([m for m, _ in kept])
            if self.replay == "updates":
                models = base.model + (models - start)
            weights = np.array([w for _, w in kept], dtype=np.float64)
            base.model = base.ctx.aggregator.fn(models, weights, base.ctx.config.assumed_malicious)
            self.replayed += 1
        return []

    def configure_round(self, round: int) -> dict:
        return {}

    def aggregate(self, round: int, replies: list) -> dict:
        return {}

    def evaluate(self) -> dict[str, float]:
        return self.base.evaluate()


def reset_loss(scores: np.ndarray, labels: np.ndarray) -> float:
    """The study's relevance-reset loss of one query: the cross-entropy of the softmax of the
    labels against the softmax of the scores, over the ``LOSS_DEPTH`` top-scored documents."""
    top = np.argsort(-scores, kind="stable")[:LOSS_DEPTH]
    s = scores[top] - scores[top].max()
    g = labels[top].astype(np.float64)
    g -= g.max()
    p_score = np.exp(s) / np.exp(s).sum()
    p_label = np.exp(g) / np.exp(g).sum()
    return float(-(p_label * np.log(np.clip(p_score, 1e-10, 1.0))).sum())


def reset_labels(labels: np.ndarray, n_grades: int) -> np.ndarray:
    """A query's labels turned upside down, as the study resets them: documents in descending
    order of relevance get the lowest grade first (three grades: the top 20% grade 0, the next
    30% grade 1, the rest grade 2; otherwise equal bands, one per grade)."""
    order = np.argsort(-labels, kind="stable")
    n = len(order)
    new = np.empty(n, dtype=labels.dtype)
    if n_grades == 3:
        cuts = [int(n * 0.2), int(n * 0.5)]
    else:
        size = int(n / n_grades)
        cuts = [size * i for i in range(1, n_grades)]
    for grade, part in enumerate(np.split(order, cuts)):
        new[part] = grade
    return new


def mean_reset_loss(ranker, train: QuerySet, queries: list[int]) -> float:
    """``reset_loss`` of the ranker averaged over ``queries`` (NaN without any)."""
    if not queries:
        return float("nan")
    return float(np.mean([_query_loss(ranker, train, q) for q in queries]))


def _query_loss(ranker, train: QuerySet, q: int) -> float:
    docs = train.doc_range(q)
    return reset_loss(ranker.score(train.features[docs]), train.labels[docs])


def high_loss_queries(ranker, train: QuerySet, queries: np.ndarray) -> list[int]:
    """The client's queries whose loss under ``ranker`` is above their median: the ones the
    study relabels."""
    qs = sorted({int(q) for q in queries})
    losses = [_query_loss(ranker, train, q) for q in qs]
    cut = float(np.percentile(losses, 50))
    return [q for q, loss in zip(qs, losses, strict=True) if loss > cut]


def relabelled(train: QuerySet, queries: list[int], n_grades: int) -> QuerySet:
    """The training set with ``queries``' labels reset (a new set: the loaded one is shared)."""
    labels = train.labels.copy()
    for q in queries:
        rng_q = train.doc_range(q)
        labels[rng_q] = reset_labels(train.labels[rng_q], n_grades)
    return replace(train, labels=labels)

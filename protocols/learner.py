"""The one PDGD learner: a client's ranker copy, its users, and local PDGD training.

Every PDGD client (FPDGD, asynchronous FPDGD, the non-IID remedies, the tutorial's FedAvgM) trains
through ``PDGDLearner.learn``, and centralised PDGD's clients show rankings through its ``serve``
while its server learns from their logs through ``learn_logged``, so the interaction loop (sample a
Plackett-Luce ranking, show it, step on the clicks) is written once. ``learn`` hands the training to
the run's compute pool (``BatchPool``), which trains every pending learner in one batched pass
(``foltr_async.ltr.pdgd_batch``), whenever the batched path computes the same thing: a linear ranker
or a one-hidden-layer tanh MLP; cascade, position-based or mixed users, drawing queries at random or
replaying a log; shared data in the same training set; PDGD steps with or without FedProx's
proximal term and DP clipping. Otherwise it trains one query at a time
(``train``, also the reference the batched path is tested against). Which path it took, and why
when not batched, is counted per run (``learner_interactions``, ``PATHS``). Each learner draws from
its own generator exactly as ``train`` does, so batching changes what its users see only up to
float rounding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from foltr_async.contract import RunContext
from foltr_async.ltr.pdgd import pdgd_gradient, sample_ranking
from foltr_async.ltr.pdgd_batch import (
    PDGDJob,
    batchable_clicks,
    compiled_pair_weights,
    learn_logged_linear,
    prepare,
    serve_linear_batch,
    train_linear_batch,
    train_mlp_batch,
)
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import LinearRanker, MLPRanker
from foltr_async.protocols.users import K, Users
from foltr_async.runtime.compute import BatchPool
from foltr_async.runtime.trust import worker_extras

#: the paths ``learn`` trains by, one name each (``learner_interactions`` in a repeat's results:
#: its interactions per path; ``learner.path`` in a variant's summary): the batched pass, or one
#: query at a time and why
BATCHED = "batched"
ONE_QUERY = "one query at a time"
WHY = {
    "ranker": "a ranker other than linear or an MLP of one tanh hidden layer",
    "clicks": "a click model other than cascade, position-based or a mixture of them",
    "shared": "shared data in another training set",
    "pool": "no batched pool in this run",
    "step": "a transform of every step's gradient (an attack's)",
}
PATHS = (BATCHED, *(f"{ONE_QUERY}: {why}" for why in WHY.values()))

# workers count their own clients' interactions per path; the server adds them up
worker_extras("learner_interactions", "counters")


def learner_paths(ctx: RunContext) -> dict[str, int]:
    """The run's interactions per learner path (``PATHS``), in its probe's extras: a protocol
    run whose clients train with ``PDGDLearner`` makes it when built, so a multi-process run's
    server holds the names its workers' counts are added to."""
    return ctx.probe.extras.setdefault("learner_interactions", dict.fromkeys(PATHS, 0))


class Served(NamedTuple):
    """One query as the users saw it: the candidates' features and scores, the shown ranking
    (document offsets in the query) and its clicks."""

    features: np.ndarray
    scores: np.ndarray
    ranking: np.ndarray
    clicks: np.ndarray


def clip_norm(theta: np.ndarray, bound: float, order: int = 2) -> np.ndarray:
    """theta * min(1, bound / ||theta||) in the L``order`` norm."""
    norm = float(np.linalg.norm(theta, ord=order))
    return theta if norm <= bound else theta * (bound / norm)


class PDGDLearner:
    """A client's ranker copy and users, trained by PDGD from its users' clicks.

    ``lr``: the step size (None: the learner only serves, as FOLtR-ES's clients);
    ``clip``: (bound, norm order) applied to the weights after every step (FPDGD's DP), or None;
    ``mu``: FedProx's proximal term, ``-lr mu (w - start)`` per step; ``shared_users``: users of
    shared data (non-IID data sharing) whose queries are mixed in with the client's own;
    ``shows``: its users' rankings are logged in batches (``show``, centralised PDGD's clients);
    ``step_transform`` (set by an attacker): ``f(gradient, rng)`` replaces every step's PDGD
    gradient, one query at a time; ``agent``: the client agent whose users these are (their
    rankings count in the round of the message it handles).
    """

    def __init__(
        self,
        ctx: RunContext,
        queries: np.ndarray,
        rng: np.random.Generator,
        owner: str = "",
        *,
        agent=None,
        lr: float | None = None,
        click_model=None,
        clip: tuple[float, int] | None = None,
        mu: float = 0.0,
        shows: bool = False,
    ) -> None:
        self.ctx = ctx
        self.ranker = ctx.new_ranker()
        own = ctx.client_data(owner)
        self.users = Users(
            ctx.train_set(owner),
            queries,
            click_model or ctx.users_click_model(owner),
            rng,
            ctx.probe,
            owner,
            own.arrivals if own is not None else None,
            agent,
        )
        self.rng = rng
        self.lr = lr
        self.clip = clip
        self.mu = mu
        self.shared_users: Users | None = None
        self.step_transform: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None
        #: the run's pool for the batched path (created with the first learner that may use it,
        #: so a run prepares it before its rounds start)
        self.pool = train_pool(ctx) if lr is not None and batch_kind(self.ranker) else None
        #: the run's pool batching ``show`` (made before the rounds start, like ``pool``)
        linear = isinstance(self.ranker, LinearRanker)
        batchable = batchable_clicks(self.users.click_model) and self.users.arrivals is None
        self.show_pool = show_pool(ctx) if shows and linear and batchable else None
        if lr is not None:
            learner_paths(ctx)

    def serve(self, q: int, users: Users | None = None) -> Served:
        """Show query ``q``'s top K sampled from the ranker's Plackett-Luce distribution."""
        users = users or self.users
        train = users.train
        features = train.features[train.doc_range(q)]
        scores = self.ranker.score(features)
        ranking = sample_ranking(scores, K, self.rng)
        return Served(features, scores, ranking, users.show(q, ranking))

    @property
    def batched(self) -> bool:
        """Whether ``learn`` goes to the batched pass (which computes what ``train`` would)."""
        return self.path == BATCHED

    @property
    def path(self) -> str:
        """The path ``learn`` takes (one of ``PATHS``): ``BATCHED``, or one query at a time
        and why."""
        shared = self.shared_users
        if self.step_transform is not None:
            why = "step"
        elif self.pool is None:
            why = "pool" if batch_kind(self.ranker) else "ranker"
        elif not batchable_clicks(self.users.click_model) or (
            shared is not None and not batchable_clicks(shared.click_model)
        ):
            why = "clicks"
        elif shared is not None and shared.train is not self.users.train:
            why = "shared"
        else:
            return BATCHED
        return f"{ONE_QUERY}: {WHY[why]}"

    async def show(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` queries shown from the ranker's current weights, each as ``serve`` shows it:
        the queries, the shown rankings (n x K document offsets, -1 past a short list) and
        their clicks. Batched with the run's other loggers (``show_pool``) where it can be."""
        users = self.users
        if self.show_pool is not None:
            weights = self.ranker.get_params()
            job = PDGDJob(weights, users.queries, n, self.rng, users.click_model, 0.0)
            return await self.show_pool.submit((self, job))
        queries = np.empty(n, dtype=np.int64)
        rankings = np.full((n, K), -1, dtype=np.int64)
        clicks = np.zeros((n, K), dtype=bool)
        for i in range(n):
            q = queries[i] = users.next_query()
            shown = self.serve(q)
            rankings[i, : shown.ranking.size] = shown.ranking
            clicks[i, : shown.ranking.size] = shown.clicks
        return queries, rankings, clicks

    async def learn(
        self, start: np.ndarray, n: int, duration: float = 0.0, *, ascend: bool = False
    ) -> np.ndarray:
        """n PDGD interactions from ``start``: the new weights, ``duration`` simulated s later
        (counted in ``learner_interactions`` under the path taken). ``ascend``: every step goes
        against PDGD's gradient (``-lr``: gradient ascent, unlearning by PGA)."""
        path = self.path
        learner_paths(self.ctx)[path] += n
        if path == BATCHED:
            return await self.pool.submit((self, self.job(start, n, ascend)), duration)
        theta = self.train(start, n, ascend)
        if duration > 0.0:
            await asyncio.sleep(duration)
        return theta

    def train(self, start: np.ndarray, n: int, ascend: bool = False) -> np.ndarray:
        """n interactions one query at a time, a step after each; returns the new weights."""
        ranker, own, shared = self.ranker, self.users, self.shared_users
        lr = -self.lr if ascend else self.lr
        ranker.set_params(start)
        n_own = len(own.queries)
        n_all = n_own + (len(shared.queries) if shared is not None else 0)
        for _ in range(n):
            users = own
            if n_all > n_own and self.rng.integers(n_all) >= n_own:
                users = shared
            shown = self.serve(users.next_query(), users)
            if not shown.clicks.any() and self.mu == 0.0:
                continue
            theta = ranker.get_params()
            gradient = pdgd_gradient(
                ranker,
                shown.features,
                shown.ranking,
                shown.clicks,
                shown.scores,
                compiled_pair_weights,
            )
            if self.step_transform is not None:
                gradient = self.step_transform(gradient, self.rng)
            step = lr * gradient
            if self.mu:
                step -= lr * self.mu * (theta - start)
            theta = theta + step
            ranker.set_params(clip_norm(theta, *self.clip) if self.clip else theta)
        return ranker.get_params()

    def learn_logged(
        self,
        start: np.ndarray,
        train: QuerySet,
        queries: np.ndarray,
        rankings: np.ndarray,
        clicks: np.ndarray,
        every: int = 0,
        scale: float = 1.0,
    ) -> np.ndarray:
        """PDGD from interactions other users had (centralised PDGD's server learns from its
        clients' logs): query ``queries[t]`` of ``train`` showed ``rankings[t]`` (document
        offsets in the query, -1 padding the end) with ``clicks[t]``. Their gradients at the
        current weights are summed and a step of ``lr`` times the sum taken every ``every``
        interactions, the remainder's scaled by ``scale`` at the end (``every`` 0: one step on
        all of them). Returns the new weights. No clipping or proximal term: the server has
        neither. A linear ranker learns in one compiled call (``learn_logged_linear``), others
        one interaction at a time."""
        ranker = self.ranker
        if isinstance(ranker, LinearRanker):
            theta = learn_logged_linear(
                train, start, queries, rankings, clicks, self.lr, every, scale
            )
            ranker.set_params(theta)
            return theta
        ranker.set_params(start)
        pending = np.zeros(ranker.n_params)
        logged = zip(queries, rankings, clicks, strict=True)
        for seen, (q, ranking, clicked) in enumerate(logged, 1):
            shown = ranking >= 0
            features = train.features[train.doc_range(int(q))]
            pending += pdgd_gradient(
                ranker, features, ranking[shown], clicked[shown], ranker.score(features)
            )
            if every and seen % every == 0:
                ranker.set_params(ranker.get_params() + self.lr * pending)
                pending[:] = 0.0
        if pending.any():
            ranker.set_params(ranker.get_params() + self.lr * scale * pending)
        return ranker.get_params()

    def job(self, start: np.ndarray, n: int, ascend: bool = False) -> PDGDJob:
        """``train(start, n, ascend)`` as a job for the batched path (a replayed log from its next
        query, shared data's queries and users beside the client's own)."""
        users, shared = self.users, self.shared_users
        bound, order = self.clip if self.clip else (None, 2)
        return PDGDJob(
            start,
            users.queries,
            n,
            self.rng,
            users.click_model,
            -self.lr if ascend else self.lr,
            bound,
            order,
            self.mu,
            replay_from=-1 if users.arrivals is None else users.played,
            shared_queries=None if shared is None else shared.queries,
            shared_model=None if shared is None else shared.click_model,
        )


def batch_kind(ranker) -> tuple | None:
    """Which batched trainer a ranker's learner goes to: ("linear",), ("mlp", hidden units)
    for a one-hidden-layer tanh MLP, None for the one-query-at-a-time path."""
    if isinstance(ranker, LinearRanker):
        return ("linear",)
    if isinstance(ranker, MLPRanker) and len(ranker.hidden) == 1 and ranker.activation == "tanh":
        return ("mlp", ranker.hidden[0])
    return None


def _groups(jobs: list[tuple[PDGDLearner, PDGDJob]], kind) -> dict[tuple, list[int]]:
    """Job indices per (training set, ``kind(learner)``): one batch each."""
    groups: dict[tuple, list[int]] = {}
    for i, (learner, _) in enumerate(jobs):
        groups.setdefault((id(learner.users.train), kind(learner)), []).append(i)
    return groups


def _record(
    users: Users,
    queries: list[int],
    shown: list[float],
    from_shared: list[bool] | None = None,
    shared: Users | None = None,
) -> None:
    """What ``serve`` does through ``Users`` for a batch's interactions: each shown ranking's
    nDCG to the probe, the issued queries to ``users.issued`` when it is logging, a replayed
    log moved on past its played queries; ``from_shared[s]``: step ``s`` showed the ``shared``
    users a shared query (their records instead)."""
    for s, (q, v) in enumerate(zip(queries, shown, strict=True)):
        if q < 0:  # -1: this learner ran fewer steps than the longest job
            continue
        who = shared if from_shared is not None and from_shared[s] else users
        who.record(v)
        if who.issued is not None:
            who.issued.append(q)
        if who.arrivals is not None:
            who.played += 1


def _train_jobs(jobs: list[tuple[PDGDLearner, PDGDJob]]) -> list[np.ndarray]:
    """The pool's batch function: every learner's interactions at once, as ``train`` would
    (``_record``; each learner's ranker ends at its new weights)."""
    out: list[np.ndarray] = [np.empty(0)] * len(jobs)
    for (_, kind), idx in _groups(jobs, lambda learner: batch_kind(learner.ranker)).items():
        learners = [jobs[i][0] for i in idx]
        train, batch = learners[0].users.train, [jobs[i][1] for i in idx]
        if kind[0] == "linear":
            res = train_linear_batch(train, batch)
        else:
            res = train_mlp_batch(train, batch, kind[1])
        shared = res.shared.tolist() if res.shared is not None else [None] * len(idx)
        for i, learner, w, queries, shown, other in zip(
            idx, learners, res.weights, res.queries.tolist(), res.ndcg.tolist(), shared,
            strict=True,
        ):  # fmt: skip
            _record(learner.users, queries, shown, other, learner.shared_users)
            learner.ranker.set_params(w)
            out[i] = w  # a row of a fresh array: nothing else holds it
    return out


def _show_jobs(jobs: list[tuple[PDGDLearner, PDGDJob]]) -> list[tuple]:
    """The show pool's batch function: every logger's ``show`` at once (``_record``)."""
    out: list[tuple] = [()] * len(jobs)
    for idx in _groups(jobs, lambda learner: None).values():
        learners = [jobs[i][0] for i in idx]
        batch = [jobs[i][1] for i in idx]
        res = serve_linear_batch(learners[0].users.train, batch)
        for row, (i, learner, job) in enumerate(zip(idx, learners, batch, strict=True)):
            n = job.n_steps
            queries = res.queries[row, :n]
            _record(learner.users, queries.tolist(), res.ndcg[row, :n].tolist())
            out[i] = (queries, res.rankings[row, :n], res.clicks[row, :n])
    return out


def train_pool(ctx: RunContext) -> BatchPool:
    """The run's one pool batching PDGD learners' local training (``batch_kind``)."""
    return ctx.shared("fpdgd.train_pool", lambda: BatchPool(_train_jobs, prepare=prepare))


def show_pool(ctx: RunContext) -> BatchPool:
    """The run's one pool batching loggers' ``show`` (linear rankers)."""
    return ctx.shared("pdgd.show_pool", lambda: BatchPool(_show_jobs, prepare=prepare))

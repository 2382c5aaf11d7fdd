"""The two halves most online-learning-to-rank protocols share.

``OnlineClient``: a client agent whose users are shown rankings from a ranker copy (its own
queries, click model and number of interactions per round, as the run's partition gives them)
and ``serve`` one query: sample a ranking (Plackett-Luce, as PDGD explores), show it, return the
clicks. ``ModelStrategy``: the server side of a protocol whose global state is one weight vector:
broadcast it as ``{"params": model}``, combine the replies' ``params`` with the scenario's
aggregator (FedAvg weighted by ``n_interactions`` unless a robust rule is chosen), evaluate.
A protocol overrides what differs (``aggregate`` of log replies, an Adam step, ...).
``OnlineRun``: a run made of one strategy class and one client class.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foltr_async.contract import ProtocolRun, RunContext
from foltr_async.ltr.pdgd import sample_ranking
from foltr_async.protocols.users import K, Users
from foltr_async.runtime.agent import Agent
from foltr_async.runtime.engine import Strategy


class Served(NamedTuple):
    """One query as the users saw it: the candidates' features and scores, the shown ranking
    (document offsets in the query) and its clicks."""

    features: np.ndarray
    scores: np.ndarray
    ranking: np.ndarray
    clicks: np.ndarray


class OnlineClient(Agent):
    """A client with a ranker copy, its users and its generator; subclasses add handlers."""

    role = "client"

    def __init__(
        self, agent_id: str, ctx: RunContext, queries: np.ndarray, rng: np.random.Generator
    ) -> None:
        super().__init__(agent_id, ctx.bus)
        self.ranker = ctx.new_ranker()
        self.users = Users(
            ctx.train_set(agent_id),
            queries,
            ctx.users_click_model(agent_id),
            rng,
            ctx.probe,
            agent_id,
        )
        self.rng = rng
        self.batch = ctx.batch_of(agent_id)

    def serve(self, q: int) -> Served:
        """Show query ``q``'s top K sampled from the ranker's Plackett-Luce distribution."""
        train = self.users.train
        features = train.features[train.doc_range(q)]
        scores = self.ranker.score(features)
        ranking = sample_ranking(scores, K, self.rng)
        return Served(features, scores, ranking, self.users.show(q, ranking))


class ModelStrategy(Strategy):
    """Server side over one global weight vector (subclasses set the two message kinds)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.ranker = ctx.new_ranker()
        self.model = self.ranker.get_params()

    def configure_round(self, round: int) -> dict:
        return {"params": self.model}

    def aggregate(self, round: int, replies: list) -> dict:
        updates = np.stack([r.body["params"] for r in replies])
        weights = np.array([r.body["n_interactions"] for r in replies], dtype=np.float64)
        self.model = self.ctx.aggregator.fn(updates, weights, self.ctx.assumed_malicious)
        return {"clients": len(replies)}

    def evaluate(self) -> dict[str, float]:
        self.ranker.set_params(self.model)
        return self.ctx.evaluate(self.ranker)


class OnlineRun(ProtocolRun):
    """A run of ``strategy_class(ctx)`` and clients ``client_class(id, ctx, queries, rng)``."""

    strategy_class: type[Strategy]
    client_class: type[Agent]

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.strategy = self.strategy_class(ctx)

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        return self.client_class(agent_id, self.ctx, queries, rng)

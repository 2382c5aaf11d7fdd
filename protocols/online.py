"""The two halves most online-learning-to-rank protocols share.

``OnlineClient``: a client agent whose users are shown rankings from a ranker copy (its own
queries, click model and number of interactions per round, as the run's partition gives them),
trained by the one PDGD learner (``protocols/learner.py``): ``make_update`` runs the round's
interactions (batched across clients where it can be), ``serve`` shows one query.
``ModelStrategy``: the server side of a protocol whose global state is one weight vector:
broadcast it as ``{"params": model}``, combine the replies' ``params`` with the scenario's
aggregator (FedAvg weighted by ``n_interactions`` unless a robust rule is chosen), evaluate.
A protocol overrides what differs (``aggregate`` of log replies, an Adam step, ...).
``OnlineRun``: a run made of one strategy class and one client class.
"""

from __future__ import annotations

import numpy as np

from foltr_async.contract import ProtocolRun, RunContext
from foltr_async.protocols.learner import PDGDLearner, Served, learner_paths
from foltr_async.protocols.users import Users
from foltr_async.runtime.agent import Agent
from foltr_async.runtime.engine import Strategy
from foltr_async.runtime.rounds import MAX_ABS, screen_reply


class OnlineClient(Agent):
    """A client whose users are shown rankings from its ranker copy, trained by the one PDGD
    learner (``self.learner``); subclasses add handlers.

    ``make_update`` is what the client sends for a round: its users' ``self.interactions``
    interactions of PDGD from the model it got (batched with the other clients' when it can be).
    It is also the one hook an attacker overrides to change what is sent. ``learner`` keywords
    go to ``PDGDLearner`` (``lr`` defaults to the protocol's ``lr`` parameter).
    """

    role = "client"
    #: False: the client only shows rankings (FOLtR-ES, centralised PDGD's loggers): no PDGD
    trains = True
    #: simulated seconds one local interaction takes (a protocol's compute model sets it)
    compute_time = 0.0

    def __init__(
        self,
        agent_id: str,
        ctx: RunContext,
        queries: np.ndarray,
        rng: np.random.Generator,
        **learner,
    ) -> None:
        super().__init__(agent_id, ctx.bus, ctx.secure_half(agent_id))
        self.ctx = ctx
        if "lr" not in learner:
            learner["lr"] = ctx.params.lr if self.trains else None
        self.learner = PDGDLearner(ctx, queries, rng, agent_id, agent=self, **learner)
        self.batch = ctx.batch_of(agent_id)  # a non-IID partition may vary it per client
        #: interactions of the training under way: the batch, or fewer (FLGo completeness)
        self.interactions = self.batch

    @property
    def ranker(self):
        return self.learner.ranker

    @property
    def users(self) -> Users:
        return self.learner.users

    @property
    def rng(self) -> np.random.Generator:
        return self.learner.rng

    def serve(self, q: int) -> Served:
        """Show query ``q``'s top K sampled from the ranker's Plackett-Luce distribution."""
        return self.learner.serve(q)

    async def local_train(self, start: np.ndarray, n: int, ascend: bool = False) -> np.ndarray:
        """n local interactions from ``start``: the new weights, ``n * compute_time`` later
        (``ascend``: against the gradient, ``PDGDLearner.learn``)."""
        return await self.learner.learn(start, n, n * self.compute_time, ascend=ascend)

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        """The weights this client sends for ``round``, trained from ``start``."""
        return await self.local_train(start, self.interactions)


class ModelStrategy(Strategy):
    """Server side over one global weight vector (subclasses set the two message kinds)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.ranker = ctx.new_ranker()
        self.model = self.ranker.get_params()

    def configure_round(self, round: int) -> dict:
        return {"params": self.model}

    def screen(self, reply) -> tuple[str, str] | None:
        """A model of the global model's length, finite and bounded (``max_abs``), weighted by
        at most the client's interactions."""
        body = reply.body
        vectors = {"params": self.model.size} if "params" in body else {}
        counts = {"n_interactions": self.ctx.most_interactions(reply.src)}
        return screen_reply(
            body, vectors, self.max_abs(), counts if "n_interactions" in body else {}
        )

    def max_abs(self) -> float:
        """The largest |coordinate| a client's model may hold."""
        return MAX_ABS

    def aggregate(self, round: int, replies: list) -> dict:
        updates = np.stack([r.body["params"] for r in replies])
        weights = np.array([r.body["n_interactions"] for r in replies], dtype=np.float64)
        self.model = self.ctx.aggregator.fn(updates, weights, self.ctx.config.assumed_malicious)
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
        if getattr(self.client_class, "trains", False):
            learner_paths(ctx)  # the names workers' counts are added to

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        return self.client_class(agent_id, self.ctx, queries, rng)

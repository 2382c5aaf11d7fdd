"""FedAvgM over PDGD clients: federated PDGD whose server keeps momentum (Hsu et al. 2019).

Each selected client starts from the global weights, shows its users B rankings sampled from
them, takes a PDGD step after every query with a click, and sends back its weights; the server
averages them (the scenario's aggregator: FedAvg by interactions) and moves the global model
with momentum: ``v <- beta * v + (mean - w)``, ``w <- w + v`` (beta = 0 is FPDGD without DP).

The protocol of docs/EXTENDING.md, loaded as a plugin:
``FOLTR_ASYNC_PLUGINS=examples.fedavgm python -m foltr_async examples/fedavgm.toml``.
"""

from __future__ import annotations

import numpy as np

from foltr_async.protocols.api import (
    Array,
    Int,
    Kind,
    ModelStrategy,
    OnlineClient,
    OnlineRun,
    ProtocolEntry,
    RunConfig,
    ScenarioError,
    Summable,
    handles,
    param,
    parameters,
)

MODEL = "fedavgm.model"
UPDATE = "fedavgm.update"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(MODEL, {"params": Array("float64", ndim=1)}),
    Kind(UPDATE, {"params": Array("float64", ndim=1), "n_interactions": Int(min=0)}),
)


@parameters
class Params:
    lr: float = param(0.1, "clients' PDGD learning rate", min=0.0)
    momentum: float = param(0.5, "server momentum beta (0: plain FedAvg)", min=0.0, max=0.99)


class Client(OnlineClient):
    """An honest client: B PDGD interactions from the global weights, then its weights."""

    @handles(MODEL)
    async def on_model(self, env) -> None:
        weights = await self.make_update(env.round, env.body["params"])
        body = {"params": weights, "n_interactions": self.interactions}
        self.reply(env.src, UPDATE, body, env.round)  # masked under secure aggregation


class Server(ModelStrategy):
    """FedAvg of the clients' weights, applied through server momentum."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.beta = ctx.params.momentum
        self.velocity = np.zeros_like(self.model)

    def aggregate(self, round: int, replies: list) -> dict:
        start = self.model
        facts = super().aggregate(round, replies)  # self.model = the aggregated weights
        self.velocity = self.beta * self.velocity + (self.model - start)
        self.model = start + self.velocity
        return {**facts, "velocity_norm": float(np.linalg.norm(self.velocity))}


class FedAvgM(OnlineRun):
    strategy_class = Server
    client_class = Client
    partitions = True  # OnlineClient reads each client's own data, so non-IID splits apply

    @classmethod
    def check(cls, config: RunConfig) -> None:
        # the first round's step is FedAvg's: one round could not show momentum's effect
        if config.params.momentum > 0 and config.federation.rounds < 2:
            raise ScenarioError(
                "federation.params.momentum: has no effect in one round; expected "
                "federation.rounds >= 2 or momentum = 0"
            )


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    ProtocolEntry(
        "fedavgm",
        "FedAvg with server momentum over PDGD clients",
        Params,
        FedAvgM,
        # the update is averaged by interactions, so it may travel masked (secure aggregation)
        summable=Summable(UPDATE, vector="params", weight="n_interactions"),
    ),
)

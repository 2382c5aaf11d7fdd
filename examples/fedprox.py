"""FedProx over PDGD clients (Li et al., MLSys 2020): a changed local step that stays batched.

Each selected client starts from the global weights and takes B PDGD steps, every one of them
also pulling back to where it started: ``w += lr * (grad - mu * (w - start))``, and on a query
without a click the pull alone. The learner's proximal weight ``mu`` is a step the compiled
batched kernel takes itself, so the clients of one instant still train in one call. The server
is FedAvg of the clients' weights.

The local-step example of docs/EXTENDING.md, loaded as a plugin:
``FOLTR_ASYNC_PLUGINS=examples.fedprox python -m foltr_async examples/fedprox.toml``.
"""

from __future__ import annotations

from foltr_async.protocols.api import (
    Array,
    Int,
    Kind,
    ModelStrategy,
    OnlineClient,
    OnlineRun,
    ProtocolEntry,
    Summable,
    handles,
    param,
    parameters,
)

MODEL = "fedprox.model"
UPDATE = "fedprox.update"
KINDS = (
    Kind(MODEL, {"params": Array("float64", ndim=1)}),
    Kind(UPDATE, {"params": Array("float64", ndim=1), "n_interactions": Int(min=0)}),
)


@parameters
class Params:
    lr: float = param(0.1, "clients' PDGD learning rate", min=0.0)
    mu: float = param(0.1, "FedProx proximal weight mu (0: FedAvg)", min=0.0)


class Client(OnlineClient):
    """Every local PDGD step also takes ``-lr mu (w - start)``: the learner's proximal weight."""

    def __init__(self, agent_id, ctx, queries, rng) -> None:
        super().__init__(agent_id, ctx, queries, rng, mu=ctx.params.mu)

    @handles(MODEL)
    async def on_model(self, env) -> None:
        weights = await self.make_update(env.round, env.body["params"])
        body = {"params": weights, "n_interactions": self.interactions}
        self.reply(env.src, UPDATE, body, env.round)


class Server(ModelStrategy):
    """FedAvg of the clients' weights."""

    broadcast_kind = MODEL
    reply_kind = UPDATE


class FedProx(OnlineRun):
    strategy_class = Server
    client_class = Client
    partitions = True


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    ProtocolEntry(
        "fedprox",
        "FedProx over PDGD clients: proximal local steps, FedAvg",
        Params,
        FedProx,
        summable=Summable(UPDATE, vector="params", weight="n_interactions"),
    ),
)

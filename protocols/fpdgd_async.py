"""Asynchronous FPDGD: the server folds client updates in as they arrive (FedAsync, FedBuff).

Clients are FPDGD clients (``foltr_async.protocols.fpdgd``): on receiving a model they run B PDGD
interactions with their own users, ``B * compute_time * device scale`` simulated seconds, and
send their weights back; the server hands them the newest model at once (the loop is
``foltr_async.runtime.async_engine``), so a client keeps serving its users with the model it
holds while slower clients are still training. Staleness ``tau`` = server version at arrival -
version the client started from.

- FedAsync (Xie, Koyejo and Gupta 2019, "Asynchronous Federated Optimization"):
  ``w <- (1 - a) w + a w_client`` with ``a = alpha * s(tau)``; every update is a new version.
  Its workers minimise ``f(y) + rho/2 ||y - w_sent||^2``: with ``rho`` > 0 every local PDGD
  ascent step also takes ``-lr * rho * (y - w_sent)`` (the proximal step FedProx uses too).
- FedBuff (Nguyen et al., AISTATS 2022, "Federated Learning with Buffered Asynchronous
  Aggregation"): the server buffers client deltas ``w_client - w_sent`` and, once it holds K,
  treats ``g = (1/K) sum s(tau_i) delta_i`` as a pseudo-gradient for a server optimiser (one new
  version per K updates); FedBuff is agnostic to that choice. ``server_optimizer = "sgd"``:
  ``m <- beta1 m + g; w <- w + eta_g m`` (``server_momentum`` beta1 = 0: plain
  ``w + eta_g g``; > 0: FedAvgM's server momentum, Hsu et al. 2019); ``"adam"``: FedAdam of Reddi
  et al. (ICLR 2021, "Adaptive Federated Optimization"), ``m <- b1 m + (1 - b1) g``,
  ``v <- b2 v + (1 - b2) g^2``, ``w <- w + eta_g m / (sqrt(v) + tau)`` (no bias correction, as
  there).

Staleness functions s (FedAsync's): constant 1; polynomial ``(1 + tau)^-a`` (a = 0.5 is
FedBuff's ``1/sqrt(1 + tau)``); hinge ``1`` if ``tau <= b`` else ``1 / (a (tau - b) + 1)``.
No differential privacy here: FPDGD's Gamma-split noise sums to Laplace only over a round's
clients, which an asynchronous server never has.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.contract import ProtocolRun, RunContext, model_message_bytes
from foltr_async.errors import ScenarioError
from foltr_async.params import param, parameters
from foltr_async.protocols.fpdgd import MODEL, UPDATE, FPDGDClient, replayed
from foltr_async.protocols.learner import learner_paths
from foltr_async.registry import ProtocolEntry
from foltr_async.runtime.agent import Agent, handles
from foltr_async.runtime.async_engine import AsyncStrategy
from foltr_async.runtime.rounds import screen_reply


@parameters
class Params:
    lr: float = param(0.1, "PDGD learning rate", min=0.0)
    compute_time: float = param(
        1.0, "simulated seconds of local training per interaction (> 0)", min=0.0
    )
    mode: str = param("fedasync", "server rule", choices=("fedasync", "fedbuff"))
    alpha: float = param(0.6, "FedAsync mixing weight", min=0.0, max=1.0)
    staleness: str = param(
        "polynomial", "staleness function s", choices=("constant", "polynomial", "hinge")
    )
    staleness_a: float = param(0.5, "a of the polynomial / hinge staleness function", min=0.0)
    staleness_b: float = param(4.0, "b of the hinge staleness function", min=0.0)
    buffer: int = param(10, "FedBuff: updates per server step (K)", min=1)
    server_lr: float = param(1.0, "FedBuff: server learning rate eta_g", min=0.0)
    server_optimizer: str = param(
        "sgd", "FedBuff: server optimiser of the buffered pseudo-gradient", choices=("sgd", "adam")
    )
    server_momentum: float = param(
        0.0, "FedBuff: server momentum beta1 (sgd: FedAvgM; adam: first moment)", min=0.0, max=1.0
    )
    server_beta2: float = param(0.99, "FedBuff adam: second-moment decay beta2", min=0.0, max=1.0)
    server_tau: float = param(1e-3, "FedBuff adam: adaptivity tau (> 0)", min=1e-12)
    rho: float = param(0.0, "FedAsync: workers' proximal weight rho (0: off)", min=0.0)
    period: float = param(10.0, "simulated seconds per reporting period (one round)", min=1e-9)
    #: not a scenario parameter: no DP here (see above), as the FPDGD learner reads it
    dp: ClassVar[bool] = False


class ServerOptimizer:
    """FedBuff's server step on the buffered pseudo-gradient ``g`` (an ascent direction here:
    PDGD's updates point uphill): SGD with optional momentum, or FedAdam."""

    def __init__(self, kind: str, lr: float, beta1: float, beta2: float, tau: float) -> None:
        self.kind, self.lr, self.beta1, self.beta2, self.tau = kind, lr, beta1, beta2, tau
        self.m: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def step(self, w: np.ndarray, g: np.ndarray) -> np.ndarray:
        if self.kind == "sgd":
            if self.beta1 == 0.0:
                return w + self.lr * g  # the plain step, bit for bit
            self.m = g if self.m is None else self.beta1 * self.m + g
            return w + self.lr * self.m
        m = np.zeros_like(g) if self.m is None else self.m
        v = np.zeros_like(g) if self.v is None else self.v
        self.m = self.beta1 * m + (1.0 - self.beta1) * g
        self.v = self.beta2 * v + (1.0 - self.beta2) * g * g
        return w + self.lr * self.m / (np.sqrt(self.v) + self.tau)


def staleness_weight(kind: str, tau: int, a: float, b: float) -> float:
    """s(tau) of FedAsync: constant, polynomial (1 + tau)^-a, or hinge with a, b."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + tau) ** -a)
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


class AsyncFPDGDStrategy(AsyncStrategy):
    """FedAsync or FedBuff over FPDGD clients' weights."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, ctx: RunContext) -> None:
        p = ctx.params
        self.ctx = ctx
        self.mode = p.mode
        self.alpha = p.alpha
        self.s = (p.staleness, p.staleness_a, p.staleness_b)
        self.k = p.buffer
        self.optimizer = ServerOptimizer(
            p.server_optimizer, p.server_lr, p.server_momentum, p.server_beta2, p.server_tau
        )
        self.period = p.period
        self.ranker = ctx.new_ranker()
        self.model = self.ranker.get_params()
        self.sent: dict[str, np.ndarray] = {}  # client -> the model it trains from (FedBuff)
        self.buffer: list[np.ndarray] = []

    def configure(self, clients: list[str], version: int) -> dict:
        if self.mode == "fedbuff":
            for c in clients:
                self.sent[c] = self.model  # never mutated in place: replaced on every step
        return {"params": self.model}

    def screen(self, reply) -> tuple[str, str] | None:
        """A model of the global model's length, finite and bounded, of at most the client's
        interactions."""
        most = self.ctx.most_interactions(reply.src)
        return screen_reply(
            reply.body, {"params": self.model.size}, counts={"n_interactions": most}
        )

    def apply(self, reply, staleness: int) -> bool:
        theta = reply.body["params"]
        weight = staleness_weight(self.s[0], staleness, *self.s[1:])
        if self.mode == "fedasync":
            a = self.alpha * weight
            self.model = (1.0 - a) * self.model + a * theta
            return True
        self.buffer.append(weight * (theta - self.sent.pop(reply.src)))
        if len(self.buffer) < self.k:
            return False
        self.model = self.optimizer.step(self.model, np.mean(self.buffer, axis=0))
        self.buffer = []
        return True

    def evaluate(self) -> dict[str, float]:
        self.ranker.set_params(self.model)
        return self.ctx.evaluate(self.ranker)


class AsyncFPDGDClient(FPDGDClient):
    """An FPDGD client that trains on every model it is handed (no unlearning store); with
    FedAsync's ``rho`` > 0 its local steps are proximal (FedProx's step, batched too)."""

    unlearns = False  # its protocol has no unlearn action (nor FPDGD's unlearning parameters)

    def __init__(
        self, agent_id: str, ctx: RunContext, queries: np.ndarray, rng: np.random.Generator
    ) -> None:
        super().__init__(agent_id, ctx, queries, rng, mu=ctx.params.rho)

    @handles(MODEL)
    async def on_model(self, env) -> None:
        start = env.body["params"]
        if self.users.arrivals is not None:
            n = await self.issued_queries()
            if n == 0:  # the user's log has ended: no update
                return
        else:
            n = self.ctx.local_work(self.id, self.batch)
        theta = await self.local_train(start, n)
        self.send(env.src, UPDATE, {"params": theta, "n_interactions": n}, env.round)

    async def issued_queries(self) -> int:
        """A replayed log: how many queries the user has issued by now and not yet played.
        With none yet the client holds the model until the next one is issued (an empty
        update would come straight back as a new dispatch); 0 when the log has ended.
        Both are counted (``holds``, ``exhausted``)."""
        users = self.users
        now = self.ctx.now()
        n = users.pending(now)
        if n > 0:
            return n
        nxt = users.next_arrival()
        if nxt is None:
            replayed(self.ctx, "exhausted")
            return 0
        replayed(self.ctx, "holds")
        await asyncio.sleep(nxt - now)
        # the timer may land a rounding error short of nxt: that query has been issued
        return users.pending(max(self.ctx.now(), nxt))


class AsyncFPDGD(ProtocolRun):
    partitions = True
    completes = True
    replays = True

    @classmethod
    def check(cls, config: RunConfig) -> None:
        if config.params.compute_time <= 0.0:
            raise ScenarioError(
                "federation.params.compute_time: expected a number > 0 for asynchronous FPDGD "
                "(each training must take simulated time), got 0.0"
            )
        if (step := config.params.lr * config.params.rho) >= 2.0:
            raise ScenarioError(
                "federation.params.rho: expected lr * rho < 2 (the proximal step "
                f"-lr * rho * (y - w) overshoots and diverges), got {step:g}"
            )
        if config.federation.secure_aggregation:
            raise ScenarioError(
                "federation.secure_aggregation: expected false for asynchronous FPDGD "
                "(there is no round of updates to mask together)"
            )

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.strategy = AsyncFPDGDStrategy(ctx)
        learner_paths(ctx)  # the names workers' counts are added to

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        return AsyncFPDGDClient(agent_id, self.ctx, queries, rng)

    def report(self) -> dict:
        return {"async": {"mode": self.strategy.mode}}


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    ProtocolEntry(
        "fpdgd_async",
        "asynchronous FPDGD: FedAsync (staleness-weighted mixing) or FedBuff (buffer of K)",
        Params,
        AsyncFPDGD,
        wire_bytes=model_message_bytes,
    ),
)

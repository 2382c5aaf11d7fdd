"""``cost(...)`` measures one configuration's per-round cost (bytes, messages, wall time) on the
real bus with vector clients, for the benchmark; the tests play their rounds the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from foltr_async.protocols.secagg.client import SecAggClient
from foltr_async.protocols.secagg.scheme import make_run
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.engine import RoundPlan, ServerAgent, Strategy
from foltr_async.runtime.schema import Array, Int, Kind
from foltr_async.runtime.secure import SecureRun, Summable
from foltr_async.runtime.wire import Envelope

BENCH_MODEL = "secagg.bench.model"
BENCH_UPDATE = "secagg.bench.update"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(BENCH_MODEL, {"dim": Int(min=1)}),
    Kind(BENCH_UPDATE, {"vector": Array("float64", ndim=1), "weight": Int(min=0)}),
)
_BENCH_SPEC = Summable(BENCH_UPDATE, "vector", "weight")


class VectorClient(Agent):
    """A client whose update is a random vector and weight (kept in ``truth`` for checking)."""

    role = "client"

    def __init__(
        self, agent_id: str, bus, rng: np.random.Generator, truth: dict, secure=None
    ) -> None:
        super().__init__(agent_id, bus, secure)
        self.rng = rng
        self.truth = truth

    @handles(BENCH_MODEL)
    def on_model(self, env: Envelope) -> None:
        vector = self.rng.normal(size=env.body["dim"])
        weight = int(self.rng.integers(1, 9))
        self.truth[env.round, self.id] = (vector, weight)
        self.reply(env.src, BENCH_UPDATE, {"vector": vector, "weight": weight}, env.round)


class MeanStrategy(Strategy):
    """Broadcast the dimension, keep each round's FedAvg of the replies."""

    broadcast_kind = BENCH_MODEL
    reply_kind = BENCH_UPDATE

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.means: dict[int, np.ndarray] = {}

    def configure_round(self, round: int) -> dict:
        return {"dim": self.dim}

    def aggregate(self, round: int, replies: list) -> dict:
        v = np.stack([r.body["vector"] for r in replies])
        w = np.array([r.body["weight"] for r in replies], dtype=np.float64)
        self.means[round] = (w / w.sum()) @ v
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}


@dataclass
class VectorRun:
    """Vector clients around a ``MeanStrategy`` server on a memory bus (benchmark and tests)."""

    bus: Any
    agents: dict[str, VectorClient]
    strategy: MeanStrategy
    server: ServerAgent
    secure: SecureRun | None
    truth: dict = field(default_factory=dict)
    reports: list = field(default_factory=list)

    def halves(self) -> dict[str, SecAggClient]:
        return {a: agent.secure for a, agent in self.agents.items() if agent.secure is not None}


async def vector_rounds(
    clients: int,
    dim: int,
    rounds: int,
    settings: dict | None,
    seed: int,
    network=None,
    deadline: float = 60.0,
    prepare=None,
) -> VectorRun:
    """Play ``rounds`` rounds of vector clients (``settings`` None: plaintext). ``prepare(run)``
    runs once everyone is built (with its secure half), before anyone starts (taps, forced
    dropouts)."""
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.network import NetworkModel

    bus = MemoryBus(network or NetworkModel(), stream(seed, "net"))
    truth: dict = {}
    secure_run = None
    if settings is not None:
        secure_run = make_run(
            _BENCH_SPEC, settings, lambda *p: stream(seed, *p), lambda *a, **k: None
        )
    agents = {
        cid: VectorClient(
            cid,
            bus,
            stream(seed, "client", i),
            truth,
            secure_run.client(cid) if secure_run else None,
        )
        for i, cid in enumerate(map(client_id, range(clients)))
    }
    strategy = MeanStrategy(dim)
    server = ServerAgent(
        bus,
        strategy,
        RoundPlan(rounds=rounds, deadline=deadline),
        stream(seed, "server"),
        clients=lambda: sorted(agents),
        secure=secure_run.server if secure_run else None,
    )
    run = VectorRun(bus, agents, strategy, server, secure_run, truth)
    if prepare is not None:
        prepare(run)
    server.start()
    for agent in agents.values():
        agent.start()
    try:
        run.reports = await server.run_rounds()
    finally:
        for agent in [*agents.values(), server]:
            await agent.leave()
    return run


def plaintext_mean(vr: VectorRun, report) -> np.ndarray:
    """FedAvg of the true inputs of the clients a round's report says contributed."""
    rows = [vr.truth[report.round, c] for c in report.clients]
    w = np.array([r[1] for r in rows], dtype=np.float64)
    return (w / w.sum()) @ np.stack([r[0] for r in rows])


def relative_error(vr: VectorRun, report) -> float:
    """Largest coordinate error of the unmasked mean relative to the largest true coordinate."""
    exact = plaintext_mean(vr, report)
    return float(np.abs(vr.strategy.means[report.round] - exact).max() / np.abs(exact).max())


def cost(
    clients: int,
    dim: int = 137,
    degree: int = 0,
    dropout: float = 0.0,
    rounds: int = 2,
    secure: bool = True,
    seed: int = 0,
    threshold: float = 0.5,
) -> dict[str, Any]:
    """Per-round cost of secure aggregation (or of the plaintext round with ``secure=False``):
    messages and bytes on the bus, wall seconds, and the largest relative error of the unmasked
    mean against the plaintext FedAvg of the same inputs. For the bench's ``secagg`` suite."""
    from foltr_async.runtime.clock import run

    settings = {"degree": degree, "dropout": dropout, "threshold": threshold} if secure else None
    t0 = time.perf_counter()
    vr = run(vector_rounds(clients, dim, rounds, settings, seed))
    wall = time.perf_counter() - t0
    errors = [relative_error(vr, rep) for rep in vr.reports if rep.round in vr.strategy.means]
    stats = vr.bus.stats
    return {
        "clients": clients,
        "dim": dim,
        "secure": secure,
        "degree": degree,
        "dropout": dropout,
        "rounds": rounds,
        "completed_rounds": len(errors),
        "messages_per_round": stats.sent / rounds,
        "bytes_per_round": stats.bytes_sent / rounds,
        "bytes_per_client_round": stats.bytes_sent / rounds / clients,
        "wall_s_per_round": wall / rounds,
        "max_rel_error": max(errors) if errors else None,
    }

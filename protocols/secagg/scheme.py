"""A run's two SecAgg halves, built from the scenario's ``[federation.secagg]`` settings."""

from __future__ import annotations

from foltr_async.protocols.secagg.client import SecAggClient
from foltr_async.protocols.secagg.server import SecAggServer
from foltr_async.protocols.secagg.settings import Settings
from foltr_async.runtime.secure import SecureRun, Summable


def make_run(spec: Summable, settings: dict, rng, emit) -> SecureRun:
    """A run's SecAgg: ``rng(*path)`` gives named seeded streams, ``emit(event, **fields)``."""
    full = Settings(**settings)
    server = SecAggServer(spec, full, rng("secagg-graph"), emit)

    def client(agent_id: str) -> SecAggClient:
        return SecAggClient(spec, full, rng("secagg", agent_id), rng("secagg-dropout", agent_id))

    return SecureRun(server, client)

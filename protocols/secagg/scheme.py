"""What a scenario may set for SecAgg, and a run's two halves built from it."""

from __future__ import annotations

from foltr_async.runtime.secure import SecureRun, Summable
from foltr_async.scenario.fields import Field
from protocols.secagg.client import SecAggClient
from protocols.secagg.server import SecAggServer

FIELDS = {
    "degree": Field(
        int, 0, "neighbours per client: 0 = all (SecAgg), k = Harary graph (SecAgg+)", min=0
    ),
    "threshold": Field(
        float, 0.5, "shares needed = floor(threshold * neighbours) + 1", min=0.5, max=1.0
    ),
    "precision_bits": Field(
        int, 32, "fractional bits of the fixed-point encoding in Z_2^64", min=8, max=48
    ),
    "deadline": Field(
        float,
        None,
        "simulated seconds per key/unmask phase (default: federation.deadline)",
        min=0.0,
        nullable=True,
    ),
    "dropout": Field(
        float, 0.0, "probability a client fails to upload after sharing its keys", min=0.0, max=1.0
    ),
}


def make_run(spec: Summable, settings: dict, rng, emit) -> SecureRun:
    """A run's SecAgg: ``rng(*path)`` gives named seeded streams, ``emit(event, **fields)``."""
    full = {k: settings.get(k, f.default) for k, f in FIELDS.items()}
    server = SecAggServer(spec, full, rng("secagg-graph"), emit)

    def client(agent_id: str) -> SecAggClient:
        return SecAggClient(spec, full, rng("secagg", agent_id), rng("secagg-dropout", agent_id))

    return SecureRun(server, client)

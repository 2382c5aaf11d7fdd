"""What one repeat's run reports: its curves, online metric, messages and the facts of its
protocol, transport and system model (results.json's per-repeat entry)."""

from __future__ import annotations

from typing import Any

from foltr_async.runtime.async_engine import AsyncServerAgent, staleness_summary
from foltr_async.runtime.engine import RoundReport


def repeat_result(sim: Any, wall_s: float, sim_s: float) -> dict[str, Any]:
    """The finished run's results (``sim``: the ``simulation.Simulation``; ``wall_s`` and
    ``sim_s``: its wall and simulated seconds)."""
    records = sim.records
    curve = records.curve
    # a synchronous run's users record the round they were served in, an asynchronous
    # run's the model version: only the first is the evaluations' round
    sync = not isinstance(sim.server, AsyncServerAgent)
    online, online_at = sim.probe.online(records.rounds if sync else ())
    result = {
        "seed": sim.seed,
        "rounds": records.rounds,
        "initial": records.initial,  # offline metrics of the model before round 1
        "offline": {k: [m[k] for m in curve] for k in (curve[0] if curve else {})},
        "sim_times": records.times,  # simulated seconds at each evaluation
        "online": online,
        "messages": sim.bus.stats.as_dict(),
        "late_replies": sim.server.late_replies,
        "contributions": contributions(records.reports),
        "wall_s": wall_s,
        "sim_s": sim_s,
    }
    if sync:
        result["online_at"] = online_at  # the online metric through each evaluated round
    if sim.remote is None:  # remote users' records arrive only at checkpoints and the end
        result["interactions"] = records.interactions  # users' interactions by each evaluation
    if sim.ctx.judged_queries is not None:
        result["judged_queries"] = sim.ctx.judged_queries
    result.update(sim.proto.report())
    if isinstance(sim.server, AsyncServerAgent):
        result["staleness"] = staleness_summary(sim.server.staleness)
        result["versions"] = sim.server.version
    if sim.ctx.partition is not None:
        result["partition"] = sim.ctx.partition.facts
    if sim.ctx.flgo is not None:
        result["flgo"] = sim.ctx.flgo.report()
    if sim.secure is not None:
        result.update(sim.secure.report())
    if sim.remote is not None:
        result["transport"] = sim.remote.report()
    result.update(sim.probe.extras)
    return result


def contributions(reports: list[RoundReport]) -> dict[str, Any]:
    """Clients whose update went into each round's model (0: the round kept the old model,
    e.g. nobody online or fewer replies than ``min_clients``, or the server played it alone),
    every phase in round order; the empty rounds (no update taken, in a round that asked
    clients) and the rounds the server played alone; and the rounds (periods) that began with
    no client online, and their simulated seconds."""
    per_round = [len(r.clients) if r.aggregated else 0 for r in reports]
    nobody = [r for r in reports if r.online == 0]
    return {
        "per_round": per_round,
        "empty_rounds": sum(
            not (n or r.server_only) for n, r in zip(per_round, reports, strict=True)
        ),
        "server_rounds": sum(r.server_only for r in reports),
        "nobody_online_rounds": len(nobody),
        "nobody_online_s": sum((r.duration for r in nobody), 0.0),
        "rounds_s": sum((r.duration for r in reports), 0.0),
    }

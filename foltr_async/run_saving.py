"""A run's checkpoints as it plays: what a saved run holds of the live one and how a saved run
goes back into a freshly built one (a ZeroMQ worker saves and restores its own agents the same
way). The file, and the checks a saved run passes before it loads, are ``run_state``'s."""

from __future__ import annotations

from typing import Any

from foltr_async.run_state import check_run_ranges, check_run_state
from foltr_async.runtime.checkpoint import Checkpointed, CheckpointError


class RunSaver:
    """One run's checkpoint state: its agents' (each declares its own) and that of the objects
    besides them that keep state between rounds, all referring to the run's machinery by name
    (``shared``), never copying it."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim  # the run (``simulation.Simulation``, which imports this module)

    def shared(self) -> dict[str, Any]:
        """The run's machinery by name: checkpoints refer to it, never copy it."""
        sim = self.sim
        ctx = sim.ctx
        named: dict[str, Any] = {
            "sim": sim,
            "observer": sim.observer,
            "ctx": ctx,
            "cfg": sim.cfg,
            "bus": sim.bus,
            "probe": sim.probe,
            "data": ctx.data,
            "train": ctx.data.train,
            "test": ctx.data.test,
            "aggregator": ctx.aggregator,
            "proto": sim.proto,
            "strategy": sim.proto.strategy,
            "network": getattr(sim.bus, "network", None),
        }
        if getattr(sim, "server", None) is not None:
            named["server"] = sim.server
        if sim.secure is not None:
            named["secure"] = sim.secure
            named["secure.server"] = sim.secure.server
        named.update({f"shared:{k}": v for k, v in ctx.shared_objects().items()})
        named.update({f"agent:{aid}": a for aid, a in sim.agents.items()})
        return {k: v for k, v in named.items() if v is not None}

    def capture_agents(self, ids: list[str]) -> dict[str, dict]:
        """Each listed local agent's lifecycle state and checkpoint state."""
        shared, agents = self.shared(), self.sim.agents
        return {
            aid: {"state": agents[aid].state, "blob": agents[aid].checkpoint_state(shared)}
            for aid in ids
        }

    def restore_agents(self, saved: dict[str, dict]) -> None:
        """Load ``capture_agents`` output into this run's freshly built (unstarted) agents."""
        shared, agents = self.shared(), self.sim.agents
        for aid, entry in saved.items():
            if aid in agents and not agents[aid].remote:
                try:
                    agents[aid].restore_state(entry["blob"], shared)
                except CheckpointError as e:
                    raise CheckpointError(f"agent {aid}: {e}") from None

    def objects(self) -> dict[str, Checkpointed | None]:
        """The run's objects besides its agents whose state a checkpoint holds (each class
        declares which of its attributes that is), by their key in the checkpoint."""
        sim = self.sim
        return {
            "server": sim.server,
            "strategy": sim.proto.strategy,
            "proto": sim.proto,
            "secure": sim.secure.server if sim.secure is not None else None,
            "flgo": sim.ctx.flgo,
            "bus": sim.bus,
            "probe": sim.probe,
        }

    async def save(self, round: int, now: float, sim0: float, wall: float) -> None:
        """Write the run as it stands after ``round`` (deferred while a message is in flight)."""
        sim = self.sim
        if sim.bus.in_flight:  # a late message is on its way: checkpoint at a quieter round
            sim.emit("checkpoint_deferred", round=round, in_flight=sim.bus.in_flight)
            return
        remote = await sim.remote.snapshot(sim) if sim.remote is not None else {}
        shared = self.shared()
        local = [a for a, ag in sim.agents.items() if not ag.remote]
        state = {
            "round": round,
            "now": now,
            "sim0": sim0,
            "wall": wall,
            **sim.records.state(),
            "agents": self.capture_agents(local),
            "remote": remote,
        }
        for key, obj in self.objects().items():
            state[key] = obj.checkpoint_state(shared) if obj is not None else None
        sim.checkpoint.save(state)
        sim.emit("checkpoint", round=round)

    def restore(self, saved: dict, agents: dict[str, dict]) -> None:
        """Load a saved run (checked first) into the freshly built one: ``agents`` are the
        saved agents by id, wherever the interrupted run hosted them."""
        sim = self.sim
        check_run_state(saved, self.objects())
        local = {aid for aid, agent in sim.agents.items() if not agent.remote}
        check_run_ranges(saved, sim.plan.rounds, set(sim.agents), local)
        shared = self.shared()
        self.restore_agents(agents)
        for key, obj in self.objects().items():
            if saved[key] is not None:
                obj.restore_state(saved[key], shared)
        sim.records.load(saved)
        for aid, agent in sim.agents.items():  # a proxy's count comes from the round reports
            if agent.remote:
                agent.rounds_joined = sum(aid in r.clients for r in saved["reports"])
        sim.emit("resumed", round=saved["round"])

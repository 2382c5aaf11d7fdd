"""One run's records as it plays, and its checkpoints: what a saved run holds, and the checks a
saved run passes before it loads (a checkpoint is checksummed, not signed)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from foltr_async.runtime.checkpoint import CheckpointError
from foltr_async.runtime.engine import RoundReport


@dataclass
class RunCheckpoint:
    """Checkpointing of one run: write ``save(state)`` every ``every`` rounds of the training
    phase; ``state`` (when resuming) is what the interrupted run saved last, read from
    ``source`` (the file named in an error loading it)."""

    every: int
    save: Callable[[dict], None]
    state: dict | None = None
    source: str = "checkpoint"


@dataclass
class Records:
    """What a run records round by round for its results; a checkpoint carries all of it."""

    rounds: list[int] = field(default_factory=list)  #: the evaluated rounds
    initial: dict[str, float] = field(default_factory=dict)  #: offline metrics before round 1
    curve: list[dict[str, float]] = field(default_factory=list)  #: metrics at each evaluation
    times: list[float] = field(default_factory=list)  #: simulated seconds at each evaluation
    interactions: list[int] = field(default_factory=list)  #: users' interactions by each
    reports: list[RoundReport] = field(default_factory=list)  #: every round played

    def add(self, report: RoundReport, sim_time: float, interactions: int) -> None:
        """A finished round (an evaluation when it has metrics)."""
        self.reports.append(report)
        if report.metrics is not None:
            self.rounds.append(report.round)
            self.curve.append(report.metrics)
            self.times.append(sim_time)
            self.interactions.append(interactions)

    def state(self) -> dict[str, Any]:
        """A copy for a checkpoint, a key per field (the run goes on appending)."""
        return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}

    def load(self, saved: dict[str, Any]) -> None:
        """What ``state`` saved (checked by ``check_run_state`` first)."""
        for f in fields(self):
            setattr(self, f.name, copy.copy(saved[f.name]))


def check_run_ranges(saved: dict, rounds: int, agent_ids: set[str], local: set[str]) -> None:
    """What the layout check cannot see: values in range and consistent with each other and
    with the rebuilt run (a checkpoint is checksummed, not signed: an edited one with its
    checksum recomputed is read). The run saves after a training round, so its round is one
    of them; its clocks are finite and in order; it evaluated only rounds it had played;
    and it holds no agent this run lacks, and every one this process hosts (a worker lost
    at the save took its clients' states with it: those are not required)."""
    now, sim0, wall = saved["now"], saved["sim0"], saved["wall"]
    problems = {
        "round": (
            1 <= saved["round"] <= rounds,
            f"a training round of this run, 1 to {rounds}",
            saved["round"],
        ),
        "now": (
            math.isfinite(now) and math.isfinite(sim0) and now >= sim0,
            "a finite time at or after the run's start (sim0)",
            now,
        ),
        "wall": (math.isfinite(wall) and wall >= 0, "a finite number of seconds >= 0", wall),
        "rounds": (
            all(1 <= r <= saved["round"] for r in saved["rounds"])
            and saved["rounds"] == sorted(set(saved["rounds"])),
            f"increasing rounds up to the saved round {saved['round']}",
            saved["rounds"][:8],
        ),
        "times": (
            all(math.isfinite(t) and t <= now for t in saved["times"]),
            "finite times up to the saved time",
            saved["times"][:8],
        ),
        "reports": (
            len(saved["reports"]) <= saved["round"],
            f"at most one report per round played ({saved['round']})",
            len(saved["reports"]),
        ),
    }
    for key, (ok, expected, got) in problems.items():
        if not ok:
            raise CheckpointError(f"run state: {key}: expected {expected}, got {got!r:.60}")
    saved_ids = set(saved["agents"]) | set(saved["remote"])
    for which, ids in (
        ("missing", agent_ids - saved_ids),
        ("not in this run", saved_ids - agent_ids),
    ):
        if ids:
            raise CheckpointError(
                f"run state: agents: {len(ids)} {which} (e.g. {sorted(ids)[0]!r}): expected "
                "the agents of this run's configuration"
            )


def check_run_state(saved: Any, objects: dict[str, Any]) -> None:
    """The layout ``Simulation._save`` writes (each object's own state is checked as it loads,
    against the object)."""
    kinds = {
        "round": int, "now": float, "sim0": float, "wall": float, "rounds": list,
        "initial": dict, "curve": list, "times": list, "reports": list, "agents": dict,
        "remote": dict,
    }  # fmt: skip
    if type(saved) is not dict:
        raise CheckpointError(f"run state: expected a table, got a {type(saved).__name__}")
    for key, kind in {**kinds, **dict.fromkeys(objects, object)}.items():
        value = saved.get(key)
        ok = type(value) is kind or (kind is float and type(value) is int)
        if key in objects:  # an object's state, or None where the run had no such object
            ok = key in saved and (value is None) == (objects[key] is None)
        if not ok:
            want = "this run's object state" if key in objects else f"a {kind.__name__}"
            raise CheckpointError(f"run state: {key}: expected {want}, got {value!r:.40}")
    checks = {
        "rounds": lambda x: type(x) is int,
        "curve": lambda x: x is None or type(x) is dict,
        "times": lambda x: type(x) is float,
        "reports": lambda x: type(x) is RoundReport,
        "agents": lambda x: type(x) is dict and type(x.get("state")) is str,
        "remote": lambda x: type(x) is dict and type(x.get("state")) is str,
    }
    for key, ok in checks.items():
        items = saved[key].values() if key in ("agents", "remote") else saved[key]
        if not all(ok(x) for x in items):
            raise CheckpointError(f"run state: {key}: an item of the wrong kind")

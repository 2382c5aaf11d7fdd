"""A whole scenario: every variant for every repeat seed, reported to the observers as it goes.

Repeats are the outer loop, so an interrupted run already holds a full side-by-side comparison
for the seeds it finished. Variants of one repeat share its seed (paired comparisons).

With ``checkpoint_every = K`` the runner keeps ``checkpoint.pkl`` in the output folder: the
finished repeats and, every K rounds, the state of the one in progress. ``resume`` continues
from it: finished repeats are not run again, the interrupted one restarts after its last
checkpointed round, and the results equal those of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from foltr_async.observe.log import close_logging, configure_logging
from foltr_async.observe.observer import Observer, Observers
from foltr_async.observe.results import ResultsWriter
from foltr_async.observe.stats import paired_test
from foltr_async.runtime.checkpoint import CheckpointError, read_checkpoint, write_atomic
from foltr_async.runtime.clock import VirtualTimeLoop
from foltr_async.runtime.clock import run as run_loop
from foltr_async.scenario.load import Scenario
from foltr_async.simulation import RunCheckpoint, Simulation

METRIC = "ndcg@10"
CHECKPOINT = "checkpoint.pkl"
_FORMAT = 1


def fingerprint(scenario: Scenario) -> str:
    """What a checkpoint must match to be resumed: every resolved variant, repeats and seed."""
    text = json.dumps(
        [scenario.seed, scenario.repeats, scenario.variants], sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()


class Checkpoints:
    """The scenario's checkpoint file: finished repeats and the latest state of the current one.

    Written atomically (``write_atomic``) at every run checkpoint and after every repeat, only
    when checkpointing is on (``every > 0``) or the run was resumed.
    """

    def __init__(
        self, out_dir: Path, scenario: Scenario, every: int = 0, resume: bool = False
    ) -> None:
        self.path = Path(out_dir) / CHECKPOINT
        self.fingerprint = fingerprint(scenario)
        if resume:
            data = read_checkpoint(self.path)
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise CheckpointError(f"{self.path}: not a checkpoint of this version")
            if data["fingerprint"] != self.fingerprint:
                raise CheckpointError(
                    f"{self.path}: written for another configuration (the scenario file, --set, "
                    "--seed and --only must be those of the interrupted run)"
                )
            every = every or data["every"]
        else:
            data = {"format": _FORMAT, "fingerprint": self.fingerprint, "done": {}, "current": None}
        self.data = data
        self.every = data["every"] = every
        self.active = every > 0 or resume

    def done(self, variant: str, repeat: int) -> dict | None:
        """The result of a repeat the checkpointed run finished."""
        return self.data["done"].get((variant, repeat))

    def run(self, variant: str, repeat: int) -> RunCheckpoint | None:
        """Checkpointing of one repeat (with its saved state when it is the interrupted one)."""
        cur = self.data["current"]
        state = cur["state"] if cur is not None and cur["run"] == (variant, repeat) else None
        if not self.active:
            return None

        def save(st: dict) -> None:
            self.data["current"] = {"run": (variant, repeat), "state": st}
            write_atomic(self.path, self.data)

        return RunCheckpoint(self.every, save, state) if self.every or state else None

    def finished(self, variant: str, repeat: int, result: dict) -> None:
        self.data["done"][variant, repeat] = result
        self.data["current"] = None
        if self.active:
            write_atomic(self.path, self.data)


def conclusions(results: dict) -> list[str]:
    """Plain sentences a reader can check against the table."""
    variants = results.get("variants", {})
    finals = {
        name: v["summary"]["final"][METRIC]["mean"]
        for name, v in variants.items()
        if v.get("summary", {}).get("final", {}).get(METRIC)
    }
    if not finals:
        return []
    best = max(finals, key=finals.get)
    lines = [f"Highest final {METRIC}: {best} ({finals[best]:.4f})."]
    ref = results.get("reference")
    for name, value in finals.items():
        if not name.endswith("-unlearned"):
            continue
        before = name.removesuffix("-unlearned")
        if before not in finals or ref not in finals:
            continue
        gap = finals[ref] - finals[before]
        if abs(gap) < 1e-12:
            lines.append(f"{before} did not differ from {ref}: nothing to recover.")
            continue
        share = (value - finals[before]) / gap
        verdict = "recovered" if value > finals[before] else "did not recover"
        diff, p = _paired(variants, name, before)
        test = "" if p is None else f"; {name} vs {before}: {diff:+.4f}, paired p={p:.3g}"
        lines.append(
            f"Unlearning {verdict}: {name} {value:.4f} vs {before} {finals[before]:.4f} and "
            f"{ref} {finals[ref]:.4f} ({share:.0%} of the gap closed{test})."
        )
    for name, v in variants.items():
        runs = [(r.get("privacy") or {}).get("run") for r in v.get("repeats", [])]
        runs = [r for r in runs if r and r.get("basic") is not None]
        if runs:
            mean = {
                k: float(np.mean([r[k] for r in runs]))
                for k in ("basic", "rdp", "pld", "pld_sampled")
                if all(r.get(k) is not None for r in runs)
            }
            delta = v["repeats"][0]["privacy"]["delta"]
            lines.append(
                f"Privacy of {name} (worst client, delta={delta:g}): epsilon "
                + ", ".join(f"{k.replace('_', ' ')} {x:.3g}" for k, x in mean.items())
                + "."
            )
    same = results.get("equal_time")
    if same:
        at = ", ".join(f"{name} {s['mean']:.4f}" for name, s in same["variants"].items() if s["n"])
        lines.append(f"{METRIC} at equal simulated time {same['time']:.0f} s: {at}.")
    for comp in results.get("comparisons", []):
        if comp.get("diff_mean") is None:
            continue
        p = comp.get("p_value")
        sig = "n/a" if p is None else ("significant" if p < 0.05 else "not significant")
        lines.append(
            f"{comp['variant']} vs {comp['reference']}: {comp['diff_mean']:+.4f} {METRIC} "
            f"(paired t-test over {comp['n']} seeds: {sig}"
            + ("" if p is None else f", p={p:.3g}")
            + ")."
        )
    return lines


def _paired(variants: dict, a: str, b: str) -> tuple[float | None, float | None]:
    """Paired test of two variants' final metric over the seeds both finished."""

    def finals(name: str) -> dict[int, float]:
        return {
            r["seed"]: r["offline"][METRIC][-1]
            for r in variants[name]["repeats"]
            if r.get("offline", {}).get(METRIC)
        }

    fa, fb = finals(a), finals(b)
    seeds = sorted(set(fa) & set(fb))
    return paired_test([fa[s] for s in seeds], [fb[s] for s in seeds])


def run_scenario(
    scenario: Scenario,
    out_dir: Path,
    reporter: Observer,
    *,
    checkpoint_every: int = 0,
    resume: bool = False,
    remote: Any = None,
) -> dict:
    """Run every repeat of every variant; ``remote``: a multi-process transport's server side
    (``foltr_async.distributed.ZmqServer``) instead of the in-memory bus in virtual time.

    Called as a library with structlog unconfigured (its default prints every debug event to
    stdout), it logs as the CLI does for the run: ``events.jsonl`` in ``out_dir`` and warnings
    and errors on stderr.
    """
    own_logging = not structlog.is_configured()
    if own_logging:
        configure_logging(
            events_path=Path(out_dir) / "events.jsonl",
            json_logs=False,
            level="warning",
            console=False,
        )
    try:
        return _run_scenario(scenario, out_dir, reporter, checkpoint_every, resume, remote)
    finally:
        if own_logging:
            close_logging()
            structlog.reset_defaults()


def _run_scenario(
    scenario: Scenario,
    out_dir: Path,
    reporter: Observer,
    checkpoint_every: int,
    resume: bool,
    remote: Any,
) -> dict:
    checkpoints = Checkpoints(out_dir, scenario, checkpoint_every, resume)
    writer = ResultsWriter(
        out_dir,
        scenario=scenario.name,
        seed=scenario.seed,
        config=scenario.variants,
        reference=scenario.reference,
        metric=METRIC,
        conclusions=conclusions,
    )
    observers = Observers([reporter, writer])
    observers.run_started(
        {
            "scenario": scenario.name,
            "out_dir": str(out_dir),
            "seed": scenario.seed,
            "variants": list(scenario.variants),
            "repeats": scenario.repeats,
            "rounds": {n: c["federation"]["rounds"] for n, c in scenario.variants.items()},
            "reference": scenario.reference,
            "metric": METRIC,
        }
    )
    todo = []
    for rep in range(scenario.repeats):
        seed = scenario.seed + rep
        for name, cfg in scenario.variants.items():
            done = checkpoints.done(name, rep)
            if done is not None:  # finished before the interruption
                observers.repeat_started(name, rep, seed)
                observers.repeat_done(name, rep, done)
            else:
                todo.append((rep, seed, name, cfg))

    def finish(name: str, rep: int, result: dict) -> None:
        result = _plain(result)
        checkpoints.finished(name, rep, result)
        observers.repeat_done(name, rep, result)

    if remote is None:
        for rep, seed, name, cfg in todo:
            observers.repeat_started(name, rep, seed)
            ck = checkpoints.run(name, rep)
            sim = Simulation(cfg, seed, observers, name, rep, checkpoint=ck)
            start = ck.state["now"] if ck is not None and ck.state is not None else 0.0
            with asyncio.Runner(loop_factory=lambda t=start: VirtualTimeLoop(t)) as runner:
                finish(name, rep, runner.run(sim.run()))
    else:

        class _StopOnCtrlC(Observer):
            """Real-time runs: Ctrl-C cancels the run and, should that cancellation be absorbed
            by a wait that completed at the same instant, stops it at the next round."""

            requested = False

            def round_done(self, *args, **kwargs) -> None:
                if self.requested:
                    raise KeyboardInterrupt

        stop = _StopOnCtrlC()
        observers.add(stop)

        async def drive() -> None:
            loop, main = asyncio.get_running_loop(), asyncio.current_task()

            def on_sigint() -> None:
                if stop.requested:  # a second Ctrl-C: stop now
                    raise KeyboardInterrupt
                stop.requested = True
                main.cancel()

            loop.add_signal_handler(signal.SIGINT, on_sigint)
            await remote.start()
            try:
                for rep, seed, name, cfg in todo:
                    observers.repeat_started(name, rep, seed)
                    sim = Simulation(
                        cfg,
                        seed,
                        observers,
                        name,
                        rep,
                        bus=remote.make_bus(cfg, seed),
                        hosts=remote.hosts,
                        remote=remote,
                        checkpoint=checkpoints.run(name, rep),
                    )
                    finish(name, rep, await sim.run())
            finally:
                await remote.close()

        try:
            run_loop(drive(), virtual=False)
        except asyncio.CancelledError:
            if stop.requested:  # our Ctrl-C cancelled the run: report it as an interruption
                raise KeyboardInterrupt from None
            raise
    writer.run_done({})
    final = writer.results
    reporter.run_done(final)
    return final


def _plain(obj):
    """numpy scalars and arrays -> JSON-ready Python values."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj

"""How a scenario's pending repeats run: three executors behind one ``run(todo)``.

``Serial``: in this process, one repeat after another, each in virtual time (checkpoints taken
and resumed). ``Parallel``: in other processes or on a Ray cluster (``foltr_async.parallel``),
longest first. ``Remote``: on a multi-process transport's server side (ZeroMQ workers), in real
time, with Ctrl-C and SIGTERM ending the run gracefully. Each reports a repeat's start to the
observers and hands its result to ``finish``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from foltr_async.errors import FoltrError
from foltr_async.observe.observer import Observer, Observers
from foltr_async.parallel import Job, longest_first, run_jobs
from foltr_async.preflight import located
from foltr_async.runtime import heap
from foltr_async.runtime.clock import VirtualTimeLoop
from foltr_async.runtime.clock import run as run_loop
from foltr_async.scenario.load import Scenario
from foltr_async.simulation import RunCheckpoint, Simulation

#: a finished repeat's result, to the checkpoint and the results files: (variant, repeat, result)
Finish = Callable[[str, int, dict], None]


class Executor(Protocol):
    def run(self, todo: list[Job]) -> None:
        """Run every job of ``todo``, reporting each one's start and handing its result on."""


@dataclass
class Serial:
    """In this process, one repeat after another, each on its own virtual-time loop."""

    scenario: Scenario
    observers: Observers
    finish: Finish
    checkpoint: Callable[[str, int], RunCheckpoint | None]
    #: raises a Ctrl-C that landed while a finaliser ran (``heap.release`` collects)
    check_interrupt: Callable[[], None]

    def run(self, todo: list[Job]) -> None:
        for rep, seed, name, cfg in todo:
            self.check_interrupt()
            self.observers.repeat_started(name, rep, seed)
            ck = self.checkpoint(name, rep)
            sim = Simulation(cfg, seed, self.observers, name, rep, checkpoint=ck)
            start = ck.state["now"] if ck is not None and ck.state is not None else 0.0
            with (
                located(self.scenario, name),
                asyncio.Runner(loop_factory=lambda t=start: VirtualTimeLoop(t)) as runner,
            ):
                self.finish(name, rep, runner.run(sim.run()))
            del sim
            heap.release()


@dataclass
class Parallel:
    """In ``jobs`` other processes, or on Ray (``executor``), the longest jobs first."""

    scenario: Scenario
    observers: Observers
    finish: Finish
    jobs: int
    executor: str

    def run(self, todo: list[Job]) -> None:
        heap.forget()  # what the pre-run check built: the runs build their own, elsewhere
        try:
            for (rep, seed, name, _), result in run_jobs(
                longest_first(todo), self.jobs, self.executor
            ):
                self.observers.repeat_started(name, rep, seed)
                self.finish(name, rep, result)
        except FoltrError as e:  # a job's own error: name its file and variant
            if not hasattr(e, "job"):
                raise
            with located(self.scenario, e.job[2]):
                raise


class _StopOnCtrlC(Observer):
    """Real-time runs: Ctrl-C cancels the run and, should that cancellation be absorbed by a
    wait that completed at the same instant, stops it at the next round."""

    requested = False

    def round_done(self, *args, **kwargs) -> None:
        if self.requested:
            raise KeyboardInterrupt


@dataclass
class Remote:
    """On a multi-process transport's server side (``remote``: a ``ZmqServer``), in real time."""

    scenario: Scenario
    observers: Observers
    finish: Finish
    checkpoint: Callable[[str, int], RunCheckpoint | None]
    remote: Any

    def run(self, todo: list[Job]) -> None:
        stop = _StopOnCtrlC()
        self.observers.add(stop)
        try:
            run_loop(self._drive(todo, stop), virtual=False)
        except asyncio.CancelledError:
            if stop.requested:  # our Ctrl-C cancelled the run: report it as an interruption
                raise KeyboardInterrupt from None
            raise

    async def _drive(self, todo: list[Job], stop: _StopOnCtrlC) -> None:
        loop, main, remote = asyncio.get_running_loop(), asyncio.current_task(), self.remote

        def on_sigint() -> None:
            if stop.requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            stop.requested = True
            main.cancel()

        # SIGTERM (kill, a batch scheduler) takes the same graceful path as Ctrl-C; the CLI's
        # own SIGTERM handler is put back when the loop is done with it
        sigterm = signal.getsignal(signal.SIGTERM)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_sigint)
        await remote.start()
        try:
            for rep, seed, name, cfg in todo:
                self.observers.repeat_started(name, rep, seed)
                sim = Simulation(
                    cfg,
                    seed,
                    self.observers,
                    name,
                    rep,
                    bus=remote.make_bus(cfg, seed),
                    hosts=remote.hosts,
                    remote=remote,
                    checkpoint=self.checkpoint(name, rep),
                )
                with located(self.scenario, name):
                    self.finish(name, rep, await sim.run())
        finally:
            await remote.close()
            loop.remove_signal_handler(signal.SIGTERM)
            if sigterm is not None:  # None: set outside Python, nothing to put back
                signal.signal(signal.SIGTERM, sigterm)

"""Virtual time for in-memory runs: the loop's clock jumps to the next timer when idle.

``VirtualTimeLoop`` is a stock ``SelectorEventLoop`` whose ``time()`` is a simulated clock.
Its selector never blocks: it polls real I/O with timeout 0 and, when nothing is ready,
advances the simulated clock by exactly the timeout the loop asked for, i.e. to the next
scheduled timer. So ``asyncio.sleep``, ``call_later``, ``asyncio.timeout`` and ``wait_for`` all
run in simulated time, ten simulated minutes cost no wall time, and the order of events
depends only on the program and its seeds, never on the machine's speed.

Why not ``looptime``: it is a pytest-oriented patcher of existing loops; a subclass of the
stdlib loop is ~100 lines, has no dependency, works with ``asyncio.Runner(loop_factory=...)``
and lets us fail loudly on a deadlock instead of hanging.

Executor work (``run_in_executor``, ``asyncio.to_thread``, the default executor's shutdown)
is real work on real threads: while some is in flight the selector waits for it in real time
and the simulated clock follows the wall clock. Other real I/O is polled but never waited
for; virtual time is for in-memory runs (the ZeroMQ bus uses a normal loop).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["DeadlockError", "VirtualTimeLoop", "run"]

T = TypeVar("T")


class DeadlockError(RuntimeError):
    """Every task waits, no timer is scheduled and nothing external is pending."""


class _Clock:
    __slots__ = ("now", "external")

    def __init__(self, start: float) -> None:
        self.now = start
        self.external = 0  # executor jobs in flight: the only thing worth waiting for


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, clock: _Clock, loop_ref: list) -> None:
        super().__init__()
        self._clock = clock
        self._loop_ref = loop_ref

    def select(self, timeout: float | None = None) -> list:
        clock = self._clock
        if clock.external:
            t0 = time.monotonic()
            events = super().select(timeout)
            waited = time.monotonic() - t0
            clock.now += waited if timeout is None else min(waited, timeout)
            return events
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise DeadlockError(_deadlock_message(self._loop_ref[0]))
        if timeout > 0:
            clock.now += timeout
        return events


def _deadlock_message(loop: asyncio.AbstractEventLoop | None) -> str:
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()) if loop else []
    shown = []
    for task in tasks[:8]:
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        where = f" at line {frame.f_lineno}" if frame is not None else ""
        shown.append(f"{task.get_name()} ({getattr(coro, '__qualname__', coro)}{where})")
    more = f" and {len(tasks) - 8} more" if len(tasks) > 8 else ""
    return (
        f"virtual-time deadlock at t={loop.time() if loop else 0.0:.6f}s: no callback is ready and "
        f"no timer is scheduled, so {len(tasks)} waiting task(s) would wait forever: "
        + (", ".join(shown) or "none")
        + more
    )


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock is simulated (starts at ``start`` seconds)."""

    def __init__(self, start: float = 0.0) -> None:
        self._clock = _Clock(float(start))
        ref: list = [None]
        super().__init__(_VirtualSelector(self._clock, ref))
        ref[0] = self

    def __del__(self, *args: Any) -> None:
        # a Ctrl-C inside ``__init__`` leaves a loop without its self-pipe, whose stock
        # ``__del__`` would print a traceback while the interrupted run exits cleanly
        if hasattr(self, "_ssock"):
            super().__del__(*args)

    def time(self) -> float:
        return self._clock.now

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future:
        fut = super().run_in_executor(executor, func, *args)
        self._clock.external += 1
        fut.add_done_callback(self._external_done)
        return fut

    def _external_done(self, _fut: asyncio.Future) -> None:
        self._clock.external -= 1

    async def shutdown_default_executor(self, *args: Any, **kwargs: Any) -> None:
        # Joins executor threads from a helper thread: real waiting, not a deadlock.
        self._clock.external += 1
        try:
            await super().shutdown_default_executor(*args, **kwargs)
        finally:
            self._clock.external -= 1


def run(coro: Coroutine[Any, Any, T], *, virtual: bool = True, debug: bool | None = None) -> T:
    """Run a coroutine to completion on a fresh loop: virtual time by default, else real."""
    with asyncio.Runner(debug=debug, loop_factory=VirtualTimeLoop if virtual else None) as runner:
        return runner.run(coro)

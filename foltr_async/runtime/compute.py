"""A compute pool: agents' local computations that take simulated time, run in batches.

An agent awaits ``pool.submit(job)`` and gets its result ``compute_time`` simulated seconds
later, as if it had computed alone. The pool does not compute at once: it keeps one loop timer
for the earliest due time among the pending jobs and, when it fires, runs ``batch_fn`` once on
*every* pending job (submission order), then resolves each job's future at its own due time.
Every pending job was submitted no later than now and is due no earlier than now (the timer is
for the earliest due), so no result arrives before its due time. With ``compute_time = 0``
exactly the jobs submitted at the same (virtual) instant share a batch: on a zero-latency network
that is every client of a round.

``batch_fn`` must compute each job from that job's own state only; then batching never changes
what an agent gets, only how fast the simulator gets it. A job whose agent left or crashed
before the flush (its task cancelled, so its future too) is discarded without being computed;
one cancelled after the flush simply never receives its result. If ``batch_fn`` raises, every
job of the batch gets the exception (the agents count a handler error, as for any failure).

The pool knows nothing about protocols; a protocol builds one per run (on the run's loop).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["BatchPool"]

J = TypeVar("J")
R = TypeVar("R")


def _resolve(fut: asyncio.Future, result: object) -> None:
    if not fut.done():
        fut.set_result(result)


class BatchPool(Generic[J, R]):
    """Batches jobs submitted by many agents; ``batch_fn(jobs) -> results`` (same length)."""

    def __init__(
        self,
        batch_fn: Callable[[list[J]], Sequence[R]],
        compute_time: float = 0.0,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        if not (compute_time >= 0.0 and math.isfinite(compute_time)):
            raise ValueError(f"compute_time must be a finite number >= 0, got {compute_time}")
        self.batch_fn = batch_fn
        self._prepare = prepare
        self.compute_time = float(compute_time)
        self._pending: list[tuple[float, J, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flush_at = math.inf
        # Counters for reports and tests.
        self.batches = 0
        self.jobs = 0
        self.discarded = 0
        self.largest = 0

    def prepare(self) -> None:
        """Do ``batch_fn``'s one-off set-up now (e.g. loading compiled code), so that a run
        whose rounds have real-time deadlines does not pay it inside its first round."""
        if self._prepare is not None:
            self._prepare()
            self._prepare = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def submit(self, job: J, compute_time: float | None = None) -> R:
        """The result of ``job``, ``compute_time`` (default: the pool's) simulated seconds on."""
        duration = self.compute_time if compute_time is None else float(compute_time)
        if not (duration >= 0.0 and math.isfinite(duration)):
            raise ValueError(f"compute_time must be a finite number >= 0, got {compute_time}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        due = loop.time() + duration
        self._pending.append((due, job, fut))
        if due < self._flush_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(due, self._flush)
            self._flush_at = due
        return await fut

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        batch, self._pending = self._pending, []
        self._timer, self._flush_at = None, math.inf
        live = [entry for entry in batch if not entry[2].done()]
        self.discarded += len(batch) - len(live)
        if not live:
            return
        self.batches += 1
        self.jobs += len(live)
        self.largest = max(self.largest, len(live))
        try:
            results = self.batch_fn([job for _, job, _ in live])
            if len(results) != len(live):
                raise RuntimeError(f"batch_fn gave {len(results)} results for {len(live)} jobs")
        except Exception as e:
            for _, _, fut in live:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (due, _, fut), result in zip(live, results, strict=True):
            if due <= now:
                _resolve(fut, result)
            else:
                loop.call_at(due, _resolve, fut, result)

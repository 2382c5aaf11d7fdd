"""Keeping the cyclic garbage collector off a run's long-lived heap.

A paper-scale run holds ~150,000 tracked objects that live as long as the run (agents, their
queues and handlers, the protocol's state, compiled code). Every full collection rescans them
all, and a round allocates enough to trigger several: ~20% of a round went there. ``gc.freeze``
moves what is alive now to a generation the collector never scans; those objects still die by
reference counting, only cycles among them wait until the last run in the process thaws them.
"""

from __future__ import annotations

import gc

__all__ = ["freeze", "refreeze", "thaw"]

_runs = 0  # runs of this process whose heap is frozen (runs may overlap on one event loop)


def freeze() -> None:
    """A run has built and started its agents: freeze everything alive now."""
    global _runs
    _runs += 1
    gc.freeze()


def refreeze() -> None:
    """Freeze what a frozen run built since (e.g. compiled code loaded by its first round)."""
    if _runs:
        gc.freeze()


def thaw() -> None:
    """A frozen run ended: once none is left, the collector may reclaim their cycles again."""
    global _runs
    _runs = max(0, _runs - 1)
    if not _runs:
        gc.unfreeze()

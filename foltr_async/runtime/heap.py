"""Keeping the cyclic garbage collector off a run's long-lived heap.

A paper-scale run holds ~150,000 tracked objects that live as long as the run (agents, their
queues and handlers, the protocol's state, compiled code). Every full collection rescans them
all, and a round allocates enough to trigger some: ~15% of a round went there. ``gc.freeze``
moves what is alive now to a generation the collector never scans; those objects still die by
reference counting, only cycles among them wait until the last run in the process thaws them.
A round also allocates (and frees) some ten objects per message, so the youngest generation's
threshold is raised while a run plays: fewer, larger young collections (the default 700 gave
~35 young collections per paper-scale round, ~8 us per client), and more so the larger the
frozen heap, since a round's allocations grow with the agents (62,500 clients: ~1.15 CPU s of
collections a round at 10,000, ~0.3 s at one per 4 frozen objects).

Data a process reuses across runs (datasets, corpora) is cached with :func:`process_cache`, and
:func:`forget` drops it where the runs go to other processes (the parent of ``--jobs``, which
built every variant once to check it). Between runs, :func:`release` hands the pages a finished
run freed back to the system: glibc keeps freed heap memory for reuse, and a process running
CS-F-LTR jobs back to back (corpora and sketches of a few hundred MB each, built and dropped per
variant) grew by the fragments until the out-of-memory killer stopped it at 11.5 GB. It does so
when the process has grown since it last did: small repeats leave their few MB of cycles to the
collector's schedule instead of a full collection each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import sys
from collections.abc import Callable
from functools import cache, lru_cache
from typing import TypeVar

__all__ = ["forget", "freeze", "process_cache", "refreeze", "release", "thaw", "trim"]

F = TypeVar("F", bound=Callable)

#: Allocations between two young collections while a run plays (Python's default: 700).
YOUNG_THRESHOLD = 10_000
#: ... or one per this many allocated memory blocks, for larger runs (``_raise_young``): about
#: one per 4 frozen objects (a run holds 3.9-4.8 blocks per tracked object from 10 to 2,000
#: clients), read in constant time where counting the frozen objects walks them all
BLOCKS_PER_YOUNG = 16

_runs = 0  # runs of this process whose heap is frozen (runs may overlap on one event loop)
_thresholds: tuple[int, ...] = ()  # the collector's thresholds before the first of them


def freeze() -> None:
    """A run has built and started its agents: freeze everything alive now."""
    global _runs, _thresholds
    if not _runs:
        _thresholds = gc.get_threshold()
    _runs += 1
    gc.freeze()
    _raise_young()


def refreeze() -> None:
    """Freeze what a frozen run built since (e.g. compiled code loaded by its first round)."""
    if _runs:
        gc.freeze()
        _raise_young()


def _raise_young() -> None:
    """The young threshold while runs play: ``YOUNG_THRESHOLD``, or one allocation per
    ``BLOCKS_PER_YOUNG`` allocated blocks when that is more. A run's allocations per round grow
    with its agents, and with a fixed threshold so do its young, middle and full collections:
    62,500 clients spent ~1.2 CPU s of a ~9 s round in them. (``gc.get_freeze_count`` walks
    the frozen heap: ~20 ms twice a repeat, a tenth of a short repeat.)"""
    young = max(YOUNG_THRESHOLD, _thresholds[0], sys.getallocatedblocks() // BLOCKS_PER_YOUNG)
    gc.set_threshold(young, *_thresholds[1:])


def thaw() -> None:
    """A frozen run ended: once none is left, the collector may reclaim their cycles again."""
    global _runs
    if not _runs:
        return
    _runs -= 1
    if not _runs:
        gc.unfreeze()
        gc.set_threshold(*_thresholds)


@cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None on another C library."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (AttributeError, OSError):
        return None


def trim() -> None:
    """Give the C heap's free pages back to the system (glibc; elsewhere nothing to do)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


#: Growth of the process since the last ``release`` below which a finished run's cycles are
#: left to the collector's own schedule: a full collection rescans every live object (~150,000
#: once numpy, scipy and numba are imported: 0.1-0.2 s), which a process of short repeats
#: would pay after each one, while a run that held hundreds of MB (CS-F-LTR's corpora) is
#: collected and trimmed at once.
RELEASE_GROWTH = 64 << 20
_released_at: int | None = None  # the process's resident bytes after the last collection


def _resident() -> int | None:
    """Resident bytes of this process (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


def release(force: bool = False) -> None:
    """A run is over and dropped: collect its cycles and return its free pages to the system,
    once the process has grown by ``RELEASE_GROWTH`` since the last time (always where its
    size cannot be read, or with ``force``)."""
    global _released_at
    now = _resident()
    if not force and None not in (now, _released_at) and now - _released_at < RELEASE_GROWTH:
        return
    gc.collect()
    trim()
    _released_at = _resident()


_process_caches: list = []


def process_cache(maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)`` for data a process reuses across runs; ``forget``
    empties it."""

    def wrap(fn: F) -> F:
        cached = lru_cache(maxsize=maxsize)(fn)
        _process_caches.append(cached)
        return cached  # type: ignore[return-value]

    return wrap


def forget() -> None:
    """Empty every ``process_cache`` and return the memory: nothing this process built for
    runs stays alive (the runs themselves are elsewhere)."""
    for cached in _process_caches:
        cached.cache_clear()
    release(force=True)

"""How many threads the compiled PDGD kernel may use (``--threads``, ``FOLTR_ASYNC_THREADS``).

A batch's jobs are independent and each draws from its own generator, so results never depend
on this number; only the wall time does. Read by ``pdgd_kernel`` on every batch; this module
imports nothing heavy, so the CLI can set it before numba is loaded.
"""

from __future__ import annotations

import contextlib
import os

from foltr_async.errors import FoltrError

__all__ = [
    "BLAS_ENV",
    "ENV",
    "cores",
    "facts",
    "layer",
    "one_blas_thread",
    "per_process",
    "set_threads",
    "threads",
]

#: environment variable with the default thread count (the CLI's ``--threads`` overrides it)
ENV = "FOLTR_ASYNC_THREADS"
#: BLAS thread counts: ``python -m foltr_async`` sets each to 1 before numpy loads (a value the
#: user set wins)
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> contextlib.AbstractContextManager:
    """A run's BLAS on one thread, unless the user set a count (``BLAS_ENV``).

    A run makes many small products from one event loop, where BLAS's own threads only spin and
    contend; the CLI sets the count before numpy loads, but a library caller (a notebook, a
    script) has numpy loaded with a thread per core: a 300-round MLP(64) non-IID run took 18-27
    user s that way against 5-6 on one thread (docs/PERFORMANCE.md).
    """
    if any(name in os.environ for name in BLAS_ENV):
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, user_api="blas")


_chosen: int | None = None


def cores() -> int:
    """The cores this process may run on (its CPU affinity), the default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def _parse(value: str, where: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise FoltrError(f"{where}: expected a whole number of threads >= 1, got {value!r}")
    return n


def set_threads(n: int | str | None, *, children: bool = False) -> None:
    """Use ``n`` threads from now on (None: back to ``FOLTR_ASYNC_THREADS`` or the cores);
    ``children``: also for processes started from now on (through ``FOLTR_ASYNC_THREADS``)."""
    global _chosen
    _chosen = None if n is None else _parse(str(n), "--threads")
    if children and _chosen is not None:
        os.environ[ENV] = str(_chosen)


def threads() -> int:
    """The thread count in force: ``set_threads``'s, else ``FOLTR_ASYNC_THREADS``, else the
    cores."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENV)
    return _parse(env, ENV) if env else cores()


def per_process(processes: int) -> int:
    """Threads for each of ``processes`` local processes sharing the cores: ``FOLTR_ASYNC_THREADS``
    when set (a bad value fails in one line), else the cores split between them (at least one)."""
    env = os.environ.get(ENV)
    return _parse(env, ENV) if env else max(1, cores() // processes)


def layer() -> str:
    """numba's threading layer for the kernel: ``NUMBA_THREADING_LAYER`` when set, else
    ``workqueue`` (``pdgd_kernel`` says why)."""
    return os.environ.get("NUMBA_THREADING_LAYER") or "workqueue"


def facts() -> dict:
    """What results.json records of this: the kernel's threads per process, the cores this
    process may use and the threading layer."""
    return {"threads": threads(), "cores": cores(), "threading_layer": layer()}

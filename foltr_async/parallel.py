"""Run a scenario's (variant, repeat) jobs in parallel: local processes or a Ray cluster.

Every in-memory run is a pure function of its config and seed (virtual time, seeded streams),
so a job can run in any process and the runner only collects the results: the results equal a
serial run's (only the measured ``wall_s`` differs). Local processes are started with ``spawn``
(no forked asyncio or logging state); each worker logs warnings and errors to its stderr.
Ray (``pip install 'foltr-async[ray]'``) runs the same jobs on a cluster: ``RAY_ADDRESS``
names one, otherwise a local Ray starts with ``jobs`` CPUs. Every Ray node needs the project
installed and the dataset at the path the scenario gives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any

from foltr_async.errors import FoltrError

EXECUTORS = ("local", "ray")

#: (repeat, seed, variant, config) of one run.
Job = tuple[int, int, str, dict]


def run_job(cfg: dict, seed: int, name: str, repeat: int) -> dict:
    """One repeat of one variant in virtual time, with no observers (the caller reports)."""
    import structlog

    from foltr_async.observe.log import configure_logging
    from foltr_async.observe.observer import Observers
    from foltr_async.registry import load_plugins
    from foltr_async.runtime import heap
    from foltr_async.runtime.clock import VirtualTimeLoop
    from foltr_async.simulation import Simulation

    if not structlog.is_configured():
        configure_logging(events_path=None, json_logs=False, level="warning", console=False)
    load_plugins()  # a fresh process has not imported the protocols yet
    sim = Simulation(cfg, seed, Observers([]), name, repeat)
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result = runner.run(sim.run())
    del sim
    heap.release()  # the worker runs the next job in the memory this one freed
    return result


def _args(job: Job) -> tuple[dict, int, str, int]:
    rep, seed, name, cfg = job
    return cfg, seed, name, rep


def run_jobs(jobs: list[Job], n: int, executor: str = "local") -> Iterator[tuple[Job, dict]]:
    """Yield ``(job, result)`` as jobs finish, ``n`` at a time."""
    if executor not in EXECUTORS:
        raise FoltrError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    if n < 1:
        raise FoltrError(f"--jobs: expected an integer >= 1, got {n}")
    if not jobs:
        return
    if executor == "ray":
        yield from _ray(jobs, n)
        return
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(n, len(jobs)), mp_context=ctx) as pool:
        futures = {pool.submit(run_job, *_args(job)): job for job in jobs}
        try:
            for fut in cf.as_completed(futures):
                yield futures[fut], fut.result()
        except cf.process.BrokenProcessPool:
            left = sorted({f"{futures[f][2]} repeat {futures[f][0]}" for f in futures
                           if not (f.done() and f.exception() is None)})  # fmt: skip
            raise FoltrError(
                f"--jobs: a job process died abruptly (killed; out of memory?) with {len(left)}"
                f" job(s) unfinished, e.g. {', '.join(left[:3])}; the finished repeats are kept"
            ) from None
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


def _ray(jobs: list[Job], n: int) -> Iterator[tuple[Job, dict]]:
    try:
        import ray
    except ImportError:
        raise FoltrError(
            "--executor ray: Ray is not installed (pip install 'foltr-async[ray]')"
        ) from None
    started = not ray.is_initialized()
    if started:
        address = os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": n}
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
    remote: Callable = ray.remote(num_cpus=1)(run_job)
    try:
        pending = {remote.remote(*_args(job)): job for job in jobs}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                yield pending.pop(ref), ray.get(ref)
    finally:
        if started:
            ray.shutdown()

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
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from foltr_async.config import RunConfig
from foltr_async.errors import FoltrError

log = structlog.get_logger()

EXECUTORS = ("local", "ray")

#: (repeat, seed, variant, config) of one run.
Job = tuple[int, int, str, RunConfig]


def job_cost(cfg: RunConfig) -> float:
    """A job's expected CPU time, in arbitrary units, for ordering only: interactions per round
    plus a fixed per-round cost (small federations' messaging and evaluation), times rounds;
    a neural ranker costs as much more as it has hidden units (FPDGD-MLP64 measured ~7x linear)."""
    fed, ranker = cfg.federation, cfg.ranker
    per_round = fed.clients * fed.queries_per_client + 100
    width = 1 + sum(ranker.hidden) / 10 if ranker.kind == "mlp" else 1
    return fed.rounds * per_round * width


def longest_first(todo: list[Job]) -> list[Job]:
    """Parallel jobs, the longest expected first (ties in the given order): the processes
    end together instead of one long job running alone at the end while the other cores
    idle. Only the order changes; every result is the same."""
    return sorted(todo, key=lambda job: -job_cost(job[3]))


def run_job(cfg: dict, seed: int, name: str, repeat: int) -> dict:
    """One repeat of one variant in virtual time, with no observers (the caller reports)."""
    from foltr_async.observe.log import configure_logging
    from foltr_async.observe.observer import Observers
    from foltr_async.plugins import load_plugins
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


def run_jobs(
    jobs: list[Job], n: int, executor: str = "local", work: Callable = run_job
) -> Iterator[tuple[Job, dict]]:
    """Yield ``(job, result)`` as jobs finish, ``n`` at a time; ``work(config, seed, variant,
    repeat)`` runs one job (a module-level function: local processes import it by name)."""
    if executor not in EXECUTORS:
        raise FoltrError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    if n < 1:
        raise FoltrError(f"--jobs: expected an integer >= 1, got {n}")
    if not jobs:
        return
    if executor == "ray":
        yield from _ray(jobs, n, work)
        return
    yield from _local(jobs, n, work)


def _local(jobs: list[Job], n: int, work: Callable) -> Iterator[tuple[Job, dict]]:
    """One single-process executor per slot, so a process that dies (the out-of-memory killer,
    a signal) loses only its own job. That job runs once more after the others; if its process
    dies again it is reported at the end, after every other result was handed over."""
    ctx = multiprocessing.get_context("spawn")

    def fresh() -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(1, mp_context=ctx)

    todo, deaths = deque(jobs), Counter()
    idle = [fresh() for _ in range(min(n, len(jobs)))]
    busy: dict[cf.Future, tuple[cf.ProcessPoolExecutor, Job]] = {}
    try:
        while todo or busy:
            while todo and idle:
                ex, job = idle.pop(), todo.popleft()
                try:
                    busy[ex.submit(work, *_args(job))] = ex, job
                except cf.process.BrokenProcessPool:  # its idle process was killed
                    ex.shutdown(wait=False)
                    idle.append(fresh())
                    todo.appendleft(job)
            done, _ = cf.wait(busy, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                ex, job = busy.pop(fut)
                try:
                    result = fut.result()
                except cf.process.BrokenProcessPool:
                    ex.shutdown(wait=False)
                    ex = fresh()
                    key = (job[2], job[0])
                    deaths[key] += 1
                    if deaths[key] == 1:
                        todo.append(job)
                    log.warning(
                        "job_process_died",
                        variant=job[2],
                        repeat=job[0],
                        then="runs again after the others" if deaths[key] == 1 else "reported",
                    )
                    continue
                except FoltrError as e:  # the run stops, as a serial one would
                    e.job = job  # for the runner to say which
                    raise
                finally:
                    idle.append(ex)
                yield job, result
    except BaseException:  # an error, Ctrl-C or a consumer that stopped: the run ends now
        for ex, _ in busy.values():
            _stop(ex)
        raise
    finally:
        for ex in idle + [ex for ex, _ in busy.values()]:
            ex.shutdown(cancel_futures=True)
    lost = sorted(key for key, count in deaths.items() if count > 1)
    if lost:
        names = ", ".join(f"{name} repeat {rep}" for name, rep in lost)
        raise FoltrError(
            f"--jobs: {len(lost)} job(s) lost their process twice (killed; out of memory?):"
            f" {names}; every other repeat finished and is kept (run those variants again with"
            " --only into another folder, then merge the two folders)"
        )


def _stop(ex: cf.ProcessPoolExecutor) -> None:
    """End a busy executor's process rather than wait for a job whose result nobody takes."""
    stop = getattr(ex, "terminate_workers", None)  # Python >= 3.14
    if stop is not None:
        stop()
        return
    for proc in list((ex._processes or {}).values()):
        proc.terminate()


def _ray(jobs: list[Job], n: int, work: Callable) -> Iterator[tuple[Job, dict]]:
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
    remote: Callable = ray.remote(num_cpus=1)(work)
    try:
        pending = {remote.remote(*_args(job)): job for job in jobs}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                job = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except FoltrError as e:  # Ray re-raises it as an instance of its class
                    e.job = job
                    raise
                yield job, result
    finally:
        if started:
            ray.shutdown()

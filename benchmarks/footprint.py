"""Suites ``startup`` and ``memory``, each measured in a fresh process: the time from a new
interpreter to the first round's broadcast and to its end (dataset cache empty, then filled),
and the RSS growth of started FPDGD client agents on one shared dataset."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

from foltr_async.benchmarks.measure import (
    FULL,
    PAPER_ROUNDS,
    DataSource,
    Sizes,
    progress,
    run_child,
    scenario_config,
    set_env,
    sizes_of,
)


def bench_startup(src: DataSource, seed: int, workdir: Path) -> dict[str, dict]:
    """A fresh process until the first broadcast and until round 1 ends: once with an empty
    dataset cache (the embedded dataset is generated), then again (it is loaded from it)."""
    progress(
        f"startup: fresh process to round 1 ({FULL.fpdgd_clients} FPDGD clients, {src.describe})"
    )
    spec = {
        "task": "startup",
        "dataset": src.with_size(None),
        "clients": FULL.fpdgd_clients,
        "seed": seed,
    }
    runs = []
    with set_env(FOLTR_ASYNC_CACHE=str(workdir / "startup-cache")):
        for _ in range(2):
            t_spawn = time.time()
            child = run_child(spec)
            runs.append(
                {
                    "s": child["first_round"] - t_spawn,
                    "cpu_s": child["cpu"],  # the child's CPU seconds (interpreter included)
                    "imports_s": child["imported"] - t_spawn,
                    "data_s": child["data"] - child["imported"],
                    "agents_s": child["first_round"] - child["data"],
                    # round 1 includes loading the compiled training kernel
                    "round1_s": child["round1_done"] - t_spawn,
                    "round1_cpu_s": child["round1_cpu"],
                }
            )
    cold, warm = runs
    startup = {
        **warm,
        "cpu_share": warm["cpu_s"] / warm["s"],
        "cold_s": cold["s"],
        "cold_data_s": cold["data_s"],
        "on": {
            "clients": FULL.fpdgd_clients,
            "dataset": src.describe,
            "embedded": src.embedded,
            **child["sizes"],
        },
        "note": "python start + imports + dataset + 1000 agents, until the first broadcast "
        "(round1_s: until round 1 ends, 2 queries per client trained); s with the dataset "
        "cached by an earlier run, cold_s generating it",
    }
    return {"startup": startup}


class _FirstRound(Exception):
    """Raised by the start-up probe when round 1 ends: the run is up to speed."""


def startup_child(spec: dict) -> dict:
    from foltr_async import simulation
    from foltr_async.observe.observer import Observer
    from foltr_async.plugins import load_plugins
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.clock import run

    load_plugins()  # the protocols (and what they import) are part of every run's start-up
    imported = time.time()
    cfg = scenario_config(
        spec["dataset"], "fpdgd", spec["clients"], 2, PAPER_ROUNDS, 10, "shared", spec["seed"]
    )
    data = simulation.load_datasets(cfg)
    loaded = time.time()
    stamp: dict[str, float] = {}

    class ProbeBus(MemoryBus):
        def broadcast(self, src, dsts, kind, body, round=0) -> None:
            if "first_round" not in stamp:
                stamp["first_round"] = time.time()
                stamp["cpu"] = time.process_time()
            super().broadcast(src, dsts, kind, body, round)

    class EndOfRound1(Observer):
        def round_done(self, *args: Any, **kwargs: Any) -> None:
            stamp["round1_done"] = time.time()
            stamp["round1_cpu"] = time.process_time()
            raise _FirstRound

    bus = ProbeBus(cfg.new_network(), stream(spec["seed"], "net"))
    with contextlib.suppress(_FirstRound):
        run(simulation.Simulation(cfg, spec["seed"], EndOfRound1(), bus=bus).run())
    return {
        "imported": imported,
        "data": loaded,
        **stamp,
        "sizes": sizes_of(data),
    }


def _rss_bytes() -> int:
    """Current resident set size (/proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_child(spec: dict) -> dict:
    """Build N started FPDGD clients; RSS before and after, then Python allocations per client
    (tracemalloc, on up to 1000 more clients: its own bookkeeping would inflate the RSS)."""
    import tracemalloc

    from foltr_async import simulation
    from foltr_async.plugins import load_plugins
    from foltr_async.registry import REGISTRY
    from foltr_async.rng import stream
    from foltr_async.runtime import heap
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.clock import run
    from foltr_async.runtime.network import NetworkModel

    load_plugins()
    n, n_traced = spec["clients"], min(spec["clients"], 1000)
    cfg = scenario_config(spec["dataset"], "fpdgd", n, 2, PAPER_ROUNDS, 10, "shared", spec["seed"])
    data = simulation.load_datasets(cfg)
    mode = "partition" if data.train.n_queries >= n + n_traced else "shared"
    out: dict[str, Any] = {"mode": mode, "sizes": sizes_of(data)}

    async def build() -> None:
        bus = MemoryBus(NetworkModel(), stream(spec["seed"], "net"))
        ctx = simulation.RunContext(
            cfg, spec["seed"], data, bus, simulation.Probe(), lambda *a, **k: None
        )
        proto = REGISTRY.protocols["fpdgd"].build(ctx)
        queries = simulation.assign_queries(
            data.train.n_queries, n + n_traced, mode, ctx.rng("data")
        )
        agents = []

        async def add(ids: range) -> None:
            for i in ids:
                aid = f"client-{i:05d}"
                agent = proto.client(aid, queries[i], ctx.rng("client", aid))
                agent.start()  # on the bus, with its inbox task waiting
                agents.append(agent)
            await asyncio.sleep(0)

        heap.release()  # later allocations show as RSS growth, not reuse of the dataset's
        rss0 = _rss_bytes()
        t0 = time.perf_counter()
        await add(range(n))
        out["build_s"] = time.perf_counter() - t0
        gc.collect()
        out["rss_before"], out["rss_after"] = rss0, _rss_bytes()
        tracemalloc.start()
        await add(range(n, n + n_traced))
        gc.collect()
        out["python_bytes_per_client"] = tracemalloc.get_traced_memory()[0] / n_traced
        tracemalloc.stop()

    run(build())
    out["peak_rss"] = _peak_rss_bytes()
    return out


def bench_memory(src: DataSource, sz: Sizes, seed: int) -> dict[str, dict]:
    """RSS growth of N started FPDGD client agents, each N in a fresh process."""
    res: dict[str, Any] = {
        "on": {
            "dataset": src.describe,
            "agents": "FPDGD clients, started (registered on a memory bus, inbox task waiting)",
        }
    }
    mb = 1024 * 1024
    for n in sz.memory_clients:
        progress(f"memory: {n} FPDGD client agents in a fresh process")
        child = run_child(
            {"task": "memory", "dataset": src.with_size(None), "clients": n, "seed": seed},
            timeout=1800,
        )
        growth = (child["rss_after"] - child["rss_before"]) / mb
        row = {
            "growth_mb": growth,
            "rss_mb": child["rss_after"] / mb,
            "peak_rss_mb": child["peak_rss"] / mb,
            "build_s": child["build_s"],
            "queries": child["mode"],
        }
        row["python_mb_per_1000"] = child["python_bytes_per_client"] * 1000 / mb
        res[str(n)] = row
        res["on"].update(child["sizes"])
        if n == sz.memory_clients[0]:
            res["mb_per_1000_clients"] = growth / n * 1000
        if n == 62_500:
            res["rss_62500_mb"] = child["peak_rss"] / mb
    return {"memory": res}

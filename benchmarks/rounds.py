"""Suites ``fpdgd`` and ``foltr_es``: whole protocol rounds through the memory bus in virtual
time, timed after round 1 so start-up is apart (optionally cProfiled); ``fpdgd`` also times
centralised PDGD interactions and offline evaluation on the same data."""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from foltr_async.benchmarks.measure import (
    FULL,
    PAPER_ROUNDS,
    ROOT,
    DataSource,
    Sizes,
    cpu_share,
    load_data,
    now,
    progress,
    scenario_config,
    sizes_of,
)
from foltr_async.observe.observer import Observer

if TYPE_CHECKING:
    from foltr_async.config import RunConfig


class _Stopwatch(Observer):
    """Observer that stamps every finished round (and optionally profiles a window of them).

    The last ``agent_changed`` before round 1 ends is when every agent has started, i.e. the
    end of start-up; ``round_done`` stamps bound whole rounds.
    """

    def __init__(self, profile_from: int | None = None, profile_to: int | None = None) -> None:
        self.ready: float | None = None
        self.rounds: dict[int, tuple[float, float]] = {}
        self.profile_from, self.profile_to = profile_from, profile_to
        self.profiler = None

    def agent_changed(self, *args: Any, **kwargs: Any) -> None:
        if not self.rounds:
            self.ready = time.perf_counter()

    def round_done(self, variant, repeat, round, *, metrics, messages, sim_time) -> None:
        if round == self.profile_to and self.profiler is not None:
            self.profiler.disable()
        self.rounds[round] = now()
        if round == self.profile_from:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()


def _simulate(cfg: RunConfig, window: int, seed: int = 0, profile: bool = False) -> dict:
    """Run one simulation; time rounds 2 .. window+1 (the last round's extra evaluation is
    outside the window)."""
    from foltr_async.runtime.clock import run
    from foltr_async.simulation import Simulation

    watch = _Stopwatch(1, 1 + window) if profile else _Stopwatch()
    t0 = time.perf_counter()
    result = run(Simulation(cfg, seed, watch).run())
    total = time.perf_counter() - t0
    first, last = watch.rounds[1], watch.rounds[1 + window]
    out = {
        "span_s": last[0] - first[0],
        "cpu_share": cpu_share(first, last),
        "setup_s": (watch.ready or t0) - t0,
        "total_s": total,
        "sent": result["messages"]["sent"],
        "dropped": result["messages"]["dropped"],
    }
    if profile and watch.profiler is not None:
        out["profile"] = _top_functions(watch.profiler)
    return out


def _top_functions(profiler, n: int = 20) -> dict[str, list[dict]]:
    """The ``n`` functions with the most own time, and own time summed per source file
    (C builtins such as numpy methods count apart as ``~``): where a round's time goes."""
    import pstats

    st = pstats.Stats(profiler)
    total = max(1e-9, st.total_tt)  # type: ignore[attr-defined]
    rows, files = [], {}
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rel = file
        with contextlib.suppress(ValueError):
            rel = str(Path(file).resolve().relative_to(ROOT))
        rel = rel.split("site-packages/")[-1]
        rel = re.sub(r"^.*/python3\.\d+/", "stdlib:", rel)
        files[rel] = files.get(rel, 0.0) + tt
        rows.append(
            {
                "function": f"{rel}:{line}({fn})",
                "calls": nc,
                "tottime_s": round(tt, 4),
                "share": round(tt / total, 4),
                "cumtime_s": round(ct, 4),
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    by_file = [
        {"file": f, "tottime_s": round(t, 4), "share": round(t / total, 4)}
        for f, t in sorted(files.items(), key=lambda kv: -kv[1])
    ]
    return {"functions": rows[:n], "files": by_file[:n]}


def bench_fpdgd(
    src: DataSource, sz: Sizes, seed: int, profile: bool = False, threads: Sequence[int] = ()
) -> dict[str, dict]:
    """FPDGD rounds, centralised PDGD interactions and offline evaluation on one dataset;
    the kernel alone also at each of ``threads`` (default: the thread count in force)."""
    from foltr_async.ltr.clicks import cascade
    from foltr_async.ltr.metrics import mean_ndcg
    from foltr_async.ltr.pdgd import pdgd_interaction
    from foltr_async.ltr.rankers import LinearRanker

    dataset = src.with_size(sz.n_queries)
    progress(f"fpdgd: loading {src.describe}")
    t0 = time.perf_counter()
    data = load_data(dataset)
    data_s = time.perf_counter() - t0
    mode = "partition" if data.train.n_queries >= sz.fpdgd_clients else "shared"
    batch, rounds = 2, sz.fpdgd_window + 2
    cfg = scenario_config(dataset, "fpdgd", sz.fpdgd_clients, batch, rounds, 10, mode, seed)
    progress(
        f"fpdgd: {sz.fpdgd_clients} clients x {batch} queries, {rounds} rounds "
        f"(timing {sz.fpdgd_window}), {data.train.n_queries} train queries ({mode})"
    )
    run = _simulate(cfg, sz.fpdgd_window, seed)
    queries = sz.fpdgd_clients * batch * sz.fpdgd_window
    s_round = run["span_s"] / sz.fpdgd_window
    scale = FULL.fpdgd_clients / sz.fpdgd_clients  # start-up and rounds grow with the clients
    fpdgd = {
        "queries_per_s": queries / run["span_s"],
        "s_per_round": s_round,
        "cpu_share": run["cpu_share"],
        "paper_run_s": data_s + (run["setup_s"] + PAPER_ROUNDS * s_round) * scale,
        "setup_s": run["setup_s"],
        "data_s": data_s,
        "messages_sent": run["sent"],
        "messages_dropped": run["dropped"],
        "on": {
            "clients": sz.fpdgd_clients,
            "queries_per_client": batch,
            "timed_rounds": sz.fpdgd_window,
            "eval_every": 10,
            "data": mode,
            "dataset": src.describe,
            **sizes_of(data),
        },
        "note": "paper_run_s = data + start-up + 200 rounds of 1000 clients x 2 queries "
        "(start-up and rounds scaled linearly to 1000 clients)",
    }
    if profile:
        progress("fpdgd: profiling the same rounds (cProfile)")
        fpdgd["profile"] = _simulate(cfg, sz.fpdgd_window, seed, profile=True)["profile"]

    kernel = _kernel_alone(data.train, sz.fpdgd_clients, seed, threads)
    kernel["on"] = {"jobs": sz.fpdgd_clients, "dataset": src.describe}

    progress(f"pdgd: {sz.pdgd_interactions} centralised interactions")
    rng = np.random.default_rng(seed)
    ranker = LinearRanker(data.train.n_features)
    clicks = cascade("informational", data.n_grades)
    qs = rng.integers(data.train.n_queries, size=sz.pdgd_interactions)
    t0 = now()
    for q in qs.tolist():
        features, labels = data.train.query(q)
        pdgd_interaction(ranker, features, labels, clicks, rng, lr=0.1)
    t1 = now()
    pdgd = {
        "interactions_per_s": sz.pdgd_interactions / (t1[0] - t0[0]),
        "cpu_share": cpu_share(t0, t1),
        "on": {
            "interactions": sz.pdgd_interactions,
            "ranker": "linear",
            "clicks": "informational",
            "dataset": src.describe,
        },
    }

    test = data.test
    progress(f"eval: {sz.eval_repeats} x nDCG@10 on {test.n_queries} held-out queries")
    t0 = now()
    for _ in range(sz.eval_repeats):
        value = mean_ndcg(ranker.score(test.features), test, 10)
    t1 = now()
    eval_s = t1[0] - t0[0]
    ev = {
        "queries_per_s": sz.eval_repeats * test.n_queries / eval_s,
        "s_per_evaluation": eval_s / sz.eval_repeats,
        "cpu_share": cpu_share(t0, t1),
        "ndcg@10_after_pdgd": value,
        "on": {
            "test_queries": test.n_queries,
            "test_docs": test.n_docs,
            "repeats": sz.eval_repeats,
        },
    }
    return {"fpdgd": fpdgd, "pdgd_kernel": kernel, "pdgd": pdgd, "eval": ev}


def _kernel_alone(train, clients: int, seed: int, threads: Sequence[int] = ()) -> dict:
    """FPDGD's local training alone (``train_linear_batch``), minimum CPU time over repeats:
    a round's batch (every client x 2 queries, each its own partition of the queries) and the
    one-job batches of staggered arrivals (1 client x 5 queries). Compiled before timing.

    ``scaling``: the round's batch at each of ``threads`` (minimum wall time of 5, with that
    repeat's CPU time), its speed-up over the first count and, against one thread, the serial
    share Amdahl's law puts on it (``(n / speed-up - 1) / (n - 1)``; on a busy machine it
    also holds the threads that did not get a core). The other figures use the thread count
    in force when called, which this leaves as it found it.
    """
    from foltr_async.ltr import threads as kernel_threads
    from foltr_async.ltr.clicks import cascade
    from foltr_async.ltr.pdgd_batch import PDGDJob, train_linear_batch

    model = cascade("informational", int(train.max_grade) + 1)
    rng = np.random.default_rng(seed)
    parts = np.array_split(rng.permutation(train.n_queries), min(clients, train.n_queries))
    start = rng.normal(size=train.n_features) * 0.01
    gens = [np.random.default_rng([seed, j]) for j in range(clients)]

    def timed(n_jobs: int, steps: int, repeats: int) -> tuple[float, float]:
        """(CPU s, wall s) of the repeat with the least wall time."""
        best = (math.inf, math.inf)
        for _ in range(repeats):
            jobs = [
                PDGDJob(start, parts[j % len(parts)], steps, gens[j], model, 0.1)
                for j in range(n_jobs)
            ]
            t0 = (time.process_time(), time.perf_counter())
            train_linear_batch(train, jobs)
            spent = (time.process_time() - t0[0], time.perf_counter() - t0[1])
            best = min(best, spent, key=lambda t: t[1])
        return best

    in_force = kernel_threads.threads()
    counts = list(threads) or [in_force]
    timed(2, 1, 1)  # numba import and cache load (or compilation) outside the timing
    progress(f"pdgd kernel: {clients} jobs x 2 queries at {counts} threads")
    scaling = []
    try:
        for n in counts:
            kernel_threads.set_threads(n)
            timed(clients, 2, 1)  # the parallel kernel's first call
            cpu, wall = timed(clients, 2, 5)
            scaling.append({"threads": n, "wall_s": wall, "cpu_s": cpu})
    finally:
        kernel_threads.set_threads(in_force)
    serial = next((r["wall_s"] for r in scaling if r["threads"] == 1), None)
    for r in scaling:
        r["queries_per_s"] = 2 * clients / r["wall_s"]
        r["queries_per_cpu_s"] = 2 * clients / r["cpu_s"]
        r["speedup"] = scaling[0]["wall_s"] / r["wall_s"]
        if serial is not None and r["threads"] > 1:
            n, gain = r["threads"], serial / r["wall_s"]
            r["serial_share"] = (n / gain - 1) / (n - 1)
    progress(f"pdgd kernel: {clients} jobs x 2 queries, and 1 job x 5 queries alone")
    batch = min(timed(clients, 2, 1)[0] for _ in range(3))
    alone = sum(timed(1, 5, 1)[0] for _ in range(200)) / 200
    return {
        "us_per_client": batch / clients * 1e6,
        "us_per_query_in_round": batch / (2 * clients) * 1e6,
        "us_per_query_alone": alone / 5 * 1e6,
        "threads": in_force,
        "scaling": scaling,
        "note": "CPU time of FPDGD's local training (train_linear_batch) alone: a round's "
        "batch of every client x 2 queries (minimum of 3) and one job of 5 queries (mean of 200),"
        " at the thread count in force; scaling: the round's batch at each --threads count",
    }


def bench_foltr_es(src: DataSource, sz: Sizes, seed: int, profile: bool = False) -> dict[str, dict]:
    """FOLtR-ES rounds without evaluation inside the timed window."""
    dataset = src.with_size(sz.n_queries)
    data = load_data(dataset)
    mode = "partition" if data.train.n_queries >= sz.es_clients else "shared"
    batch, rounds = 4, sz.es_window + 2
    cfg = scenario_config(dataset, "foltr_es", sz.es_clients, batch, rounds, 10**6, mode, seed)
    progress(
        f"foltr_es: {sz.es_clients} clients x {batch} queries, {rounds} rounds "
        f"(timing {sz.es_window}, {mode} queries)"
    )
    run = _simulate(cfg, sz.es_window, seed)
    s_round = run["span_s"] / sz.es_window
    es = {
        "s_per_round": s_round,
        "queries_per_s": sz.es_clients * batch / s_round,
        "cpu_share": run["cpu_share"],
        "setup_s": run["setup_s"],
        "on": {
            "clients": sz.es_clients,
            "queries_per_client": batch,
            "timed_rounds": sz.es_window,
            "data": mode,
            "dataset": src.describe,
            **sizes_of(data),
        },
    }
    if profile:
        progress("foltr_es: profiling the same rounds (cProfile)")
        es["profile"] = _simulate(cfg, sz.es_window, seed, profile=True)["profile"]
    return {"foltr_es": es}

"""``python -m foltr_async bench``: how fast and how big the simulator is, against its targets.

Every suite runs the project's real code paths at a stated size and reports what it measured on
what, so a number can be reproduced and compared across commits:

- ``fpdgd``: FPDGD rounds through the memory bus in virtual time (linear ranker, held-out
  evaluation every 10 rounds), timed over whole rounds after round 1 so start-up is apart; also
  centralised PDGD interactions/s and offline evaluation queries/s on the same data.
- ``foltr_es``: FOLtR-ES rounds (2000 clients x 4 queries at full size).
- ``bus``: coordination cost per client update with training stubbed out (echo clients speaking
  the FPDGD messages: encode, schedule, deliver, decode, replay check, FedAvg), and the start-up
  time of a fresh process to the first round's broadcast on the embedded dataset.
- ``memory``: RSS growth of started FPDGD client agents on one shared dataset (fresh process).
- ``zmq``: two processes over loopback TCP (PUSH/PULL), FPDGD update envelopes with 136 float64.
- ``parse``: LETOR parsing from text (cold cache) and from the binary cache, extrapolated to the
  MSLR-WEB10K Fold1 training file.

Timings are wall-clock on this machine, each with its CPU share (CPU seconds per wall second):
on a shared machine the share says how much the wall number understates the code. Nothing here
is asserted by a test. Suites that need a clean process (start-up, memory, zmq) run children
with ``sys.executable``; docs/PERFORMANCE.md records a measured run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from foltr_async.errors import DatasetError, FoltrError
from foltr_async.observe.observer import Observer

__all__ = ["SUITES", "TARGETS", "Sizes", "letor_like", "main", "run_suites"]

SUITES = ("fpdgd", "foltr_es", "bus", "startup", "memory", "zmq", "parse", "secagg", "csfltr")
PROFILE = "mslr-like"  # the embedded profile shaped like MSLR-WEB10K (136 features, ~120 docs)
N_FEATURES = 136
PAPER_ROUNDS = 200  # FPDGD on MSLR-WEB10K: |C| = 1000, B = 2, 200 rounds (Wang et al. 2021)
MSLR_TRAIN_LINES = 723_412  # documents in MSLR-WEB10K Fold1/train.txt
MIN_EXTRAPOLATE_LINES = 10_000  # below this, fixed costs make a linear extrapolation meaningless
ROOT = Path(__file__).resolve().parents[1]  # the folder holding foltr_async/ and protocols/


@dataclass(frozen=True)
class Check:
    """A target: ``suite.key`` compared with ``limit`` (``>=`` or ``<=``/``<``)."""

    suite: str
    key: str
    op: str
    limit: float
    label: str

    def ok(self, value: float) -> bool:
        return {">=": value >= self.limit, "<=": value <= self.limit, "<": value < self.limit}[
            self.op
        ]


TARGETS = (
    Check("fpdgd", "queries_per_s", ">=", 50_000, "FPDGD queries/s"),
    Check("foltr_es", "s_per_round", "<", 0.3, "FOLtR-ES s/round"),
    Check("bus", "us_per_update", "<=", 50, "bus us/update"),
    Check("startup", "s", "<", 1.0, "start-up s"),
    Check("memory", "mb_per_1000_clients", "<=", 300, "MB per 1000 clients"),
    Check("memory", "rss_62500_mb", "<=", 4096, "RSS with 62,500 clients (MB)"),
    Check("zmq", "msgs_per_s", ">=", 20_000, "zmq msgs/s"),
    Check("parse", "mslr_parse_s", "<", 60, "MSLR-size parse s"),
    Check("parse", "mslr_cached_s", "<", 2, "MSLR-size cached load s"),
    Check("secagg", "max_rel_error", "<=", 1e-6, "secure sum vs plaintext FedAvg (relative)"),
    Check("csfltr", "speedup", ">=", 100, "RTK-Sketch vs NAIVE reverse top-K speed-up"),
    Check("csfltr", "cover_rate_rankable", ">=", 0.9, "RTK-Sketch cover rate (rankable terms)"),
)


@dataclass(frozen=True)
class Sizes:
    """How much work each suite does. ``window``s are timed rounds (multiples of 10 for FPDGD,
    so the share of evaluation rounds is the paper's)."""

    fpdgd_clients: int
    fpdgd_window: int
    pdgd_interactions: int
    eval_repeats: int
    es_clients: int
    es_window: int
    bus_clients: int
    bus_window: int
    memory_clients: tuple[int, ...]
    zmq_messages: int
    parse_lines: int
    n_queries: int | None  # embedded dataset size for fpdgd / foltr_es (None: profile default)
    rtk_docs: tuple[int, ...]  # collection sizes of the reverse top-K measurement (first: targets)

    def at_scale(self, clients: int | None, interactions: int | None) -> Sizes:
        """Paper-scale runs: ``clients`` for FPDGD, FOLtR-ES and the bus; FPDGD's timed rounds
        enough for ``interactions`` (2 per client and round), in whole rounds."""
        out = self
        if clients is not None:
            out = dataclasses.replace(out, fpdgd_clients=clients, es_clients=clients)
            out = dataclasses.replace(out, bus_clients=clients)
        if interactions is not None:
            window = max(1, math.ceil(interactions / (2 * out.fpdgd_clients)))
            out = dataclasses.replace(out, fpdgd_window=window)
        return out

    def scaled(self, f: float) -> Sizes:
        """Every count times ``f`` (for smoke tests); windows and dataset size stay."""

        def s(n: int, lo: int) -> int:
            return max(lo, round(n * f))

        return dataclasses.replace(
            self,
            fpdgd_clients=s(self.fpdgd_clients, 2),
            pdgd_interactions=s(self.pdgd_interactions, 20),
            es_clients=s(self.es_clients, 2),
            bus_clients=s(self.bus_clients, 2),
            memory_clients=tuple(s(n, 2) for n in self.memory_clients),
            zmq_messages=s(self.zmq_messages, 100),
            parse_lines=s(self.parse_lines, 200),
            rtk_docs=tuple(s(n, 300) for n in self.rtk_docs),
        )


QUICK = Sizes(200, 10, 2_000, 3, 500, 2, 500, 10, (1_000,), 20_000, 20_000, None, (2_000,))
FULL = Sizes(
    1_000,
    30,
    20_000,
    10,
    2_000,
    3,
    1_000,
    20,
    (1_000, 62_500),
    200_000,
    200_000,
    2_000,
    (10_000, 20_000, 40_000),
)


def _now() -> tuple[float, float]:
    """(wall, CPU) seconds: CPU / wall over a span shows how much of the machine we had."""
    return time.perf_counter(), time.process_time()


def _cpu_share(t0: tuple[float, float], t1: tuple[float, float]) -> float:
    """CPU seconds of this process per wall second over a span: ~1 on an idle core, lower
    when other processes competed (the wall-clock numbers then understate the code)."""
    return round((t1[1] - t0[1]) / max(1e-9, t1[0] - t0[0]), 2)


def _progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ data


def letor_like(
    n_queries: int,
    rng: np.random.Generator,
    *,
    docs_per_query: int = 120,
    n_features: int = N_FEATURES,
    n_grades: int = 5,
):
    """A random QuerySet whose LETOR text looks like MSLR-WEB10K's, to time the parser.

    A third of the features are small integer counts and the rest have four decimals, so a
    written line is ~1.3 kB, close to MSLR's (full-precision random floats would double the
    text and make the parser look slower than on real data). Grades are skewed to 0.
    """
    from foltr_async.ltr.queryset import QuerySet

    sizes = rng.integers(docs_per_query // 2, docs_per_query * 3 // 2 + 1, n_queries)
    n = int(sizes.sum())
    latent = rng.standard_normal(n)
    x = rng.standard_normal((n, n_features), dtype=np.float32)
    x += (latent[:, None] * rng.uniform(0.0, 0.5, n_features)).astype(np.float32)
    ints = n_features // 3
    x[:, :ints] = np.floor(np.abs(x[:, :ints]) * 5.0)
    x[:, ints:] = np.round(x[:, ints:], 4)
    noisy = latent + rng.standard_normal(n)
    cuts = np.quantile(noisy, [0.55, 0.8, 0.93, 0.98][: n_grades - 1])
    labels = np.digitize(noisy, cuts).astype(np.int8)
    qptr = np.zeros(n_queries + 1, dtype=np.int64)
    np.cumsum(sizes, out=qptr[1:])
    qids = np.arange(1, n_queries + 1).astype(str)
    return QuerySet(x, labels, qptr, qids, name="letor-like")


@dataclass
class DataSource:
    """Where the fpdgd / foltr_es / start-up / memory suites get their data.

    ``dataset`` is the scenario's ``[dataset]`` table, so the simulator loads it through its own
    path: the embedded profile, or the ``--data`` files.
    """

    dataset: dict
    describe: str
    embedded: bool
    train_file: Path | None = None

    def with_size(self, n_queries: int | None) -> dict:
        if "profile" in self.dataset and n_queries is not None:
            return {**self.dataset, "n_queries": n_queries}
        return dict(self.dataset)


def check_data(path: Path) -> Path:
    """The training file of ``--data``, or a one-line DatasetError."""
    if path.is_dir():
        train, test = path / "train.txt", path / "test.txt"
        if not train.is_file() or not test.is_file():
            raise DatasetError(
                f"--data {path}: expected a LETOR fold directory with train.txt and test.txt"
            )
        return train
    if path.is_file():
        if not path.with_name("test.txt").is_file():
            raise DatasetError(
                f"--data {path}: no test.txt beside the training file (the fpdgd suite "
                "evaluates on it)"
            )
        return path
    raise DatasetError(f"--data {path}: no such file or directory")


def resolve_data(path: Path | None, seed: int) -> DataSource:
    """``--data`` if given, else the embedded mslr-like profile."""
    if path is not None:
        return DataSource({"path": str(path)}, f"{path}", False, check_data(path))
    return DataSource({"profile": PROFILE, "seed": seed}, f"embedded {PROFILE}", True)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(
    dataset: dict,
    protocol: str,
    clients: int,
    batch: int,
    rounds: int,
    every: int,
    data_mode: str = "partition",
    seed: int = 0,
) -> dict:
    from foltr_async.scenario.load import validate

    raw = {
        "scenario": {"name": "bench", "seed": seed},
        "dataset": dataset,
        "federation": {
            "protocol": protocol,
            "clients": clients,
            "queries_per_client": batch,
            "rounds": rounds,
            "data": data_mode,
        },
        "evaluation": {"every": every},
    }
    return validate(raw, "bench")


def _load(dataset: dict):
    from foltr_async import simulation

    return simulation.load_datasets(_config(dataset, "fpdgd", 1, 1, 1, 1))


def _sizes_of(data) -> dict:
    tr, te = data.train, data.test
    return {
        "train_queries": tr.n_queries,
        "train_docs": tr.n_docs,
        "docs_per_query": round(tr.n_docs / max(1, tr.n_queries), 1),
        "features": tr.n_features,
        "test_queries": te.n_queries,
        "grades": data.n_grades,
    }


# ------------------------------------------------------------------------------ simulations


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
        self.rounds[round] = _now()
        if round == self.profile_from:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()


def _simulate(cfg: dict, window: int, seed: int = 0, profile: bool = False) -> dict:
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
        "cpu_share": _cpu_share(first, last),
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


def bench_fpdgd(src: DataSource, sz: Sizes, seed: int, profile: bool = False) -> dict[str, dict]:
    """FPDGD rounds, centralised PDGD interactions and offline evaluation on one dataset."""
    from foltr_async.ltr.clicks import cascade
    from foltr_async.ltr.metrics import mean_ndcg
    from foltr_async.ltr.pdgd import pdgd_interaction
    from foltr_async.ltr.rankers import LinearRanker

    dataset = src.with_size(sz.n_queries)
    _progress(f"fpdgd: loading {src.describe}")
    t0 = time.perf_counter()
    data = _load(dataset)
    data_s = time.perf_counter() - t0
    mode = "partition" if data.train.n_queries >= sz.fpdgd_clients else "shared"
    batch, rounds = 2, sz.fpdgd_window + 2
    cfg = _config(dataset, "fpdgd", sz.fpdgd_clients, batch, rounds, 10, mode, seed)
    _progress(
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
            **_sizes_of(data),
        },
        "note": "paper_run_s = data + start-up + 200 rounds of 1000 clients x 2 queries "
        "(start-up and rounds scaled linearly to 1000 clients)",
    }
    if profile:
        _progress("fpdgd: profiling the same rounds (cProfile)")
        fpdgd["profile"] = _simulate(cfg, sz.fpdgd_window, seed, profile=True)["profile"]

    _progress(f"pdgd: {sz.pdgd_interactions} centralised interactions")
    rng = np.random.default_rng(seed)
    ranker = LinearRanker(data.train.n_features)
    clicks = cascade("informational", data.n_grades)
    qs = rng.integers(data.train.n_queries, size=sz.pdgd_interactions)
    t0 = _now()
    for q in qs.tolist():
        features, labels = data.train.query(q)
        pdgd_interaction(ranker, features, labels, clicks, rng, lr=0.1)
    t1 = _now()
    pdgd = {
        "interactions_per_s": sz.pdgd_interactions / (t1[0] - t0[0]),
        "cpu_share": _cpu_share(t0, t1),
        "on": {
            "interactions": sz.pdgd_interactions,
            "ranker": "linear",
            "clicks": "informational",
            "dataset": src.describe,
        },
    }

    test = data.test
    _progress(f"eval: {sz.eval_repeats} x nDCG@10 on {test.n_queries} held-out queries")
    t0 = _now()
    for _ in range(sz.eval_repeats):
        value = mean_ndcg(ranker.score(test.features), test, 10)
    t1 = _now()
    eval_s = t1[0] - t0[0]
    ev = {
        "queries_per_s": sz.eval_repeats * test.n_queries / eval_s,
        "s_per_evaluation": eval_s / sz.eval_repeats,
        "cpu_share": _cpu_share(t0, t1),
        "ndcg@10_after_pdgd": value,
        "on": {
            "test_queries": test.n_queries,
            "test_docs": test.n_docs,
            "repeats": sz.eval_repeats,
        },
    }
    return {"fpdgd": fpdgd, "pdgd": pdgd, "eval": ev}


def bench_foltr_es(src: DataSource, sz: Sizes, seed: int, profile: bool = False) -> dict[str, dict]:
    """FOLtR-ES rounds without evaluation inside the timed window."""
    dataset = src.with_size(sz.n_queries)
    data = _load(dataset)
    mode = "partition" if data.train.n_queries >= sz.es_clients else "shared"
    batch, rounds = 4, sz.es_window + 2
    cfg = _config(dataset, "foltr_es", sz.es_clients, batch, rounds, 10**6, mode, seed)
    _progress(
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
            **_sizes_of(data),
        },
    }
    if profile:
        _progress("foltr_es: profiling the same rounds (cProfile)")
        es["profile"] = _simulate(cfg, sz.es_window, seed, profile=True)["profile"]
    return {"foltr_es": es}


# ------------------------------------------------------------------------------- bus + start-up


def _echo_classes():
    """An echo client and a FedAvg-only strategy speaking the FPDGD messages (no training)."""
    from foltr_async.runtime.agent import Agent, handles
    from foltr_async.runtime.engine import Strategy
    from protocols.aggregation import fedavg
    from protocols.fpdgd import MODEL, UPDATE

    class EchoClient(Agent):
        role = "client"

        @handles(MODEL)
        async def on_model(self, env) -> None:
            self.send(
                env.src, UPDATE, {"params": env.body["params"], "n_interactions": 2}, env.round
            )

    class EchoStrategy(Strategy):
        broadcast_kind, reply_kind = MODEL, UPDATE

        def __init__(self, n_params: int) -> None:
            self.model = np.zeros(n_params)

        def configure_round(self, round: int) -> dict:
            return {"params": self.model}

        def aggregate(self, round: int, replies: list) -> dict:
            updates = np.stack([r.body["params"] for r in replies])
            weights = np.array([r.body["n_interactions"] for r in replies], dtype=np.float64)
            self.model = fedavg(updates, weights) + 1e-3  # a new model each round
            return {}

        def evaluate(self) -> dict[str, float]:
            return {}

    return EchoClient, EchoStrategy


def bench_bus(sz: Sizes, seed: int) -> dict[str, dict]:
    """Memory-bus cost per client update."""
    from foltr_async.registry import load_plugins
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.clock import run
    from foltr_async.runtime.engine import RoundPlan, ServerAgent
    from foltr_async.runtime.network import NetworkModel

    load_plugins()
    echo_client, echo_strategy = _echo_classes()
    n, window = sz.bus_clients, sz.bus_window
    _progress(
        f"bus: {n} echo clients, {window + 2} rounds of FPDGD messages ({N_FEATURES} float64)"
    )
    marks: list[tuple[tuple[float, float], int, int]] = []

    async def main() -> None:
        bus = MemoryBus(NetworkModel(), stream(seed, "net"))
        ids = [f"client-{i:04d}" for i in range(n)]
        server = ServerAgent(
            bus,
            echo_strategy(N_FEATURES),
            RoundPlan(rounds=window + 2, eval_every=10**6),
            stream(seed, "server"),
            clients=lambda: ids,
            after_round=lambda rep: marks.append((_now(), bus.stats.sent, bus.stats.bytes_sent)),
        )
        server.start()
        clients = [echo_client(i, bus) for i in ids]
        for c in clients:
            c.start()
        await server.run_rounds()
        for a in [*clients, server]:
            await a.leave()

    run(main())
    (t0, m0, b0), (t1, m1, b1) = marks[0], marks[window]
    span = t1[0] - t0[0]
    bus = {
        "us_per_update": span / (n * window) * 1e6,
        "cpu_share": _cpu_share(t0, t1),
        "msgs_per_s": (m1 - m0) / span,
        "bytes_per_s": (b1 - b0) / span,
        "bytes_per_msg": (b1 - b0) / max(1, m1 - m0),
        "on": {
            "clients": n,
            "timed_rounds": window,
            "params": N_FEATURES,
            "network": "default (no latency, loss or dropout)",
        },
    }
    return {"bus": bus}


def bench_startup(src: DataSource, seed: int, workdir: Path) -> dict[str, dict]:
    """A fresh process until the first broadcast: once with an empty dataset cache (the
    embedded dataset is generated), then again (it is loaded from the cache)."""
    _progress(
        f"startup: fresh process to round 1 ({FULL.fpdgd_clients} FPDGD clients, {src.describe})"
    )
    spec = {
        "task": "startup",
        "dataset": src.with_size(None),
        "clients": FULL.fpdgd_clients,
        "seed": seed,
    }
    runs = []
    with _env(FOLTR_ASYNC_CACHE=str(workdir / "startup-cache")):
        for _ in range(2):
            t_spawn = time.time()
            child = _run_child(spec)
            runs.append(
                {
                    "s": child["first_round"] - t_spawn,
                    "cpu_s": child["cpu"],  # the child's CPU seconds (interpreter included)
                    "imports_s": child["imported"] - t_spawn,
                    "data_s": child["data"] - child["imported"],
                    "agents_s": child["first_round"] - child["data"],
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
        "note": "python start + imports + dataset + 1000 agents, until the first broadcast; "
        "s with the dataset cached by an earlier run, cold_s generating it",
    }
    return {"startup": startup}


class _FirstRound(Exception):
    """Raised by the start-up probe's bus at the first broadcast: the run has started."""


def _startup_child(spec: dict) -> dict:
    from foltr_async import simulation
    from foltr_async.observe.observer import Observer
    from foltr_async.registry import load_plugins
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.clock import run
    from foltr_async.runtime.network import NetworkModel

    load_plugins()  # the protocols (and what they import) are part of every run's start-up
    imported = time.time()
    cfg = _config(
        spec["dataset"], "fpdgd", spec["clients"], 2, PAPER_ROUNDS, 10, "shared", spec["seed"]
    )
    data = simulation.load_datasets(cfg)
    loaded = time.time()
    stamp: dict[str, float] = {}

    class ProbeBus(MemoryBus):
        def broadcast(self, src, dsts, kind, body, round=0) -> None:
            stamp["first_round"] = time.time()
            stamp["cpu"] = time.process_time()
            raise _FirstRound

    bus = ProbeBus(NetworkModel.from_dict(cfg["network"]), stream(spec["seed"], "net"))
    with contextlib.suppress(_FirstRound):
        run(simulation.Simulation(cfg, spec["seed"], Observer(), bus=bus).run())
    return {
        "imported": imported,
        "data": loaded,
        "first_round": stamp["first_round"],
        "cpu": stamp["cpu"],
        "sizes": _sizes_of(data),
    }


# ----------------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    """Current resident set size (/proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return _peak_rss_bytes()


def _trim_heap() -> None:
    """Give freed C heap back to the OS (glibc), so later allocations show up as RSS growth
    instead of silently reusing what building the dataset left behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _memory_child(spec: dict) -> dict:
    """Build N started FPDGD clients; RSS before and after, then Python allocations per client
    (tracemalloc, on up to 1000 more clients: its own bookkeeping would inflate the RSS)."""
    import tracemalloc

    from foltr_async import simulation
    from foltr_async.registry import REGISTRY, load_plugins
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.clock import run
    from foltr_async.runtime.network import NetworkModel

    load_plugins()
    n, n_traced = spec["clients"], min(spec["clients"], 1000)
    cfg = _config(spec["dataset"], "fpdgd", n, 2, PAPER_ROUNDS, 10, "shared", spec["seed"])
    data = simulation.load_datasets(cfg)
    mode = "partition" if data.train.n_queries >= n + n_traced else "shared"
    out: dict[str, Any] = {"mode": mode, "sizes": _sizes_of(data)}

    async def build() -> None:
        bus = MemoryBus(NetworkModel(), stream(spec["seed"], "net"))
        ctx = simulation.RunContext(
            cfg, spec["seed"], data, bus, simulation.Probe(), REGISTRY.aggregators["fedavg"],
            0, lambda *a, **k: None,
        )  # fmt: skip
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

        gc.collect()
        _trim_heap()
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
        _progress(f"memory: {n} FPDGD client agents in a fresh process")
        child = _run_child(
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


# -------------------------------------------------------------------------------------- zmq


def _update_envelope(i: int, params: np.ndarray) -> bytes:
    from foltr_async.runtime.codec import WIRE_VERSION, Envelope, encode
    from protocols.fpdgd import UPDATE

    body = {"params": params, "n_interactions": 2}
    return encode(
        Envelope(UPDATE, f"client-{i % 1000:04d}", "server", body, 1, i + 1, float(i), WIRE_VERSION)
    )


def _zmq_sender(spec: dict) -> dict:
    import zmq

    params = np.random.default_rng(spec["seed"]).standard_normal(spec["n_features"])
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(spec["endpoint"])
    t0 = time.perf_counter()
    for i in range(spec["n"]):
        push.send(_update_envelope(i, params), copy=False)
    sent_s = time.perf_counter() - t0
    push.close(linger=10_000)
    ctx.term()
    return {"sent_s": sent_s}


def bench_zmq(sz: Sizes, seed: int) -> dict[str, dict]:
    """Envelopes from a sender process to this one over loopback TCP, decoded and validated."""
    import zmq

    from foltr_async.registry import load_plugins
    from foltr_async.runtime.codec import decode

    load_plugins()
    n = sz.zmq_messages
    _progress(f"zmq: {n} FPDGD update envelopes, PUSH -> PULL over tcp://127.0.0.1")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 60_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    spec = {
        "task": "zmq_send",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "n": n,
        "n_features": N_FEATURES,
        "seed": seed,
    }
    proc = _spawn_child(spec)
    try:
        nbytes = 0
        try:
            first = pull.recv()
            t0 = _now()
            decode(first)
            for _ in range(n - 1):
                data = pull.recv()
                nbytes += len(data)
                decode(data)
            t1 = _now()
            span = t1[0] - t0[0]
        except zmq.Again:
            raise RuntimeError("zmq: the sender stopped sending (60 s without a message)") from None
        _finish_child(proc, spec)
    finally:
        if proc.poll() is None:
            proc.kill()
        pull.close(linger=0)
        ctx.term()
    return {
        "zmq": {
            "msgs_per_s": (n - 1) / span,
            "cpu_share": _cpu_share(t0, t1),  # of the receiver (decoding every message)
            "bytes_per_s": nbytes / span,
            "bytes_per_msg": len(first),
            "on": {
                "messages": n,
                "pattern": "PUSH/PULL, tcp://127.0.0.1, 2 processes",
                "payload": f"fpdgd.update, {N_FEATURES} float64, encode + decode",
            },
        }
    }


# ----------------------------------------------------------------------------------- secagg


def bench_secagg(sz: Sizes, seed: int) -> dict[str, dict]:
    """Cost of a secure-aggregation round against the number of clients (FPDGD-sized vectors):
    plaintext, the complete graph (SecAgg) and the sparse graph (SecAgg+, degree 16), plus 30 %
    dropout after key sharing; and the largest error of the unmasked mean."""
    from protocols.secagg import cost

    if sz.fpdgd_clients < 100:  # --scale for smoke tests: the same shapes, tiny
        plan = [(6, False, 0, 0.0), (6, True, 0, 0.0), (12, True, 4, 0.0), (12, True, 0, 0.3)]
    else:
        large = sz.fpdgd_clients >= 1000  # the full suite adds the 1000-client SecAgg+ round
        plan = [(n, False, 0, 0.0) for n in (10, 30, 100)]
        plan += [(n, True, 0, 0.0) for n in (10, 30, 100)]
        plan += [(n, True, 16, 0.0) for n in ((100, 300, 1000) if large else (100, 300))]
        plan += [(100, True, 0, 0.3), (100, True, 40, 0.3)]
    rows = []
    for clients, secure, degree, dropout in plan:
        r = cost(
            clients, dim=N_FEATURES + 1, degree=degree, dropout=dropout, secure=secure, seed=seed
        )
        rows.append(r)
        graph = "plain" if not secure else ("complete" if degree == 0 else f"k={degree}")
        _progress(
            f"secagg: {clients} clients {graph} dropout {dropout:.0%}: "
            f"{r['wall_s_per_round']:.3f} s/round, {r['messages_per_round']:.0f} messages, "
            f"{r['bytes_per_client_round'] / 1e3:.1f} kB per client"
        )
    errors = [r["max_rel_error"] for r in rows if r["secure"] and r["max_rel_error"] is not None]
    full = [r for r in rows if r["secure"] and r["degree"] == 0 and r["dropout"] == 0]
    top = max(full, key=lambda r: r["clients"])  # the largest complete-graph round
    return {
        "secagg": {
            "max_rel_error": max(errors),
            "complete_s_per_round": top["wall_s_per_round"],
            "complete_kb_per_client": top["bytes_per_client_round"] / 1e3,
            "rows": rows,
            "on": {
                "vector": f"{N_FEATURES + 1} values (weights + interaction count)",
                "complete graph clients": top["clients"],
                "rounds per setting": 2,
                "threshold": 0.5,
            },
        }
    }


# ------------------------------------------------------------------------------------ csfltr


def bench_csfltr(sz: Sizes, seed: int) -> dict[str, dict]:
    """CS-F-LTR's reverse top-K, RTK-Sketch against NAIVE, on one owner's embedded collection
    at each size (scenario defaults: K 150, alpha 5, beta 0.1, w 200, z 30, z1 10, epsilon 0.5);
    the targets read the first size."""
    from protocols.rtk_cost import cost

    rows = []
    for docs in sz.rtk_docs:
        r = cost(docs, seed=seed, queries=100 if docs >= 2_000 else 20)
        rows.append(r)
        _progress(
            f"csfltr: {docs} documents: RTK {r['rtk']['ms_per_term']:.3f} ms/term, NAIVE "
            f"{r['naive']['ms_per_term']:.2f} ms/term ({r['speedup']:.1f}x); cover on "
            f"{r['rankable_terms']} rankable terms RTK {r['rtk']['cover_rate_rankable'] or 0:.3f} "
            "(by the K-th count: "
            + ", ".join(f"{b}: {c:.2f}" for b, (c, _) in r["rtk"]["cover_by_kth"].items())
            + ")"
        )
    first = rows[0]
    return {
        "csfltr": {
            "speedup": first["speedup"],
            "cover_rate_rankable": first["rtk"]["cover_rate_rankable"] or 0.0,
            "rtk_ms_per_term": first["rtk"]["ms_per_term"],
            "naive_ms_per_term": first["naive"]["ms_per_term"],
            "rows": rows,
            "on": {
                "documents": first["docs"],
                "queries": first["queries"],
                "terms": first["terms"],
                "rankable terms": first["rankable_terms"],
                "K, alpha, w, z, z1": "150, 5, 200, 30, 10",
            },
        }
    }


# ------------------------------------------------------------------------------------ parse


def bench_parse(sz: Sizes, seed: int, workdir: Path, data_file: Path | None) -> dict[str, dict]:
    """Cold parse (hash + parse + cache write) and cached load of one LETOR file."""
    from foltr_async.ltr.data import load_letor, write_letor

    if data_file is None:
        n_queries = max(1, round(sz.parse_lines / 120))
        qs = letor_like(n_queries, np.random.default_rng(seed))
        path = workdir / "parse" / "train.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        _progress(f"parse: writing {qs.n_docs} MSLR-like LETOR lines")
        t0 = time.perf_counter()
        write_letor(qs, path)
        write_s = time.perf_counter() - t0
        what = "written with write_letor (MSLR-like widths)"
    else:
        path, write_s, what = data_file, None, "--data"
    size = path.stat().st_size
    with _env(FOLTR_ASYNC_CACHE=str(workdir / "parse-cache")):
        _progress(f"parse: {path.name} ({size / 1e6:.0f} MB), cold then cached")
        t0 = _now()
        qs = load_letor(path)
        t1 = _now()
        cold = t1[0] - t0[0]
        c0 = time.perf_counter()
        again = load_letor(path)
        cached = time.perf_counter() - c0
    if again.n_docs != qs.n_docs or not np.array_equal(again.features, qs.features):
        raise RuntimeError("parse: the cached load differs from the parsed one")
    lines = qs.n_docs
    out: dict[str, Any] = {
        "lines_per_s": lines / cold,
        "cold_s": cold,
        "cached_s": cached,
        "mb_per_s": size / 1e6 / cold,
        "cpu_share": _cpu_share(t0, t1),  # up to 2: the parser runs two blocks at once
        "on": {"lines": lines, "features": qs.n_features, "megabytes": size / 1e6, "file": what},
    }
    if lines >= MIN_EXTRAPOLATE_LINES:
        # Both times are linear in the cells parsed / loaded once fixed costs are small.
        scale = MSLR_TRAIN_LINES / lines * N_FEATURES / max(1, qs.n_features)
        out["mslr_parse_s"] = cold * scale
        out["mslr_cached_s"] = cached * scale
        out["note"] = (
            f"mslr_* extrapolate linearly to {MSLR_TRAIN_LINES} lines x {N_FEATURES} features "
            "(MSLR-WEB10K Fold1 train)"
        )
    else:
        out["note"] = (
            f"fewer than {MIN_EXTRAPOLATE_LINES} lines: fixed costs dominate, no MSLR-size "
            "extrapolation"
        )
    if write_s is not None:
        out["write_lines_per_s"] = lines / write_s
    return {"parse": out}


# ---------------------------------------------------------------------------------- children


def _child_cmd(spec: dict) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    code = "import sys; from foltr_async.bench import child_main; child_main(sys.argv[1])"
    return [sys.executable, "-c", code, json.dumps(spec)], env


def _spawn_child(spec: dict) -> subprocess.Popen:
    cmd, env = _child_cmd(spec)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_child(proc: subprocess.Popen, spec: dict, timeout: float = 600) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{spec['task']}: child process timed out after {timeout} s") from None
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{spec['task']}: child process failed: {last}")
    return json.loads(out.strip().splitlines()[-1])


def _run_child(spec: dict, timeout: float = 600) -> dict:
    return _finish_child(_spawn_child(spec), spec, timeout)


def child_main(spec_json: str) -> None:
    """Entry point of the bench's child processes: one JSON line on stdout."""
    spec = json.loads(spec_json)
    _quiet_logs()
    task = {"startup": _startup_child, "memory": _memory_child, "zmq_send": _zmq_sender}
    print(json.dumps(task[spec["task"]](spec)), flush=True)


# ------------------------------------------------------------------------------------ driver


def _meta(quick: bool, scale: float) -> dict:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip("\n") if r.returncode == 0 else None

    # Code that differs from the commit (edited or not yet added) changes what was measured.
    status = git("status", "--porcelain", "--", "foltr_async", "protocols")
    changed = [line[3:] for line in (status or "").splitlines() if line.endswith(".py")]
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(changed) if status is not None else None,
        "local_changes": changed,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cores": os.cpu_count(),
        "machine": f"{platform.system()} {platform.machine()}",
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "load_average": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
        "quick": quick,
        "scale": scale,
    }


def run_suites(
    suites: list[str],
    sizes: Sizes,
    *,
    data: Path | None = None,
    seed: int = 0,
    profile: bool = False,
) -> dict[str, Any]:
    """Run the named suites; a suite that fails is reported as ``{"error": ...}``.

    fpdgd, foltr_es and parse use ``data`` when given; start-up and memory always measure the
    embedded dataset (what a user gets without any files).
    """
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="foltr-bench-") as tmp:
        workdir = Path(tmp)
        src, embedded = resolve_data(data, seed), resolve_data(None, seed)
        runners: dict[str, Callable[[], dict]] = {
            "fpdgd": lambda: bench_fpdgd(src, sizes, seed, profile),
            "foltr_es": lambda: bench_foltr_es(src, sizes, seed, profile),
            "bus": lambda: bench_bus(sizes, seed),
            "startup": lambda: bench_startup(embedded, seed, workdir),
            "memory": lambda: bench_memory(embedded, sizes, seed),
            "zmq": lambda: bench_zmq(sizes, seed),
            "parse": lambda: bench_parse(
                sizes, seed, workdir, None if data is None else check_data(data)
            ),
            "secagg": lambda: bench_secagg(sizes, seed),
            "csfltr": lambda: bench_csfltr(sizes, seed),
        }
        for name in suites:
            t0 = time.perf_counter()
            try:
                results.update(runners[name]())
            except FoltrError:
                raise
            except Exception as e:  # one broken suite must not hide the others' numbers
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                _progress(f"{name}: FAILED: {type(e).__name__}: {e}")
            _progress(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    results["checks"] = [
        {
            "metric": f"{c.suite}.{c.key}",
            "label": c.label,
            "value": results[c.suite][c.key],
            "target": f"{c.op} {c.limit:g}",
            "ok": c.ok(results[c.suite][c.key]),
        }
        for c in TARGETS
        if c.suite in results and c.key in results[c.suite]
    ]
    return results


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


# (suite, key, label, unit) shown in the table besides the targets
_SHOWN = (
    ("fpdgd", "queries_per_s", "queries/s", ""),
    ("fpdgd", "s_per_round", "round", "s"),
    ("fpdgd", "paper_run_s", "200-round paper run (extrapolated)", "s"),
    ("pdgd", "interactions_per_s", "centralised interactions/s", ""),
    ("eval", "queries_per_s", "offline nDCG@10 queries/s", ""),
    ("foltr_es", "s_per_round", "round", "s"),
    ("bus", "us_per_update", "per client update", "us"),
    ("bus", "msgs_per_s", "messages/s", ""),
    ("bus", "bytes_per_s", "bytes/s", ""),
    ("startup", "s", "start-up to round 1", "s"),
    ("startup", "cold_s", "start-up, dataset not cached yet", "s"),
    ("memory", "mb_per_1000_clients", "RSS per 1000 clients", "MB"),
    ("memory", "rss_62500_mb", "RSS with 62,500 clients", "MB"),
    ("zmq", "msgs_per_s", "messages/s", ""),
    ("parse", "lines_per_s", "lines/s (cold)", ""),
    ("parse", "cached_s", "cached load", "s"),
    ("parse", "mslr_parse_s", "MSLR-size parse (extrapolated)", "s"),
    ("parse", "mslr_cached_s", "MSLR-size cached load (extrapolated)", "s"),
    ("secagg", "complete_s_per_round", "round, complete graph (largest)", "s"),
    ("secagg", "complete_kb_per_client", "sent per client, complete graph", "kB"),
    ("secagg", "max_rel_error", "unmasked mean vs plaintext (relative)", ""),
    ("csfltr", "rtk_ms_per_term", "RTK-Sketch reverse top-K per term", "ms"),
    ("csfltr", "naive_ms_per_term", "NAIVE reverse top-K per term", "ms"),
    ("csfltr", "speedup", "speed-up", "x"),
    ("csfltr", "cover_rate_rankable", "RTK cover rate, rankable terms", ""),
)


def _on(d: dict) -> str:
    """One line of what a suite measured on (its sizes), for the readable output."""
    return ", ".join(
        f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
        for k, v in d.get("on", {}).items()
    )


def render(results: dict) -> None:
    """The readable output: one row per metric with its target and a pass/fail mark, then what
    each suite measured on (and the profile when asked for)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    meta = results["meta"]
    checks = {c["metric"]: c for c in results["checks"]}
    dirty = " + local changes" if meta["dirty"] else ""
    table = Table(
        title=f"foltr_async bench{' --quick (smaller sizes)' if meta['quick'] else ''}",
        caption=f"commit {(meta['commit'] or '?')[:10]}{dirty}, {meta['cores']} cores, "
        f"Python {meta['python']}, numpy {meta['numpy']}, load average {meta['load_average']}; "
        "CPU share = CPU s per wall s of the timed span (< 1: other processes competed)",
    )
    table.add_column("suite")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    table.add_column("")
    table.add_column("CPU share", justify="right")
    for suite, key, label, unit in _SHOWN:
        d = results.get(suite)
        if d is None or key not in d:
            continue
        c = checks.get(f"{suite}.{key}")
        mark = "" if c is None else ("[green]pass[/]" if c["ok"] else "[red]FAIL[/]")
        target = f"{c['target']} {unit}".strip() if c else ""
        cpu = f"{d['cpu_share']:.2f}" if "cpu_share" in d else ""
        table.add_row(suite, label, f"{_fmt(d[key])} {unit}".strip(), target, mark, cpu)
    for suite, d in results.items():
        if isinstance(d, dict) and "error" in d:
            table.add_row(suite, "suite failed", "error", "", "[red]FAIL[/]")
    console.print(table)
    for suite, d in results.items():
        if not isinstance(d, dict) or suite in ("meta",):
            continue
        if "error" in d:
            console.print(f"[bold]{suite}[/] failed: {d['error']}", highlight=False)
        elif "on" in d:
            console.print(f"[bold]{suite}[/] on: {_on(d)}", highlight=False)
    rows = results.get("reference", {}).get("rows")
    if rows:
        rt = Table(title=f"next to {results['reference']['name']}")
        for col in ("metric", "this run", "CPU share", "reference", "times better", "on"):
            rt.add_column(col, justify="left" if col in ("metric", "on") else "right")
        for r in rows:
            cpu = "" if r["cpu_share"] is None else f"{r['cpu_share']:.2f}"
            rt.add_row(
                r["metric"],
                _fmt(r["ours"]),
                cpu,
                _fmt(r["reference"]),
                f"{r['times_better']:.1f}x",
                str(r["reference_on"]),
            )
        console.print(rt)
    rows = results.get("secagg", {}).get("rows")
    if rows:
        st = Table(title="secure aggregation: cost per round against the number of clients")
        for col in ("clients", "graph", "dropout", "rounds ok", "messages", "kB/client", "s"):
            st.add_column(col, justify="right")
        for r in rows:
            graph = (
                "plain"
                if not r["secure"]
                else ("complete" if r["degree"] == 0 else f"k={r['degree']}")
            )
            st.add_row(
                str(r["clients"]),
                graph,
                f"{r['dropout']:.0%}",
                f"{r['completed_rounds']}/{r['rounds']}",
                f"{r['messages_per_round']:.0f}",
                f"{r['bytes_per_client_round'] / 1e3:.1f}",
                f"{r['wall_s_per_round']:.3f}",
            )
        console.print(st)
    rows = results.get("csfltr", {}).get("rows")
    if rows:
        ct = Table(title="CS-F-LTR reverse top-K on one owner: RTK-Sketch vs NAIVE per term")
        ct.caption = "cover: rankable terms / all terms; kB per answer; MB: RTK-Sketch / sketches"
        for col in ("docs", "rankable", "RTK ms", "NAIVE ms", "x", "RTK cover", "NAIVE cover"):
            ct.add_column(col, justify="right")
        for col in ("kB", "MB"):
            ct.add_column(col, justify="right")
        for r in rows:
            a, b = r["rtk"], r["naive"]
            ct.add_row(
                str(r["docs"]),
                f"{r['rankable_terms']}/{r['terms']}",
                f"{a['ms_per_term']:.3f}",
                f"{b['ms_per_term']:.2f}",
                f"{r['speedup']:.1f}",
                f"{a['cover_rate_rankable'] or 0:.3f} / {a['cover_rate']:.3f}",
                f"{b['cover_rate_rankable'] or 0:.3f} / {b['cover_rate']:.3f}",
                f"{a['bytes_per_term'] / 1e3:.0f} / {b['bytes_per_term'] / 1e3:.0f}",
                f"{a['memory_bytes'] / 1e6:.0f} / {b['memory_bytes'] / 1e6:.0f}",
            )
        console.print(ct)
    for suite in ("fpdgd", "foltr_es"):
        prof = results.get(suite, {}).get("profile")
        if not prof:
            continue
        pt = Table(title=f"cProfile of the timed {suite} rounds: own time per file")
        for col in ("file", "own s", "share"):
            pt.add_column(col, justify="left" if col == "file" else "right")
        for r in prof["files"][:12]:
            pt.add_row(r["file"], f"{r['tottime_s']:.3f}", f"{r['share']:.0%}")
        console.print(pt)
        pt = Table(title=f"cProfile of the timed {suite} rounds: top functions by own time")
        for col in ("function", "calls", "own s", "share", "cumulative s"):
            pt.add_column(col, justify="left" if col == "function" else "right")
        for r in prof["functions"]:
            pt.add_row(
                r["function"],
                str(r["calls"]),
                f"{r['tottime_s']:.3f}",
                f"{r['share']:.0%}",
                f"{r['cumtime_s']:.3f}",
            )
        console.print(pt)


#: (suite, key) rows a reference file may give, and whether more is better
REFERENCE_KEYS = {
    ("fpdgd", "queries_per_s"): True,
    ("fpdgd", "s_per_round"): False,
    ("fpdgd", "paper_run_s"): False,
    ("pdgd", "interactions_per_s"): True,
    ("eval", "queries_per_s"): True,
    ("foltr_es", "s_per_round"): False,
    ("startup", "s"): False,
}


def load_reference(path: Path) -> dict[str, dict]:
    """Recorded figures of another implementation (e.g. the papers' authors' code), as JSON::

        {"name": "authors' code", "fpdgd": {"queries_per_s": 1800, "s_per_round": 1.1,
         "on": "1000 clients x 2 queries, MSLR-shaped, same machine"}, "foltr_es": {...}}

    Only the metrics of ``REFERENCE_KEYS`` are compared; ``on`` says what they were measured on.
    """
    try:
        ref = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FoltrError(f"--reference {path}: cannot read a JSON object ({e})") from None
    if not isinstance(ref, dict):
        raise FoltrError(f"--reference {path}: expected a JSON object of suites")
    for (suite, key), _ in REFERENCE_KEYS.items():
        v = ref.get(suite, {}).get(key) if isinstance(ref.get(suite), dict) else None
        if v is not None and not (isinstance(v, int | float) and v > 0):
            raise FoltrError(f"--reference {path}: {suite}.{key} must be a positive number")
    return ref


def compare(results: dict, ref: dict) -> list[dict]:
    """Rows of this run's figure next to the reference's, with how many times better."""
    rows = []
    for (suite, key), more_is_better in REFERENCE_KEYS.items():
        theirs = ref.get(suite, {}).get(key) if isinstance(ref.get(suite), dict) else None
        ours = results.get(suite, {}).get(key)
        if theirs is None or ours is None:
            continue
        rows.append(
            {
                "metric": f"{suite}.{key}",
                "ours": ours,
                "reference": theirs,
                "times_better": ours / theirs if more_is_better else theirs / ours,
                "cpu_share": results[suite].get("cpu_share"),
                "reference_on": ref[suite].get("on", ""),
            }
        )
    return rows


def _quiet_logs() -> None:
    """Only warnings and errors from the simulator's structlog, on stderr: stdout is the
    table or the JSON object."""
    from foltr_async.observe.log import configure_logging

    configure_logging(events_path=None, json_logs=False, level="warning", console=False)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async bench",
        description="Measure simulator speed and memory against the project's targets.",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    p.add_argument(
        "--data",
        type=Path,
        metavar="LETOR_FILE_OR_FOLD_DIR",
        help="a LETOR training file (test.txt beside it) or fold directory for the "
        "fpdgd / foltr_es / parse suites (default: the embedded mslr-like profile)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--suite",
        action="append",
        choices=SUITES,
        metavar="NAME",
        help=f"run only these suites (repeatable): {', '.join(SUITES)}",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every count (clients, messages, lines) by this factor",
    )
    p.add_argument(
        "--clients",
        type=int,
        help="clients of the fpdgd, foltr_es and bus suites (e.g. 62500; default 1000 / 2000)",
    )
    p.add_argument(
        "--interactions",
        type=int,
        help="interactions in FPDGD's timed rounds (e.g. 1000000; rounded up to whole rounds)",
    )
    p.add_argument(
        "--reference",
        type=Path,
        metavar="FILE.json",
        help="recorded figures of another implementation (e.g. the authors' code) to print "
        "next to this run's, with the ratio",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the runs")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile the timed FPDGD and FOLtR-ES rounds (top functions in the output)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 0 when every suite ran, 1 when one failed, 2 on bad input."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error
        return int(e.code or 0)
    for name in ("scale", "clients", "interactions"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            print(f"error: --{name} must be > 0", file=sys.stderr)
            return 2
    _quiet_logs()
    suites = list(dict.fromkeys(args.suite or SUITES))
    sizes = (QUICK if args.quick else FULL).scaled(args.scale)
    sizes = sizes.at_scale(args.clients, args.interactions)
    try:
        if args.data is not None:
            check_data(args.data)
        reference = None if args.reference is None else load_reference(args.reference)
        _progress(f"{'quick' if args.quick else 'full'} run of {', '.join(suites)}")
        results = {"meta": _meta(args.quick, args.scale)}
        results.update(
            run_suites(suites, sizes, data=args.data, seed=args.seed, profile=args.profile)
        )
        if reference is not None:
            results["reference"] = {
                "name": str(reference.get("name", args.reference.name)),
                "rows": compare(results, reference),
            }
    except FoltrError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(results, indent=2, default=float))
    else:
        render(results)
    return 1 if any(isinstance(v, dict) and "error" in v for v in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What every suite shares: the sizes, timing with its CPU share, the data source and the
scenario configs the simulation suites run, and child processes for suites that need a fresh one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from foltr_async.errors import DatasetError

if TYPE_CHECKING:
    from foltr_async.config import RunConfig

PROFILE = "mslr-like"  # the embedded profile shaped like MSLR-WEB10K (136 features, ~120 docs)
N_FEATURES = 136
PAPER_ROUNDS = 200  # FPDGD on MSLR-WEB10K: |C| = 1000, B = 2, 200 rounds (Wang et al. 2021)
ROOT = Path(__file__).resolve().parents[1]  # the folder holding the three packages


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


def now() -> tuple[float, float]:
    """(wall, CPU) seconds: CPU / wall over a span shows how much of the machine we had."""
    return time.perf_counter(), time.process_time()


def cpu_share(t0: tuple[float, float], t1: tuple[float, float]) -> float:
    """CPU seconds of this process per wall second over a span: ~1 on an idle core, lower
    when other processes competed (the wall-clock numbers then understate the code)."""
    return round((t1[1] - t0[1]) / max(1e-9, t1[0] - t0[0]), 2)


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ data


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
def set_env(**values: str) -> Iterator[None]:
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


def scenario_config(
    dataset: dict,
    protocol: str,
    clients: int,
    batch: int,
    rounds: int,
    every: int,
    data_mode: str = "partition",
    seed: int = 0,
) -> RunConfig:
    from foltr_async.plugins import load_plugins
    from foltr_async.scenario.load import validate

    load_plugins()  # the protocol names the config is checked against
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


def load_data(dataset: dict):
    from foltr_async import simulation

    return simulation.load_datasets(scenario_config(dataset, "fpdgd", 1, 1, 1, 1))


def sizes_of(data) -> dict:
    tr, te = data.train, data.test
    return {
        "train_queries": tr.n_queries,
        "train_docs": tr.n_docs,
        "docs_per_query": round(tr.n_docs / max(1, tr.n_queries), 1),
        "features": tr.n_features,
        "test_queries": te.n_queries,
        "grades": data.n_grades,
    }


# ---------------------------------------------------------------------------------- children


def child_cmd(spec: dict) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    code = "import sys; from foltr_async.benchmarks.cli import child_main; child_main(sys.argv[1])"
    return [sys.executable, "-c", code, json.dumps(spec)], env


def spawn_child(spec: dict) -> subprocess.Popen:
    cmd, env = child_cmd(spec)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_child(proc: subprocess.Popen, spec: dict, timeout: float = 600) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{spec['task']}: child process timed out after {timeout} s") from None
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{spec['task']}: child process failed: {last}")
    return json.loads(out.strip().splitlines()[-1])


def run_child(spec: dict, timeout: float = 600) -> dict:
    return finish_child(spawn_child(spec), spec, timeout)


def quiet_logs() -> None:
    """Only warnings and errors from the simulator's structlog, on stderr: stdout is the
    table or the JSON object."""
    from foltr_async.observe.log import configure_logging

    configure_logging(events_path=None, json_logs=False, level="warning", console=False)

"""Repeats in parallel (local processes, Ray) give the serial run's results."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foltr_async import simulation
from foltr_async.errors import FoltrError
from foltr_async.experiment import run_scenario
from foltr_async.observe.observer import Observer
from foltr_async.parallel import run_jobs
from foltr_async.scenario.load import load_scenario

SCENARIO = """
[scenario]
name = "par"
seed = 4
repeats = 2
reference = "fedavg"
[dataset]
n_queries = 60
[federation]
protocol = "fpdgd"
clients = 4
queries_per_client = 2
rounds = 6
[evaluation]
every = 3
[variants.fedavg]
[[grid]]
name = "attacked-{aggregator}"
set = { agents = [{ behaviour = "scaled_reversal", count = 1 }] }
product = { federation.aggregator = ["fedavg", "median"] }
"""


def _without_wall_time(obj):
    if isinstance(obj, dict):
        return {k: _without_wall_time(v) for k, v in obj.items() if k != "wall_s"}
    if isinstance(obj, list):
        return [_without_wall_time(v) for v in obj]
    return obj


def _run(tmp_path: Path, name: str, **kw) -> dict:
    path = tmp_path / "par.toml"
    path.write_text(SCENARIO)
    out = tmp_path / name
    run_scenario(load_scenario(path), out, Observer(), **kw)
    return json.loads((out / "results.json").read_text())


def test_jobs_give_the_serial_results_json(tmp_path):
    serial = _run(tmp_path, "serial")
    assert simulation._load.cache_info().currsize > 0  # the serial runs reuse the dataset
    parallel = _run(tmp_path, "jobs2", jobs=2)
    assert len(serial["variants"]) == 3 and serial["complete"]
    assert _without_wall_time(parallel) == _without_wall_time(serial)
    # the jobs ran in other processes: this one keeps no dataset for them
    assert simulation._load.cache_info().currsize == 0


def test_bad_job_counts_and_executors_are_one_line_errors():
    with pytest.raises(FoltrError, match="--jobs: expected an integer >= 1, got 0"):
        list(run_jobs([(0, 1, "a", {})], 0))
    with pytest.raises(FoltrError, match="--executor: expected one of local, ray"):
        list(run_jobs([(0, 1, "a", {})], 2, "dask"))


def test_killed_job_processes_do_not_stop_the_run(tmp_path):
    """The out-of-memory killer took the pool's processes in a long run: their jobs run again
    and the run ends with every result."""
    import multiprocessing

    path = tmp_path / "par.toml"
    path.write_text(SCENARIO.replace("rounds = 6", "rounds = 60"))
    sc = load_scenario(path)
    jobs = [(r, sc.seed + r, name, cfg) for name, cfg in sc.variants.items() for r in range(2)]
    results = run_jobs(jobs, 2)
    first = [next(results)]  # one job done: the processes are up
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)
    got = first + list(results)
    assert sorted((name, rep) for (rep, _, name, _), _ in got) == sorted(
        (name, rep) for rep, _, name, _ in jobs
    )
    assert all(result["rounds"] for _, result in got)


def dies_unless_marked(cfg: dict, seed: int, name: str, repeat: int) -> dict:
    """A job function (imported by name in the job process): ``always`` kills its process
    every time, ``once`` only the first time (it leaves a marker file), the others return."""
    marker = Path(cfg["marker"])
    if name == "always" or (name == "once" and not marker.exists()):
        marker.touch()
        os._exit(9)
    return {"variant": name, "repeat": repeat, "seed": seed}


def test_a_job_whose_process_dies_twice_is_one_line_after_every_other_result(tmp_path):
    cfg = {"marker": str(tmp_path / "died")}
    jobs = [(r, r, name, cfg) for name in ("ok", "once", "always") for r in range(2)]
    got = []
    with pytest.raises(
        FoltrError,
        match=r"--jobs: 2 job\(s\) lost their process twice \(killed; out of memory\?\):"
        r" always repeat 0, always repeat 1; every other repeat finished and is kept",
    ):
        for job, result in run_jobs(jobs, 2, work=dies_unless_marked):
            got.append((job[2], job[0]))
            assert result == {"variant": job[2], "repeat": job[0], "seed": job[1]}
    assert sorted(got) == [("ok", 0), ("ok", 1), ("once", 0), ("once", 1)]


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (optional extra: pip install 'foltr-async[ray]')",
)
def test_ray_executor_on_a_local_two_cpu_ray_gives_the_serial_results(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    serial = _run(tmp_path, "serial")
    on_ray = _run(tmp_path, "ray", jobs=2, executor="ray")
    assert _without_wall_time(on_ray) == _without_wall_time(serial)


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_diverged_model_stops_the_run_in_one_line_naming_its_variant(tmp_path, jobs):
    """lr = 1e308 overflows the weights to inf: the scores are nan, every query one tie, and
    the nDCG a constant that would look like a result."""
    path = tmp_path / "par.toml"
    path.write_text(SCENARIO.replace('"fpdgd"', '"fpdgd"\nparams = { lr = 1e308 }'))
    with pytest.raises(FoltrError, match=r"par.toml \[variant [\w-]+\]: the model diverged"):
        run_scenario(load_scenario(path), tmp_path / "out", Observer(), jobs=jobs)


def fails_or_sleeps(cfg: dict, seed: int, name: str, repeat: int) -> dict:
    """A job function: ``fails`` raises a one-line error once ``sleeps`` is running (its
    marker file exists), ``sleeps`` takes ten minutes."""
    started = Path(cfg["started"])
    if name == "fails":
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise FoltrError("the model diverged")
    started.touch()
    time.sleep(600)
    return {}


def test_a_jobs_error_ends_the_run_without_waiting_for_the_running_jobs(tmp_path):
    cfg = {"started": str(tmp_path / "started")}
    start = time.monotonic()
    with pytest.raises(FoltrError, match="the model diverged") as err:
        list(run_jobs([(0, 1, "sleeps", cfg), (0, 1, "fails", cfg)], 2, work=fails_or_sleeps))
    assert err.value.job[2] == "fails" and (tmp_path / "started").exists()
    assert time.monotonic() - start < 600  # the sleeping job's 600 s were not waited for


def test_parallel_jobs_start_longest_first_and_equal_costs_keep_their_order(tmp_path):
    from foltr_async.parallel import longest_first

    path = tmp_path / "par.toml"
    path.write_text(
        SCENARIO
        + "[variants.long]\nfederation.rounds = 60\n"
        + "[variants.wide]\nfederation.clients = 12\n"
        + '[variants.mlp]\nranker = { kind = "mlp", hidden = [20] }\n'
    )
    sc = load_scenario(path)
    todo = [
        (rep, sc.seed + rep, name, cfg) for rep in range(2) for name, cfg in sc.variants.items()
    ]
    order = [(name, rep) for rep, _, name, _ in longest_first(todo)]
    # 60 rounds x (8 + 100) > 6 x (24 + 100) x 1; the MLP's 20 units cost 3x: 6 x 108 x 3
    assert order[:6] == [("long", 0), ("long", 1), ("mlp", 0), ("mlp", 1), ("wide", 0), ("wide", 1)]
    rest = [(n, r) for n, r in order[6:]]
    assert rest == [
        (n, r) for r in range(2) for n in ("fedavg", "attacked-fedavg", "attacked-median")
    ]


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent, ...); None: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _long_run(tmp_path: Path, *args: str, **popen) -> tuple[subprocess.Popen, Path]:
    """A million-round run of SCENARIO in its own process (stderr piped); its output folder."""
    path = tmp_path / "long.toml"
    path.write_text(SCENARIO.replace("rounds = 6", "rounds = 1000000").replace("repeats = 2", ""))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "foltr_async", str(path), "--quiet", "--out", str(out), *args]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, **popen), out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_sigterm_to_a_jobs_run_stops_its_workers_as_ctrl_c_does(tmp_path):
    run, _ = _long_run(tmp_path, "--jobs", "2")
    deadline = time.monotonic() + 120
    workers: set[int] = set()
    while len(workers) < 2 and time.monotonic() < deadline:  # two job processes and more
        time.sleep(0.5)
        workers = {p for p in _children(run.pid) if "spawn_main" in _cmdline(p)}
    try:
        assert len(workers) == 2, "the run's two workers did not start"
        time.sleep(1.0)
        run.send_signal(signal.SIGTERM)  # to the parent only, as a scheduler does
        _, err = run.communicate(timeout=60)
        assert run.returncode == 130 and "interrupted" in err
        deadline = time.monotonic() + 30
        while any(_state(p) != "Z" for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_state(p) == "Z" for p in workers), "workers left running"
    finally:  # a failure must not leave million-round jobs running
        run.kill()
        for p in workers:
            if _state(p) != "Z":
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_to_an_in_process_run_ends_it_without_a_traceback(tmp_path, signum):
    """The interrupt lands in whichever agent's task is running; it must still end the run as
    one line (no 'Task exception was never retrieved' dump) with what was written kept."""
    run, out = _long_run(
        tmp_path,
        *("--jobs", "1", "--only", "fedavg"),
        # a shell's background job ignores SIGINT, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        events = out / "events.jsonl"
        while time.monotonic() < deadline and not (
            events.exists() and '"round"' in events.read_text()
        ):
            time.sleep(0.2)
        time.sleep(0.5)
        run.send_signal(getattr(signal, signum))
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert (out / "events.jsonl").exists()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _state(pid: int) -> str:
    """A process's state letter; "Z" also for one already gone."""
    fields = _stat(pid)
    return "Z" if fields is None else fields[0]

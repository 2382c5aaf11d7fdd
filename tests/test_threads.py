"""``--threads`` / FOLTR_ASYNC_THREADS: the compiled PDGD kernel's threads change wall time only.

(The kernel itself is checked bit for bit at 1, 2 and 4 threads in test_pdgd_kernel.py.)
"""

import json
from pathlib import Path

import pytest

from foltr_async import cli
from foltr_async.benchmarks import cli as bench_cli
from foltr_async.ltr import threads


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.setenv(threads.ENV, "")  # the commands below export their choice to children
    yield
    threads.set_threads(None)


def scenario(tmp_path: Path, data: Path) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(
        f"""
[scenario]
name = "threads"
seed = 3

[dataset]
path = "{data}"

[clicks]
model = "informational"

[federation]
protocol = "fpdgd"
clients = 40
queries_per_client = 3
rounds = 4

[evaluation]
every = 2

[variants.linear]

[variants.mlp]
ranker = {{ kind = "mlp", hidden = [8] }}
"""
    )
    return path


def run(path: Path, out: Path, *extra: str) -> dict:
    assert cli.main([str(path), "--out", str(out), "--quiet", *extra]) == 0
    res = json.loads((out / "results.json").read_text())
    for entry in res["variants"].values():
        entry["summary"].pop("wall_s")
        for rep in entry["repeats"]:
            rep.pop("wall_s")
    return res


def test_a_run_is_the_same_at_one_and_two_threads_and_records_them(tmp_path, mq2008_dir):
    path = scenario(tmp_path, mq2008_dir)
    one = run(path, tmp_path / "one", "--threads", "1")
    two = run(path, tmp_path / "two", "--threads", "2")
    assert one.pop("environment")["threads"] == 1
    env = two.pop("environment")
    assert env["threads"] == 2 and env["cores"] >= 1 and env["threading_layer"] == "workqueue"
    assert one == two
    assert threads.threads() == 2  # and processes started from here inherit it
    assert threads.facts()["threads"] == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_thread_count_is_one_line(tmp_path, capsys, mq2008_dir, monkeypatch, value):
    path = scenario(tmp_path, mq2008_dir)
    assert cli.main([str(path), "--out", str(tmp_path / "o"), "--threads", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --threads: expected a whole number of threads >= 1, got {value!r}"]
    monkeypatch.setenv(threads.ENV, value)
    assert cli.main([str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {threads.ENV}: expected a whole number of threads >= 1, got {value!r}"]
    assert not (tmp_path / "o").exists()
    assert bench_cli.main(["--threads", f"1,{value}", "--suite", "fpdgd"]) == 2
    assert capsys.readouterr().err.startswith("error: --threads: expected a whole number")


def test_local_processes_share_the_cores_unless_told(monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 8)
    cli._apply_threads(None, processes=3)
    assert threads.threads() == 2
    threads.set_threads(None)
    monkeypatch.setenv(threads.ENV, "5")  # the environment variable is a choice too
    cli._apply_threads(None, processes=3)
    assert threads.threads() == 5
    cli._apply_threads("3", processes=4)
    assert threads.threads() == 3


def test_bench_times_the_kernel_at_each_thread_count(capsys, mq2008_dir):
    argv = ["--quick", "--json", "--scale", "0.01", "--suite", "fpdgd"]
    rc = bench_cli.main([*argv, "--data", str(mq2008_dir / "train.txt"), "--threads", "1,2"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out)
    rows = res["pdgd_kernel"]["scaling"]
    assert [r["threads"] for r in rows] == [1, 2] and rows[0]["speedup"] == 1.0
    assert "serial_share" in rows[1] and "serial_share" not in rows[0]
    assert all(r["queries_per_s"] > 0 and r["queries_per_cpu_s"] > 0 for r in rows)
    assert res["meta"]["kernel"]["threads"] == res["pdgd_kernel"]["threads"] == 2


def blas_threads() -> int:
    from threadpoolctl import threadpool_info

    return max(info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas")


def test_a_run_uses_one_blas_thread_unless_the_user_set_a_count(monkeypatch, mq2008_dir):
    """A library caller's numpy has a BLAS thread per core; a run limits it to one for its
    duration (many small products from one event loop), unless the user set a count."""
    from foltr_async.observe.observer import Observer
    from foltr_async.protocols.online import ModelStrategy
    from foltr_async.runtime.clock import run
    from foltr_async.scenario.load import validate
    from foltr_async.simulation import Simulation

    for name in threads.BLAS_ENV:
        monkeypatch.delenv(name, raising=False)
    before = blas_threads()
    seen = []
    with threads.one_blas_thread():
        seen.append(blas_threads())
    assert seen == [1] and blas_threads() == before

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", str(before))
    with threads.one_blas_thread():
        assert blas_threads() == before  # the user's choice stands
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")

    cfg = validate(
        {
            "dataset": {"path": str(mq2008_dir)},
            "federation": {"protocol": "fpdgd", "clients": 2, "rounds": 1},
        },
        "test",
    )
    measured = ModelStrategy.evaluate

    def evaluate(strategy):
        seen.append(blas_threads())
        return measured(strategy)

    monkeypatch.setattr(ModelStrategy, "evaluate", evaluate)
    run(Simulation(cfg, 0, Observer()).run())
    assert seen[1:] and set(seen[1:]) == {1}  # the server's evaluations ran on one thread
    assert blas_threads() == before

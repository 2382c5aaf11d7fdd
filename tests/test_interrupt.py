"""Ctrl-C and SIGTERM keep every finished repeat: in results.json, summary.md and the checkpoint,
for serial and ``--jobs`` runs, and ``--resume`` completes them to the uninterrupted results."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foltr_async.experiment import CHECKPOINT, run_scenario
from foltr_async.observe.observer import Observer
from foltr_async.runtime.checkpoint import read_checkpoint
from foltr_async.scenario.load import load_scenario

SCENARIO = """
[scenario]
name = "cut"
seed = 4
repeats = 12
[dataset]
n_queries = 60
[federation]
protocol = "fpdgd"
clients = 3
queries_per_client = 2
rounds = 4
[evaluation]
every = 2
[variants.a]
[variants.b]
federation = { aggregator = "median" }
"""


def _finished(events: Path) -> int:
    """The repeats the run's log says finished (0 while there is no log)."""
    try:
        text = events.read_text()
    except OSError:
        return 0
    return text.count('"event":"repeat_done"')


def _comparable(results: dict) -> dict:
    """The repeats' results without wall-clock times (the only thing a resume may change)."""
    return {
        name: [{k: v for k, v in rep.items() if k != "wall_s"} for rep in v["repeats"]]
        for name, v in results["variants"].items()
    }


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "foltr_async", *args, "--quiet", "--json-logs"]


@pytest.mark.parametrize(("signum", "jobs"), [("SIGINT", "1"), ("SIGTERM", "1"), ("SIGINT", "2")])
def test_an_interrupt_keeps_every_finished_repeat_and_resume_completes_them(tmp_path, signum, jobs):
    path = tmp_path / "cut.toml"
    path.write_text(SCENARIO)
    out, k = tmp_path / "out", 4
    log = (tmp_path / "stderr").open("w")  # a file: a full pipe would stall the run
    run = subprocess.Popen(
        _cli(str(path), "--out", str(out), "--checkpoint-every", "100", "--jobs", jobs),
        stdout=subprocess.DEVNULL,
        stderr=log,
        # a shell's background job ignores SIGINT, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        while _finished(out / "events.jsonl") < k and run.poll() is None:
            assert time.monotonic() < deadline, "the run finished no repeat in 300 s"
            time.sleep(0.1)
        run.send_signal(getattr(signal, signum))  # to the parent only, as a scheduler does
        run.wait(timeout=120)
    finally:
        run.kill()
        log.close()
    err = (tmp_path / "stderr").read_text()
    assert run.returncode == 130, err
    assert "interrupted: results written so far are kept" in err and "Traceback" not in err
    done = _finished(out / "events.jsonl")
    assert k <= done < 24, "the run was not interrupted part-way"
    partial = json.loads((out / "results.json").read_text())
    kept = sum(len(v["repeats"]) for v in partial["variants"].values())
    assert not partial["complete"] and kept == done
    assert len(read_checkpoint(out / CHECKPOINT)["done"]) == done
    assert f"{done}/24 repeats finished" in (out / "summary.md").read_text()

    resumed = subprocess.run(
        _cli("run", str(path), "--resume", str(out)), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    full = run_scenario(load_scenario(path), tmp_path / "full", Observer())
    again = json.loads((out / "results.json").read_text())
    assert again["complete"] and _comparable(again) == _comparable(full)


def test_a_folder_in_use_by_a_run_cannot_be_resumed_by_another(tmp_path, capsys):
    """Two ``--resume`` of one folder both ran, interleaving checkpoints and results: the
    folder is locked while a run uses it, and a second run stops in one line."""
    import fcntl

    from foltr_async.cli import main
    from foltr_async.outdir import LOCK_FILE

    path = tmp_path / "cut.toml"
    path.write_text(SCENARIO.replace("repeats = 12", "repeats = 1"))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--quiet", "--checkpoint-every", "100"]) == 0
    before = (out / "results.json").read_bytes()
    with open(out / LOCK_FILE, "a") as held:  # what the running one holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capsys.readouterr()
        assert main(["run", str(path), "--resume", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--resume {out}: in use by another run" in err
        assert (out / "results.json").read_bytes() == before and not (
            out / "events.1.jsonl"
        ).exists()
    assert main(["run", str(path), "--resume", str(out), "--quiet"]) == 0  # released: it runs


def test_half_written_files_of_a_killed_run_are_removed_by_its_resume(tmp_path, capsys):
    from foltr_async.cli import main

    path = tmp_path / "cut.toml"
    path.write_text(SCENARIO.replace("repeats = 12", "repeats = 1"))
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--quiet", "--checkpoint-every", "100"]) == 0
    left = [out / ".results.json.99999.tmp", out / ".checkpoint.pkl.99999.tmp"]
    for tmp in left:  # what kill -9 in the middle of a write leaves
        tmp.write_bytes(b"\x00half")
    assert main(["run", str(path), "--resume", str(out), "--quiet"]) == 0
    assert not any(tmp.exists() for tmp in left)


def test_a_dangling_symlink_out_says_where_it_points(tmp_path, capsys):
    from foltr_async.cli import main

    path = tmp_path / "cut.toml"
    path.write_text(SCENARIO)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    assert main([str(path), "--out", str(link), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--out {link}: a symbolic link to {tmp_path / 'gone'}, which does not exist" in err


def test_a_full_disk_at_the_start_is_one_line_without_a_traceback(tmp_path, capsys, monkeypatch):
    """Five chained tracebacks and an empty error.log: the results, then error.log, could not
    be written. A write that finds no room is one line naming the file."""
    import errno

    from foltr_async.cli import main
    from foltr_async.observe import results

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(results, "atomic_write_text", full)
    path = tmp_path / "cut.toml"
    path.write_text(SCENARIO)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert f"error: cannot write {out / 'results.json'}: No space left on device" in err

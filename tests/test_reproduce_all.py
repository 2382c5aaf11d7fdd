"""tools/reproduce_all.py: the plan covers the reproduce/ folder, runs resume, failures are kept."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foltr_async.provenance import code_stamp

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "reproduce_all.py"

TINY = """
[scenario]
name = "tiny"
repeats = 2
reference = "plain"
[dataset]
profile = "mq2007-like"
n_queries = 20
[clicks]
model = "informational"
[federation]
protocol = "fpdgd"
clients = 3
rounds = 4
[evaluation]
every = 2
[variants.plain]
[variants.dp]
federation.params = { dp = true, epsilon = 4.5, sensitivity = 5.0 }
"""


def tool(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_plan_runs_every_reproduce_file_and_each_click_model_separately():
    out = tool("--plan", "--out", "nowhere")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    planned = {line.split()[0] for line in lines}
    for f in (ROOT / "reproduce").glob("*.toml"):
        assert any(name == f.stem or name.startswith(f.stem + "-") for name in planned), f.name
    # the seeds report these studies for every click model (thesis §3.1, §5.4, §6.2; FPDGD
    # paper Figures 5-6)
    models = ("perfect", "navigational", "informational")
    studies = ("fpdgd_dp", "unlearning", "data_poisoning", "model_poisoning")
    for study in (*studies, "defense_no_attack", "foltres", "foltres_clients", "fpdgd_batch_dp"):
        names = {f"{study}-{m}" for m in models}
        runs = [line for line in lines if line.split()[0] in names]
        assert len(runs) == 3 and all("--set clicks.model=" in line for line in runs), study
    assert all("to run" in line for line in lines)
    # FOLtR-ES at its authors' notebook settings: p = 1, their two rankers, 2,000 clients
    authors = [line for line in lines if line.startswith("foltres_authors-")]
    assert len(authors) == 3 and all(
        "--set federation.params.p=1.0 --only linear-C2000 --only mlp10-C2000" in line
        for line in authors
    )
    # and with their client's randomness
    streams = [line for line in lines if line.startswith("foltres_authors_streams-")]
    assert len(streams) == 3 and all(
        "--set federation.params.streams=authors" in line for line in streams
    )
    mslr = [line for line in lines if line.startswith("fpdgd_vs_foltres-mslr-like-")]
    assert len(mslr) == 3 and all("--set dataset.profile=mslr-like" in line for line in mslr)


def test_a_file_planned_in_parts_runs_every_variant_once_through_only():
    """fedips.toml at the paper's settings is planned in parts: together they are the file."""
    import tomllib

    from foltr_async.scenario.load import load_scenario

    plan = tomllib.loads((ROOT / "tools" / "reproduce_plan.toml").read_text())["run"]
    parts = [r for r in plan if r["file"] == "reproduce/fedips.toml"]
    assert len(parts) > 1 and all(r.get("only") for r in parts)
    names = [v for r in parts for v in r["only"]]
    assert len(names) == len(set(names))
    assert set(names) == set(load_scenario(ROOT / "reproduce" / "fedips.toml").variants)
    out = tool("--plan", "--out", "nowhere", "--only", "fedips-clients")
    assert out.returncode == 0, out.stderr
    assert "--only FedIPS-g1-C100 --only FedIPS-g1-C500" in out.stdout
    assert "--only FedIPS-g1-C62500" in out.stdout and "--only naive" not in out.stdout


@pytest.mark.parametrize(
    "entry, message",
    [
        ('file = "missing.toml"', "run 1: file 'missing.toml' not found"),
        ('file = "s.toml"\nclicks = ["cascade"]', "run 1: clicks must be a list of perfect"),
        ('file = "s.toml"\nwhen = 1', "run 1: unknown key 'when'"),
        ('file = "s.toml"\nset = ["rounds"]', 'run 1: set must be a list of "key=value"'),
        ('file = "s.toml"\n[[run]]\nfile = "s.toml"', "run 's' is planned twice"),
        ('name = "a/b"\nfile = "s.toml"', "run 1: name must name one folder"),
        ('file = "s.toml"\nonly = "plain"', "run 1: only must be a list of variant names"),
        ('file = "s.toml"\nreuse = "s"', "run 1: reuse must be a list of the plan's run names"),
        ('file = "s.toml"\nreuse = ["t"]', "run 's': reuse names 't', not a run of the plan"),
        ('file = "s.toml"\nread_at = ["x"]', 'run 1: read_at must be a list of "NAME=VARIANT@'),
    ],
)
def test_a_bad_plan_is_one_line_and_exit_2(tmp_path, entry, message):
    (tmp_path / "s.toml").write_text(TINY)
    (tmp_path / "plan.toml").write_text(f"[[run]]\n{entry}\n")
    out = tool("--plan-file", "plan.toml", "--plan", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and message in out.stderr, out.stderr


def test_runs_resume_failures_are_reported_and_the_report_holds_every_finished_run(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "broken.toml").write_text(TINY.replace('protocol = "fpdgd"', 'protocol = "x"'))
    (tmp_path / "plan.toml").write_text(
        '[[run]]\nfile = "tiny.toml"\nclicks = ["perfect", "navigational"]\n'
        '[[run]]\nfile = "broken.toml"\n'
    )
    killed = tmp_path / "out" / "tiny-navigational"  # a run killed earlier, partial results
    killed.mkdir(parents=True)
    (killed / "results.json").write_text('{"complete": false, "variants": {}}')
    (tmp_path / "out" / "tiny-navigational.log").write_text("the killed run's output")
    first = tool("--plan-file", "plan.toml", "--out", "out", "--jobs", "2", cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "1 run(s) failed: broken" in first.stdout
    out = tmp_path / "out"
    aside = out / "tiny-navigational.incomplete-1"
    assert (aside / "run.log").read_text() == "the killed run's output"
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["run"], r["exit_code"]) for r in records] == [
        ("tiny-perfect", 0),
        ("tiny-navigational", 0),
        ("broken", 2),
    ]
    assert all(r["wall_s"] > 0 and r["cpu_s"] > 0 for r in records)
    assert "protocol" in (out / "broken.log").read_text()  # the run's own one-line error
    perfect = json.loads((out / "tiny-perfect" / "results.json").read_text())
    navigational = json.loads((out / "tiny-navigational" / "results.json").read_text())
    assert perfect["config"]["dp"]["clicks"]["model"] == "perfect"
    assert navigational["config"]["dp"]["clicks"]["model"] == "navigational"
    report = (out / "REPORT.md").read_text()
    assert "## tiny-perfect" in report and "## tiny-navigational" in report
    assert "## broken" not in report and report.count("| dp |") == 2

    again = tool("--plan-file", "plan.toml", "--out", "out", "--only", "tiny-p", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("done before, skipped") == 1
    assert len((out / "runs.jsonl").read_text().splitlines()) == 3  # nothing ran again
    assert "## tiny-navigational" in (out / "REPORT.md").read_text()  # the whole plan's report

    # a finished run's record of results, for the claims (a dry pass with --set is refused)
    rec = tool(
        "--plan-file",
        "plan.toml",
        "--out",
        "out",
        "--only",
        "tiny-p",
        "--record",
        "rec",
        cwd=tmp_path,
    )
    assert rec.returncode == 0, rec.stdout + rec.stderr
    record = json.loads(gzip.decompress((tmp_path / "rec" / "tiny-perfect.json.gz").read_bytes()))
    assert record["run"] == "tiny-perfect" and record["cost"]["cpu_s"] > 0
    assert len(record["variants"]["dp"]) == 2 and record["settings"]["clicks"]["model"] == "perfect"
    dry = tool("--plan-file", "plan.toml", "--record", "--set", "federation.rounds=2", cwd=tmp_path)
    assert dry.returncode == 2 and "not with --set" in dry.stderr


def test_runs_at_once_go_longest_first_by_the_recorded_cpu_and_each_keeps_its_own_cpu(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    # long enough that its CPU stands clear of the start-up's (~5 s, varying by ~1 s under load)
    long = TINY.replace("rounds = 4", "rounds = 1000").replace("every = 2", "every = 500")
    (tmp_path / "long.toml").write_text(long)
    (tmp_path / "plan.toml").write_text(
        '[[run]]\nfile = "tiny.toml"\nclicks = ["perfect", "navigational"]\n'
        '[[run]]\nfile = "long.toml"\n'
    )
    out = tmp_path / "out"
    out.mkdir()
    # an earlier night's records: the long run took the most CPU, tiny-perfect none recorded
    earlier = [{"run": "long", "cpu_s": 90.0}, {"run": "tiny-navigational", "cpu_s": 3.0}]
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    env = {k: v for k, v in os.environ.items() if k != "FOLTR_ASYNC_THREADS"}
    ran = tool("--plan-file", "plan.toml", "--out", "out", "--runs", "2", cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    started = [line.split()[1].rstrip(":") for line in ran.stdout.splitlines() if "running" in line]
    assert started == ["long", "tiny-navigational", "tiny-perfect"]
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()][2:]
    assert sorted(r["run"] for r in records) == ["long", "tiny-navigational", "tiny-perfect"]
    cpu = {r["run"]: r["cpu_s"] for r in records}
    assert all(r["exit_code"] == 0 and r["wall_s"] > 0 for r in records)
    # each run's own process tree: the 1000-round run costs more than a 4-round one
    assert cpu["long"] > cpu["tiny-perfect"] > 0
    # two runs at once share the cores: each process's kernel gets half of them
    shared = max(1, len(os.sched_getaffinity(0)) // 2)
    for name in cpu:
        result = json.loads((out / name / "results.json").read_text())
        assert result["complete"] is True
        assert result["environment"]["threads"] == shared
    assert all(r["threads"] == shared for r in records)


def test_the_users_thread_count_wins_and_a_bad_one_is_one_line(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "plan.toml").write_text('[[run]]\nfile = "tiny.toml"\n')
    env = {**os.environ, "FOLTR_ASYNC_THREADS": "3"}
    ran = tool("--plan-file", "plan.toml", "--out", "out", "--runs", "2", cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    result = json.loads((tmp_path / "out" / "tiny" / "results.json").read_text())
    assert result["environment"]["threads"] == 3
    env["FOLTR_ASYNC_THREADS"] = "many"
    bad = tool("--plan-file", "plan.toml", "--out", "out2", cwd=tmp_path, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "FOLTR_ASYNC_THREADS" in bad.stderr and not (tmp_path / "out2").exists()


def test_a_run_takes_the_repeats_a_run_it_reuses_made_with_the_same_settings(tmp_path):
    """``reuse``: the second file's plain arm is the first file's, taken with --reuse from the
    run of the same click model; its own arm runs."""
    (tmp_path / "tiny.toml").write_text(TINY)
    other = TINY.replace('name = "tiny"', 'name = "other"').replace(
        "[variants.dp]", "[variants.more]"
    )
    (tmp_path / "other.toml").write_text(other.replace("epsilon = 4.5", "epsilon = 10.0"))
    (tmp_path / "plan.toml").write_text(
        '[[run]]\nfile = "tiny.toml"\nclicks = ["perfect"]\n'
        '[[run]]\nfile = "other.toml"\nclicks = ["perfect"]\nreuse = ["tiny"]\n'
        'read_at = ["early=plain@2"]\n'
    )
    before = tool("--plan-file", "plan.toml", "--out", "out", "--plan", cwd=tmp_path)
    assert "--reuse" not in before.stdout  # nothing to take yet
    done = tool("--plan-file", "plan.toml", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    assert "--reuse out/tiny-perfect" in (out / "runs.jsonl").read_text().splitlines()[1]
    tiny = json.loads((out / "tiny-perfect" / "results.json").read_text())["variants"]
    res = json.loads((out / "other-perfect" / "results.json").read_text())["variants"]
    assert [r["reused"] for r in res["plain"]["repeats"]] == ["out/tiny-perfect:plain"] * 2
    finals = [
        [r["offline"]["ndcg@10"][-1] for r in v["repeats"]] for v in (res["plain"], tiny["plain"])
    ]
    assert finals[0] == finals[1]
    assert all("reused" not in r for r in res["more"]["repeats"])  # another epsilon: run
    tiny_part, other_part = (out / "REPORT.md").read_text().split("## other-perfect")
    assert "| early |" in other_part and "| early |" not in tiny_part  # its plan's read_at
    # results made by other code are not offered to --reuse (which would refuse them)
    first = out / "tiny-perfect" / "results.json"
    assert (
        "--reuse out/tiny-perfect"
        in tool("--plan-file", "plan.toml", "--out", "out", "--plan", cwd=tmp_path).stdout
    )
    first.write_text(
        first.read_text().replace(f'"source": "{code_stamp()["source"]}"', '"source": "0"')
    )
    after = tool("--plan-file", "plan.toml", "--out", "out", "--plan", cwd=tmp_path)
    assert after.returncode == 0 and "--reuse" not in after.stdout


def test_a_check_reruns_one_repeat_per_variant_and_marks_an_equal_stale_record_checked(tmp_path):
    """A record made by other code is stale; --check re-runs its first seed of every variant
    with this code: equal, the record is checked and current; a record whose numbers this code
    does not compute is left stale, with exit 1."""
    from foltr_async.reproduction.records import load_records

    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "plan.toml").write_text('[[run]]\nfile = "tiny.toml"\nclicks = ["perfect"]\n')
    made = tool("--plan-file", "plan.toml", "--out", "out", "--record", "rec", cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    path = tmp_path / "rec" / "tiny-perfect.json.gz"

    def rewrite(edit):
        record = json.loads(gzip.decompress(path.read_bytes()))
        edit(record)
        path.write_bytes(gzip.compress(json.dumps(record).encode()))

    def older_code(record):
        record["files"]["foltr_async/simulation.py"] = "0" * 16

    rewrite(older_code)
    assert load_records(tmp_path / "rec")["tiny-perfect"].stale
    ok = tool("--plan-file", "plan.toml", "--out", "out", "--check", "rec", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "checked, seed 0 of every variant: 2 of the 4 repeats equal" in ok.stdout
    rec = load_records(tmp_path / "rec")["tiny-perfect"]
    assert not rec.stale and rec.checked["how"].endswith("2 of the 4 repeats")
    again = tool("--plan-file", "plan.toml", "--out", "out", "--check", "rec", cwd=tmp_path)
    assert "its record is current, nothing to check" in again.stdout

    def older_code_other_numbers(record):
        record.pop("checked")
        older_code(record)
        record["variants"]["dp"][0]["online"] += 1.0

    rewrite(older_code_other_numbers)
    differs = tool("--plan-file", "plan.toml", "--out", "out", "--check", "rec", cwd=tmp_path)
    assert differs.returncode == 1, differs.stdout + differs.stderr
    assert "dp, seed 0: online differs" in differs.stdout
    assert "--only tiny-perfect --record" in differs.stdout
    assert load_records(tmp_path / "rec")["tiny-perfect"].stale
    refused = tool("--plan-file", "plan.toml", "--check", "--set", "federation.rounds=2")
    assert refused.returncode == 2 and "not with --set" in refused.stderr


def test_ctrl_c_stops_the_runs_going_and_says_how_to_resume(tmp_path):
    """SIGINT to the tool alone (not its process group): the run it started stops too, and the
    tool exits 130 with one line, no traceback."""
    import signal
    import time

    (tmp_path / "long.toml").write_text(TINY.replace("rounds = 4", "rounds = 100000"))
    (tmp_path / "plan.toml").write_text('[[run]]\nfile = "long.toml"\n')
    proc = subprocess.Popen(
        [sys.executable, str(TOOL), "--plan-file", "plan.toml", "--out", "out"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "out" / "long.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and log.stat().st_size > 0):
        time.sleep(0.2)  # the run has started and written its first lines
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out + err
    assert "interrupted: runs stopped (long)" in out and "Traceback" not in out + err
    log_text = log.read_text()  # the run itself was interrupted and kept what it had
    assert log_text.rstrip().endswith("interrupted: results written so far are kept"), log_text
    assert (tmp_path / "out" / "long" / "results.json").exists()

"""Input a run cannot take as asked: every key path is known, odd files get one line, and a run
that measured nothing says so instead of reporting a result."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foltr_async import cli
from foltr_async.benchmarks import cli as bench_cli
from foltr_async.benchmarks.report import Check
from foltr_async.errors import ScenarioError
from foltr_async.experiment import conclusions
from foltr_async.ltr.synthetic import make_dataset_files
from foltr_async.observe.results import compare, summarise_variant
from foltr_async.runtime import traces
from foltr_async.scenario import load
from foltr_async.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parents[1]

BASE = """
[scenario]
name = "input"
[dataset]
n_queries = 40
[federation]
protocol = "fpdgd"
clients = 2
rounds = 2
"""


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def one_line(capsys, argv: list[str], code: int = 2) -> str:
    got = cli.main(argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- 1. every key path is known ----------------------------------------------------------------


def test_a_misspelt_section_in_set_is_refused_with_a_suggestion(tmp_path, capsys):
    path = write(tmp_path, BASE)
    line = one_line(capsys, ["validate", str(path), "--set", "federaton.rounds=3"])
    assert line == (
        "error: --set federaton.rounds=3: federaton: unknown section (did you mean "
        "'federation'?); known: scenario, dataset, ranker, clicks, federation, network, "
        "evaluation, agents, timeline"
    )


def test_a_misspelt_section_in_a_variant_is_refused_naming_the_variant(tmp_path, capsys):
    path = write(tmp_path, BASE + "[variants.a]\nfederaton = { rounds = 3 }\n[variants.b]\n")
    line = one_line(capsys, ["validate", str(path)])
    assert line.startswith(
        f"error: {path} [variant a]: federaton: unknown section (did you mean 'federation'?)"
    )


def test_a_grid_over_a_misspelt_key_is_refused_not_run_as_identical_variants(tmp_path, capsys):
    text = BASE + '[[grid]]\nname = "c{clients}"\nproduct = { federaton.clients = [2, 3] }\n'
    line = one_line(capsys, ["validate", str(write(tmp_path, text))])
    assert "[variant c2]: federaton: unknown section (did you mean 'federation'?)" in line


@pytest.mark.parametrize("nested", ["variants.b", "grid"])
def test_variants_and_grids_belong_to_the_top_level_only(tmp_path, capsys, nested):
    path = write(tmp_path, BASE + f"[variants.a.{nested}]\n")
    line = one_line(capsys, ["validate", str(path)])
    assert line.startswith(f"error: {path} [variant a]: {nested.split('.')[0]}: unknown section")


def test_a_misspelt_network_key_gets_a_suggestion(tmp_path, capsys):
    path = write(tmp_path, BASE + "[network]\nlatncy = 0.1\n")
    line = one_line(capsys, ["validate", str(path)])
    assert "network.latncy: " in line and "(did you mean 'latency'?)" in line


@pytest.mark.parametrize("key", ["seed = 5", "repeats = 3", 'reference = "a"', 'name = "other"'])
def test_a_scenario_wide_value_cannot_differ_between_variants(tmp_path, key):
    # only the first variant's value was used: the second ran with another seed than it said
    text = BASE + f"[variants.a]\n[variants.b]\nscenario.{key}\n"
    with pytest.raises(ScenarioError, match=r"scenario\.\w+: expected one value for every"):
        load_scenario(write(tmp_path, text))


# --- 2. one line instead of a traceback ----------------------------------------------------------


def test_a_scenario_name_too_long_for_a_folder_is_refused(tmp_path, capsys):
    path = write(tmp_path, BASE.replace('name = "input"', f'name = "{"x" * 300}"'))
    line = one_line(capsys, ["validate", str(path)])
    assert line.startswith(f"error: {path}: scenario.name: expected a name for one folder")
    assert "at most 255 bytes" in line


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5000 + "]" * 5000,
        "a = " + "{x=" * 5000 + "1" + "}" * 5000,
        "[variants.a]\nfederation.params" + ".a" * 3000 + " = 1\n",  # parses, nests 3000 deep
    ],
    ids=["arrays", "inline-tables", "dotted-key"],
)
def test_deep_nesting_is_one_line(tmp_path, capsys, text):
    path = write(tmp_path, text + BASE)
    line = one_line(capsys, ["validate", str(path)])
    assert line.startswith(f"error: {path}: ") and "nested deeper than" in line


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "short.csv",
            "client_id,computation,communication\n0,1,2\n1,3\n",
            "line 3: expected 3 fields (client_id,computation,communication), got 2",
        ),
        (
            "big.json",
            '{"format": "flgo", "clients": {"0": {"prob_available": 0.5, '
            '"prob_unavailable": 0.5, "latency": 1' + "0" * 400 + "}}}",
            "client 0: latency: expected a number >= 0.0, got an integer beyond the float range",
        ),
        (
            "deep.json",
            '{"format": "flgo", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "invalid JSON: nested too deeply",
        ),
    ],
    ids=["csv-short-row", "json-10**400", "json-deep"],
)
def test_a_bad_trace_is_one_line(tmp_path, capsys, name, text, message):
    write(tmp_path, text, name)
    path = write(tmp_path, BASE + f'[network]\ntrace = "{name}"\n')
    line = one_line(capsys, ["validate", str(path)])
    assert line == f"error: {path}: network.trace: {tmp_path / name}: {message}"


def test_out_naming_a_file_is_refused(tmp_path, capsys):
    path = write(tmp_path, BASE)
    target = write(tmp_path, "mine\n", "notes.txt")
    line = one_line(capsys, [str(path), "--out", str(target), "--quiet"])
    assert line == f"error: --out {target}: not a folder"
    assert target.read_text() == "mine\n"


def test_out_naming_a_foreign_non_empty_folder_is_refused_and_left_alone(tmp_path, capsys):
    path = write(tmp_path, BASE)
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "thesis.tex").write_text("x")
    (folder / "data").mkdir()
    line = one_line(capsys, [str(path), "--out", str(folder), "--quiet"])
    assert line == (
        f"error: --out {folder}: not empty and not a run's results folder (holds data, "
        "thesis.tex); nothing was written. Give a new or empty folder"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["data", "thesis.tex"]


def test_merge_refuses_a_foreign_non_empty_folder_too(tmp_path, capsys):
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "thesis.tex").write_text("x")
    line = one_line(capsys, ["merge", str(tmp_path / "run"), "--out", str(folder)])
    assert line.startswith(f"error: --out {folder}: not empty and not a run's results folder")


def _fifo(tmp_path: Path, name: str) -> Path:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    return fifo


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A separate process: a hang or a runaway read cannot take the test run with it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "foltr_async", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_scenario_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, kind):
    path = {
        "fifo": lambda: _fifo(tmp_path, "s.toml"),
        "dev-zero": lambda: Path("/dev/zero"),
        "directory": lambda: tmp_path,
    }[kind]()
    if not path.exists():
        pytest.skip(f"{path} does not exist here")
    done = _cli("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr == f"error: {path}: not a regular file\n"


def test_a_scenario_above_the_size_limit_is_refused(tmp_path, capsys):
    path = write(tmp_path, BASE + "# padding\n" * (load.MAX_SCENARIO_BYTES // 10))
    line = one_line(capsys, ["validate", str(path)])
    assert line == f"error: {path}: larger than the 4 MB limit of a scenario file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_trace_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, kind):
    trace = _fifo(tmp_path, "t.json") if kind == "fifo" else Path("/dev/zero")
    if not trace.exists():
        pytest.skip(f"{trace} does not exist here")
    path = write(tmp_path, BASE + f'[network]\ntrace = "{trace}"\n')
    done = _cli("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr == f"error: {path}: network.trace: {trace}: not a regular file\n"


def test_a_trace_above_the_size_limit_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 2**20)  # the real limit is 256 MB
    write(tmp_path, '{"format": "flgo", "clients": {}}' + " " * 2**20, "t.json")
    path = write(tmp_path, BASE + '[network]\ntrace = "t.json"\n')
    line = one_line(capsys, ["validate", str(path)])
    trace = tmp_path / "t.json"
    assert (
        line == f"error: {path}: network.trace: {trace}: larger than the 1 MB limit of a trace file"
    )


# --- 3. a run that measured nothing says so ------------------------------------------------------


def _no_relevant_test_split(tmp_path: Path) -> Path:
    """A LETOR fold whose test split has no relevant document: nDCG is undefined on it."""
    folder = tmp_path / "fold"
    make_dataset_files("mq2007-like", folder, seed=0, n_queries=60)
    test = folder / "test.txt"
    test.write_text("".join("0" + line[line.index(" ") :] for line in test.open()))
    return folder


def test_a_run_whose_test_split_has_no_relevant_document_measured_nothing(tmp_path, capsys):
    fold = _no_relevant_test_split(tmp_path)
    path = write(
        tmp_path,
        BASE.replace("n_queries = 40", f'path = "{fold.as_posix()}"')
        + "[variants.v]\n[variants.w]\nfederation.clients = 1\n",
    )
    out = tmp_path / "out"
    code = cli.main([str(path), "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 3, captured.err
    assert "Highest" not in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        "error: nothing was measured in v, w: no held-out query has a relevant document, so "
        f"ndcg@10 is undefined (results kept in {out})"
    )
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] is True and res["nothing_measured"] == {"v": 1, "w": 1}
    assert res["variants"]["v"]["repeats"][0]["judged_queries"] == 0
    assert res["variants"]["v"]["summary"]["final"]["ndcg@10"]["n"] == 0
    assert res["conclusions"][0].startswith("Nothing was measured in v: in 1 of 1 repeats")
    assert not any("Highest" in c for c in res["conclusions"])
    md = (out / "summary.md").read_text()
    assert "run finished, but nothing was measured in v (1 of 1 repeats), w (1 of 1" in md
    assert "| v | **not measured** |" in md
    assert {p.name for p in out.iterdir()} >= {"results.json", "summary.md", "curves.csv"}


def test_a_run_with_relevant_test_documents_records_how_many_queries_it_measured(tmp_path):
    from foltr_async.experiment import run_scenario
    from foltr_async.observe.observer import Observer

    res = run_scenario(load_scenario(write(tmp_path, BASE)), tmp_path / "out", Observer())
    (rep,) = res["variants"]["default"]["repeats"]
    assert rep["judged_queries"] > 0 and res["nothing_measured"] == {}


# --- 4. smaller --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "kind"),
    [
        ('federation.protocol = "nope"', "protocol"),
        ('federation.aggregator = "nope"', "aggregator"),
        ('agents = [{ behaviour = "nope" }]', "behaviour"),
    ],
)
def test_an_unknown_name_points_at_plugins_and_the_list(tmp_path, capsys, setting, kind):
    path = write(tmp_path, BASE + "[variants.v]\n" + setting + "\n")
    line = one_line(capsys, ["validate", str(path)])
    assert f"unknown {kind} 'nope'" in line
    assert "FOLTR_ASYNC_PLUGINS" in line and "python -m foltr_async list" in line


def _fold_results(folds: list[int], n: int) -> dict:
    """``n`` repeats of variants a and b (b better), on ``folds`` (none: plain seeds)."""
    reps = {
        name: [
            {"seed": s, "rounds": [10], "offline": {"ndcg@10": [0.5 + shift * (1 + s % 3)]}}
            for s in range(n)
        ]
        for name, shift in (("a", 0.0), ("b", 0.05))
    }
    return {
        "reference": "a",
        "config": {name: {"dataset": {"folds": folds}} for name in reps},
        "variants": {
            k: {"repeats": r, "summary": summarise_variant(r, "ndcg@10")} for k, r in reps.items()
        },
        "comparisons": compare(reps, "a", "ndcg@10"),
    }


def test_conclusions_count_fold_seed_runs_not_seeds():
    line = next(s for s in conclusions(_fold_results([1, 2, 3], 6)) if s.startswith("b vs a"))
    assert "paired t-test over 6 runs (3 folds x 2 seeds)" in line
    line = next(s for s in conclusions(_fold_results([], 6)) if s.startswith("b vs a"))
    assert "paired t-test over 6 seeds" in line


def test_bench_check_fails_when_a_target_is_missed_and_says_what_a_target_is(capsys, monkeypatch):
    impossible = Check("secagg", "max_rel_error", "<", 0.0, "an error below zero")
    monkeypatch.setattr(bench_cli, "TARGETS", (impossible,))
    argv = ["--quick", "--scale", "0.01", "--suite", "secagg"]
    assert bench_cli.main(argv) == 0  # a missed target is reported, not an error
    out = capsys.readouterr().out
    assert "FAIL" in out and "target: " in out
    assert bench_cli.main([*argv, "--check"]) == 1
    err = capsys.readouterr().err
    assert "error: --check: 1 target missed: secagg.max_rel_error" in err

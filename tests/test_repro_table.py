"""tools/repro_table.py: one run's table, and several runs of one file side by side (one
column of paired differences per run, each against its own reference)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foltr_async.cli import main
from tests.test_parallel import SCENARIO

TOOL = Path(__file__).resolve().parents[1] / "tools" / "repro_table.py"


def table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The same scenario once per click model, as the reproduction plan runs it."""
    root = tmp_path_factory.mktemp("table")
    scenario = root / "s.toml"
    scenario.write_text(SCENARIO)
    for model in ("perfect", "informational"):
        argv = [str(scenario), "--out", str(root / model), "--quiet"]
        assert main([*argv, "--set", f"clicks.model={model}"]) == 0
    return root


def test_one_run_gives_its_table(runs):
    out = table(str(runs / "perfect"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("| variant | nDCG@10 |") and "| reference |" in out.stdout
    # the last two columns: Holm and Bonferroni over the run's comparisons, as results.json
    # records them (Bonferroni: the published studies' correction, m x p)
    res = json.loads((runs / "perfect" / "results.json").read_text())
    m = sum(1 for c in res["comparisons"] if c["p_value"] is not None)
    lines = out.stdout.splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines}
    assert rows["variant"][-2:] == ["Holm p", "Bonferroni p |"]
    for c in res["comparisons"]:
        assert c["p_bonferroni"] == min(1.0, m * c["p_value"])
        assert rows[c["variant"]][-1].rstrip(" |") == f"{c['p_bonferroni']:.2g}"


def test_runs_side_by_side_give_each_difference_against_its_own_reference(runs):
    out = table(str(runs / "perfect"), str(runs / "informational" / "results.json"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "| variant | perfect: Δ (Holm p) | informational: Δ (Holm p) |"
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines[2:]}
    for col, model in enumerate(("perfect", "informational")):
        res = json.loads((runs / model / "results.json").read_text())
        ref = res["reference"]
        level = res["variants"][ref]["summary"]["final"]["ndcg@10"]["mean"]
        assert rows[ref][col].rstrip(" |") == f"reference {level:.4f}"
        for c in res["comparisons"]:
            cell = rows[c["variant"]][col].rstrip(" |")
            assert cell == f"{c['diff_mean']:+.4f} ({c['p_holm']:.2g})"
    assert len(rows) == len(res["variants"])


def test_a_missing_run_is_one_line_and_a_non_zero_exit(runs):
    out = table(str(runs / "perfect"), str(runs / "nowhere"))
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "nowhere" in out.stderr


def test_power_gives_each_comparison_its_spread_and_detectable_difference(runs):
    from foltr_async.observe.results import paired_finals
    from foltr_async.observe.stats import detectable_difference

    out = table(str(runs / "perfect"), "--power")
    assert out.returncode == 0, out.stderr
    res = json.loads((runs / "perfect" / "results.json").read_text())
    m = sum(1 for c in res["comparisons"] if c["p_value"] is not None)
    lines = out.stdout.splitlines()
    assert lines[0].endswith(f"| detectable Δ (α 0.05) | detectable Δ (α 0.05/{m}) |")
    rows = {
        line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in lines[2:]
    }
    assert set(rows) == {c["variant"] for c in res["comparisons"]}
    ref = res["variants"][res["reference"]]["repeats"]
    for c in res["comparisons"]:
        mine, theirs = paired_finals(res["variants"][c["variant"]]["repeats"], ref, "ndcg@10")
        d = np.subtract(mine, theirs)
        n, mean, sd = rows[c["variant"]][0], rows[c["variant"]][1], rows[c["variant"]][2]
        assert int(n) == c["n"] == d.size and mean == f"{c['diff_mean']:+.4f}"
        assert sd == f"{d.std(ddof=1):.4f}"
        assert rows[c["variant"]][3] == f"{detectable_difference(d.std(ddof=1), d.size):.4f}"


def _rows(*args: str) -> dict[str, list[str]]:
    """A table's cells by row name (the first cell)."""
    out = table(*args)
    assert out.returncode == 0, out.stderr
    return {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in out.stdout.splitlines()
    }


def test_an_arm_read_at_a_round_of_a_longer_one_equals_that_arm_run(tmp_path):
    """``--read-at`` reads an arm that is another's first rounds at that round: the row equals
    the arm run on its own (levels, difference, p); ``--at-round`` reads every arm so; bad
    specs are one line."""
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO + "[variants.short]\nfederation = { rounds = 3 }\n")
    assert main([str(scenario), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    run = str(tmp_path / "run")
    rows = _rows(run, "--read-at", "read=fedavg@3")
    short, read = rows["short"], rows["read"]
    assert read[:3] == short[:3] and short[2] != "–"  # nDCG@10, MaxRR@10, online through round 3
    assert read[3:5] == short[3:5] and short[4] != "–"  # n, Δ
    assert read[5] == short[5]  # raw p; Holm and Bonferroni count one more comparison
    assert len(rows) == 2 + 5  # header, rule, the run's four variants and the read one
    # every arm at one round: the longer arm at round 3 is the 3-round arm's final
    at3 = _rows(run, "--at-round", "3")
    assert at3["fedavg"][:2] == short[:2] and at3["short"][:2] == short[:2]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    short_reps = res["variants"]["short"]["repeats"]
    shorts = {r["seed"]: r["online"]["ndcg@10_discounted"] for r in short_reps}
    for rep in res["variants"]["fedavg"]["repeats"]:  # the running online metric ends at the total
        assert rep["online_at"][-1] == rep["online"]["ndcg@10_discounted"] > rep["online_at"][0]
        assert rep["online_at"][rep["rounds"].index(3)] == shorts[rep["seed"]]  # to the last bit
    legacy = tmp_path / "legacy"  # results made before online_at: the read row's online is "–"
    legacy.mkdir()
    for rep in (r for v in res["variants"].values() for r in v["repeats"]):
        del rep["online_at"]
    (legacy / "results.json").write_text(json.dumps(res))
    assert _rows(str(legacy), "--read-at", "read=fedavg@3")["read"][2] == "–"
    at6 = _rows(run, "--at-round", "6")  # the 3-round arm was not evaluated there: left out
    assert "short" not in at6 and at6["attacked-median"][:2] == rows["attacked-median"][:2]
    for option, spec, says in (
        ("--read-at", "read=fedavg", "expected NAME=VARIANT@ROUND"),
        ("--read-at", "read=nope@3", "no variant 'nope'"),
        ("--read-at", "read=fedavg@4", "has no evaluation at round 4"),
        ("--at-round", "4", "no variant was evaluated at round 4"),
    ):
        bad = table(run, option, spec)
        assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and says in bad.stderr

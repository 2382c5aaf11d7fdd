"""A scenario run in parts (--only) and merged gives the whole run's results, paired tests and
Holm; parts that cannot be paired are refused in one line, with nothing written."""

import json
from pathlib import Path

import pytest

from foltr_async.cli import main
from foltr_async.provenance import code_stamp
from tests.test_parallel import SCENARIO as PARALLEL_SCENARIO
from tests.test_parallel import _without_wall_time

SCENARIO = PARALLEL_SCENARIO.replace('name = "par"', 'name = "parts"')


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The whole run, and the same scenario in two parts: one with the reference, one without."""
    root = tmp_path_factory.mktemp("merge")
    scenario = root / "parts.toml"
    scenario.write_text(SCENARIO)
    for name, only in (
        ("whole", []),
        ("a", ["fedavg", "attacked-fedavg"]),
        ("b", ["attacked-median"]),
        ("overlap", ["fedavg", "attacked-median"]),
        ("seed5", ["attacked-median"]),
        ("three", []),  # seeds 4-6, on data drawn from seed 4 (dataset.seed)
        ("two", []),  # seeds 4-5, the same data
        ("later", []),  # seeds 5-6, the same data
    ):
        extra = [a for v in only for a in ("--only", v)]
        extra += ["--seed", "5"] if name in ("seed5", "later") else []
        extra += ["--set", "scenario.repeats=3"] if name == "three" else []
        extra += ["--set", "dataset.seed=4"] if name in ("three", "two", "later") else []
        argv = [str(scenario), "--out", str(root / name), "--quiet", *extra]
        assert main(argv) == 0
    return root


def _read(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


def _write(path: Path, res: dict) -> Path:
    """A run folder holding ``res`` (a part edited by the test)."""
    path.mkdir(exist_ok=True)
    (path / "results.json").write_text(json.dumps(res))
    return path


def test_parts_merge_into_the_whole_run(runs, capsys):
    out = runs / "merged"
    assert (
        main(["merge", str(runs / "a"), str(runs / "b"), str(runs / "overlap"), "--out", str(out)])
        == 0
    )
    assert "3 variants, 6 repeats" in capsys.readouterr().out
    merged, whole = _read(out), _read(runs / "whole")
    assert merged["complete"] and list(merged["variants"]) == list(whole["variants"])
    assert _without_wall_time(merged["variants"]) == _without_wall_time(whole["variants"])
    # part b alone has no reference; merged, its variant is tested and Holm counts all three
    assert _read(runs / "b")["comparisons"] == []
    assert merged["comparisons"] == whole["comparisons"] and len(merged["comparisons"]) == 2
    assert merged["conclusions"] == whole["conclusions"]
    assert (out / "curves.png").exists()


def test_a_part_run_with_later_seeds_adds_them(runs, tmp_path, capsys):
    """Seeds 4-5 and a part from seed 5 (seeds 5-6; seed 5 in both, checked) merge into the
    run of seeds 4-6: the same repeats, tests and conclusions."""
    out = tmp_path / "merged"
    assert main(["merge", str(runs / "later"), str(runs / "two"), "--out", str(out)]) == 0
    merged, three = _read(out), _read(runs / "three")
    assert merged["complete"] and merged["seed"] == 4
    assert _without_wall_time(merged["variants"]) == _without_wall_time(three["variants"])
    assert merged["comparisons"] == three["comparisons"] and merged["config"] == three["config"]
    assert "3 variants, 9 repeats (seeds 4-6)" in capsys.readouterr().out


def test_later_seeds_on_other_folds_are_refused(runs, tmp_path, capsys):
    """With folds, a later-seeded part's repeat must have run on the fold its number in the
    merged run gives it; seeds 5-6 after one seed (4) with two folds would not."""
    parts = {}
    for name in ("two", "later"):
        res = _read(runs / name)
        for variant, entry in res["variants"].items():
            res["config"][variant]["dataset"]["folds"] = [1, 2]
            for rep in entry["repeats"]:
                rep["fold"] = 1 + rep["repeat"] % 2
        if name == "two":
            for entry in res["variants"].values():
                entry["repeats"] = entry["repeats"][:1]  # seed 4 only
            res["planned"]["repeats"] = 1
        parts[name] = _write(tmp_path / name, res)
    out = tmp_path / "merged"
    argv = ["merge", str(parts["later"]), str(parts["two"]), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "seed 5: ran on fold 1, but as repeat 1 of the merged run it would be on fold 2" in err
    assert not out.exists()


def test_parts_of_other_runs_are_refused_with_nothing_written(runs, capsys, tmp_path):
    out = tmp_path / "merged"
    # other seeds on data drawn from the scenario seed: other data
    assert main(["merge", str(runs / "a"), str(runs / "seed5"), "--out", str(out)]) == 2
    assert "draws its data from the scenario seed (4; the parts have seeds [4, 5])" in (
        capsys.readouterr().err
    )
    # the same variant with another result: another version of the code or data
    res = _read(runs / "overlap")
    res["variants"]["fedavg"]["repeats"][1]["offline"]["ndcg@10"][-1] += 0.01
    tampered = _write(tmp_path / "tampered", res)
    assert main(["merge", str(runs / "a"), str(tampered), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "variant fedavg repeat 1 (seed 5): final ndcg@10" in err and "cannot be paired" in err
    # the same variant with other settings
    res = _read(runs / "overlap")
    res["config"]["fedavg"]["federation"]["rounds"] = 7
    _write(tampered, res)
    assert main(["merge", str(runs / "a"), str(tampered), "--out", str(out)]) == 2
    assert "(federation.rounds: 6 vs 7)" in capsys.readouterr().err
    assert not out.exists()


def test_bad_inputs_and_a_used_out_folder_are_one_line_errors(runs, capsys, tmp_path):
    assert (
        main(["merge", str(runs / "a"), str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    )
    assert "nope: no such run folder or results.json" in capsys.readouterr().err
    assert main(["merge", str(runs / "a"), str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "results.json: not a readable results.json" in capsys.readouterr().err
    assert main(["merge", str(runs / "a"), "--out", str(tmp_path / "o")]) == 2
    assert "at least two run folders" in capsys.readouterr().err
    assert main(["merge", str(runs / "a"), str(runs / "b"), "--out", str(runs / "a")]) == 2
    assert "already holds a run's results" in capsys.readouterr().err


def test_a_lost_repeat_run_again_makes_the_merge_complete(runs, tmp_path, capsys):
    """A --jobs run lost a repeat (its process died twice): the variant run again with --only
    fills it in; without that part the merge stays incomplete."""
    res = _read(runs / "whole")
    res["variants"]["attacked-median"]["repeats"].pop()
    res["complete"] = False
    part = _write(tmp_path / "part", res)
    assert main(["merge", str(part), str(runs / "a"), "--out", str(tmp_path / "m1")]) == 0
    assert _read(tmp_path / "m1")["complete"] is False
    assert "not complete: some planned repeats are in no part" in capsys.readouterr().out
    assert main(["merge", str(part), str(runs / "b"), "--out", str(tmp_path / "m2")]) == 0
    merged = _read(tmp_path / "m2")
    assert merged["complete"] is True
    assert merged["comparisons"] == _read(runs / "whole")["comparisons"]


def test_a_run_merged_with_itself_is_its_own_results_json(runs, tmp_path):
    whole = runs / "whole"
    assert main(["merge", str(whole), str(whole), "--out", str(tmp_path / "m")]) == 0
    assert _read(tmp_path / "m") == _read(whole)


def test_parts_run_with_other_thread_counts_merge_and_keep_each_environment(runs, tmp_path, capsys):
    """The kernel's thread count does not change results, so a part run on another machine or
    with --threads pairs; results.json keeps each part's record. Any other disagreement on a
    run-level key is still refused."""
    res = _read(runs / "b")
    env = {**res["environment"], "threads": res["environment"]["threads"] + 7}
    res["environment"] = env
    part = _write(tmp_path / "b-threads", res)
    assert main(["merge", str(runs / "a"), str(part), "--out", str(tmp_path / "m")]) == 0
    merged = _read(tmp_path / "m")
    assert merged["environment"] == [_read(runs / "a")["environment"], env]
    assert merged["comparisons"] == _read(runs / "whole")["comparisons"]
    a = _write(tmp_path / "a-noted", {**_read(runs / "a"), "note": "one"})
    _write(part, {**res, "note": "another"})
    assert main(["merge", str(a), str(part), "--out", str(tmp_path / "m2")]) == 2
    assert "disagree on 'note'" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists()


# the whole run's base settings, under another name, with other variant names
OTHER = PARALLEL_SCENARIO.split("[variants.fedavg]")[0].replace('name = "par"', 'name = "other"')
OTHER = (
    OTHER.replace('reference = "fedavg"', 'reference = "plain"')
    + """
[variants.plain]
[variants.robust]
agents = [{ behaviour = "scaled_reversal", count = 1 }]
federation = { aggregator = "median" }
[variants.shorter]
federation = { rounds = 5 }
"""
)


def _run_other(root: Path, name: str, *extra: str) -> dict:
    scenario = root / "other.toml"
    scenario.write_text(OTHER)
    assert main([str(scenario), "--out", str(root / name), "--quiet", *extra]) == 0
    return _read(root / name)


def _not_reused(variants: dict) -> dict:
    """``variants`` without wall times and the ``reused`` marks (a copy)."""
    return _without_wall_time(
        {
            name: {
                **e,
                "repeats": [{k: v for k, v in r.items() if k != "reused"} for r in e["repeats"]],
            }
            for name, e in variants.items()
        }
    )


def test_another_scenarios_repeats_with_the_same_settings_and_seed_are_reused(runs, tmp_path):
    """--reuse takes another scenario's repeats under other variant names when settings and
    seed agree, and they are what this scenario computes itself; the rest runs."""
    fresh = _run_other(tmp_path, "fresh")
    reused = _run_other(tmp_path, "reused", "--reuse", str(runs / "whole"))
    whole = _read(runs / "whole")["variants"]
    v = reused["variants"]
    for name, source in (("plain", "fedavg"), ("robust", "attacked-median")):
        assert [rep["reused"] for rep in v[name]["repeats"]] == [f"{runs / 'whole'}:{source}"] * 2
        assert _not_reused({name: v[name]}) == _without_wall_time({name: whole[source]})
    assert all("reused" not in rep for rep in v["shorter"]["repeats"])  # other rounds: run
    assert _not_reused(v) == _without_wall_time(fresh["variants"])
    assert reused["comparisons"] == fresh["comparisons"]
    # another scenario seed on data drawn from it: other data, every repeat runs
    other_seed = _run_other(tmp_path, "seed5", "--reuse", str(runs / "whole"), "--seed", "5")
    assert all("reused" not in r for e in other_seed["variants"].values() for r in e["repeats"])


def test_a_run_of_later_seeds_takes_them_from_a_longer_run(runs, tmp_path):
    """Seeds 5-6 (data fixed by dataset.seed) are repeats 1-2 of the run of seeds 4-6: taken,
    renumbered, and equal to what the run computes itself."""
    later = ["--seed", "5", "--set", "dataset.seed=4"]
    fresh = _run_other(tmp_path, "fresh", *later)
    reused = _run_other(tmp_path, "reused", *later, "--reuse", str(runs / "three"))
    v = reused["variants"]
    assert [r["reused"] for r in v["plain"]["repeats"]] == [f"{runs / 'three'}:fedavg"] * 2
    assert [r["repeat"] for r in v["plain"]["repeats"]] == [0, 1]
    assert _not_reused(v) == _without_wall_time(fresh["variants"])
    assert reused["comparisons"] == fresh["comparisons"]


def test_reusing_what_is_not_a_run_is_one_line(runs, tmp_path, capsys):
    scenario = tmp_path / "other.toml"
    scenario.write_text(OTHER)
    argv = [str(scenario), "--out", str(tmp_path / "o"), "--quiet", "--reuse", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable results.json" in err[0]


def test_results_made_by_other_code_are_neither_reused_nor_merged(runs, tmp_path, capsys):
    """Each results.json names the code that made it; a run or part made by other code is
    refused in one line, one made before the stamp existed is taken on trust."""
    whole = _read(runs / "whole")
    assert whole["code"] == code_stamp() and len(whole["code"]["source"]) == 16
    code = f"Code: foltr_async {whole['code']['version']} (source {whole['code']['source']}"
    assert code in (runs / "whole" / "summary.md").read_text()
    other = json.loads(json.dumps(whole))
    other["code"]["source"] = "0" * 16
    older = {k: v for k, v in whole.items() if k != "code"}
    scenario = tmp_path / "other.toml"
    scenario.write_text(OTHER)
    argv = [str(scenario), "--out", str(tmp_path / "o"), "--quiet"]
    assert main([*argv, "--reuse", str(_write(tmp_path / "other", other))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "made by other code (source 0000000000000000" in err[0]
    assert not (tmp_path / "o").exists()  # refused before the output folder is made
    assert main([*argv, "--reuse", str(_write(tmp_path / "older", older))]) == 0
    reused = _read(tmp_path / "o")["variants"]["plain"]["repeats"]
    assert [r["reused"] for r in reused] == [f"{tmp_path / 'older'}:fedavg"] * 2
    out = tmp_path / "merged"
    assert main(["merge", str(runs / "a"), str(tmp_path / "other"), "--out", str(out)]) == 2
    assert "made by other code than" in capsys.readouterr().err and not out.exists()
    # a part without a stamp merges, and the merge does not claim the code it cannot know
    assert main(["merge", str(runs / "a"), str(tmp_path / "older"), "--out", str(out)]) == 0
    assert "code" not in _read(out)
    assert main(["merge", str(runs / "a"), str(runs / "b"), "--out", str(tmp_path / "m")]) == 0
    assert _read(tmp_path / "m")["code"] == whole["code"]


@pytest.mark.parametrize("name", ["x | injected | row", "../../up", "a\nb"])
def test_a_part_whose_variant_name_would_break_the_summary_is_refused(runs, tmp_path, capsys, name):
    res = _read(runs / "b")
    res["variants"][name] = res["variants"].pop("attacked-median")
    part = _write(tmp_path / "forged", res)
    assert main(["merge", str(runs / "a"), str(part), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"variant {name!r}: expected a variant name" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()

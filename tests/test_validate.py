"""``validate``: every shipped scenario checked in seconds without building anything, each file
answered on its own line (a scenario whose data must be made first does not stop the others),
``--build`` for what only building shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from foltr_async import simulation
from foltr_async.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "scenarios").glob("*.toml"))


@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validate built a variant")

    monkeypatch.setattr(simulation.Simulation, "build", refuse)


def test_every_shipped_scenario_validates_without_building(nothing_built, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    shipped = [p for p in SHIPPED if p.name != "aol_replay.toml"]  # its data is made first
    assert main(["validate", *map(str, shipped)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ok (")[0] for line in out] == list(map(str, shipped))


def test_a_scenario_whose_data_is_missing_does_not_stop_the_others(
    nothing_built, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a fresh clone: data/aol-sample not made yet
    aol, batch = ROOT / "scenarios" / "aol_replay.toml", ROOT / "scenarios" / "fpdgd_batch.toml"
    assert main(["validate", str(aol), str(batch)]) == 2
    cap = capsys.readouterr()
    assert cap.out.startswith(f"{batch}: ok (3 variants")
    err = cap.err.splitlines()
    assert len(err) == 2, cap.err
    assert err[0].startswith(f"error: {aol} [variant ") and "data/aol-sample" in err[0]
    assert "tools/make_aol_sample.py" in err[0] and str(tmp_path) in err[0]
    assert err[1] == "1 of 2 scenario files failed"


def test_a_data_file_of_another_format_fails_from_its_first_line(nothing_built, tmp_path, capsys):
    (tmp_path / "train.txt").write_text("query,doc,label\nq1,d1,1\n")
    (tmp_path / "test.txt").write_text("0 qid:1 1:0.5\n")
    scenario = tmp_path / "csv.toml"
    scenario.write_text(
        f'[dataset]\npath = "{(tmp_path / "train.txt").as_posix()}"\n'
        '[federation]\nprotocol = "fpdgd"\nclients = 2\nrounds = 1\n'
    )
    assert main(["validate", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {scenario}: dataset.path: {tmp_path / 'train.txt'}:1: ")


def test_build_checks_what_only_the_data_shows(tmp_path, capsys):
    scenario = tmp_path / "many.toml"
    scenario.write_text(
        '[dataset]\nprofile = "mq2007-like"\nn_queries = 20\n'
        '[federation]\nprotocol = "fpdgd"\nclients = 500\nrounds = 1\n'
    )
    assert main(["validate", str(scenario)]) == 0  # keys and types are fine
    capsys.readouterr()
    assert main(["validate", "--build", str(scenario)]) == 2
    assert "clients" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("file", "sets", "says"),
    [  # a protocol's own cross-key rules (``ProtocolRun.check``), one per protocol that has any
        ("unlearn_strategies.toml", ["federation.params.dp=true"], "'retrain' with dp = true"),
        ("csfltr.toml", ["federation.clients=1"], "cross-silo modes need at least 2 parties"),
        (
            "fpdgd_vs_foltres.toml",
            ["federation.params.p=0.5", "federation.params.metric=dcg"],
            "metric 'maxrr'",
        ),
        ("async_fpdgd.toml", ["federation.params.rho=100"], "expected lr * rho < 2"),
        ("fpdgd_vs_foltres.toml", ['network.flgo.completeness="PDU"'], "expected 'IDL'"),
    ],
)
def test_a_protocols_cross_key_rules_are_checked_without_building(
    nothing_built, file, sets, says, capsys
):
    """Each rule refuses in one line; ``--only`` picks the variants an override fits."""
    only = {"fpdgd_vs_foltres.toml": "FOLtR-ES-p0.25", "async_fpdgd.toml": "fedasync"}
    args = [x for s in sets for x in ("--set", s)]
    if file in only and "flgo" not in sets[0]:
        args += ["--only", only[file]]
    assert main(["validate", str(ROOT / "scenarios" / file), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_only_checks_the_variants_it_names(nothing_built, capsys):
    async_fpdgd = str(ROOT / "scenarios" / "async_fpdgd.toml")
    assert main(["validate", async_fpdgd, "--set", "federation.params.rho=0.5"]) == 2  # sync
    capsys.readouterr()
    assert (
        main(["validate", async_fpdgd, "--set", "federation.params.rho=0.5", "--only", "fedasync"])
        == 0
    )
    assert capsys.readouterr().out.startswith(f"{async_fpdgd}: ok (1 variant x ")

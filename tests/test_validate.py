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


AUDIT = ["privacy_audit.toml", "--only"]


@pytest.mark.parametrize(
    ("args", "says"),
    [  # a protocol's own rules across keys (``ProtocolRun.check``), one per protocol with any,
        # and an agent group's (``BehaviourEntry.check``): the privacy audit's
        (["unlearn_strategies.toml", "--set", "federation.params.dp=true"], "'retrain' with dp"),
        (["csfltr.toml", "--set", "federation.clients=1"], "cross-silo modes need at least 2"),
        (
            ["fpdgd_vs_foltres.toml", "--only", "FOLtR-ES-p0.25"]
            + ["--set", "federation.params.p=0.5", "--set", "federation.params.metric=dcg"],
            "metric 'maxrr'",
        ),
        (
            ["async_fpdgd.toml", "--only", "fedasync", "--set", "federation.params.rho=100"],
            "expected lr * rho < 2",
        ),
        (["fpdgd_vs_foltres.toml", "--set", 'network.flgo.completeness="PDU"'], "expected 'IDL'"),
        (
            [*AUDIT, "FPDGD-dp-4.5-5", "--set", "federation.params.dp=false"],
            "agents: canary: expected federation.params.dp = true",
        ),
        (
            [*AUDIT, "FPDGD-dp-4.5-5", "--set", 'federation.aggregator="median"'],
            "the FPDGD audit expected 'fedavg'",
        ),
        ([*AUDIT, "FPDGD-dp-4.5-5", "--set", "network.loss=0.1"], "audit expected 0"),
        (
            [*AUDIT, "FOLtR-ES-p0.9", "--set", "federation.params.antithetic=false"],
            "agents: canary: expected federation.params.metric = 'maxrr' and antithetic",
        ),
        (
            [*AUDIT, "FPDGD-dp-4.5-5", "--set", 'agents=[{behaviour = "auditor"}]'],
            "agents: auditor: expected a canary group",
        ),
        (
            [*AUDIT, "FPDGD-dp-4.5-5", "--set", 'federation.params.clip_norm="l2"']
            + ["--set", 'agents=[{behaviour = "canary", count = 2}]'],
            "agents: canary count: expected 1 with L2 clipping",
        ),
        (
            ["eavesdropper.toml", "--set"]
            + ['agents=[{behaviour = "eavesdropper", targets = ["client-9999"]}]'],
            "agents: eavesdropper targets: no client 'client-9999'",
        ),
        (
            ["noniid_type1.toml", "--set", "federation.partition.merge_intents=true"]
            + ["--set", "federation.partition.intents=[]"],
            "merge_intents: needs intents to merge",
        ),
        (
            [*AUDIT, "CS-F-LTR-eps-0.5", "--set", "federation.params.canary=false"],
            "agents: auditor: expected federation.params.canary = true",
        ),
    ],
)
def test_the_rules_across_keys_are_checked_without_building(nothing_built, args, says, capsys):
    """Each rule refuses in one line; ``--only`` picks the variants an override fits."""
    assert main(["validate", str(ROOT / "scenarios" / args[0]), *args[1:]]) == 2
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

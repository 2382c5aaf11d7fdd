"""Scenario files: variants, overrides and one-line errors that say where and what."""

from pathlib import Path

import pytest

from foltr_async.errors import ScenarioError
from foltr_async.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parents[1]

BASE = """
[scenario]
seed = 3
repeats = 2
reference = "a"
[federation]
protocol = "fpdgd"
clients = 4
rounds = 12
[variants.a]
[variants.b]
federation = { clients = 6, params = { dp = true } }
agents = [{ behaviour = "scaled_reversal", count = 1, z = 3.0 }]
timeline = [{ round = -1, action = "unlearn", agents = ["attackers"] }]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_variants_deep_merge_over_the_base(tmp_path):
    sc = load_scenario(write(tmp_path, BASE))
    a, b = sc.variants["a"], sc.variants["b"]
    assert (sc.seed, sc.repeats, sc.reference) == (3, 2, "a")
    assert a.federation.clients == 4 and b.federation.clients == 6
    assert b.federation.rounds == 12  # untouched keys survive the merge
    assert a.params.dp is False and b.params.dp is True
    assert b.params.lr == 0.1  # protocol defaults filled in
    assert b.agents[0].role == "attacker" and b.agents[0].params.z == 3.0
    assert b.timeline[0].round == 12  # -1 is the last round


def test_set_overrides_every_variant_and_parses_toml_values(tmp_path):
    sc = load_scenario(
        write(tmp_path, BASE), ["federation.rounds=20", "clicks.model=perfect"], seed=9
    )
    for cfg in sc.variants.values():
        assert cfg.federation.rounds == 20
        assert cfg.clicks.model == "perfect"
    assert sc.seed == 9


def test_a_profile_override_replaces_the_file_s_real_data_path_and_folds(tmp_path):
    real = BASE.replace(
        "[federation]", '[dataset]\npath = "MQ2008"\nfolds = [1, 2, 3]\n[federation]'
    )
    assert load_scenario(write(tmp_path, real)).repeats == 6  # 2 seeds x 3 folds
    sc = load_scenario(write(tmp_path, real), ["dataset.profile=mslr-like", "scenario.repeats=5"])
    assert (sc.folds, sc.repeats) == ((), 5)
    for cfg in sc.variants.values():
        assert cfg.dataset.profile == "mslr-like" and cfg.dataset.path is None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("clients = 4", "clinets = 4"),
            "federation.clinets: unknown key (did you mean 'clients'?)",
        ),
        (("clients = 4", "clients = -1"), "federation.clients: expected an integer >= 1, got -1"),
        (("clients = 4", 'clients = "four"'), "federation.clients: expected an integer"),
        (
            ('protocol = "fpdgd"', 'protocol = "fpgdd"'),
            "unknown protocol 'fpgdd' (did you mean 'fpdgd'?)",
        ),
        (("z = 3.0", "zz = 3.0"), "agents[0].zz: unknown key (did you mean 'z'?)"),
        (('"scaled_reversal"', '"scaled_reverse"'), "did you mean 'scaled_reversal'?"),
        (("round = -1", "round = 50"), "timeline[0].round: expected a round in 1..12"),
        (('action = "unlearn"', 'action = "unlern"'), "did you mean 'unlearn'?"),
        (('reference = "a"', 'reference = "c"'), "scenario.reference: 'c' is not a variant"),
        (("[variants.a]", "[variantz.a]"), "variantz: unknown section"),
        (
            ("[federation]", '[dataset]\nprofile = "mslr_like"\n[federation]'),
            "dataset.profile: unknown profile 'mslr_like' (did you mean 'mslr-like'?)",
        ),
        (("rounds = 12", "rounds = 12\nrounds = 13"), "invalid TOML"),
    ],
)
def test_errors_name_file_variant_key_and_expectation(tmp_path, edit, message):
    path = write(tmp_path, BASE.replace(*edit))
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    text = str(err.value)
    assert message in text
    assert str(path) in text and "\n" not in text


def test_network_errors_are_scenario_errors(tmp_path):
    bad = BASE + '[network]\nlatency = { kind = "gaussian" }\n'
    with pytest.raises(ScenarioError, match="network.latency"):
        load_scenario(
            write(
                tmp_path,
                bad.replace("[variants.a]\n", "").replace(
                    "[variants.b]", "[variants.a]\n[variants.b]"
                ),
            )
        )


def test_every_shipped_scenario_validates():
    files = sorted((ROOT / "scenarios").glob("*.toml"))
    assert files, "no scenarios shipped"
    for f in files:
        sc = load_scenario(f)
        assert sc.variants and sc.name


def test_only_validates_just_the_named_variants():
    """A protocol parameter set for the FOLtR-ES variants of a mixed file: refused for the
    whole file (the FPDGD variants do not know it), accepted with --only naming FOLtR-ES ones."""
    path = ROOT / "scenarios" / "fpdgd_vs_foltres.toml"
    sets = ["federation.params.streams=authors"]
    with pytest.raises(ScenarioError, match=r"FPDGD\]: federation.params.streams: .*--only"):
        load_scenario(path, sets)
    sc = load_scenario(path, sets, only=["FOLtR-ES-p1.0", "FOLtR-ES-p0.5"])
    assert list(sc.variants) == ["FOLtR-ES-p0.5", "FOLtR-ES-p1.0"]  # the file's order
    assert {v.params.streams for v in sc.variants.values()} == {"authors"}
    assert sc.reference is None  # the file's reference (FPDGD) is not among them
    assert load_scenario(path, only=["FPDGD"]).reference == "FPDGD"
    with pytest.raises(ScenarioError, match=r"unknown variant 'FOLtR-ES-p1'.*did you mean"):
        load_scenario(path, only=["FOLtR-ES-p1"])


def test_a_variant_is_one_typed_frozen_config_whose_tables_are_what_the_file_gives(tmp_path):
    """Each variant is built once into typed sections and derived values; changing one from
    Python goes through the loader's rules again (``revise``), never around them."""
    import dataclasses

    from foltr_async.scenario.load import revise, validate

    sc = load_scenario(write(tmp_path, BASE))
    b = sc.variants["b"]
    assert (b.n_clients, b.n_attackers, b.n_eavesdroppers, b.assumed_malicious) == (7, 1, 0, 1)
    assert b.timeline_actions == {"unlearn"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.federation.rounds = 3
    # the plain tables give the same config back, and a change is checked like a file's
    assert validate({**b.as_dict(), "agents": []}, "x").federation == b.federation
    assert revise(b, {"federation": {"rounds": 20}}).federation.rounds == 20
    with pytest.raises(ScenarioError, match=r"timeline\[0\].round: expected a round in 1..5"):
        revise(b, {"federation": {"rounds": 5}})  # the unlearning round is past the end
    with pytest.raises(ScenarioError, match=r"revised: federation.rounds: expected an integer"):
        revise(b, {"federation": {"rounds": "five"}})
    with pytest.raises(ScenarioError, match=r"min_clients: expected at most the 7 clients"):
        revise(b, {"federation": {"min_clients": 8}})

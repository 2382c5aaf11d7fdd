"""Bad input, table by table: each broken scenario or dataset gets one line on stderr naming the
scenario file, the variant, the key (and the data file's line), exit code 2, no traceback, and
no output folder; ``validate`` says exactly what the run says."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foltr_async import cli
from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.plugins import load_plugins
from foltr_async.preflight import check_scenario
from foltr_async.scenario.load import SECTIONS, load_scenario, validate

BASE = """
[scenario]
name = "bad"
[dataset]
n_queries = 40
[federation]
protocol = "fpdgd"
clients = 3
rounds = 2
[variants.ok]
[variants.v]
"""

# (what goes into [variants.v], what the one line must say after "FILE [variant v]: ")
BAD_SCENARIOS = [
    ("federation.round_gap = inf", "federation.round_gap: expected a finite number >= 0.0"),
    ("federation.participation = nan", "federation.participation: expected a finite number in"),
    ("federation.deadline = nan", "federation.deadline: expected a finite number >= 0.0, got nan"),
    ("federation.deadline = -inf", "federation.deadline: expected a finite number >= 0.0"),
    ("federation.params.lr = nan", "federation.params.lr: expected a finite number"),
    ("federation.secagg.threshold = nan", "federation.secagg.threshold: expected a finite number"),
    ("federation.clients = 0", "federation.clients: expected an integer >= 1, got 0"),
    ("federation.min_clients = 4", "federation.min_clients: expected at most the 3 clients"),
    ("network.availability = nan", "network.availability: expected a number in [0.0, 1.0]"),
    (
        'agents = [{ behaviour = "scaled_reversal", z = nan }]',
        "agents[0].z: expected a finite number",
    ),
    (
        'timeline = [{ time = inf, action = "leave", agents = ["clients"] }]',
        "timeline[0].time: expected a finite number >= 0.0, got inf",
    ),
    (
        "federation.partition.pbm_eta = [1.0, nan]",
        "federation.partition.pbm_eta[1]: expected a finite number >= 0.0, got nan",
    ),
    ('ranker = { kind = "mlp", hidden = [64, 0] }', "ranker.hidden[1]: expected an integer >= 1"),
    ('scenario.name = "../elsewhere"', "scenario.name: expected a name for one folder"),
    (
        'federation.protocol = "foltr_es"\n'
        'timeline = [{ round = 2, action = "unlearn", agents = ["client-0001"] }]',
        "timeline[0].action: 'unlearn' is not an action of protocol 'foltr_es' (its actions: "
        "join, rejoin, leave, crash, attack_start, attack_stop)",
    ),
    # what only building the run finds
    (
        'timeline = [{ round = 2, action = "leave", agents = ["client-0099"] }]',
        "timeline[0].agents: unknown agent 'client-0099'",
    ),
    ("federation.clients = 100", "federation.clients: 100 clients cannot each own queries"),
    ('dataset.path = "no/such/fold"', "dataset.path: no/such/fold: dataset file does not exist"),
    (
        'federation = { protocol = "foltr_es", params = { metric = "dcg", p = 0.5 } }',
        "federation.params.p: privatisation needs the discrete metric",
    ),
]


def bad_scenario(tmp_path: Path, override: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(BASE + override + "\n")
    return path


def one_line_error(capsys, argv: list[str]) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("override", "message"), BAD_SCENARIOS, ids=[b[0] for b in BAD_SCENARIOS])
def test_bad_scenario_is_one_line_in_validate_and_run(tmp_path, capsys, override, message):
    path = bad_scenario(tmp_path, override)
    line = one_line_error(capsys, ["validate", "--build", str(path)])
    assert line.startswith(f"error: {path} [variant v]: {message}"), line
    out = tmp_path / "out"
    assert one_line_error(capsys, [str(path), "--out", str(out), "--quiet"]) == line
    assert not out.exists()  # rejected before anything was written


GOOD_LETOR = "0 qid:1 1:0.5 2:0.1\n1 qid:1 1:0.2 2:0.3\n0 qid:2 1:0.1 2:0.9\n2 qid:2 1:0.4 2:0.2\n"

# (a line appended to train.txt as line 5, what the one line must say after the file's name)
BAD_LETOR = [
    ("1 1:0.5 2:0.3", ":5: expected 'qid:<id>' after the label, got '1:0.5'"),
    ("x qid:3 1:0.5", ":5: expected a relevance grade (integer 0-127) as the first field"),
    ("-1 qid:3 1:0.5", ":5: expected a relevance grade (integer 0-127) as the first field"),
    ("1 qid:3 1:nan", ":5: expected a finite number after '1:', got 'nan'"),
    ("1 qid:3 1:1e400", ":5: expected a finite number after '1:', got '1e400'"),
    ("1 qid:3 1:abc", ":5: expected a finite number after '1:', got 'abc'"),
    ("1 qid:3 0:0.5", ":5: expected a feature id (integer 1-10000) before ':'"),
    ("1 qid:3 1:0.5 1:0.3", ":5: feature id 1 appears twice"),
    ("1 qid: 1:0.5", ":5: expected 'qid:<id>' after the label, got 'qid:'"),
    ("1 qid:3 1:0.5\x00", ":5: unexpected control character '\\x00'"),
]


def letor_scenario(tmp_path: Path, train: str, test: str | None = GOOD_LETOR) -> Path:
    fold = tmp_path / "fold"
    fold.mkdir()
    (fold / "train.txt").write_text(train)
    if test is not None:
        (fold / "test.txt").write_text(test)
    path = tmp_path / "data.toml"
    path.write_text(
        BASE.replace("[variants.v]", f'[variants.v]\ndataset.path = "{fold.as_posix()}"')
        + 'federation.data = "shared"\n'
    )
    return path


@pytest.mark.parametrize(("line", "message"), BAD_LETOR, ids=[b[0] for b in BAD_LETOR])
def test_bad_letor_line_names_scenario_variant_key_and_data_line(tmp_path, capsys, line, message):
    path = letor_scenario(tmp_path, GOOD_LETOR + line + "\n")
    train = (tmp_path / "fold" / "train.txt").as_posix()
    got = one_line_error(capsys, ["validate", "--build", str(path)])
    assert got.startswith(f"error: {path} [variant v]: dataset.path: {train}{message}"), got
    out = tmp_path / "out"
    assert one_line_error(capsys, [str(path), "--out", str(out), "--quiet"]) == got
    assert not out.exists()


@pytest.mark.parametrize(
    ("train", "test", "message"),
    [
        ("", GOOD_LETOR, "train.txt: no data lines"),
        (GOOD_LETOR, None, "expected test.txt in the directory"),
        ("\x11\x02binary", GOOD_LETOR, "train.txt:1: unexpected control character"),
    ],
    ids=["empty", "no-test", "binary"],
)
def test_bad_letor_files(tmp_path, capsys, train, test, message):
    path = letor_scenario(tmp_path, train, test)
    got = one_line_error(capsys, ["validate", "--build", str(path)])
    assert got.startswith(f"error: {path} [variant v]: dataset.path: ") and message in got, got


def _number_fields() -> list[tuple[str, str | None, str, bool]]:
    """(protocol, behaviour, path, inf allowed) for every float field a scenario can set:
    sections, each protocol's and behaviour's parameters, secure aggregation."""
    reg = load_plugins()
    out = [
        ("fpdgd", None, f"{section}.{key}", f.infinite)
        for section, fields in SECTIONS.items()
        for key, f in fields.items()
        if f.kind is float
    ]
    out += [
        (name, None, f"federation.params.{key}", f.infinite)
        for name, proto in reg.protocols.items()
        for key, f in proto.fields.items()
        if f.kind is float
    ]
    out += [
        ("fpdgd", None, f"federation.secagg.{key}", f.infinite)
        for key, f in reg.scheme().fields.items()
        if f.kind is float
    ]
    out += [
        (next(iter(entry.protocols)), name, f"agents[0].{key}", f.infinite)
        for name, entry in reg.behaviours.items()
        for key, f in entry.fields.items()
        if f.kind is float
    ]
    return out


NUMBER_FIELDS = _number_fields()


def test_the_float_fields_reach_every_kind_of_table():
    paths = {path for _, _, path, _ in NUMBER_FIELDS}
    assert {
        "federation.deadline",
        "federation.params.lr",
        "federation.params.epsilon",
        "federation.secagg.threshold",
        "agents[0].z",
    } <= paths


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(NUMBER_FIELDS), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_no_float_field_takes_nan_or_inf(field, value):
    protocol, behaviour, path, infinite = field
    raw: dict = {"federation": {"protocol": protocol, "clients": 3}}
    if behaviour is not None:
        raw["agents"] = [{"behaviour": behaviour}]
    *head, key = path.split(".")
    node = raw
    for part in head:
        node = raw["agents"][0] if part == "agents[0]" else node.setdefault(part, {})
    node[key] = value
    if infinite and value == math.inf:
        validate(raw, "s.toml")  # documented: inf means "none" (e.g. no noise)
        return
    with pytest.raises(ScenarioError) as err:
        validate(raw, "s.toml")
    assert str(err.value).startswith(f"s.toml: {path}: expected ")
    assert str(err.value).endswith(f"got {value!r}")


# --- runs in which nobody (or not everybody) takes part ------------------------------------


def run_cli(capsys, path: Path, out: Path, *sets: str) -> tuple[int, str, dict]:
    argv = [str(path), "--out", str(out), "--quiet"] + [a for s in sets for a in ("--set", s)]
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, err, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "setting",
    [
        "network.availability = 0",
        "federation.deadline = 0",
        # one of the 3 clients leaves before round 1: never min_clients replies
        'federation.min_clients = 3\ntimeline = [{ round = 1, action = "leave", agents = '
        '["client-0000"] }]',
    ],
    ids=["availability-0", "deadline-0", "min-clients-above-the-online-clients"],
)
def test_a_run_that_learned_nothing_says_so_and_exits_3(tmp_path, capsys, setting):
    path = bad_scenario(tmp_path, setting)
    out = tmp_path / "out"
    code, err, res = run_cli(capsys, path, out, "federation.rounds=4", "evaluation.every=2")
    assert code == 3, err
    assert err.strip().splitlines()[-1].startswith("error: nothing was learned in v: ")
    assert "Traceback" not in err
    assert res["complete"] is True and set(res["nothing_learned"]) == {"v"}
    (rep,) = res["variants"]["v"]["repeats"]
    c = rep["contributions"]
    assert c["per_round"] == [0, 0, 0, 0] and c["empty_rounds"] == 4
    (ok,) = res["variants"]["ok"]["repeats"]
    assert ok["contributions"]["empty_rounds"] == 0 and all(ok["contributions"]["per_round"])
    assert res["conclusions"][0].startswith("Nothing was learned in v: in 1 of 1 repeats")
    assert not any("Highest" in c and ": v (" in c for c in res["conclusions"])
    md = (out / "summary.md").read_text()
    assert "nothing was learned in v (1 of 1 repeats)" in md
    assert "| **4 of 4: nothing learned** |" in md
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "round_empty" and e["variant"] == "v" for e in events) == 4


def test_a_server_whose_workers_never_join_learned_nothing_and_exits_3(tmp_path):
    """ZeroMQ: the clients' worker never connects (refused, or not started); the server runs
    its rounds without them and says so."""
    path = bad_scenario(tmp_path, "")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "foltr_async", "serve", str(path), "--only", "v", "--quiet"]
        + ["--bind", "tcp://127.0.0.1:0", "--insecure", "--join-timeout", "1"]
        + ["--set", "federation.rounds=2", "--set", "federation.deadline=1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "error: nothing was learned in v" in done.stderr and "Traceback" not in done.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["variants"]["v"]["repeats"][0]["contributions"]["per_round"] == [0, 0]


def test_rounds_without_contributions_are_counted_in_a_run_that_learned(tmp_path, capsys):
    path = bad_scenario(tmp_path, "network.availability = 0.3")
    code, err, res = run_cli(capsys, path, tmp_path / "out", "federation.rounds=12")
    assert code == 0, err
    c = res["variants"]["v"]["repeats"][0]["contributions"]
    assert 0 < c["empty_rounds"] < 12 and c["empty_rounds"] == c["per_round"].count(0)
    assert max(c["per_round"]) <= 3
    assert res["nothing_learned"] == {}
    summary = res["variants"]["v"]["summary"]["contributions"]
    assert summary["empty_rounds"]["mean"] == c["empty_rounds"] and summary["learned_nothing"] == 0


# --- output folders -----------------------------------------------------------------------


class _SameSecond:
    """``datetime`` for the CLI whose ``now()`` is always the same second."""

    @staticmethod
    def now():
        from datetime import datetime

        return datetime(2026, 1, 2, 3, 4, 5)


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "datetime", _SameSecond)
    path = bad_scenario(tmp_path, "")
    for seed in (1, 2):
        assert cli.main([str(path), "--quiet", "--seed", str(seed), "--only", "v"]) == 0
    capsys.readouterr()
    folders = sorted(p.name for p in (tmp_path / "results" / "bad").iterdir())
    assert folders == ["20260102-030405", "20260102-030405-2"]
    got = [
        json.loads((tmp_path / "results" / "bad" / f / "results.json").read_text())["seed"]
        for f in folders
    ]
    assert got == [1, 2]  # neither run overwrote the other


def test_out_refuses_a_folder_that_holds_results_and_keeps_them(tmp_path, capsys):
    path = bad_scenario(tmp_path, "")
    out = tmp_path / "out"
    assert cli.main([str(path), "--quiet", "--out", str(out), "--only", "v"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = one_line_error(capsys, [str(path), "--quiet", "--out", str(out), "--seed", "5"])
    assert line.startswith(f"error: --out {out}: already holds a run's results (results.json")
    assert "nothing was replaced" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_out_accepts_an_empty_folder_and_one_claim_wins(tmp_path, capsys):
    path = bad_scenario(tmp_path, "")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([str(path), "--quiet", "--out", str(empty), "--only", "v"]) == 0
    assert (empty / "results.json").exists()
    claimed = tmp_path / "claimed"  # another run has just claimed it (its log exists)
    claimed.mkdir()
    (claimed / "events.jsonl").write_text("")
    capsys.readouterr()
    line = one_line_error(capsys, [str(path), "--quiet", "--out", str(claimed)])
    assert "(events.jsonl)" in line
    assert list(claimed.iterdir()) == [claimed / "events.jsonl"]


# --- any value, any key: a one-line error or a config of finite numbers ----------------------

_TOML_VALUES = st.recursive(
    st.one_of(
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_KEYS = [(section, key) for section, fields in SECTIONS.items() for key in fields]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_KEYS), _TOML_VALUES)
def test_any_value_for_any_key_is_a_finite_config_or_one_line_error(key, value):
    section, name = key
    raw: dict = {"federation": {"protocol": "fpdgd"}}
    raw.setdefault(section, {})[name] = value
    try:
        cfg = validate(raw, "s.toml")
    except ScenarioError as e:
        text = str(e)
        assert text.startswith("s.toml: ") and "\n" not in text
    else:
        table = cfg.as_dict()
        assert all(math.isfinite(x) for x in _floats(table)), table[section][name]


def _floats(obj):
    if isinstance(obj, float):
        yield obj
    elif isinstance(obj, dict | list):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _floats(v)


_LINE = st.lists(
    st.sampled_from(
        ["0", "3", "12", " ", "\t", "qid:", "7", ":", ".", "-", "e", "#"]
        + ["nan", "inf", "\x00", "\x7f", "é", "1:0.5", "qid:9"]
    ),
    max_size=12,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(line=_LINE)
def test_any_appended_letor_line_is_data_or_one_line_naming_the_line(tmp_path_factory, line):
    """What ``validate`` and a run print is ``error: `` and this exception's text: only a
    FoltrError may come out, naming scenario, variant, key and the data file's line."""
    tmp_path = tmp_path_factory.mktemp("letor")
    path = letor_scenario(tmp_path, GOOD_LETOR + line + "\n")
    try:
        check_scenario(load_scenario(path))
    except FoltrError as e:
        train = (tmp_path / "fold" / "train.txt").as_posix()
        assert str(e).startswith(f"{path} [variant v]: dataset.path: {train}:5: "), str(e)
        assert "\n" not in str(e)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[federation.params]\n"\\n" = false\n', "federation.params.'\\n': unknown key"),
        ('["x\\ny"]\n', "'x\\ny': unknown section"),
        ('[variants."a\\nb"]\nfederation.rounds = 0\n', "variants: expected a variant name"),
        ('[variants." v"]\nfederation.rounds = 0\n', "1 to 255 bytes, got ' v'"),
    ],
    ids=["key", "section", "variant", "variant-space"],
)
def test_quoted_toml_keys_stay_on_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "q.toml"
    path.write_text('[federation]\nprotocol = "fpdgd"\nclients = 3\n' + text)
    assert message in one_line_error(capsys, ["validate", str(path)])

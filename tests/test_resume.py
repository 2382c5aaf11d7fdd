"""Checkpoint and resume on the memory transport: no lost or repeated rounds, same result."""

import asyncio
import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foltr_async.errors import FoltrError
from foltr_async.experiment import CHECKPOINT, run_scenario
from foltr_async.ltr.rankers import MLPRanker
from foltr_async.observe.observer import Observer
from foltr_async.provenance import code_stamp
from foltr_async.runtime.checkpoint import (
    Checkpointed,
    CheckpointError,
    capture,
    read_checkpoint,
    restore,
    write_atomic,
)
from foltr_async.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parents[1]


def scenario_file(tmp_path: Path, data: Path) -> Path:
    """Attacker + unlearning (a calibration phase after training), latency, dropout, two
    protocols, two repeats: every piece of state a checkpoint has to carry."""
    p = tmp_path / "resume.toml"
    p.write_text(f"""
[scenario]
name = "resume"
seed = 3
repeats = 2
[dataset]
path = "{data.as_posix()}"
[federation]
protocol = "fpdgd"
clients = 4
queries_per_client = 3
rounds = 24
round_gap = 5.0
[network]
latency = {{ kind = "lognormal", median = 0.5, sigma = 0.5 }}
availability = 0.8
[evaluation]
every = 4
[variants.attacked]
federation = {{ params = {{ store_every = 4 }} }}
agents = [{{ behaviour = "scaled_reversal", count = 1 }}]
timeline = [{{ round = 18, action = "unlearn", agents = ["attackers"] }},
            {{ round = 9, action = "crash", agents = ["client-0001"] }},
            {{ round = 14, action = "rejoin", agents = ["client-0001"] }}]
[variants.es]
federation = {{ protocol = "foltr_es" }}
""")
    return p


class StopAt(Observer):
    """Ctrl-C at a given round of a given repeat (KeyboardInterrupt passes the observers)."""

    def __init__(self, variant: str, repeat: int, round: int) -> None:
        self.at = (variant, repeat, round)

    def round_done(self, variant, repeat, round, **kw) -> None:
        if (variant, repeat, round) == self.at:
            raise KeyboardInterrupt


def comparable(results: dict) -> str:
    """results.json without wall-clock times (the only thing a resume may change)."""
    res = json.loads(json.dumps(results))
    for v in res["variants"].values():
        v["summary"].pop("wall_s")
        for rep in v["repeats"]:
            rep.pop("wall_s")
    return json.dumps(res, sort_keys=True)


def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, mq2008_dir):
    sc = load_scenario(scenario_file(tmp_path, mq2008_dir))
    full = run_scenario(sc, tmp_path / "full", Observer())
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):  # repeat 0 done, repeat 1 of "attacked" at round 15
        run_scenario(sc, out, StopAt("attacked", 1, 15), checkpoint_every=4)
    saved = read_checkpoint(out / CHECKPOINT)
    assert sorted(saved["done"]) == [("attacked", 0), ("es", 0)]
    assert saved["current"]["run"] == ("attacked", 1)
    assert saved["current"]["state"]["round"] == 12  # the last multiple of 4 before round 15
    partial = json.loads((out / "results.json").read_text())
    assert not partial["complete"] and len(partial["variants"]["attacked"]["repeats"]) == 1

    resumed = run_scenario(sc, out, Observer(), resume=True)
    assert resumed["complete"]
    rep = resumed["variants"]["attacked"]["repeats"][1]
    assert rep["rounds"] == list(range(4, 25, 4)) + list(range(25, 31))  # 6 calibration rounds
    assert rep["unlearning"]["clients"] == ["client-0004"]
    assert comparable(resumed) == comparable(full)


def test_resume_refuses_another_configuration(tmp_path, mq2008_dir):
    path = scenario_file(tmp_path, mq2008_dir)
    sc = load_scenario(path, ["scenario.repeats=1", "federation.rounds=18"])
    out = tmp_path / "out"
    run_scenario(sc, out, Observer(), checkpoint_every=4)
    other = load_scenario(path, ["scenario.repeats=1", "federation.rounds=19"])
    with pytest.raises(CheckpointError, match="written for another configuration"):
        run_scenario(other, out, Observer(), resume=True)
    # the same configuration, but the checkpoint was written by other code
    saved = read_checkpoint(out / CHECKPOINT)
    assert saved["code"] == code_stamp()["source"]
    write_atomic(out / CHECKPOINT, {**saved, "code": "0" * 16})
    with pytest.raises(CheckpointError, match="written by other code .source 0000000000000000"):
        run_scenario(sc, out, Observer(), resume=True)


def test_resume_cli_explains_a_missing_checkpoint(tmp_path, mq2008_dir):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "foltr_async",
            str(scenario_file(tmp_path, mq2008_dir)),
            "--resume",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no checkpoint.pkl" in done.stderr and "Traceback" not in done.stderr


def test_capture_keeps_views_names_machinery_and_renews_asyncio_primitives():
    class Holder:
        pass

    bus, other = object(), object()
    h = Holder()
    h.ranker = MLPRanker(5, (4,), rng=np.random.default_rng(0))
    h.rng = np.random.default_rng(7)
    h.same_rng = h.rng
    h.bus = bus
    h.event = asyncio.Event()
    h.event.set()
    h.queries = np.arange(100_000)[10:20]  # a view of an array that is not captured: copied
    h.kinds = frozenset({("pbm", 1), ("cascade", 2)})
    blob = capture(h, {"bus": bus})

    fresh = Holder()
    restore(fresh, blob, {"bus": other})
    assert fresh.bus is other  # machinery by name: the fresh run's own
    assert fresh.same_rng is fresh.rng and fresh.rng.random() == h.rng.random()
    assert fresh.rng.bit_generator.state == h.rng.bit_generator.state
    assert fresh.rng.spawn(1)[0].random() == h.rng.spawn(1)[0].random()  # its seed sequence too
    assert not fresh.event.is_set()  # asyncio primitives restore fresh
    assert fresh.queries.tolist() == list(range(10, 20)) and len(blob) < 100_000
    assert fresh.kinds == h.kinds
    x = np.random.default_rng(1).random((3, 5))
    assert np.array_equal(fresh.ranker.score(x), h.ranker.score(x))
    fresh.ranker.set_params(np.zeros(fresh.ranker.n_params))  # views still alias the flat vector
    assert not fresh.ranker.score(x).any()
    with pytest.raises(CheckpointError, match="which this run lacks"):
        restore(Holder(), blob, {})
    assert issubclass(CheckpointError, FoltrError)


def test_a_class_declares_its_checkpoint_state():
    class Kept(Checkpointed):
        checkpoint_fields = ("count",)

    class AllBut(Kept):
        checkpoint_fields = None
        checkpoint_skip = ("wiring",)

    def filled(cls):
        obj = cls()
        obj.count, obj.wiring, obj.cache = 3, object(), [1]
        return obj

    kept, all_but = Kept(), AllBut()
    kept.restore_state(filled(Kept).checkpoint_state({}), {})
    assert vars(kept) == {"count": 3}  # the named fields only
    all_but.restore_state(filled(AllBut).checkpoint_state({}), {})
    assert vars(all_but) == {"count": 3, "cache": [1]}  # every attribute but the machinery


class _Calls:
    """A pickle that calls ``call(*args)`` when loaded (what a tampered state would hold)."""

    def __init__(self, call, *args) -> None:
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def test_pickled_data_is_not_read_and_nothing_runs(tmp_path):
    """Agent state reaches workers over the network on --resume: no pickle is ever loaded
    (pickle.loads ran os.system here and wrote the marker file)."""
    from foltr_async.runtime.checkpoint import loads

    marker = tmp_path / "ran"
    payloads = [
        pickle.dumps({"w": _Calls(os.system, f"touch {marker}")}),
        pickle.dumps([_Calls(exec, f"open({str(marker)!r}, 'w').close()")]),
        pickle.dumps(_Calls(os.system, f"touch {marker}"), protocol=0),
    ]
    for data in payloads:
        with pytest.raises(CheckpointError, match="unreadable|may not"):
            loads(data, {})
    path = tmp_path / "checkpoint.pkl"
    path.write_bytes(payloads[0])
    with pytest.raises(CheckpointError, match=r"checkpoint\.pkl: .*old pickle format"):
        read_checkpoint(path)
    assert not marker.exists()


def test_secure_aggregation_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SecAgg state (X25519 keys, shares, the run's callbacks) loads through the checked
    unpickler and the resumed run equals the uninterrupted one."""
    sc = load_scenario(
        ROOT / "scenarios" / "secagg_dropout.toml",
        [
            "federation.clients=6",
            "federation.rounds=6",
            "scenario.repeats=1",
            "federation.queries_per_client=2",
        ],  # fmt: skip
    )
    sc = dataclasses.replace(
        sc, reference=None, variants={"secagg-drop30": sc.variants["secagg-drop30"]}
    )
    full = run_scenario(sc, tmp_path / "full", Observer())
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run_scenario(sc, out, StopAt("secagg-drop30", 0, 5), checkpoint_every=2)
    assert read_checkpoint(out / CHECKPOINT)["current"]["state"]["round"] == 4
    assert comparable(run_scenario(sc, out, Observer(), resume=True)) == comparable(full)


def small_scenario(tmp_path: Path, data: Path) -> Path:
    """Two repeats of a short FPDGD run: a checkpoint holding a finished repeat's results and
    the state of the next one."""
    p = tmp_path / "small.toml"
    p.write_text(f"""
[scenario]
name = "small"
seed = 5
repeats = 2
[dataset]
path = "{data.as_posix()}"
[federation]
protocol = "fpdgd"
clients = 3
queries_per_client = 2
rounds = 8
[evaluation]
every = 2
""")
    return p


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, mq2008_dir) -> tuple[Path, Path]:
    """The scenario file and the folder of its run stopped at round 7 of repeat 1 (repeat 0
    finished, repeat 1 checkpointed at round 4)."""
    tmp = tmp_path_factory.mktemp("interrupted")
    path = small_scenario(tmp, mq2008_dir)
    with pytest.raises(KeyboardInterrupt):
        run_scenario(load_scenario(path), tmp / "out", StopAt("default", 1, 7), checkpoint_every=4)
    return path, tmp / "out"


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")}


def resume_cli(scenario: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "foltr_async", str(scenario), "--resume", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


class _ObjectDtype:
    """np.dtype("O") with its flags reset by a state-setting step: numpy then believes the
    dtype holds no object references and builds one from raw bytes."""

    def __reduce__(self):
        return np.dtype, ("O8", False, True), (3, "|", None, None, None, 8, 8, 0)


class _WildPointers:
    """An object array whose elements are the bytes 0x4141...: touching it crashes."""

    def __reduce__(self):
        from numpy._core.numeric import _frombuffer

        return _frombuffer, (b"A" * 32, _ObjectDtype(), (4,), "C")


def test_a_crafted_pickle_checkpoint_is_refused_unread(tmp_path, interrupted):
    """Built only from what the old checking unpickler admitted (numpy dtype and buffer calls,
    a state-setting step), this file made --resume segfault comparing its fingerprint. Now it
    is not read at all: the format changed, in one line, and the folder stays as it was."""
    scenario, done = interrupted
    out = tmp_path / "out"
    shutil.copytree(done, out)
    crafted = {"format": 2, "fingerprint": _WildPointers(), "done": {}, "current": None}
    (out / CHECKPOINT).write_bytes(pickle.dumps(crafted, protocol=5))
    before = files(out)
    res = resume_cli(scenario, out)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "old pickle format" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert files(out) == before


def _flip(data: bytes, at: int, edit) -> bytes:
    return data[:at] + edit(data[at:])


@pytest.mark.parametrize("damage", ["edited", "bit flip", "truncated"])
def test_an_edited_damaged_or_truncated_checkpoint_is_refused(tmp_path, interrupted, damage):
    """A stored nDCG of the finished repeat edited to 0.99 (the old format resumed and reported
    it), one flipped bit in it (silently taken as well), a truncated file: each is refused by
    the checksum in one line, nothing in the folder changes."""
    scenario, done = interrupted
    final = json.loads((done / "results.json").read_text())["variants"]["default"]["repeats"]
    value = struct.pack(">d", final[0]["offline"]["ndcg@10"][-1])  # floats: big-endian
    data = (done / CHECKPOINT).read_bytes()
    at = data.index(value)
    changed = {
        "edited": lambda: data.replace(value, struct.pack(">d", 0.99)),
        "bit flip": lambda: data[: at + 7] + bytes([data[at + 7] ^ 1]) + data[at + 8 :],
        "truncated": lambda: data[:-100],
    }[damage]()
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / CHECKPOINT).write_bytes(changed)
    before = files(out)
    res = resume_cli(scenario, out)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "checksum mismatch" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert files(out) == before


def _retype(node, change) -> bool:
    """Change the first float64 array node of an encoded state in place."""
    if isinstance(node, list) and node[:2] == [7, "<f8"]:
        node[1:] = change(node)
        return True
    return isinstance(node, list) and any(_retype(x, change) for x in node)


def test_a_field_of_the_wrong_dtype_or_shape_is_refused_naming_it(tmp_path, interrupted):
    """A checkpoint whose checksum matches (rewritten, not damaged) but whose client model has
    the wrong dtype or shape: refused naming file, agent, field and what was expected."""
    scenario, done = interrupted
    sc = load_scenario(scenario)
    for what, change in {
        "dtype": lambda node: ["<f4", node[2], node[3][: len(node[3]) // 2]],
        "shape": lambda node: [node[1], [len(node[3]) // 16], node[3][: len(node[3]) // 2]],
    }.items():
        out = tmp_path / what
        shutil.copytree(done, out)
        saved = read_checkpoint(out / CHECKPOINT)
        entry = saved["current"]["state"]["agents"]["client-0001"]
        tree = msgpack.unpackb(entry["blob"])
        assert _retype(tree, change)
        entry["blob"] = msgpack.packb(tree)
        write_atomic(out / CHECKPOINT, saved)
        with pytest.raises(CheckpointError) as err:
            run_scenario(sc, out, Observer(), resume=True)
        msg = str(err.value)
        assert f"{out / CHECKPOINT}: agent client-0001: " in msg and "\n" not in msg
        assert "expected a float64 array of shape" in msg, msg
        assert ("got a float32" if what == "dtype" else "got a float64") in msg


def test_restore_checks_each_field_against_the_fresh_object():
    """Each field against the freshly built object: dtype, shape, type, into project objects
    (a model of another size); a fitting state loads."""
    holder = Checkpointed()
    holder.w = np.zeros(3)
    holder.ranker = MLPRanker(4, (2,), rng=np.random.default_rng(0))
    blob = capture(holder, {})
    for field, value, expected in [
        ("w", np.zeros(3, np.float32), "Checkpointed.w: expected a float64 array of shape (3,)"),
        ("w", "3 zeros", "Checkpointed.w: expected a float64 array of shape (3,), got a str"),
        (
            "ranker",
            MLPRanker(4, (3,)),
            "Checkpointed.ranker._flat: expected a float64 array of shape (12,), "
            "got a float64 array of shape (18,)",
        ),
    ]:
        fresh = Checkpointed()
        fresh.w, fresh.ranker = np.ones(3), MLPRanker(4, (2,))
        other = Checkpointed()
        vars(other).update(vars(holder))
        setattr(other, field, value)
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            restore(fresh, capture(other, {}), {})
    restore(fresh, blob, {})
    assert np.array_equal(fresh.ranker.get_params(), holder.ranker.get_params())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_a_checkpoint_error(tmp_path_factory, data):
    from foltr_async.runtime.checkpoint import MAGIC, loads

    path = tmp_path_factory.mktemp("random") / CHECKPOINT
    for raw in (data, MAGIC + hashlib.sha256(data).digest() + data):
        path.write_bytes(raw)
        for read in (lambda: loads(data, {}), lambda: read_checkpoint(path)):
            try:
                read()
            except CheckpointError as e:
                assert "\n" not in str(e)


_nodes = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 20) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16) | st.sampled_from(["<f8", "|b1", "|O", "foltr_async.simulation",
                                                "Probe", "<U3", "shared"]),
    lambda kids: st.lists(kids, max_size=6) | st.lists(st.integers(0, 16), max_size=4),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(tree=_nodes)
def test_random_node_trees_never_raise_anything_but_a_checkpoint_error(tree):
    """Well-formed msgpack with tags in the wrong places, bad shapes, unknown classes..."""
    from foltr_async.runtime.checkpoint import loads

    try:
        loads(msgpack.packb(tree), {"shared": object()})
    except CheckpointError as e:
        assert "\n" not in str(e)


def _forge(state: dict, change: str) -> None:
    """Edit a saved run state as a forger would (the checksum is recomputed on writing)."""
    if change == "round -5":
        state["round"] = -5
    elif change == "round 10**15":
        state["round"] = 10**15
    elif change == "now NaN":
        state["now"] = float("nan")
    elif change == "removed agent":
        state["agents"].pop(sorted(state["agents"])[-1])
    elif change == "added agent":
        state["agents"]["client-9999"] = next(iter(state["agents"].values()))
    elif change == "future evaluation":
        state["rounds"] = [*state["rounds"], state["round"] + 3]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("round -5", r"run state: round: expected a training round of this run, 1 to \d+, got -5"),
        ("round 10**15", r"run state: round: expected a training round .* got 1000000000000000"),
        ("now NaN", r"run state: now: expected a finite time"),
        ("removed agent", r"run state: agents: 1 missing \(e\.g\. 'client-\d+'\)"),
        ("added agent", r"run state: agents: 1 not in this run \(e\.g\. 'client-9999'\)"),
        ("future evaluation", r"run state: rounds: expected increasing rounds up to the saved"),
    ],
)
def test_a_forged_checkpoint_with_a_recomputed_checksum_is_refused_in_one_line(
    tmp_path, interrupted, change, message
):
    """The checksum catches damage, not a forger who recomputes it: every field is checked
    against its range, the others and the rebuilt run (a removed agent was a KeyError)."""
    scenario, done = interrupted
    out = tmp_path / "out"
    shutil.copytree(done, out)
    data = read_checkpoint(out / CHECKPOINT)
    _forge(data["current"]["state"], change)
    write_atomic(out / CHECKPOINT, data)
    with pytest.raises(CheckpointError, match=message) as e:
        run_scenario(load_scenario(scenario), out, Observer(), resume=True)
    assert "\n" not in str(e.value) and f"{out / CHECKPOINT}: run state: " in str(e.value)

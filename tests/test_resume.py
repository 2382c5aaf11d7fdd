"""Checkpoint and resume on the memory transport: no lost or repeated rounds, same result."""

import asyncio
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foltr_async.errors import FoltrError
from foltr_async.experiment import CHECKPOINT, run_scenario
from foltr_async.ltr.rankers import MLPRanker
from foltr_async.observe.observer import Observer
from foltr_async.runtime.checkpoint import (
    Checkpointed,
    CheckpointError,
    capture,
    read_checkpoint,
    restore,
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
    blob = capture(h, {"bus": bus})

    fresh = Holder()
    restore(fresh, blob, {"bus": other})
    assert fresh.bus is other  # machinery by name: the fresh run's own
    assert fresh.same_rng is fresh.rng and fresh.rng.random() == h.rng.random()
    assert not fresh.event.is_set()  # asyncio primitives restore fresh
    assert fresh.queries.tolist() == list(range(10, 20)) and len(blob) < 100_000
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


def _global(module: str, name: str, *args: str | int, op: bytes = pickle.REDUCE) -> bytes:
    """A protocol-4 pickle that calls (``REDUCE``) or allocates (``NEWOBJ``) ``module.name``
    with these arguments."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw

    packed = b"".join(text(a) if isinstance(a, str) else pickle.BININT1 + bytes([a]) for a in args)
    return (
        pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL
        + pickle.MARK + packed + pickle.TUPLE + op + pickle.STOP
    )  # fmt: skip


def test_checkpoint_data_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    """Agent state reaches workers over the network on --resume: loading it must not call what
    the data names (pickle.loads ran os.system here and wrote the marker file)."""
    from numpy.random import _pickle as np_pickle

    from foltr_async.distributed import LocalWorkers
    from foltr_async.runtime.checkpoint import loads, write_atomic

    marker = tmp_path / "ran"
    payloads = {
        "os.system": pickle.dumps({"w": _Calls(os.system, f"touch {marker}")}),
        "exec": pickle.dumps([_Calls(exec, f"open({str(marker)!r}, 'w').close()")]),
        "a project function": pickle.dumps(_Calls(write_atomic, marker, 1)),
        "a project constructor": pickle.dumps(_Calls(LocalWorkers, None, [], 1, marker, True)),
        "a library call with a class": pickle.dumps(
            _Calls(np_pickle.__bit_generator_ctor, LocalWorkers)
        ),
        "a dotted name": _global("foltr_async.distributed", "subprocess.Popen"),
        "a module not imported": _global("foltr_async.__main__", "main"),
        "a numpy class's __new__": _global(
            "numpy", "memmap", str(marker), "uint8", "w+", 0, 4, op=pickle.NEWOBJ
        ),
        "protocol 0": pickle.dumps(_Calls(os.system, f"touch {marker}"), protocol=0),
    }
    for what, data in payloads.items():
        with pytest.raises(CheckpointError, match="may not load|unreadable"):
            loads(data, {})
        assert not marker.exists(), what
    path = tmp_path / "checkpoint.pkl"
    path.write_bytes(payloads["os.system"])
    with pytest.raises(CheckpointError, match=r"checkpoint\.pkl: .*posix\.system"):
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

"""The ZeroMQ transport with real processes on loopback (and across a veth pair when allowed).

Every test spawns ``python -m foltr_async`` processes: the local launcher (``--transport zmq
--workers N``), or ``serve`` plus ``join`` workers started here so a test can kill one.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

from foltr_async.distributed.claims import agent_ids, parse_agents
from foltr_async.errors import FoltrError
from foltr_async.experiment import run_scenario
from foltr_async.observe.observer import Observer
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.wire import Envelope, encode
from foltr_async.runtime.zmq_buses import HubBus
from foltr_async.runtime.zmq_endpoints import Hub
from foltr_async.runtime.zmq_keys import add_worker_key, make_keys
from foltr_async.runtime.zmq_wire import pack_control, unpack_control
from foltr_async.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "foltr_async"]


def write_scenario(path: Path, data: Path, extra: str = "", **fed) -> Path:
    fed = {"protocol": '"fpdgd"', "clients": 6, "queries_per_client": 3, "rounds": 12, **fed}
    fed_lines = "\n".join(f"{k} = {v}" for k, v in fed.items())
    path.write_text(f"""
[scenario]
name = "z"
seed = 11
[dataset]
path = "{data.as_posix()}"
[federation]
{fed_lines}
[evaluation]
every = 3
{extra}
""")
    return path


def spawn(*args: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [*CLI, *args],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


async def until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """In a test's event loop: poll ``predicate`` until it holds (a generous timeout, so a
    loaded machine only makes the test slower)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def events(out: Path, name: str = "events.jsonl") -> list[dict]:
    path = out / name
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def replies_per_round(out: Path) -> dict[int, int]:
    found = {}
    for path in sorted(out.glob("events*.jsonl")):
        for e in events(out, path.name):
            if e["event"] == "aggregation":
                found[e["round"]] = e["replied"]
    return found


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def assert_same_metrics(a: dict, b: dict) -> None:
    """Offline curves, online metric and every message counter equal, repeat by repeat (per
    kind: messages; a kind's bytes may shift by a header byte where seqs number otherwise)."""
    assert a["variants"].keys() == b["variants"].keys()
    for name in a["variants"]:
        for ra, rb in zip(
            a["variants"][name]["repeats"], b["variants"][name]["repeats"], strict=True
        ):
            for key in ("rounds", "offline", "online", "late_replies"):
                assert ra[key] == rb[key], (name, key)
            ma, mb = dict(ra["messages"]), dict(rb["messages"])
            ka, kb = ma.pop("kinds"), mb.pop("kinds")
            assert ma == mb, name
            assert ka.keys() == kb.keys(), name
            for kind in ka:
                for key in ("sent", "delivered", "dropped"):
                    assert ka[kind][key] == kb[kind][key], (name, kind, key)


def memory_results(path: Path, tmp: Path, sets: list[str] = ()) -> dict:
    return run_scenario(load_scenario(path, list(sets)), tmp / "memory", Observer())


# --------------------------------------------------------------------------- in process


def test_agent_specs_and_control_messages_round_trip():
    assert parse_agents("client-0..client-3,client-7") == {0, 1, 2, 3, 7}
    assert agent_ids({0, 1, 2, 3, 7, 9, 10}) == "client-0..client-3,client-7,client-9..client-10"
    for bad in ("worker-1", "client-5..client-2", "client-x"):
        with pytest.raises(FoltrError, match="--agents"):
            parse_agents(bad)
    msg = {"t": "done", "shown": np.arange(6, dtype=np.int32).reshape(2, 3), "key": ("a", 1)}
    back = unpack_control(pack_control(msg))
    assert back["key"] == ["a", 1] and back["shown"].dtype == np.int32
    assert np.array_equal(back["shown"], msg["shown"])
    with pytest.raises(ValueError):
        unpack_control(b"\xc1")


HELLO = {"t": "hello", "worker": "w1", "claims": [0], "host": "h", "pid": 1, "run": 0}


class _Proxy:
    remote = True
    role = "client"

    def __init__(self, agent_id: str, worker: bytes) -> None:
        self.id, self.worker = agent_id, worker


async def test_network_input_is_checked_dropped_and_counted_never_raised():
    """Frames from a worker: malformed, oversized, spoofed source, stale run -> counted drops;
    a good one reaches the server agent. The codec's rules hold for traffic from the network."""
    import zmq
    import zmq.asyncio

    hub = Hub("tcp://127.0.0.1:0", keys=None)
    endpoint = await hub.start()
    bus = HubBus(NetworkModel(), np.random.default_rng(0), hub, run=1, max_bytes=2000)
    hub.bus = bus
    got = []

    class Server:
        id, role, remote = "server", "server", False

        def deliver(self, env):
            got.append(env)

    bus.register(Server())
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.routing_id = b"w1"
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"C", pack_control(HELLO)])
        await until(lambda: b"w1" in hub.peers, what="the hello")
        bus.register(_Proxy("client-0000", b"w1"))
        head, stale = struct.pack("<Id", 1, 0.0), struct.pack("<Id", 7, 0.0)

        def env(src: str, body: dict, seq: int = 1) -> bytes:
            return encode(Envelope("fpdgd.update", src, "server", body, 1, seq, 0.0))

        good = {"params": np.zeros(3), "n_interactions": 1}
        frames = [
            [b"M", head, b"server", b"\xc1 garbage"],
            [
                b"M",
                head,
                b"server",
                env("client-0000", {"params": np.zeros(400), "n_interactions": 1}),
            ],
            [b"M", head, b"server", env("client-0001", good)],  # not hosted by w1
            [b"M", stale, b"server", env("client-0000", good)],
            [b"M", head, b"server", env("client-0000", good, seq=2)],
            [b"M", head, b"server", env("client-0000", good, seq=2)],  # replayed
        ]
        for f in frames:
            await dealer.send_multipart(f)
        await until(lambda: sum(bus.stats.dropped.values()) >= 5 and got, what="the frames")
        dropped = dict(bus.stats.dropped)
        assert dropped == {
            "malformed": 1,
            "oversized": 1,
            "unauthenticated": 1,
            "stale_run": 1,
            "replayed": 1,
        }
        assert [e.src for e in got] == ["client-0000"] and bus.stats.delivered == 1
    finally:
        dealer.close(linger=0)
        ctx.term()
        await hub.close(bye=False)


async def test_garbage_control_frames_are_counted_once_with_one_warning_per_reason():
    """Undecodable, untyped, schema-breaking and unknown control messages and broken frames
    from a peer: counted by reason, one warning line per reason and no traceback (a bad hello
    raised out of the server's handler and its sender became a worker); only a valid hello
    makes a worker. Refused handshakes are counted in the run they happened in."""
    import msgpack
    import structlog
    import zmq
    import zmq.asyncio

    from foltr_async.distributed.server import ZmqServer

    srv = ZmqServer("tcp://127.0.0.1:0", keys=None)
    await srv.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.routing_id = b"mallory"
    dealer.connect(srv.hub.endpoint)
    garbage = [
        [b"C", b"\xc1garbage"],
        [b"C", msgpack.packb([1, 2])],
        [b"C", pack_control({"t": "hello", "claims": "abc", "pid": "x"})],
        [b"C", pack_control({**HELLO, "claims": [1, "x"], "worker": {"a": 1}})],
        [b"C", pack_control({**HELLO, "pid": -1})],
        [b"C", pack_control({"t": "flush", "run": 0, "flush": 3})],
        [b"C", pack_control({"t": "ready", "req": "zz", "states": 5})],
        [b"C", pack_control({"t": "nonsense"})],
        [b"X"],
        [b"M", b"12"],
        [b"M", struct.pack("<Id", 1, 0.0), b"server", b"\xc1"],
    ]
    try:
        with structlog.testing.capture_logs() as logs:
            for f in garbage:
                await dealer.send_multipart(f)
            await until(lambda: sum(srv.hub.dropped.values()) == len(garbage), what="drops")
        assert dict(srv.hub.dropped) == {
            "undecodable": 2,
            "bad_control": 6,
            "bad_frame": 2,
            "not_introduced": 1,
        }
        assert srv.workers == {} and srv.hub.peers == {}
        warnings = [e["reason"] for e in logs if e["log_level"] == "warning"]
        assert sorted(warnings) == ["bad_control", "bad_frame", "not_introduced", "undecodable"]
        assert not any(e["log_level"] in ("error", "critical") for e in logs)
        await dealer.send_multipart([b"C", pack_control(HELLO)])
        await until(lambda: srv.workers, what="the hello")
        assert [w.name for w in srv.workers.values()] == ["w1"]
        srv.hub._refused("10.0.0.9", "KEY")
        await srv.end_run(None)
        assert srv.report()["refused_handshakes"] == 1
        assert srv.report()["frames_dropped"] == dict(srv.hub.dropped)
        await srv.end_run(None)  # the next variant: nothing new refused or dropped
        assert srv.report()["refused_handshakes"] == 0 and srv.report()["frames_dropped"] == {}
    finally:
        dealer.close(linger=0)
        ctx.term()
        await srv.hub.close(bye=False)


# --------------------------------------------------------------------------- processes


def test_local_workers_match_the_memory_run_with_one_frame_per_worker(tmp_path, mq2008_dir):
    """The headline shape (an attacker hosted by the server, unlearning, calibration rounds),
    PGA with the relevance reset (leavers in two workers), PGA as the study's code (its leavers
    rejoin where they live), FedRemove's server-side replay and
    FOLtR-ES (also with its authors' per-client streams, which live in the workers): a secure
    zmq run with 3 worker processes gives the memory run's metrics."""
    path = write_scenario(
        tmp_path / "z.toml",
        mq2008_dir,
        extra="""
[variants.attacked]
federation = { params = { store_every = 3 } }
agents = [{ behaviour = "scaled_reversal", count = 1 }]
timeline = [{ round = -1, action = "unlearn", agents = ["attackers"] }]
[variants.retrained]
federation = { params = { unlearning = "retrain" } }
agents = [{ behaviour = "scaled_reversal", count = 1 }]
timeline = [{ round = -1, action = "unlearn", agents = ["attackers"] }]
[variants.ascended]
federation = { params = { unlearning = "pga", relevance_reset = true } }
timeline = [{ round = -1, action = "unlearn", agents = ["client-0001", "client-0004"] }]
[variants.ascended-as-code]
federation = { params = { unlearning = "pga", pga_as_code = true, unlearn_rounds = 3 } }
timeline = [{ round = -1, action = "unlearn", agents = ["client-0001", "client-0004"] }]
[variants.removed]
federation = { params = { unlearning = "fedremove" } }
agents = [{ behaviour = "scaled_reversal", count = 1 }]
timeline = [{ round = -1, action = "unlearn", agents = ["attackers"] }]
[variants.es]
federation = { protocol = "foltr_es" }
[variants.es-authors-streams]
federation = { protocol = "foltr_es", params = { streams = "authors" } }
""",
    )
    out = tmp_path / "zmq"
    done = subprocess.run(
        [*CLI, str(path), "--transport", "zmq", "--workers", "3", "--out", str(out), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    z = results(out)
    assert z["complete"]
    memory = memory_results(path, tmp_path)
    assert_same_metrics(memory, z)
    rep = z["variants"]["attacked"]["repeats"][0]
    # the workers' learners' interactions per path, added up by the server
    paths = memory["variants"]["attacked"]["repeats"][0]["learner_interactions"]
    assert rep["learner_interactions"] == paths and paths["batched"] > 0
    assert rep["unlearning"]["clients"] == ["client-0006"]  # the server-hosted attacker left
    ascended = z["variants"]["ascended"]["repeats"][0]["unlearning"]
    assert ascended["relevance_reset"]["queries"] > 0
    in_memory = memory["variants"]["ascended"]["repeats"][0]["unlearning"]
    # everything but the phase's duration, which over ZeroMQ is real seconds
    assert ascended.pop("sim_s") >= 0.0 and in_memory.pop("sim_s") >= 0.0
    assert ascended == in_memory
    as_code = z["variants"]["ascended-as-code"]["repeats"][0]["unlearning"]
    assert as_code["ascent_interactions"] == 3 * 2 * 3  # rounds x rejoined leavers x B
    t = rep["transport"]
    assert t["kind"] == "zmq" and t["secure"] and t["workers"] == 3
    # 12 training + 4 calibration broadcasts, each reaching 3 workers once, while the clients
    # got one message each: fan-out per process, not per agent
    assert t["frames_to_workers"] == 3 * 16 < rep["messages"]["kinds"]["fpdgd.model"]["delivered"]
    assert sorted(p.name for p in (out / "workers").iterdir()) == [
        "worker-0.log",
        "worker-1.log",
        "worker-2.log",
    ]


def zmq_and_memory(tmp_path: Path, name: str, variant: str, sets: list[str]) -> tuple[dict, dict]:
    """One variant of a shipped scenario with its clients in two workers, then in memory."""
    scenario = ROOT / "scenarios" / name
    out = tmp_path / "zmq"
    done = subprocess.run(
        [*CLI, str(scenario), "--only", variant, "--transport", "zmq", "--workers", "2"]
        + [a for s in sets for a in ("--set", s)]
        + ["--out", str(out), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scn = load_scenario(scenario, sets)
    scn = dataclasses.replace(scn, reference=None, variants={variant: scn.variants[variant]})
    return results(out), run_scenario(scn, tmp_path / "memory", Observer())


def test_fedips_over_workers_matches_the_memory_run(tmp_path):
    """FedIPS (PBM users, IPS-weighted local SGD, FedOpt server) in two workers: the memory
    run's metrics and message counts."""
    sets = ["federation.rounds=6", "federation.clients=12", "scenario.repeats=1"]
    zmq, mem = zmq_and_memory(tmp_path, "fedips.toml", "FedIPS-g1.0", sets)
    assert_same_metrics(mem, zmq)


def test_csfltr_parties_in_worker_processes_report_to_the_server(tmp_path):
    """Parties hosted by two workers (with network latency, in real time): the memory run's
    metrics and message counts, since no answer depends on arrival order; the parties'
    measurements and the relay eavesdropper's truths reach the server."""
    sets = ["federation.params.docs_per_party=300", "federation.rounds=4", "scenario.repeats=1"]
    zmq, mem = zmq_and_memory(tmp_path, "csfltr.toml", "csfltr", sets)
    assert_same_metrics(mem, zmq)
    z = zmq["variants"]["csfltr"]["repeats"][0]
    m = mem["variants"]["csfltr"]["repeats"][0]
    assert z["transport"]["workers"] == 2 and z["messages"]["tap_errors"] == 0
    assert sorted(z["csfltr"]["instances"]) == [f"client-{p:04d}" for p in range(4)]
    for part in ("rtk", "naive"):
        assert z["csfltr"][part]["terms"] == m["csfltr"][part]["terms"] > 0
    assert z["eavesdrop"]["eve-0"]["terms"] == m["eavesdrop"]["eve-0"]["terms"] > 0
    assert "csfltr.measured" not in z  # raw measurements are summarised, not written


def cli(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _other_code(where: Path) -> Path:
    """A copy of this checkout with one protocol file changed: a worker running other code."""
    for folder in ("foltr_async", "protocols"):
        shutil.copytree(ROOT / folder, where / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    with open(where / "protocols" / "fpdgd.py", "a") as fh:
        fh.write("\n# another version\n")
    return where


def test_unknown_key_is_refused_and_logged_and_plaintext_needs_asking(tmp_path, mq2008_dir):
    """Only an authorised key with the server's configuration and code gets clients; the
    simulated network (latency, loss) applies on this path too, in real time."""
    path = write_scenario(
        tmp_path / "z.toml",
        mq2008_dir,
        rounds=3,
        deadline=0.5,
        extra="[network]\nlatency = 0.05\nloss = 0.2",
    )
    keys, intruder = tmp_path / "keys", tmp_path / "intruder"
    make_keys(keys, workers=1)
    intruder.mkdir()
    shutil.copy(keys / "server.key", intruder / "server.key")  # knows the server, not allowed
    add_worker_key(intruder, "mallory")
    port, out = free_port(), tmp_path / "out"
    server = spawn("serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--keys",
                   str(keys), "--out", str(out), "--quiet", log=tmp_path / "serve.log")  # fmt: skip
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--agents", "client-0.."]
    join[-1] += "client-5"
    try:
        bad = cli(*join, "--keys", str(intruder), "--name", "mallory")
        assert bad.returncode == 2, bad.stderr
        assert "refused this worker's key" in bad.stderr and "Traceback" not in bad.stderr
        plain = cli(*join)
        assert plain.returncode == 2 and "--insecure" in plain.stderr
        other = cli(*join, "--keys", str(keys), "--name", "worker-0", "--set",
                    "federation.queries_per_client=2")  # fmt: skip
        assert other.returncode == 2 and "differ from the server's" in other.stderr
        changed = _other_code(tmp_path / "other-code")
        older = cli(*join, "--keys", str(keys), "--name", "worker-0", cwd=changed)
        assert older.returncode == 2 and "runs other code than the server" in older.stderr
        good = cli(*join, "--keys", str(keys), "--name", "worker-0")
        assert good.returncode == 0, good.stderr[-2000:]
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
    refused = [e for e in events(out) if e["event"] == "auth_refused"]
    assert refused and refused[0]["address"] == "127.0.0.1"
    rep = results(out)["variants"]["default"]["repeats"][0]
    assert rep["transport"]["refused_handshakes"] >= 1 and rep["rounds"][-1] == 3
    assert rep["messages"]["dropped"]["lost"] > 0  # loss drawn by the hub's network model
    assert rep["transport"]["round_s"]["p50"] >= 0.1  # two 50 ms hops per round, real time


def test_killed_worker_counts_as_dropped_and_a_restarted_one_rejoins(tmp_path, mq2008_dir):
    # a deadline long enough for any honest reply on a loaded machine: only the rounds whose
    # clients were killed wait it out
    path = write_scenario(tmp_path / "z.toml", mq2008_dir, rounds=40, deadline=20.0, round_gap=0.15)
    port, out = free_port(), tmp_path / "out"
    server = spawn(
        "serve",
        str(path),
        "--bind",
        f"tcp://127.0.0.1:{port}",
        "--insecure",
        "--out",
        str(out),
        "--quiet",
        "--heartbeat-timeout",
        "2",
        log=tmp_path / "serve.log",
    )
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure"]

    def logged(name: str, line: str) -> bool:
        return line in (tmp_path / name).read_text()

    w0 = w1b = None
    w1 = spawn(*join, "--agents", "client-3..client-5", log=tmp_path / "w1.log")
    try:
        # The restarted worker is started before round 1 (a start takes seconds on a loaded
        # machine, ~30 of this run's short rounds): it waits while w1 hosts its clients and
        # takes them over once w1 is lost. Round 1 waits for w0's clients.
        wait_for(lambda: logged("w1.log", "worker_welcomed"), what="w1 welcomed")
        w1b = spawn(*join, "--agents", "client-3..client-5", log=tmp_path / "w1b.log")
        wait_for(lambda: logged("w1b.log", "worker_waiting"), what="w1b waiting for w1's clients")
        w0 = spawn(*join, "--agents", "client-0..client-2", log=tmp_path / "w0.log")
        wait_for(lambda: max(replies_per_round(out), default=0) >= 4, what="round 4")
        w1.kill()
        w1.wait()
        killed_at = max(replies_per_round(out))
        assert server.wait(timeout=120) == 0
        assert w0.wait(timeout=30) == 0 and w1b.wait(timeout=30) == 0
    finally:
        for p in (server, w0, w1, w1b):
            if p is not None:
                p.kill()
    replied = replies_per_round(out)
    assert sorted(replied) == list(range(1, 41))  # the run went on: every round played
    assert replied[1] == 6 and replied[40] == 6  # ... and the restarted worker's clients rejoined
    # rounds while they were gone: only the other half replied
    assert 3 in [replied[r] for r in range(killed_at + 1, 41)]
    names = [e["event"] for e in events(out) if e.get("variant") == "default"]  # in the run
    assert names.count("worker_lost") == 1 and names.count("worker_joined") == 3
    assert results(out)["complete"]
    rep = results(out)["variants"]["default"]["repeats"][0]
    # every reply's 3 interactions are in the online metric, the killed worker's too (they
    # were flushed only at the end, and the killed process's vanished), and its deliveries
    # are counted: every message sent was delivered or dropped
    assert rep["online"]["interactions"] == 3 * (sum(replied.values()) + rep["late_replies"])
    m = rep["messages"]
    assert m["sent"] == m["delivered"] + sum(m["dropped"].values())


def test_a_worker_whose_set_up_outlasts_the_heartbeat_timeout_is_not_lost(tmp_path, mq2008_dir):
    """Building a run's clients blocks a worker's loop (a large dataset, compiled code), so no
    heartbeats leave it meanwhile, nor are the server's read: with set-up 5 s and 2 s heartbeat
    timeouts the server declared the worker lost before round 1 (and the worker the server),
    and it had to join again."""
    plugin = {"FOLTR_ASYNC_PLUGINS": "tests.plugin_slow_setup"}
    slow = {**plugin, "FOLTR_TEST_SLOW_SETUP": "5"}  # the worker's set-up only
    path = write_scenario(tmp_path / "z.toml", mq2008_dir, protocol='"fpdgd_slow_setup"',
                          rounds=4, deadline=60.0)  # fmt: skip
    port, out = free_port(), tmp_path / "out"
    server = spawn("serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--out", str(out), "--quiet", "--heartbeat-timeout", "2",
                   log=tmp_path / "serve.log", env=plugin)  # fmt: skip
    worker = spawn("join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--agents", "client-0..client-5", "--heartbeat-timeout", "2",
                   log=tmp_path / "w.log", env=slow)  # fmt: skip
    try:
        assert server.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-2000:]
        assert worker.wait(timeout=30) == 0
    finally:
        server.kill()
        worker.kill()
    names = [e["event"] for e in events(out)]
    assert names.count("worker_joined") == 1 and "worker_lost" not in names
    assert replies_per_round(out) == {1: 6, 2: 6, 3: 6, 4: 6}
    # (after its run the worker may miss heartbeats while a loaded server writes the results)
    assert "server_lost" not in (tmp_path / "w.log").read_text().split("run_done")[0]


def test_a_worker_silent_after_its_set_up_is_lost(tmp_path, mq2008_dir):
    """Once a worker has built its run, its silence counts again: a stopped (SIGSTOP) worker,
    its connection still open, is lost after the heartbeat timeout. A first version of the
    set-up exemption never ended it, so such a worker was lost only when its connection closed."""
    path = write_scenario(tmp_path / "z.toml", mq2008_dir, rounds=400, deadline=1.0)
    port, out = free_port(), tmp_path / "out"
    server = spawn("serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--out", str(out), "--quiet", "--heartbeat-timeout", "2",
                   log=tmp_path / "serve.log")  # fmt: skip
    worker = spawn("join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--agents", "client-0..client-5", log=tmp_path / "w.log")  # fmt: skip
    try:
        wait_for(lambda: max(replies_per_round(out), default=0) >= 2, what="round 2")
        worker.send_signal(signal.SIGSTOP)
        wait_for(lambda: "worker_lost" in [e["event"] for e in events(out)], timeout=30,
                 what="the stopped worker lost")  # fmt: skip
    finally:
        server.kill()
        worker.kill()


def test_a_serve_run_no_worker_joined_says_so_and_exits_3(tmp_path, mq2008_dir):
    """Only the server-hosted attacker trained: the old server said "run complete" and exited
    0. Now the console, summary.md and results.json say the clients never joined, and the
    exit code says nothing meaningful was measured."""
    path = write_scenario(
        tmp_path / "z.toml",
        mq2008_dir,
        rounds=3,
        deadline=0.3,
        extra='[[agents]]\nbehaviour = "scaled_reversal"\ncount = 1',
    )
    out = tmp_path / "out"
    done = cli("serve", str(path), "--bind", f"tcp://127.0.0.1:{free_port()}", "--insecure",
               "--join-timeout", "1", "--out", str(out), "--quiet")  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "no honest client took part in default" in done.stderr
    assert "6 of 6 clients never joined" in done.stderr and "Traceback" not in done.stderr
    res = results(out)
    rep = res["variants"]["default"]["repeats"][0]
    assert rep["transport"]["clients"] == rep["transport"]["clients_missing"] == 6
    assert res["not_as_asked"] == ["default repeat 0: 6 of 6 clients never joined (no worker "
                                   "hosted them)"]  # fmt: skip
    summary = (out / "summary.md").read_text()
    assert "**Not as asked**: default repeat 0: 6 of 6 clients never joined" in summary


def test_workers_that_lost_a_stalled_server_get_their_run_back(tmp_path, mq2008_dir):
    """The server stops answering for longer than the workers' heartbeat timeout (as under a
    junk flood): they drop their clients and say hello again. The old server welcomed them
    without resending the run and never counted them lost, so every later round waited its
    full deadline with no reply. Now their clients crash, rejoin, and the run says so."""
    path = write_scenario(tmp_path / "z.toml", mq2008_dir, rounds=24, deadline=10.0, round_gap=0.2)
    port, out = free_port(), tmp_path / "out"
    server = spawn("serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--out", str(out), "--quiet", "--heartbeat-timeout", "60",
                   log=tmp_path / "serve.log")  # fmt: skip
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure",
            "--heartbeat-timeout", "4"]  # fmt: skip
    w0 = spawn(*join, "--agents", "client-0..client-2", log=tmp_path / "w0.log")
    w1 = spawn(*join, "--agents", "client-3..client-5", log=tmp_path / "w1.log")
    try:
        wait_for(lambda: max(replies_per_round(out), default=0) >= 3, what="round 3")
        server.send_signal(signal.SIGSTOP)
        wait_for(lambda: "server_lost" in (tmp_path / "w0.log").read_text()
                 and "server_lost" in (tmp_path / "w1.log").read_text(),
                 timeout=30, what="the workers to give the server up")  # fmt: skip
        server.send_signal(signal.SIGCONT)
        assert server.wait(timeout=120) == 0
        assert w0.wait(timeout=30) == 0 and w1.wait(timeout=30) == 0
    finally:
        for p in (server, w0, w1):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
            p.kill()
    replied = replies_per_round(out)
    assert sorted(replied) == list(range(1, 25))
    assert replied[24] == 6 and replied[23] == 6  # the clients were back for the last rounds
    lost = [e for e in events(out) if e["event"] == "worker_lost"]
    assert len(lost) == 2 and all(e["crashed"] == 3 for e in lost)
    res = results(out)
    rep = res["variants"]["default"]["repeats"][0]
    assert rep["transport"]["clients_lost"] == 6
    assert "6 of 6 clients were lost with their worker" in (out / "summary.md").read_text()


def test_server_resume_with_workers_left_running_gives_the_uninterrupted_result(
    tmp_path, mq2008_dir
):
    path = write_scenario(tmp_path / "z.toml", mq2008_dir, rounds=24, round_gap=0.1)
    port, out = free_port(), tmp_path / "out"
    serve = ["serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure", "--quiet"]
    server = spawn(*serve, "--out", str(out), "--checkpoint-every", "4", log=tmp_path / "s1.log")
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure"]
    workers = [
        spawn(*join, "--agents", "client-0..client-2", log=tmp_path / "w0.log"),
        spawn(*join, "--agents", "client-3..client-5", log=tmp_path / "w1.log"),
    ]
    try:
        wait_for(
            lambda: any(e["event"] == "checkpoint" and e["round"] >= 8 for e in events(out)),
            what="a checkpoint at round 8",
        )
        server.kill()  # no goodbye: the workers wait for a server to come back
        server.wait()
        workers[1].kill()  # ... and one of them dies too: its restart gets its clients' state
        workers[1].wait()
        workers[1] = spawn(*join, "--agents", "client-3..client-5", log=tmp_path / "w1b.log")
        resumed = subprocess.run(
            [*CLI, *serve, "--resume", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert all(w.wait(timeout=30) == 0 for w in workers)
    finally:
        for p in (server, *workers):
            p.kill()
    assert any(e["event"] == "resumed" for e in events(out))
    assert_same_metrics(memory_results(path, tmp_path), results(out))


class _RunsShell:
    """What a tampered checkpoint could hold as a client's state: a pickle calling a shell."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_tampered_agent_state_sent_on_resume_is_refused_by_the_worker_and_counted(
    tmp_path, mq2008_dir
):
    """A client's checkpointed state replaced by a pickle that runs a shell command (in a
    checkpoint rewritten with a matching checksum): the worker it is sent to on --resume
    refuses it with one line (no pickle is read, nothing runs), the server counts it in
    ``worker_errors`` and the run goes on without that worker's clients."""
    import pickle

    from foltr_async.runtime.checkpoint import read_checkpoint, write_atomic

    path = write_scenario(tmp_path / "z.toml", mq2008_dir, rounds=12, round_gap=0.1)
    port, out = free_port(), tmp_path / "out"
    serve = ["serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure", "--quiet"]
    server = spawn(*serve, "--out", str(out), "--checkpoint-every", "4", log=tmp_path / "s1.log")
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure"]
    halves = ["client-0..client-2", "client-3..client-5"]
    workers = [
        spawn(*join, "--agents", a, log=tmp_path / f"w{i}.log") for i, a in enumerate(halves)
    ]
    marker = tmp_path / "ran"
    try:
        wait_for(lambda: any(e["event"] == "checkpoint" for e in events(out)), what="a checkpoint")
        for p in (server, *workers):
            p.kill()
            p.wait()
        saved = read_checkpoint(out / "checkpoint.pkl")
        remote = saved["current"]["state"]["remote"]
        remote["client-0004"]["blob"] = pickle.dumps({"x": _RunsShell(f"touch {marker}")})
        write_atomic(out / "checkpoint.pkl", saved)
        workers = [spawn(*join, "--agents", a, log=tmp_path / f"w{i}b.log")
                   for i, a in enumerate(halves)]  # fmt: skip
        resumed = subprocess.run(
            [*CLI, *serve, "--resume", str(out), "--join-timeout", "3"],
            cwd=ROOT, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert workers[1].wait(timeout=30) == 2  # it cannot host the server's run: it stops
    finally:
        for p in (server, *workers):
            p.kill()
    assert not marker.exists()
    log = (tmp_path / "w1b.log").read_text()
    assert "agent client-0004: unreadable checkpoint data" in log and "Traceback" not in log
    rep = results(out)["variants"]["default"]["repeats"][0]
    assert rep["transport"]["worker_errors"] == 1 and rep["rounds"][-1] == 12
    assert [e for e in events(out) if e["event"] == "worker_error"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_stops_server_and_workers_and_keeps_written_results(tmp_path, mq2008_dir, signum):
    """SIGTERM (kill, a batch scheduler) takes Ctrl-C's graceful path; it once hung the run."""
    path = write_scenario(
        tmp_path / "z.toml",
        mq2008_dir,
        rounds=20000,  # b must still be running when Ctrl-C arrives
        round_gap=0.02,
        extra="[variants.a]\nfederation = { rounds = 3 }\n[variants.b]\n",
    )
    out = tmp_path / "out"
    run = spawn(
        str(path),
        "--transport",
        "zmq",
        "--workers",
        "2",
        "--out",
        str(out),
        "--quiet",
        log=tmp_path / "run.log",
    )
    try:
        wait_for(
            lambda: (out / "results.json").exists() and results(out)["variants"]["a"]["repeats"],
            what="variant a",
        )
        wait_for(
            lambda: any(e["event"] == "round" and e.get("variant") == "b" for e in events(out)),
            what="variant b running",
        )
        run.send_signal(signum)
        assert run.wait(timeout=60) == 130
    finally:
        run.kill()
    assert "interrupted" in (tmp_path / "run.log").read_text()
    res = results(out)
    assert not res["complete"] and len(res["variants"]["a"]["repeats"]) == 1
    pids = [
        int(line.split("pid=")[1].split()[0])
        for log in (out / "workers").iterdir()
        for line in log.read_text().splitlines()
        if "worker_welcomed" in line
    ]
    assert len(pids) == 2

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(lambda: all(gone(p) for p in pids), timeout=60, what="workers to exit")


# --------------------------------------------------------------------------- across an interface


def _netns_reason() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "network namespaces need root on Linux"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"foltr-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def test_server_and_worker_in_two_namespaces_joined_by_a_veth_pair(tmp_path, mq2008_dir):
    reason = _netns_reason()
    if reason is not None:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns_s, ns_w, veth = f"foltr-s-{tag}", f"foltr-w-{tag}", f"fv{tag}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    path = write_scenario(tmp_path / "z.toml", mq2008_dir, rounds=6)
    keys, out = tmp_path / "keys", tmp_path / "out"
    subprocess.run([*CLI, "keys", "init", str(keys)], cwd=ROOT, check=True, capture_output=True)
    try:
        ip("netns", "add", ns_s)
        ip("netns", "add", ns_w)
        ip("link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b")
        ip("link", "set", f"{veth}a", "netns", ns_s)
        ip("link", "set", f"{veth}b", "netns", ns_w)
        ip("-n", ns_s, "addr", "add", "10.231.7.1/30", "dev", f"{veth}a")
        ip("-n", ns_w, "addr", "add", "10.231.7.2/30", "dev", f"{veth}b")
        for ns, dev in ((ns_s, f"{veth}a"), (ns_w, f"{veth}b")):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        inside = ["ip", "netns", "exec"]
        with open(tmp_path / "serve.log", "wb") as fh:
            server = subprocess.Popen(
                [
                    *inside,
                    ns_s,
                    *CLI,
                    "serve",
                    str(path),
                    "--bind",
                    "tcp://10.231.7.1:5555",
                    "--keys",
                    str(keys),
                    "--out",
                    str(out),
                    "--quiet",
                ],
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        try:
            worker = subprocess.run(
                [
                    *inside,
                    ns_w,
                    *CLI,
                    "join",
                    str(path),
                    "--connect",
                    "tcp://10.231.7.1:5555",
                    "--agents",
                    "client-0..client-5",
                    "--keys",
                    str(keys),
                    "--name",
                    "worker-0",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert worker.returncode == 0, worker.stderr[-2000:]
            assert server.wait(timeout=60) == 0
        finally:
            server.kill()
        counters = subprocess.run(
            [*inside, ns_w, "cat", f"/sys/class/net/{veth}b/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert int(counters.stdout) > 10_000  # the traffic really crossed the interface
    finally:
        for ns in (ns_s, ns_w):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert_same_metrics(memory_results(path, tmp_path), results(out))

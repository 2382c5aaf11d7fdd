"""Reliability under hostile input: a seeded wire fuzz against a live server on both transports.

Every fuzz case is built to be dropped (its reason predicted before it is sent), so the run
must end exactly as the unfuzzed one (metrics, messages sent and delivered) with the drops
added by reason, and memory must stay bounded whatever the headers say.
"""

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import zmq
from conftest import free_port

from foltr_async.observe.observer import Observer
from foltr_async.rng import stream
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.clock import run
from foltr_async.runtime.wire import DropMessage, Envelope, decode, encode
from foltr_async.runtime.zmq_wire import pack_control
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 64 * 1024  # the memory run's size limit: oversized cases stay small
HUGE_SEQS = (2**33, 2**62, 2**64 - 1)


def scenario(tmp_path: Path, data: Path, rounds: int = 10, round_gap: float = 0.0) -> Path:
    path = tmp_path / "fuzz.toml"
    path.write_text(f"""
[scenario]
name = "fuzz"
seed = 5
[dataset]
path = "{data.as_posix()}"
[federation]
protocol = "fpdgd"
clients = 4
queries_per_client = 3
rounds = {rounds}
round_gap = {round_gap}
[evaluation]
every = 2
""")
    return path


def reencode(data: bytes, **change) -> bytes:
    """A captured envelope with header fields changed (the body kept as it was)."""
    obj = msgpack.unpackb(data, raw=False)
    obj.update(change)
    return msgpack.packb(obj)


def predicted(data: bytes, max_bytes: int) -> str | None:
    """The reason decoding drops these bytes for, or None when they decode."""
    try:
        decode(data, max_bytes=max_bytes)
    except DropMessage as e:
        return e.reason
    return None


def fuzz_cases(
    rng: np.random.Generator, captured: list[bytes], max_bytes: int
) -> list[tuple[bytes, str]]:
    """(bytes, reason) for one batch: each case's drop reason as the receiver will give it.

    ``captured`` are envelopes already delivered, so a replay of one is refused."""
    cases: list[tuple[bytes, str]] = []
    for data in (captured[i] for i in rng.choice(len(captured), 6, replace=False)):
        env = decode(data)
        cases.append((data, "replayed"))
        cases.append((data[: int(rng.integers(1, len(data)))], "malformed"))
        for _ in range(4):  # random byte flips; the ones that still decode are not sent
            buf = bytearray(data)
            for pos in rng.integers(0, len(buf), size=int(rng.integers(1, 6))):
                buf[pos] = int(rng.integers(0, 256))
            reason = predicted(bytes(buf), max_bytes)
            if reason is not None:
                cases.append((bytes(buf), reason))
        cases.append((reencode(data, seq=HUGE_SEQS[rng.integers(len(HUGE_SEQS))]), "seq_ahead"))
        cases.append((reencode(data, kind="fuzz.unknown"), "unknown_kind"))
        cases.append((reencode(data, v=99), "bad_version"))
        bad_body = {**env.body, next(iter(env.body), "x"): "not the right type", "zz": 1}
        cases.append((reencode(data, body=bad_body), "bad_schema"))
        cases.append((reencode(data, body={"pad": b"\0" * max_bytes}), "oversized"))
        cases.append((reencode(data, src=env.src + "x" * 300), "malformed"))
    cases.append((rng.bytes(int(rng.integers(1, 200))), "malformed"))
    cases.append((b"", "malformed"))
    for data, reason in cases:
        assert predicted(data, max_bytes) == (
            None if reason in ("replayed", "seq_ahead") else reason
        )
    return cases


class FuzzedBus(MemoryBus):
    """A memory bus that, at the start of each round after the first, injects a seeded batch of
    fuzz cases built from the messages it carried in earlier rounds (all delivered by then)."""

    def __init__(self, *args, seed: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.rng = np.random.default_rng(seed)
        self.captured: list[bytes] = []
        self.expected: Counter[str] = Counter()
        self.tap(lambda data, header: self.captured.append(data))

    def begin_round(self, round, agent_ids):  # noqa: ANN001
        if round > 1:
            for data, reason in fuzz_cases(self.rng, self.captured, self.max_bytes):
                dst = decode(data).dst if reason in ("replayed", "seq_ahead") else "server"
                self.inject(data, dst)
                self.expected[reason] += 1
            self.inject(self.captured[0], "client-0002")  # a copy to another receiver
            self.expected["misrouted"] += 1
        return super().begin_round(round, agent_ids)


def simulate(cfg: dict, fuzz: bool) -> tuple[dict, MemoryBus, int]:
    """One run in virtual time; returns the result, its bus and the peak traced memory."""
    net = cfg.new_network()
    if fuzz:
        bus = FuzzedBus(net, stream(5, "net"), max_bytes=MAX_BYTES, seed=123)
    else:
        bus = MemoryBus(net, stream(5, "net"), max_bytes=MAX_BYTES)
    sim = Simulation(cfg, 5, Observer(), bus=bus)
    tracemalloc.start()
    try:
        result = run(sim.run())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, bus, peak


def test_memory_bus_fuzz_drops_every_case_by_reason_and_the_run_ends_as_unfuzzed(
    tmp_path, mq2008_dir
):
    cfg = load_scenario(scenario(tmp_path, mq2008_dir)).variants["default"]
    clean, _, _ = simulate(cfg, fuzz=False)
    fuzzed, bus, peak = simulate(cfg, fuzz=True)
    n_cases = sum(bus.expected.values())
    print(f"memory fuzz: {n_cases} cases, drops {dict(bus.expected)}, traced peak "
          f"{peak / 1e6:.2f} MB")  # fmt: skip
    assert n_cases > 500 and len(bus.expected) == 8  # every kind of case was tried
    for key in ("rounds", "offline", "online", "late_replies"):
        assert fuzzed[key] == clean[key], key
    m, c = fuzzed["messages"], clean["messages"]
    assert (m["sent"], m["delivered"], m["injected"]) == (c["sent"], c["delivered"], n_cases)
    assert Counter(m["dropped"]) == Counter(c["dropped"]) + bus.expected
    # the data is cached by the unfuzzed run: the fuzzed run's own allocations stay small
    # (oversized cases are 64 KB each, dropped before decoding; a huge seq cost gigabytes)
    assert peak < 8 * 1024 * 1024


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def test_zmq_hub_fuzz_from_a_connected_peer_is_dropped_by_reason_and_the_run_ends_as_in_memory(
    tmp_path, mq2008_dir
):
    """A peer that says a valid hello (hosting no clients) floods the live server's hub with
    the memory fuzz's cases, envelopes as other agents, stale runs, huge seqs and garbage
    control frames while two workers' clients train: the run's metrics and message counts
    are the memory run's, every fuzz frame is a counted drop and the server's memory stays
    flat. Oversized envelopes are just over the run's message limit (the hub's frame limit
    is above it: they reach the codec, which drops and counts them)."""
    from foltr_async.distributed.control import wire_limits

    path = scenario(tmp_path, mq2008_dir, rounds=12, round_gap=0.4)
    limits = wire_limits(load_scenario(path))
    port, out = free_port(), tmp_path / "zmq"
    cli = [sys.executable, "-m", "foltr_async"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def spawn(*args: str, log: str, extra_env: dict | None = None) -> subprocess.Popen:
        with open(tmp_path / log, "wb") as fh:
            return subprocess.Popen([*cli, *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    env={**env, **(extra_env or {})})  # fmt: skip

    # glibc raises its mmap threshold to the size of a freed mmapped block, so after the first
    # large frame the next one may come from the heap and stay in RSS when freed: that is the
    # allocator, not the hub holding frames. A fixed threshold keeps RSS a measure of the hub.
    server = spawn("serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--out", str(out), "--quiet", log="serve.log",
                   extra_env={"MALLOC_MMAP_THRESHOLD_": "131072"})  # fmt: skip
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure"]
    workers = [
        spawn(*join, "--agents", "client-0..client-1", log="w0.log"),
        spawn(*join, "--agents", "client-2..client-3", log="w1.log"),
    ]
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.routing_id = b"fuzzer"
    peer.linger = 0
    expected: Counter[str] = Counter()
    rng = np.random.default_rng(7)
    try:
        deadline = time.monotonic() + 60
        while sum(e["event"] == "worker_joined" for e in events(out)) < 2:
            assert time.monotonic() < deadline, "the workers did not join"
            time.sleep(0.05)
        time.sleep(0.5)  # the first rounds are on: fuzz while clients train
        peer.connect(f"tcp://127.0.0.1:{port}")
        hello = {"t": "hello", "worker": "fuzzer", "claims": [], "host": "h", "pid": 1, "run": 0}
        peer.send_multipart([b"C", pack_control(hello)])
        time.sleep(0.3)
        honest = encode(
            Envelope("fpdgd.update", "client-0001", "server",
                     {"params": np.zeros(46), "n_interactions": 3}, 1, 1, 0.0)
        )  # fmt: skip
        run_1 = (1).to_bytes(4, "little") + bytes(8)
        rss = []
        for _ in range(3):  # the same volume three times: memory must not grow with it
            for data, reason in fuzz_cases(rng, [honest] * 6, limits.message):
                peer.send_multipart([b"M", run_1, b"server", data])
                expected["unauthenticated" if reason in ("replayed", "seq_ahead") else reason] += 1
            time.sleep(0.3)
            rss.append(rss_kb(server.pid))
        for _ in range(20):
            peer.send_multipart([b"M", (9).to_bytes(4, "little") + bytes(8), b"server", honest])
            expected["stale_run"] += 1
        control = Counter()
        for _ in range(50):
            peer.send_multipart([b"C", rng.bytes(int(rng.integers(1, 64)))])
            peer.send_multipart([b"C", pack_control({"t": "flush", "run": 1, "flush": 0})])
            peer.send_multipart([b"C", pack_control({"t": "spam"})])
            peer.send_multipart([b"Z", b"1", b"2"])
            control.update(bad_control=2, bad_frame=1)
        time.sleep(0.3)
        rss.append(rss_kb(server.pid))
        assert server.wait(timeout=120) == 0
        assert all(w.wait(timeout=30) == 0 for w in workers)
    finally:
        peer.close()
        ctx.term()
        for p in (server, *workers):
            p.kill()
    rep = json.loads((out / "results.json").read_text())["variants"]["default"]["repeats"][0]
    mem = run_memory(path, tmp_path)
    n_cases = sum(expected.values())
    dropped = rep["transport"]["frames_dropped"]
    print(f"zmq fuzz: {n_cases} data frames {dict(expected)}, control {dropped}, "
          f"server RSS after each batch {rss} kB")  # fmt: skip
    for key in ("rounds", "offline", "online", "late_replies"):
        assert rep[key] == mem[key], key
    m, c = rep["messages"], mem["messages"]
    assert (m["sent"], m["delivered"]) == (c["sent"], c["delivered"])
    assert Counter(m["dropped"]) == Counter(c["dropped"]) + expected
    undecodable = dropped.pop("undecodable")
    assert dropped == dict(control) and 0 < undecodable <= 50  # a few random bytes decode
    assert rep["transport"]["workers"] == 3  # the fuzzer said a valid hello: a worker
    # after the first batch (oversized frames went through the hub's buffers), further batches
    # and the garbage control frames leave the server's memory flat
    assert rss[-1] - rss[0] < 16 * 1024, rss


def run_memory(path: Path, tmp_path: Path) -> dict:
    from foltr_async.experiment import run_scenario

    res = run_scenario(load_scenario(path), tmp_path / "memory", Observer())
    return res["variants"]["default"]["repeats"][0]


# --------------------------------------------------------------------------- wire limits


HELLO = {"t": "hello", "worker": "w", "claims": [0], "host": "h", "pid": 1, "run": 0}


async def _until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_wire_limits_come_from_the_run_and_stay_far_below_the_old_64_mb(tmp_path, mq2008_dir):
    """The limits follow the run's model and federation: a 4-client MQ2008 run takes data
    messages under 100 KB and frames of 4 MB, not 64 MB, and what one peer can queue at the
    hub is bounded (the old hub: 10^6 frames of up to 64 MB)."""
    from foltr_async.distributed.control import wire_limits

    limits = wire_limits(load_scenario(scenario(tmp_path, mq2008_dir)))
    print(f"limits: frame {limits.frame} B, message {limits.message} B, hwm {limits.hwm}, "
          f"held per peer {limits.held / 2**20:.0f} MiB")  # fmt: skip
    assert limits.clients == 4 and limits.message < 100_000 and limits.frame == 4 * 2**20
    assert limits.held <= 2**30
    sets = ["federation.clients=400", 'ranker.kind="mlp"', "ranker.hidden=[4000]"]
    bigger = wire_limits(load_scenario(scenario(tmp_path, mq2008_dir), sets))
    assert bigger.clients == 400 and bigger.message > limits.message + 16 * 8 * 46 * 4000
    assert bigger.frame == 2 * bigger.message


async def test_a_stranger_gets_a_size_checked_hello_before_anything_is_unpacked():
    """Before a valid hello a control frame may be a few kilobytes; a hello may claim only the
    run's clients; an introduced peer's control frame may not ask for millions of items.
    The old hub unpacked a 57 MB frame of one-byte items (4.4 GB) from anyone and kept ten
    hellos of 2 M claims (1.5 GB) to the end of the run."""
    import zmq.asyncio

    from foltr_async.runtime.zmq_endpoints import Hub
    from foltr_async.runtime.zmq_wire import WireLimits

    hub = Hub("tcp://127.0.0.1:0", keys=None, limits=WireLimits(clients=8, items=1000))
    endpoint = await hub.start()
    ctx = zmq.asyncio.Context()
    socks = []

    def peer(name: bytes) -> zmq.asyncio.Socket:
        s = ctx.socket(zmq.DEALER)
        s.routing_id, s.linger = name, 0
        s.connect(endpoint)
        socks.append(s)
        return s

    try:
        stranger = peer(b"stranger")
        # a 2 MB array of tiny items: dropped by its size, never unpacked
        await stranger.send_multipart([b"C", msgpack.packb([0] * (2 << 20))])
        # a hello claiming 2 M clients (the run has 8): the length limit refuses it unbuilt
        await stranger.send_multipart([b"C", pack_control({**HELLO, "claims": list(range(20000))})])
        # a hello claiming a client the run does not have
        await stranger.send_multipart([b"C", pack_control({**HELLO, "claims": [8]})])
        await _until(lambda: sum(hub.dropped.values()) == 3)
        assert dict(hub.dropped) == {"oversized_control": 1, "undecodable": 1, "bad_control": 1}
        assert hub.peers == {}
        worker = peer(b"worker")
        await worker.send_multipart([b"C", pack_control(HELLO)])
        await _until(lambda: b"worker" in hub.peers)
        bomb = pack_control({"t": "flush", "run": 1, "flush": {"x": [0] * 5000}})
        await worker.send_multipart([b"C", bomb])
        await _until(lambda: hub.dropped["undecodable"] == 2)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        await hub.close(bye=False)


async def test_a_worker_building_its_run_is_not_lost_for_its_silence_and_is_after():
    """A worker that builds its run's agents (data, compiled code) blocks its own loop, so its
    heartbeats stop: on a loaded machine a 2 s heartbeat timeout declared such workers lost
    before round 1. While the server waits for its answer the silence is not a loss; after,
    it is one again."""
    import zmq.asyncio

    from foltr_async.runtime.zmq_endpoints import Hub

    lost, building = [], set()
    hub = Hub("tcp://127.0.0.1:0", keys=None, heartbeat=0.05, timeout=0.3, on_lost=lost.append,
              preparing=building)  # fmt: skip
    endpoint = await hub.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id, sock.linger = b"worker", 0
    sock.connect(endpoint)
    try:
        building.add(b"worker")  # before the hello: a stalled test loop cannot lose it early
        await sock.send_multipart([b"C", pack_control(HELLO)])
        await _until(lambda: b"worker" in hub.peers)
        await asyncio.sleep(1.0)  # three timeouts of silence
        assert lost == [] and b"worker" in hub.peers
        building.discard(b"worker")
        await _until(lambda: lost == [b"worker"], timeout=30)  # loose: a loaded machine
    finally:
        sock.close(linger=0)
        ctx.term()
        await hub.close(bye=False)


async def test_a_junk_flood_is_handled_in_batches_so_the_loop_stays_responsive():
    """40 k junk control frames queued at once: the hub counts them all while the rest of its
    event loop (heartbeats, rounds) keeps running. The old receive loop handled every queued
    frame before yielding: the loop stalled for the whole backlog and workers timed out."""
    from foltr_async.runtime.zmq_endpoints import Hub

    n = 40_000
    hub = Hub("tcp://127.0.0.1:0", keys=None)
    endpoint = await hub.start()
    ctx = zmq.Context()
    flooder = ctx.socket(zmq.DEALER)
    flooder.linger, flooder.sndtimeo = 0, 20_000  # a send that cannot go in 20 s gives up
    flooder.connect(endpoint)
    junk = [bytes([0xC1]) + np.random.default_rng(i).bytes(i % 200) for i in range(64)]

    def flood() -> None:
        with contextlib.suppress(zmq.Again):
            for i in range(n):
                flooder.send_multipart([b"C", junk[i % 64]])

    lags: list[float] = []
    stop = False

    async def probe() -> None:
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    try:
        sender = threading.Thread(target=flood)
        sender.start()
        time.sleep(1.0)  # the loop is busy elsewhere while the frames queue up
        task = asyncio.ensure_future(probe())
        started = time.monotonic()
        await _until(lambda: hub.dropped["undecodable"] >= n, timeout=60)
        took = time.monotonic() - started
        stop = True
        await task
        sender.join(timeout=30)
    finally:
        flooder.close(linger=0)
        ctx.term()
        await hub.close(bye=False)
    print(f"{n} junk frames counted in {took:.2f} s; loop lag max {max(lags) * 1e3:.1f} ms "
          f"over {len(lags)} probes")  # fmt: skip
    assert hub.dropped["undecodable"] == n
    # the loop kept running its other tasks between batches of the backlog (a receive loop that
    # handled every queued frame before yielding let the probe run once or twice); a count of
    # turns, not a time: a loaded machine only makes the backlog, and the turns, longer
    assert len(lags) > 10


async def test_a_frame_over_the_limit_is_refused_before_the_hub_holds_it():
    """libzmq disconnects a peer whose frame is over ``limits.frame`` while reading its size:
    the hub never buffers or sees it (the old hub took frames of up to 64 MB)."""
    import zmq.asyncio

    from foltr_async.runtime.zmq_endpoints import Hub
    from foltr_async.runtime.zmq_wire import WireLimits

    hub = Hub("tcp://127.0.0.1:0", keys=None, limits=WireLimits(frame=64 * 1024))
    endpoint = await hub.start()
    ctx = zmq.asyncio.Context()
    big = ctx.socket(zmq.DEALER)
    big.linger = 0
    big.connect(endpoint)
    try:
        await big.send_multipart([b"C", bytes(8 << 20)])
        await big.send_multipart([b"C", b"\xc1"])  # after a reconnect: an ordinary junk frame
        small = ctx.socket(zmq.DEALER)
        small.linger = 0
        small.connect(endpoint)
        await small.send_multipart([b"C", b"\xc1" * 1000])
        await _until(lambda: hub.frames_in >= 1)
        await asyncio.sleep(0.3)
        small.close(linger=0)
        assert hub.largest_in < 64 * 1024 and hub.bytes_in < 64 * 1024
    finally:
        big.close(linger=0)
        ctx.term()
        await hub.close(bye=False)


def test_saved_states_are_split_under_the_frame_budget():
    """A checkpoint reply from a worker hosting many clients goes in parts under half a
    frame, never one frame that grows with the clients it hosts."""
    from foltr_async.distributed.worker import _split

    agents = {f"client-{i:04d}": {"state": "joined", "blob": bytes(3000)} for i in range(10)}
    parts = _split(agents, 10_000)
    assert [len(p) for p in parts] == [3, 3, 3, 1]
    assert {a: e for p in parts for a, e in p.items()} == agents
    assert all(len(pack_control(p)) <= 10_000 for p in parts)
    assert _split({"big": {"blob": bytes(50_000)}, "x": {}}, 10_000)[0] == {
        "big": {"blob": bytes(50_000)}
    }


async def test_a_worker_that_never_reads_loses_frames_counted_not_queued_without_bound():
    """Sends to a worker whose queue is full are dropped and counted: the old hub waited for
    room, holding every pending frame in memory."""
    import zmq.asyncio

    from foltr_async.runtime.zmq_endpoints import Hub
    from foltr_async.runtime.zmq_wire import WireLimits

    hub = Hub("tcp://127.0.0.1:0", keys=None, limits=WireLimits(hwm=8, send_hwm=8))
    endpoint = await hub.start()
    ctx = zmq.asyncio.Context()
    sleeper = ctx.socket(zmq.DEALER)
    sleeper.routing_id, sleeper.linger, sleeper.rcvhwm = b"sleeper", 0, 8
    sleeper.setsockopt(zmq.RCVBUF, 4096)
    sleeper.connect(endpoint)
    failed = []
    try:
        await sleeper.send_multipart([b"C", pack_control(HELLO)])
        await _until(lambda: b"sleeper" in hub.peers)
        frame = bytes(256 * 1024)
        for _ in range(400):  # 100 MB offered; the kernel's buffers take a few of them
            hub.send(b"sleeper", [b"M", frame], lambda: failed.append(1))
        await _until(lambda: hub.dropped["send_queue_full"] > 0)
        await asyncio.sleep(0.2)
        assert len(failed) == hub.dropped["send_queue_full"] > 300
    finally:
        sleeper.close(linger=0)
        ctx.term()
        await hub.close(bye=False)


def test_a_control_flood_from_a_worker_is_counted_while_the_run_goes_on(tmp_path, mq2008_dir):
    """Three seconds of random 1-512-byte control frames from a peer that said a valid hello,
    while two workers' clients train: every round still gets every client's reply, every
    junk frame is a counted drop (reported in results.json and on the console) and the log
    gets a line per reason, not per frame. The old hub logged each frame (220 k lines), its
    heartbeats starved, the workers dropped their runs and no later round got a reply."""
    path = scenario(tmp_path, mq2008_dir, rounds=20, round_gap=0.2)
    port, out = free_port(), tmp_path / "zmq"
    cli = [sys.executable, "-m", "foltr_async"]
    logs = []

    def spawn(*args: str) -> subprocess.Popen:
        logs.append(open(tmp_path / f"p{len(logs)}.log", "wb"))  # noqa: SIM115
        return subprocess.Popen([*cli, *args], cwd=ROOT, stdout=logs[-1],
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip

    server = spawn("serve", str(path), "--bind", f"tcp://127.0.0.1:{port}", "--insecure",
                   "--out", str(out))  # fmt: skip
    join = ["join", str(path), "--connect", f"tcp://127.0.0.1:{port}", "--insecure",
            "--heartbeat-timeout", "5"]  # fmt: skip
    workers = [spawn(*join, "--agents", a) for a in ("client-0..client-1", "client-2..client-3")]
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.routing_id, peer.linger, peer.sndtimeo = b"flooder", 0, 1000
    rng = np.random.default_rng(3)
    sent = 0
    try:
        deadline = time.monotonic() + 60
        while sum(e["event"] == "worker_joined" for e in events(out)) < 2:
            assert time.monotonic() < deadline, "the workers did not join"
            time.sleep(0.05)
        peer.connect(f"tcp://127.0.0.1:{port}")
        hello = {"t": "hello", "worker": "f", "claims": [], "host": "h", "pid": 1, "run": 0}
        peer.send_multipart([b"C", pack_control(hello)])
        time.sleep(0.3)
        junk = [rng.bytes(int(n)) for n in rng.integers(1, 513, size=1024)]
        end = time.monotonic() + 3
        # 3 s or 40,000 frames: a fast machine's flood (170,000 frames idle) is then no longer
        # than a loaded one can count before the run ends
        while time.monotonic() < end and sent < 40_000:
            with contextlib.suppress(zmq.Again):
                peer.send_multipart([b"C", junk[sent % 1024]])
                sent += 1
        assert server.wait(timeout=180) == 0
        assert all(w.wait(timeout=30) == 0 for w in workers)
    finally:
        peer.close()
        ctx.term()
        for p in (server, *workers):
            p.kill()
        for fh in logs:
            fh.close()
    rep = json.loads((out / "results.json").read_text())["variants"]["default"]["repeats"][0]
    replied = {e["round"]: e["replied"] for e in events(out) if e["event"] == "aggregation"}
    dropped = rep["transport"]["frames_dropped"]
    lines = [e for e in events(out) if e["event"] == "hub_frame_dropped"]
    print(f"{sent} junk frames in up to 3 s: dropped {dropped}, {len(lines)} log lines, "
          f"replies per round {sorted(set(replied.values()))}")  # fmt: skip
    assert sent > 1000 and sum(dropped.values()) == sent
    assert sorted(replied) == list(range(1, 21)) and set(replied.values()) == {4}
    assert len(lines) <= 2 * len(dropped)  # a line per reason (and one more per 10 s)
    console = (tmp_path / "p0.log").read_text()
    assert "default repeat 0: at the hub: " in console
    assert f"undecodable {dropped['undecodable']}" in console
    assert not any(e["event"] == "worker_lost" for e in events(out))

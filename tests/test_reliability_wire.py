"""Reliability under hostile input: a seeded wire fuzz against a live server on both transports.

Every fuzz case is built to be dropped (its reason predicted before it is sent), so the run
must end exactly as the unfuzzed one (metrics, messages sent and delivered) with the drops
added by reason, and memory must stay bounded whatever the headers say.
"""

import json
import os
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import zmq

import foltr_async.protocols.fpdgd  # noqa: F401  (registers the message kinds the fuzz mutates)
from foltr_async.observe.observer import Observer
from foltr_async.rng import stream
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.clock import run
from foltr_async.runtime.codec import DropMessage, Envelope, decode, encode
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.zmqbus import pack_control
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
    net = NetworkModel.from_dict(cfg["network"])
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    flat."""
    path = scenario(tmp_path, mq2008_dir, rounds=12, round_gap=0.4)
    port, out = free_port(), tmp_path / "zmq"
    cli = [sys.executable, "-m", "foltr_async"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def spawn(*args: str, log: str, extra_env: dict | None = None) -> subprocess.Popen:
        with open(tmp_path / log, "wb") as fh:
            return subprocess.Popen([*cli, *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    env={**env, **(extra_env or {})})  # fmt: skip

    # glibc raises its mmap threshold to the size of a freed mmapped block, so after the first
    # 16 MB frame the next one may come from the heap and stay in RSS when freed: that is the
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
        hello = {"t": "hello", "worker": "fuzzer", "claims": [], "host": "h", "pid": 1}
        peer.send_multipart([b"C", pack_control(hello)])
        time.sleep(0.3)
        honest = encode(
            Envelope("fpdgd.update", "client-0001", "server",
                     {"params": np.zeros(46), "n_interactions": 3}, 1, 1, 0.0)
        )  # fmt: skip
        run_1 = (1).to_bytes(4, "little") + bytes(8)
        rss = []
        for _ in range(3):  # the same volume three times: memory must not grow with it
            big = 0
            for data, reason in fuzz_cases(rng, [honest] * 6, 16 * 1024 * 1024):
                big += reason == "oversized"
                if reason == "oversized" and big > 1:
                    continue  # one 16 MB frame per batch: the hub must drain it before the end
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
    # after the first batch (a 16 MB frame went through the hub's buffers), further batches
    # and the garbage control frames leave the server's memory flat
    assert rss[-1] - rss[0] < 16 * 1024, rss


def run_memory(path: Path, tmp_path: Path) -> dict:
    from foltr_async.experiment import run_scenario

    res = run_scenario(load_scenario(path), tmp_path / "memory", Observer())
    return res["variants"]["default"]["repeats"][0]

"""Reliability against a connected peer that lies: nothing a worker sends forges the results,
exhausts the server or ends the run.

A *rogue* is a raw DEALER socket that speaks the control protocol itself (a hello, the run's
``ready``, acks, flushes, updates with forged contents) beside honest ``join`` workers; the
server must take only what the rogue's own assigned clients could have produced, count the
rest, and finish the run with exit 0.
"""

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import zmq
from conftest import free_port

from foltr_async.runtime.wire import Envelope, encode
from foltr_async.runtime.zmq_wire import pack_control, unpack_control

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "foltr_async"]
RUN = struct.Struct("<Id")
UPDATE = "fpdgd.update"


def scenario(tmp_path: Path, data: Path, rounds: int = 8, extra: str = "", **fed) -> Path:
    fed = {"protocol": '"fpdgd"', "clients": 4, "queries_per_client": 3, "rounds": rounds, **fed}
    lines = "\n".join(f"{k} = {v}" for k, v in fed.items())
    path = tmp_path / "trust.toml"
    path.write_text(f"""
[scenario]
name = "trust"
seed = 5
[dataset]
path = "{data.as_posix()}"
[federation]
{lines}
[evaluation]
every = 2
{extra}
""")
    return path


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def repeat_of(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["variants"]["default"]["repeats"][0]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Rogue(threading.Thread):
    """A peer that says hello claiming ``claims`` and answers the server's control requests
    as a worker would, hosting nothing: ``ready`` lists ``ready_states(run message)``; a
    model to one of its clients is answered by the replies ``update(round, params)`` lists
    (FPDGD), or by the ``(kind, body)`` replies ``reply(kind, round, body)`` lists (any
    protocol); ``on_run(rogue)`` runs once the run message came (forged flushes, floods)."""

    def __init__(
        self,
        endpoint: str,
        claims: list[int],
        *,
        name: str = "rogue",
        ready_states: Callable[[dict], dict] | None = None,
        update: Callable[[int, np.ndarray], list[tuple]] | None = None,
        reply: Callable[[str, int, dict], list[tuple[str, dict]]] | None = None,
        on_run: Callable[["Rogue"], None] | None = None,
        on_welcome: Callable[["Rogue"], None] | None = None,
        quit_after_run: float | None = None,
        curve: tuple[bytes, bytes, bytes] | None = None,
        ready_after: float = 0.0,
    ) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.claims, self.name = endpoint, claims, name
        self.ready_states = ready_states or (
            lambda msg: {a: ["joined", "client"] for a in msg["agents"]}
        )
        self.update, self.on_run, self.quit_after_run = update, on_run, quit_after_run
        self.reply = reply
        self.on_welcome = on_welcome
        self.ready_after = ready_after  # seconds before it answers the run (after the others)
        self.done = threading.Event()  # set once on_run / on_welcome returned
        self.run_id = 0
        self.seq = 0
        self.sent_updates = 0
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.routing_id = f"{name}@test".encode()
        self.sock.linger = 0
        if curve is not None:  # (its public key, its secret key, the server's public key)
            pub, sec, server = curve
            self.sock.curve_publickey, self.sock.curve_secretkey = pub, sec
            self.sock.curve_serverkey = server

    def control(self, msg: dict) -> None:
        self.sock.send_multipart([b"C", pack_control(msg)])

    def flush(self, shown=None, extras=None, stats=None) -> dict:
        owners, owner, rounds, values = shown or ([], [], [], [])
        return {
            "shown": {
                "owners": owners,
                "owner": np.asarray(owner, dtype=np.int32),
                "rounds": np.asarray(rounds, dtype=np.int64),
                "values": np.asarray(values, dtype=np.float64),
            },
            "extras": extras or {},
            "stats": stats or {"delivered": 0, "bytes_delivered": 0, "dropped": {}, "kinds": {}},
        }

    def send_update(self, src: str, round: int, params: np.ndarray, n: int) -> None:
        self.send_reply(src, round, UPDATE, {"params": params, "n_interactions": n})

    def send_reply(self, src: str, round: int, kind: str, body: dict) -> None:
        self.seq += 1
        env = Envelope(kind, src, "server", body, round, self.seq, 0.0)
        self.sock.send_multipart([b"M", RUN.pack(self.run_id, 0.0), b"server", encode(env)])
        self.sent_updates += 1

    def run(self) -> None:
        self.sock.connect(self.endpoint)
        hello = {"t": "hello", "worker": self.name, "claims": self.claims, "host": "h",
                 "pid": 1, "run": 0}  # fmt: skip
        self.control(hello)
        ran_at = None
        while not self.stop.is_set():
            gone = self.quit_after_run is not None and ran_at is not None
            if gone and time.monotonic() - ran_at > self.quit_after_run:
                break  # gone without a word: the server notices by its heartbeats
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            if frames[0] == b"C":
                msg = unpack_control(frames[1])
                ran_at = self._control(msg) or ran_at
            elif frames[0] == b"B" and (self.update or self.reply) is not None:
                src, kind, rnd, _, dsts, _, _ = msgpack.unpackb(frames[2])
                body = msgpack.unpackb(frames[3], ext_hook=_array)
                for dst in dsts:
                    if self.reply is not None:
                        for reply_kind, reply in self.reply(kind, rnd, body):
                            self.send_reply(dst, rnd, reply_kind, reply)
                    elif kind == "fpdgd.model":
                        for reply in self.update(rnd, body["params"]):
                            self.send_update(dst, rnd, *reply)
        self.sock.close(0)
        self.ctx.term()

    def _control(self, msg: dict) -> float | None:
        t, req = msg["t"], msg.get("req")
        if t == "hb":
            self.control({"t": "hb"})
        elif t == "run":
            self.run_id = msg["run"]
            time.sleep(self.ready_after)
            self.control({"t": "ready", "req": req, "states": self.ready_states(msg)})
            if self.on_run is not None:
                self.on_run(self)
                self.done.set()
            return time.monotonic()
        elif t == "act":
            self.control({"t": "ack", "req": req, "states": {msg["agent"]: ["joined", "client"]}})
        elif t == "snap":
            self.control({"t": "snapped", "req": req, "agents": {}, "flush": self.flush()})
        elif t == "end":
            self.control({"t": "done", "req": req, "flush": self.flush()})
        elif t == "welcome" and self.on_welcome is not None:
            self.on_welcome(self)
            self.on_welcome = None
            self.done.set()
        elif t == "bye":
            self.stop.set()
        return None


def echo(rnd: int, params: np.ndarray) -> list[tuple]:
    """An update as plain as it gets: the model back, 3 interactions."""
    return [(params.copy(), 3)]


def _array(code: int, data: bytes):
    from foltr_async.runtime.wire import _ext_hook

    return _ext_hook(code, data)


class Live:
    """``serve`` and honest ``join`` workers on loopback, their logs in ``tmp_path``."""

    def __init__(self, tmp_path: Path, path: Path, workers: list[str], *serve_args: str,
                 env: dict | None = None, preexec=None,
                 keys: Path | None = None) -> None:  # fmt: skip
        self.port, self.out, self.tmp = free_port(), tmp_path / "out", tmp_path
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.logs = []
        auth = ["--insecure"] if keys is None else ["--keys", str(keys)]
        self.server = self._spawn("serve", str(path), "--bind", self.endpoint, *auth,
                                  "--out", str(self.out), "--quiet", *serve_args, env=env,
                                  preexec=preexec)  # fmt: skip
        join = ["join", str(path), "--connect", self.endpoint, *auth]
        self.workers = [
            self._spawn(*join, "--agents", a, "--name", f"worker-{i}")
            for i, a in enumerate(workers)
        ]

    def _spawn(self, *args: str, env: dict | None = None, preexec=None) -> subprocess.Popen:
        fh = open(self.tmp / f"p{len(self.logs)}.log", "wb")  # noqa: SIM115
        self.logs.append(fh)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec, env=env)  # fmt: skip

    def joined(self, n: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(e["event"] == "worker_joined" for e in events(self.out)) < n:
            assert self.server.poll() is None, self.console()
            assert time.monotonic() < deadline, "the workers did not join"
            time.sleep(0.05)

    def finish(self, timeout: float = 180.0) -> int:
        try:
            code = self.server.wait(timeout=timeout)
            for w in self.workers:
                w.wait(timeout=30)
            return code
        finally:
            self.close()

    def close(self) -> None:
        for p in (self.server, *self.workers):
            if p.poll() is None:
                p.kill()
                p.wait()
        for fh in self.logs:
            fh.close()

    def console(self) -> str:
        return (self.tmp / "p0.log").read_text(errors="replace")


# --------------------------------------------------------------------------- frames


async def test_a_deeply_nested_control_frame_is_refused_at_decode_and_counted():
    """A 1,151-byte flush nested 1,000 deep decoded (msgpack allows 1,024 levels) and was
    merged into the results, whose writing overflowed Python's stack at the end of the repeat
    (RecursionError, exit 1). The hub refuses it unbuilt past 16 levels and counts it."""
    import zmq.asyncio

    from foltr_async.distributed.control import WORKER_CONTROL
    from foltr_async.runtime.zmq_endpoints import Hub

    got = []
    hub = Hub("tcp://127.0.0.1:0", keys=None, on_control=lambda p, m: got.append(m["t"]),
              control=WORKER_CONTROL)  # fmt: skip
    endpoint = await hub.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id, sock.linger = b"deep", 0
    sock.connect(endpoint)
    deep: object = 0
    for _ in range(1000):
        deep = [deep]
    try:
        await sock.send_multipart(
            [
                b"C",
                pack_control(
                    {"t": "hello", "worker": "w", "claims": [0], "host": "h", "pid": 1, "run": 0}
                ),
            ]
        )
        bomb = pack_control({"t": "flush", "run": 1, "flush": {"extras": {"x": deep}}})
        assert len(bomb) < 1200
        await sock.send_multipart([b"C", bomb])
        await sock.send_multipart([b"C", pack_control({"t": "error", "message": "still here"})])
        deadline = time.monotonic() + 10
        while "error" not in got:
            assert time.monotonic() < deadline, dict(hub.dropped)
            await asyncio.sleep(0.02)
        assert hub.dropped["too_deep"] == 1 and got == ["hello", "error"]
    finally:
        sock.close(linger=0)
        ctx.term()
        await hub.close(bye=False)


# --------------------------------------------------------------------------- updates


def _bad_updates(rnd: int, params: np.ndarray) -> list[tuple]:
    """Round by round: one float too many, one too few, empty, NaN, inf, x1e12, 2**64 - 1
    interactions, each followed by the model it got back (so the round need not wait for its
    deadline); round 8: that reply alone."""
    nan, inf = params.copy(), params.copy()
    nan[0], inf[1] = np.nan, np.inf
    bad = {
        1: (np.zeros(params.size + 1), 3),
        2: (np.zeros(params.size - 1), 3),
        3: (np.zeros(0), 3),
        4: (nan, 3),
        5: (inf, 3),
        6: (params * 1e12 + 1e12, 3),
        7: (params.copy(), 2**64 - 1),
    }
    return [bad[rnd], (params.copy(), 3)] if rnd in bad else [(params.copy(), 3)]


def test_bad_updates_from_a_worker_are_dropped_and_counted_and_the_run_ends(tmp_path, mq2008_dir):
    """A peer hosting client 3 answers rounds 1-7 with an update one float too long, one too
    short, empty, with NaN, inf, x1e12 and 2**64 - 1 interactions. The old server crashed in
    aggregation (ValueError, exit 1), stopped with exit 2 blaming the learning rate, or gave
    the forged client all of FedAvg's weight, uncounted. Each is dropped before aggregation
    and counted by reason in results.json; the median aggregator run also ends."""
    for aggregator in ("fedavg", "median"):
        tmp = tmp_path / aggregator
        tmp.mkdir()
        path = scenario(tmp, mq2008_dir, rounds=8, aggregator=f'"{aggregator}"')
        live = Live(tmp, path, ["client-0..client-2"])
        rogue = Rogue(live.endpoint, [3], update=_bad_updates)
        try:
            live.joined(1)
            rogue.start()
            code = live.finish()
        finally:
            rogue.stop.set()
            live.close()
        console = live.console()
        assert code == 0, console[-3000:]
        assert "learning rate" not in console and "diverged" not in console
        rep = repeat_of(live.out)
        dropped = rep["messages"]["dropped"]
        print(aggregator, {k: v for k, v in dropped.items() if k.startswith("update_")},
              rep["offline"]["ndcg@10"][-1])  # fmt: skip
        assert rogue.sent_updates == 15
        assert dropped["update_wrong_length"] == 3
        assert dropped["update_not_finite"] == 2
        assert dropped["update_too_large"] == 1
        assert dropped["update_interactions"] == 1
        assert rep["contributions"]["per_round"] == [4] * 8
        assert all(np.isfinite(rep["offline"]["ndcg@10"]))


CSFLTR_SMALL = """
[scenario]
name = "trust"
seed = 5
[dataset]
profile = "mq2007-like"
n_queries = 12
[federation]
protocol = "csfltr"
clients = 4
rounds = 5
[federation.params]
mode = "global"
docs_per_party = 200
vocab_size = 2000
topics = 6
body_len = 200
queries_per_party = 8
test_queries = 12
judged = [2, 4]
local_candidates = 10
stopwords = 30
[evaluation]
every = 2
"""


def _fedips_replies(kind: str, rnd: int, body: dict) -> list[tuple[str, dict]]:
    """FedIPS: round 1 a delta one float too long, 2 x1e12, 3 2**40 interactions, 4 NaN,
    each followed by a well-formed zero delta; later rounds the zero delta alone."""
    good = {"delta": np.zeros(body["params"].size), "n_interactions": 3, "em_examined": None,
            "em_shown": None, "em_relevance": None}  # fmt: skip
    nan = np.zeros(body["params"].size)
    nan[0] = np.nan
    bad = {
        1: {**good, "delta": np.zeros(body["params"].size + 1)},
        2: {**good, "delta": np.full(body["params"].size, 1e12)},
        3: {**good, "n_interactions": 2**40},
        4: {**good, "delta": nan},
    }
    return [("fedips.update", bad[rnd]), ("fedips.update", good)] if rnd in bad else [
        ("fedips.update", good)]  # fmt: skip


def _csfltr_replies(kind: str, rnd: int, body: dict) -> list[tuple[str, dict]]:
    """CS-F-LTR: round 1 a model one float too long, 2 x1e12, 3 2**40 queries (all of
    FedAvg's weight), each followed by the model it got back."""
    good = {"params": body["params"].copy(), "n_queries": 1, "instances": 10}
    bad = {
        1: {**good, "params": np.zeros(body["params"].size + 1)},
        2: {**good, "params": np.full(body["params"].size, 1e12)},
        3: {**good, "n_queries": 2**40},
    }
    return [("csfltr.update", bad[rnd]), ("csfltr.update", good)] if rnd in bad else [
        ("csfltr.update", good)]  # fmt: skip


def _central_replies(kind: str, rnd: int, body: dict) -> list[tuple[str, dict]]:
    """Centralised PDGD: round 1 a document offset far past its query's list, 2 a query
    number -1, 3 a query number past the training set, 4 clicks one column wider than the
    rankings, 5 a document shown twice, 6 a click on padding, 7 1,000 interactions (the
    client has 3), each followed by an empty log; later rounds the empty log alone."""
    k = 10

    def log(queries, rankings, clicks=None) -> dict:
        rankings = np.asarray(rankings, dtype=np.int64).reshape(len(queries), k)
        if clicks is None:
            clicks = np.zeros(rankings.shape, dtype=bool)
        return {"queries": np.asarray(queries, dtype=np.int64), "rankings": rankings,
                "clicks": clicks}  # fmt: skip

    row = list(range(k))
    pad = list(range(5)) + [-1] * 5
    padded_click = np.zeros((1, k), dtype=bool)
    padded_click[0, 7] = True
    bad = {
        1: log([0], [[10**6] + row[1:]]),
        2: log([-1], [row]),
        3: log([10**6], [row]),
        4: log([0], [row], np.zeros((1, k + 1), dtype=bool)),
        5: log([0], [[0, 0] + row[2:]]),
        6: log([0], [pad], padded_click),
        7: log([0] * 1000, [row] * 1000),
    }
    empty = log([], np.zeros((0, k)))
    return [("central.log", bad[rnd]), ("central.log", empty)] if rnd in bad else [
        ("central.log", empty)]  # fmt: skip


def test_bad_replies_of_every_protocol_s_server_are_dropped_and_counted(tmp_path, mq2008_dir):
    """A peer hosting one client answers FedIPS, CS-F-LTR (global mode) and centralised
    PDGD rounds with malformed replies: wrong lengths, x1e12, NaN, a weight (interactions,
    queries) far beyond the client's, click logs naming documents past their query's list,
    query numbers outside the training set, clicks of another shape, a document shown twice,
    a click on padding. The old servers had no screen for these protocols: a wrong length
    crashed FedIPS's and CS-F-LTR's aggregation and a bad log crashed centralised PDGD's
    PDGD step (exit 1), an oversized weight took all of CS-F-LTR's FedAvg. Each is dropped
    before aggregation and counted by reason; every run ends with exit 0 and finite
    metrics, every round aggregating every client's one good reply."""
    cases = {  # scenario, replies, rounds, drops expected, bad replies
        "fedips": ({"protocol": '"fedips"', "rounds": 6}, _fedips_replies, 6,
                   {"update_wrong_length": 1, "update_too_large": 1, "update_interactions": 1},
                   4),
        "csfltr": (None, _csfltr_replies, 5,
                   {"update_wrong_length": 1, "update_too_large": 1, "update_interactions": 1},
                   3),
        "pdgd_central": ({"protocol": '"pdgd_central"', "rounds": 8}, _central_replies, 8,
                         {"log_bad_ranking": 3, "log_bad_query": 2, "log_wrong_shape": 1,
                          "update_interactions": 1},
                         7),
    }  # fmt: skip
    for name, (fed, reply, rounds, expected, n_bad) in cases.items():
        tmp = tmp_path / name
        tmp.mkdir()
        if fed is None:
            path = tmp / "trust.toml"
            path.write_text(CSFLTR_SMALL)
        else:
            path = scenario(tmp, mq2008_dir, **fed)
        live = Live(tmp, path, ["client-0..client-2"])
        rogue = Rogue(live.endpoint, [3], reply=reply)
        try:
            live.joined(1)
            rogue.start()
            code = live.finish()
        finally:
            rogue.stop.set()
            live.close()
        assert code == 0, (name, live.console()[-3000:])
        rep = repeat_of(live.out)
        dropped = rep["messages"]["dropped"]
        print(name, dict(dropped))
        assert rogue.sent_updates == rounds + n_bad, name
        for reason, n in expected.items():
            assert dropped[reason] == n, (name, reason, dict(dropped))
        assert rep["contributions"]["per_round"] == [4] * rounds, name
        assert all(np.isfinite(rep["offline"]["ndcg@10"])), name


# --------------------------------------------------------------------------- measurements


def _forge(rogue: Rogue) -> None:
    """Flushes that try to overwrite the server's records: results fields and privacy as
    extras, another worker's client's rankings, a billion deliveries, NaN values."""
    run = rogue.run_id or 1
    forged = rogue.flush(
        shown=(["client-0000", "client-0003"], [0] * 500 + [1] * 500, [1] * 1000,
               [0.999] * 999 + [float("nan")]),
        extras={"offline": {"ndcg@10": [0.999]}, "privacy": {"epsilon": 0.001},
                "messages": {"delivered": 10**9}, "csfltr.measured": {"client-0000": 1},
                "replay": {"played": 10**6}},
        stats={"delivered": 10**9, "bytes_delivered": 10**12, "dropped": {}, "kinds": {}},
    )  # fmt: skip
    for _ in range(3):
        rogue.control({"t": "flush", "run": run, "flush": forged})
    deep: object = 0
    for _ in range(1000):
        deep = [deep]
    rogue.control({"t": "flush", "run": run, "flush": {**forged, "extras": {"x": deep}}})
    rogue.control({"t": "oracle", "run": run, "key": ["fpdgd.update", "client-0000"],
                   "value": [1, 2]})  # fmt: skip


def test_forged_measurements_change_nothing_the_server_computes(tmp_path, mq2008_dir):
    """Two peers, one claiming no clients, one hosting client 3, send flushes naming results
    fields, privacy and message counts as extras, 999 nDCGs of 0.999 for client 0 (another
    worker's) and for client 3 before it was sent any model, a billion deliveries, a NaN, and
    one flush nested 1,000 deep. The old server wrote them over its results (nDCG 0.999,
    epsilon 0.001, 10^9 deliveries, exit 0) or crashed on the deep one. Every results field
    equals the run's without the forgeries; what was refused is counted."""
    runs = {}
    for forged in (False, True):
        tmp = tmp_path / ("forged" if forged else "honest")
        tmp.mkdir()
        path = scenario(tmp, mq2008_dir, rounds=6)
        live = Live(tmp, path, ["client-0..client-2"])
        rogues = [
            Rogue(live.endpoint, [3], name="host", update=echo, on_run=_forge if forged else None),
            Rogue(live.endpoint, [], name="nobody", on_welcome=_forge if forged else None),
        ]
        try:
            live.joined(1)
            for r in rogues:
                r.start()
            code = live.finish()
        finally:
            for r in rogues:
                r.stop.set()
            live.close()
        assert code == 0, live.console()[-3000:]
        runs[forged] = repeat_of(live.out)
    honest, forged = runs[False], runs[True]
    refused = forged["transport"]["measurements_refused"]
    print("refused:", refused, "frames dropped:", forged["transport"]["frames_dropped"])
    assert forged.keys() == honest.keys()
    for key in ("offline", "online", "online_at", "late_replies", "privacy"):
        assert forged[key] == honest[key], key
    assert forged["contributions"]["per_round"] == honest["contributions"]["per_round"]
    hm, fm = dict(honest["messages"]), dict(forged["messages"])
    assert (fm["sent"], fm["delivered"], fm["bytes_delivered"]) == (
        hm["sent"], hm["delivered"], hm["bytes_delivered"])  # fmt: skip
    assert forged["transport"]["frames_dropped"]["too_deep"] == 2
    assert refused["no_clients"] == 3
    assert refused["shown_not_its_client"] == 3 * 500
    assert refused["shown_over_budget"] + refused["shown_bad_value"] == 3 * 500
    assert refused["stats_over_budget"] == 3
    assert refused["extras_key"] == 3 * 4 and refused["extras_not_its_client"] == 3
    assert refused["oracle_unasked"] == 2  # one from each peer


def test_a_measurement_flood_stays_within_what_the_worker_s_clients_could_do(tmp_path, mq2008_dir):
    """20 flushes of 3.6 MB (180,000 displayed rankings each) for the peer's own client: the
    old server kept them all (141 -> 664 MB, interactions 720 -> 4,000,720). The server takes
    at most twice the client's interactions per model it sent, so its memory stays flat and
    the interactions are the honest run's plus at most that budget."""
    path = scenario(tmp_path, mq2008_dir, rounds=6, round_gap=0.3)
    live = Live(tmp_path, path, ["client-0..client-2"],
                env={"MALLOC_MMAP_THRESHOLD_": "131072"})  # fmt: skip
    n = 180_000

    def flood(rogue: Rogue) -> None:
        rounds = np.ones(n, dtype=np.int64)
        for _ in range(20):
            rogue.control({"t": "flush", "run": rogue.run_id,
                           "flush": rogue.flush(shown=(["client-0003"], np.zeros(n), rounds,
                                                       np.full(n, 0.5)))})  # fmt: skip

    rogue = Rogue(live.endpoint, [3], update=echo, on_run=flood)
    try:
        live.joined(1)
        before = rss_kb(live.server.pid)
        rogue.start()
        assert rogue.done.wait(60)
        time.sleep(1.0)
        after = rss_kb(live.server.pid)
        code = live.finish()
    finally:
        rogue.stop.set()
        live.close()
    assert code == 0, live.console()[-3000:]
    rep = repeat_of(live.out)
    interactions = rep["online"]["interactions"]
    print(f"server RSS {before} -> {after} kB, interactions {interactions}")
    refused = rep["transport"]["measurements_refused"]
    assert refused["shown_over_budget"] >= 20 * n - 2 * 3 * 6
    assert interactions <= 3 * 3 * 6 + 2 * 3 * 6  # honest clients' + the budget of client 3
    assert after - before < 64 * 1024, (before, after)


# --------------------------------------------------------------------------- claims


def test_a_worker_s_ready_names_only_its_own_clients_so_its_loss_crashes_only_them(
    tmp_path, mq2008_dir
):
    """A peer hosting client 3 answers the run (after the honest worker) with a ``ready``
    that lists clients 0-3, then vanishes. The old server believed the list: the honest
    worker's clients were marked crashed with the peer, no later round had a contribution
    and the results said "4 of 4 clients were lost with their worker". Now the list is cut to
    client 3 (counted), and only client 3 is lost."""
    path = scenario(tmp_path, mq2008_dir, rounds=12, round_gap=0.5, deadline=20.0)
    live = Live(tmp_path, path, ["client-0..client-2"], "--heartbeat-timeout", "2")
    every = {f"client-{i:04d}": ["joined", "client"] for i in range(4)}
    rogue = Rogue(live.endpoint, [3], ready_states=lambda msg: every, update=echo,
                  quit_after_run=1.5, ready_after=5.0)  # fmt: skip
    try:
        live.joined(1)
        rogue.start()
        code = live.finish()
    finally:
        rogue.stop.set()
        live.close()
    assert code == 0, live.console()[-3000:]
    rep = repeat_of(live.out)
    per_round = rep["contributions"]["per_round"]
    print("contributions per round:", per_round, "lost:", rep["transport"]["clients_lost"])
    assert rep["transport"]["clients_lost"] == 1
    assert rep["transport"]["measurements_refused"]["state_not_its_client"] == 3
    assert per_round[-1] == 3 and min(per_round) >= 3


def test_a_key_says_hello_only_under_its_own_worker_name(tmp_path, mq2008_dir):
    """With authorised keys, a peer holding worker-1's key says hello as worker-0 (the honest
    worker's name). The old hub took any name from any key; now the hello is dropped
    (``name_not_key``), the peer never becomes a worker and its claimed client stays
    unhosted."""
    import zmq.auth

    from foltr_async.runtime.zmq_keys import make_keys

    keys = tmp_path / "keys"
    make_keys(keys, workers=2)
    pub, sec = zmq.auth.load_certificate(str(keys / "worker-1.key_secret"))
    server, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    path = scenario(tmp_path, mq2008_dir, rounds=2)
    live = Live(tmp_path, path, ["client-0..client-2"], "--join-timeout", "20", keys=keys)
    rogue = Rogue(live.endpoint, [3], name="worker-0", update=echo, curve=(pub, sec, server))
    try:
        live.joined(1)
        rogue.start()
        code = live.finish()
    finally:
        rogue.stop.set()
        live.close()
    assert code in (0, 3) and "Traceback" not in live.console(), live.console()[-3000:]
    rep = repeat_of(live.out)  # (exit 3 when the honest worker was slower than the timeout)
    joined = [e for e in events(live.out) if e["event"] == "worker_joined"]
    print("frames dropped:", rep["transport"]["frames_dropped"], "joined:", len(joined))
    assert rep["transport"]["frames_dropped"]["name_not_key"] >= 1
    assert len(joined) == 1 and rep["transport"]["workers"] == 1
    assert rep["transport"]["clients_missing"] >= 1  # client 3: the peer never hosted it


# --------------------------------------------------------------------------- nobody online


def test_serve_with_no_worker_stops_after_the_stated_empty_rounds_and_exits_3(tmp_path, mq2008_dir):
    """No worker ever joins a 30-round scenario with a 60 s deadline: the old server waited
    every round's deadline (30 minutes) before exit 3. An empty round ends at once, and after
    ``--max-empty-rounds`` of them in a row the run stops with one line and exit 3, its
    results so far written."""
    path = scenario(tmp_path, mq2008_dir, rounds=30, deadline=60.0)
    out = tmp_path / "out"
    done = subprocess.run(
        [*CLI, "serve", str(path), "--bind", f"tcp://127.0.0.1:{free_port()}", "--insecure",
         "--join-timeout", "1", "--max-empty-rounds", "4", "--out", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("error: stopped")]
    assert lines == [
        "error: stopped (default repeat 0 at round 4): 4 rounds in a row had no client online, "
        f"no worker hosts them (--max-empty-rounds; results kept in {out})"
    ]
    rep = repeat_of(out)
    assert rep["contributions"]["per_round"] == [0, 0, 0, 0]
    assert rep["transport"]["stopped_idle_at"] == 4


def test_serve_of_an_asynchronous_run_with_no_worker_stops_after_the_stated_empty_periods(
    tmp_path, mq2008_dir
):
    """Asynchronous FPDGD (30 reporting periods of 60 s) with no worker: the old server never
    counted its empty periods, so it waited every period in real time (30 minutes) before
    exit 3. An empty period (no client online, none training) ends at once and counts toward
    ``--max-empty-rounds`` as an empty round does: the run stops at period 4 with exit 3."""
    path = scenario(tmp_path, mq2008_dir, rounds=30, protocol='"fpdgd_async"',
                    extra="[federation.params]\nperiod = 60.0\ncompute_time = 1.0")  # fmt: skip
    out = tmp_path / "out"
    done = subprocess.run(
        [*CLI, "serve", str(path), "--bind", f"tcp://127.0.0.1:{free_port()}", "--insecure",
         "--join-timeout", "1", "--max-empty-rounds", "4", "--out", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert [x for x in done.stderr.splitlines() if x.startswith("error: stopped")] == [
        "error: stopped (default repeat 0 at round 4): 4 rounds in a row had no client online, "
        f"no worker hosts them (--max-empty-rounds; results kept in {out})"
    ]
    rep = repeat_of(out)
    assert rep["transport"]["stopped_idle_at"] == 4
    assert rep["contributions"]["per_round"] == [0, 0, 0, 0]


# --------------------------------------------------------------------------- logging


def test_junk_data_frames_are_counted_with_a_log_line_per_reason_not_per_frame(
    tmp_path, mq2008_dir
):
    """A peer sends 6,000 junk data frames (random bytes, another run's frames, envelopes as
    an agent it does not host) while the run trains: every one is a counted drop in
    results.json, and events.jsonl gets a line per reason (and one more per 10 s), not a
    line per frame (the old hub: 36 k frames in 3 s wrote 7.1 MB of events)."""
    path = scenario(tmp_path, mq2008_dir, rounds=6, round_gap=0.3)
    live = Live(tmp_path, path, ["client-0..client-3"])
    rng = np.random.default_rng(3)
    forged = encode(Envelope(UPDATE, "client-0001", "server",
                             {"params": np.zeros(46), "n_interactions": 3}, 1, 1, 0.0))  # fmt: skip

    def junk(rogue: Rogue) -> None:
        for _ in range(2000):
            rogue.sock.send_multipart([b"M", RUN.pack(1, 0.0), b"server", rng.bytes(40)])
            rogue.sock.send_multipart([b"M", RUN.pack(7, 0.0), b"server", forged])
            rogue.sock.send_multipart([b"M", RUN.pack(1, 0.0), b"server", forged])

    rogue = Rogue(live.endpoint, [], on_welcome=junk)
    try:
        live.joined(1)
        rogue.start()
        code = live.finish()
    finally:
        rogue.stop.set()
        live.close()
    assert code == 0, live.console()[-3000:]
    dropped = repeat_of(live.out)["messages"]["dropped"]
    lines = [e for e in events(live.out) if e["event"] in ("drop", "hub_data_dropped")]
    size = (live.out / "events.jsonl").stat().st_size
    print(f"dropped {dropped}, {len(lines)} log lines, events.jsonl {size} bytes")
    assert dropped["stale_run"] == dropped["unauthenticated"] == 2000
    assert sum(dropped.values()) == 6000
    assert len(lines) <= 4 * len(dropped)


# --------------------------------------------------------------------------- connections


def test_many_plain_tcp_connections_leave_the_server_its_files(tmp_path, mq2008_dir):
    """Scaled down: a server started with a soft limit of 128 open files (hard 4,096) and 300
    plain TCP connections to its port held open while it trains and checkpoints every round.
    The old server had no descriptor left for its checkpoint (at 1,024 files: 1,100
    connections) and crashed; it raises its soft limit to the hard one at the start."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 4096))

    path = scenario(tmp_path, mq2008_dir, rounds=6, round_gap=0.3)
    live = Live(tmp_path, path, ["client-0..client-3"], "--checkpoint-every", "1",
                preexec=low_limit)  # fmt: skip
    conns = []
    try:
        live.joined(1)
        for _ in range(300):
            try:
                conns.append(socket.create_connection(("127.0.0.1", live.port)))
            except ConnectionRefusedError:  # the server is gone
                break
        code = live.finish()
    finally:
        for c in conns:
            c.close()
        live.close()
    assert code == 0, live.console()[-3000:]
    assert len(conns) == 300 and (live.out / "checkpoint.pkl").exists()
    assert repeat_of(live.out)["contributions"]["per_round"] == [4] * 6


# --------------------------------------------------------------------------- the ledger


def test_the_ledger_adds_up_workers_counters_and_keeps_clients_entries_apart():
    """Two workers report cumulative replay counters (the old server kept only the last
    report, overwriting the other worker's and its own); per-client tables take only each
    worker's own clients; reported states only of the clients asked."""
    from collections import Counter
    from types import SimpleNamespace

    from foltr_async.contract import Probe
    from foltr_async.runtime.bus import MessageStats
    from foltr_async.runtime.schema import MESSAGE_KINDS
    from foltr_async.runtime.trust import RunLedger

    probe = Probe()
    probe.extras["replay"] = {"played": 5, "empty_updates": 0}
    ctx = SimpleNamespace(batch_of=lambda aid: 3, client_data=lambda aid: None)
    bus = SimpleNamespace(sent_to=Counter({"client-0000": 10, "client-0001": 10}),
                          routed=Counter(), routed_bytes=Counter(), registry=MESSAGE_KINDS,
                          stats=MessageStats())  # fmt: skip
    ledger = RunLedger(SimpleNamespace(probe=probe, ctx=ctx), bus)
    ledger.assign(b"a", ["client-0000"])
    ledger.assign(b"b", ["client-0001"])
    empty = {"owners": [], "owner": np.zeros(0, np.int32), "rounds": np.zeros(0, np.int64),
             "values": np.zeros(0)}  # fmt: skip
    stats = {"delivered": 0, "bytes_delivered": 0, "dropped": {}, "kinds": {}}

    def flush(played: int, table: dict) -> dict:
        return {"shown": empty, "stats": stats,
                "extras": {"replay": {"played": played}, "csfltr.measured": table}}  # fmt: skip

    ledger.merge(b"a", flush(2, {"client-0000": {"n": 1}, "client-0001": {"n": 9}}))
    ledger.merge(b"b", flush(4, {"client-0001": {"n": 2}}))
    ledger.merge(b"a", flush(3, {"client-0000": {"n": 3}}))  # cumulative: 3 in all, not 5
    assert probe.extras["replay"] == {"played": 5 + 3 + 4, "empty_updates": 0}
    assert probe.extras["csfltr.measured"] == {"client-0000": {"n": 3}, "client-0001": {"n": 2}}
    said = {"client-0000": ["joined", "client"], "client-0001": ["crashed", "client"]}
    asked = ledger.states(b"a", said, {"client-0000"})
    assert asked == {"client-0000": ["joined", "client"]}
    assert +ledger.refused == {"extras_not_its_client": 1, "state_not_its_client": 1}
    ledger.assign(b"b", ["client-0000"])  # re-hosted: worker a may no longer report it
    assert ledger.own(b"a") == set()

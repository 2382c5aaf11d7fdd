"""Agents as separate processes across hosts: ``serve``, ``join`` and the local launcher.

The server process runs the experiment as in memory (same ``Simulation``, observers, results
writer, checkpoints), on the real-time asyncio loop and a ``HubBus``. Honest clients live in
*worker* processes (``python -m foltr_async join``), each building its share of them from its
own copy of the scenario and the data (client data never travels); the server's run holds a
``RemoteAgent`` proxy for each. Attackers and eavesdroppers run in the server process, which
every message crosses, so their taps see every link as in memory.

Control protocol (simulator messages, not a protocol's; ``C`` frames of ``zmqbus``)::

    worker -> hub   hello {worker, claims, run}       hub -> worker   welcome | wait {reason}
    hub -> worker   run {run, variant, repeat, seed, digest, code,
                         agents: {id: {state, blob, seq, seen}}}
    worker -> hub   ready {req, states: {id: [state, role]}}   | error {req, message}
    hub -> worker   act {run, agent, action, round}    -> ack {req, states}
    hub -> worker   snap {run, part}                   -> snapped_part {req, agents} ...
                                                          snapped {req, agents, flush}
    hub -> worker   end {run}                          -> done {req, flush}
    worker -> hub   oracle {run, key, value}  (a client's oracle truth, before its update)
    worker -> hub   flush {run, flush}        (before a client's message: shown, counters)
    hub -> worker   bye                       (the experiment is over: exit)

A *flush* carries what the worker measured since its last flush: displayed-ranking records
(the online metric), delivery counters and (at a checkpoint or the end) probe extras. A worker
is not trusted: its replies and flushes are merged only as far as they are about the clients
the server assigned it and within what those could have done (``runtime.trust.RunLedger``;
docs/SECURITY.md). One goes
ahead of every message a client sends when anything changed, so a killed worker's interactions
behind every update the server received are counted. The server does not start round 1
before every expected client is running (or ``join_timeout`` passes: the missing ones are
logged and join, late, when a worker hosts them; the report counts clients late, lost with a
worker and never hosted, and the results say so). A worker that stops (killed, network cut)
is noticed by its heartbeats: its clients count as crashed, so they miss the round (after the
deadline) and are not selected again; a worker that says hello again (restarted, or it lost
the server and dropped its run: its hello names no run) gets its clients back, built afresh,
and they rejoin. Determinism: every agent's randomness is a named stream of the seed,
partitions come from the ``data`` stream, replies are aggregated in client-id order and the
online metric is ordered by (round, client), so a zmq run with no simulated latency, loss or
dropout gives the metrics of the memory run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.provenance import code_stamp
from foltr_async.registry import REGISTRY
from foltr_async.rng import stream
from foltr_async.runtime import heap
from foltr_async.runtime.compute import BatchPool
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.schema import Array, Bytes, Int, ListOf, Map, Opt, Spec, Str, Struct
from foltr_async.runtime.trust import Measured, RunLedger
from foltr_async.runtime.wire import DEFAULT_MAX_BYTES
from foltr_async.runtime.zmqbus import (
    DEFAULT_LIMITS,
    HUB_CONTROL,
    Hub,
    HubBus,
    ServerKeys,
    TransportError,
    WireLimits,
    WorkerBus,
    WorkerKeys,
    WorkerLink,
    make_keys,
    pack_control,
    stats_delta,
)
from foltr_async.scenario.load import Scenario
from foltr_async.simulation import ROLE_OF_GROUP, Simulation, load_datasets

__all__ = [
    "LocalWorkers",
    "RemoteAgent",
    "ZmqServer",
    "agent_ids",
    "join",
    "parse_agents",
    "run_digest",
    "wire_limits",
]

log = structlog.get_logger()

_RANGE = re.compile(r"^client-(\d+)(?:\.\.client-(\d+))?$")


def parse_agents(spec: str) -> set[int]:
    """``client-0..client-99,client-120`` -> the client numbers it names."""
    out: set[int] = set()
    for part in spec.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise FoltrError(
                f"--agents: {part.strip()!r}: expected client-N or "
                "client-A..client-B (e.g. client-0..client-99)"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise FoltrError(f"--agents: {part.strip()!r}: empty range")
        out.update(range(lo, hi + 1))
    return out


def agent_ids(numbers: set[int] | list[int]) -> str:
    """The shortest ``--agents`` spec for these client numbers."""
    nums = sorted(numbers)
    parts = []
    for _, run in itertools.groupby(enumerate(nums), lambda t: t[1] - t[0]):
        block = [n for _, n in run]
        parts.append(
            f"client-{block[0]}" if len(block) == 1 else f"client-{block[0]}..client-{block[-1]}"
        )
    return ",".join(parts)


def _client_number(agent_id: str) -> int:
    return int(agent_id.rsplit("-", 1)[1])


def run_digest(cfg: dict, data: Any) -> str:
    """What a worker's run must share with the server's: the variant's configuration (all but
    where the data lives) and the training data's shape and labels."""
    cfg = json.loads(json.dumps(cfg, default=str))
    cfg["dataset"].pop("path", None)
    train = data.train
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(np.asarray([train.n_queries, train.features.shape[0], train.n_features]).tobytes())
    h.update(np.ascontiguousarray(train.labels).tobytes())
    h.update(np.ascontiguousarray(train.qptr).tobytes())
    return h.hexdigest()[:32]


def wire_limits(scenario: Scenario) -> WireLimits:
    """What the hub accepts from a peer in this scenario's runs, from its largest variant.

    A data message is at most what the protocol declares (``ProtocolEntry.wire_bytes``: for
    model-sized messages a few models, a list of training queries or one entry per client),
    else the codec's 16 MB. A control frame carries measurements or saved client states, which
    a worker splits into parts of at most half a frame (``snapped_part``), so a frame of twice
    the largest message, at least 4 MB, fits every legal one.
    """
    message, clients = 0, 1
    for cfg in scenario.variants.values():
        fed = cfg["federation"]
        n = fed["clients"] + sum(g["count"] for g in cfg["agents"] if g["role"] == "attacker")
        bound = REGISTRY.protocols[fed["protocol"]].wire_bytes
        m = DEFAULT_MAX_BYTES if bound is None else bound(cfg, load_datasets(cfg))
        message = max(message, m)
        clients = max(clients, n)
    return WireLimits(
        frame=max(4 << 20, 2 * message),
        message=message,
        hello=(64 << 10) + 9 * clients,  # a worker may claim every client (msgpack ints)
        clients=clients,
        items=max(1 << 16, 16 * clients),
    )


# --------------------------------------------------------------------------- control schemas


_STATES = Map(ListOf(Str(), max_len=2))
_FLUSH = Struct(
    {
        "shown": Struct(
            {
                "owners": ListOf(Str()),
                "owner": Array("int32"),
                "rounds": Array("int64"),
                "values": Array("float64"),
            }
        ),
        "extras": Map(Measured(), max_len=64),
        "stats": Struct(
            {
                "delivered": Int(min=0),
                "bytes_delivered": Int(min=0),
                "dropped": Map(Int(min=0), max_len=256),
                "kinds": Map(ListOf(Int(min=0), max_len=3), max_len=4096),
            }
        ),
    }
)
_SAVED = Struct({"state": Str(), "blob": Bytes(), "seq": Map(Int(min=0)), "seen": Map(Int(min=0))})


def _reply(**fields: Spec) -> Struct:
    return Struct({"t": Str(), "req": Int(), **fields})


#: What a worker may send the server; anything else is dropped and counted by the hub.
WORKER_CONTROL: dict[str, Struct] = {
    **HUB_CONTROL,
    "ready": _reply(states=_STATES),
    "ack": _reply(states=_STATES),
    "error": Struct({"t": Str(), "req": Opt(Int()), "message": Str(max_len=4000)}),
    "snapped": _reply(agents=Map(_SAVED), flush=_FLUSH),
    "snapped_part": _reply(agents=Map(_SAVED)),
    "done": _reply(flush=_FLUSH),
    "oracle": Struct({"t": Str(), "run": Int(), "key": Measured(), "value": Measured()}),
    "flush": Struct({"t": Str(), "run": Int(), "flush": _FLUSH}),
}


# --------------------------------------------------------------------------- server side


class RemoteAgent:
    """The server run's stand-in for a client another process hosts."""

    remote = True

    def __init__(self, agent_id: str, group: str) -> None:
        self.id = agent_id
        self.group = group
        self.role = ROLE_OF_GROUP[group]
        self.state = "new"
        self.rounds_joined = 0
        self.last_kind: str | None = None
        self.worker: bytes | None = None
        #: crashed because its worker was lost: it rejoins when a worker hosts it again
        self.lost = False

    def __repr__(self) -> str:
        return f"<RemoteAgent {self.id} {self.state} on {self.worker!r}>"

    def deliver(self, env: Any) -> None:  # the hub forwards bytes; never called with a message
        raise RuntimeError(f"{self.id} is remote: messages to it travel as bytes")


@dataclass
class _Worker:
    peer: bytes
    name: str
    claims: set[int]
    host: str = ""
    pid: int = 0
    flushed: dict = field(default_factory=dict)


class ZmqServer:
    """The server side of a zmq run: the hub, the workers and the run control (``Remote``).

    ``launch(endpoint)`` (the local launcher) starts worker processes once the hub listens;
    ``stop()`` ends them after the goodbyes.
    """

    def __init__(
        self,
        bind: str,
        *,
        keys: ServerKeys | None,
        join_timeout: float = 120.0,
        reply_timeout: float = 60.0,
        heartbeat: float = 1.0,
        heartbeat_timeout: float = 10.0,
        launch: Callable[[str], Any] | None = None,
        stop: Callable[[], Any] | None = None,
        check: Callable[[], None] | None = None,
        limits: WireLimits = DEFAULT_LIMITS,
        max_empty_rounds: int = 3,
    ) -> None:
        #: worker -> its unanswered run request (it builds the run's agents meanwhile: the hub
        #: does not count its silence)
        self._run_out: dict[bytes, int] = {}
        self.hub = Hub(
            bind,
            keys=keys,
            heartbeat=heartbeat,
            timeout=heartbeat_timeout,
            on_control=self._on_control,
            on_lost=self._on_lost,
            on_refused=self._on_refused,
            control=WORKER_CONTROL,
            limits=limits,
            preparing=self._run_out,
        )
        self.limits = limits
        self.join_timeout = join_timeout
        self.reply_timeout = reply_timeout
        self._launch = launch
        self._stop = stop
        self._check = check  # raises when a launched worker died before hosting its clients
        self.workers: dict[bytes, _Worker] = {}
        self.run_id = 0
        self.sim: Simulation | None = None
        self.bus: HubBus | None = None
        #: the current run's record of what each worker was assigned (``runtime.trust``)
        self.ledger: RunLedger | None = None
        self._pending: dict[int, tuple[bytes, asyncio.Future]] = {}
        self._parts: dict[int, dict] = {}  # request -> saved states of its snapped_parts so far
        self._req = itertools.count(1)
        self._changed = asyncio.Event()
        self._digest = ""
        self._round_t: list[float] = []
        self._wall0 = 0.0
        #: the hub's refusal and dropped-frame counts at the end of the previous run, and
        #: this run's share of them (a run reports its own, not the experiment's so far)
        self._counts_before: tuple[int, Counter] = (0, Counter())
        self._run_counts: dict[str, Any] = {}
        self.worker_errors = 0
        #: this run's clients a worker hosted at some point; of the others, those not hosted
        #: by round 1 (``late``, the join timeout passed) and those whose worker was lost
        #: mid-run (``lost``: they crashed); at the end, those never hosted (``missing``)
        self.hosted: set[str] = set()
        self.late: set[str] = set()
        self.lost: set[str] = set()
        self.missing: list[str] = []
        self.n_clients = 0  # clients the workers host in this run
        #: rounds in a row (over runs) with no client online to ask; at ``max_empty_rounds``
        #: the run stops there, and later runs stop after their first such round
        self.max_empty_rounds = max_empty_rounds
        self.empty_rounds = 0
        self.stopped_at: int | None = None  # this run's round where it stopped so

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._changed = asyncio.Event()
        endpoint = await self.hub.start()
        if self._launch is not None:
            self._launch(endpoint)

    async def close(self) -> None:
        await self.hub.close(bye=True)
        if self._stop is not None:
            self._stop()

    # ----------------------------------------------------------------- Simulation hooks

    def make_bus(self, cfg: dict, seed: int) -> HubBus:
        self.run_id += 1
        self.bus = HubBus(
            NetworkModel.from_dict(cfg["network"]),
            stream(seed, "net"),
            self.hub,
            self.run_id,
            max_bytes=self.limits.message,
        )
        self.hub.bus = self.bus
        self._round_t = []
        self.worker_errors = 0  # runs a worker refused (this run)
        self.hosted, self.late, self.lost, self.missing = set(), set(), set(), []
        original = self.bus.begin_round

        def begin_round(round: int, agent_ids: list[str]) -> set[str]:
            self._round_t.append(time.perf_counter())  # round wall times for the report
            return original(round, agent_ids)

        self.bus.begin_round = begin_round
        return self.bus

    @staticmethod
    def hosts(agent_id: str, group: str) -> bool:
        """Honest clients live in workers; attackers and eavesdroppers here (they tap links)."""
        return group != "clients"

    def proxy(self, agent_id: str, group: str) -> RemoteAgent:
        return RemoteAgent(agent_id, group)

    def _proxies(self) -> dict[str, RemoteAgent]:
        sim = self.sim
        if sim is None:
            return {}
        return {a: p for a, p in sim.agents.items() if p.remote}

    async def begin_run(self, sim: Simulation, later: set[str], restore: dict | None) -> None:
        self.sim = sim
        self._wall0 = time.perf_counter()
        self._digest = run_digest(sim.cfg, sim.ctx.data)
        self.ledger = RunLedger(sim, self.bus)
        self.stopped_at = None
        sim.server.wait_empty = False  # real time: an empty round would only wait
        sim.server.stop_when = self._stop_when_idle
        sim.server.untrusted = lambda src: self.bus.hosted_by(src) is not None
        idle = self.empty_rounds >= self.max_empty_rounds  # nobody came to the last run
        proxies = self._proxies()
        self.n_clients = len(proxies)
        self._restore = restore or {}
        for aid, p in proxies.items():
            saved = self._restore.get(aid)
            if saved is not None:
                p.lost = saved["state"] == "joined"  # wanted running, as at the checkpoint
                if not p.lost:
                    p.state = saved["state"]
            else:
                p.lost = aid not in later  # wanted running as soon as a worker hosts it
        for peer in list(self.workers):
            self._send_run(peer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.join_timeout
        while True:
            missing = sorted(a for a, p in proxies.items() if p.worker is None)
            if not missing:
                break
            if self._check is not None:
                self._check()
            if loop.time() >= deadline or idle:
                self.late = set(missing)
                sim.emit(
                    "agents_missing",
                    n=len(missing),
                    agents=agent_ids([_client_number(a) for a in missing]),
                )
                break
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(min(deadline, loop.time() + 1.0)):
                    await self._changed.wait()
        self._restore = {}
        for p in proxies.values():
            sim.observer.agent_changed(p.id, p.role, p.state, p.rounds_joined, None)

    def _stop_when_idle(self, report: Any) -> bool:
        """After ``max_empty_rounds`` rounds (or asynchronous periods) in a row with no
        client online and no reply, stop the run there (its results so far are kept; the CLI
        says so and exits 3)."""
        empty = not report.online and not report.replied
        self.empty_rounds = self.empty_rounds + 1 if empty else 0
        if self.empty_rounds < self.max_empty_rounds:
            return False
        self.stopped_at = report.round
        self.sim.emit("stopped_idle", round=report.round, empty_rounds=self.empty_rounds)
        return True

    def _send_run(self, peer: bytes) -> None:
        """Give a worker its share of the current run's clients (in a new run or on rejoin)."""
        sim, w = self.sim, self.workers.get(peer)
        if sim is None or w is None:
            return
        mine: dict[str, dict] = {}
        for aid, p in self._proxies().items():
            if _client_number(aid) not in w.claims:
                continue
            if p.worker is not None and p.worker != peer and p.worker in self.workers:
                continue  # another live worker hosts it
            saved = self._restore.get(aid)
            want = "joined" if p.lost else p.state
            mine[aid] = {
                "state": want,
                "blob": saved["blob"] if saved else None,
                "seq": saved.get("seq") if saved else None,
                "seen": saved.get("seen") if saved else None,
            }
        if not mine:
            return
        self.ledger.assign(peer, mine)
        msg = {
            "t": "run",
            "run": self.run_id,
            "variant": sim.variant,
            "repeat": sim.repeat,
            "seed": sim.seed,
            "digest": self._digest,
            "code": code_stamp()["source"],
            "agents": mine,
            "oracle": bool(sim.groups["eavesdroppers"]),
        }
        req = self._run_out[peer] = next(self._req)  # now: a hello queued behind must not resend
        asyncio.ensure_future(self._run_request(peer, msg, req))

    async def _run_request(self, peer: bytes, msg: dict, req: int) -> None:
        try:
            reply = await self._request(peer, msg, req)
        finally:
            if self._run_out.get(peer) == req:
                del self._run_out[peer]
        if reply is None or self.sim is None or msg["run"] != self.run_id:
            return
        if reply["t"] == "error":  # e.g. agent state it refused to load
            w = self.workers.get(peer)
            self.worker_errors += 1
            self.sim.emit("worker_error", worker=w.name if w else "?", message=reply["message"])
            return
        fresh = [a for a, spec in msg["agents"].items() if spec["blob"] is None]
        self._apply_states(peer, self.ledger.states(peer, reply["states"], msg["agents"]), fresh)
        self._changed.set()

    def _apply_states(self, peer: bytes, states: dict, fresh: list[str] = ()) -> None:
        proxies, bus, sim = self._proxies(), self.bus, self.sim
        for aid, (state, role) in states.items():
            p = proxies.get(aid)
            if p is None:
                continue
            p.worker, p.role, p.lost = peer, role, False
            self.hosted.add(aid)
            if aid in fresh:
                bus.forget_sender(aid)  # a fresh agent numbers its messages from 1 again
            if state == "joined":
                p.state = "joined"
                if not bus.is_registered(aid):
                    bus.register(p)
            else:
                p.state = state
                bus.unregister(aid)
            if sim is not None:
                sim.observer.agent_changed(aid, p.role, p.state, p.rounds_joined, p.last_kind)

    async def act(self, agent: RemoteAgent, action: str, round: int) -> None:
        peer = agent.worker
        if peer is None or peer not in self.workers:  # its worker is gone: the proxy records it
            after = self.sim.proto.state_after(action)
            if after == "joined":
                agent.lost = True
            elif after is not None:
                agent.lost = False
                agent.state = after
            return
        reply = await self._request(
            peer,
            {"t": "act", "run": self.run_id, "agent": agent.id, "action": action, "round": round},
        )
        if reply is not None and reply["t"] == "ack" and self.ledger is not None:
            self._apply_states(peer, self.ledger.states(peer, reply["states"], {agent.id}))

    async def snapshot(self, sim: Simulation) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for peer in self._hosting():
            msg = {"t": "snap", "run": self.run_id, "part": self.limits.frame // 2}
            reply = await self._request(peer, msg)
            if reply is None or reply["t"] != "snapped":
                continue
            self.ledger.merge(peer, reply["flush"])
            out.update(self.ledger.saved(peer, reply["agents"]))
        return out

    async def end_run(self, sim: Simulation) -> None:
        try:
            peers = self._hosting()
            replies = await asyncio.gather(
                *(self._request(peer, {"t": "end", "run": self.run_id}) for peer in peers)
            )
            for peer, reply in zip(peers, replies, strict=True):
                if reply is not None and reply["t"] == "done":
                    self.ledger.merge(peer, reply["flush"])
        finally:
            self.missing = sorted(set(self._proxies()) - self.hosted)
            self.sim = None
            self.hub.bus = None
            refused, dropped = self._counts_before
            self._run_counts = {
                "refused_handshakes": self.hub.refused - refused,
                "frames_dropped": dict(self.hub.dropped - dropped),
                "measurements_refused": dict(+self.ledger.refused) if self.ledger else {},
            }
            self.ledger = None
            self._counts_before = (self.hub.refused, Counter(self.hub.dropped))
            self.hub.warn.flush()

    def report(self) -> dict[str, Any]:
        """Transport facts; the message rate counts each message once, over the rounds' wall
        time (from the first round's start to the end of the run, set-up excluded)."""
        bus, times = self.bus, self._round_t
        gaps = np.diff(times) if len(times) > 1 else np.zeros(0)
        wall = time.perf_counter() - (times[0] if times else self._wall0)
        st = bus.stats if bus is not None else None
        return {
            "kind": "zmq",
            "workers": len(self.workers),
            "secure": self.hub.keys is not None,
            "frames_to_workers": bus.frames if bus else 0,
            "frames_from_workers": bus.received if bus else 0,
            "messages_per_s": st.sent / wall if st and wall > 0 else None,
            "round_s": {
                "mean": float(gaps.mean()) if gaps.size else None,
                "p50": float(np.percentile(gaps, 50)) if gaps.size else None,
                "p95": float(np.percentile(gaps, 95)) if gaps.size else None,
            },
            "worker_errors": self.worker_errors,
            "clients": self.n_clients,
            "clients_missing": len(self.missing),
            "clients_late": len(self.late - set(self.missing)),
            "clients_lost": len(self.lost),
            "largest_frame_in": self.hub.largest_in,
            "stopped_idle_at": self.stopped_at,
            **self._run_counts,
        }

    # ----------------------------------------------------------------- requests

    def _hosting(self) -> list[bytes]:
        peers = {p.worker for p in self._proxies().values() if p.worker is not None}
        return [peer for peer in peers if peer in self.workers]

    async def _request(self, peer: bytes, msg: dict, req: int | None = None) -> dict | None:
        req = next(self._req) if req is None else req
        fut = asyncio.get_running_loop().create_future()
        self._pending[req] = (peer, fut)
        self.hub.control(peer, {**msg, "req": req})
        try:
            async with asyncio.timeout(self.reply_timeout):
                return await fut
        except TimeoutError:
            w = self.workers.get(peer)
            log.warning("worker_no_reply", worker=w.name if w else peer, request=msg["t"])
            return None
        finally:
            self._pending.pop(req, None)
            self._parts.pop(req, None)

    # ----------------------------------------------------------------- hub callbacks

    def _on_control(self, peer: bytes, msg: dict) -> None:
        t = msg["t"]
        if t == "hello":
            self._hello(peer, msg)
            return
        req = msg.get("req")
        if req is not None:
            entry = self._pending.get(req)
            if entry is None or entry[0] != peer or entry[1].done():
                return
            if self._run_out.get(peer) == req:  # answered: a later hello is about this run
                del self._run_out[peer]
            if t == "snapped_part":  # saved states ahead of the reply, on the same connection
                self._parts.setdefault(req, {}).update(msg["agents"])
                return
            if t == "snapped":
                msg["agents"] = {**self._parts.pop(req, {}), **msg["agents"]}
            entry[1].set_result(msg)
            return
        ledger = self.ledger
        if ledger is None or msg.get("run") != self.run_id:
            return
        if t == "oracle":
            ledger.oracle(peer, msg["key"], msg["value"])
        elif t == "flush":
            ledger.merge(peer, msg["flush"])

    def _hello(self, peer: bytes, msg: dict) -> None:
        claims = set(msg.get("claims") or [])
        name = str(msg.get("worker", "?"))
        if peer in self.workers and self.workers[peer].claims == claims:
            if self.sim is None or msg["run"] == self.run_id or peer in self._run_out:
                # a repeated hello: nothing changed, or its run is on the way
                self.hub.control(peer, {"t": "welcome"})
                return
            # it hosts no run (it thought the server lost and dropped its clients): its clients
            # crashed, and they get their run again below, as a restarted worker's do
            if any(p.worker == peer for p in self._proxies().values()):
                self._on_lost(peer)
        for other in self.workers.values():
            overlap = claims & other.claims
            if other.peer != peer and overlap:
                self.hub.control(
                    peer,
                    {
                        "t": "wait",
                        "reason": (
                            f"clients {agent_ids(sorted(overlap)[:5])}... are hosted by worker "
                            f"{other.name}"
                        ),
                    },
                )
                self.hub.peers.pop(peer, None)
                return
        self.workers[peer] = _Worker(
            peer, name, claims, str(msg.get("host", "")), int(msg.get("pid", 0))
        )
        self.hub.control(peer, {"t": "welcome"})
        facts = {"worker": name, "host": msg.get("host"), "clients": agent_ids(claims)}
        if self.sim is not None:
            self.sim.emit("worker_joined", **facts)
            self._send_run(peer)
        else:
            log.info("worker_joined", **facts)

    def _on_lost(self, peer: bytes) -> None:
        w = self.workers.pop(peer, None)
        for req, (p, fut) in list(self._pending.items()):
            if p == peer and not fut.done():
                fut.set_result(None)
                self._pending.pop(req, None)
        sim = self.sim
        if sim is None:
            log.info("worker_lost", worker=w.name if w else "?")
            return
        gone = []
        for aid, p in self._proxies().items():
            if p.worker != peer:
                continue
            if p.state == "joined":
                p.state, p.lost = "crashed", True
                self.bus.unregister(aid)
                gone.append(aid)
                self.lost.add(aid)
                sim.observer.agent_changed(aid, p.role, p.state, p.rounds_joined, p.last_kind)
        sim.emit(
            "worker_lost",
            worker=w.name if w else "?",
            crashed=len(gone),
            round=getattr(sim.server, "plan_round", 0) if hasattr(sim, "server") else 0,
        )

    def _on_refused(self, address: str, key: str) -> None:
        """A refused handshake: the first is a warning (and event) at once, later ones one line
        per ``limits.log_every`` seconds with how many came since (``count``); a flood of
        connections with made-up keys, or libzmq retrying a refused peer every reconnect
        interval, costs a counter, not a line each. ``Hub.refused`` counts every one."""
        if not self.hub.warn("auth_refused", "auth_refused", address=address, key=key):
            return
        sim = self.sim
        if sim is not None:
            sim.observer.event(
                "auth_refused", variant=sim.variant, repeat=sim.repeat, address=address, key=key
            )


# --------------------------------------------------------------------------- worker side


class _ServerStub:
    """What a protocol's ``attach_server`` / ``act`` may touch in a worker: the
    round number (set from each action); server-side handlers are the server's business."""

    id = "server"

    def __init__(self) -> None:
        self.plan_round = 0

    def on(self, kind: str, handler: Callable) -> None:
        """Server-side handlers are registered in the server process, not here."""


class _OracleForward(dict):
    """A worker's ``probe.oracle``: every truth also goes to the server (before the message it
    describes, on the same ordered connection), where the eavesdroppers score."""

    def __init__(self, link: WorkerLink, run: int) -> None:
        super().__init__()
        self._link, self._run = link, run

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._link.control(
            {"t": "oracle", "run": self._run, "key": list(key), "value": list(value)}
        )


class AgentHost:
    """One run's agents in a worker process."""

    def __init__(self, scenario: Scenario, link: WorkerLink, msg: dict) -> None:
        self.run = msg["run"]
        mine = code_stamp()["source"]
        if msg.get("code") != mine:
            raise ScenarioError(
                f"this worker runs other code than the server (source {mine}, the server's "
                f"{msg.get('code')}): install the same version of foltr_async on both hosts"
            )
        variant = msg["variant"]
        cfg = scenario.variants.get(variant)
        if cfg is None:
            raise ScenarioError(
                f"variant {variant!r} is not in this worker's scenario "
                f"({', '.join(scenario.variants)})"
            )
        self.ids = set(msg["agents"])
        self.bus = WorkerBus(link, self.run)
        self.sim = Simulation(
            cfg,
            msg["seed"],
            Observer(),
            variant,
            msg["repeat"],
            bus=self.bus,
            hosts=lambda aid, group: aid in self.ids,
        )
        self.proto = self.sim.build()
        digest = run_digest(cfg, self.sim.ctx.data)
        if digest != msg["digest"]:
            raise ScenarioError(
                f"variant {variant!r}: this worker's scenario or data differ from the server's "
                "(the same file, --set and --seed on both sides, and the same dataset)"
            )
        self.stub = _ServerStub()
        self.proto.attach_server(self.stub)
        if msg.get("oracle"):  # the server's eavesdroppers read what these clients write
            self.sim.probe.oracle = _OracleForward(link, self.run)
            self.sim.probe.read_oracle()
        self.flushed = 0
        self.stats_before: dict | None = None
        self.link = link
        self.bus.before_send = self.report
        link.bus = self.bus

    def start(self, agents: dict) -> dict:
        self.sim.restore_agents({a: e for a, e in agents.items() if e.get("blob") is not None})
        for aid, spec in agents.items():
            agent = self.sim.agents.get(aid)
            if agent is None:
                continue
            self.bus.restore_seqs(aid, spec.get("seq") or {}, spec.get("seen") or {})
            if spec["state"] == "joined":
                agent.start()
            elif spec["state"] in ("left", "crashed"):
                agent.state = spec["state"]
        # Compute pools' one-off set-up (compiled kernels) before the server's rounds start:
        # their deadlines are real time here, and round 1 would otherwise pay it.
        for obj in self.sim.ctx.shared_objects().values():
            if isinstance(obj, BatchPool):
                obj.prepare()
        heap.freeze()  # the agents and their compiled code live until the run ends
        return self.states()

    def states(self, ids: Any = None) -> dict:
        ids = self.ids if ids is None else ids
        return {
            a: [self.sim.agents[a].state, self.sim.agents[a].role]
            for a in ids
            if a in self.sim.agents
        }

    async def act(self, aid: str, action: str, round: int) -> dict:
        agent = self.sim.agents.get(aid)
        if agent is None:
            return {}
        self.stub.plan_round = round
        await self.sim.act_locally(agent, action)
        return self.states([aid])

    def report(self) -> None:
        """Before a client's message leaves: what was shown and delivered since the last flush
        goes ahead of it on the same ordered connection, so a worker killed later loses none of
        the interactions behind the updates the server got (they were flushed only at the run's
        end or a checkpoint, and a killed worker's vanished: 405 of 459 counted)."""
        if len(self.sim.probe.records(self.flushed)) or self.bus.delivery_stats() != (
            self.stats_before or {}
        ):
            self.link.control({"t": "flush", "run": self.run, "flush": self.flush(extras=False)})

    def flush(self, extras: bool = True) -> dict:
        records = self.sim.probe.records(self.flushed)
        self.flushed += len(records)
        owners = sorted({o for _, o, _ in records})
        index = {o: i for i, o in enumerate(owners)}
        now = self.bus.delivery_stats()
        delta = stats_delta(now, self.stats_before)
        self.stats_before = now
        return {
            "shown": {
                "owners": owners,
                "owner": np.array([index[o] for _, o, _ in records], dtype=np.int32),
                "rounds": np.array([r for r, _, _ in records], dtype=np.int64),
                "values": np.array([v for _, _, v in records], dtype=np.float64),
            },
            "extras": self.sim.probe.extras if extras else {},
            "stats": delta,
        }

    def snapshot(self) -> dict:
        ids = [a for a in self.ids if a in self.sim.agents]
        agents = self.sim.capture_agents(ids)
        for aid in ids:
            agents[aid]["seq"] = self.bus.seqs_of(aid)
            agents[aid]["seen"] = self.bus.seen_by(aid)
        return agents

    async def end(self) -> dict:
        for agent in self.sim.agents.values():
            if agent.state == "joined":
                await agent.leave()
        heap.thaw()
        return self.flush()

    async def crash_all(self) -> None:
        for agent in self.sim.agents.values():
            await agent.crash()
        heap.thaw()


def _split(agents: dict[str, dict], budget: int) -> list[dict[str, dict]]:
    """Saved agent states in groups of at most ``budget`` packed bytes (an agent bigger than
    that alone), so a worker hosting many clients never sends a frame over the hub's limit."""
    parts: list[dict[str, dict]] = [{}]
    size = 0
    for aid, entry in agents.items():
        n = len(pack_control({aid: entry}))
        if parts[-1] and size + n > budget:
            parts.append({})
            size = 0
        parts[-1][aid] = entry
        size += n
    return parts


class WorkerRuntime:
    """The control loop of ``python -m foltr_async join``."""

    def __init__(
        self,
        scenario: Scenario,
        link: WorkerLink,
        claims: set[int],
        *,
        connect_timeout: float,
        server_timeout: float,
    ) -> None:
        self.scenario = scenario
        self.link = link
        self.claims = claims
        self.connect_timeout = connect_timeout
        self.server_timeout = server_timeout
        self.host: AgentHost | None = None
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.welcomed = asyncio.Event()
        self.done = asyncio.Event()
        link.on_control = self._on_control

    def _on_control(self, msg: dict) -> None:
        t = msg["t"]
        if t == "welcome":
            self.welcomed.set()
        elif t == "rehello":  # the server forgot this worker (restarted, or thought it lost)
            self._hello()
        elif t == "wait":
            log.warning("worker_waiting", reason=msg.get("reason"))
        elif t == "bye":
            self.done.set()
        else:
            self.queue.put_nowait(msg)

    def _hello(self) -> None:
        self.link.control(
            {
                "t": "hello",
                "worker": self.link.name,
                "claims": sorted(self.claims),
                "host": os.uname().nodename,
                "pid": os.getpid(),
                "run": self.host.run if self.host is not None else 0,
            }
        )

    async def _introduce(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.welcomed.clear()
        self.link.beating = False
        while not self.welcomed.is_set():
            if self.done.is_set():  # a goodbye while saying hello again: the experiment is over
                return
            if self.link.failed.done():
                self.link.failed.result()  # raises the TransportError
            if loop.time() >= deadline:
                raise TransportError(
                    f"no answer from a server at {self.link.connect_address} within {timeout:.0f} s"
                )
            self._hello()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.welcomed.wait()
        self.link.beating = True
        self.link.last_heard = time.monotonic()
        log.info("worker_welcomed", server=self.link.connect_address, pid=os.getpid())

    async def run(self) -> None:
        await self._introduce(self.connect_timeout)
        control = asyncio.ensure_future(self._control_loop())
        try:
            while not self.done.is_set():
                if self.link.failed.done():
                    self.link.failed.result()
                if control.done():
                    control.result()
                silent = self.link.server_silent_for()
                if silent > self.link.timeout:
                    log.warning("server_lost", silent_s=round(silent, 1))
                    await self._drop_run()
                    await self._introduce(self.server_timeout)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.done.wait()
        finally:
            control.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await control
            await self._drop_run()

    async def _drop_run(self) -> None:
        if self.host is not None:
            host, self.host = self.host, None
            await host.crash_all()
            self.link.bus = None

    async def _control_loop(self) -> None:
        while True:
            msg = await self.queue.get()
            try:
                reply = await self._handle(msg)
            except FoltrError as e:
                self.link.control({"t": "error", "message": str(e), "req": msg.get("req")})
                if msg["t"] == "run":  # this worker cannot host the server's runs: stop
                    raise
                log.error("worker_error", error=str(e))
                continue
            if reply is not None:
                self.link.control({**reply, "req": msg.get("req")})

    async def _handle(self, msg: dict) -> dict | None:
        t, run = msg["t"], msg.get("run")
        if t == "run":
            await self._drop_run()
            self.host = AgentHost(self.scenario, self.link, msg)
            log.info(
                "run_started",
                run=run,
                variant=msg["variant"],
                repeat=msg["repeat"],
                agents=len(msg["agents"]),
            )
            states = self.host.start(msg["agents"])
            # the set-up blocked this loop (so the server's heartbeats waited unread): deaf,
            # not abandoned, as the server knows while it waits for this answer
            self.link.last_heard = time.monotonic()
            return {"t": "ready", "states": states}
        host = self.host
        if host is None or host.run != run:
            return {"t": "error", "message": f"no run {run} here"}
        if t == "act":
            return {"t": "ack", "states": await host.act(msg["agent"], msg["action"], msg["round"])}
        if t == "snap":
            *parts, last = _split(host.snapshot(), msg["part"])
            for part in parts:
                self.link.control({"t": "snapped_part", "agents": part, "req": msg.get("req")})
            return {"t": "snapped", "agents": last, "flush": host.flush()}
        if t == "end":
            flush = await host.end()
            self.host = None
            self.link.bus = None
            log.info("run_done", run=run)
            return {"t": "done", "flush": flush}
        return None


async def join(
    scenario: Scenario,
    connect: str,
    claims: set[int],
    *,
    keys: WorkerKeys | None,
    name: str,
    heartbeat: float = 1.0,
    heartbeat_timeout: float = 10.0,
    connect_timeout: float = 60.0,
    server_timeout: float = 120.0,
    parent: int | None = None,
) -> None:
    """Host the claimed clients for the server at ``connect`` until it says goodbye."""
    link = WorkerLink(connect, keys=keys, name=name, heartbeat=heartbeat, timeout=heartbeat_timeout)
    await link.start()
    runtime = WorkerRuntime(
        scenario, link, claims, connect_timeout=connect_timeout, server_timeout=server_timeout
    )
    watch = asyncio.ensure_future(_watch_parent(parent, runtime.done)) if parent else None
    try:
        await runtime.run()
    finally:
        if watch is not None:
            watch.cancel()
        link.close()


async def _watch_parent(pid: int, done: asyncio.Event) -> None:
    """Stop when the launcher that started this worker is gone."""
    while True:
        await asyncio.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("launcher_gone", pid=pid)
            done.set()
            return
        except PermissionError:
            pass


# --------------------------------------------------------------------------- launcher


class LocalWorkers:
    """``--transport zmq --workers N``: N ``join`` processes on this machine, keys made for the
    run in a private temporary folder (unless ``insecure``), logs in ``OUT/workers/``."""

    def __init__(
        self, scenario: Scenario, scenario_args: list[str], n: int, log_dir: Path, insecure: bool
    ) -> None:
        if n < 1:
            raise FoltrError(f"--workers: expected an integer >= 1, got {n}")
        clients = max(cfg["federation"]["clients"] for cfg in scenario.variants.values())
        chunks = [c for c in np.array_split(np.arange(clients), n) if c.size]
        if not chunks:
            raise ScenarioError("--transport zmq: the scenario has no honest clients to host")
        self.specs = [agent_ids(c.tolist()) for c in chunks]
        self.scenario_args = scenario_args
        self.log_dir = Path(log_dir)
        self.insecure = insecure
        self.procs: list[subprocess.Popen] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.key_dir: Path | None = None
        if not insecure:
            self._tmp = tempfile.TemporaryDirectory(prefix="foltr-keys-")
            self.key_dir = Path(self._tmp.name)
            make_keys(self.key_dir, workers=len(self.specs))

    def server_keys(self) -> ServerKeys | None:
        from foltr_async.runtime.zmqbus import load_server_keys

        return None if self.key_dir is None else load_server_keys(self.key_dir)

    def command(self, i: int, endpoint: str) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "foltr_async",
            "join",
            *self.scenario_args,
            "--connect",
            endpoint,
            "--agents",
            self.specs[i],
            "--name",
            f"worker-{i}",
            "--exit-with",
            str(os.getpid()),
        ]
        return cmd + (["--insecure"] if self.key_dir is None else ["--keys", str(self.key_dir)])

    def launch(self, endpoint: str) -> None:
        endpoint = endpoint.replace("0.0.0.0", "127.0.0.1").replace("//*", "//127.0.0.1")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for i in range(len(self.specs)):
            with open(self.log_dir / f"worker-{i}.log", "ab") as fh:
                self.procs.append(
                    subprocess.Popen(
                        self.command(i, endpoint),
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        log.info("workers_started", n=len(self.procs), logs=str(self.log_dir))

    def check(self) -> None:
        """A worker that ended before hosting its clients cannot come back: say why."""
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and code != 0:
                log_file = self.log_dir / f"worker-{i}.log"
                lines = log_file.read_text(errors="replace").strip().splitlines()
                raise FoltrError(
                    f"worker-{i} exited with code {code}: "
                    f"{lines[-1] if lines else 'no output'} (log: {log_file})"
                )

    def stop(self, grace: float = 10.0) -> None:
        """After the goodbyes: wait for the workers, then end the stragglers."""
        deadline = time.monotonic() + grace
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

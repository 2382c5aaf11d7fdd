"""The server side of a zmq run (``serve``, ``run --transport zmq``): the hub, its workers, runs.

The server process runs the experiment as in memory (same ``Simulation``, observers, results
writer, checkpoints), on the real-time asyncio loop and a ``HubBus``; its run holds a
``RemoteAgent`` proxy for each honest client a worker hosts, and attackers and eavesdroppers
run here. Round 1 does not start before every expected client is running (or
``join_timeout`` passes: the missing ones are logged and join, late, when a worker hosts
them). A worker whose heartbeats stop loses its clients (crashed: they miss the round and are
not selected again); a worker that says hello again gets them back, built afresh, and they
rejoin. Replies are aggregated in client-id order and the online metric is ordered by
(round, client), so a zmq run with no simulated latency, loss or dropout gives the metrics of
the memory run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from foltr_async.config import RunConfig
from foltr_async.distributed.claims import agent_ids, client_number
from foltr_async.distributed.control import WORKER_CONTROL, run_digest
from foltr_async.provenance import code_stamp
from foltr_async.rng import stream
from foltr_async.runtime.trust import RunLedger
from foltr_async.runtime.zmq_buses import HubBus
from foltr_async.runtime.zmq_endpoints import Hub
from foltr_async.runtime.zmq_keys import ServerKeys
from foltr_async.runtime.zmq_wire import DEFAULT_LIMITS, WireLimits
from foltr_async.simulation import ROLE_OF_GROUP, Simulation

__all__ = ["RemoteAgent", "ZmqServer"]

log = structlog.get_logger()


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

    def make_bus(self, cfg: RunConfig, seed: int) -> HubBus:
        self.run_id += 1
        self.bus = HubBus(
            cfg.new_network(),
            stream(seed, "net"),
            self.hub,
            self.run_id,
            max_bytes=self.limits.message,
        )
        self.hub.bus = self.bus
        self.worker_errors = 0  # runs a worker refused (this run)
        self.hosted, self.late, self.lost, self.missing = set(), set(), set(), []
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
                    agents=agent_ids([client_number(a) for a in missing]),
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
            if client_number(aid) not in w.claims:
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
        bus = self.bus
        times = bus.round_started if bus is not None else []
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

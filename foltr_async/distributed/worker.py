"""A worker (``python -m foltr_async join``): hosts its share of a run's honest clients.

Each worker builds its clients from its own copy of the scenario and the data (client data
never travels), and refuses a run whose code, scenario or data differ from the server's. What
its clients show and receive goes to the server in a *flush* ahead of every message they send,
so a killed worker's interactions behind every update the server got are counted. A worker
that loses the server drops its run and says hello again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from foltr_async.distributed.control import run_digest
from foltr_async.errors import FoltrError, ScenarioError, TransportError
from foltr_async.observe.observer import Observer
from foltr_async.provenance import code_stamp
from foltr_async.runtime import heap
from foltr_async.runtime.compute import BatchPool
from foltr_async.runtime.zmq_buses import WorkerBus, stats_delta
from foltr_async.runtime.zmq_endpoints import WorkerLink
from foltr_async.runtime.zmq_keys import WorkerKeys
from foltr_async.runtime.zmq_wire import pack_control
from foltr_async.scenario.load import Scenario
from foltr_async.simulation import Simulation

__all__ = ["AgentHost", "WorkerRuntime", "join"]

log = structlog.get_logger()


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
        self.flushed = 0
        self.stats_before: dict | None = None
        self.link = link
        self.bus = WorkerBus(link, self.run, before_send=self.report)
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
        link.bus = self.bus

    def start(self, agents: dict) -> dict:
        self.sim.saver.restore_agents(
            {a: e for a, e in agents.items() if e.get("blob") is not None}
        )
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
        agents = self.sim.saver.capture_agents(ids)
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

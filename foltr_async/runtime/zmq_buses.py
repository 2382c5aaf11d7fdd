"""The ``Bus`` across processes: ``HubBus`` in the server process, ``WorkerBus`` in each worker.

Topology: a star. Every message crosses the hub, also between two agents of one worker, so
the server process is the one place where the network model is applied, taps see every link
(eavesdroppers and full-knowledge attackers run there) and message counters are kept, exactly
as on the memory bus. The envelopes and the codec are the memory bus's: the same bytes travel,
byte counts match.

- ``HubBus`` is a ``MemoryBus`` whose registered agents are local agents or *proxies* of
  remote ones (``remote = True``, ``worker`` = the hosting worker). Sending checks and counts
  as in memory, draws loss and latency from the scenario's network model, then hands a message
  for a remote agent to the hub with its simulated delay. A broadcast goes to each worker
  **once** (the body packed once, the per-agent headers rebuilt by the worker). Bytes from a
  worker are decoded (the trust boundary: malformed, oversized, unknown, replayed input is
  dropped and counted as on the memory bus), checked to come from an agent that worker hosts
  (else dropped as ``unauthenticated``), counted as sent, then routed like a local send.
- ``WorkerBus`` forwards every send to the hub and delivers what the hub sends after the
  simulated delay the hub drew (real seconds on top of the real transit), with the memory
  bus's decoding, replay guard and counters (sends are counted by the hub). It cannot tap.

Frames of another run than the current one are dropped (``stale_run``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from foltr_async.errors import ScenarioError
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.replay import ReplayGuard
from foltr_async.runtime.schema import MESSAGE_KINDS, SchemaRegistry
from foltr_async.runtime.wire import (
    DEFAULT_MAX_BYTES,
    WIRE_VERSION,
    DropMessage,
    Envelope,
    _header,
    decode,
    encode,
    encode_many,
)
from foltr_async.runtime.zmq_endpoints import Hub, WorkerLink
from foltr_async.runtime.zmq_wire import RUN_HEADER

__all__ = ["HubBus", "WorkerBus", "stats_delta"]


def _head(kind: str, src: str, dst: str, round: int, seq: int, sent_at: float) -> bytes:
    """An envelope's bytes up to its body (the packed body follows): the codec's own framing."""
    return _header(WIRE_VERSION, kind, src, dst, seq, round, sent_at)


class HubBus(MemoryBus):
    """The server process's bus: a memory bus whose remote agents live behind the hub."""

    def __init__(
        self,
        network: NetworkModel,
        rng: np.random.Generator,
        hub: Hub,
        run: int,
        *,
        registry: SchemaRegistry = MESSAGE_KINDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        replay_window: int = 4096,
    ) -> None:
        super().__init__(
            network, rng, registry=registry, max_bytes=max_bytes, replay_window=replay_window
        )
        self.hub = hub
        self.run_id = run
        self._where: dict[str, bytes] = {}  # registered remote agent -> worker routing id
        self.frames = 0  # data frames sent to workers (fan-out: one per worker per broadcast)
        self.received = 0  # data frames received from workers
        #: messages handed to the hub for each remote agent, and for each worker (with their
        #: bytes): what a worker's delivery counters and its clients' measurements are
        #: checked against (``runtime.trust``)
        self.sent_to: Counter[str] = Counter()
        self.routed: Counter[bytes] = Counter()
        self.routed_bytes: Counter[bytes] = Counter()
        #: wall time (``perf_counter``) at which each round began: the transport report's
        #: round times
        self.round_started: list[float] = []

    def begin_round(self, round: int, agent_ids: Sequence[str]) -> set[str]:
        self.round_started.append(time.perf_counter())
        return super().begin_round(round, agent_ids)

    def register(self, agent: Any) -> None:
        super().register(agent)
        if agent.remote:
            self._where[agent.id] = agent.worker

    def unregister(self, agent_id: str) -> None:
        super().unregister(agent_id)
        self._where.pop(agent_id, None)

    def hosted_by(self, agent_id: str) -> bytes | None:
        return self._where.get(agent_id)

    def forget_sender(self, agent_id: str) -> None:
        """A re-hosted agent starts afresh: it numbers its messages from 1 again and its new
        replay guard counts from 0, so both directions' numbering restarts."""
        for guard in self._guards.values():
            guard.forget(agent_id)
        for link in [k for k in self._seq if k[1] == agent_id]:
            del self._seq[link]

    def inject(self, data: bytes, dst: str) -> None:
        worker = self._where.get(dst)
        if worker is None:
            super().inject(data, dst)
            return
        self.stats.injected += 1  # raw bytes for a remote agent: its worker decodes them
        self.frames += 1
        self._routed(worker, dst, len(data))
        self.hub.send(worker, [b"M", RUN_HEADER.pack(self.run_id, 0.0), dst.encode(), data])

    def _schedule(self, loop, when, data, src, dst, kind, shared=None) -> None:  # noqa: ANN001
        worker = self._where.get(dst)
        if worker is None:
            super()._schedule(loop, when, data, src, dst, kind, shared)
            return
        delay = max(0.0, when - loop.time())
        self.frames += 1
        self._routed(worker, dst, len(data))
        self.hub.send(
            worker,
            [b"M", RUN_HEADER.pack(self.run_id, delay), dst.encode(), data],
            lambda: self.report_drop("unreachable", f"worker of {dst} is gone", src, dst, kind),
        )

    def broadcast(
        self, src: str, dsts: Sequence[str], kind: str, body: dict, round: int = 0
    ) -> None:
        remote = [d for d in dsts if d in self._where]
        if not remote:
            super().broadcast(src, dsts, kind, body, round)
            return
        local = [d for d in dsts if d not in self._where]
        if local:
            super().broadcast(src, local, kind, body, round)
        sent = self._send_many(src, remote, kind, body, round)
        if sent is None:
            return
        _, now, seqs, datas, arrivals = sent
        packed = datas[0][len(_head(kind, src, remote[0], round, seqs[0], now)) :]
        groups: dict[bytes, tuple[list[str], list[int], list[float]]] = {}
        for i, t in arrivals:
            self._routed(self._where[remote[i]], remote[i], len(datas[i]))
            d, s, ts = groups.setdefault(self._where[remote[i]], ([], [], []))
            d.append(remote[i])
            s.append(seqs[i])
            ts.append(t)
        for worker, (d, s, ts) in groups.items():
            meta = msgpack.packb([src, kind, round, now, d, s, ts])
            self.frames += 1
            self.hub.send(
                worker,
                [b"B", RUN_HEADER.pack(self.run_id, 0.0), meta, packed],
                lambda d=d: [
                    self.report_drop("unreachable", "worker is gone", src, x, kind) for x in d
                ],
            )

    def _routed(self, worker: bytes, dst: str, n: int) -> None:
        self.sent_to[dst] += 1
        self.routed[worker] += 1
        self.routed_bytes[worker] += n

    def junk(
        self, reason: str, detail: str, src: str | None, dst: str | None, kind: str | None
    ) -> None:
        """A peer's data frame that is no message of the run (undecodable, of another run, from
        an agent its worker does not host): counted as a drop, logged as the hub's warnings
        are (a line per reason at most every ``log_every`` s, with the count since), not one
        event each (36 k junk frames in 3 s wrote 7.1 MB of events)."""
        self.stats.injected += 1
        self.stats.dropped[reason] += 1
        if kind is not None:
            self.stats.kind(kind).dropped += 1
        self.hub.warn("hub_data_dropped", reason, src=src, detail=detail[:200])
        for fn in self._drop_listeners:
            fn(reason, detail, src, dst, kind)

    def from_worker(self, worker: bytes, run: int, data: bytes) -> None:
        """Bytes an agent of ``worker`` sent: check, count and route them like a local send."""
        self.received += 1
        if run != self.run_id:
            self.junk("stale_run", f"frame of run {run} during run {self.run_id}", None, None, None)
            return
        try:
            env = decode(data, self.registry, self.max_bytes)
        except DropMessage as e:
            h = e.header
            src, dst, kind = (h.src, h.dst, h.kind) if h else (None, None, None)
            self.junk(e.reason, e.detail, src, dst, kind)
            return
        if self._where.get(env.src) != worker:
            self.junk(
                "unauthenticated",
                f"{env.src} is not hosted by the sending worker",
                env.src,
                env.dst,
                env.kind,
            )
            return
        header = None
        if self._taps:
            header = Envelope(
                env.kind, env.src, env.dst, {}, env.round, env.seq, env.sent_at, WIRE_VERSION
            )
        if not self._accept(data, env.src, env.dst, env.kind, header):
            return
        t = self.network.transit_time(
            env.src,
            env.dst,
            len(data),
            self._rng_net,
            src_role=self._roles.get(env.src),
            dst_role=self._roles.get(env.dst),
        )
        if t is None:
            self.report_drop("lost", "lost in the network", env.src, env.dst, env.kind)
            return
        loop = asyncio.get_running_loop()
        self._schedule(loop, loop.time() + t, data, env.src, env.dst, env.kind)


class WorkerBus(MemoryBus):
    """An agent-host process's bus: sends go to the hub, deliveries come from it."""

    def __init__(
        self,
        link: WorkerLink,
        run: int,
        *,
        registry: SchemaRegistry = MESSAGE_KINDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        replay_window: int = 4096,
        before_send: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            NetworkModel(),
            np.random.default_rng(0),  # never drawn from: the hub applies the network model
            registry=registry,
            max_bytes=max_bytes,
            replay_window=replay_window,
        )
        self.link = link
        self.run_id = run
        #: called before each message leaves (the host sends its measurements ahead of it)
        self.before_send = before_send

    def tap(self, callback, **kw) -> None:  # noqa: ANN001
        raise ScenarioError(
            "an agent that taps links must run in the server process (workers host honest "
            "clients only)"
        )

    def begin_round(self, round: int, agent_ids: Sequence[str]) -> set[str]:
        return set(agent_ids)  # presence is the hub's: it never asks a worker

    def seqs_of(self, src: str) -> dict[str, int]:
        """The last sequence number ``src`` used towards each destination (checkpoints)."""
        return {dst: n for (s, dst), n in self._seq.items() if s == src}

    def seen_by(self, dst: str) -> dict[str, int]:
        """The highest seq ``dst`` accepted from each sender (checkpoints)."""
        guard = self._guards.get(dst)
        return guard.highs() if guard is not None else {}

    def restore_seqs(self, agent: str, sent: dict[str, int], seen: dict[str, int]) -> None:
        """Continue an agent's numbering and its replay guard from a checkpoint."""
        for dst, n in sent.items():
            self._seq[agent, dst] = n
        if seen:
            self._guards[agent] = guard = ReplayGuard(self.replay_window)
            guard.resume(seen)

    def send(self, src: str, dst: str, kind: str, body: dict, round: int = 0) -> None:
        now = asyncio.get_running_loop().time()
        data = encode(
            Envelope(kind, src, dst, body, round, self._next_seq(src, dst), now, WIRE_VERSION)
        )
        if self.before_send is not None:
            self.before_send()
        self.link.send_data(self.run_id, dst, data)

    def broadcast(
        self, src: str, dsts: Sequence[str], kind: str, body: dict, round: int = 0
    ) -> None:
        dsts = list(dsts)
        if not dsts:
            return
        now = asyncio.get_running_loop().time()
        seqs = [self._next_seq(src, d) for d in dsts]
        if self.before_send is not None:
            self.before_send()
        for d, data in zip(dsts, encode_many(src, dsts, kind, body, round, seqs, now), strict=True):
            self.link.send_data(self.run_id, d, data)

    def on_frames(self, frames: list[bytes]) -> None:
        """A data frame from the hub: schedule each delivery after its simulated delay."""
        run, delay = RUN_HEADER.unpack(frames[1])
        loop = asyncio.get_running_loop()
        now = loop.time()
        if run != self.run_id:
            self.report_drop(
                "stale_run", f"frame of run {run} during run {self.run_id}", None, None, None
            )
            return
        if frames[0] == b"M":
            self._schedule(loop, now + delay, frames[3], None, frames[2].decode(), None)
            return
        src, kind, round, sent_at, dsts, seqs, delays = msgpack.unpackb(frames[2])
        packed = frames[3]
        for dst, seq, d in zip(dsts, seqs, delays, strict=True):
            data = _head(kind, src, dst, round, seq, sent_at) + packed
            self._schedule(loop, now + d, data, src, dst, kind)

    def delivery_stats(self) -> dict:
        """Counters a worker adds to the hub's at a flush (the hub counts the sends)."""
        st = self.stats
        return {
            "delivered": st.delivered,
            "bytes_delivered": st.bytes_delivered,
            "dropped": dict(st.dropped),
            "kinds": {k: [v.delivered, v.bytes_delivered, v.dropped] for k, v in st.kinds.items()},
        }


def stats_delta(now: dict, before: dict | None) -> dict:
    """``now - before`` of two ``delivery_stats`` snapshots."""
    if before is None:
        return now
    dropped = {k: v - before["dropped"].get(k, 0) for k, v in now["dropped"].items()}
    kinds = {}
    for k, v in now["kinds"].items():
        b = before["kinds"].get(k, [0, 0, 0])
        kinds[k] = [x - y for x, y in zip(v, b, strict=True)]
    return {
        "delivered": now["delivered"] - before["delivered"],
        "bytes_delivered": now["bytes_delivered"] - before["bytes_delivered"],
        "dropped": {k: v for k, v in dropped.items() if v},
        "kinds": kinds,
    }

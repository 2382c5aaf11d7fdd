"""The bus: the only way agents talk. Every message crosses it as bytes.

``Bus`` is the transport-agnostic interface plus the bookkeeping every transport shares
(message statistics, taps for eavesdroppers, drop counting and logging). ``MemoryBus`` is the
in-process transport: it applies the ``NetworkModel`` (loss, availability, latency,
bandwidth) and delivers with ``loop.call_at`` so, on a ``VirtualTimeLoop``, delays cost no
wall time. A ZeroMQ bus implements the same interface.

Drops are counted per reason in ``stats.dropped``, logged at debug level and reported to drop
listeners; they are never raised into an agent. Reasons: transport ``lost``, ``offline``,
``unknown_dst``, ``misrouted`` (header dst differs from the receiver); wire (from the codec)
``oversized``, ``malformed``, ``bad_version``, ``unknown_kind``, ``bad_schema``, ``replayed``,
``seq_ahead``; agent (reported by agents) ``not_running``, ``no_handler``, ``handler_error``.
Accounting: ``sent + injected == delivered + (drops of non-agent reasons) + in_flight``;
agent drops happen after delivery.
"""

from __future__ import annotations

import abc
import asyncio
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import structlog

from foltr_async.runtime.checkpoint import Checkpointed
from foltr_async.runtime.network import NetworkModel, Presence
from foltr_async.runtime.replay import ReplayGuard
from foltr_async.runtime.schema import MESSAGE_KINDS, SchemaRegistry
from foltr_async.runtime.wire import (
    DEFAULT_MAX_BYTES,
    WIRE_VERSION,
    DropMessage,
    Envelope,
    SharedBody,
    decode,
    decode_from,
    encode_many,
    encode_one,
)

__all__ = ["AGENT_REASONS", "Bus", "MemoryBus", "MessageStats"]

log = structlog.get_logger()

AGENT_REASONS = frozenset(("not_running", "no_handler", "handler_error"))

TapCallback = Callable[[bytes, Envelope], None]
DropListener = Callable[[str, str, "str | None", "str | None", "str | None"], None]


class Receiver(Protocol):
    id: str
    role: str
    #: a stand-in for an agent another process hosts (the ZeroMQ hub routes to its worker)
    remote: bool

    def deliver(self, env: Envelope) -> None: ...


class _KindStats:
    __slots__ = ("sent", "delivered", "bytes_sent", "bytes_delivered", "dropped")

    def __init__(self) -> None:
        self.sent = self.delivered = self.bytes_sent = self.bytes_delivered = self.dropped = 0


class MessageStats:
    """Counters of one bus: messages and bytes sent/delivered, drops per reason, per kind."""

    def __init__(self) -> None:
        self.sent = 0
        self.delivered = 0
        self.injected = 0
        self.bytes_sent = 0
        self.bytes_delivered = 0
        self.tap_errors = 0
        self.dropped: Counter[str] = Counter()
        self.kinds: dict[str, _KindStats] = {}

    def kind(self, kind: str) -> _KindStats:
        ks = self.kinds.get(kind)
        if ks is None:
            ks = self.kinds[kind] = _KindStats()
        return ks

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data for results.json (``bytes`` = bytes sent)."""
        return {
            "sent": self.sent,
            "delivered": self.delivered,
            "injected": self.injected,
            "bytes": self.bytes_sent,
            "bytes_sent": self.bytes_sent,
            "bytes_delivered": self.bytes_delivered,
            "dropped": dict(sorted(self.dropped.items())),
            "tap_errors": self.tap_errors,
            "kinds": {
                k: {s: getattr(v, s) for s in _KindStats.__slots__}
                for k, v in sorted(self.kinds.items())
            },
        }


def _idset(x: str | Iterable[str] | None) -> frozenset[str] | None:
    if x is None:
        return None
    return frozenset((x,)) if isinstance(x, str) else frozenset(x)


class _Tap:
    __slots__ = ("callback", "src", "dst", "kinds")

    def __init__(self, callback: TapCallback, src: Any, dst: Any, kinds: Any) -> None:
        self.callback = callback
        self.src, self.dst, self.kinds = _idset(src), _idset(dst), _idset(kinds)

    def wants(self, src: str, dst: str, kind: str) -> bool:
        return (
            (self.src is None or src in self.src)
            and (self.dst is None or dst in self.dst)
            and (self.kinds is None or kind in self.kinds)
        )


class Bus(Checkpointed, abc.ABC):
    """Transport interface plus shared bookkeeping (stats, taps, drop reporting)."""

    #: State between rounds: the counters (agents register and tap again as they restart).
    checkpoint_fields: tuple[str, ...] = ("stats",)

    def __init__(self) -> None:
        self.stats = MessageStats()
        self._taps: list[_Tap] = []
        self._drop_listeners: list[DropListener] = []

    # ---------------------------------------------------------------- transport (abstract)

    @abc.abstractmethod
    def register(self, agent: Receiver) -> None:
        """Make ``agent`` (with ``.id``, ``.role``, ``.deliver(env)``) reachable."""

    @abc.abstractmethod
    def unregister(self, agent_id: str) -> None:
        """Forget an agent; messages still on their way to it are dropped (``unknown_dst``)."""

    @abc.abstractmethod
    def send(self, src: str, dst: str, kind: str, body: dict, round: int = 0) -> None:
        """Queue one message; never blocks, never raises for network reasons."""

    @abc.abstractmethod
    def broadcast(
        self, src: str, dsts: Sequence[str], kind: str, body: dict, round: int = 0
    ) -> None:
        """The same body to many destinations, encoded once."""

    @abc.abstractmethod
    def begin_round(self, round: int, agent_ids: Sequence[str]) -> set[str]:
        """Sample who of ``agent_ids`` is online this round; returns the online ones."""

    @abc.abstractmethod
    def inject(self, data: bytes, dst: str) -> None:
        """Raw bytes arriving for ``dst`` from the wire: decoded, checked, counted, delivered."""

    # ---------------------------------------------------------------- shared bookkeeping

    def tap(
        self,
        callback: TapCallback,
        *,
        src: str | Iterable[str] | None = None,
        dst: str | Iterable[str] | None = None,
        kinds: str | Iterable[str] | None = None,
    ) -> None:
        """Call ``callback(data, header)`` at send time with the exact wire bytes.

        ``header`` is the envelope without its body (``body == {}``): an eavesdropper learns
        the content only by decoding the bytes, like a real one.
        """
        self._taps.append(_Tap(callback, src, dst, kinds))

    def untap(self, callback: TapCallback) -> None:
        self._taps = [t for t in self._taps if t.callback != callback]  # bound methods: ==

    def add_drop_listener(self, fn: DropListener) -> None:
        """``fn(reason, detail, src, dst, kind)`` for every drop (event log, console)."""
        self._drop_listeners.append(fn)

    def report_drop(
        self, reason: str, detail: str, src: str | None, dst: str | None, kind: str | None
    ) -> None:
        """Count, log and announce one dropped message (agents report theirs here too)."""
        self.stats.dropped[reason] += 1
        if kind is not None:
            self.stats.kind(kind).dropped += 1
        log.debug("drop", reason=reason, detail=detail, src=src, dst=dst, kind=kind)
        for fn in self._drop_listeners:
            fn(reason, detail, src, dst, kind)

    def _tap(self, data: bytes, header: Envelope) -> None:
        for t in self._taps:
            if t.wants(header.src, header.dst, header.kind):
                try:
                    t.callback(data, header)
                except Exception:  # an observer's bug must not break the sender
                    self.stats.tap_errors += 1
                    log.exception("tap_error", src=header.src, dst=header.dst, kind=header.kind)


def _split(rng: np.random.Generator) -> tuple[np.random.Generator, np.random.Generator]:
    """Two independent child streams (presence, traffic) of the bus's generator."""
    try:
        a, b = rng.spawn(2)
    except (TypeError, ValueError):  # a bit generator without a SeedSequence
        a, b = (np.random.default_rng(s) for s in rng.integers(2**63, size=2))
    return a, b


class MemoryBus(Bus):
    """In-process transport with a simulated network.

    Per message: encode (sequence number per src->dst link, ``sent_at`` = loop time), count,
    drop if the sender is offline, show to taps, drop if the destination is unknown or
    offline, ask the network for loss and transit time, then deliver at ``now + transit``:
    re-check the receiver (and, under FedScale's completion rule, that the sending client's
    trace still has it online), decode, replay-check, ``agent.deliver(env)``. Messages due at the
    same instant arrive in the order they were sent.

    Randomness: ``rng`` is split once into two child streams, one for per-round presence and
    one for message loss and latency, so the clients online in a round do not depend on how
    much traffic earlier rounds made (variants of one seed share their dropout pattern).
    """

    #: Random streams, presence, sequence numbers and replay guards too (a checkpoint is taken
    #: when nothing is in flight, so the delivery queue is empty).
    checkpoint_fields = (
        *Bus.checkpoint_fields,
        "round",
        "_rng_presence",
        "_rng_net",
        "_presence",
        "_guards",
        "_seq",
        "_offline",
    )

    def __init__(
        self,
        network: NetworkModel,
        rng: np.random.Generator,
        *,
        registry: SchemaRegistry = MESSAGE_KINDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        replay_window: int = 4096,
    ) -> None:
        super().__init__()
        self.network = network
        self.registry = registry
        self.max_bytes = max_bytes
        self.replay_window = replay_window
        self.round = 0
        self._rng_presence, self._rng_net = _split(rng)
        self._presence = Presence()
        self._agents: dict[str, Receiver] = {}
        self._roles: dict[str, str] = {}
        self._guards: dict[str, ReplayGuard] = {}
        self._seq: dict[tuple[str, str], int] = {}
        self._offline: set[str] = set()
        #: due time -> the messages due then in send order: (bytes, src, dst, kind, the
        #: broadcast's SharedBody or None); ``_times`` is a heap of its keys
        self._due: dict[float, deque[tuple[bytes, str, str, str, SharedBody | None]]] = {}
        self._times: list[float] = []
        self._in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        #: FedScale's completion rule: a client's message counts only if it is still online
        self._completion = network.checks_completion

    # ---------------------------------------------------------------- membership

    def register(self, agent: Receiver) -> None:
        old = self._agents.get(agent.id)
        if old is not None and old is not agent:
            raise ValueError(f"agent id {agent.id!r} is already registered on this bus")
        self._agents[agent.id] = agent
        self._roles[agent.id] = agent.role

    def unregister(self, agent_id: str) -> None:
        self._agents.pop(agent_id, None)

    def is_registered(self, agent_id: str) -> bool:
        return agent_id in self._agents

    def is_online(self, agent_id: str) -> bool:
        return agent_id in self._agents and agent_id not in self._offline

    def begin_round(self, round: int, agent_ids: Sequence[str]) -> set[str]:
        ids = set(agent_ids)
        try:
            now = asyncio.get_running_loop().time()  # diurnal / trace availability
        except RuntimeError:
            now = 0.0
        online = self.network.online(
            ids, round, self._rng_presence, state=self._presence, roles=self._roles, now=now
        )
        self._offline = ids - online
        self.round = round
        return online

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ---------------------------------------------------------------- sending

    def _next_seq(self, src: str, dst: str) -> int:
        seq = self._seq.get((src, dst), 0) + 1
        self._seq[src, dst] = seq
        return seq

    def _accept(self, data: bytes, src: str, dst: str, kind: str, header: Envelope | None) -> bool:
        """Count a sent message and apply the checks before the network; False if dropped."""
        st = self.stats
        n = len(data)
        st.sent += 1
        st.bytes_sent += n
        ks = st.kind(kind)
        ks.sent += 1
        ks.bytes_sent += n
        if src in self._offline:
            self.report_drop("offline", f"sender {src} is offline", src, dst, kind)
            return False
        if header is not None:
            self._tap(data, header)
        if dst not in self._agents:
            self.report_drop("unknown_dst", f"no agent {dst} on the bus", src, dst, kind)
            return False
        if dst in self._offline:
            self.report_drop("offline", f"receiver {dst} is offline", src, dst, kind)
            return False
        return True

    def _schedule(
        self,
        loop: asyncio.AbstractEventLoop,
        when: float,
        data: bytes,
        src: str,
        dst: str,
        kind: str,
        shared: SharedBody | None = None,
    ) -> None:
        queue = self._due.get(when)
        if queue is None:
            queue = self._due[when] = deque()
            heapq.heappush(self._times, when)
        queue.append((data, src, dst, kind, shared))
        self._in_flight += 1
        if self._timer is None or when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(when, self._arrive_due)
            self._timer_at = when

    def send(self, src: str, dst: str, kind: str, body: dict, round: int = 0) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        seq = self._next_seq(src, dst)
        data = encode_one(kind, src, dst, body, round, seq, now)
        header = Envelope(kind, src, dst, {}, round, seq, now, WIRE_VERSION) if self._taps else None
        if not self._accept(data, src, dst, kind, header):
            return
        t = self.network.transit_time(
            src,
            dst,
            len(data),
            self._rng_net,
            src_role=self._roles.get(src),
            dst_role=self._roles.get(dst),
        )
        if t is None:
            self.report_drop("lost", "lost in the network", src, dst, kind)
            return
        self._schedule(loop, now + t, data, src, dst, kind)

    def broadcast(
        self, src: str, dsts: Sequence[str], kind: str, body: dict, round: int = 0
    ) -> None:
        # One body for every copy: packed once, and parsed and schema-checked once on arrival
        # (each copy's header is still decoded and checked from its own bytes).
        shared = SharedBody(body)
        sent = self._send_many(src, list(dsts), kind, shared, round)
        if sent is None:
            return
        loop, now, _, datas, arrivals = sent
        for i, t in arrivals:
            self._schedule(loop, now + t, datas[i], src, dsts[i], kind, shared)

    def _send_many(
        self, src: str, dsts: list[str], kind: str, body: dict | SharedBody, round: int
    ) -> (
        tuple[asyncio.AbstractEventLoop, float, list[int], list[bytes], list[tuple[int, float]]]
        | None
    ):
        """The sending half of a broadcast, shared by every transport: sequence numbers, one
        body encode, taps and send-side drops, network transit times (losses counted). Returns
        (loop, now, seqs, datas, [(index into dsts, transit time)] of what will arrive), or None
        when nothing is left to deliver."""
        if not dsts:
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        seqs = [self._next_seq(src, d) for d in dsts]
        datas = encode_many(src, dsts, kind, body, round, seqs, now)
        taps = bool(self._taps)
        live = [
            i
            for i, (d, data) in enumerate(zip(dsts, datas, strict=True))
            if self._accept(
                data,
                src,
                d,
                kind,
                Envelope(kind, src, d, {}, round, seqs[i], now, WIRE_VERSION) if taps else None,
            )
        ]
        if not live:
            return None
        times = self.network.transit_times(
            src,
            [dsts[i] for i in live],
            np.array([len(datas[i]) for i in live]),
            self._rng_net,
            src_role=self._roles.get(src),
            dst_roles=[self._roles.get(dsts[i]) for i in live],
        )
        arrivals = []
        for i, t in zip(live, times.tolist(), strict=True):
            if math.isnan(t):
                self.report_drop("lost", "lost in the network", src, dsts[i], kind)
            else:
                arrivals.append((i, t))
        return loop, now, seqs, datas, arrivals

    # ---------------------------------------------------------------- receiving

    def _arrive_due(self) -> None:
        # One loop timer, always for the earliest message, instead of one TimerHandle per
        # message; the messages of one instant (a broadcast's copies, a round's replies on a
        # network without latency) are one heap entry, delivered in send order in one pass
        # (those sent meanwhile for the same instant too, after them).
        limit, self._timer = self._timer_at, None
        times, due = self._times, self._due
        while times and times[0] <= limit:
            when = heapq.heappop(times)
            queue = due[when]
            while queue:
                data, src, dst, kind, shared = queue.popleft()
                self._in_flight -= 1
                self._arrive(data, dst, src, kind, shared)
            del due[when]
        if times and self._timer is None:
            self._timer_at = times[0]
            self._timer = asyncio.get_running_loop().call_at(self._timer_at, self._arrive_due)

    def inject(self, data: bytes, dst: str) -> None:
        self.stats.injected += 1
        self._arrive(data, dst, None, None)

    def _arrive(
        self,
        data: bytes,
        dst: str,
        src: str | None,
        kind: str | None,
        shared: SharedBody | None = None,
    ) -> None:
        agent = self._agents.get(dst)
        if agent is None:
            self.report_drop("unknown_dst", f"no agent {dst} on the bus", src, dst, kind)
            return
        if dst in self._offline:
            self.report_drop("offline", f"receiver {dst} is offline", src, dst, kind)
            return
        if (
            self._completion
            and src is not None
            and self.network.offline_at(src, asyncio.get_running_loop().time())
        ):
            self.report_drop(
                "offline", f"sender {src} went offline before this arrived", src, dst, kind
            )
            return
        try:
            if kind is None:  # raw bytes: nothing is known about them
                env = decode(data, self.registry, self.max_bytes)
            else:
                env = decode_from(data, kind, src, dst, shared, self.registry, self.max_bytes)
        except DropMessage as e:
            h = e.header
            self.report_drop(e.reason, e.detail, h.src if h else src, dst, h.kind if h else kind)
            return
        if env.dst != dst:
            self.report_drop("misrouted", f"addressed to {env.dst}", env.src, dst, env.kind)
            return
        guard = self._guards.get(dst)
        if guard is None:
            guard = self._guards[dst] = ReplayGuard(self.replay_window)
        refused = guard.check(env)
        if refused is not None:
            self.report_drop(refused, f"seq {env.seq} from {env.src}", env.src, dst, env.kind)
            return
        n = len(data)
        st = self.stats
        st.delivered += 1
        st.bytes_delivered += n
        ks = st.kind(env.kind)
        ks.delivered += 1
        ks.bytes_delivered += n
        try:
            agent.deliver(env)
        except Exception as e:  # a receiver's bug is counted against it, not the bus
            log.exception("deliver_error", agent=dst, kind=env.kind, src=env.src)
            self.report_drop("handler_error", repr(e), env.src, dst, env.kind)

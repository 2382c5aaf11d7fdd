"""ZeroMQ transport: the bus across processes and hosts (real time, asyncio sockets).

Topology: a star. The server process runs the ``Hub``, one ROUTER socket bound to
``tcp://*:PORT``; every agent-host process (a *worker*) connects one DEALER socket to it
(``WorkerLink``) and may host many agents. Every message crosses the hub, also between two
agents of one worker, so the hub is the one place where the network model is applied, taps see
every link (eavesdroppers and full-knowledge attackers run in the server process) and
message counters are kept, exactly as on the memory bus. The envelopes and the codec are the
memory bus's: the same bytes travel, byte counts match.

- ``HubBus`` (server process) is a ``MemoryBus`` whose registered agents are local agents or
  *proxies* of remote ones (``remote = True``, ``worker`` = the hosting worker). Sending checks
  and counts as in memory, draws loss and latency from the scenario's network model, then hands
  a message for a remote agent to the hub with its simulated delay. A broadcast goes to each
  worker **once** (the body packed once, the per-agent headers rebuilt by the worker), not once
  per agent. Bytes from a worker are decoded (the trust boundary: malformed, oversized, unknown,
  replayed input is dropped and counted as on the memory bus), checked to come from an agent
  that worker hosts (else dropped as ``unauthenticated``), counted as sent, then routed like a
  local send.
- ``WorkerBus`` (agent-host process) forwards every send to the hub and delivers what the hub
  sends after the simulated delay the hub drew (real seconds on top of the real transit), with
  the memory bus's decoding, replay guard and counters (deliveries and delivery-time drops;
  sends are counted by the hub). It cannot tap: agents that tap run in the server process.

Frames (ROUTER adds the peer's routing id in front on the hub side)::

    b"M" | <run u32, delay f64> | dst | envelope bytes          one message
    b"B" | <run u32, 0.0> | msgpack [src, kind, round, sent_at, dsts, seqs, delays] | body
    b"C" | msgpack control map (arrays as ExtType 42)          simulator control, heartbeats

Control messages (run set-up, timeline actions, checkpoints, end-of-run measurements,
heartbeats) belong to the simulator, not to any protocol; ``foltr_async.distributed`` speaks
them. Frames of another run than the current one are dropped (``stale_run``).

Security: CurveZMQ. The hub has a key pair and an allow-list of worker public keys checked by a
ZAP handler; an unknown key is refused at the handshake and logged (``auth_refused``), and the
refused worker sees ``EVENT_HANDSHAKE_FAILED_AUTH`` and stops with a one-line error. A key is
one worker's: the handler names the peer by its key's file name (the frames' ``User-Id``) and a
hello must say that name, so one key cannot say hello as another worker and take its clients.
Plaintext only when asked for (``security=None``).

Limits (``WireLimits``, derived by the server from the run): what one peer can make the hub hold
is at most ``hwm`` frames of at most ``frame`` bytes (``ZMQ_MAXMSGSIZE``: libzmq disconnects a
peer that sends more); below that, the codec's size limit drops and counts data. A control frame
from a peer that has not said hello must be a hello of at most ``hello`` bytes claiming at most
``clients`` clients; every control frame is unpacked with msgpack's length limits, so a few bytes
cannot ask for millions of objects, and refused past ``depth`` levels of nesting. The receive
loop handles at most ``batch`` frames per turn of the event loop, so a flood of junk costs
counters, not heartbeats; junk data frames are counted drops with a rate-limited log line.
The hub raises the process's soft open-files limit to the hard one, so many connections leave
the server descriptors for its own files. Sends to a worker whose queue
is full are dropped and counted (``send_queue_full``), never queued without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import structlog
import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.inputs import nesting_depth
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.replay import ReplayGuard
from foltr_async.runtime.schema import MESSAGE_KINDS, Int, ListOf, SchemaRegistry, Spec, Str, Struct
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

__all__ = [
    "DEFAULT_LIMITS",
    "HUB_CONTROL",
    "Hub",
    "WireLimits",
    "HubBus",
    "ServerKeys",
    "TransportError",
    "WorkerBus",
    "WorkerKeys",
    "WorkerLink",
    "add_worker_key",
    "load_server_keys",
    "load_worker_keys",
    "make_keys",
    "pack_control",
    "unpack_control",
]

log = structlog.get_logger()

_RUN = struct.Struct("<Id")
DEFAULT_DEPTH = 16
_ARRAY_EXT = 42
ZAP_DOMAIN = b"foltr"


@dataclass(frozen=True)
class WireLimits:
    """What the hub accepts from one peer; the defaults fit a run of unknown size, a server
    derives tighter ones from its scenario (``distributed.wire_limits``)."""

    #: largest frame (libzmq disconnects a peer sending more): the largest legal message
    frame: int = DEFAULT_MAX_BYTES
    #: largest data message (the codec drops and counts bigger ones)
    message: int = DEFAULT_MAX_BYTES
    #: frames a peer may have queued at the hub (libzmq receive high-water mark); a worker
    #: sending faster waits (its own queue holds the rest), it loses nothing
    hwm: int = 256
    #: frames the hub queues for one worker before it drops (and counts) more
    send_hwm: int = 100_000
    #: largest control frame from a peer that has not said hello
    hello: int = 64 * 1024
    #: most clients a hello may claim (client numbers below this)
    clients: int = 1 << 20
    #: most items of one msgpack array or map in a control message
    items: int = 1 << 16
    #: deepest nesting of lists and maps in a control message (the deepest legal one, a
    #: worker's measurements, nests 7 deep); deeper frames are dropped as ``too_deep``
    depth: int = DEFAULT_DEPTH
    #: frames handled per turn of the event loop before the hub yields
    batch: int = 64
    #: seconds between two log lines of a repeated warning (refusals, dropped frames)
    log_every: float = 10.0

    @property
    def held(self) -> int:
        """Bytes one peer can make the hub hold in its receive queue."""
        return self.hwm * self.frame


DEFAULT_LIMITS = WireLimits()


class _RateLog:
    """A warning that may repeat a million times: the first occurrence is logged at once, later
    ones as one line per ``every`` seconds with how many there were since the last line."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._pending: dict[str, tuple[str, int]] = {}  # key -> (event, occurrences not logged)

    def __call__(self, event: str, reason: str, **fields: Any) -> bool:
        """Log ``event`` for ``reason`` now or count it; True when a line was written."""
        n = self._pending.pop(reason, (event, 0))[1] + 1
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.every:
            self._pending[reason] = (event, n)
            return False
        self._last[reason] = now
        log.warning(event, reason=reason, count=n, **fields)
        return True

    def flush(self) -> None:
        """One last line per reason with occurrences not logged yet (at the end of a run)."""
        for reason, (event, n) in sorted(self._pending.items()):
            log.warning(event, reason=reason, count=n)
        self._pending.clear()


class TransportError(FoltrError):
    """The transport cannot work: no server, refused key, bad key files, bad address."""


# --------------------------------------------------------------------------- control codec


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        head = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(_ARRAY_EXT, head + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot send {type(obj).__name__} in a control message")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _ARRAY_EXT:
        return msgpack.ExtType(code, data)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    offset = unpacker.tell()
    dt = np.dtype(dtype)
    if dt.kind not in "biuf" or dt.hasobject:
        raise ValueError(f"control array of dtype {dtype!r}")
    return np.frombuffer(data, dt, int(np.prod(shape, dtype=np.int64)), offset).reshape(shape)


def pack_control(msg: dict) -> bytes:
    """A control map as bytes (numpy arrays as an ExtType, tuples as lists)."""
    return msgpack.packb(msg, default=_default, use_bin_type=True)


class TooDeep(ValueError):
    """A control message nests deeper than the hub reads (``WireLimits.depth``)."""


def unpack_control(data: bytes, items: int | None = None, depth: int = DEFAULT_DEPTH) -> dict:
    """Inverse of ``pack_control``; raises ValueError for anything that is not a control map.

    ``items`` bounds every array's and map's length before it is built: msgpack's own limit
    is the frame's size, and a 57 MB frame of one-byte items became 60 M objects (4 GB).
    ``depth`` bounds the nesting (``TooDeep``): msgpack builds up to 1024 levels, and code
    that later walks the value recursively (results, checkpoints) overflows Python's stack
    on a 1,151-byte frame."""
    n = len(data) if items is None else items
    try:
        msg = msgpack.unpackb(
            data,
            ext_hook=_ext_hook,
            raw=False,
            strict_map_key=False,
            max_array_len=n,
            max_map_len=n,
        )
    except Exception as e:
        raise ValueError(f"undecodable control message: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("control message without a type 't'")
    if nesting_depth(msg, depth) > depth:
        raise TooDeep(f"control message nested deeper than {depth} levels")
    return msg


#: The control messages the hub itself reads; a server adds its own (``Hub(control=...)``).
#: A peer becomes a worker only with a hello that matches its schema.
HUB_CONTROL: dict[str, Struct] = {
    "hello": Struct(
        {
            "t": Str(),
            "worker": Str(),
            "claims": ListOf(Int(min=0)),
            "host": Str(),
            "pid": Int(min=0),
            "run": Int(min=0),  # the run it hosts (0: none), so a restarted host gets its run
        }
    ),
    "hb": Struct({"t": Str()}),
}


def hello_schema(clients: int) -> Struct:
    """A hello that claims only client numbers of the run (at most ``clients`` of them)."""
    fields = dict(HUB_CONTROL["hello"].fields)
    fields["claims"] = ListOf(Int(min=0, max=max(0, clients - 1)), max_len=clients)
    return Struct(fields)


def check_control(msg: dict, schemas: Mapping[str, Spec]) -> str | None:
    """Why a decoded control message does not match its type's schema, or None."""
    spec = schemas.get(msg["t"])
    if spec is None:
        return f"unknown control type {msg['t'][:40]!r}"
    try:
        spec.check(msg)
    except Exception as e:  # the specs' own error: one line naming the field
        return str(e)
    return None


def _head(kind: str, src: str, dst: str, round: int, seq: int, sent_at: float) -> bytes:
    """An envelope's bytes up to its body (the packed body follows): the codec's own framing."""
    return _header(WIRE_VERSION, kind, src, dst, seq, round, sent_at)


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    #: z85 public key -> name of every worker allowed to connect
    allowed: dict[bytes, str]


@dataclass(frozen=True)
class WorkerKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def make_keys(directory: Path, workers: int = 1) -> list[Path]:
    """A server key pair and ``workers`` authorised worker key pairs in ``directory``.

    Layout: ``server.key`` (public, give it to every worker host), ``server.key_secret`` (stays
    on the server host), ``worker-N.key`` / ``worker-N.key_secret`` (copy the secret file and
    ``server.key`` to the worker's host), ``authorized/`` (public keys the server accepts).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "server.key_secret").exists():
        raise TransportError(f"keys: {directory} already holds a server key (use 'keys add')")
    (directory / "authorized").mkdir(exist_ok=True)
    made = list(zmq.auth.create_certificates(str(directory), "server"))
    os.chmod(directory / "server.key_secret", 0o600)
    for i in range(workers):
        made += add_worker_key(directory, f"worker-{i}")
    return [Path(p) for p in made]


def add_worker_key(directory: Path, name: str) -> list[Path]:
    """One more worker key pair in ``directory``, its public key added to ``authorized/``."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith(".") or name == "server":
        raise TransportError(f"keys: {name!r} is not a usable worker name")
    if (directory / f"{name}.key").exists():
        raise TransportError(f"keys: {directory / (name + '.key')} exists already")
    (directory / "authorized").mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    allowed = directory / "authorized" / f"{name}.key"
    allowed.write_bytes(Path(public).read_bytes())
    os.chmod(secret, 0o600)
    return [Path(public), Path(secret), allowed]


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise TransportError(f"{path}: cannot read the key ({e})") from None
    if public is None or len(public) != 40 or (secret and (sec is None or len(sec) != 40)):
        raise TransportError(f"{path}: not a {'secret' if secret else 'public'} CURVE key file")
    return public, sec


def load_server_keys(directory: Path) -> ServerKeys:
    """``server.key_secret`` and the allow-list ``authorized/*.key`` from a key folder."""
    directory = Path(directory)
    public, secret = _load(directory / "server.key_secret", True)
    allowed = {}
    auth = directory / "authorized"
    for path in sorted(auth.glob("*.key")) if auth.is_dir() else []:
        allowed[_load(path, False)[0]] = path.stem
    if not allowed:
        raise TransportError(f"{auth}: no authorised worker keys (python -m foltr_async keys add)")
    return ServerKeys(public, secret, allowed)


def load_worker_keys(directory: Path, name: str) -> WorkerKeys:
    """A worker's ``NAME.key_secret`` and the server's ``server.key`` from a key folder."""
    directory = Path(directory)
    public, secret = _load(directory / f"{name}.key_secret", True)
    server, _ = _load(directory / "server.key", False)
    return WorkerKeys(public, secret, server)


# --------------------------------------------------------------------------- buses


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
        self.hub.send(worker, [b"M", _RUN.pack(self.run_id, 0.0), dst.encode(), data])

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
            [b"M", _RUN.pack(self.run_id, delay), dst.encode(), data],
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
                [b"B", _RUN.pack(self.run_id, 0.0), meta, packed],
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
        self.before_send: Callable[[], None] | None = None

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
        run, delay = _RUN.unpack(frames[1])
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


# --------------------------------------------------------------------------- endpoints


async def _zap_handler(
    sock: zmq.asyncio.Socket, keys: ServerKeys, on_refused: Callable[[str, str], None]
) -> None:
    """ZAP (RFC 27): accept CURVE clients whose public key is in the allow-list."""
    while True:
        frames = await sock.recv_multipart()
        if len(frames) < 6:
            continue
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        name = None
        key = b""
        if mechanism == b"CURVE" and len(frames) >= 7 and len(frames[6]) == 32:
            key = zmq.utils.z85.encode(frames[6])
            name = keys.allowed.get(key)
        if name is None:
            on_refused(address.decode(errors="replace"), key.decode(errors="replace"))
            reply = [version, request_id, b"400", b"unknown key", b"", b""]
        else:
            reply = [version, request_id, b"200", b"OK", name.encode(), b""]
        await sock.send_multipart(reply)


def _user_id(parts: list[zmq.Frame]) -> str | None:
    """The ZAP User-Id of a received message (its sender's key name), if it has one."""
    try:
        return parts[-1].get("User-Id")
    except zmq.ZMQError:
        return None


def raise_fd_limit(most: int = 1 << 20) -> int:
    """Raise this process's soft limit of open files to its hard limit (at most ``most``);
    returns the soft limit then in force.

    Every TCP connection to the hub holds a file descriptor, and anyone who can reach the port
    can open connections (a key is checked only after the connection is up): at the usual soft
    limit of 1,024, 1,100 plain connections left the server no descriptor for its own files
    (a checkpoint, results) and it crashed. libzmq itself survives running out (it refuses
    the connection), so the server only needs room for its files beside the connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
    return soft


@dataclass
class _Peer:
    routing_id: bytes
    last_seen: float
    info: dict = field(default_factory=dict)


class Hub:
    """The server end: one ROUTER socket, CURVE authentication, heartbeats, frame dispatch.

    ``on_control(peer, msg)`` gets every control message but heartbeats, once it matches its
    schema in ``control`` (default ``HUB_CONTROL``), and only from a peer that said a valid
    hello; ``on_lost(peer)`` a worker whose heartbeats stopped (or whose connection is gone);
    data frames from introduced peers go to ``bus.from_worker`` (the current run's ``HubBus``).
    Frames that cannot be used are counted in ``dropped`` by reason (``bad_frame``,
    ``undecodable``, ``too_deep``, ``bad_control``, ``not_introduced``, ``oversized_control``,
    ``name_not_key``: a hello naming another worker than its key's, ``handler_error``; frames
    this end could not queue: ``send_queue_full``), each reason logged as a warning at most
    once per ``limits.log_every`` seconds with its count: a flood of garbage costs a counter,
    not a log. Counters: ``refused`` handshakes, ``frames_out`` / ``frames_in``, ``bytes_out``
    / ``bytes_in``, ``largest_in`` (the largest frame received).
    """

    def __init__(
        self,
        bind: str,
        *,
        keys: ServerKeys | None,
        heartbeat: float = 1.0,
        timeout: float = 5.0,
        on_control: Callable[[bytes, dict], None] | None = None,
        on_lost: Callable[[bytes], None] | None = None,
        on_refused: Callable[[str, str], None] | None = None,
        control: Mapping[str, Spec] = HUB_CONTROL,
        limits: WireLimits = DEFAULT_LIMITS,
        preparing: Container[bytes] = (),
    ) -> None:
        self.bind_address = bind
        self.limits = limits
        self.control_schemas = {**control, "hello": hello_schema(limits.clients)}
        self.keys = keys
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.on_control = on_control
        self.on_lost = on_lost
        self.on_refused = on_refused
        self.bus: HubBus | None = None
        self.peers: dict[bytes, _Peer] = {}
        #: peers building a run's agents (blocking work: data, compiled code): their silence
        #: meanwhile is not a loss; the server's wait for their answer bounds it
        self.preparing = preparing
        self.endpoint = ""
        self.refused = 0
        self.dropped: Counter[str] = Counter()
        self.closing = False
        self.frames_out = self.frames_in = self.bytes_out = self.bytes_in = self.largest_in = 0
        self.warn = _RateLog(limits.log_every)
        self._rehello: dict[bytes, float] = {}  # peer -> when it was last asked to say hello
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> str:
        """Bind and start serving; returns the bound endpoint (a ``:0`` port resolved)."""
        raise_fd_limit()
        ctx = self._ctx = zmq.asyncio.Context()
        if self.keys is not None:
            zap = ctx.socket(zmq.REP)
            zap.linger = 0
            zap.bind("inproc://zeromq.zap.01")
            self._tasks.append(asyncio.ensure_future(_zap_handler(zap, self.keys, self._refused)))
            self._zap = zap
        sock = self._sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = 1
        sock.maxmsgsize = self.limits.frame
        sock.rcvhwm = self.limits.hwm
        sock.sndhwm = self.limits.send_hwm
        if self.keys is not None:
            sock.curve_server = True
            sock.curve_publickey = self.keys.public
            sock.curve_secretkey = self.keys.secret
            sock.zap_domain = ZAP_DOMAIN
        try:
            sock.bind(self.bind_address)
        except zmq.ZMQError as e:
            self.close_now()
            raise TransportError(f"--bind {self.bind_address}: {e.strerror}") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks += [
            asyncio.ensure_future(self._recv_loop()),
            asyncio.ensure_future(self._beat_loop()),
        ]
        log.info("hub_listening", endpoint=self.endpoint, secure=self.keys is not None)
        return self.endpoint

    def _refused(self, address: str, key: str) -> None:
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(address, key)
        else:
            log.warning("auth_refused", address=address, key=key)

    # ----------------------------------------------------------------- sending

    def send(
        self, peer: bytes, frames: list[bytes], on_fail: Callable[[], Any] | None = None
    ) -> None:
        """Queue frames for one worker (never blocks); ``on_fail`` if it is unreachable."""
        sock = self._sock
        if sock is None:
            if on_fail is not None:
                on_fail()
            return
        self.frames_out += 1
        self.bytes_out += sum(len(f) for f in frames)
        # never wait for room: a worker that does not read its queue (full at ``hwm``) loses
        # frames, counted, instead of the hub holding them in pending sends without bound
        fut = sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)

        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                return
            err = f.exception()
            if err is None:
                return
            if on_fail is not None:
                on_fail()
            if isinstance(err, zmq.Again):
                self.drop(peer, "send_queue_full", "a worker's queue is full")
            elif isinstance(err, zmq.ZMQError) and err.errno == zmq.EHOSTUNREACH:
                log.debug("hub_send_failed", peer=peer, error=repr(err))
                self._lose(peer)
            else:
                log.debug("hub_send_failed", peer=peer, error=repr(err))

        fut.add_done_callback(done)

    def control(self, peer: bytes, msg: dict) -> None:
        self.send(peer, [b"C", pack_control(msg)])

    # ----------------------------------------------------------------- receiving

    async def _recv_loop(self) -> None:
        """Frames in, at most ``limits.batch`` per turn of the event loop: awaiting a frame that
        is already queued does not yield, so a flood would otherwise starve the heartbeats and
        the run (115 k junk frames in 3 s made every worker think the server was gone)."""
        sock, batch = self._sock, self.limits.batch
        keyed = self.keys is not None
        while True:
            for _ in range(batch):
                if keyed:  # the frames' User-Id: the name the ZAP handler gave the peer's key
                    parts = await sock.recv_multipart(copy=False)
                    frames, user = [f.bytes for f in parts], _user_id(parts)
                else:
                    frames, user = await sock.recv_multipart(), None
                try:
                    self._dispatch(frames, user)
                except Exception as e:  # a peer's bad frame must never end the hub
                    self.drop(frames[0], "handler_error", f"{type(e).__name__}: {e}")
            await asyncio.sleep(0)

    def drop(self, peer: bytes, reason: str, detail: str) -> None:
        """Count one unusable frame; a warning per reason at most every ``log_every`` s."""
        self.dropped[reason] += 1
        self.warn("hub_frame_dropped", reason, peer=peer[:64], detail=detail[:200])

    def _dispatch(self, frames: list[bytes], user: str | None = None) -> None:
        if self.closing:
            return
        size = sum(len(f) for f in frames)
        self.frames_in += 1
        self.bytes_in += size
        self.largest_in = max(self.largest_in, size)
        if len(frames) < 2:
            self.drop(frames[0] if frames else b"", "bad_frame", f"{len(frames)} frames")
            return
        peer, tag = frames[0], frames[1]
        known = self.peers.get(peer)
        if known is not None:
            known.last_seen = time.monotonic()
        if tag == b"M" and len(frames) == 5:
            bus = self.bus
            if known is None:
                self.drop(peer, "not_introduced", "data frame before a valid hello")
                return
            if bus is None:
                log.debug("hub_data_dropped", peer=peer, reason="no run")
                return
            try:
                run, _ = _RUN.unpack(frames[2])
            except struct.error:
                bus.junk("malformed", "bad frame header", None, None, None)
                return
            bus.from_worker(peer, run, frames[4])
            return
        if tag != b"C" or len(frames) != 3:
            self.drop(peer, "bad_frame", f"tag {tag[:8]!r} with {len(frames) - 1} frames")
            return
        data, limits = frames[2], self.limits
        if known is None and len(data) > limits.hello:  # checked before anything is unpacked
            self.drop(peer, "oversized_control", f"{len(data)} bytes before a hello")
            return
        try:
            msg = unpack_control(
                data, max(64, limits.clients) if known is None else limits.items, limits.depth
            )
        except TooDeep as e:
            self.drop(peer, "too_deep", str(e))
            return
        except ValueError as e:
            self.drop(peer, "undecodable", str(e))
            return
        why = check_control(msg, self.control_schemas)
        if why is not None:
            self.drop(peer, "bad_control", f"{msg['t'][:40]}: {why}")
            return
        if msg["t"] == "hello":
            if user is not None and msg["worker"] != user:
                # a key is one worker's: another name would let it take that worker's clients
                self.drop(peer, "name_not_key", f"hello as {msg['worker'][:40]!r}, key of {user!r}")
                return
            self.peers[peer] = _Peer(peer, time.monotonic(), msg)
        elif known is None:
            # not introduced, or declared lost: ask it to introduce itself (at most once a
            # second, so a stranger's frames are not answered one for one)
            now = time.monotonic()
            if now - self._rehello.get(peer, -1.0) >= 1.0:
                if len(self._rehello) > 1024:
                    self._rehello.clear()
                self._rehello[peer] = now
                self.send(peer, [b"C", pack_control({"t": "rehello"})])
            return
        if msg["t"] == "hb":
            return
        if self.on_control is not None:
            self.on_control(peer, msg)

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            now = time.monotonic()
            for peer in list(self.peers):
                p = self.peers.get(peer)
                if p is None:
                    continue
                if now - p.last_seen > self.timeout and peer not in self.preparing:
                    self._lose(peer)
                else:
                    self.send(peer, [b"C", pack_control({"t": "hb"})])

    def _lose(self, peer: bytes) -> None:
        if self.peers.pop(peer, None) is None:
            return
        log.debug("peer_lost", peer=peer)
        if self.on_lost is not None:
            self.on_lost(peer)

    # ----------------------------------------------------------------- closing

    def close_now(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self._sock = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def close(self, bye: bool = True) -> None:
        """Say goodbye to every worker (they exit), then close the socket."""
        self.closing = True  # from now on frames are ignored: the experiment is over
        if bye and self._sock is not None:
            peers, self.peers = list(self.peers), {}  # no more heartbeats, no loss reports
            for peer in peers:
                self.control(peer, {"t": "bye"})
            await asyncio.sleep(0.05)  # let the goodbyes leave before the socket closes
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        self.close_now()


class WorkerLink:
    """The agent-host end: one DEALER socket to the hub, heartbeats, auth-failure detection.

    ``on_control(msg)`` gets control messages (heartbeats excepted), ``bus`` (set per run)
    gets data frames. ``failed`` is set with a TransportError when the server refused this
    worker's key; ``server_lost`` when the server's heartbeats stopped for ``timeout``.
    """

    def __init__(
        self,
        connect: str,
        *,
        keys: WorkerKeys | None,
        name: str,
        heartbeat: float = 1.0,
        timeout: float = 5.0,
        on_control: Callable[[dict], None] | None = None,
    ) -> None:
        self.connect_address = connect
        self.keys = keys
        self.name = name
        self.routing_id = f"{name}@{socket.gethostname()}:{os.getpid()}".encode()
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.on_control = on_control
        self.bus: WorkerBus | None = None
        #: heartbeats go out only once the server has welcomed this worker
        self.beating = False
        self.failed: asyncio.Future | None = None
        self.last_heard = 0.0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.failed = loop.create_future()
        ctx = self._ctx = zmq.asyncio.Context()
        sock = self._sock = ctx.socket(zmq.DEALER)
        sock.linger = 1000
        sock.routing_id = self.routing_id
        sock.sndhwm = sock.rcvhwm = 1_000_000
        if self.keys is not None:
            sock.curve_serverkey = self.keys.server_public
            sock.curve_publickey = self.keys.public
            sock.curve_secretkey = self.keys.secret
        monitor = self._monitor_sock = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        try:
            sock.connect(self.connect_address)
        except zmq.ZMQError as e:
            self.close()
            raise TransportError(f"--connect {self.connect_address}: {e.strerror}") from None
        self.last_heard = time.monotonic()
        self._tasks = [
            asyncio.ensure_future(self._recv_loop()),
            asyncio.ensure_future(self._monitor(monitor)),
            asyncio.ensure_future(self._beat_loop()),
        ]

    async def _monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = await recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail(
                    f"the server at {self.connect_address} refused this worker's key "
                    f"(CURVE authentication failed, status {event['value']})"
                )
            elif event["event"] in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                self._fail(
                    f"handshake with {self.connect_address} failed (plaintext on one "
                    "side and CURVE on the other, or the wrong server key?)"
                )

    def _fail(self, message: str) -> None:
        if self.failed is not None and not self.failed.done():
            self.failed.set_exception(TransportError(message))

    def send_data(self, run: int, dst: str, data: bytes) -> None:
        if self._sock is not None:
            self._sock.send_multipart([b"M", _RUN.pack(run, 0.0), dst.encode(), data])

    def control(self, msg: dict) -> None:
        if self._sock is not None:
            self._sock.send_multipart([b"C", pack_control(msg)])

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self.last_heard = time.monotonic()
            try:
                if frames[0] in (b"M", b"B") and len(frames) == 4:
                    if self.bus is not None:
                        self.bus.on_frames(frames)
                elif frames[0] == b"C" and len(frames) == 2:
                    msg = unpack_control(frames[1])
                    if msg["t"] != "hb" and self.on_control is not None:
                        self.on_control(msg)
            except Exception as e:  # a bad frame must never end the worker: one line
                log.warning("worker_frame_error", error=f"{type(e).__name__}: {e}"[:200])

    async def _beat_loop(self) -> None:
        while True:
            if self.beating:
                self.control({"t": "hb"})
            await asyncio.sleep(self.heartbeat)

    def server_silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self, linger: int = 1000) -> None:
        """Stop; messages still queued (a final flush) get ``linger`` ms to leave."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock = None
        if self._ctx is not None:
            self._ctx.destroy(linger=linger)
            self._ctx = None

"""The two ends of the ZeroMQ star: the server's ``Hub`` (ROUTER) and a worker's ``WorkerLink``.

Sockets, CurveZMQ authentication, heartbeats and frame dispatch; what a data frame means is
the buses' (``zmq_buses``). The hub has a key pair and an allow-list of worker public keys
checked by a ZAP handler; an unknown key is refused at the handshake and logged
(``auth_refused``), and the refused worker sees ``EVENT_HANDSHAKE_FAILED_AUTH`` and stops with
a one-line error. A hello must say the name of the peer's key, so one key cannot say hello as
another worker and take its clients. Plaintext only when asked for (``keys=None``).

What one peer can make the hub hold is bounded (``WireLimits``): at most ``hwm`` frames of at
most ``frame`` bytes (``ZMQ_MAXMSGSIZE``: libzmq disconnects a peer that sends more); a control
frame from a peer that has not said hello must be a hello of at most ``hello`` bytes claiming at
most ``clients`` clients. The receive loop handles at most ``batch`` frames per turn of the
event loop, so a flood of junk costs counters, not heartbeats. Sends to a worker whose queue is
full are dropped and counted (``send_queue_full``), never queued without bound.
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
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from foltr_async.errors import TransportError
from foltr_async.runtime.schema import Spec
from foltr_async.runtime.zmq_keys import ServerKeys, WorkerKeys
from foltr_async.runtime.zmq_wire import (
    DEFAULT_LIMITS,
    HUB_CONTROL,
    RUN_HEADER,
    TooDeep,
    WireLimits,
    check_control,
    hello_schema,
    pack_control,
    unpack_control,
)

__all__ = ["Hub", "HubData", "WorkerData", "WorkerLink", "raise_fd_limit"]

log = structlog.get_logger()

ZAP_DOMAIN = b"foltr"


class HubData(Protocol):
    """Where the hub hands data frames: the current run's bus (``zmq_buses.HubBus``)."""

    def from_worker(self, worker: bytes, run: int, data: bytes) -> None: ...

    def junk(
        self, reason: str, detail: str, src: str | None, dst: str | None, kind: str | None
    ) -> None: ...


class WorkerData(Protocol):
    """Where a worker's link hands data frames: its run's bus (``zmq_buses.WorkerBus``)."""

    def on_frames(self, frames: list[bytes]) -> None: ...


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
        self.bus: HubData | None = None
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
                run, _ = RUN_HEADER.unpack(frames[2])
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
        self.bus: WorkerData | None = None
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
            self._sock.send_multipart([b"M", RUN_HEADER.pack(run, 0.0), dst.encode(), data])

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

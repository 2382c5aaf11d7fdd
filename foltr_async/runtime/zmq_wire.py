"""What crosses a ZeroMQ link besides envelopes: frames, the hub's limits, control messages.

The buses and both endpoints share it, so it sits below them. Frames (ROUTER adds the peer's
routing id in front on the hub side)::

    b"M" | <run u32, delay f64> | dst | envelope bytes          one message
    b"B" | <run u32, 0.0> | msgpack [src, kind, round, sent_at, dsts, seqs, delays] | body
    b"C" | msgpack control map (arrays as ExtType 42)          simulator control, heartbeats

Control messages (run set-up, timeline actions, checkpoints, end-of-run measurements,
heartbeats) belong to the simulator, not to any protocol; ``foltr_async.distributed`` speaks
them. Every control frame is unpacked with msgpack's length limits, so a few bytes cannot ask
for millions of objects, and refused past ``WireLimits.depth`` levels of nesting.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from foltr_async.inputs import nesting_depth
from foltr_async.runtime.schema import Int, ListOf, Spec, Str, Struct
from foltr_async.runtime.wire import DEFAULT_MAX_BYTES

__all__ = [
    "DEFAULT_DEPTH",
    "DEFAULT_LIMITS",
    "HUB_CONTROL",
    "RUN_HEADER",
    "TooDeep",
    "WireLimits",
    "check_control",
    "hello_schema",
    "pack_control",
    "unpack_control",
]

#: a data frame's second part: the run it belongs to and the simulated delay of its delivery
RUN_HEADER = struct.Struct("<Id")
DEFAULT_DEPTH = 16
_ARRAY_EXT = 42


@dataclass(frozen=True)
class WireLimits:
    """What the hub accepts from one peer; the defaults fit a run of unknown size, a server
    derives tighter ones from its scenario (``distributed.control.wire_limits``)."""

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

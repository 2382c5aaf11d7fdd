"""The wire format: msgpack envelopes, numpy arrays as ExtType, bodies checked by their schema.

Every message crosses the bus as bytes, also in memory, so byte counts, eavesdroppers and codec
bugs are real. Decoding is the trust boundary: any input bytes either become a valid
``Envelope`` whose body matches the schema its protocol registered, or raise ``DropMessage``
with one of a fixed set of reasons. Nothing else may escape ``decode``.

Wire form: a msgpack map ``{v, kind, src, dst, seq, round, sent_at, body}``. A numpy array
anywhere in the body is ``ExtType(1, payload)`` with payload::

    u8 ndim | u8 len(typestr) | typestr ("<f8", "|b1", ...) | zero pad to 8 bytes
    | ndim x u64 little-endian dims | raw little-endian C-order data

The padding keeps the data 8-byte aligned inside the payload so the decoded array is a
zero-copy, read-only ``np.frombuffer`` view.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from foltr_async.runtime.schema import (
    MAX_ID_LEN,
    MESSAGE_KINDS,
    WIRE_DTYPES,
    BodySchema,
    Invalid,
    SchemaRegistry,
    check_body,
)

__all__ = [
    "ARRAY_EXT",
    "DEFAULT_MAX_BYTES",
    "DROP_REASONS",
    "WIRE_VERSION",
    "DropMessage",
    "Envelope",
    "SharedBody",
    "decode",
    "decode_from",
    "encode",
    "encode_many",
    "encode_one",
    "pack_body",
]

WIRE_VERSION = 1
ARRAY_EXT = 1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
#: Reasons ``decode`` (and the replay guard) can give; buses add transport reasons.
DROP_REASONS = (
    "oversized", "malformed", "bad_version", "unknown_kind", "bad_schema", "replayed", "seq_ahead"
)  # fmt: skip

_HEADER_KEYS = frozenset(("v", "kind", "src", "dst", "seq", "round", "sent_at", "body"))
_MAX_NDIM = 32
_DIMS = [struct.Struct(f"<{n}Q") for n in range(_MAX_NDIM + 1)]


@dataclass(slots=True)
class Envelope:
    """One message: routing header plus a body dict (arrays decoded as read-only views)."""

    kind: str
    src: str
    dst: str
    body: dict
    round: int = 0
    seq: int = 0
    sent_at: float = 0.0
    v: int = 1


class DropMessage(Exception):
    """Input that must be dropped and counted, never raised into an agent.

    ``header`` is the envelope without its body when the header was readable, so a drop can
    still be attributed to a source, destination and kind.
    """

    def __init__(self, reason: str, detail: str = "", header: Envelope | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.header = header


# --------------------------------------------------------------------------- encoding


# (dtype, ndim) -> payload prefix for arrays already little-endian; filled on first use.
_PREFIX: dict[tuple[np.dtype, int], bytes] = {}


def _prefix(dt: np.dtype, ndim: int) -> bytes:
    code = dt.str.encode()
    if code not in WIRE_DTYPES:
        raise TypeError(f"cannot encode a {dt} array (bool, int*, uint*, float* only)")
    if ndim > _MAX_NDIM:
        raise TypeError(f"cannot encode an array with {ndim} dimensions (max {_MAX_NDIM})")
    head = bytes((ndim, len(code))) + code
    head += b"\0" * (-len(head) % 8)
    _PREFIX[dt, ndim] = head
    return head


def _array_payload(arr: np.ndarray) -> bytes:
    """Ext payload of an array: header, dims, raw bytes (one copy of the data)."""
    head = _PREFIX.get((arr.dtype, arr.ndim))
    if head is None:
        le = arr.dtype.newbyteorder("<")
        if arr.dtype != le:  # big-endian: one extra copy to the wire byte order
            arr = arr.astype(le)
        head = _prefix(le, arr.ndim)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return b"".join((head, _DIMS[arr.ndim].pack(*arr.shape), arr))


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        # tuple.__new__ skips ExtType's pure-Python argument checks (both are known good here).
        return tuple.__new__(msgpack.ExtType, (ARRAY_EXT, _array_payload(obj)))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message body")


_local = threading.local()


def _pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, default=_default)`` with one Packer per thread instead of a new one
    per call (~0.2 us each; a Packer resets after an error, and threads never share one)."""
    try:
        pack = _local.pack
    except AttributeError:
        pack = _local.pack = msgpack.Packer(default=_default).pack
    return pack(obj)


#: (kind, src, dst) -> the packed header up to the ``seq`` key, bounded by a run's links.
_PREFIXES: dict[tuple[str, str, str], bytes] = {}
#: msgpack's forms of a positive int and a float64, picked as ``msgpack.packb`` picks them.
_FIXINT = [bytes((i,)) for i in range(128)]
_U8, _U16, _U32 = (struct.Struct(f">B{c}").pack for c in "BHI")
_F64 = struct.Struct(">d").pack


def _packed_uint(x: Any) -> bytes:
    """``msgpack.packb(x)`` for ints 0 <= x < 2**32 without a call into the Packer."""
    if type(x) is int and x >= 0:
        if x < 128:
            return _FIXINT[x]
        if x < 0x100:
            return _U8(0xCC, x)
        if x < 0x10000:
            return _U16(0xCD, x)
        if x < 0x100000000:
            return _U32(0xCE, x)
    return _pack(x)


def _map_start(v: Any, kind: Any, src: Any, dst: Any) -> bytes:
    return b"".join(
        (
            b"\x88\xa1v", _pack(v), b"\xa4kind", _pack(kind), b"\xa3src", _pack(src),
            b"\xa3dst", _pack(dst), b"\xa3seq",
        )
    )  # fmt: skip


def _link_prefix(kind: str, src: str, dst: str) -> bytes:
    """The packed map up to the ``seq`` key of a current-version envelope, cached."""
    key = (kind, src, dst)
    head = _PREFIXES.get(key)
    if head is None:
        if len(_PREFIXES) >= 1 << 18:  # a bound for runs with very many agents
            _PREFIXES.clear()
        head = _PREFIXES[key] = _map_start(WIRE_VERSION, kind, src, dst)
    return head


def _header(v: int, kind: str, src: str, dst: str, seq: int, round: int, sent_at: float) -> bytes:
    """Packed envelope map up to and including the ``body`` key; the packed body follows.

    Byte for byte ``msgpack.packb`` of the map ``{v, kind, src, dst, seq, round, sent_at,
    body: nil}`` without its trailing nil (so a pre-packed body can be appended: how a broadcast
    encodes its body once): the map's start cached per kind and link, then the numbers.
    """
    if (
        type(v) is int
        and v == WIRE_VERSION
        and type(kind) is str
        and type(src) is str
        and type(dst) is str
    ):
        head = _link_prefix(kind, src, dst)
    else:  # unusual values (tests of the wire form): nothing to cache
        head = _map_start(v, kind, src, dst)
    return b"".join(
        (
            head, _packed_uint(seq), b"\xa5round", _packed_uint(round), b"\xa7sent_at\xcb",
            _F64(float(sent_at)), b"\xa4body",
        )
    )  # fmt: skip


def pack_body(body: Mapping) -> bytes:
    """The msgpack bytes of a body (arrays as ExtType); raises TypeError for unencodable values."""
    if type(body) is not dict and not isinstance(body, Mapping):
        raise TypeError(f"message body must be a dict, got {type(body).__name__}")
    return _pack(body)


def encode(env: Envelope) -> bytes:
    """Bytes of one envelope."""
    body = pack_body(env.body)
    return _header(env.v, env.kind, env.src, env.dst, env.seq, env.round, env.sent_at) + body


def encode_one(
    kind: str, src: str, dst: str, body: Mapping, round: int, seq: int, sent_at: float
) -> bytes:
    """``encode(Envelope(kind, src, dst, body, round, seq, sent_at))`` without the envelope."""
    packed = pack_body(body)
    return _header(WIRE_VERSION, kind, src, dst, seq, round, sent_at) + packed


def encode_many(
    src: str,
    dsts: Sequence[str],
    kind: str,
    body: Mapping | SharedBody,
    round: int,
    seqs: Sequence[int],
    sent_at: float,
) -> list[bytes]:
    """One envelope per destination; the body (e.g. a model) is packed once and spliced in."""
    if len(dsts) != len(seqs):
        raise ValueError(f"encode_many: {len(dsts)} destinations but {len(seqs)} sequence numbers")
    packed = body.packed if type(body) is SharedBody else pack_body(body)
    return [
        _header(WIRE_VERSION, kind, src, dst, seq, round, sent_at) + packed
        for dst, seq in zip(dsts, seqs, strict=True)
    ]


# --------------------------------------------------------------------------- decoding


#: payload heads (dims included) of arrays decoded before -> (dtype, shape, count)
_ARRAY_HEADS: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}


def _ext_hook(code: int, data: bytes) -> np.ndarray:
    """An array ext's read-only view; a head seen before (a run sends few shapes) skips its
    checks, bool arrays excepted (their bytes are checked every time)."""
    if code == ARRAY_EXT and len(data) >= 2:
        start = 2 + data[1]
        off = start + (-start % 8) + 8 * data[0]
        known = _ARRAY_HEADS.get(data[:off])
        if known is not None:
            dt, shape, count = known
            if len(data) - off == count * dt.itemsize:
                arr = np.frombuffer(data, dt, count, off)
                return arr if len(shape) == 1 else arr.reshape(shape)
    return _read_array(code, data)


def _read_array(code: int, data: bytes) -> np.ndarray:
    if code != ARRAY_EXT:
        raise DropMessage("malformed", f"unknown ext type {code}")
    n = len(data)
    if n < 2:
        raise DropMessage("malformed", "array ext shorter than its header")
    ndim, tlen = data[0], data[1]
    start = 2 + tlen
    head = start + (-start % 8)
    dt = WIRE_DTYPES.get(data[2:start])
    if dt is None or ndim > _MAX_NDIM:
        raise DropMessage("malformed", f"array ext with dtype {data[2:start]!r}, ndim {ndim}")
    if data[start:head].strip(b"\0") or n < head + 8 * ndim:
        raise DropMessage("malformed", "array ext header is corrupt")
    shape = _DIMS[ndim].unpack_from(data, head)
    count = math.prod(shape)
    off = head + 8 * ndim
    if (n - off) != count * dt.itemsize:
        raise DropMessage(
            "malformed", f"array ext of shape {list(shape)} {dt} holds {n - off} data bytes"
        )
    arr = np.frombuffer(data, dt, count, off)
    if ndim != 1:
        arr = arr.reshape(shape)
    if dt.kind == "b":
        if count and arr.view(np.uint8).max() > 1:
            raise DropMessage("malformed", "bool array holds bytes other than 0 and 1")
    elif len(_ARRAY_HEADS) < 4096:
        _ARRAY_HEADS[data[:off]] = (dt, shape, count)
    return arr


def _bad_header(obj: dict) -> str | None:
    """Why the envelope header is unusable, or None."""
    kind, src, dst = obj.get("kind"), obj.get("src"), obj.get("dst")
    seq, rnd, t = obj.get("seq"), obj.get("round"), obj.get("sent_at")
    if (  # the usual header, checked in one expression; what is wrong is found below
        type(kind) is str
        and type(src) is str
        and type(dst) is str
        and 0 < len(kind) <= MAX_ID_LEN
        and 0 < len(src) <= MAX_ID_LEN
        and 0 < len(dst) <= MAX_ID_LEN
        and type(seq) is int
        and seq >= 0
        and type(rnd) is int
        and rnd >= 0
        and type(t) is float
        and math.isfinite(t)
        and type(obj.get("body")) is dict
        and obj.keys() == _HEADER_KEYS
    ):
        return None
    if obj.keys() != _HEADER_KEYS:
        return f"envelope keys {sorted(map(str, obj))}"
    for key in ("kind", "src", "dst"):
        val = obj[key]
        if type(val) is not str or not val or len(val) > MAX_ID_LEN:
            return f"header {key!r} must be a non-empty string of at most {MAX_ID_LEN} characters"
    for key in ("seq", "round"):
        if type(obj[key]) is not int or obj[key] < 0:
            return f"header {key!r} must be a non-negative integer"
    t = obj["sent_at"]
    if type(t) not in (float, int) or not math.isfinite(t):
        return "header 'sent_at' must be a finite number"
    if type(obj["body"]) is not dict:
        return "body must be a map"
    return None


def decode(
    data: bytes, registry: SchemaRegistry = MESSAGE_KINDS, max_bytes: int = DEFAULT_MAX_BYTES
) -> Envelope:
    """Bytes -> validated Envelope, or ``DropMessage``; never any other exception."""
    try:
        return _decode(data, registry, max_bytes)
    except DropMessage:
        raise
    except Exception as e:  # a bug guard: whatever slipped through is still a counted drop
        raise DropMessage("malformed", f"{type(e).__name__}: {e}") from None


def _decode(data: bytes, registry: SchemaRegistry, max_bytes: int) -> Envelope:
    if len(data) > max_bytes:
        raise DropMessage("oversized", f"{len(data)} bytes > {max_bytes}")
    try:
        obj = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except DropMessage:
        raise
    except Exception as e:
        raise DropMessage("malformed", f"not msgpack: {type(e).__name__}: {e}") from None
    if type(obj) is not dict:
        raise DropMessage("malformed", f"envelope is a {type(obj).__name__}, not a map")
    v = obj.get("v")
    if type(v) is not int:
        raise DropMessage("malformed", "envelope without an integer version 'v'")
    if v != WIRE_VERSION:
        raise DropMessage("bad_version", f"wire version {v}, expected {WIRE_VERSION}")
    why = _bad_header(obj)
    if why is not None:
        raise DropMessage("malformed", why)
    kind = obj["kind"]
    env = Envelope(
        kind, obj["src"], obj["dst"], {}, obj["round"], obj["seq"], float(obj["sent_at"]), v
    )
    schema = registry.get(kind)
    if schema is None:
        raise DropMessage(
            "unknown_kind", f"kind {kind!r} is not registered (load_plugins installs them)", env
        )
    if schema.max_bytes is not None and len(data) > schema.max_bytes:
        raise DropMessage("oversized", f"{len(data)} bytes > {schema.max_bytes} for {kind}", env)
    body = obj["body"]
    try:
        check_body(body, schema.fields)
    except Invalid as e:
        raise DropMessage("bad_schema", f"{kind}: {e}", env) from None
    env.body = body
    return env


class SharedBody:
    """A broadcast's body: packed once for all its copies, parsed and schema-checked at most once.

    Each copy still crosses as its own bytes and ``decode_from`` reads its header from them;
    only the body's msgpack parse and schema check are shared (``checked``), and each recipient
    gets its own body dict holding the shared immutable values (read-only array views of the
    packed bytes, numbers, strings). A body with mutable containers (lists, maps), and any copy
    that is not exactly as the bus encoded it, is decoded in full, so a drop has the same reason.
    """

    __slots__ = ("packed", "_checked")

    def __init__(self, body: Mapping) -> None:
        self.packed = pack_body(body)
        #: (registry, kind) -> the checked body, or None when it must be decoded per copy
        self._checked: dict[tuple[int, str], dict | None] = {}

    def checked(self, registry: SchemaRegistry, kind: str, schema: BodySchema) -> dict | None:
        """The body checked against ``kind``'s schema if its values can be shared, else None."""
        key = (id(registry), kind)
        if key not in self._checked:
            self._checked[key] = _shareable(self.packed, schema)
        return self._checked[key]


def decode_from(
    data: bytes,
    kind: str,
    src: str,
    dst: str,
    shared: SharedBody | None = None,
    registry: SchemaRegistry = MESSAGE_KINDS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Envelope:
    """``decode(data, registry, max_bytes)`` of bytes a bus sent as a ``kind`` message from
    ``src`` to ``dst`` (``shared``: the broadcast body they were encoded with): the same envelope
    or the same ``DropMessage``, cheaper. The bytes must start with that link's packed header
    prefix; the numbers after it are read and checked from the bytes, and the body is unpacked
    and schema-checked (once per broadcast with ``shared``). Anything unexpected is decoded by
    ``decode``, which then names the reason."""
    try:
        env = _decode_known(data, kind, src, dst, shared, registry, max_bytes)
    except Exception:  # DropMessage, Invalid, msgpack errors: the full decode says which
        env = None
    return decode(data, registry, max_bytes) if env is None else env


#: msgpack's uint forms: first byte -> (reader of the value after it, bytes in all)
_UINT_AT = {
    code: (struct.Struct(">" + c).unpack_from, 1 + struct.calcsize(c))
    for code, c in ((0xCC, "B"), (0xCD, "H"), (0xCE, "I"), (0xCF, "Q"))
}
_F64_AT = struct.Struct(">d").unpack_from


def _uint_at(data: bytes, i: int) -> tuple[int, int]:
    """The non-negative int msgpack packed at ``data[i]`` and the offset after it (-1: none)."""
    b = data[i]
    if b < 0x80:
        return b, i + 1
    form = _UINT_AT.get(b)
    if form is None:
        return -1, i
    return form[0](data, i + 1)[0], i + form[1]


#: (kind, src, dst) of valid header strings -> their link prefix (``_link_prefix``)
_KNOWN: dict[tuple[str, str, str], bytes] = {}


def _known_prefix(kind: str, src: str, dst: str) -> bytes | None:
    key = (kind, src, dst)
    head = _KNOWN.get(key)
    if head is None:
        if not all(type(x) is str and 0 < len(x) <= MAX_ID_LEN for x in key):
            return None
        if len(_KNOWN) >= 1 << 18:
            _KNOWN.clear()
        head = _KNOWN[key] = _link_prefix(kind, src, dst)
    return head


def _decode_known(
    data: bytes,
    kind: str,
    src: str,
    dst: str,
    shared: SharedBody | None,
    registry: SchemaRegistry,
    max_bytes: int,
) -> Envelope | None:
    n = len(data)
    schema = registry.get(kind)
    if n > max_bytes or schema is None or (schema.max_bytes is not None and n > schema.max_bytes):
        return None
    head = _known_prefix(kind, src, dst)
    if head is None or not data.startswith(head):
        return None
    seq, i = _uint_at(data, len(head))
    if seq < 0 or not data.startswith(b"\xa5round", i):
        return None
    rnd, i = _uint_at(data, i + 6)
    if rnd < 0 or not data.startswith(b"\xa7sent_at\xcb", i):
        return None
    (sent_at,) = _F64_AT(data, i + 9)
    i += 17
    if not math.isfinite(sent_at) or not data.startswith(b"\xa4body", i):
        return None
    i += 5
    if shared is not None:
        packed = shared.packed
        if n - i != len(packed) or not data.endswith(packed):
            return None
        body = shared.checked(registry, kind, schema)
        if body is None:
            return None
        body = dict(body)
    else:
        rest = memoryview(data)[i:]
        body = msgpack.unpackb(rest, ext_hook=_ext_hook, raw=False, strict_map_key=True)
        if type(body) is not dict:
            return None
        check_body(body, schema.fields)
    return Envelope(kind, src, dst, body, rnd, seq, sent_at, WIRE_VERSION)


_IMMUTABLE = (int, float, str, bytes, bool, type(None))


def _shareable(packed: bytes, schema: BodySchema) -> dict | None:
    """The checked body of ``packed`` if its values can be shared read-only, else None."""
    try:
        body = msgpack.unpackb(packed, ext_hook=_ext_hook, raw=False, strict_map_key=True)
        if type(body) is not dict:
            return None
        check_body(body, schema.fields)
    except Exception:  # DropMessage, Invalid, msgpack errors: the full decode says which
        return None
    for value in body.values():
        if not (
            type(value) in _IMMUTABLE or (type(value) is np.ndarray and not value.flags.writeable)
        ):
            return None
    return body

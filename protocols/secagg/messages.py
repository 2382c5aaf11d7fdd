"""SecAgg's message kinds, the layout of a share row on the wire, and their schemas."""

from __future__ import annotations

from foltr_async.protocols.secagg.primitives import CHUNKS, KEY_LEN
from foltr_async.runtime.schema import Array, Bytes, Int, Kind, ListOf, Str

ADVERTISE = "secagg.advertise"
KEYS = "secagg.keys"
ROSTER = "secagg.roster"
SHARES = "secagg.shares"
RELAY = "secagg.relay"
MASKED = "secagg.masked"
UNMASK = "secagg.unmask"
REVEAL = "secagg.reveal"

SHARE_COLS = 1 + 2 * CHUNKS  # x, the mask key's chunks, the self-mask seed's chunks
REVEAL_COLS = 1 + CHUNKS  # x and one secret's chunks
CT_LEN = 4 * SHARE_COLS + 16  # uint32 share row + Poly1305 tag
_MAX_IDS = 1 << 17
_Ids = ListOf(Str(max_len=256), max_len=_MAX_IDS)
_Keys = ListOf(Bytes(max_len=KEY_LEN), max_len=_MAX_IDS)

#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(ADVERTISE, {}),
    Kind(KEYS, {"c_pk": Bytes(max_len=KEY_LEN), "s_pk": Bytes(max_len=KEY_LEN)}),
    Kind(
        ROSTER,
        {
            "threshold": Int(min=1),
            "clients": Int(min=1),
            "neighbours": _Ids,
            "c_pks": _Keys,
            "s_pks": _Keys,
        },
    ),
    Kind(SHARES, {"to": _Ids, "ct": ListOf(Bytes(max_len=CT_LEN), max_len=_MAX_IDS)}),
    Kind(RELAY, {"senders": _Ids, "ct": ListOf(Bytes(max_len=CT_LEN), max_len=_MAX_IDS)}),
    Kind(MASKED, {"y": Array("uint64", ndim=1)}),
    Kind(UNMASK, {"survivors": _Ids}),
    Kind(
        REVEAL,
        {"b_of": _Ids, "b": Array("uint32", ndim=2), "sk_of": _Ids, "sk": Array("uint32", ndim=2)},
    ),
)

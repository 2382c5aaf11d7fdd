"""Secure aggregation after Bonawitz et al. (CCS 2017), with the sparse-graph variant SecAgg+ of
Bell et al. (CCS 2020): the server learns the sum of the clients' updates and nothing else about
any one of them, even when clients drop out after sharing their keys.

One round, every message an ordinary envelope through the server (clients never talk directly):

1. ``secagg.advertise`` server -> selected; ``secagg.keys`` back: two fresh X25519 public keys
   per client, ``c`` for the share channel, ``s`` for the pairwise masks. Responders: U1.
2. ``secagg.roster`` server -> each u in U1: its neighbours N(u) with their public keys and the
   threshold t. ``degree = 0``: everyone is everyone's neighbour (SecAgg); ``degree = k``: a
   Harary graph of degree k over a random permutation of U1 (SecAgg+), so a client's cost grows
   with k = O(log n), not n. Each client draws a self-mask seed b_u, splits its mask key s_u^SK
   and b_u into t-out-of-|N(u)| Shamir shares, encrypts the share for v with ChaCha20-Poly1305
   under HKDF(X25519(c_u, c_v)) and sends them in ``secagg.shares``. Responders: U2 (clients
   left with fewer than t neighbours in U2 are pruned: their masks could never be removed).
3. ``secagg.relay`` server -> each v in U2: the ciphertexts addressed to it. Then the protocol's
   own broadcast (the global model) goes to U2; each client trains and, instead of its plain
   reply, sends ``secagg.masked``: y_u = x_u + PRG(b_u) + sum_{v in N(u) & U2} +-PRG(s_uv) in
   Z_2^64, x_u the fixed-point encoding of [w_u * theta_u, w_u] (``precision_bits`` fractional
   bits), s_uv = HKDF(X25519(s_u, s_v)), + when u < v, - otherwise, so pairwise masks cancel in
   the sum. Responders: U3.
4. ``secagg.unmask`` server -> each u in U3: which of its neighbours survived. u answers
   ``secagg.reveal`` with its shares of b_v for surviving neighbours and of s_v^SK for dropped
   ones, never both for one v, and refuses when fewer than t neighbours survived. The server
   rebuilds each b_u (u in U3) and each dropped client's s_v^SK from t shares (a rebuilt key
   must match the advertised public key), removes PRG(b_u) and the dropped clients' pairwise
   masks, and decodes sum_u [w_u theta_u, w_u]; the FPDGD strategy gets the weighted mean.

Choices, stated:

- PRG: the ChaCha20 keystream (``cryptography``) keyed by the 32-byte seed, nonce 0; every seed is
  used once per round (fresh keys each round).
- Shamir: implemented here over GF(2^31 - 1), a 32-byte secret as 16 little-endian 16-bit chunks
  with independent polynomials, vectorised with numpy. The well-kept library that fits,
  PyCryptodome (``Crypto.Protocol.SecretSharing.Shamir``), is not a dependency, shares 16-byte
  secrets over GF(2^128) in pure Python (about 4 ms per split and 16 ms per combine at t = 11 of
  20 on this machine: seconds per round for 100 clients, a minute for the complete graph) and
  draws its coefficients from the OS, which would break the simulator's seeded reproducibility.
- Randomness: keys, seeds and share coefficients come from the client's seeded stream
  (``rng("secagg", id)``), so a scenario and seed replay bit-identically; a deployment would use
  the OS's randomness. Dropout draws have their own stream (``rng("secagg-dropout", id)``), so a
  dropout sweep drops nested sets of clients.
- Threat model: honest-but-curious server and eavesdroppers. Bonawitz et al.'s active variant
  (signed keys under a PKI, the consistency-check round) is not implemented; the threshold is
  kept above half the neighbourhood, which that variant needs.
- ``dropout``: a client that has shared its keys fails to upload with this probability (it has
  trained, its users saw their rankings, then its upload is lost): the case the shares exist for.

``cost(...)`` measures one configuration's per-round cost (bytes, messages, wall time) on the
real bus with vector clients, for the benchmark.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from foltr_async.registry import REGISTRY, BehaviourEntry
from foltr_async.runtime.agent import Agent, handles
from foltr_async.runtime.codec import (
    Array,
    Bytes,
    Envelope,
    Int,
    ListOf,
    Str,
    decode,
    encode,
    register_kind,
)
from foltr_async.runtime.engine import RoundPlan, ServerAgent, Strategy
from foltr_async.runtime.secure import (
    Scheme,
    SecureAggregationError,
    SecureClient,
    SecureRun,
    SecureServer,
    Summable,
    register_scheme,
    reply,
    summable,
)
from foltr_async.scenario.fields import Field
from protocols import eavesdrop, fpdgd

__all__ = [
    "FIELDS",
    "SecAggClient",
    "SecAggServer",
    "cost",
    "from_ring",
    "harary",
    "make_run",
    "prg",
    "shamir_combine",
    "shamir_split",
    "to_ring",
]

ADVERTISE = "secagg.advertise"
KEYS = "secagg.keys"
ROSTER = "secagg.roster"
SHARES = "secagg.shares"
RELAY = "secagg.relay"
MASKED = "secagg.masked"
UNMASK = "secagg.unmask"
REVEAL = "secagg.reveal"

PRIME = 2**31 - 1  # Shamir field; products of two elements fit in int64
CHUNKS = 16  # a 32-byte secret as 16 uint16 values
SHARE_COLS = 1 + 2 * CHUNKS  # x, the mask key's chunks, the self-mask seed's chunks
REVEAL_COLS = 1 + CHUNKS  # x and one secret's chunks
CT_LEN = 4 * SHARE_COLS + 16  # uint32 share row + Poly1305 tag
KEY_LEN = 32
_MAX_IDS = 1 << 17
_Ids = ListOf(Str(max_len=256), max_len=_MAX_IDS)
_Keys = ListOf(Bytes(max_len=KEY_LEN), max_len=_MAX_IDS)

register_kind(ADVERTISE, {})
register_kind(KEYS, {"c_pk": Bytes(max_len=KEY_LEN), "s_pk": Bytes(max_len=KEY_LEN)})
register_kind(
    ROSTER,
    {
        "threshold": Int(min=1),
        "clients": Int(min=1),
        "neighbours": _Ids,
        "c_pks": _Keys,
        "s_pks": _Keys,
    },
)
register_kind(SHARES, {"to": _Ids, "ct": ListOf(Bytes(max_len=CT_LEN), max_len=_MAX_IDS)})
register_kind(RELAY, {"senders": _Ids, "ct": ListOf(Bytes(max_len=CT_LEN), max_len=_MAX_IDS)})
register_kind(MASKED, {"y": Array("uint64", ndim=1)})
register_kind(UNMASK, {"survivors": _Ids})
register_kind(
    REVEAL,
    {"b_of": _Ids, "b": Array("uint32", ndim=2), "sk_of": _Ids, "sk": Array("uint32", ndim=2)},
)

FIELDS = {
    "degree": Field(
        int, 0, "neighbours per client: 0 = all (SecAgg), k = Harary graph (SecAgg+)", min=0
    ),
    "threshold": Field(
        float, 0.5, "shares needed = floor(threshold * neighbours) + 1", min=0.5, max=1.0
    ),
    "precision_bits": Field(
        int, 32, "fractional bits of the fixed-point encoding in Z_2^64", min=8, max=48
    ),
    "deadline": Field(
        float,
        None,
        "simulated seconds per key/unmask phase (default: federation.deadline)",
        min=0.0,
        nullable=True,
    ),
    "dropout": Field(
        float, 0.0, "probability a client fails to upload after sharing its keys", min=0.0, max=1.0
    ),
}

log = structlog.get_logger()

_B_COLS = np.r_[0, 1 + CHUNKS : SHARE_COLS]  # x and the self-mask seed's chunks of a share row
_NONCE16 = bytes(16)  # ChaCha20 (cryptography): 4-byte counter + 12-byte nonce
_NONCE12 = bytes(12)  # ChaCha20-Poly1305: every key encrypts exactly one message


# --------------------------------------------------------------------------- primitives


def prg(seed: bytes, n: int) -> np.ndarray:
    """n pseudo-random uint64 values: the ChaCha20 keystream under a 32-byte seed."""
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE16), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(8 * n)), dtype="<u8")


def kdf(secret: bytes, label: str) -> bytes:
    """A 32-byte key for one purpose (``label`` names it, its parties and the round)."""
    return HKDF(hashes.SHA256(), 32, None, label.encode()).derive(secret)


def _public(raw: bytes) -> X25519PublicKey:
    return X25519PublicKey.from_public_bytes(raw)


def _pair_label(a: str, b: str, round: int) -> str:
    lo, hi = sorted((a, b))
    return f"foltr-secagg mask {lo}|{hi}@{round}"


def _share_label(src: str, dst: str, round: int) -> str:
    return f"foltr-secagg share {src}>{dst}@{round}"


def to_ring(x: np.ndarray, bits: int, clients: int) -> np.ndarray:
    """Fixed-point encoding in Z_2^64 (two's complement), refusing values whose sum over
    ``clients`` could wrap around."""
    limit = 2.0 ** (63 - bits) / max(1, clients)
    top = float(np.max(np.abs(x))) if x.size else 0.0
    if not top < limit:  # also catches NaN
        raise SecureAggregationError(
            f"update value {top:g} is outside the fixed-point range +-{limit:g} "
            f"({bits} fractional bits, {clients} clients)"
        )
    return np.rint(x * 2.0**bits).astype(np.int64).view(np.uint64)


def from_ring(z: np.ndarray, bits: int) -> np.ndarray:
    """Decode a (summed) ring vector to floats."""
    return np.ascontiguousarray(z, dtype=np.uint64).view(np.int64) / 2.0**bits


def _secret_values(secret: bytes) -> np.ndarray:
    return np.frombuffer(secret, dtype="<u2").astype(np.int64)


def _secret_bytes(values: np.ndarray, what: str) -> bytes:
    if values.size != CHUNKS or values.min() < 0 or values.max() > 0xFFFF:
        raise SecureAggregationError(f"{what}: the shares do not agree on a secret")
    return values.astype("<u2").tobytes()


def shamir_split(
    secret: np.ndarray, threshold: int, n: int, rng: np.random.Generator
) -> np.ndarray:
    """t-out-of-n Shamir shares of each value of ``secret`` (ints in [0, PRIME)).

    Row i is ``[x_i = i + 1, f_1(x_i), ...]`` (uint32), f_j a random polynomial of degree
    ``threshold - 1`` over GF(PRIME) with f_j(0) = secret[j]; any ``threshold`` rows give the
    secret back, fewer say nothing about it.
    """
    s = np.asarray(secret, dtype=np.int64)
    if not 1 <= threshold <= n < PRIME:
        raise ValueError(f"Shamir: need 1 <= threshold ({threshold}) <= n ({n})")
    if s.size and (s.min() < 0 or s.max() >= PRIME):
        raise ValueError("Shamir: secret values must lie in [0, PRIME)")
    coef = rng.integers(0, PRIME, size=(threshold - 1, s.size), dtype=np.int64)
    x = np.arange(1, n + 1, dtype=np.int64)[:, None]
    acc = np.zeros((n, s.size), dtype=np.int64)
    for c in coef[::-1]:  # Horner: ((c_{t-1} x + c_{t-2}) x + ...) x, < 2^63 at every step
        acc = (acc + c) * x % PRIME
    acc = (acc + s) % PRIME
    return np.hstack([x, acc]).astype(np.uint32)


def _inverse(a: np.ndarray) -> np.ndarray:
    """a^(PRIME - 2) mod PRIME elementwise (Fermat), by square and multiply."""
    result = np.ones_like(a)
    base = a % PRIME
    e = PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    return result


def shamir_combine(shares: np.ndarray, threshold: int) -> np.ndarray:
    """The secret from the first ``threshold`` shares with distinct x (Lagrange at 0)."""
    rows = np.asarray(shares, dtype=np.int64).reshape(-1, np.shape(shares)[-1])
    _, first = np.unique(rows[:, 0], return_index=True)
    rows = rows[np.sort(first)][:threshold]
    if len(rows) < threshold or threshold < 1:
        raise SecureAggregationError(f"{len(rows)} distinct shares, threshold {threshold}")
    x, y = rows[:, 0], rows[:, 1:]
    if (x <= 0).any() or (x >= PRIME).any():
        raise SecureAggregationError("a share has an x coordinate outside the field")
    # basis l_j(0) = prod_{m != j} x_m / (x_m - x_j): one vector step per m
    num = np.ones(threshold, dtype=np.int64)
    den = np.ones(threshold, dtype=np.int64)
    others = ~np.eye(threshold, dtype=bool)
    for m in range(threshold):
        num = np.where(others[m], num * x[m] % PRIME, num)
        den = np.where(others[m], den * ((x[m] - x) % PRIME) % PRIME, den)
    basis = num * _inverse(den) % PRIME
    return (basis[:, None] * (y % PRIME) % PRIME).sum(axis=0) % PRIME


def harary(ids: list[str], degree: int, rng: np.random.Generator) -> dict[str, list[str]]:
    """Each client's neighbours: everyone (``degree`` 0 or >= n - 1), else the Harary graph
    H(k, n) of even degree k (``degree`` rounded up) over a random order of the clients: the
    k/2 nearest on each side of a ring (Bell et al. 2020)."""
    n = len(ids)
    k = degree + degree % 2
    if degree <= 0 or k >= n - 1:
        return {u: [v for v in ids if v != u] for u in ids}
    order = np.asarray(ids, dtype=object)[rng.permutation(n)]
    half = np.arange(1, k // 2 + 1)
    ring = (np.arange(n)[:, None] + np.concatenate([half, -half])[None, :]) % n
    return {order[i]: sorted(order[ring[i]].tolist()) for i in range(n)}


def threshold_of(neighbours: int, fraction: float) -> int:
    """Shares needed of a client's ``neighbours``: more than half of them at least."""
    return max(1, min(neighbours, math.floor(fraction * neighbours) + 1))


# --------------------------------------------------------------------------- client half


@dataclass
class _ClientRound:
    """A client's key material and progress in one round (bytes and arrays: checkpointable)."""

    round: int
    server: str
    c_raw: bytes  # channel key
    s_raw: bytes  # mask key
    neighbours: list[str] = field(default_factory=list)
    s_pks: dict[str, bytes] = field(default_factory=dict)
    keys_in: dict[str, bytes] = field(default_factory=dict)
    threshold: int = 0
    clients: int = 0
    b: bytes = b""
    held: dict[str, np.ndarray] = field(default_factory=dict)
    u2: list[str] = field(default_factory=list)
    relayed: bool = False
    pending: tuple[str, dict] | None = None
    dropped: bool = False
    sent: bool = False
    revealed: bool = False


def _private(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


class SecAggClient(SecureClient):
    """A client's SecAgg half: answers the server's phases and masks the client's reply."""

    kinds = {ADVERTISE: "on_advertise", ROSTER: "on_roster", RELAY: "on_relay", UNMASK: "on_unmask"}

    def __init__(
        self,
        spec: Summable,
        settings: dict,
        rng: np.random.Generator,
        dropout_rng: np.random.Generator,
    ) -> None:
        super().__init__(spec)
        self.bits = settings["precision_bits"]
        self.dropout = settings["dropout"]
        self.rng = rng
        self.dropout_rng = dropout_rng
        self.state: _ClientRound | None = None

    @staticmethod
    def _count(agent: Agent, what: str) -> None:
        agent.counters[f"secagg_{what}"] += 1

    def _current(self, agent: Agent, env: Envelope) -> _ClientRound | None:
        st = self.state
        if st is None or st.round != env.round or st.server != env.src:
            self._count(agent, "stale")
            return None
        return st

    def on_advertise(self, agent: Agent, env: Envelope) -> None:
        """Fresh key pairs for the round: ``c`` for the share channel, ``s`` for the masks."""
        self.state = st = _ClientRound(
            env.round, env.src, self.rng.bytes(KEY_LEN), self.rng.bytes(KEY_LEN)
        )
        c_pk = _private(st.c_raw).public_key().public_bytes_raw()
        s_pk = _private(st.s_raw).public_key().public_bytes_raw()
        agent.send(env.src, KEYS, {"c_pk": c_pk, "s_pk": s_pk}, env.round)

    def on_roster(self, agent: Agent, env: Envelope) -> None:
        """Share the mask key and a new self-mask seed with the neighbours, encrypted to each."""
        st = self._current(agent, env)
        if st is None or st.neighbours:
            return
        body = env.body
        nbs, c_pks, s_pks, t = body["neighbours"], body["c_pks"], body["s_pks"], body["threshold"]
        me = agent.id
        if (
            len(c_pks) != len(nbs)
            or len(s_pks) != len(nbs)
            or me in nbs
            or len(set(nbs)) != len(nbs)
            or not t <= len(nbs)
            or any(len(k) != KEY_LEN for k in (*c_pks, *s_pks))
        ):
            self._count(agent, "bad_roster")
            return
        if t <= len(nbs) / 2:  # the threshold must stay above half the neighbourhood
            self._count(agent, "low_threshold")
            return
        st.neighbours, st.threshold, st.clients = list(nbs), t, body["clients"]
        st.s_pks = dict(zip(nbs, s_pks, strict=True))
        st.b = self.rng.bytes(KEY_LEN)
        secrets = np.concatenate([_secret_values(st.s_raw), _secret_values(st.b)])
        rows = shamir_split(secrets, t, len(nbs), self.rng)
        c_sk = _private(st.c_raw)
        cts = []
        for v, c_pk, row in zip(nbs, c_pks, rows, strict=True):
            shared = c_sk.exchange(_public(c_pk))
            st.keys_in[v] = kdf(shared, _share_label(v, me, env.round))
            key = kdf(shared, _share_label(me, v, env.round))
            cts.append(ChaCha20Poly1305(key).encrypt(_NONCE12, row.tobytes(), None))
        agent.send(env.src, SHARES, {"to": st.neighbours, "ct": cts}, env.round)

    def on_relay(self, agent: Agent, env: Envelope) -> None:
        """The neighbours' shares for this client; who sent them is U2 among the neighbours."""
        st = self._current(agent, env)
        if st is None or st.relayed or not st.neighbours:
            return
        senders, cts = env.body["senders"], env.body["ct"]
        known = set(st.neighbours)
        if len(senders) != len(cts) or not set(senders) <= known or len(set(senders)) != len(cts):
            self._count(agent, "bad_relay")
            return
        for v, ct in zip(senders, cts, strict=True):
            try:
                plain = ChaCha20Poly1305(st.keys_in[v]).decrypt(_NONCE12, ct, None)
            except Exception:  # a forged or corrupted share: that neighbour's secrets lack one
                self._count(agent, "bad_share")
                continue
            row = np.frombuffer(plain, dtype="<u4")
            if row.size == SHARE_COLS:
                st.held[v] = row
        st.u2 = sorted(senders)
        st.relayed = True
        st.dropped = self.dropout > 0.0 and self.dropout_rng.random() < self.dropout
        self._flush(agent, st)

    def submit(self, agent: Agent, dst: str, body: dict, round: int) -> None:
        st = self.state
        if st is None or st.round != round or st.server != dst:
            self._count(agent, "unkeyed")  # no key material for this round: never send in clear
            return
        st.pending = (dst, body)
        self._flush(agent, st)

    def _flush(self, agent: Agent, st: _ClientRound) -> None:
        """Send the masked input once both the reply and the relay are in."""
        if not st.relayed or st.pending is None or st.sent:
            return
        if st.dropped:
            self._count(agent, "dropped")
            st.pending = None
            return
        dst, body = st.pending
        st.pending = None
        try:
            y = self.mask(agent.id, st, self.spec.encode(body))
        except SecureAggregationError as e:  # cannot be summed safely: this client drops out
            self._count(agent, "unencodable")
            log.warning("secagg_unencodable", agent=agent.id, round=st.round, error=str(e))
            return
        st.sent = True
        agent.send(dst, MASKED, {"y": y}, st.round)

    def mask(self, me: str, st: _ClientRound, x: np.ndarray) -> np.ndarray:
        """y = x + PRG(b) + sum over neighbours in U2 of +-PRG(s_uv), in Z_2^64."""
        m = x.size
        y = to_ring(x, self.bits, st.clients) + prg(st.b, m)
        s_sk = _private(st.s_raw)
        plus, minus = np.zeros(m, np.uint64), np.zeros(m, np.uint64)
        for v in st.u2:
            p = prg(kdf(s_sk.exchange(_public(st.s_pks[v])), _pair_label(me, v, st.round)), m)
            if me < v:
                plus += p
            else:
                minus += p
        return y + plus - minus

    def on_unmask(self, agent: Agent, env: Envelope) -> None:
        """Reveal b-shares of surviving neighbours and key shares of dropped ones, once."""
        st = self._current(agent, env)
        if st is None or not st.sent or st.revealed:
            return
        survivors = set(env.body["survivors"])
        if not survivors <= set(st.u2):
            self._count(agent, "bad_unmask")
            return
        if len(survivors) < st.threshold:
            self._count(agent, "refused")  # too few survivors: the sum would expose too few
            return
        st.revealed = True
        b_of = [v for v in st.u2 if v in survivors and v in st.held]
        sk_of = [v for v in st.u2 if v not in survivors and v in st.held]
        b = np.array([st.held[v][_B_COLS] for v in b_of], np.uint32).reshape(-1, REVEAL_COLS)
        sk = np.array([st.held[v][:REVEAL_COLS] for v in sk_of], np.uint32)
        body = {"b_of": b_of, "b": b, "sk_of": sk_of, "sk": sk.reshape(-1, REVEAL_COLS)}
        agent.send(env.src, REVEAL, body, env.round)


# --------------------------------------------------------------------------- server half


@dataclass
class _ServerRound:
    round: int
    graph: dict[str, list[str]]
    s_pks: dict[str, bytes]
    thresholds: dict[str, int]
    u2: list[str]


class SecAggServer(SecureServer):
    """The server's SecAgg phases around the protocol's own broadcast and collection."""

    masked_kind = MASKED
    phase_kinds = (KEYS, SHARES, REVEAL)

    def __init__(self, spec: Summable, settings: dict, rng: np.random.Generator, emit) -> None:
        super().__init__(spec, settings["deadline"], emit)
        self.settings = settings
        self.degree = settings["degree"]
        self.fraction = settings["threshold"]
        self.bits = settings["precision_bits"]
        self.rng = rng
        self.state: _ServerRound | None = None
        self.totals: Counter[str] = Counter()

    async def _setup(self, round: int, selected: list[str]) -> list[str]:
        self.state = None
        if len(selected) < 2:
            raise SecureAggregationError(
                f"{len(selected)} client(s) selected; secure aggregation needs at least 2"
            )
        keys = await self.phase(round, selected, ADVERTISE, {}, KEYS)
        s_pks = {
            u: e.body["s_pk"]
            for u, e in keys.items()
            if len(e.body["s_pk"]) == KEY_LEN and len(e.body["c_pk"]) == KEY_LEN
        }
        u1 = sorted(s_pks)
        self.note(round, advertised=len(u1))
        if len(u1) < 2:
            raise SecureAggregationError(
                f"only {len(u1)} of {len(selected)} clients advertised keys; at least 2 needed"
            )
        graph = harary(u1, self.degree, self.rng)
        thresholds = {u: threshold_of(len(graph[u]), self.fraction) for u in u1}

        def roster(u: str) -> dict:
            nbs = graph[u]
            return {
                "threshold": thresholds[u],
                "clients": len(u1),
                "neighbours": nbs,
                "c_pks": [keys[v].body["c_pk"] for v in nbs],
                "s_pks": [s_pks[v] for v in nbs],
            }

        shares = await self.phase(round, u1, ROSTER, roster, SHARES)
        cts = {
            u: e.body["ct"]
            for u, e in shares.items()
            if e.body["to"] == graph[u]
            and all(len(c) == CT_LEN for c in e.body["ct"])
            and len(e.body["ct"]) == len(graph[u])
        }
        u2 = set(cts)
        while True:  # prune clients whose secrets could never be rebuilt: too few sharing peers
            short = {u for u in u2 if sum(v in u2 for v in graph[u]) < thresholds[u]}
            if not short:
                break
            u2 -= short
        self.note(round, shared=len(cts), pruned=len(cts) - len(u2))
        if len(u2) < 2:
            raise SecureAggregationError(
                f"only {len(u2)} of {len(u1)} clients shared their keys with enough neighbours "
                f"(each needs {min(thresholds.values())}+ of its {len(graph[u1[0]])})"
            )
        where = {u: {v: i for i, v in enumerate(graph[u])} for u in u2}

        def relay(v: str) -> dict:
            senders = [u for u in graph[v] if u in u2]
            return {"senders": senders, "ct": [cts[u][where[u][v]] for u in senders]}

        await self.phase(round, u2, RELAY, relay, None)
        self.state = _ServerRound(round, graph, s_pks, thresholds, sorted(u2))
        return self.state.u2

    async def _unmask(self, round: int, replies: list[Envelope]) -> np.ndarray:
        st = self.state
        if st is None or st.round != round:
            raise SecureAggregationError("masked inputs without this round's key material")
        sizes = Counter(e.body["y"].size for e in replies if e.src in st.graph)
        m = sizes.most_common(1)[0][0] if sizes else 0
        ys = {e.src: e.body["y"] for e in replies if e.src in st.u2 and e.body["y"].size == m}
        u3 = sorted(ys)
        dropped = [v for v in st.u2 if v not in ys]
        self.note(round, masked=len(u3), dropped=len(dropped))
        if len(u3) < 2:
            raise SecureAggregationError(
                f"{len(u3)} masked input(s) of {len(st.u2)}: a sum of fewer than 2 would expose "
                "a single update"
            )
        alive = set(u3)
        for who in (*u3, *dropped):
            have = sum(v in alive for v in st.graph[who])
            if have < st.thresholds[who]:
                raise SecureAggregationError(
                    f"{len(dropped)} of {len(st.u2)} clients dropped after sharing keys; "
                    f"{who} has {have} surviving neighbours, threshold {st.thresholds[who]}"
                )
        reveals = await self.phase(
            round,
            u3,
            UNMASK,
            lambda u: {"survivors": [v for v in st.graph[u] if v in alive]},
            REVEAL,
        )
        self.note(round, revealed=len(reveals))
        b_rows, sk_rows = self._collect_shares(st, reveals, alive)
        total = np.sum(np.stack([ys[u] for u in u3]), axis=0, dtype=np.uint64)
        for u in u3:  # self masks
            seed = _secret_bytes(self._rebuild(b_rows, u, st, "self-mask seed"), f"{u}'s seed")
            total -= prg(seed, m)
        for v in dropped:  # the dropped clients' pairwise masks still inside survivors' inputs
            raw = _secret_bytes(self._rebuild(sk_rows, v, st, "mask key"), f"{v}'s mask key")
            sk = _private(raw)
            if sk.public_key().public_bytes_raw() != st.s_pks[v]:
                raise SecureAggregationError(
                    f"{v}'s rebuilt mask key does not match its advertised public key"
                )
            for u in st.graph[v]:
                if u in alive:
                    p = prg(kdf(sk.exchange(_public(st.s_pks[u])), _pair_label(u, v, round)), m)
                    total = total - p if u < v else total + p
        self.totals.update(
            rounds=1,
            masked=len(u3),
            dropped=len(dropped),
            keys_rebuilt=len(dropped),
            seeds_rebuilt=len(u3),
        )
        self.state = None
        return from_ring(total, self.bits)

    @staticmethod
    def _collect_shares(st: _ServerRound, reveals: dict[str, Envelope], alive: set[str]):
        """Revealed share rows per owner, only from the owner's neighbours and of the right kind
        (b for survivors, key for dropped clients)."""
        b_rows: dict[str, list[np.ndarray]] = {}
        sk_rows: dict[str, list[np.ndarray]] = {}
        for src, env in reveals.items():
            body = env.body
            for owners, rows, keep, out in (
                (body["b_of"], body["b"], True, b_rows),
                (body["sk_of"], body["sk"], False, sk_rows),
            ):
                if rows.shape != (len(owners), REVEAL_COLS):
                    continue
                for owner, row in zip(owners, rows, strict=True):
                    if owner in st.graph and (owner in alive) == keep and src in st.graph[owner]:
                        out.setdefault(owner, []).append(row)
        return b_rows, sk_rows

    @staticmethod
    def _rebuild(
        rows: dict[str, list[np.ndarray]], owner: str, st: _ServerRound, what: str
    ) -> np.ndarray:
        got = rows.get(owner, [])
        t = st.thresholds[owner]
        if len(got) < t:
            raise SecureAggregationError(
                f"{owner}'s {what}: {len(got)} shares arrived, threshold {t}"
            )
        return shamir_combine(np.stack(got), t)

    def report(self) -> dict[str, Any]:
        rounds = self.totals["rounds"]
        return {
            "scheme": "SecAgg+ (Bell et al. 2020)"
            if self.degree
            else "SecAgg (Bonawitz et al. 2017)",
            **{k: self.settings[k] for k in ("degree", "threshold", "precision_bits", "dropout")},
            "primitives": "X25519 key agreement, HKDF-SHA256, ChaCha20 PRG, ChaCha20-Poly1305 "
            "share encryption, Shamir over GF(2^31-1), ring Z_2^64",
            "unmasked_rounds": rounds,
            "mean_masked_inputs": self.totals["masked"] / rounds if rounds else None,
            "mean_dropped_after_sharing": self.totals["dropped"] / rounds if rounds else None,
            "keys_rebuilt": self.totals["keys_rebuilt"],
            **super().report(),
        }


# --------------------------------------------------------------------------- registration


def make_run(spec: Summable, settings: dict, rng, emit) -> SecureRun:
    """A run's SecAgg: ``rng(*path)`` gives named seeded streams, ``emit(event, **fields)``."""
    full = {k: settings.get(k, f.default) for k, f in FIELDS.items()}
    server = SecAggServer(spec, full, rng("secagg-graph"), emit)

    def client(agent_id: str) -> SecAggClient:
        return SecAggClient(spec, full, rng("secagg", agent_id), rng("secagg-dropout", agent_id))

    return SecureRun(server, client)


def _build(ctx, spec: Summable, settings: dict) -> SecureRun:
    return make_run(spec, settings, ctx.rng, ctx.emit)


register_scheme(
    Scheme("secagg", "Bonawitz et al. 2017 secure aggregation; SecAgg+ with degree", FIELDS, _build)
)
# FPDGD's update is FedAvg'd by interactions: it can travel masked (declared here, beside the
# scheme, so fpdgd.py keeps only its reply site change).
summable("fpdgd", fpdgd.UPDATE, vector="params", weight="n_interactions")


# --------------------------------------------------------------------------- eavesdropper


class MaskedEavesdropper(eavesdrop.FPDGDEavesdropper):
    """The FPDGD eavesdropper, also on masked uploads: it reads a ``secagg.masked`` vector as the
    plaintext would be read ([B * theta, B] in fixed point) and scores that guess with
    ``FPDGDEavesdropper``'s own update-recovery and query-inference measures. The server sees
    exactly these messages, so the scores are also what the server learns from one upload."""

    taps = {**eavesdrop.FPDGDEavesdropper.taps, MASKED: "src"}

    def __init__(self, agent_id, ctx, targets, rng, candidates) -> None:
        super().__init__(agent_id, ctx, targets, rng, candidates)
        fed = ctx.cfg["federation"]
        self.batch = fed["queries_per_client"]
        self.bits = (fed.get("secagg") or {}).get(
            "precision_bits", FIELDS["precision_bits"].default
        )
        self.masked = 0

    def observe(self, header, data: bytes) -> None:
        if header.kind != MASKED:
            super().observe(header, data)
            return
        self.masked += 1
        guess = from_ring(decode(data).body["y"], self.bits)[:-1] / self.batch
        plain = Envelope(
            fpdgd.UPDATE,
            header.src,
            header.dst,
            {"params": guess, "n_interactions": self.batch},
            header.round,
            header.seq,
            header.sent_at,
        )
        super().observe(dataclasses.replace(header, kind=fpdgd.UPDATE), encode(plain))

    def summary(self) -> dict:
        return {
            **super().summary(),
            "masked_updates": self.masked,
            "secure_aggregation": bool(self.ctx.cfg["federation"].get("secure_aggregation")),
        }


def _build_eavesdropper(ctx, proto, group, aid, queries, rng):
    return MaskedEavesdropper(aid, ctx, eavesdrop._targets(ctx, group), rng, group["candidates"])


REGISTRY.add(
    BehaviourEntry(
        "secagg_eavesdropper",
        "eavesdropper",
        "taps FPDGD uplinks, plain or masked by secure aggregation: update recovery, query "
        "inference",
        ("fpdgd",),
        dict(REGISTRY.behaviours["eavesdropper"].params),
        _build_eavesdropper,
    )
)


# --------------------------------------------------------------------------- cost benchmark

BENCH_MODEL = "secagg.bench.model"
BENCH_UPDATE = "secagg.bench.update"
register_kind(BENCH_MODEL, {"dim": Int(min=1)})
register_kind(BENCH_UPDATE, {"vector": Array("float64", ndim=1), "weight": Int(min=0)})
_BENCH_SPEC = Summable(BENCH_UPDATE, "vector", "weight")


class VectorClient(Agent):
    """A client whose update is a random vector and weight (kept in ``truth`` for checking)."""

    role = "client"

    def __init__(self, agent_id: str, bus, rng: np.random.Generator, truth: dict) -> None:
        super().__init__(agent_id, bus)
        self.rng = rng
        self.truth = truth

    @handles(BENCH_MODEL)
    def on_model(self, env: Envelope) -> None:
        vector = self.rng.normal(size=env.body["dim"])
        weight = int(self.rng.integers(1, 9))
        self.truth[env.round, self.id] = (vector, weight)
        reply(self, env.src, BENCH_UPDATE, {"vector": vector, "weight": weight}, env.round)


class MeanStrategy(Strategy):
    """Broadcast the dimension, keep each round's FedAvg of the replies."""

    broadcast_kind = BENCH_MODEL
    reply_kind = BENCH_UPDATE

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.means: dict[int, np.ndarray] = {}

    def configure_round(self, round: int) -> dict:
        return {"dim": self.dim}

    def aggregate(self, round: int, replies: list) -> dict:
        v = np.stack([r.body["vector"] for r in replies])
        w = np.array([r.body["weight"] for r in replies], dtype=np.float64)
        self.means[round] = (w / w.sum()) @ v
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}


@dataclass
class VectorRun:
    """Vector clients around a ``MeanStrategy`` server on a memory bus (benchmark and tests)."""

    bus: Any
    agents: dict[str, VectorClient]
    strategy: MeanStrategy
    server: ServerAgent
    secure: SecureRun | None
    truth: dict = field(default_factory=dict)
    reports: list = field(default_factory=list)

    def halves(self) -> dict[str, SecAggClient]:
        return {a: agent.secure for a, agent in self.agents.items() if hasattr(agent, "secure")}


async def vector_rounds(
    clients: int,
    dim: int,
    rounds: int,
    settings: dict | None,
    seed: int,
    network=None,
    deadline: float = 60.0,
    prepare=None,
) -> VectorRun:
    """Play ``rounds`` rounds of vector clients (``settings`` None: plaintext). ``prepare(run)``
    runs once everyone is built and enrolled, before anyone starts (taps, forced dropouts)."""
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.network import NetworkModel

    bus = MemoryBus(network or NetworkModel(), stream(seed, "net"))
    truth: dict = {}
    agents = {
        f"client-{i:04d}": VectorClient(f"client-{i:04d}", bus, stream(seed, "client", i), truth)
        for i in range(clients)
    }
    secure_run = None
    if settings is not None:
        secure_run = make_run(
            _BENCH_SPEC, settings, lambda *p: stream(seed, *p), lambda *a, **k: None
        )
        for agent in agents.values():
            secure_run.enrol(agent)
    strategy = MeanStrategy(dim)
    server = ServerAgent(
        bus,
        strategy,
        RoundPlan(rounds=rounds, deadline=deadline),
        stream(seed, "server"),
        clients=lambda: sorted(agents),
        secure=secure_run.server if secure_run else None,
    )
    run = VectorRun(bus, agents, strategy, server, secure_run, truth)
    if prepare is not None:
        prepare(run)
    server.start()
    for agent in agents.values():
        agent.start()
    try:
        run.reports = await server.run_rounds()
    finally:
        for agent in [*agents.values(), server]:
            await agent.leave()
    return run


def plaintext_mean(vr: VectorRun, report) -> np.ndarray:
    """FedAvg of the true inputs of the clients a round's report says contributed."""
    rows = [vr.truth[report.round, c] for c in report.clients]
    w = np.array([r[1] for r in rows], dtype=np.float64)
    return (w / w.sum()) @ np.stack([r[0] for r in rows])


def relative_error(vr: VectorRun, report) -> float:
    """Largest coordinate error of the unmasked mean relative to the largest true coordinate."""
    exact = plaintext_mean(vr, report)
    return float(np.abs(vr.strategy.means[report.round] - exact).max() / np.abs(exact).max())


def cost(
    clients: int,
    dim: int = 137,
    degree: int = 0,
    dropout: float = 0.0,
    rounds: int = 2,
    secure: bool = True,
    seed: int = 0,
    threshold: float = 0.5,
) -> dict[str, Any]:
    """Per-round cost of secure aggregation (or of the plaintext round with ``secure=False``):
    messages and bytes on the bus, wall seconds, and the largest relative error of the unmasked
    mean against the plaintext FedAvg of the same inputs. For ``foltr_async.bench``."""
    from foltr_async.runtime.clock import run

    settings = {"degree": degree, "dropout": dropout, "threshold": threshold} if secure else None
    t0 = time.perf_counter()
    vr = run(vector_rounds(clients, dim, rounds, settings, seed))
    wall = time.perf_counter() - t0
    errors = [relative_error(vr, rep) for rep in vr.reports if rep.round in vr.strategy.means]
    stats = vr.bus.stats
    return {
        "clients": clients,
        "dim": dim,
        "secure": secure,
        "degree": degree,
        "dropout": dropout,
        "rounds": rounds,
        "completed_rounds": len(errors),
        "messages_per_round": stats.sent / rounds,
        "bytes_per_round": stats.bytes_sent / rounds,
        "bytes_per_client_round": stats.bytes_sent / rounds / clients,
        "wall_s_per_round": wall / rounds,
        "max_rel_error": max(errors) if errors else None,
    }

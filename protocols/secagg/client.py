"""A client's SecAgg half: fresh keys per round, encrypted Shamir shares of its secrets for its
neighbours, the masked upload, and the shares it reveals so the server can unmask the sum."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import structlog
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from foltr_async.protocols.secagg.messages import (
    ADVERTISE,
    KEYS,
    MASKED,
    RELAY,
    REVEAL,
    REVEAL_COLS,
    ROSTER,
    SHARE_COLS,
    SHARES,
    UNMASK,
)
from foltr_async.protocols.secagg.primitives import (
    CHUNKS,
    KEY_LEN,
    kdf,
    pair_mask,
    prg,
    private_key,
    public_key,
    secret_values,
    shamir_split,
    share_label,
    to_ring,
)
from foltr_async.protocols.secagg.settings import Settings
from foltr_async.runtime.agent import Agent
from foltr_async.runtime.secure import SecureAggregationError, SecureClient, Summable
from foltr_async.runtime.wire import Envelope

log = structlog.get_logger()

_B_COLS = np.r_[0, 1 + CHUNKS : SHARE_COLS]  # x and the self-mask seed's chunks of a share row
_NONCE12 = bytes(12)  # ChaCha20-Poly1305: every key encrypts exactly one message


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


class SecAggClient(SecureClient):
    """A client's SecAgg half: answers the server's phases and masks the client's reply."""

    kinds = {ADVERTISE: "on_advertise", ROSTER: "on_roster", RELAY: "on_relay", UNMASK: "on_unmask"}

    def __init__(
        self,
        spec: Summable,
        settings: Settings,
        rng: np.random.Generator,
        dropout_rng: np.random.Generator,
    ) -> None:
        super().__init__(spec)
        self.bits = settings.precision_bits
        self.dropout = settings.dropout
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
        c_pk = private_key(st.c_raw).public_key().public_bytes_raw()
        s_pk = private_key(st.s_raw).public_key().public_bytes_raw()
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
        secrets = np.concatenate([secret_values(st.s_raw), secret_values(st.b)])
        rows = shamir_split(secrets, t, len(nbs), self.rng)
        c_sk = private_key(st.c_raw)
        cts = []
        for v, c_pk, row in zip(nbs, c_pks, rows, strict=True):
            shared = c_sk.exchange(public_key(c_pk))
            st.keys_in[v] = kdf(shared, share_label(v, me, env.round))
            key = kdf(shared, share_label(me, v, env.round))
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
        s_sk = private_key(st.s_raw)
        plus, minus = np.zeros(m, np.uint64), np.zeros(m, np.uint64)
        for v in st.u2:
            p = pair_mask(s_sk, st.s_pks[v], me, v, st.round, m)
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

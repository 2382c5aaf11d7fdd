"""The server's SecAgg half: the key, share and relay phases before the protocol's broadcast,
then unmasking the sum of the masked replies (rebuilding self-mask seeds and dropped clients'
mask keys from the revealed shares)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from foltr_async.protocols.secagg.messages import (
    ADVERTISE,
    CT_LEN,
    KEYS,
    MASKED,
    RELAY,
    REVEAL,
    REVEAL_COLS,
    ROSTER,
    SHARES,
    UNMASK,
)
from foltr_async.protocols.secagg.primitives import (
    KEY_LEN,
    from_ring,
    harary,
    pair_mask,
    prg,
    private_key,
    secret_bytes,
    shamir_combine,
    threshold_of,
)
from foltr_async.protocols.secagg.settings import Settings
from foltr_async.runtime.secure import SecureAggregationError, SecureServer, Summable
from foltr_async.runtime.wire import Envelope


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

    def __init__(self, spec: Summable, settings: Settings, rng: np.random.Generator, emit) -> None:
        super().__init__(spec, settings.deadline, emit)
        self.settings = settings
        self.degree = settings.degree
        self.fraction = settings.threshold
        self.bits = settings.precision_bits
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
            seed = secret_bytes(self._rebuild(b_rows, u, st, "self-mask seed"), f"{u}'s seed")
            total -= prg(seed, m)
        for v in dropped:  # the dropped clients' pairwise masks still inside survivors' inputs
            raw = secret_bytes(self._rebuild(sk_rows, v, st, "mask key"), f"{v}'s mask key")
            sk = private_key(raw)
            if sk.public_key().public_bytes_raw() != st.s_pks[v]:
                raise SecureAggregationError(
                    f"{v}'s rebuilt mask key does not match its advertised public key"
                )
            for u in st.graph[v]:
                if u in alive:
                    p = pair_mask(sk, st.s_pks[u], u, v, round, m)
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
            **{
                k: getattr(self.settings, k)
                for k in ("degree", "threshold", "precision_bits", "dropout")
            },
            "primitives": "X25519 key agreement, HKDF-SHA256, ChaCha20 PRG, ChaCha20-Poly1305 "
            "share encryption, Shamir over GF(2^31-1), ring Z_2^64",
            "unmasked_rounds": rounds,
            "mean_masked_inputs": self.totals["masked"] / rounds if rounds else None,
            "mean_dropped_after_sharing": self.totals["dropped"] / rounds if rounds else None,
            "keys_rebuilt": self.totals["keys_rebuilt"],
            **super().report(),
        }

"""What the server takes from a worker: checked against what that worker was assigned.

A worker is a peer, not part of the server: whatever it sends is a claim. Its control
messages are typed and bounded at the hub (``distributed.control.WORKER_CONTROL``,
``Measured``); this module checks what they say against the server's own records of the
run before any of it is merged:

- states (``ready``, ``ack``) only of the clients the request named;
- saved agent states (``snapped``) only of its own clients;
- displayed-ranking records only of its own clients, nDCG values in [0, 1], at most twice
  the client's assigned interactions per model message the server sent it;
- delivery counters at most what the hub routed to its clients (messages and bytes);
- probe extras only under the keys the code declares (``worker_extras``): a table
  keyed by its own client ids (each entry replaces that client's last one) or the counters
  the server declared, added up over the workers;
- oracle truths only about its own clients.

Everything else is refused and counted by reason (``refused``: the results'
``transport.measurements_refused``); nothing a worker sends is written over a field the server
computes (results, privacy accounting, message counts).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from foltr_async.runtime.schema import Invalid, Spec

__all__ = ["WORKER_EXTRAS", "Measured", "RunLedger", "worker_extras"]

#: lifecycle states a worker may report for its clients
_STATES = frozenset(("new", "joined", "left", "crashed"))
#: how many displayed rankings per interaction the server allows (FOLtR-ES's antithetic pairs)
_SHOWN_PER_INTERACTION = 2


#: Probe extras a worker may report about its own clients, and how the server merges them:
#: ``"per_client"``, a table keyed by client id (a worker's entry for one of its own clients
#: replaces that client's last one), or ``"counters"``, named counts the server holds too (each
#: worker's latest counts are added to the server's own). A worker's other extras are refused.
WORKER_EXTRAS: dict[str, str] = {}


def worker_extras(key: str, merge: str) -> None:
    """Declare that workers may report ``probe.extras[key]``, merged as ``merge`` says."""
    if merge not in ("per_client", "counters"):
        raise ValueError(f"worker_extras: merge must be 'per_client' or 'counters', got {merge!r}")
    WORKER_EXTRAS[key] = merge


class Measured(Spec):
    """A measurement value: numbers, strings, numeric arrays, lists and string-keyed tables,
    nested at most ``depth`` deep, holding at most ``scalars`` numbers and strings in all
    (an array counts its elements). Checked without recursion."""

    __slots__ = ("depth", "scalars")

    def __init__(self, depth: int = 6, scalars: int = 1 << 18) -> None:
        self.depth = depth
        self.scalars = scalars

    def check(self, value: Any) -> Any:
        todo, n = [(value, 0)], 0
        while todo:
            node, depth = todo.pop()
            t = type(node)
            if t is dict:
                if depth >= self.depth:
                    raise Invalid(f"measurement nested deeper than {self.depth} levels")
                for key in node:
                    if type(key) is not str or len(key) > 256:
                        raise Invalid("measurement tables need string keys (at most 256 chars)")
                todo += [(v, depth + 1) for v in node.values()]
                n += len(node)
            elif t is list:
                if depth >= self.depth:
                    raise Invalid(f"measurement nested deeper than {self.depth} levels")
                todo += [(v, depth + 1) for v in node]
            elif t is np.ndarray:
                if node.dtype.kind not in "biuf":
                    raise Invalid(f"measurement array of dtype {node.dtype}")
                n += node.size
            elif t is str:
                if len(node) > 256:
                    raise Invalid("measurement strings hold at most 256 characters")
                n += 1
            elif t in (int, float, bool) or node is None:
                n += 1
            else:
                raise Invalid(f"measurement value of type {t.__name__}")
            if n > self.scalars:
                raise Invalid(f"measurement of more than {self.scalars} values")
        return value


class RunLedger:
    """One run's record of what each worker was assigned, and the checked merge of what it
    reports (``refused`` counts what was not taken, by reason)."""

    def __init__(self, sim: Any, bus: Any) -> None:
        self.sim = sim
        self.bus = bus
        self.assigned: dict[bytes, set[str]] = {}
        self.refused: Counter[str] = Counter()
        self._shown: Counter[str] = Counter()  # client -> displayed-ranking records taken
        self._delivered: Counter[bytes] = Counter()  # worker -> deliveries and drops taken
        self._bytes: Counter[bytes] = Counter()
        extras = sim.probe.extras
        #: the counters the server holds (workers' counts are added to them)
        self._base = {
            k: dict(extras[k])
            for k, how in WORKER_EXTRAS.items()
            if how == "counters" and isinstance(extras.get(k), dict)
        }
        self._counts: dict[tuple[str, bytes], dict[str, int]] = {}  # each worker's latest

    # ----------------------------------------------------------------- assignment

    def assign(self, peer: bytes, ids: Any) -> None:
        """``peer`` hosts these clients from now on (no other worker does)."""
        ids = set(ids)
        for other, mine in self.assigned.items():
            if other != peer:
                mine -= ids
        self.assigned.setdefault(peer, set()).update(ids)

    def own(self, peer: bytes) -> set[str]:
        return self.assigned.get(peer, set())

    def states(self, peer: bytes, states: dict, asked: Any) -> dict:
        """The reported states of clients the request named (and this worker was given)."""
        own, out = self.own(peer), {}
        for aid, entry in states.items():
            if aid not in asked or aid not in own:
                self.refused["state_not_its_client"] += 1
            elif len(entry) != 2 or entry[0] not in _STATES:
                self.refused["bad_state"] += 1
            else:
                out[aid] = entry
        return out

    def saved(self, peer: bytes, agents: dict) -> dict:
        """Saved agent states of this worker's own clients."""
        own = self.own(peer)
        out = {aid: e for aid, e in agents.items() if aid in own}
        self.refused["saved_not_its_client"] += len(agents) - len(out)
        return out

    def oracle(self, peer: bytes, key: list, value: list) -> None:
        """A truth about one of this worker's clients (``key``: kind, client id, ...), for the
        eavesdroppers' scores."""
        if not self.sim.probe.oracle_read:
            self.refused["oracle_unasked"] += 1
        elif len(key) < 2 or type(key[0]) is not str or key[1] not in self.own(peer):
            self.refused["oracle_not_its_client"] += 1
        else:
            self.sim.probe.oracle[tuple(key)] = tuple(value)

    # ----------------------------------------------------------------- measurements

    def merge(self, peer: bytes, flush: dict) -> None:
        """Take a worker's flush: its records, counters and extras, as far as they check."""
        own = self.own(peer)
        if not own:
            self.refused["no_clients"] += 1
            return
        self._records(own, flush["shown"])
        self._stats(peer, flush["stats"])
        for key, value in flush["extras"].items():
            self._extra(peer, own, key, value)

    def shown_budget(self, aid: str) -> int:
        """Displayed rankings a client may have recorded: per model message the server sent it,
        twice its interactions per round (a replayed log: all its queries)."""
        ctx = self.sim.ctx
        per = ctx.batch_of(aid)
        own = ctx.client_data(aid)
        if own is not None and own.arrivals is not None:
            per = max(per, len(own.queries))
        return _SHOWN_PER_INTERACTION * per * self.bus.sent_to[aid]

    def _records(self, own: set[str], shown: dict) -> None:
        """Checked with numpy, so a flood of records costs arrays, not Python objects."""
        owners = shown["owners"]
        idx, rounds, values = shown["owner"], shown["rounds"], shown["values"]
        if not (len(idx) == len(rounds) == len(values)):
            self.refused["shown_malformed"] += 1
            return
        mine = np.array([o in own for o in owners] + [False], dtype=bool)
        idx = np.where((idx >= 0) & (idx < len(owners)), idx, len(owners))
        ok = mine[idx]
        self.refused["shown_not_its_client"] += int((~ok).sum())
        good = (rounds >= 0) & (values >= 0.0) & (values <= 1.0)  # NaN fails too
        self.refused["shown_bad_value"] += int((ok & ~good).sum())
        ok &= good
        keep = np.zeros(len(idx), dtype=bool)
        for i in np.unique(idx[ok]).tolist():
            aid = owners[i]
            rows = np.flatnonzero(ok & (idx == i))
            room = max(0, self.shown_budget(aid) - self._shown[aid])
            keep[rows[:room]] = True
            self._shown[aid] += min(room, rows.size)
            self.refused["shown_over_budget"] += max(0, rows.size - room)
        sel = np.flatnonzero(keep)
        self.sim.probe.add_records(
            list(
                zip(
                    rounds[sel].tolist(),
                    [owners[i] for i in idx[sel].tolist()],
                    values[sel].tolist(),
                    strict=True,
                )
            )
        )

    def _stats(self, peer: bytes, delta: dict) -> None:
        """Delivery counters, if within what the hub routed to this worker's clients."""
        routed, routed_bytes = self.bus.routed[peer], self.bus.routed_bytes[peer]
        kinds = delta["kinds"]
        registry = self.bus.registry
        n = delta["delivered"] + sum(delta["dropped"].values())
        ok = (
            all(v >= 0 for v in delta["dropped"].values())
            and all(k in registry and len(c) == 3 and min(c) >= 0 for k, c in kinds.items())
            and self._delivered[peer] + n <= 2 * routed
            and delta["delivered"] <= routed
            and self._bytes[peer] + delta["bytes_delivered"] <= routed_bytes
        )
        if not ok:
            self.refused["stats_over_budget"] += 1
            return
        self._delivered[peer] += n
        self._bytes[peer] += delta["bytes_delivered"]
        st = self.bus.stats
        st.delivered += delta["delivered"]
        st.bytes_delivered += delta["bytes_delivered"]
        for reason, k in delta["dropped"].items():
            st.dropped[reason] += k
        for kind, (delivered, nbytes, dropped) in kinds.items():
            ks = st.kind(kind)
            ks.delivered += delivered
            ks.bytes_delivered += nbytes
            ks.dropped += dropped

    def _extra(self, peer: bytes, own: set[str], key: str, value: Any) -> None:
        how = WORKER_EXTRAS.get(key)
        extras = self.sim.probe.extras
        if how == "per_client" and type(value) is dict:
            if type(extras.get(key, {})) is not dict:
                self.refused["extras_key"] += 1
                return
            for aid, entry in value.items():
                if aid in own:
                    extras.setdefault(key, {})[aid] = entry
                else:
                    self.refused["extras_not_its_client"] += 1
        elif how == "counters" and key in self._base and type(value) is dict:
            base = self._base[key]
            bound = sum(self.shown_budget(a) + self.bus.sent_to[a] for a in own)
            if not all(
                name in base and type(n) is int and 0 <= n <= bound for name, n in value.items()
            ):
                self.refused["extras_counters"] += 1
                return
            # the workers' counts are cumulative: add what this report adds to its last one
            last = self._counts.get((key, peer), {})
            self._counts[key, peer] = dict(value)
            table = extras.setdefault(key, {})
            for name in base:
                table[name] = table.get(name, 0) + value.get(name, 0) - last.get(name, 0)
        else:
            self.refused["extras_key"] += 1

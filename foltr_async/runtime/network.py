"""The network model: latency, bandwidth, loss, availability and churn (the bus applies it).

Agents never see it; they only notice that messages arrive late or not at all, and that some
clients are offline in a round. All randomness comes from the generator the bus passes in.

Model, exactly:

- transit time of a message of ``n`` bytes = one latency draw for its link + ``n / bandwidth``
  (each message has its own pipe: no queueing or shared-capacity congestion).
- loss: each message is lost independently with probability ``loss`` (drawn before latency).
- availability: in every round each client is online independently with probability
  ``availability`` (transient dropout, no memory).
- devices: each client's local compute time is the protocol's times a multiplier drawn once
  per client from ``compute_scale`` (a distribution like ``latency``; default 1: equal devices).
- availability models (``availability_model``): ``"bernoulli"`` as above; ``"diurnal"``: client i
  is online with probability ``availability * (1 + amplitude * sin(2 pi (t / day + phase_i)))``
  (clipped to [0, 1]) at simulated time t, phases drawn once per client uniformly in
  ``[0, spread)`` (time zones; FLGo's sinusoidal availability, and the day-night cycle FedScale's
  and Yang et al.'s (WWW 2021) smartphone traces show); ``"trace"``: the ``trace`` file says
  (FedScale on/off windows at time t, or FLGo's per-client Markov chain stepped once per
  round), and ``availability`` < 1 adds independent transient dropout on top. FedScale windows
  are read at trace time ``trace_start + trace_speed * t``; under ``trace_rule =
  "completion"`` (the default) a client's message also counts only if its windows still have it
  online when the message arrives (FedScale's synchronous rule: online at the round's start and
  at its update's completion); ``"round_start"``: presence at the round's start is all.
- traces (``trace``): per-client compute-time factors, bandwidths and availability from a
  FedScale or FLGo trace (``foltr_async.runtime.traces``); the trace factor multiplies the
  ``compute_scale`` draw, and a link runs at the slower end's bandwidth.
- FLGo's named system models (``flgo``: availability, connectivity, completeness,
  responsiveness; ``foltr_async.runtime.flgo``): the run's servers and clients apply them on
  top of everything above.
- churn: at the start of every round, a client that is not already away leaves with
  probability ``churn`` and stays away for K rounds including this one,
  K ~ Geometric(1 / churn_rounds) on {1, 2, ...} (mean ``churn_rounds``). A client is online
  in a round iff it is not away and its availability draw succeeds. The server (any agent of
  role ``server``) is always online.

Per-link latency overrides are keyed ``"src->dst"``, each side an agent id (``client-0003``), a
role (``client``) or ``*``; the most specific match wins: a side scores 2 for an id, 1 for a
role, 0 for ``*``, the highest sum wins and a tie goes to the more specific source (so
``client-0003->*`` beats ``client->server``, which beats ``*->server``). An agent's role is
given by the bus, or read from its id by dropping a trailing ``-<number>`` (``client-0003`` ->
``client``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from foltr_async.errors import ScenarioError
from foltr_async.names import suggest
from foltr_async.runtime.flgo import FlgoModels
from foltr_async.runtime.traces import Trace, load_trace

__all__ = ["Latency", "NetworkModel", "Presence", "role_of"]

_KINDS = {"constant": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma")}
_ROLE_RE = re.compile(r"-\d+$")


def role_of(agent_id: str) -> str:
    """Role implied by an id: ``client-0003`` -> ``client``; ``server`` -> ``server``."""
    return _ROLE_RE.sub("", agent_id)


def _fail(path: str, expected: str, got: Any = ...) -> ScenarioError:
    tail = "" if got is ... else f", got {got!r}"
    return ScenarioError(f"{path}: expected {expected}{tail}")


def _number(
    d: Mapping,
    key: str,
    path: str,
    *,
    lo: float = 0.0,
    lo_open: bool = False,
    hi: float | None = None,
    hi_open: bool = False,
) -> float:
    """``d[key]`` as a float within bounds, else a ScenarioError naming ``path.key``."""
    val = d[key]
    if hi is None:
        want = f"a number {'>' if lo_open else '>='} {lo}"
    else:
        want = f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    ok = isinstance(val, int | float) and not isinstance(val, bool) and math.isfinite(val)
    ok = ok and (val > lo if lo_open else val >= lo)
    if ok and hi is not None:
        ok = val < hi if hi_open else val <= hi
    if not ok:
        raise _fail(f"{path}.{key}", want, val)
    return float(val)


@dataclass(frozen=True)
class Latency:
    """One-way delay distribution in seconds: constant, uniform(low, high), lognormal(median,
    sigma) (= median * exp(sigma * N(0, 1)), so ``median`` is the median delay)."""

    kind: str = "constant"
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        self._validate("latency")

    def _validate(self, path: str) -> None:
        if self.kind not in _KINDS:
            raise _fail(f"{path}.kind", "one of " + ", ".join(_KINDS), self.kind)
        d = {k: getattr(self, k) for k in ("value", "low", "high", "median", "sigma")}
        for key in _KINDS[self.kind]:
            _number(d, key, path, lo_open=key == "median")
        if self.kind == "uniform" and self.high < self.low:
            raise _fail(f"{path}.high", f"a number >= low ({self.low})", self.high)

    @classmethod
    def constant(cls, value: float) -> Latency:
        return cls("constant", value=value)

    @classmethod
    def uniform(cls, low: float, high: float) -> Latency:
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, sigma: float) -> Latency:
        return cls("lognormal", median=median, sigma=sigma)

    @classmethod
    def from_dict(cls, d: Any, path: str = "network.latency") -> Latency:
        """A table ``{kind = "uniform", low = 0.01, high = 0.2}`` or a number (constant)."""
        if isinstance(d, int | float) and not isinstance(d, bool):
            d = {"kind": "constant", "value": d}
        if not isinstance(d, Mapping):
            raise _fail(path, "a number of seconds or a table with 'kind'", d)
        kind = d.get("kind", "constant")
        if kind not in _KINDS:
            raise _fail(f"{path}.kind", "one of " + ", ".join(_KINDS), kind)
        allowed = ("kind", *_KINDS[kind])
        for key in d:
            if key not in allowed:
                raise _fail(
                    f"{path}.{key}",
                    f"one of the {kind} latency keys{suggest(str(key), list(allowed))}: "
                    + ", ".join(allowed),
                )
        for key in _KINDS[kind]:
            if key not in d:
                raise _fail(f"{path}.{key}", f"a number (required for {kind} latency)")
        params = {k: _number(d, k, path, lo_open=k == "median") for k in _KINDS[kind]}
        if kind == "uniform" and params["high"] < params["low"]:
            raise _fail(f"{path}.high", f"a number >= low ({params['low']})", params["high"])
        return cls(kind, **params)

    def sample(self, rng: np.random.Generator) -> float:
        """One delay in seconds (a constant draws nothing from the generator)."""
        if self.kind == "constant":
            return self.value
        if self.kind == "uniform":
            return float(rng.uniform(self.low, self.high))
        return self.median * math.exp(self.sigma * float(rng.standard_normal()))

    def sample_many(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` delays, the same stream as ``n`` calls to ``sample``."""
        if self.kind == "constant":
            return np.full(n, self.value)
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high, n)
        return self.median * np.exp(self.sigma * rng.standard_normal(n))


def _sides(agent_id: str, role: str | None) -> list[tuple[str, int]]:
    """Names a link key may use for one side, with their specificity (an id equal to its role,
    like ``server``, counts as a role)."""
    role = role or role_of(agent_id)
    return ([(agent_id, 2)] if agent_id != role else []) + [(role, 1), ("*", 0)]


class Presence:
    """Per-run availability state: until which round each churned client stays away, diurnal
    phases and Markov (trace) states of the clients seen so far."""

    __slots__ = ("away_until", "phase", "up")

    def __init__(self) -> None:
        self.away_until: dict[str, int] = {}
        self.phase: dict[str, float] = {}
        self.up: dict[str, bool] = {}


@dataclass(frozen=True)
class Diurnal:
    """Day-night availability: relative amplitude, day length (s), spread of the phases."""

    amplitude: float = 0.5
    day: float = 86400.0
    spread: float = 1.0

    @classmethod
    def from_dict(cls, d: Any, path: str) -> Diurnal:
        if not isinstance(d, Mapping):
            raise _fail(path, "a table {amplitude, day, spread}", d)
        for key in d:
            if key not in ("amplitude", "day", "spread"):
                hint = suggest(str(key), ["amplitude", "day", "spread"])
                raise _fail(
                    f"{path}.{key}", f"one of the diurnal keys{hint}: amplitude, day, spread"
                )
        kw = {}
        if "amplitude" in d:
            kw["amplitude"] = _number(d, "amplitude", path, hi=1.0)
        if "day" in d:
            kw["day"] = _number(d, "day", path, lo_open=True)
        if "spread" in d:
            kw["spread"] = _number(d, "spread", path, hi=1.0)
        return cls(**kw)


AVAILABILITY_MODELS = ("bernoulli", "diurnal", "trace")


_KEYS = (
    "latency",
    "links",
    "bandwidth",
    "loss",
    "availability",
    "churn",
    "churn_rounds",
    "compute_scale",
    "trace",
    "availability_model",
    "diurnal",
    "flgo",
    "trace_start",
    "trace_speed",
    "trace_rule",
)

TRACE_RULES = ("completion", "round_start")


def _trace_timing(d: Mapping[str, Any], prefix: str, trace: Trace | None) -> dict[str, Any]:
    """``trace_start`` / ``trace_speed`` / ``trace_rule``: only where FedScale windows drive
    availability (``trace``: the model's trace when its availability model is "trace")."""
    given = [k for k in ("trace_start", "trace_speed", "trace_rule") if k in d]
    if given and (trace is None or not trace.has_windows):
        raise ScenarioError(
            f'{prefix}.{given[0]}: only with availability_model = "trace" and a network.trace '
            "with FedScale on/off windows (a behaviour table)"
        )
    kw: dict[str, Any] = {}
    if "trace_start" in d:
        kw["trace_start"] = _number(d, "trace_start", prefix)
    if "trace_speed" in d:
        kw["trace_speed"] = _number(d, "trace_speed", prefix, lo_open=True)
    if "trace_rule" in d:
        if d["trace_rule"] not in TRACE_RULES:
            raise _fail(f"{prefix}.trace_rule", "one of " + ", ".join(TRACE_RULES), d["trace_rule"])
        kw["trace_rule"] = d["trace_rule"]
    return kw


@dataclass(frozen=True)
class NetworkModel:
    """Network configuration (immutable; per-run churn state lives in a ``Presence``)."""

    latency: Latency = field(default_factory=Latency)
    links: Mapping[str, Latency] = field(default_factory=dict)
    bandwidth: float | None = None
    loss: float = 0.0
    availability: float = 1.0
    churn: float = 0.0
    churn_rounds: float = 5.0
    #: per-device multiplier of local compute time, drawn once per client (``device_scale``)
    compute_scale: Latency = field(default_factory=lambda: Latency.constant(1.0))
    trace: Trace | None = None
    availability_model: str = "bernoulli"
    diurnal: Diurnal = field(default_factory=Diurnal)
    flgo: FlgoModels | None = None
    #: FedScale windows: trace seconds at simulated time 0, trace seconds per simulated second
    trace_start: float = 0.0
    trace_speed: float = 1.0
    trace_rule: str = "completion"
    _resolved: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _own_presence: Presence = field(default_factory=Presence, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        d = {
            "loss": self.loss,
            "availability": self.availability,
            "churn": self.churn,
            "churn_rounds": self.churn_rounds,
        }
        _number(d, "loss", "network", hi=1.0, hi_open=True)
        _number(d, "availability", "network", hi=1.0)
        _number(d, "churn", "network", hi=1.0, hi_open=True)
        _number(d, "churn_rounds", "network", lo=1.0)
        if self.bandwidth is not None:
            _number({"bandwidth": self.bandwidth}, "bandwidth", "network", lo_open=True)
        for key, lat in self.links.items():
            src, sep, dst = key.partition("->")
            if not sep or not src.strip() or not dst.strip():
                raise _fail(f"network.links.{key}", 'a key "src->dst" (ids, roles or *)')
            if not isinstance(lat, Latency):
                raise _fail(f"network.links.{key}", "a Latency", lat)
            self._links[src.strip(), dst.strip()] = lat

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, prefix: str = "network") -> NetworkModel:
        """Build from the scenario's ``[network]`` table; errors name the key path."""
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            raise _fail(prefix, "a table", d)
        for key in d:
            if key not in _KEYS:
                raise _fail(
                    f"{prefix}.{key}",
                    f"one of the network keys{suggest(str(key), list(_KEYS))}: " + ", ".join(_KEYS),
                )
        kw: dict[str, Any] = {}
        if "latency" in d:
            kw["latency"] = Latency.from_dict(d["latency"], f"{prefix}.latency")
        if "links" in d:
            if not isinstance(d["links"], Mapping):
                raise _fail(f"{prefix}.links", 'a table of "src->dst" = latency', d["links"])
            kw["links"] = {}
            for key, val in d["links"].items():
                src, sep, dst = str(key).partition("->")
                if not sep or not src.strip() or not dst.strip():
                    raise _fail(f"{prefix}.links.{key}", 'a key "src->dst" (ids, roles or *)')
                kw["links"][key] = Latency.from_dict(val, f"{prefix}.links.{key}")
        if "bandwidth" in d and d["bandwidth"] is not None:
            kw["bandwidth"] = _number(d, "bandwidth", prefix, lo_open=True)
        for key, hi, hi_open in (
            ("loss", 1.0, True),
            ("availability", 1.0, False),
            ("churn", 1.0, True),
        ):
            if key in d:
                kw[key] = _number(d, key, prefix, hi=hi, hi_open=hi_open)
        if "churn_rounds" in d:
            kw["churn_rounds"] = _number(d, "churn_rounds", prefix, lo=1.0)
        if "compute_scale" in d:
            kw["compute_scale"] = Latency.from_dict(d["compute_scale"], f"{prefix}.compute_scale")
        if "trace" in d:
            if not isinstance(d["trace"], str):
                raise _fail(f"{prefix}.trace", "a path to a FedScale or FLGo trace", d["trace"])
            kw["trace"] = load_trace(d["trace"])
        model = d.get("availability_model", "bernoulli")
        if model not in AVAILABILITY_MODELS:
            raise _fail(
                f"{prefix}.availability_model", "one of " + ", ".join(AVAILABILITY_MODELS), model
            )
        if model == "trace" and (kw.get("trace") is None or not kw["trace"].has_availability):
            raise _fail(
                f"{prefix}.availability_model",
                '"trace" only with a network.trace that has availability (behaviour or FLGo)',
                model,
            )
        kw["availability_model"] = model
        if "diurnal" in d:
            kw["diurnal"] = Diurnal.from_dict(d["diurnal"], f"{prefix}.diurnal")
        if "flgo" in d:
            kw["flgo"] = FlgoModels.from_dict(d["flgo"], f"{prefix}.flgo")
        kw.update(_trace_timing(d, prefix, kw.get("trace") if model == "trace" else None))
        return cls(**kw)

    # ------------------------------------------------------------------ trace time

    def trace_time(self, now: float) -> float:
        """The FedScale trace's time at simulated time ``now``."""
        return self.trace_start + self.trace_speed * now

    @property
    def checks_completion(self) -> bool:
        """Whether a client's message counts only if its windows hold when it arrives."""
        return (
            self.availability_model == "trace"
            and self.trace_rule == "completion"
            and self.trace is not None
            and self.trace.has_windows
        )

    def offline_at(self, agent_id: str, now: float) -> bool:
        """A client whose FedScale windows have it offline at simulated time ``now``."""
        own = self.trace.of(agent_id) if self.trace is not None else None
        return (
            own is not None
            and own.intervals is not None
            and not own.online_at(self.trace_time(now))
        )

    # ------------------------------------------------------------------ devices

    def device_scale(self, agent_id: str, rng: np.random.Generator) -> float:
        """One client's compute-time multiplier (slow devices > 1): its trace factor times a
        ``compute_scale`` draw from its own stream."""
        own = self.trace.of(agent_id) if self.trace is not None else None
        factor = own.compute_factor if own is not None and own.compute_factor is not None else 1.0
        return factor * self.compute_scale.sample(rng)

    def _bandwidth(self, agent_id: str) -> float | None:
        own = self.trace.of(agent_id) if self.trace is not None else None
        return own.bandwidth if own is not None and own.bandwidth is not None else self.bandwidth

    def link_bandwidth(self, src: str, dst: str) -> float | None:
        """Bytes per second of src -> dst: the slower end's (None: no bandwidth limit)."""
        if self.trace is None:
            return self.bandwidth
        known = [b for b in (self._bandwidth(src), self._bandwidth(dst)) if b is not None]
        return min(known) if known else None

    # ------------------------------------------------------------------ messages

    def link_latency(
        self, src: str, dst: str, src_role: str | None = None, dst_role: str | None = None
    ) -> Latency:
        """The latency distribution of the link src -> dst (most specific override wins)."""
        key = (src, dst, src_role, dst_role)
        lat = self._resolved.get(key)
        if lat is None:
            lat = self.latency
            if self._links:
                ranked = sorted(
                    ((-(a + b), -a), (s, d))
                    for s, a in _sides(src, src_role)
                    for d, b in _sides(dst, dst_role)
                )
                for _, cand in ranked:
                    if cand in self._links:
                        lat = self._links[cand]
                        break
            self._resolved[key] = lat
        return lat

    def transit_time(
        self,
        src: str,
        dst: str,
        nbytes: int,
        rng: np.random.Generator,
        *,
        src_role: str | None = None,
        dst_role: str | None = None,
    ) -> float | None:
        """Seconds until the message arrives, or None if it is lost."""
        lost = self.loss > 0.0 and rng.random() < self.loss
        t = self.link_latency(src, dst, src_role, dst_role).sample(rng)
        if lost:
            return None
        bandwidth = self.link_bandwidth(src, dst)
        if bandwidth is not None:
            t += nbytes / bandwidth
        return t

    def transit_times(
        self,
        src: str,
        dsts: Sequence[str],
        nbytes: int,
        rng: np.random.Generator,
        *,
        src_role: str | None = None,
        dst_roles: Sequence[str | None] | None = None,
    ) -> np.ndarray:
        """Vectorised ``transit_time`` for a broadcast; NaN marks a lost message.

        Draws: one loss uniform per destination, then latencies link by link in order of
        first appearance (one call per distinct link distribution).
        """
        n = len(dsts)
        lost = rng.random(n) < self.loss if self.loss > 0.0 else None
        roles = dst_roles if dst_roles is not None else [None] * n
        lats = [self.link_latency(src, d, src_role, r) for d, r in zip(dsts, roles, strict=True)]
        out = np.empty(n)
        first = lats[0] if n else None
        if all(lat is first for lat in lats):
            if n:
                out[:] = first.sample_many(rng, n)
        else:
            groups: dict[int, tuple[Latency, list[int]]] = {}
            for i, lat in enumerate(lats):
                groups.setdefault(id(lat), (lat, []))[1].append(i)
            for lat, idx in groups.values():
                out[idx] = lat.sample_many(rng, len(idx))
        if self.trace is not None:
            bws = [self.link_bandwidth(src, d) for d in dsts]
            out += nbytes / np.array([math.inf if b is None else b for b in bws])
        elif self.bandwidth is not None:
            out += nbytes / self.bandwidth
        if lost is not None:
            out[lost] = np.nan
        return out

    # ------------------------------------------------------------------ presence

    def online(
        self,
        agent_ids: Iterable[str],
        round: int,
        rng: np.random.Generator,
        *,
        state: Presence | None = None,
        roles: Mapping[str, str] | None = None,
        now: float = 0.0,
    ) -> set[str]:
        """Who is online in ``round`` (call once per round). Servers are always online.

        Draws (ids sorted, servers excluded): one churn uniform per client not away, then one
        geometric away-length per churned client, then one availability uniform per client.
        ``state`` carries churn across rounds; the bus passes its own so one model can serve
        many runs (without it the model keeps a private state). ``now``: simulated seconds, for
        the diurnal and trace models. Diurnal: first one phase uniform per client not seen
        before (sorted), then its availability uniforms. Trace (Markov): a client's first step
        draws its start from the stationary distribution, every step one uniform.
        """
        state = self._own_presence if state is None else state
        always = self.availability_model == "bernoulli" and self.availability >= 1.0
        if always and self.churn == 0.0 and not state.away_until:
            return set(agent_ids)  # nobody can be away and nothing is drawn (~70 ms at 62,500)
        roles = roles or {}
        ids = sorted(set(agent_ids))
        servers = {a for a in ids if (roles[a] if a in roles else role_of(a)) == "server"}
        clients = [a for a in ids if a not in servers]
        away = state.away_until
        present = np.array([away.get(a, -1) <= round for a in clients], dtype=bool)
        if self.churn > 0.0 and present.any():
            idx = np.flatnonzero(present)
            leave = idx[rng.random(idx.size) < self.churn]
            if leave.size:
                k = rng.geometric(1.0 / self.churn_rounds, leave.size)
                for i, rounds in zip(leave.tolist(), k.tolist(), strict=True):
                    away[clients[i]] = round + rounds
                present[leave] = False
        if self.availability_model == "diurnal":
            present &= self._diurnal(clients, state, rng, now)
        elif self.availability_model == "trace":
            present &= self._traced(clients, state, rng, now)
            if self.availability < 1.0:
                present &= rng.random(len(clients)) < self.availability
        elif self.availability < 1.0:
            present &= rng.random(len(clients)) < self.availability
        return servers | {a for a, ok in zip(clients, present.tolist(), strict=True) if ok}

    def _diurnal(
        self, clients: list[str], state: Presence, rng: np.random.Generator, now: float
    ) -> np.ndarray:
        d = self.diurnal
        new = [a for a in clients if a not in state.phase]
        if new:
            for a, u in zip(new, rng.random(len(new)).tolist(), strict=True):
                state.phase[a] = d.spread * u
        phase = np.array([state.phase[a] for a in clients])
        p = self.availability * (1.0 + d.amplitude * np.sin(2 * np.pi * (now / d.day + phase)))
        return rng.random(len(clients)) < np.clip(p, 0.0, 1.0)

    def _traced(
        self, clients: list[str], state: Presence, rng: np.random.Generator, now: float
    ) -> np.ndarray:
        out = np.ones(len(clients), dtype=bool)
        for i, a in enumerate(clients):
            own = self.trace.of(a)
            if own is None:
                continue
            if own.intervals is not None:
                out[i] = own.online_at(self.trace_time(now))
            elif own.p_on is not None:
                u = float(rng.random())
                if a not in state.up:  # start from the chain's stationary distribution
                    state.up[a] = u < own.p_on / (own.p_on + own.p_off)
                else:
                    state.up[a] = u >= own.p_off if state.up[a] else u < own.p_on
                out[i] = state.up[a]
        return out

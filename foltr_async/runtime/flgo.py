"""FLGo's system-heterogeneity models, by their FLGo names, as ``[network.flgo]`` keys.

FLGo (Wang et al. 2023, the ``flgo`` package) simulates system heterogeneity with named modes
(``flgo/simulator/default_simulator.py`` and ``base.py`` of FLGo 0.4.4, whose formulas these
follow, each function named below): availability (who is idle and may be selected in a round),
connectivity (a selected client drops out), completeness (a client does only part of its local
steps) and responsiveness (time units until a client's reply arrives). FLGo draws from numpy's
global ``RandomState``; here every draw comes from the run's seeded tree (``rng("flgo", ...)``),
so the values follow FLGo's distributions and orders of draws, not its exact numbers.

Mapping to this simulator: a FLGo client's data are its queries' labelled documents (one
query-document row is one of FLGo's samples, its relevance grade the sample's label, the held-out
set's grades the server's test labels); FLGo's ``num_steps`` is the client's B interactions per
round; a FLGo round is a round (asynchronous runs: a reporting period) and ``time_unit`` simulated
seconds are one FLGo time unit. The server's ``federation.deadline`` plays FLGo's
``tolerance_for_latency``.

- availability: in every mode FLGo sets ``prob_unavailable = 1 - prob_available`` and steps an
  offline/idle chain once per round (``BasicSimulator.flush`` with
  ``roundwise_fixed_availability``), so a client is idle with probability ``prob_available``
  whatever its state before: one independent draw per client and round, ``u <= p``.
- connectivity: each selected client draws once per dispatch (``with_dropout``); a dropped
  client's reply is lost (FLGo does not even send it the model; here its users are served but
  the update never arrives), and a synchronous round then waits its deadline, as FLGo waits its
  tolerance.
- responsiveness: a client's latency (time units) is drawn once per client, as FLGo's modes do,
  and added to every reply's arrival on top of the network's transit and the protocol's compute
  time (set those to 0 for FLGo's latency alone). A synchronous round drops what is still on its
  way at the deadline (``with_clock``: ``conditionally_clear`` of overdue packages).
- completeness: the working amount replaces B for one training; the update then counts the
  interactions done (``with_completeness``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from foltr_async.errors import ScenarioError
from foltr_async.params import Field, check_table
from foltr_async.runtime.checkpoint import Checkpointed
from foltr_async.runtime.wire import Envelope

__all__ = ["FlgoClient", "FlgoModels", "FlgoSystem", "sln_factor", "yc_window"]

#: mode -> (FLGo 0.4.4 function, its parameters and their defaults)
AVAILABILITY: dict[str, tuple[str, dict[str, float]]] = {
    "IDL": ("ideal_client_availability", {}),
    "YMF": ("y_max_first_client_availability", {"beta": 0.1}),
    "MDF": ("more_data_first_client_availability", {"beta": 0.0001}),
    "LDF": ("less_data_first_client_availability", {"beta": 0.5}),
    "YFF": ("y_fewer_first_client_availability", {"beta": 0.2}),
    "HOMO": ("homogeneous_client_availability", {"beta": 0.2}),
    "LN": ("lognormal_client_availability", {"beta": 0.1}),
    "SLN": ("sin_lognormal_client_availability", {"beta": 0.1}),
    "YC": ("y_cycle_client_availability", {"beta": 0.5}),
}
CONNECTIVITY = {
    "IDL": ("ideal_client_connectivity", {}),
    "HOMO": ("homogeneous_client_connectivity", {"gamma": 0.05}),
    "UNI": ("uniform_client_connectivity", {"gamma": 0.5}),
}
#: FLGo's ADU / ASU set a number of local epochs over a client's dataset; an online client's
#: B interactions are not epochs of anything, so only the step-fraction modes are here.
COMPLETENESS = {
    "IDL": ("ideal_client_completeness", {}),
    "PDU": ("part_dynamic_uniform_client_completeness", {"p": 0.5}),
    "FSU": ("full_static_unifrom_client_completeness", {}),
}
RESPONSIVENESS = {
    "IDL": ("ideal_client_responsiveness", {}),
    "LN": ("lognormal_client_responsiveness", {"mean_latency": 100.0, "var_latency": 10.0}),
    "UNI": ("uniform_client_responsiveness", {"min_latency": 0, "max_latency": 1}),
}
MODELS = {
    "availability": AVAILABILITY,
    "connectivity": CONNECTIVITY,
    "completeness": COMPLETENESS,
    "responsiveness": RESPONSIVENESS,
}
#: FLGo's period of its time-varying availability modes (SLN, YC), in rounds
PERIOD = 24
_EPSILON = 0.000001  # FLGo's LN / SLN: sigma = -ln(1 - beta - epsilon)


def _unit(help: str, kind: type = float, **kw: Any) -> Field:
    return Field(kind, None, help, nullable=True, min=0.0, **kw)


FIELDS: dict[str, Field] = {
    "availability": Field(str, "IDL", "FLGo availability mode", choices=tuple(AVAILABILITY)),
    "availability_beta": _unit("beta of the availability mode (FLGo's default if unset)", max=1.0),
    "connectivity": Field(str, "IDL", "FLGo connectivity (drop) mode", choices=tuple(CONNECTIVITY)),
    "connectivity_gamma": _unit("gamma of the connectivity mode", max=1.0),
    "completeness": Field(str, "IDL", "FLGo completeness mode", choices=tuple(COMPLETENESS)),
    "completeness_p": _unit("p of PDU: share of trainings cut short", max=1.0),
    "responsiveness": Field(str, "IDL", "FLGo responsiveness mode", choices=tuple(RESPONSIVENESS)),
    "responsiveness_mean_latency": _unit("LN: mean latency (time units)"),
    "responsiveness_var_latency": _unit("LN: variance of the latency"),
    "responsiveness_min_latency": _unit("UNI: smallest latency (time units)", int),
    "responsiveness_max_latency": _unit("UNI: latency bound, exclusive (time units)", int),
    "time_unit": Field(float, 1.0, "simulated seconds per FLGo time unit", min=1e-9),
}


@dataclass(frozen=True)
class FlgoModels:
    """The four FLGo modes of a scenario and their parameters (FLGo's defaults filled in)."""

    availability: str = "IDL"
    connectivity: str = "IDL"
    completeness: str = "IDL"
    responsiveness: str = "IDL"
    params: Mapping[str, Mapping[str, float]] = None  # model -> parameter -> value
    time_unit: float = 1.0

    def __post_init__(self) -> None:
        if self.params is None:
            object.__setattr__(self, "params", {m: {} for m in MODELS})

    def param(self, model: str, name: str) -> float:
        return self.params[model][name]

    @property
    def modes(self) -> dict[str, str]:
        return {m: getattr(self, m) for m in MODELS}

    @classmethod
    def from_dict(cls, table: Any, prefix: str = "network.flgo") -> FlgoModels:
        """Check ``[network.flgo]``: known keys (did-you-mean), FLGo's mode names, and only the
        parameters the chosen mode takes; errors name ``prefix`` and the key."""
        if isinstance(table, Mapping) and table.get("completeness") in ("ADU", "ASU"):
            raise ScenarioError(
                f"{prefix}: completeness: expected one of 'IDL', 'PDU', 'FSU', got "
                f"{table['completeness']!r} (FLGo's ADU and ASU draw local epochs, which B "
                "online interactions are not)"
            )
        t = check_table(table, FIELDS, prefix, "")
        params: dict[str, dict[str, float]] = {}
        for model, modes in MODELS.items():
            mode = t[model]
            takes = modes[mode][1]
            for key in FIELDS:
                name = key.removeprefix(model + "_")
                if key.startswith(model + "_") and t[key] is not None and name not in takes:
                    raise ScenarioError(
                        f"{prefix}: {key}: not a parameter of {model} {mode} (it takes "
                        + (", ".join(f"{model}_{k}" for k in takes) or "none")
                        + ")"
                    )
            params[model] = {
                k: (v if t[f"{model}_{k}"] is None else t[f"{model}_{k}"]) for k, v in takes.items()
            }
        beta = params["availability"].get("beta")
        if t["availability"] in ("LN", "SLN") and beta >= 1.0 - _EPSILON:
            raise ScenarioError(
                f"{prefix}: availability_beta: expected a number < {1.0 - _EPSILON} for "
                f"{t['availability']} (sigma = -ln(1 - beta - 1e-6)), got {beta}"
            )
        rsp = params["responsiveness"]
        if t["responsiveness"] == "LN" and rsp["mean_latency"] <= 0.0:
            raise ScenarioError(
                f"{prefix}: responsiveness_mean_latency: expected a number > 0, "
                f"got {rsp['mean_latency']}"
            )
        if t["responsiveness"] == "UNI" and rsp["min_latency"] >= rsp["max_latency"]:
            raise ScenarioError(
                f"{prefix}: responsiveness_max_latency: expected an integer > "
                f"responsiveness_min_latency ({rsp['min_latency']}; the bound is exclusive), "
                f"got {rsp['max_latency']}"
            )
        return cls(
            t["availability"],
            t["connectivity"],
            t["completeness"],
            t["responsiveness"],
            params,
            t["time_unit"],
        )


@dataclass(frozen=True)
class FlgoClient:
    """What FLGo's modes read of one client: its samples, their labels, its local steps."""

    id: str
    size: int  # labelled samples (FLGo's len(train_data)): the rows of the client's queries
    labels: frozenset[int]  # their labels (relevance grades)
    batch: int  # local steps per round (FLGo's num_steps): B interactions


def sln_factor(round: int) -> float:
    """FLGo's SLN time factor: ``0.4 sin(linspace(0, 2 pi, 24))[round % 24] + 0.5``."""
    times = np.linspace(start=0, stop=2 * np.pi, num=PERIOD)
    return float(0.4 * np.sin(times)[round % PERIOD] + 0.5)


def yc_window(round: int, lo: np.ndarray, hi: np.ndarray, max_label: int) -> np.ndarray:
    """FLGo's YC indicator: ``r = (1 + round % 24) / 24`` within [min_label / max_label,
    max_label_i / max_label] of each client."""
    r = 1.0 * (1 + round % PERIOD) / PERIOD
    return (r >= 1.0 * lo / max_label) & (r <= 1.0 * hi / max_label)


class FlgoSystem(Checkpointed):
    """One run's FLGo models: per-client draws made once (as FLGo's mode functions do at
    start-up), per-round availability, per-dispatch drops, delayed replies, working amounts,
    and how many replies each model cost.

    The population is every client of the run in id order; ``rng(*path)`` gives the run's
    named streams (``"flgo", model, ...``), so turning one model on shifts no other draw.
    """

    checkpoint_fields = ("counts", "_drop_rng", "_work_rngs", "_dropped")

    def __init__(
        self,
        models: FlgoModels,
        clients: Sequence[FlgoClient],
        test_labels: Iterable[int],
        rng: Callable[..., np.random.Generator],
    ) -> None:
        self.models = models
        self.ids = [c.id for c in clients]
        self._index = {c.id: i for i, c in enumerate(clients)}
        self._rng = rng
        self.counts: Counter[str] = Counter()
        self._dropped: dict[str, int] = {}  # client -> the dispatch tag its reply is lost for
        self._pending: dict[tuple[str, int], asyncio.TimerHandle] = {}
        self._work_rngs: dict[str, np.random.Generator] = {}
        labels = sorted(set(int(x) for x in test_labels))
        self._availability_base(clients, labels)
        self.prob_drop = self._connectivity(len(clients))
        self._drop_rng = rng("flgo", "connectivity")
        self.latency = self._responsiveness(len(clients))
        self.working_amount = self._completeness(clients)

    # ------------------------------------------------------------------ start-up draws

    def _availability_base(self, clients: Sequence[FlgoClient], test_labels: list[int]) -> None:
        """The per-client part of ``prob_available`` (FLGo's ``*_client_availability``)."""
        m = self.models
        mode = m.availability
        beta = m.params["availability"].get("beta", 0.0)
        n = len(clients)
        size = np.array([c.size for c in clients], dtype=np.float64)
        if mode == "IDL":
            base = np.ones(n)
        elif mode == "YMF":  # beta * min(labels of c) / max(1, label_num - 1) + (1 - beta)
            mins = np.array([min(c.labels) for c in clients], dtype=np.float64)
            base = beta * mins / max(1, len(test_labels) - 1) + (1 - beta)
        elif mode == "MDF":  # |D_i|^beta / max
            p = size**beta
            base = p / np.max(p)
        elif mode == "LDF":  # |D_i|^-beta / max
            p = size ** (-beta)
            base = p / np.max(p)
        elif mode == "YFF":  # beta * |set(Y_i)| / |set(Y)| + (1 - beta)
            base = np.array([beta * len(c.labels) / len(test_labels) + (1 - beta) for c in clients])
        elif mode == "HOMO":
            base = np.full(n, 1.0 - beta)
        elif mode in ("LN", "SLN"):  # T_k ~ lognormal(0, -ln(1 - beta - eps)), p = T_k / max
            tks = self._rng("flgo", "availability").lognormal(0, -np.log(1 - beta - _EPSILON), n)
            base = tks / np.max(tks)
        else:  # YC: each client's label range, read every round
            self._lo = np.array([min(c.labels) for c in clients])
            self._hi = np.array([max(c.labels) for c in clients])
            self._max_label = max(test_labels)
            base = np.ones(n)
        self.base = base

    def prob_available(self, round: int) -> np.ndarray:
        """Every client's ``prob_available`` in ``round`` (FLGo's round numbers, from 1)."""
        m = self.models
        if m.availability == "SLN":  # p(i, t) = fts[t % 24] * q_i
            return sln_factor(round) * self.base
        if m.availability == "YC":  # beta * ic + (1 - beta)
            beta = m.param("availability", "beta")
            ic = yc_window(round, self._lo, self._hi, self._max_label)
            return beta * ic.astype(np.float64) + (1 - beta)
        return self.base

    def _connectivity(self, n: int) -> np.ndarray:
        """``prob_drop`` per client: 0 (IDL), gamma (HOMO), or for UNI ``uniform(0, 1) if
        rand() < gamma else 0`` per client, the condition drawn first."""
        mode = self.models.connectivity
        if mode == "IDL":
            return np.zeros(n)
        gamma = self.models.param("connectivity", "gamma")
        if mode == "HOMO":
            return np.full(n, gamma)
        g = self._rng("flgo", "connectivity", "uni")
        return np.array([g.uniform(0, 1) if g.random() < gamma else 0.0 for _ in range(n)])

    def _responsiveness(self, n: int) -> np.ndarray:
        """Latency per client in time units: 0 (IDL); LN: ``int(lognormal(mu, sigma))`` with
        mu, sigma giving mean ``mean_latency`` and variance ``var_latency``; UNI:
        ``randint(min_latency, max_latency)`` (the upper bound excluded)."""
        mode = self.models.responsiveness
        if mode == "IDL":
            return np.zeros(n, dtype=np.int64)
        p = self.models.params["responsiveness"]
        g = self._rng("flgo", "responsiveness")
        if mode == "LN":
            mean, var = p["mean_latency"], p["var_latency"]
            mu = np.log(mean) - 0.5 * np.log(1 + var / mean / mean)
            sigma = np.sqrt(np.log(1 + var / mean / mean))
            return g.lognormal(mu, sigma, n).astype(np.int64)  # int() truncates: both >= 0
        return g.integers(p["min_latency"], p["max_latency"], n)

    def _completeness(self, clients: Sequence[FlgoClient]) -> np.ndarray | None:
        """FSU's static amounts ``max(1, int(num_steps * rand()))`` per client (else None)."""
        if self.models.completeness != "FSU":
            return None
        u = self._rng("flgo", "completeness").random(len(clients))
        return np.array([max(1, int(c.batch * x)) for c, x in zip(clients, u, strict=True)])

    # ------------------------------------------------------------------ the server's side

    def available(self, round: int, online: set[str]) -> set[str]:
        """``online`` without the clients FLGo's availability leaves offline in ``round``
        (one uniform per client of the population, in id order, from the round's stream)."""
        if self.models.availability == "IDL":
            return online
        p = self.prob_available(round)
        u = self._rng("flgo", "availability", round).random(len(self.ids))
        off = {a for a, ok in zip(self.ids, (u <= p).tolist(), strict=True) if not ok}
        taken = off & online
        self.counts["offline"] += len(taken)
        return online - taken

    def dispatched(self, clients: Sequence[str], tag: int) -> None:
        """Clients given the model (``tag``: the round or model version their reply carries):
        each drops out with its ``prob_drop`` (one uniform each, in order)."""
        if self.models.connectivity == "IDL" or not clients:
            return
        u = self._drop_rng.random(len(clients))
        for c, x in zip(clients, u.tolist(), strict=True):
            i = self._index.get(c)
            if i is not None and x < self.prob_drop[i]:
                self._dropped[c] = tag
            else:
                self._dropped.pop(c, None)

    def admit(self, env: Envelope, take: Callable[[Envelope], bool]) -> bool:
        """A reply reached the server: False when dropped (connectivity) or held back by the
        client's latency (``take(env)`` then runs when it arrives; False from it: too late)."""
        if self._dropped.get(env.src) == env.round:
            del self._dropped[env.src]
            self.counts["dropped"] += 1
            return False
        i = self._index.get(env.src)
        delay = 0.0 if i is None else float(self.latency[i]) * self.models.time_unit
        if delay <= 0.0:
            return True
        key = (env.src, env.round)
        self._pending[key] = asyncio.get_running_loop().call_later(
            delay, self._arrive, key, env, take
        )
        return False

    def _arrive(self, key: tuple[str, int], env: Envelope, take: Callable) -> None:
        self._pending.pop(key, None)
        if not take(env):
            self.counts["overdue"] += 1

    def close_round(self) -> None:
        """A synchronous round ended: replies still held back are overdue and dropped."""
        for handle in self._pending.values():
            handle.cancel()
            self.counts["overdue"] += 1
        self._pending.clear()

    # ------------------------------------------------------------------ the clients' side

    def work(self, agent_id: str, batch: int) -> int:
        """Interactions of this client's next training out of ``batch`` (FLGo's working
        amount). PDU (``part_dynamic_uniform_client_completeness``): with probability p
        ``max(1, randint(0, num_steps))``, else all, from the client's own stream; FSU: its
        static amount."""
        mode = self.models.completeness
        if mode == "IDL":
            return batch
        if mode == "FSU":
            n = (
                int(self.working_amount[self._index[agent_id]])
                if agent_id in self._index
                else batch
            )
        else:
            g = self._work_rngs.get(agent_id)
            if g is None:
                g = self._work_rngs[agent_id] = self._rng("flgo", "completeness", agent_id)
            p = self.models.param("completeness", "p")
            n = max(1, int(g.integers(0, batch))) if g.random() < p else batch
        n = min(n, batch)
        if n < batch:
            self.counts["incomplete"] += 1
            self.counts["skipped_interactions"] += batch - n
        return n

    def report(self) -> dict[str, Any]:
        """For results.json: the modes and parameters, and what each model cost."""
        keys = ("offline", "dropped", "overdue", "incomplete", "skipped_interactions")
        return {
            "modes": self.models.modes,
            "params": {k: dict(v) for k, v in self.models.params.items() if v},
            "time_unit": self.models.time_unit,
            **{k: int(self.counts[k]) for k in keys},
        }

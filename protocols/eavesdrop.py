"""Eavesdroppers: agents that tap links and measure what one client's messages leak.

An eavesdropper (``role = "eavesdropper"``, ids ``eve-N``) is no participant: it never sends, and
it learns only the exact bytes crossing the links it taps (``bus.tap``), decoded with the codec
like a real one. How much it learnt is scored against truths the clients leave in the run's
``Probe.oracle`` (the simulator's oracle, never a message), and the scores land in results.json
under ``eavesdrop`` (one entry per eavesdropper, per repeat).

FPDGD (taps ``fpdgd.model`` to the targets and ``fpdgd.update`` from them):

- *update recovery*: the estimate of a client's local direction is (its sent weights - the
  broadcast global model); the score is its cosine with the true local direction (the client's
  noiseless local update: trained weights, clipped under DP, before the DP noise). Without DP the
  message *is* the model, so the cosine is 1; DP noise is what lowers it. Updates of clients that
  saw no click (no local change) are counted apart.
- *query inference* (linear rankers), a guessing game: for each update the eavesdropper gets
  ``candidates`` training queries, the distinct queries the client issued that round plus random
  other training queries, and names the one it thinks was issued; top-1 accuracy is compared with
  chance (issued / candidates). Its score for a candidate q is the cosine between the update and
  the query's relevance direction g_q = mean(relevant documents) - mean(non-relevant documents)
  (where PDGD's pairwise steps move a linear ranker, in expectation). This adversary knows the
  candidate queries' documents and relevance labels: a strong, label-aware adversary, an
  upper-bound-style measurement; one that knows only the documents would do worse. (Centring the
  directions on the candidates' mean was tried and scored no better.)

FOLtR-ES (taps ``foltr_es.seed_metric`` from the targets): the guess of a client's true MaxRR
level is the level it sent (the MAP guess when p > 1/n); its hit rate is compared with the
randomised-response bound e^eps / (e^eps + n - 1) (= p, n = 11 levels). Only values that are one
privatised level are scored: a half of one interaction, or any half under ``privatise = "mean"``;
a mean of several privatised interactions is counted as ``averaged``. A Bayesian guess that
first estimates the level prior from the observed messages (inverting the randomised response,
p is public) is reported too: the local-DP bound is for a uniform prior, and real MaxRR levels are
far from uniform (no click is common), so a prior-aware adversary can beat it.

Each eavesdropper class names the protocol whose messages it taps (``protocol``); a module lists
it in its ``PROVIDES`` and ``load_plugins`` installs it in ``REGISTRY.eavesdroppers``
(``TapEavesdropper.install``); the ``eavesdropper`` behaviour speaks exactly those protocols
and builds the run's protocol's one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from foltr_async.config import AgentGroup, RunConfig
from foltr_async.errors import ScenarioError
from foltr_async.ltr.queryset import QuerySet
from foltr_async.params import param, parameters
from foltr_async.protocols import foltr_es, fpdgd
from foltr_async.registry import REGISTRY, BehaviourEntry, Registry
from foltr_async.runtime import heap
from foltr_async.runtime.agent import Agent, client_id
from foltr_async.runtime.wire import DropMessage, decode

__all__ = [
    "ESEavesdropper",
    "FPDGDEavesdropper",
    "TapEavesdropper",
    "bayes_guess_rate",
    "cosine",
    "query_directions",
    "query_scores",
]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity (nan when either vector is zero)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else math.nan


@heap.process_cache(maxsize=4)
def query_directions(train: QuerySet) -> np.ndarray:
    """Per query, mean(relevant documents) - mean(non-relevant documents) (zero when a query
    lacks either kind): the direction PDGD moves a linear ranker in, in expectation."""
    x = train.features.astype(np.float64)
    rel = (train.labels > 0).astype(np.float64)
    starts = train.qptr[:-1]
    n_rel = np.add.reduceat(rel, starts)
    n_all = np.diff(train.qptr).astype(np.float64)
    s_rel = np.add.reduceat(x * rel[:, None], starts)
    s_all = np.add.reduceat(x, starts)
    n_non = n_all - n_rel
    ok = (n_rel > 0) & (n_non > 0)
    g = np.zeros_like(s_rel)
    g[ok] = s_rel[ok] / n_rel[ok, None] - (s_all[ok] - s_rel[ok]) / n_non[ok, None]
    g.setflags(write=False)
    return g


def query_scores(update: np.ndarray, directions: np.ndarray) -> np.ndarray:
    """Cosine of an update with each candidate query's direction (-inf where undefined)."""
    norms = np.linalg.norm(directions, axis=1) * np.linalg.norm(update)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norms > 0, (directions @ update) / norms, -np.inf)


def bayes_guess_rate(confusion: np.ndarray, p: float) -> float:
    """Hit rate of the MAP guess under a level prior estimated from the sent levels alone.

    ``confusion[sent, true]`` counts messages. Randomised response keeps a level with
    probability p and otherwise sends one of the other n - 1 uniformly, so the sent
    distribution q = a * prior + b with a = p - (1 - p)/(n - 1), b = (1 - p)/(n - 1); the
    eavesdropper inverts that (clipped to a distribution) and guesses argmax prior(v) P(s | v).
    """
    total = confusion.sum()
    if total == 0:
        return math.nan
    n = len(confusion)
    other = (1.0 - p) / (n - 1)
    a = p - other
    sent = confusion.sum(axis=1) / total
    if abs(a) < 1e-12:  # p = 1/n: messages carry nothing, the prior is unobservable
        prior = np.full(n, 1.0 / n)
    else:
        prior = np.clip((sent - other) / a, 0.0, None)
        prior = prior / prior.sum() if prior.sum() > 0 else np.full(n, 1.0 / n)
    likelihood = np.full((n, n), other)  # [sent, true]
    np.fill_diagonal(likelihood, p)
    guess = np.argmax(likelihood * prior[None, :], axis=1)
    return float(confusion[np.arange(n), guess].sum() / total)


class TapEavesdropper(Agent, ABC):
    """Base of every eavesdropper: taps its links at once when started (the first broadcast may
    precede its task's first run), learns from each tapped message's exact bytes (undecodable
    ones are counted) and publishes its ``summary`` under ``eavesdrop`` when the run ends."""

    #: kind -> "src" | "dst": which end of the tapped link must be a target
    taps: ClassVar[dict[str, str]] = {}
    #: the protocol whose messages it taps (the class is then its eavesdropper, once installed)
    protocol: ClassVar[str | None] = None

    @classmethod
    def install(cls, registry: Registry) -> None:
        """Make ``cls`` the eavesdropper of its ``protocol`` (``load_plugins`` calls it)."""
        if cls.protocol is None:
            raise ValueError(f"{cls.__name__} names no protocol whose messages it taps")
        old = registry.eavesdroppers.get(cls.protocol)
        if old is not None and old is not cls:
            raise ValueError(f"protocol {cls.protocol!r} already has eavesdropper {old.__name__}")
        registry.eavesdroppers[cls.protocol] = cls

    @classmethod
    def for_group(cls, ctx, agent_id: str, targets: list[str] | None, group: dict, rng):
        """One eavesdropper of a scenario's agent group (a subclass may read more of it)."""
        return cls(agent_id, ctx, targets)

    def __init__(self, agent_id: str, ctx, targets: list[str] | None) -> None:
        super().__init__(agent_id, ctx.bus)
        self.ctx = ctx
        self.probe = ctx.probe
        self.probe.read_oracle()  # its scores compare guesses with the writers' truths
        self.targets = targets  # None: every link

    def start(self):
        self.bus.untap(self._on_tap)  # a rejoin must not tap twice
        for kind, end in self.taps.items():
            self.bus.tap(self._on_tap, kinds=kind, **{end: self.targets})
        return super().start()

    def _on_tap(self, data: bytes, header) -> None:
        if self.state != "joined":
            return
        try:
            self.observe(header, data)
        except DropMessage:
            self.counters["undecodable"] += 1

    @abstractmethod
    def observe(self, header, data: bytes) -> None:
        """Learn from one tapped message (its exact bytes)."""

    async def on_leave(self) -> None:
        """The run is ending (or this agent leaves): publish the scores."""
        self.probe.extras.setdefault("eavesdrop", {})[self.id] = self.summary()

    @abstractmethod
    def summary(self) -> dict:
        """The scores to publish in results.json."""

    def scope(self) -> dict:
        """What a client-link eavesdropper's summary starts with: the run's protocol and the
        clients whose links it tapped."""
        return {
            "protocol": self.ctx.config.federation.protocol,
            "targets": self.targets or "all",
        }


class FPDGDEavesdropper(TapEavesdropper):
    """Recovers tapped clients' local updates and infers which queries they trained on."""

    protocol = fpdgd.NAME
    taps = {fpdgd.MODEL: "dst", fpdgd.UPDATE: "src"}

    @classmethod
    def for_group(cls, ctx, agent_id, targets, group, rng):
        return cls(agent_id, ctx, targets, rng, group.params.candidates)

    def __init__(self, agent_id, ctx, targets, rng: np.random.Generator, candidates: int) -> None:
        super().__init__(agent_id, ctx, targets)
        self.rng = rng
        self.candidates = candidates
        self.train = ctx.data.train
        linear = ctx.config.ranker.kind == "linear"
        self.directions = query_directions(self.train) if linear else None
        if candidates > self.train.n_queries:
            raise ScenarioError(
                f"agents: eavesdropper candidates = {candidates} exceeds the "
                f"{self.train.n_queries} training queries"
            )
        self._global: dict[int, np.ndarray] = {}
        self.cos = np.zeros(3)  # count, sum, sum of squares
        self.zero_updates = 0
        self.missed = 0  # updates whose round's broadcast or truth was not seen
        self.hits = 0
        self.trials = 0
        self.chance = 0.0

    def observe(self, header, data: bytes) -> None:
        r = header.round
        if header.kind == fpdgd.MODEL:
            if r not in self._global:  # every target gets the same model: decode it once
                self._global = {r: decode(data).body["params"]}
            return
        start = self._global.get(r)
        truth = self.probe.oracle.get((fpdgd.UPDATE, header.src))
        if start is None or truth is None or truth[0] != r:
            self.missed += 1
            return
        estimate = decode(data).body["params"] - start
        _, true_update, issued, _ = truth
        if not true_update.any():
            self.zero_updates += 1
            return
        c = cosine(estimate, true_update)
        if math.isfinite(c):
            self.cos += (1.0, c, c * c)
        if self.directions is not None and issued:
            self._guess(estimate, issued)

    def _guess(self, estimate: np.ndarray, issued: list[int]) -> None:
        """One round of the query-inference game for this update."""
        used = np.unique(np.asarray(issued))[: self.candidates]
        draw = self.rng.choice(
            self.train.n_queries, size=self.candidates + len(used), replace=False
        )
        decoys = draw[~np.isin(draw, used)][: self.candidates - len(used)]
        cand = self.rng.permutation(np.concatenate([used, decoys]))
        best = cand[int(np.argmax(query_scores(estimate, self.directions[cand])))]
        self.hits += int(best in used)
        self.trials += 1
        self.chance += len(used) / self.candidates

    def summary(self) -> dict:
        n, s, ss = self.cos
        mean = s / n if n else None
        std = math.sqrt(max(ss / n - mean * mean, 0.0)) if n else None
        out = {
            **self.scope(),
            "dp": self.ctx.params.dp,
            "updates": int(n),
            "cosine_mean": mean,
            "cosine_std": std,
            "zero_updates": self.zero_updates,
            "missed": self.missed,
        }
        if self.directions is not None:
            out["query_inference"] = {
                "candidates": self.candidates,
                "trials": self.trials,
                "top1_accuracy": self.hits / self.trials if self.trials else None,
                "chance": self.chance / self.trials if self.trials else None,
                "adversary": "knows the candidates' documents and relevance labels",
            }
        return out


class ESEavesdropper(TapEavesdropper):
    """Guesses tapped clients' true MaxRR levels from their privatised messages."""

    protocol = foltr_es.NAME
    taps = {foltr_es.SEED_METRIC: "src"}

    def __init__(self, agent_id, ctx, targets) -> None:
        super().__init__(agent_id, ctx, targets)
        self.p = ctx.params.p
        self.discrete = ctx.params.metric == "maxrr"
        n = len(foltr_es.LEVELS)
        self.confusion = np.zeros((n, n), dtype=np.int64)  # [sent level, true level]
        self.missed = 0
        self.per_interaction = ctx.params.privatise == "interaction"
        self.antithetic = ctx.params.antithetic
        self.averaged = 0  # values that are means of several privatised interactions

    def observe(self, header, data: bytes) -> None:
        truth = self.probe.oracle.get((foltr_es.SEED_METRIC, header.src))
        if not self.discrete or truth is None or truth[0] != header.round:
            self.missed += 1
            return
        body = decode(data).body
        b = body["n_interactions"]
        sizes = (b - b // 2, b // 2) if self.antithetic else (b,)
        pairs = [
            (v, t, size)
            for v, t, size in zip(
                (body["metric"], body["antithetic_metric"]), truth[1:], sizes, strict=False
            )
            if v is not None
        ]
        single = [(v, t) for v, t, size in pairs if size == 1 or not self.per_interaction]
        self.averaged += len(pairs) - len(single)
        if not single:
            return
        sent = [v for v, _ in single]
        true = np.array([t for _, t in single], dtype=np.float64)
        levels = foltr_es.LEVELS
        s = np.argmin(np.abs(levels[None, :] - np.asarray(sent)[:, None]), axis=1)
        t = np.argmin(np.abs(levels[None, :] - true[:, None]), axis=1)
        np.add.at(self.confusion, (s, t), 1)

    def summary(self) -> dict:
        total = int(self.confusion.sum())
        n = len(self.confusion)
        eps = foltr_es.epsilon_bound(self.p)
        bound = 1.0 if math.isinf(eps) else math.exp(eps) / (math.exp(eps) + n - 1)
        return {
            **self.scope(),
            "p": self.p,
            "epsilon": None if math.isinf(eps) else eps,
            "metrics": total,
            "guess_rate": float(np.trace(self.confusion)) / total if total else None,
            "bound": bound,
            "bayes_guess_rate": bayes_guess_rate(self.confusion, self.p) if total else None,
            "true_level_share_zero": float(self.confusion[:, 0].sum()) / total if total else None,
            "averaged": self.averaged,
            "missed": self.missed,
        }


def check_targets(config: RunConfig, group: AgentGroup) -> None:
    """``targets``: "all" or a list of existing client ids."""
    value = group.params.targets
    if value == "all":
        return
    if isinstance(value, str) or not value or not all(isinstance(t, str) for t in value):
        raise ScenarioError(
            f'agents: eavesdropper targets: expected "all" or a non-empty list '
            f"of client ids, got {value!r}"
        )
    n = config.n_clients
    known = {client_id(i) for i in range(n)}
    unknown = [t for t in value if t not in known]
    if unknown:
        raise ScenarioError(
            f"agents: eavesdropper targets: no client {unknown[0]!r} "
            f"(ids are {client_id(0)} .. {client_id(n - 1)})"
        )


@parameters
class Params:
    targets: list | str = param([client_id(0)], 'client ids whose links are tapped, or "all"')
    candidates: int = param(10, "FPDGD query inference: candidate queries per guess", min=2)


def targets_of(group: AgentGroup) -> list[str] | None:
    """The tapped client ids (None: every link)."""
    value = group.params.targets
    return None if value == "all" else sorted(set(value))


def _build(ctx, proto, group, aid, queries, rng):
    targets = targets_of(group)
    cls = REGISTRY.eavesdroppers[ctx.config.federation.protocol]
    return cls.for_group(ctx, aid, targets, group, rng)


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    FPDGDEavesdropper,
    ESEavesdropper,
    BehaviourEntry(
        "eavesdropper",
        "eavesdropper",
        "taps client links: FPDGD update recovery and query inference, FOLtR-ES metric guessing",
        REGISTRY.eavesdroppers.keys(),  # a live view: a plugin's eavesdropper adds its protocol
        Params,
        _build,
        check=check_targets,
    ),
)

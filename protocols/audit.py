"""Privacy audits as agents: canaries with a secret bit, and auditors that guess it.

A ``canary`` (an attacker-role client; ids after the honest clients) sends, instead of what it
learnt, one of two worst-case inputs picked by a fair secret bit: a fresh bit every round
(``bits = "round"``: each round's release is one trial) or one bit for the whole run
(``bits = "run"``: the repeat is one trial, auditing the run's composition). Its bits stay in the
simulator's oracle. An ``auditor`` (an eavesdropper-role agent) sees what its threat model allows,
scores each release by the log-likelihood ratio of the two inputs under the noise the run claims,
and publishes its trials under ``audit``; ``foltr_async.observe.audit`` turns them into an
empirical lower bound on epsilon beside the accountant's claim.

FPDGD (distributed Gamma-difference noise; ``federation.params.dp = true``): the canary's two
inputs are the weights +v and -v, v on the clipping boundary where it moves the aggregate most in
L1 (L1 clipping: the bound on one coordinate, each canary its own; L2 clipping: the bound spread
evenly over every coordinate), the neighbouring pair the accountant's sensitivity is for.

- ``view = "aggregate"``: the attacker reads every round's published global model and knows every
  other client's noiseless weights and FedAvg weight (white-box: the worst case for the canary);
  it subtracts them, leaving the canary's input plus the round's summed noise. This is what the
  server learns under secure aggregation, and anyone who reads the model. Claim: the round's
  epsilon from the accountant (``privacy.rounds``), and the canary's run epsilon
  (``privacy.per_client``) for run bits.
- ``view = "link"``: the attacker reads the canary's own uplink (a link eavesdropper, or the
  server without secure aggregation): the canary's input plus its share of the noise only. The
  accountant claims nothing there without secure aggregation (its guarantee is the aggregate's),
  and epsilon 0 with it (a masked upload says nothing alone).

FOLtR-ES (randomised response over the 11 MaxRR levels; ``view = "link"``, local DP): the canary's
true level is the lowest or the highest by its bit, privatised by the protocol's own randomised
response, one release per antithetic half; the attacker reads the message. Claim: the epsilon per
privatised value (``privacy.epsilon``), and per run the canary's composed figure.

CS-F-LTR (one shared Laplace(1/epsilon) draw per term-frequency answer;
``federation.params.canary = true``): party 0 answers as a canary owner
(``protocols/csfltr/canary.py``: one more occurrence of the answer's canary term in its first
document, by a fresh bit per answer); the auditor reads its answers, knowing their counts without
the canary. ``view = "estimate"``: the canary term's estimate, the median over its rows (the
release the guarantee is stated for; claim: ``csfltr.params.epsilon``); ``view = "answer"``:
every entry (no claim: the noise is shared, so contrasting entries removes it).

Not covered: FedIPS (no DP mechanism there), CS-F-LTR's noisy collection statistics and reverse
top-K answers, what the selection of clients reveals, and FPDGD runs that lose messages (the
aggregate view assumes every client that trained in a round was aggregated: ``network.loss``
must be 0).
"""

from __future__ import annotations

import math
from abc import abstractmethod

import numpy as np

from foltr_async.config import AgentGroup, RunConfig
from foltr_async.errors import ScenarioError
from foltr_async.params import param, parameters
from foltr_async.protocols import csfltr, foltr_es, fpdgd
from foltr_async.protocols.canary_truth import CANARY_TRUTH, CanaryTruth
from foltr_async.protocols.csfltr.canary import BODY
from foltr_async.protocols.csfltr.messages import TF_ANSWER
from foltr_async.protocols.eavesdrop import TapEavesdropper
from foltr_async.protocols.foltr_es import ESClient
from foltr_async.protocols.fpdgd import FPDGDClient
from foltr_async.protocols.secagg.messages import MASKED
from foltr_async.protocols.secagg.primitives import from_ring
from foltr_async.protocols.secagg.settings import Settings
from foltr_async.registry import BehaviourEntry
from foltr_async.runtime.agent import client_id, handles
from foltr_async.runtime.wire import decode

CANARY = "canary"
AUDITOR = "auditor"
#: where a repeat's results hold a canary's run epsilon (``observe.audit`` reads it)
RUN_CLAIM = {
    "path": ["privacy", "per_client"],
    "accountants": ["basic", "rdp", "pld"],
    "delta": ["privacy", "delta"],
}


def canary_ids(config: RunConfig) -> list[str]:
    """The ids of the run's canaries: attackers are numbered after the honest clients in the
    order of their ``[[agents]]`` groups (as the simulation places them)."""
    out, i = [], config.federation.clients
    for g in config.agents:
        if g.role != "attacker":
            continue
        if g.behaviour == CANARY:
            out += [client_id(i + k) for k in range(g.count)]
        i += g.count
    return out


def worst_case(d: int, bound: float, order: int, index: int) -> np.ndarray:
    """The canary's +v: the clipping boundary's point farthest from -v in L1 (L1: all of the
    bound on one coordinate, ``index`` mod d; L2: spread evenly, bound / sqrt(d) each)."""
    v = np.zeros(d)
    if order == 1:
        v[index % d] = bound
    else:
        v[:] = bound / math.sqrt(d)
    return v


def laplace_llr(x: np.ndarray, v: np.ndarray, scale: float) -> float:
    """log p(x | +v) / p(x | -v) under Laplace(scale) noise per coordinate."""
    return float(np.sum(np.abs(x + v) - np.abs(x - v)) / scale)


def keep_secret(ctx, agent_id: str, rng: np.random.Generator, bits: str):
    """A canary's run bit (None: one per release) and its truth record, left in the oracle."""
    truth = CanaryTruth()
    ctx.probe.oracle[CANARY_TRUTH, agent_id] = truth
    return (int(rng.integers(2)) if bits == "run" else None), truth


def _draw(rng: np.random.Generator, run_bit: int | None) -> int:
    return run_bit if run_bit is not None else int(rng.integers(2))


class FPDGDCanary(FPDGDClient):
    """Sends +v or -v (by its secret bit) with its share of the round's noise; never trains."""

    unlearns = False

    def __init__(self, agent_id, ctx, queries, rng, *, bits: str, index: int) -> None:
        super().__init__(agent_id, ctx, queries, rng)
        p = ctx.params
        d = ctx.new_ranker().get_params().size
        self.vector = worst_case(d, p.clip_bound, p.clip_order, index)
        self.run_bit, self.truth = keep_secret(ctx, agent_id, rng, bits)

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        bit = _draw(self.rng, self.run_bit)
        self.truth.bits[round, 0] = bit
        self.truth.weight[round] = self.interactions
        return self.privatise((2 * bit - 1) * self.vector)


class ESCanary(ESClient):
    """Its true MaxRR is the lowest or the highest level (by its bit), once per antithetic half,
    privatised by the protocol's randomised response; serves no users."""

    def __init__(self, agent_id, ctx, queries, rng, *, bits: str, index: int) -> None:
        super().__init__(agent_id, ctx, queries, rng)
        self.run_bit, self.truth = keep_secret(ctx, agent_id, rng, bits)

    @handles(foltr_es.MODEL)
    async def on_model(self, env) -> None:
        seed = self._draw_seed()
        sent = []
        for slot in (0, 1):
            bit = _draw(self.rng, self.run_bit)
            self.truth.bits[env.round, slot] = bit
            level = foltr_es.LEVELS[-1] if bit else foltr_es.LEVELS[0]
            sent.append(foltr_es.privatise(float(level), self.p, self.rng))
        body = {"seed": seed, "metric": sent[0], "antithetic_metric": sent[1]}
        self.send(env.src, foltr_es.SEED_METRIC, {**body, "n_interactions": 2}, env.round)


class Auditor(TapEavesdropper):
    """Scores the canaries' releases it sees; publishes its trials under ``audit``."""

    mechanism = ""
    threat = ""

    def __init__(self, agent_id, ctx, view: str, bits: str, confidence: float) -> None:
        self.canaries = self.canary_ids(ctx)
        # the canaries' own links, or every link (the aggregate view reads the broadcasts)
        super().__init__(agent_id, ctx, None if view == "aggregate" else self.canaries)
        self.view, self.bits, self.confidence = view, bits, confidence
        self.trials: list[tuple[int, str, int, float]] = []  # round, canary, slot, score
        self.skipped: dict[str, int] = {}

    def canary_ids(self, ctx) -> list[str]:
        return canary_ids(ctx.config)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    @abstractmethod
    def round_claim(self) -> dict:
        """Where the repeat's results hold the epsilon claimed for one release of this view."""

    async def on_leave(self) -> None:
        truths = {c: self.probe.oracle[CANARY_TRUTH, c] for c in self.canaries}
        kept = [t for t in self.trials if (t[0], t[2]) in truths[t[1]].bits]
        self.probe.extras.setdefault("audit", {})[self.id] = {
            "mechanism": self.mechanism,
            "view": self.view,
            "threat": self.threat,
            "bits": self.bits,
            "trials": {
                "round": [t[0] for t in kept],
                "canary": [t[1] for t in kept],
                "bit": [truths[t[1]].bits[t[0], t[2]] for t in kept],
                "score": [t[3] for t in kept],
            },
            "skipped": self.skipped,
            "confidence": self.confidence,
            "claim": {"round": self.round_claim(), "run": RUN_CLAIM},
        }

    def summary(self) -> dict:  # published by on_leave under "audit", not "eavesdrop"
        return {}


class FPDGDAuditor(Auditor):
    """The aggregate view (the published model minus what the attacker knows) or the link view
    (the canaries' uplinks)."""

    protocol = fpdgd.NAME

    def __init__(self, agent_id, ctx, view: str, bits: str, confidence: float) -> None:
        super().__init__(agent_id, ctx, view, bits, confidence)
        p = ctx.params
        if view == "aggregate":
            self.taps = {fpdgd.MODEL: "dst"}
        else:  # the canaries' uploads: masked under secure aggregation
            self.taps = {
                MASKED if ctx.config.federation.secure_aggregation else fpdgd.UPDATE: "src"
            }
            self.precision = Settings.of(ctx.config.federation.secagg).precision_bits
        self.scale = p.sensitivity / p.epsilon  # the claimed Laplace scale per coordinate
        d = ctx.new_ranker().get_params().size
        self.vectors = {
            c: worst_case(d, p.clip_bound, p.clip_order, i) for i, c in enumerate(self.canaries)
        }
        norm = "L1" if p.clip_order == 1 else "L2"
        secure = (
            "secure aggregation"
            if ctx.config.federation.secure_aggregation
            else "no secure aggregation"
        )
        self.mechanism = f"FPDGD Gamma-difference noise, {norm} clipping, {secure}"
        self.threat = (
            "reads the published model, knows every other client's noiseless weights"
            if view == "aggregate"
            else "reads the canaries' uplink messages"
        )
        self.models: dict[int, np.ndarray] = {}

    def round_claim(self) -> dict:
        if self.view == "aggregate":
            return {
                "path": ["privacy", "rounds", "epsilon"],
                "index": ["privacy", "rounds", "round"],
            }
        return {"value": 0.0 if self.ctx.config.federation.secure_aggregation else None}

    def observe(self, header, data: bytes) -> None:
        r = header.round
        if header.kind == fpdgd.UPDATE:  # link view: a canary's own message
            self._link_trial(r, header.src, decode(data).body["params"])
            return
        if header.kind == MASKED:  # link view, secure aggregation: read as the plain upload
            truth = self.probe.oracle[CANARY_TRUTH, header.src]
            y = from_ring(decode(data).body["y"], self.precision)  # [w * params, w] if unmasked
            self._link_trial(r, header.src, y[:-1] / truth.weight.get(r, 1))
            return
        if r in self.models:  # every client gets the same model: read it once
            return
        self.models[r] = decode(data).body["params"]
        if r - 1 in self.models:
            self._aggregate_trials(r - 1, self.models[r - 1], self.models[r])

    def _link_trial(self, r: int, c: str, x: np.ndarray) -> None:
        self.trials.append((r, c, 0, laplace_llr(x, self.vectors[c], self.scale)))

    def _aggregate_trials(self, r: int, start: np.ndarray, published: np.ndarray) -> None:
        """Round r's trials: the canaries' inputs plus the summed noise, from the model
        published after round r minus every other client's (known) weights."""
        known = [
            (v[3], start + v[1])
            for k, v in self.probe.oracle.items()
            if k[0] == fpdgd.UPDATE and v[0] == r and k[1] not in self.vectors
        ]
        truths = {c: self.probe.oracle[CANARY_TRUTH, c] for c in self.canaries}
        took = [c for c in self.canaries if r in truths[c].weight]
        if not took:
            self.skip("no canary selected")
            return
        weights = [w for w, _ in known] + [truths[c].weight[r] for c in took]
        if len(set(weights)) != 1:  # the shares are summed unweighted only then
            self.skip("unequal weights")
            return
        w = weights[0]
        residual = sum(weights) * published - sum(w * theta for _, theta in known)
        x = residual / w
        for c in took:
            self.trials.append((r, c, 0, laplace_llr(x, self.vectors[c], self.scale)))


class ESAuditor(Auditor):
    """Reads the canaries' privatised metrics (local DP: each message is the release)."""

    protocol = foltr_es.NAME

    def __init__(self, agent_id, ctx, view: str, bits: str, confidence: float) -> None:
        super().__init__(agent_id, ctx, view, bits, confidence)
        self.taps = {foltr_es.SEED_METRIC: "src"}
        p = ctx.params.p
        n = len(foltr_es.LEVELS)
        # the log-likelihood ratio of a release at either extreme level (1: p = 1, certain)
        self.step = math.log(p * (n - 1) / (1 - p)) if 0 < p < 1 else 1.0
        self.mechanism = f"FOLtR-ES randomised response, p = {p:g}"
        self.threat = "reads the canaries' messages (the server)"

    def round_claim(self) -> dict:
        return {"path": ["privacy", "epsilon"]}

    def observe(self, header, data: bytes) -> None:
        body = decode(data).body
        top, bottom = float(foltr_es.LEVELS[-1]), float(foltr_es.LEVELS[0])
        for slot, key in enumerate(("metric", "antithetic_metric")):
            v = body[key]
            score = self.step if v == top else -self.step if v == bottom else 0.0
            self.trials.append((header.round, header.src, slot, score))


class SketchAuditor(Auditor):
    """CS-F-LTR: reads the canary owner's term-frequency answers on their way to the relay,
    knowing each answer's counts without the canary (white-box)."""

    protocol = csfltr.NAME

    def __init__(self, agent_id, ctx, view: str, bits: str, confidence: float) -> None:
        super().__init__(agent_id, ctx, view, bits, confidence)
        self.taps = {TF_ANSWER: "src"}
        self.eps = ctx.params.epsilon
        self.mechanism = f"CS-F-LTR sketch answers, Laplace(1/epsilon), epsilon = {self.eps:g}"
        self.threat = (
            "the querier's estimate of the canary term (median over its rows), counts known"
            if view == "estimate"
            else "the whole answer, every entry, counts known"
        )

    def canary_ids(self, ctx) -> list[str]:
        return [client_id(0)] if ctx.params.canary else []

    def round_claim(self) -> dict:
        if self.view == "estimate":
            return {"path": ["csfltr", "params", "epsilon"]}
        return {"value": None}  # the stated guarantee is the estimate's, not every entry's

    def observe(self, header, data: bytes) -> None:
        body = decode(data).body
        req = body["req"]
        truth = self.probe.oracle[CANARY_TRUTH, header.src]
        clean, shift = truth.answers.pop(req)
        residual = body["tf"].astype(np.float64) - clean  # bit * shift + the shared noise
        moved = shift != 0
        if self.view == "estimate":  # the canary term's estimate: the median over its rows
            rows = shift[BODY, 0, 0] != 0
            x = float(np.median(residual[BODY, 0, 0][rows] * shift[BODY, 0, 0][rows]))
            score = self.eps * (abs(x) - abs(x - 1.0)) if math.isfinite(self.eps) else x
        else:  # the noise is shared: the moved entries against the others show the bit
            score = float(np.mean(residual[moved] * shift[moved]) - np.mean(residual[~moved]))
        self.trials.append((req, header.src, 0, score))


@parameters
class CanaryParams:
    bits: str = param(
        "round",
        "a fresh secret bit every round (each release one trial) or one per run (each repeat "
        "one trial of the run's composition)",
        choices=("round", "run"),
    )


@parameters
class AuditorParams:
    view: str = param(
        "aggregate",
        "aggregate: the published model, others' weights known (the server under secure "
        "aggregation); link: the canaries' uplinks (FOLtR-ES: the only view); CS-F-LTR: "
        "estimate (the canary term's estimate) or answer (every entry of an answer)",
        choices=("aggregate", "link", "estimate", "answer"),
    )
    confidence: float = param(
        0.95, "confidence of the reported lower bound (Clopper-Pearson)", min=0.5, max=0.999999
    )


def _bits(config: RunConfig) -> set[str]:
    """The canaries' bit modes (one for the run's canaries: the auditor pools their trials)."""
    return {g.params.bits for g in config.agents if g.behaviour == CANARY}


def _canaries_bits(config: RunConfig) -> str:
    """The one bit mode the checked run's canaries share ("round" when it has none)."""
    return min(_bits(config), default="round")


def _check_canary(config: RunConfig, group: AgentGroup) -> None:
    """A mechanism to audit, in the form the protocol's canary sends its worst case through."""
    p = config.params
    if config.federation.protocol == foltr_es.NAME:
        if p.metric != "maxrr" or not p.antithetic:
            raise ScenarioError(
                "agents: canary: expected federation.params.metric = 'maxrr' and antithetic = "
                "true (the randomised response privatises MaxRR levels, one per half)"
            )
        return
    if not p.dp:
        raise ScenarioError(
            "agents: canary: expected federation.params.dp = true (an audit measures a "
            "privacy mechanism)"
        )
    if p.clip_order == 2 and len(canary_ids(config)) > 1:
        raise ScenarioError(
            "agents: canary count: expected 1 with L2 clipping (L2 canaries share the "
            "worst-case direction, so each would hide the others' bits)"
        )


def _check_auditor(config: RunConfig, group: AgentGroup) -> None:
    """The canaries it scores, a view its protocol has and the mechanism that view audits."""
    p, fed, view = config.params, config.federation, group.params.view
    if fed.protocol == csfltr.NAME:
        if view not in ("estimate", "answer"):
            raise ScenarioError(
                f"agents: auditor view: expected 'estimate' or 'answer' for csfltr, got {view!r}"
            )
        if not p.canary:
            raise ScenarioError(
                "agents: auditor: expected federation.params.canary = true (party 0 then "
                "answers as the canary owner)"
            )
        return
    if fed.protocol == foltr_es.NAME and view != "link":
        raise ScenarioError(
            "agents: auditor view: expected 'link' for foltr_es (local DP: each message "
            "is the release)"
        )
    if not canary_ids(config):
        raise ScenarioError("agents: auditor: expected a canary group in [[agents]]")
    if len(_bits(config)) > 1:
        raise ScenarioError("agents: canary bits: expected one mode for every canary group")
    if fed.protocol != fpdgd.NAME:
        return
    if not p.dp:
        raise ScenarioError("agents: auditor: expected federation.params.dp = true")
    if fed.aggregator != "fedavg":
        raise ScenarioError(
            f"federation.aggregator: the FPDGD audit expected 'fedavg' (the aggregate the "
            f"noise is sized for), got {fed.aggregator!r}"
        )
    if config.network.loss:
        raise ScenarioError(
            "network.loss: the FPDGD audit expected 0 (the aggregate view assumes every "
            "client that trained in a round was aggregated)"
        )


def _build_canary(ctx, proto, group, aid, queries, rng):
    cls = FPDGDCanary if ctx.config.federation.protocol == fpdgd.NAME else ESCanary
    index = canary_ids(ctx.config).index(aid)
    return cls(aid, ctx, queries, rng, bits=group.params.bits, index=index)


AUDITORS = {fpdgd.NAME: FPDGDAuditor, foltr_es.NAME: ESAuditor, csfltr.NAME: SketchAuditor}


def _build_auditor(ctx, proto, group, aid, queries, rng):
    cls = AUDITORS[ctx.config.federation.protocol]
    p = group.params
    return cls(aid, ctx, p.view, _canaries_bits(ctx.config), p.confidence)


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    BehaviourEntry(
        CANARY,
        "attacker",
        "privacy audit: sends one of two worst-case inputs by a secret bit",
        (fpdgd.NAME, foltr_es.NAME),
        CanaryParams,
        _build_canary,
        check=_check_canary,
    ),
    BehaviourEntry(
        AUDITOR,
        "eavesdropper",
        "privacy audit: guesses the canaries' bits (empirical epsilon lower bound)",
        tuple(AUDITORS),
        AuditorParams,
        _build_auditor,
        check=_check_auditor,
    ),
)

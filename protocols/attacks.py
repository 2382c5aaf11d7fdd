"""Attacker clients: they speak the honest protocol and change what they send.

- ``data_poison``: honest learning on clicks from the ``poison`` cascade model (click probability
  reversed, never stop) — untargeted data poisoning (Wang & Zuccon, ICTIR 2023).
- ``scaled_reversal``: M_mal = -z * M_local, the unlearning evaluation's attack (Wang, Liu &
  Zuccon, ECIR 2024): equivalently the update -z * Delta_local - (z + 1) * M_global.
- ``gradient_reversal``: every local PDGD step's gradient g becomes -2 gamma g + mu, gamma ~
  U(1, 2) and mu ~ N(mean(g), std(g)) per coordinate, drawn each step: the model poisoning of the
  unlearning-for-FOLTR reproducibility study (Tao et al., SIGIR 2025; its code's client).
- ``lie``: "A Little Is Enough" (Baruch, Baruch & Goldberg, NeurIPS 2019): every colluder sends
  mu - z * sigma per coordinate.
- ``fang``: local model poisoning (Fang, Cao, Jia & Gong, USENIX Security 2020), crafted against
  Krum / Multi-Krum (``target = "krum"``) or trimmed mean / median (``target = "trimmed_mean"``).

Updates are the clients' model vectors (FPDGD sends weights). An attacker only attacks while
``attacking`` is true: its group's ``attacking`` at the start, then switched by ``on_attack``
(the timeline's attack_start / attack_stop).

Collusion (``lie``, ``fang``): one ``[[agents]]`` group is one coalition; its members know each
other's ids (they are agreed before the run). On each model a colluder trains honestly, sends that
honest update to the other colluders (``attack.share``), waits in simulated time until it holds
the shares of every colluder (with ``knowledge = "full"``: of every colluder the server selected,
plus the updates of every selected honest client, seen by tapping the bus) or ``wait`` seconds
pass, then crafts from what it holds and replies to the server. Shares bypass the inbox (the model
handler is the one waiting for them). Crafting is deterministic given the shared knowledge, so
colluders that hold the same knowledge send the same update; only Fang's random sampling (and the
tiny offsets between Krum copies) use each attacker's own generator.
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from statistics import NormalDist

import numpy as np

from foltr_async.config import AgentGroup, RunConfig
from foltr_async.errors import ScenarioError
from foltr_async.params import param, parameters
from foltr_async.protocols.aggregation import krum
from foltr_async.protocols.fpdgd import MODEL, NAME, UPDATE, FPDGDClient
from foltr_async.registry import BehaviourEntry
from foltr_async.runtime import heap
from foltr_async.runtime.agent import client_id
from foltr_async.runtime.schema import Array, Kind
from foltr_async.runtime.wire import DropMessage, decode

SHARE = "attack.share"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (Kind(SHARE, {"params": Array("float64", ndim=1)}),)

#: Distance scale of the copies the other Fang-Krum colluders send around the crafted model.
KRUM_COPY_RADIUS = 1e-6


class AttackerClient(FPDGDClient):
    """An FPDGD client that attacks while ``attacking``, which the timeline switches."""

    def __init__(self, agent_id, ctx, queries, rng, *, attacking: bool) -> None:
        super().__init__(agent_id, ctx, queries, rng)
        self.attacking = attacking

    def on_attack(self, start: bool) -> None:
        self.attacking = start


class DataPoisonClient(AttackerClient):
    """Learns honestly, but from poisoned clicks (while attacking)."""

    def __init__(self, agent_id, ctx, queries, rng, *, attacking: bool) -> None:
        super().__init__(agent_id, ctx, queries, rng, attacking=attacking)
        self.honest_clicks = self.users.click_model
        self.poison_clicks = ctx.click_model("poison")

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        users = self.users
        users.click_model = self.poison_clicks if self.attacking else self.honest_clicks
        return await super().make_update(round, start)


class ScaledReversalClient(AttackerClient):
    """Trains honestly, then sends the reversed and scaled model -z * M_local."""

    def __init__(self, agent_id, ctx, queries, rng, *, attacking: bool, z: float) -> None:
        super().__init__(agent_id, ctx, queries, rng, attacking=attacking)
        self.z = z

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        local = await super().make_update(round, start)
        return -self.z * local if self.attacking else local


class GradientReversalClient(AttackerClient):
    """Trains with every step's gradient reversed, amplified and noised (while attacking)."""

    def __init__(self, agent_id, ctx, queries, rng, *, attacking: bool) -> None:
        super().__init__(agent_id, ctx, queries, rng, attacking=attacking)
        self.on_attack(attacking)

    def on_attack(self, start: bool) -> None:
        super().on_attack(start)
        self.learner.step_transform = reversed_gradient if start else None


def reversed_gradient(g: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """-2 gamma g + mu, gamma ~ U(1, 2), mu ~ N(mean(g), std(g)) per coordinate."""
    gamma = rng.uniform(1.0, 2.0)
    return -2.0 * gamma * g + rng.normal(g.mean(), g.std(), g.shape)


# --------------------------------------------------------------------------- crafting (pure)


def _spread(known: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-coordinate mean and standard deviation (unbiased when there are two or more rows,
    as ``torch.std`` in the LIE authors' code)."""
    return known.mean(axis=0), known.std(axis=0, ddof=1 if len(known) > 1 else 0)


def lie_z(n: int, m: int) -> float:
    """Baruch et al. 2019: s = floor(n/2 + 1) - m supporters are needed; z = Phi^-1((n - s)/n)."""
    s = math.floor(n / 2 + 1) - m
    if not 1 <= s < n:
        raise ValueError(f"LIE needs 0 < m < floor(n/2 + 1) (n = {n}, m = {m})")
    return NormalDist().inv_cdf((n - s) / n)


def lie_update(known: np.ndarray, n: int, m: int) -> np.ndarray:
    """The LIE update mu - z * sigma over the known benign updates (rows of ``known``)."""
    mu, sigma = _spread(np.asarray(known, dtype=np.float64))
    return mu - lie_z(n, m) * sigma


def benign_direction(known: np.ndarray, w_global: np.ndarray) -> np.ndarray:
    """Fang et al.'s s: the sign of where the global model would move without attack,
    estimated as the mean of the known benign models minus the current global model."""
    return np.sign(np.asarray(known).mean(axis=0) - w_global)


def fang_krum_lambda_max(known: np.ndarray, w_global: np.ndarray, c: int) -> float:
    """Fang et al.'s upper bound on lambda against Krum, with n = known benign + c crafted:
    min_i sum_{l in Gamma_i^{n-c-2}} D(w_l, w_i) / ((n - 2c - 1) sqrt(d))
    + max_i D(w_i, w_global) / sqrt(d) (Euclidean D over the known benign models)."""
    known = np.asarray(known, dtype=np.float64)
    k, d = known.shape
    n = k + c
    sq = np.einsum("ij,ij->i", known, known)
    dist = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2.0 * known @ known.T, 0.0))
    np.fill_diagonal(dist, np.inf)
    near = min(max(1, n - c - 2), k - 1)
    first = 0.0
    if near >= 1:
        first = float(np.partition(dist, near - 1, axis=1)[:, :near].sum(axis=1).min())
        first /= max(1, n - 2 * c - 1) * math.sqrt(d)
    return first + float(np.linalg.norm(known - w_global, axis=1).max()) / math.sqrt(d)


def fang_krum(
    known: np.ndarray, w_global: np.ndarray, c: int, m_defender: int, tol: float = 1e-5
) -> tuple[np.ndarray, float, bool]:
    """Fang et al. against Krum: w' = w_global - lambda * s with lambda halved from its upper
    bound until Krum, run on the known benign models plus c copies of w', selects w' (or lambda
    drops below ``tol``). Returns (w', lambda, selected)."""
    known = np.asarray(known, dtype=np.float64)
    s = benign_direction(known, w_global)
    lam = fang_krum_lambda_max(known, w_global, c)
    ones = np.ones(len(known) + c)
    while True:
        crafted = w_global - lam * s
        stack = np.vstack([known, np.broadcast_to(crafted, (c, crafted.size))])
        if np.array_equal(krum(stack, ones, m_defender), crafted):
            return crafted, lam, True
        if lam < tol:
            return crafted, lam, False
        lam /= 2.0


@heap.process_cache(maxsize=1)
def _fang_krum_of(known: bytes, shape: tuple, w_global: bytes, c: int, m_defender: int) -> tuple:
    """``fang_krum`` of float64 arrays given as bytes (hashable: the last search is kept)."""
    return fang_krum(np.frombuffer(known).reshape(shape), np.frombuffer(w_global), c, m_defender)


def coalition_fang_krum(
    known: np.ndarray, w_global: np.ndarray, c: int, m_defender: int
) -> tuple[np.ndarray, float, bool]:
    """``fang_krum``, searched once for a coalition: its colluders craft one after the other
    from the same knowledge and global model, so the search (which draws nothing) runs once a
    round, not once per colluder; each gets its own copy of the crafted model."""
    known = np.asarray(known, dtype=np.float64)
    w = np.asarray(w_global, dtype=np.float64)
    crafted, lam, selected = _fang_krum_of(known.tobytes(), known.shape, w.tobytes(), c, m_defender)
    return crafted.copy(), lam, selected


def fang_trimmed(
    known: np.ndarray,
    w_global: np.ndarray,
    rng: np.random.Generator,
    *,
    partial: bool,
    b: float = 2.0,
) -> np.ndarray:
    """Fang et al. against trimmed mean / median, one sample per coordinate j against s_j.

    Full knowledge (w_max, w_min over the known benign models): s_j = -1 samples in
    [w_max, b w_max] (or [w_max, w_max / b] when w_max <= 0); s_j = +1 in [w_min / b, w_min]
    (or [b w_min, w_min] when w_min <= 0). Partial knowledge (mu, sigma of the attackers' own
    models): [mu + 3 sigma, mu + 4 sigma] or [mu - 4 sigma, mu - 3 sigma]. Where s_j = 0 (no
    known movement) the coordinate keeps the benign mean.
    """
    known = np.asarray(known, dtype=np.float64)
    s = benign_direction(known, w_global)
    mu, sigma = _spread(known)
    if partial:
        lo = np.where(s < 0, mu + 3 * sigma, mu - 4 * sigma)
        hi = np.where(s < 0, mu + 4 * sigma, mu - 3 * sigma)
    else:
        w_max, w_min = known.max(axis=0), known.min(axis=0)
        lo = np.where(s < 0, w_max, np.where(w_min > 0, w_min / b, b * w_min))
        hi = np.where(s < 0, np.where(w_max > 0, b * w_max, w_max / b), w_min)
    out = lo + rng.random(mu.size) * (hi - lo)
    return np.where(s == 0, mu, out)


# --------------------------------------------------------------------------- colluding agents


class ColludingClient(AttackerClient, ABC):
    """A coalition member: trains honestly, shares, waits for the coalition, then crafts."""

    behaviour = "colluding"

    def __init__(
        self,
        agent_id,
        ctx,
        queries,
        rng,
        *,
        attacking: bool,
        coalition: list[str],
        knowledge: str,
        wait: float,
    ) -> None:
        super().__init__(agent_id, ctx, queries, rng, attacking=attacking)
        self.coalition = tuple(sorted(coalition))
        self.knowledge = knowledge
        self.wait = wait
        self.probe = ctx.probe
        self.n = ctx.config.n_clients  # federation size the attack is planned for
        self.m_defender = ctx.config.n_attackers  # the m the robust aggregator assumes
        self._shares: dict[int, dict[str, np.ndarray]] = {}
        self._benign: dict[int, dict[str, np.ndarray]] = {}  # full knowledge: tapped updates
        self._selected: dict[int, set[str]] = {}  # full knowledge: tapped broadcast targets
        self._changed = asyncio.Event()
        self.facts = {
            "behaviour": self.behaviour,
            "knowledge": knowledge,
            "rounds_attacked": 0,
            "waits_timed_out": 0,
            "known_updates": 0,
        }

    def start(self) -> asyncio.Task:
        # tap at once (not in on_join, which runs later in the agent's task): the first round's
        # broadcast may go out before this agent's task first runs
        if self.knowledge == "full":
            self.bus.untap(self._on_tap)  # a rejoin must not tap twice
            self.bus.tap(self._on_tap, kinds=(MODEL, UPDATE))
        return super().start()

    def _on_tap(self, data: bytes, header) -> None:
        """Full knowledge: who was asked this round, and the honest clients' updates."""
        if self.state != "joined" or not self.attacking:
            return
        if header.kind == MODEL:
            if header.round not in self._selected:  # a new round: forget the older ones
                self._forget_before(header.round)
            self._selected.setdefault(header.round, set()).add(header.dst)
            return
        if header.src in self.coalition:
            return
        try:
            env = decode(data)
        except DropMessage:
            return
        self._benign.setdefault(env.round, {})[env.src] = env.body["params"]
        self._changed.set()

    def deliver(self, env) -> None:
        """Shares go straight to the waiting model handler, not through the inbox."""
        if env.kind != SHARE or self.state != "joined":
            super().deliver(env)
            return
        self.counters["received"] += 1
        if env.src not in self.coalition or env.src == self.id:
            self.counters["share_ignored"] += 1
            return
        self._shares.setdefault(env.round, {})[env.src] = np.array(env.body["params"])
        self._changed.set()

    def _ready(self, round: int) -> bool:
        have = self._shares.get(round, {}).keys()
        if self.knowledge == "partial":
            return len(have) == len(self.coalition)
        asked = self._selected.get(round, set())
        benign = asked.difference(self.coalition)
        return (
            asked.intersection(self.coalition) <= have
            and benign <= self._benign.get(round, {}).keys()
        )

    def _forget_before(self, round: int) -> None:
        for table in (self._shares, self._benign, self._selected):
            for old in [r for r in table if r < round]:
                del table[old]

    async def _gather(self, round: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self.wait):
                while not self._ready(round):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            self.facts["waits_timed_out"] += 1

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        honest = await super().make_update(round, start)
        if not self.attacking:
            return honest
        self._forget_before(round)
        shares = self._shares.setdefault(round, {})
        shares[self.id] = honest
        others = [c for c in self.coalition if c != self.id]
        if others:
            self.broadcast(others, SHARE, {"params": honest}, round)
        await self._gather(round)
        own = np.stack([shares[c] for c in sorted(shares)])
        benign = self._benign.get(round, {})
        known = np.stack([benign[c] for c in sorted(benign)]) if benign else own
        self.facts["rounds_attacked"] += 1
        self.facts["known_updates"] += len(known)
        crafted = self.craft(start, known, full=bool(benign))
        self.probe.extras.setdefault("attacks", {})[self.id] = dict(self.facts)
        return crafted

    @abstractmethod
    def craft(self, start: np.ndarray, known: np.ndarray, *, full: bool) -> np.ndarray:
        """The malicious model from the round's global model and the known honest models
        (``full``: tapped from the bus; else the colluders' own honest models)."""


class LIEClient(ColludingClient):
    """Little Is Enough: mu - z * sigma over the colluders' own honest updates (partial
    knowledge) or over the honest updates tapped from the bus (full knowledge)."""

    behaviour = "lie"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.z = lie_z(self.n, len(self.coalition))
        self.facts["z"] = self.z

    def craft(self, start, known, *, full):
        return lie_update(known, self.n, len(self.coalition))


class FangClient(ColludingClient):
    """Fang et al.'s local model poisoning against Krum-type or trimmed-mean-type rules."""

    behaviour = "fang"

    def __init__(self, *args, target: str, b: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.target = target
        self.b = b
        self.facts.update(target=target, krum_selected=0, krum_lambda_sum=0.0)

    def craft(self, start, known, *, full):
        if self.target == "trimmed_mean":
            return fang_trimmed(known, start, self.rng, partial=not full, b=self.b)
        crafted, lam, selected = coalition_fang_krum(
            known, start, len(self.coalition), self.m_defender
        )
        self.facts["krum_selected"] += int(selected)
        self.facts["krum_lambda_sum"] += lam
        if self.id != self.coalition[0]:  # the others send copies a tiny distance away
            crafted = crafted + self.rng.uniform(-KRUM_COPY_RADIUS, KRUM_COPY_RADIUS, crafted.size)
        return crafted


# --------------------------------------------------------------------------- registration


def coalition_of(ctx, group: dict) -> list[str]:
    """The ids of one attacker group (the simulation numbers attackers after the honest clients,
    group by group, in scenario order)."""
    i = ctx.config.federation.clients
    for g in ctx.config.agents:
        if g.role != "attacker":
            continue
        if g is group:
            return [client_id(j) for j in range(i, i + g.count)]
        i += g.count
    raise ValueError("attacker group not found in the scenario's agents")


def _build_colluder(cls, ctx, group, aid, queries, rng, **extra):
    coalition = coalition_of(ctx, group)
    p = group.params
    return cls(
        aid,
        ctx,
        queries,
        rng,
        attacking=p.attacking,
        coalition=coalition,
        knowledge=p.knowledge,
        wait=p.wait,
        **extra,
    )


def _check_lie(config: RunConfig, group: AgentGroup) -> None:
    """The coalition is small enough for LIE's supporters to exist in this federation."""
    try:
        lie_z(config.n_clients, group.count)
    except ValueError as e:
        raise ScenarioError(f"agents: behaviour 'lie': {e}") from None


@parameters
class AttackParams:
    attacking: bool = param(True, "attack from the start (else wait for attack_start)")


@parameters
class ReversalParams(AttackParams):
    z: float = param(2.0, "reversal scale z", min=0.0)


@parameters
class CollusionParams(AttackParams):
    knowledge: str = param(
        "partial",
        "what the colluders know: their own honest updates "
        "(partial) or also every honest update, tapped from the bus (full)",
        choices=("partial", "full"),
    )
    wait: float = param(
        10.0,
        "simulated seconds a colluder waits for the coalition's "
        "knowledge before crafting from what it has",
        min=0.0,
    )


@parameters
class FangParams(CollusionParams):
    target: str = param(
        "krum",
        "the rule attacked: krum (also Multi-Krum) or trimmed_mean (also median)",
        choices=("krum", "trimmed_mean"),
    )
    b: float = param(2.0, "Fang's b for the full-knowledge trimmed-mean ranges", min=1.0)


def _build_reversal(ctx, proto, group, aid, queries, rng):
    p = group.params
    return ScaledReversalClient(aid, ctx, queries, rng, attacking=p.attacking, z=p.z)


def _build_fang(ctx, proto, group, aid, queries, rng):
    p = group.params
    return _build_colluder(FangClient, ctx, group, aid, queries, rng, target=p.target, b=p.b)


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    BehaviourEntry(
        "data_poison",
        "attacker",
        "learns from the poison click model",
        (NAME,),
        AttackParams,
        lambda ctx, proto, g, aid, q, rng: DataPoisonClient(
            aid, ctx, q, rng, attacking=g.params.attacking
        ),
    ),
    BehaviourEntry(
        "scaled_reversal",
        "attacker",
        "sends -z times its local model",
        (NAME,),
        ReversalParams,
        _build_reversal,
    ),
    BehaviourEntry(
        "gradient_reversal",
        "attacker",
        "trains with every step's gradient g as -2 gamma g + N(mean g, std g) (Tao et al. 2025)",
        (NAME,),
        AttackParams,
        lambda ctx, proto, g, aid, q, rng: GradientReversalClient(
            aid, ctx, q, rng, attacking=g.params.attacking
        ),
    ),
    BehaviourEntry(
        "lie",
        "attacker",
        "Little Is Enough: colluders send mu - z sigma (Baruch et al. 2019)",
        (NAME,),
        CollusionParams,
        lambda ctx, proto, g, aid, q, rng: _build_colluder(LIEClient, ctx, g, aid, q, rng),
        check=_check_lie,
    ),
    BehaviourEntry(
        "fang",
        "attacker",
        "Fang et al. 2020 local model poisoning against Krum or trimmed mean",
        (NAME,),
        FangParams,
        _build_fang,
    ),
)

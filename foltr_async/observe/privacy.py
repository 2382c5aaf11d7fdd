"""Privacy accounting of a run: epsilon per client and per run, over the rounds taken part in.

Basic composition adds the per-release epsilons; it is exact for one release and loose for
many. Beside it, two maintained accountants from Google's ``dp-accounting`` library (imported
only here, when a run has something to account): Renyi DP (Mironov, CSF 2017) and privacy loss
distributions (PLD: Koskela et al. AISTATS 2020; Doroshenko et al. PETS 2022), each read at the
scenario's delta. PLDs are built directly with ``privacy_loss_distribution`` and self-composed:
``PLDAccountant`` 0.6.0 composes a randomised-response event once whatever its count. The PLD
grid is 0.01 nats, pessimistic (the epsilon stays an upper bound).

Mechanisms:

- ``laplace(epsilon)``: Laplace noise of scale sensitivity / epsilon (FPDGD's round aggregate),
  add-or-remove-one neighbours. When clients take part in a fraction q < 1 of the rounds, the
  run bound also composes every round as a Poisson-sampled release with q (amplification by
  subsampling, Balle et al. NeurIPS 2018): basic composition of ``ln(1 + q (e^eps - 1))`` per round
  and a sampled PLD. It assumes whoever reads the models does not know who took part; the
  selection is a uniform sample of fixed size, which Poisson sampling approximates. RDP has no
  sampled Laplace in the library, so it is reported without amplification.
- ``randomised_response(p, k)``: keep the true one of k values with probability p, else send a
  uniform other one (FOLtR-ES): ``eps = ln(p (k - 1) / (1 - p))`` per release, replace-one
  neighbours. Local DP: the server knows who sent, so no amplification applies.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from foltr_async.errors import FoltrError

PLD_GRID = 0.01
#: Laplace releases above this epsilon get no PLD figure: the library's grid would need ~2 eps /
#: PLD_GRID points (a run with epsilon 1e12, i.e. clipping without noise, asked for 1.4 PiB)
#: and such a release protects nothing a figure could show. Basic composition and RDP remain.
PLD_MAX_EPSILON = 100.0
ACCOUNTANTS = ("basic", "rdp", "pld")


@dataclass(frozen=True)
class Mechanism:
    """One release of a client's data: its pure epsilon and how the accountants see it."""

    kind: str  # "laplace" | "randomised_response"
    epsilon: float
    k: int = 0  # randomised response: number of values
    p: float = 0.0  # randomised response: keep probability

    @property
    def sampled(self) -> bool:
        """Whether amplification by subsampling applies (central, not local, DP)."""
        return self.kind == "laplace"


def laplace(epsilon: float) -> Mechanism:
    return Mechanism("laplace", float(epsilon))


def rr_epsilon(p: float, k: int) -> float:
    """Local DP of k-ary randomised response keeping the truth with probability p."""
    if p >= 1.0 or p <= 0.0:
        return math.inf
    return abs(math.log(p * (k - 1) / (1.0 - p)))


def randomised_response(p: float, k: int) -> Mechanism:
    return Mechanism("randomised_response", rr_epsilon(p, k), k=k, p=float(p))


def _library():
    try:
        import dp_accounting
        from dp_accounting.pld import privacy_loss_distribution as pld
        from dp_accounting.privacy_accountant import NeighboringRelation
        from dp_accounting.rdp import RdpAccountant
    except ImportError:
        raise FoltrError(
            "privacy accounting needs dp-accounting: python -m pip install 'dp-accounting>=0.6'"
        ) from None
    return dp_accounting, pld, NeighboringRelation, RdpAccountant


@lru_cache(maxsize=4096)
def composed(mech: Mechanism, n: int, delta: float) -> dict[str, float | None]:
    """Epsilon of ``n`` releases by basic composition, RDP and PLD (None: not defined)."""
    if n == 0:
        return dict.fromkeys(ACCOUNTANTS, 0.0)
    if not math.isfinite(mech.epsilon):
        return dict.fromkeys(ACCOUNTANTS)
    dp, pld, Rel, Rdp = _library()
    out: dict[str, float | None] = {"basic": n * mech.epsilon}
    if mech.kind == "laplace":
        event, rel = dp.LaplaceDpEvent(1.0 / mech.epsilon), Rel.ADD_OR_REMOVE_ONE
        dist = None
        if mech.epsilon <= PLD_MAX_EPSILON:
            dist = pld.from_laplace_mechanism(
                1.0 / mech.epsilon, value_discretization_interval=PLD_GRID
            )
    else:
        if mech.p < 1.0 / mech.k:  # the library's parameterisation needs p >= 1/k
            return {**out, "rdp": None, "pld": None}
        q = mech.k * (1.0 - mech.p) / (mech.k - 1)  # uniform over all k with probability q
        event, rel = dp.RandomizedResponseDpEvent(q, mech.k), Rel.REPLACE_ONE
        dist = pld.from_randomized_response(
            q, mech.k, value_discretization_interval=PLD_GRID, neighboring_relation=rel
        )
    rdp = Rdp(neighboring_relation=rel)
    rdp.compose(event, n)
    out["rdp"] = float(rdp.get_epsilon(delta))
    out["pld"] = None if dist is None else float(dist.self_compose(n).get_epsilon_for_delta(delta))
    return out


@lru_cache(maxsize=256)
def sampled(mech: Mechanism, rounds: int, q: float, delta: float) -> dict[str, float | None]:
    """Every round a Poisson-sampled release with probability q: basic and PLD epsilon."""
    _, pld, _, _ = _library()
    eps = mech.epsilon
    # log(1 + q (e^eps - 1)), without overflow for large eps
    per_round = math.log1p(q * math.expm1(eps)) if eps < 700 else eps + math.log(q)
    if eps > PLD_MAX_EPSILON:
        return {"basic_sampled": rounds * per_round, "pld_sampled": None}
    dist = pld.from_laplace_mechanism(
        1.0 / eps, value_discretization_interval=PLD_GRID, sampling_prob=q
    )
    return {
        "basic_sampled": rounds * per_round,
        "pld_sampled": float(dist.self_compose(rounds).get_epsilon_for_delta(delta)),
    }


def account(
    mech: Mechanism,
    taken_part: Mapping[int, Sequence[str]],
    clients: Sequence[str],
    curve_rounds: Sequence[int],
    delta: float,
    releases_per_round: int = 1,
) -> dict:
    """Per client and per run epsilons, and the worst client's epsilon after each curve round.

    ``taken_part``: round -> clients whose release that round counts (e.g. whose update the
    server aggregated); ``clients``: every client of the run (zero rounds is zero epsilon).
    """
    played = sorted(taken_part)
    per_client = {c: 0 for c in clients}
    worst, worst_after = 0, []  # the worst client's rounds after each played round (one pass)
    for r in played:
        for c in taken_part[r]:
            per_client[c] = per_client.get(c, 0) + 1
            worst = max(worst, per_client[c])
        worst_after.append(worst)

    def eps(n_rounds: int) -> dict:
        return composed(mech, n_rounds * releases_per_round, delta)

    run = {"rounds": len(played), "max_client_rounds": worst, **eps(worst)}
    n_clients = len(per_client)
    q = sum(per_client.values()) / (len(played) * n_clients) if played and n_clients else 1.0
    amplified = mech.sampled and 0.0 < q < 1.0 and math.isfinite(mech.epsilon)
    if amplified:
        run["sampling_probability"] = q
        run.update(sampled(mech, len(played) * releases_per_round, q, delta))
    curve: dict[str, list] = {"rounds": list(curve_rounds)}
    for r in curve_rounds:
        so_far = bisect.bisect_right(played, r)  # played rounds up to r
        point = eps(worst_after[so_far - 1] if so_far else 0)
        if amplified:
            point = {**point, **sampled(mech, so_far * releases_per_round, q, delta)}
        for key, value in point.items():
            curve.setdefault(key, []).append(value)
    return {
        "mechanism": mech.kind,
        "epsilon_per_release": mech.epsilon if math.isfinite(mech.epsilon) else None,
        "releases_per_round": releases_per_round,
        "delta": delta,
        "per_client": {c: {"rounds": n, **eps(n)} for c, n in sorted(per_client.items())},
        "run": run,
        "curve": curve,
    }

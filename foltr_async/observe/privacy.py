"""Privacy accounting of a run: epsilon per client and per run, over the rounds taken part in.

Basic composition adds the per-release epsilons; it is exact for one release and loose for
many. Beside it, two maintained accountants from Google's ``dp-accounting`` library (imported
only here, when a run has something to account): Renyi DP (Mironov, CSF 2017) and privacy loss
distributions (PLD: Koskela et al. AISTATS 2020; Doroshenko et al. PETS 2022), each read at the
scenario's delta. PLDs are built directly with ``privacy_loss_distribution`` and self-composed:
``PLDAccountant`` 0.6.0 composes a randomised-response event once whatever its count. The PLD
grid is 0.01 nats, pessimistic (the epsilon stays an upper bound).

Mechanisms (sensitivity normalised to 1: ``epsilon`` = sensitivity / noise scale):

- ``laplace(epsilon)``: Laplace noise (FPDGD's round aggregate when every client the round's
  noise was split over reported). When clients take part in a fraction q < 1 of the rounds, the
  run also gets an *a priori* bound (keys ``a_priori_*``): every round composed as a sampled
  release with q (amplification by subsampling, Balle et al. NeurIPS 2018): basic composition of
  ``ln(1 + q (e^eps - 1))`` per round and a sampled PLD. It holds over the random selection, for
  a reader who does not learn who took part; the selection is a uniform sample of fixed size,
  which Poisson sampling approximates. RDP has no sampled Laplace in the library, so it is
  reported without amplification. The other figures are *realised* (a posteriori): each client
  is charged for the rounds it did take part in, whoever knows it.
- ``gamma_difference(epsilon, shape)``: gamma - gamma' with both Gamma(shape, 1 / epsilon), the
  noise of a FPDGD aggregate holding only ``shape`` = k' / k of the k shares the round's noise
  was split over (shape 1 is Laplace). Below shape 1 it is not Laplace: no pure DP at shape <= 1/2
  (its density is unbounded at 0), and its PLD is built from the noise's distribution on a grid
  (``gamma_difference_pmf``, then ``from_two_probability_mass_functions``). RDP: not defined.
- ``randomised_response(p, k)``: keep the true one of k values with probability p, else send a
  uniform other one (FOLtR-ES): ``eps = ln(p (k - 1) / (1 - p))`` per release, replace-one
  neighbours. Local DP: the server knows who sent, so no amplification applies.

The run's figures (``run``, ``curve``) are, per accountant, the largest over clients: the bound
that holds for every client of the run.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from foltr_async.errors import FoltrError

PLD_GRID = 0.01
#: Laplace releases above this epsilon get no PLD figure: the library's grid would need ~2 eps /
#: PLD_GRID points (a run with epsilon 1e12, i.e. clipping without noise, asked for 1.4 PiB)
#: and such a release protects nothing a figure could show. Basic composition and RDP remain.
PLD_MAX_EPSILON = 100.0
ACCOUNTANTS = ("basic", "rdp", "pld")
#: what the figures of ``account`` guarantee (written beside them in results.json)
BOUNDS = {
    "realised": "basic, rdp, pld: a posteriori, each client charged for the rounds it took part "
    "in, whoever knows which; run and curve: the largest over the run's clients",
    "a_priori": "a_priori_*: before the run, over the random selection of who takes part "
    "(each round a release sampled with a_priori_sampling_probability), for a reader who "
    "does not learn who took part",
}
#: accounting composes Gamma-difference rounds with shapes rounded down to these steps
SHAPE_STEPS = 20
#: gamma_difference_pmf: bins per unit shift (and per noise scale, whichever is finer), and the
#: tail mass left out of the grid (counted as infinite privacy loss: it only adds to delta)
NOISE_BINS = 200
NOISE_TAIL = 1e-13


@dataclass(frozen=True)
class Mechanism:
    """One release of a client's data: its epsilon and how the accountants see it."""

    kind: str  # "laplace" | "gamma_difference" | "randomised_response"
    epsilon: float  # additive noise: sensitivity / scale; randomised response: its pure epsilon
    k: int = 0  # randomised response: number of values
    p: float = 0.0  # randomised response: keep probability
    shape: float = 1.0  # gamma_difference: the Gamma shape of each of the two summed parts

    @property
    def sampled(self) -> bool:
        """Whether amplification by subsampling applies (central, not local, DP)."""
        return self.kind == "laplace"

    @property
    def pure_epsilon(self) -> float:
        """The epsilon of epsilon-DP (delta 0): inf when the mechanism has none."""
        if self.kind == "gamma_difference":
            return gamma_difference_pure_epsilon(self.epsilon, self.shape)
        return self.epsilon


def laplace(epsilon: float) -> Mechanism:
    return Mechanism("laplace", float(epsilon))


def gamma_difference(epsilon: float, shape: float) -> Mechanism:
    """Noise gamma - gamma', both Gamma(shape, 1 / epsilon); Laplace(1 / epsilon) at shape 1."""
    if shape >= 1.0:
        return laplace(epsilon)
    return Mechanism("gamma_difference", float(epsilon), shape=float(shape))


def floor_shape(mech: Mechanism) -> Mechanism:
    """The mechanism with its shape rounded down to a multiple of 1 / SHAPE_STEPS: a bound on
    it (Gamma(a') - Gamma(a') is Gamma(a) - Gamma(a) plus independent noise for a' > a), so a
    run's rounds need only a few distinct mechanisms to compose."""
    if mech.kind != "gamma_difference":
        return mech
    return gamma_difference(
        mech.epsilon, max(1, math.floor(mech.shape * SHAPE_STEPS)) / SHAPE_STEPS
    )


def rr_epsilon(p: float, k: int) -> float:
    """Local DP of k-ary randomised response keeping the truth with probability p."""
    if p >= 1.0 or p <= 0.0:
        return math.inf
    return abs(math.log(p * (k - 1) / (1.0 - p)))


def randomised_response(p: float, k: int) -> Mechanism:
    return Mechanism("randomised_response", rr_epsilon(p, k), k=k, p=float(p))


def gamma_difference_logpdf(x: np.ndarray, shape: float, scale: float) -> np.ndarray:
    """Log density of gamma - gamma' (iid Gamma(shape, scale)): a symmetric variance-gamma,
    |x|^(a - 1/2) K_(a - 1/2)(|x| / s) / (sqrt(pi) Gamma(a) (2 s)^(a - 1/2) s); -inf-free away
    from 0 (at 0 it is +inf for shape <= 1/2)."""
    from scipy import special

    nu = shape - 0.5
    z = np.abs(x) / scale
    with np.errstate(divide="ignore"):
        return (
            nu * np.log(np.abs(x))
            + np.log(special.kve(nu, z))
            - z
            - 0.5 * math.log(math.pi)
            - special.gammaln(shape)
            - nu * math.log(2.0 * scale)
            - math.log(scale)
        )


@lru_cache(maxsize=256)
def gamma_difference_pmf(epsilon: float, shape: float) -> tuple[float, np.ndarray]:
    """The noise (scale 1 / epsilon) as masses of bins of width h, edges at multiples of h and 1
    a whole number of bins (the shift of the neighbouring output): (h, masses from -T to T)."""
    from scipy import special

    scale = 1.0 / epsilon
    h = min(1.0, scale) / NOISE_BINS
    h = 1.0 / math.ceil(1.0 / h)
    # tail: P(|N| > t) <= 2 P(Gamma(shape, s) > t) below NOISE_TAIL / 2, and one shift more so
    # that the neighbour's output (noise + 1) is on the same grid up to that tail
    t = special.gammainccinv(shape, NOISE_TAIL / 4.0) * scale + 1.0
    n = math.ceil(t / h)
    edges = np.arange(1, n + 1) * h  # bins [0, h], [h, 2h], ... on the positive side
    # every bin but [0, h] by 8-point Gauss-Legendre on the density (smooth away from 0)
    nodes, weights = np.polynomial.legendre.leggauss(8)
    left = edges[:-1]
    xs = left[:, None] + (nodes[None, :] + 1.0) * (h / 2.0)
    pdf = np.exp(gamma_difference_logpdf(xs, shape, scale))
    masses = (pdf * weights[None, :]).sum(axis=1) * (h / 2.0)
    # [0, h], where the density is unbounded for shape <= 1/2: the rest of the half's 1/2 (it
    # also takes the tail beyond the grid, at most NOISE_TAIL / 2)
    first = 0.5 - float(masses.sum())
    half = np.concatenate([[first], masses])
    masses = np.concatenate([half[::-1], half])
    masses.setflags(write=False)  # cached: shared by every caller
    return h, masses


@lru_cache(maxsize=256)
def gamma_difference_pure_epsilon(epsilon: float, shape: float) -> float:
    """sup_x ln f(x) / f(x - 1) of the noise's density f: inf for shape <= 1/2, where f is
    unbounded at 0; else on a fine grid around 0 and 1 (the loss tends to epsilon in the tails)."""
    if shape >= 1.0:
        return epsilon
    if shape <= 0.5:
        return math.inf
    scale = 1.0 / epsilon
    x = np.concatenate([np.linspace(-3.0, 4.0, 70001), -np.geomspace(1e-12, 1e-3, 200)])
    x = x[(x != 0.0) & (x != 1.0)]
    loss = gamma_difference_logpdf(x, shape, scale) - gamma_difference_logpdf(x - 1.0, shape, scale)
    return float(max(np.max(loss), epsilon))


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


@lru_cache(maxsize=64)
def _pld(mech: Mechanism):
    """The mechanism's privacy loss distribution (None: none the grid can hold)."""
    _, pld, Rel, _ = _library()
    if mech.kind == "randomised_response":
        q = mech.k * (1.0 - mech.p) / (mech.k - 1)  # uniform over all k with probability q
        return pld.from_randomized_response(
            q, mech.k, value_discretization_interval=PLD_GRID, neighboring_relation=Rel.REPLACE_ONE
        )
    if mech.epsilon > PLD_MAX_EPSILON:
        return None
    if mech.kind == "laplace":
        return pld.from_laplace_mechanism(
            1.0 / mech.epsilon, value_discretization_interval=PLD_GRID
        )
    h, masses = gamma_difference_pmf(mech.epsilon, mech.shape)
    shift = round(1.0 / h)
    with np.errstate(divide="ignore"):
        logs = np.log(masses).tolist()
    upper = dict(enumerate(logs))
    lower = {i + shift: v for i, v in enumerate(logs)}
    return pld.from_two_probability_mass_functions(
        lower, upper, value_discretization_interval=PLD_GRID
    )


def _defined(mech: Mechanism) -> bool:
    """Whether the library's RDP / PLD can take the mechanism at all."""
    if mech.kind == "randomised_response":
        return mech.p >= 1.0 / mech.k  # the library's parameterisation needs p >= 1/k
    return True


@lru_cache(maxsize=4096)
def composed_all(releases: tuple[tuple[Mechanism, int], ...], delta: float) -> dict:
    """Epsilon of the releases (mechanism, how many) by basic composition, RDP and PLD (None:
    not defined; basic is the sum of pure epsilons, None when one of them is infinite)."""
    releases = tuple((m, n) for m, n in releases if n > 0)
    if not releases:
        return dict.fromkeys(ACCOUNTANTS, 0.0)
    if not all(math.isfinite(m.epsilon) for m, _ in releases):
        return dict.fromkeys(ACCOUNTANTS)
    basic = sum(n * m.pure_epsilon for m, n in releases)
    out: dict[str, float | None] = {"basic": basic if math.isfinite(basic) else None}
    if not all(_defined(m) for m, _ in releases):
        return {**out, "rdp": None, "pld": None}
    dp, _, Rel, Rdp = _library()
    kinds = {m.kind for m, _ in releases}
    out["rdp"] = None
    if kinds == {"laplace"} or kinds == {"randomised_response"}:
        rel = Rel.ADD_OR_REMOVE_ONE if kinds == {"laplace"} else Rel.REPLACE_ONE
        rdp = Rdp(neighboring_relation=rel)
        for m, n in releases:
            if m.kind == "laplace":
                rdp.compose(dp.LaplaceDpEvent(1.0 / m.epsilon), n)
            else:
                q = m.k * (1.0 - m.p) / (m.k - 1)
                rdp.compose(dp.RandomizedResponseDpEvent(q, m.k), n)
        out["rdp"] = float(rdp.get_epsilon(delta))
    total = None
    for m, n in releases:
        one = _pld(m)
        if one is None:
            total = None
            break
        part = one.self_compose(n)
        total = part if total is None else total.compose(part)
    out["pld"] = None if total is None else float(total.get_epsilon_for_delta(delta))
    return out


def composed(mech: Mechanism, n: int, delta: float) -> dict[str, float | None]:
    """Epsilon of ``n`` releases of one mechanism by basic composition, RDP and PLD."""
    return composed_all(((mech, n),), delta)


@lru_cache(maxsize=256)
def delta_at(mech: Mechanism, epsilon: float) -> float:
    """The delta of one release at ``epsilon`` (0 when epsilon-DP holds): the round's
    guarantee stated at the nominal epsilon. For Gamma-difference noise the hockey-stick
    divergence sum (P(x) - e^eps P(x - shift))+ over the noise's bins (no PLD grid rounding)."""
    if mech.pure_epsilon <= epsilon:
        return 0.0
    if mech.kind != "gamma_difference":
        one = _pld(mech)
        return 1.0 if one is None else float(one.get_delta_for_epsilon(epsilon))
    h, masses = gamma_difference_pmf(mech.epsilon, mech.shape)
    shift = round(1.0 / h)
    lower = np.concatenate([np.zeros(shift), masses])  # the neighbour's output: noise + 1
    upper = np.concatenate([masses, np.zeros(shift)])
    return float(np.clip(upper - math.exp(epsilon) * lower, 0.0, None).sum())


@lru_cache(maxsize=256)
def sampled(mech: Mechanism, rounds: int, q: float, delta: float) -> dict[str, float | None]:
    """A priori: every round a Poisson-sampled release with probability q, basic and PLD."""
    _, pld, _, _ = _library()
    eps = mech.epsilon
    # log(1 + q (e^eps - 1)), without overflow for large eps
    per_round = math.log1p(q * math.expm1(eps)) if eps < 700 else eps + math.log(q)
    if eps > PLD_MAX_EPSILON:
        return {"a_priori_basic": rounds * per_round, "a_priori_pld": None}
    dist = pld.from_laplace_mechanism(
        1.0 / eps, value_discretization_interval=PLD_GRID, sampling_prob=q
    )
    return {
        "a_priori_basic": rounds * per_round,
        "a_priori_pld": float(dist.self_compose(rounds).get_epsilon_for_delta(delta)),
    }


def _front(keys: set[tuple]) -> set[tuple]:
    """The release histories no other one dominates, when the mechanisms are one additive
    noise of one epsilon ordered by shape (a smaller shape is weaker): history A dominates B if,
    for every shape, A holds at least as many releases at that shape or weaker. A dominated
    history's epsilon is at most the dominating one's, so only the front is composed."""
    mechs = sorted({m for k in keys for m, _ in k}, key=lambda m: m.shape)
    additive = all(m.kind in ("laplace", "gamma_difference") for m in mechs)
    if not mechs or not additive or len({m.epsilon for m in mechs}) != 1:
        return keys
    order = {m: i for i, m in enumerate(mechs)}
    listed = list(keys)
    counts = np.zeros((len(listed), len(mechs)))
    for row, k in enumerate(listed):
        for m, n in k:
            counts[row, order[m]] = n
    cum = np.cumsum(counts, axis=1)  # releases at each shape or weaker
    keep = set()
    for row in range(len(listed)):
        above = np.all(cum >= cum[row], axis=1) & np.any(cum > cum[row], axis=1)
        if not above.any():
            keep.add(listed[row])
    return keep


def _worst(figures: list[dict]) -> dict:
    """Per accountant the largest figure (None if it is undefined for any client)."""
    out: dict[str, float | None] = {}
    for key in ACCOUNTANTS:
        values = [f[key] for f in figures]
        out[key] = None if any(v is None for v in values) else max(values, default=0.0)
    return out


def account(
    mech: Mechanism | Mapping[int, Mechanism],
    taken_part: Mapping[int, Sequence[str]],
    clients: Sequence[str],
    curve_rounds: Sequence[int],
    delta: float,
    releases_per_round: int | Callable[[str], int] = 1,
) -> dict:
    """Per client and per run epsilons, and the run's (worst client's) epsilon after each curve
    round: realised figures, and a priori ones (``a_priori_*``) when sampling amplifies.

    ``mech``: the mechanism of every round, or round -> that round's mechanism;
    ``taken_part``: round -> clients whose release that round counts (e.g. whose update the
    server aggregated); ``clients``: every client of the run (zero rounds is zero epsilon);
    ``releases_per_round``: releases a client makes per round taken part in (or client -> it).
    """
    played = sorted(taken_part)
    if isinstance(mech, Mapping):
        per_round = {r: floor_shape(m) for r, m in mech.items()}
    else:
        per_round = dict.fromkeys(played, mech)
    times = releases_per_round if callable(releases_per_round) else lambda _: releases_per_round
    history: dict[str, Counter] = {c: Counter() for c in clients}

    def key(c: str) -> tuple:
        return tuple(sorted(((m, n * times(c)) for m, n in history[c].items()), key=repr))

    needed = {bisect.bisect_right(played, r) for r in curve_rounds}  # played rounds so far
    worst_after: dict[int, dict] = {0: dict.fromkeys(ACCOUNTANTS, 0.0)}  # the run's figures
    for i, r in enumerate(played, 1):
        for c in taken_part[r]:
            history.setdefault(c, Counter())[per_round[r]] += 1
        if i in needed:
            front = _front({key(c) for c in history})
            worst_after[i] = _worst([composed_all(k, delta) for k in front])
    final = {c: composed_all(key(c), delta) for c in sorted(history)}  # every client's own
    counts = {c: sum(h.values()) for c, h in history.items()}
    worst_rounds = max(counts.values(), default=0)
    run = {"rounds": len(played), "max_client_rounds": worst_rounds, **_worst(list(final.values()))}
    mechs = set(per_round[r] for r in played)
    q = sum(counts.values()) / (len(played) * len(counts)) if played and counts else 1.0
    single = next(iter(mechs)) if len(mechs) == 1 else None
    one = mech if isinstance(mech, Mechanism) else single
    uniform_times = len({times(c) for c in history}) == 1
    amplified = (
        one is not None
        and one.sampled
        and uniform_times
        and 0.0 < q < 1.0
        and math.isfinite(one.epsilon)
    )
    n_times = times(next(iter(history))) if history else 1
    if amplified:
        run["a_priori_sampling_probability"] = q
        run.update(sampled(one, len(played) * n_times, q, delta))
    curve: dict[str, list] = {"rounds": list(curve_rounds)}
    for r in curve_rounds:
        so_far = bisect.bisect_right(played, r)  # played rounds up to r
        point = worst_after[so_far]
        if amplified:
            point = {**point, **sampled(one, so_far * n_times, q, delta)}
        for k, value in point.items():
            curve.setdefault(k, []).append(value)
    return {
        "mechanism": one.kind if one is not None else "per round",
        "epsilon_per_release": one.epsilon if one and math.isfinite(one.epsilon) else None,
        "releases_per_round": n_times if uniform_times else "per client",
        "delta": delta,
        "bounds": BOUNDS if amplified else {"realised": BOUNDS["realised"]},
        "per_client": {c: {"rounds": counts[c], **final[c]} for c in sorted(history)},
        "run": run,
        "curve": curve,
    }

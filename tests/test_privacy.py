"""Privacy accounting: closed forms, the accountants against basic composition, runs' reports."""

import math

import numpy as np
import pytest
from scipy import stats

from foltr_async.experiment import conclusions
from foltr_async.observe.observer import Observer
from foltr_async.observe.plots import _worst_curve
from foltr_async.observe.privacy import (
    account,
    composed,
    delta_at,
    gamma_difference,
    gamma_difference_logpdf,
    gamma_difference_pmf,
    laplace,
    randomised_response,
    rr_epsilon,
    sampled,
)
from foltr_async.protocols import fpdgd
from foltr_async.protocols.foltr_es import SEED_METRIC
from foltr_async.runtime.clock import run
from foltr_async.runtime.wire import decode
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation


def test_randomised_response_epsilon_is_the_likelihood_ratio():
    # keep with p, else one of the k - 1 others uniformly: ratio p / ((1 - p) / (k - 1))
    assert rr_epsilon(0.9, 11) == pytest.approx(math.log(90.0))
    assert rr_epsilon(1.0, 11) == math.inf
    one = composed(randomised_response(0.9, 11), 1, 0.0)
    assert one["pld"] == pytest.approx(math.log(90.0), abs=0.02)  # pure DP: delta 0 gives eps


def test_basic_composition_adds_and_the_accountants_are_tighter_over_many_releases():
    mech = laplace(1.2)
    assert composed(mech, 7, 1e-5)["basic"] == pytest.approx(8.4)
    many = composed(mech, 200, 1e-5)
    assert many["pld"] < many["rdp"] < many["basic"] == pytest.approx(240.0)
    rr = composed(randomised_response(0.6, 11), 200, 1e-5)
    assert rr["pld"] < rr["basic"] and rr["rdp"] < rr["basic"]


def test_subsampling_amplifies_only_below_full_participation():
    mech = laplace(1.2)
    q = 0.3
    amp = sampled(mech, 50, q, 1e-5)
    assert amp["a_priori_basic"] == pytest.approx(50 * math.log(1 + q * (math.exp(1.2) - 1)))
    assert amp["a_priori_pld"] < composed(mech, 50, 1e-5)["pld"] / 2
    full = account(mech, {1: ["a", "b"], 2: ["a", "b"]}, ["a", "b"], [2], 1e-5)
    assert "a_priori_sampling_probability" not in full["run"]
    assert set(full["bounds"]) == {"realised"}


def test_each_client_is_charged_for_the_rounds_it_took_part_in():
    taken = {1: ["a"], 2: ["a", "b"], 3: ["a"], 4: ["b"]}
    rep = account(laplace(2.0), taken, ["a", "b", "c"], [2, 4], 1e-5)
    assert {c: v["rounds"] for c, v in rep["per_client"].items()} == {"a": 3, "b": 2, "c": 0}
    assert rep["per_client"]["a"]["basic"] == pytest.approx(6.0)
    assert rep["per_client"]["c"]["pld"] == 0.0
    assert rep["run"]["max_client_rounds"] == 3 and rep["run"]["basic"] == pytest.approx(6.0)
    assert rep["curve"]["basic"] == pytest.approx([4.0, 6.0])  # worst client after rounds 2, 4
    assert rep["run"]["a_priori_sampling_probability"] == pytest.approx(5 / 12)
    assert set(rep["bounds"]) == {"realised", "a_priori"}


def test_a_huge_epsilon_is_accounted_without_the_pld_grid():
    """epsilon 1e12 (clipping without noise) once asked the PLD library for 1.4 PiB after a
    run's training: basic and RDP are reported, PLD is None, at once."""
    huge = laplace(1e12)
    out = composed(huge, 1000, 1e-5)
    assert out["basic"] == pytest.approx(1e15) and out["pld"] is None and out["rdp"] > 1e11
    amp = sampled(huge, 1000, 0.25, 1e-5)
    assert amp["a_priori_pld"] is None
    assert amp["a_priori_basic"] == pytest.approx(1000 * (1e12 + math.log(0.25)))
    rep = account(huge, {1: ["a"], 2: ["a", "b"]}, ["a", "b"], [2], 1e-5)
    assert rep["run"]["pld"] is None and rep["run"]["a_priori_pld"] is None


SCENARIO = """
[scenario]
seed = 2
[dataset]
profile = "mq2007-like"
n_queries = 100
[federation]
protocol = "fpdgd"
clients = 4
rounds = 6
data = "shared"
[evaluation]
every = 3
max_test_queries = 20
[variants.dp]
federation = { participation = 0.5, params = { dp = true, epsilon = 2.3, sensitivity = 3.0 } }
[variants.es]
federation = { protocol = "foltr_es", params = { p = 0.9 } }
[variants.es_mean]
federation = { protocol = "foltr_es", params = { p = 0.9, privatise = "mean" } }
"""


@pytest.mark.parametrize("variant", ["dp", "es", "es_mean"])
def test_runs_report_epsilon_per_client_per_run_and_over_rounds(tmp_path, variant):
    path = tmp_path / "p.toml"
    path.write_text(SCENARIO)
    cfg = load_scenario(path).variants[variant]
    result = run(Simulation(cfg, 2, Observer()).run())
    privacy = result["privacy"]
    assert privacy["curve"]["rounds"] == result["rounds"] == [3, 6]
    # FOLtR-ES privatises each of its B = 4 interactions, or once per antithetic half;
    # FPDGD's L2 clipping: two clients' weights differ by up to sqrt(d) Delta in L1
    per_round = {"dp": 1, "es": 4, "es_mean": 2}[variant]
    eps = 2.3 * math.sqrt(46) if variant == "dp" else math.log(90.0)
    counts = [c["rounds"] for c in privacy["per_client"].values()]
    assert privacy["run"]["basic"] == pytest.approx(max(counts) * per_round * eps)
    assert privacy["curve"]["basic"][-1] == pytest.approx(privacy["run"]["basic"])
    if variant == "dp":  # half the online clients per round: amplification by subsampling
        assert privacy["nominal"]["run"]["basic"] == pytest.approx(max(counts) * 2.3)
        assert privacy["run"]["a_priori_sampling_probability"] == pytest.approx(0.5)
        # below what a client taking part in all 6 rounds would pay
        assert privacy["run"]["a_priori_pld"] < composed(laplace(eps), 6, 1e-5)["pld"]
    else:
        assert counts == [6, 6, 6, 6]


# --------------------------------------------------------------------------- FPDGD's noise, seen
# from outside: the weights each client sent (tapped off the bus) minus its pre-noise weights
# (the probe's oracle), summed over a round's clients.

FPDGD_DP = """
[scenario]
seed = 5
[dataset]
profile = "mq2007-like"
n_queries = 120
[federation]
protocol = "fpdgd"
clients = 20
queries_per_client = 2
rounds = {rounds}
data = "shared"
params = {{ dp = true, epsilon = 1.2, sensitivity = 3.0{params} }}
{federation}
[evaluation]
every = {rounds}
max_test_queries = 10
{network}
"""


def fpdgd_run(tmp_path, rounds=40, params="", federation="", network="", configure=None):
    """A small FPDGD + DP run: its result and, per round, every sent update's noise and each
    client's pre-noise weights and the shares the model message announced."""
    path = tmp_path / "dp.toml"
    path.write_text(
        FPDGD_DP.format(rounds=rounds, params=params, federation=federation, network=network)
    )
    sim = Simulation(load_scenario(path).variants["default"], 5, Observer())
    start, shares = {}, {}
    noise: dict[int, dict[str, np.ndarray]] = {}
    weights: dict[int, dict[str, np.ndarray]] = {}

    def on_model(data, header):
        sim.probe.read_oracle()  # this test reads the pre-noise updates (built with the run)
        body = decode(data).body
        start[header.round] = np.array(body["params"])
        shares.setdefault(header.round, body["shares"])

    def on_update(data, header):
        sent = decode(data).body["params"]
        _, update, _, _ = sim.probe.oracle[fpdgd.UPDATE, header.src]
        clean = start[header.round] + update  # the clipped local model before its noise
        weights.setdefault(header.round, {})[header.src] = clean
        noise.setdefault(header.round, {})[header.src] = sent - clean

    sim.bus.tap(on_model, kinds=fpdgd.MODEL)
    sim.bus.tap(on_update, kinds=fpdgd.UPDATE)
    return run(sim.run()), noise, weights, shares


def summed_noise(noise: dict, taken: dict | None = None) -> np.ndarray:
    """Per round the noise summed over the clients aggregated (all senders by default)."""
    return np.concatenate(
        [
            np.sum([v for c, v in per.items() if taken is None or c in taken[r]], axis=0)
            for r, per in sorted(noise.items())
        ]
    )


def test_the_aggregate_noise_is_laplace_when_a_tenth_of_the_clients_take_part(tmp_path):
    """Participation 0.1 (2 of 20 clients): each client's share was sized for all 20, so the
    aggregate carried gamma - gamma' with Gamma(0.1), std ~0.45 of Laplace's. Sized for the
    round's 2 clients, the sum is Laplace(Delta/epsilon) (KS over 40 rounds x 46 coordinates)."""
    result, noise, _, shares = fpdgd_run(tmp_path, federation="participation = 0.1")
    assert set(shares.values()) == {2}
    total = summed_noise(noise)
    scale = 3.0 / 1.2
    assert total.size == 40 * 46
    assert stats.kstest(total, stats.laplace(scale=scale).cdf).pvalue > 0.01
    assert np.std(total) == pytest.approx(math.sqrt(2) * scale, rel=0.1)
    rounds = result["privacy"]["rounds"]
    assert set(rounds["shares"]) == {2} and set(rounds["aggregated"]) == {2}


def test_full_participation_keeps_the_papers_draws(tmp_path, monkeypatch):
    """Every client in every round: the shares are |C| = 20, exactly the paper's Gamma(1/|C|),
    so the run equals one whose server announces nothing (clients then split over |C|)."""
    ours, noise, _, shares = fpdgd_run(tmp_path, rounds=10)
    assert set(shares.values()) == {20}
    total = summed_noise(noise)
    assert stats.kstest(total, stats.laplace(scale=2.5).cdf).pvalue > 0.01
    monkeypatch.setattr(
        fpdgd.FPDGDStrategy, "configure_for", lambda self, r, who: self.configure_round(r)
    )
    (tmp_path / "paper").mkdir()
    paper, paper_noise, _, _ = fpdgd_run(tmp_path / "paper", rounds=10)
    assert ours["offline"] == paper["offline"] and ours["online"] == paper["online"]
    for r, per in noise.items():
        for c, v in per.items():
            np.testing.assert_array_equal(v, paper_noise[r][c])


def gamma_difference_delta(epsilon: float, shape: float, at: float, n: int = 1_000_000) -> float:
    """Monte Carlo delta of gamma - gamma' (Gamma(shape, 1 / epsilon)) against the same shifted
    by 1, at ``at``: E[(1 - e^(at - L(X)))+] over numpy's Gamma draws X, L the privacy loss."""
    rng = np.random.default_rng(11)
    x = rng.gamma(shape, 1.0 / epsilon, n) - rng.gamma(shape, 1.0 / epsilon, n)
    scale = 1.0 / epsilon
    loss = gamma_difference_logpdf(x, shape, scale) - gamma_difference_logpdf(x - 1.0, shape, scale)
    return float(np.mean(np.clip(1.0 - np.exp(at - loss), 0.0, None)))


@pytest.mark.parametrize("shape", [0.1, 0.5, 0.8])
def test_delta_of_a_short_aggregate_matches_an_independent_computation(shape):
    """The noise's binned distribution against numpy's Gamma draws (CDF at every bin edge),
    and the delta at the nominal epsilon against a Monte Carlo estimate."""
    h, masses = gamma_difference_pmf(1.2, shape)
    draws = np.random.default_rng(7).gamma(shape, 1 / 1.2, (2, 400_000))
    x = np.sort(draws[0] - draws[1])
    edges = (np.arange(masses.size + 1) - masses.size // 2) * h
    cdf = np.concatenate([[0.0], np.cumsum(masses)])
    empirical = np.searchsorted(x, edges) / x.size
    assert np.max(np.abs(cdf - empirical)) < 3e-3  # KS distance, 400k draws
    ours = delta_at(gamma_difference(1.2, shape), 1.2)
    assert ours == pytest.approx(gamma_difference_delta(1.2, shape, 1.2), abs=3e-3)
    assert delta_at(gamma_difference(1.2, 1.0), 1.2) == 0.0  # Laplace: pure 1.2-DP


def test_a_round_missing_reports_states_its_weaker_guarantee(tmp_path):
    """A lost update leaves k' < k shares in the aggregate: that round's delta at the nominal
    epsilon is the Gamma(k'/k) noise's, not 0; the others' is 0 (L1 clipping: nominal exact)."""
    result, _, _, _ = fpdgd_run(
        tmp_path, rounds=12, params=', clip_norm = "l1"', network="[network]\nloss = 0.02"
    )
    rounds = result["privacy"]["rounds"]
    pairs = list(zip(rounds["shares"], rounds["aggregated"], strict=True))
    assert 0 < sum(a < k for k, a in pairs) < len(pairs)
    independent = {a / k: gamma_difference_delta(1.2, a / k, 1.2) for k, a in set(pairs) if a < k}
    for (k, a), delta in zip(pairs, rounds["delta_at_nominal_epsilon"], strict=True):
        if a == k:
            assert delta == 0.0
        else:
            assert delta == pytest.approx(independent[a / k], abs=3e-3) and delta > 0.0
    # the worst client's PLD epsilon is above the nominal Laplace composition's
    nominal = result["privacy"]["nominal"]["run"]
    assert result["privacy"]["run"]["pld"] > nominal["pld"]


def test_epsilon_under_l2_clipping_is_sqrt_d_times_the_nominal_and_l1_clipping_makes_it_exact(
    tmp_path,
):
    l2, _, w2, _ = fpdgd_run(tmp_path, rounds=6)
    (tmp_path / "l1").mkdir()
    l1, _, w1, _ = fpdgd_run(tmp_path / "l1", rounds=6, params=', clip_norm = "l1"')
    d = len(next(iter(next(iter(w2.values())).values())))
    # two vectors in the L2 ball of radius Delta/2 are up to sqrt(d) Delta apart in L1
    far = np.full(d, 1.5 / math.sqrt(d))
    assert np.abs(far - -far).sum() == pytest.approx(math.sqrt(d) * 3.0)
    assert l2["privacy"]["epsilon_mechanism"] == pytest.approx(math.sqrt(d) * 1.2)
    assert l2["privacy"]["nominal"]["epsilon_per_round"] == 1.2
    assert l1["privacy"]["epsilon_mechanism"] == pytest.approx(1.2)
    # what the clients sent, before noise: inside the clipping norm's ball of radius Delta / 2
    sent = [v for per in w1.values() for v in per.values()]
    assert max(np.abs(v).sum() for v in sent) <= 1.5 + 1e-9
    assert max(np.abs(v).sum() for v in sent) > 1.0  # clipping was active
    assert max(np.linalg.norm(v) for per in w2.values() for v in per.values()) <= 1.5 + 1e-9


def test_foltr_es_counts_every_release_the_server_received(tmp_path):
    """Rounds with fewer than min_clients replies keep the old model, but the clients' metrics
    were sent: local DP charges them (one release per privatised interaction: B = 4 a round)."""
    path = tmp_path / "es.toml"
    path.write_text(
        """
[scenario]
seed = 3
[dataset]
profile = "mq2007-like"
n_queries = 60
[federation]
protocol = "foltr_es"
clients = 3
min_clients = 3
rounds = 12
data = "shared"
params = { p = 0.9 }
[network]
availability = 0.7
[evaluation]
every = 12
max_test_queries = 10
"""
    )
    sim = Simulation(load_scenario(path).variants["default"], 3, Observer())
    sent: dict[str, int] = {}
    sim.bus.tap(lambda data, h: sent.__setitem__(h.src, sent.get(h.src, 0) + 1), kinds=SEED_METRIC)
    result = run(sim.run())
    assert result["contributions"]["empty_rounds"] > 0  # rounds that kept the old model
    per_client = result["privacy"]["per_client"]
    assert {c: v["rounds"] for c, v in per_client.items() if v["rounds"]} == sent
    worst = max(sent.values())
    assert result["privacy"]["run"]["basic"] == pytest.approx(4 * worst * math.log(90.0))


def test_the_worst_client_of_a_variant_is_the_worst_over_its_repeats():
    def repeat(basic: float) -> dict:
        run_ = {"basic": basic, "rdp": basic, "pld": basic}
        return {"privacy": {"delta": 1e-5, "run": run_}}

    results = {
        "variants": {
            "v": {
                "summary": {"final": {"ndcg@10": {"mean": 0.3}}},
                "repeats": [repeat(10.0), repeat(30.0)],
            }
        }
    }
    line = next(s for s in conclusions(results) if s.startswith("Privacy of v"))
    assert "over 2 repeat(s)" in line and "basic 30," in line and "basic 20" not in line
    curves = [{"rounds": [1, 2], "pld": [1.0, 5.0]}, {"rounds": [1, 2], "pld": [2.0, 3.0]}]
    assert _worst_curve(curves)["pld"] == [2.0, 5.0]


def test_an_infinite_privacy_loss_is_said_unbounded_not_undefined():
    from foltr_async.experiment import _privacy_sentence

    run = {"basic": None, "rdp": None, "pld": None}
    text = _privacy_sentence("p0", [{"run": run, "delta": 1e-5}])
    assert "realised epsilon basic unbounded" in text and "not defined" not in text
    huge = _privacy_sentence("eps1e308", [{"run": {**run, "pld": 3.0}, "delta": 1e-5}])
    assert "basic unbounded, pld 3" in huge

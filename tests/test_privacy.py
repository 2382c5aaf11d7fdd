"""Privacy accounting: closed forms, the accountants against basic composition, runs' reports."""

import math

import pytest

from foltr_async.observe.observer import Observer
from foltr_async.observe.privacy import (
    account,
    composed,
    laplace,
    randomised_response,
    rr_epsilon,
    sampled,
)
from foltr_async.runtime.clock import run
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
    assert amp["basic_sampled"] == pytest.approx(50 * math.log(1 + q * (math.exp(1.2) - 1)))
    assert amp["pld_sampled"] < composed(mech, 50, 1e-5)["pld"] / 2
    full = account(mech, {1: ["a", "b"], 2: ["a", "b"]}, ["a", "b"], [2], 1e-5)
    assert "sampling_probability" not in full["run"]


def test_each_client_is_charged_for_the_rounds_it_took_part_in():
    taken = {1: ["a"], 2: ["a", "b"], 3: ["a"], 4: ["b"]}
    rep = account(laplace(2.0), taken, ["a", "b", "c"], [2, 4], 1e-5)
    assert {c: v["rounds"] for c, v in rep["per_client"].items()} == {"a": 3, "b": 2, "c": 0}
    assert rep["per_client"]["a"]["basic"] == pytest.approx(6.0)
    assert rep["per_client"]["c"]["pld"] == 0.0
    assert rep["run"]["max_client_rounds"] == 3 and rep["run"]["basic"] == pytest.approx(6.0)
    assert rep["curve"]["basic"] == pytest.approx([4.0, 6.0])  # worst client after rounds 2, 4
    assert rep["run"]["sampling_probability"] == pytest.approx(5 / 12)


def test_a_huge_epsilon_is_accounted_without_the_pld_grid():
    """epsilon 1e12 (clipping without noise) once asked the PLD library for 1.4 PiB after a
    run's training: basic and RDP are reported, PLD is None, at once."""
    huge = laplace(1e12)
    out = composed(huge, 1000, 1e-5)
    assert out["basic"] == pytest.approx(1e15) and out["pld"] is None and out["rdp"] > 1e11
    amp = sampled(huge, 1000, 0.25, 1e-5)
    assert amp["pld_sampled"] is None
    assert amp["basic_sampled"] == pytest.approx(1000 * (1e12 + math.log(0.25)))
    rep = account(huge, {1: ["a"], 2: ["a", "b"]}, ["a", "b"], [2], 1e-5)
    assert rep["run"]["pld"] is None and rep["run"]["pld_sampled"] is None


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
    # FOLtR-ES privatises each of its B = 4 interactions, or once per antithetic half
    per_round = {"dp": 1, "es": 4, "es_mean": 2}[variant]
    eps = 2.3 if variant == "dp" else math.log(90.0)
    counts = [c["rounds"] for c in privacy["per_client"].values()]
    assert privacy["run"]["basic"] == pytest.approx(max(counts) * per_round * eps)
    assert privacy["curve"]["basic"][-1] == pytest.approx(privacy["run"]["basic"])
    if variant == "dp":  # half the online clients per round: amplification by subsampling
        assert privacy["run"]["sampling_probability"] == pytest.approx(0.5)
        # below what a client taking part in all 6 rounds would pay
        assert privacy["run"]["pld_sampled"] < composed(laplace(2.3), 6, 1e-5)["pld"]
    else:
        assert counts == [6, 6, 6, 6]

"""The seeds' comparisons at the shipped scenarios' default scale (one seed each)."""

from pathlib import Path

from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def final(cfg, seed=1):
    sim = Simulation(cfg, seed, Observer())
    result = run(sim.run())
    return result["offline"]["ndcg@10"][-1], sim.ctx.evaluate(sim.ctx.new_ranker())["ndcg@10"]


def test_fpdgd_beats_foltr_es_on_mslr_like_and_both_learn():
    sc = load_scenario(SCENARIOS / "fpdgd_vs_foltres.toml")
    fpdgd, zero = final(sc.variants["FPDGD"])
    es, _ = final(sc.variants["FOLtR-ES-p1.0"])
    assert es > zero + 0.05
    assert fpdgd > es + 0.05


def test_dp_hurts_with_10_clients_and_costs_little_with_100():
    sc = load_scenario(SCENARIOS / "fpdgd_clients.toml")
    c10, _ = final(sc.variants["C10"])
    c10_dp, _ = final(sc.variants["C10-dp"])
    c100, _ = final(sc.variants["C100"])
    c100_dp, _ = final(sc.variants["C100-dp"])
    assert c10_dp < c10 - 0.1
    assert abs(c100_dp - c100) < 0.05


def test_online_pdgd_on_the_same_budget_is_one_learner_stepping_at_every_interaction(mq2008_dir):
    """reproduce/fpdgd_vs_foltres.toml's PDGD-same-budget arm: FPDGD's budget taken by one
    learner that updates after every interaction (whether that beats FPDGD is the run's
    finding, not asserted here)."""
    path = Path(__file__).resolve().parents[1] / "reproduce" / "fpdgd_vs_foltres.toml"
    sets = [f"dataset.path={mq2008_dir / 'train.txt'}", "federation.rounds=3", "evaluation.every=1"]
    sc = load_scenario(path, sets)
    online = Simulation(sc.variants["PDGD-same-budget"], 1, Observer())
    result = run(online.run())
    zero = online.ctx.evaluate(online.ctx.new_ranker())["ndcg@10"]
    assert online.ctx.config.n_clients == 1
    assert result["online"]["interactions"] == 3 * 1000 * 4  # FPDGD's budget
    assert result["messages"]["kinds"]["fpdgd.update"]["delivered"] == 3  # one model a round
    assert result["offline"]["ndcg@10"][-1] > zero + 0.1

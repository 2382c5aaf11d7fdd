"""The headline question at small scale: does unlearning remove a poisoning client's damage?"""

from pathlib import Path

import numpy as np

from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

HEADLINE = Path(__file__).resolve().parents[1] / "scenarios" / "unlearn_attacker.toml"


def final(cfg, seed):
    result = run(Simulation(cfg, seed, Observer()).run())
    return result["offline"]["ndcg@10"][-1], result


def test_unlearning_beats_the_poisoned_federation_and_costs_less_than_retraining():
    sc = load_scenario(HEADLINE)  # the shipped defaults: 200 rounds, Delta_t = 10, n' = 2
    seeds = (1, 2, 3)
    scores = {v: [] for v in ("9H-0M", "9H-1M", "9H-1M-unlearned")}
    for seed in seeds:
        for name in scores:
            value, result = final(sc.variants[name], seed)
            scores[name].append(value)
            if name == "9H-1M-unlearned":
                cost = result["unlearning"]
                assert cost["clients"] == ["client-0009"]
                assert cost["calibration_rounds"] == 20  # T / Delta_t = 200 / 10
                assert cost["retrain_interactions"] == 200 * 9 * 5
                assert cost["calibration_interactions"] == 20 * 9 * 2
                assert cost["calibration_messages"] == 2 * 20 * 9  # the leaver never takes part
                assert result["rounds"][-1] == 220
    clean, poisoned, unlearned = (np.mean(scores[v]) for v in scores)
    assert poisoned < clean - 0.03, scores  # the attack hurts
    assert unlearned > poisoned + 0.02, scores  # unlearning recovers a clear part of it


def test_clients_store_updates_only_in_runs_that_can_unlearn():
    sc = load_scenario(HEADLINE, ["federation.rounds=20"])
    for name, stores in (("9H-1M", False), ("9H-1M-unlearned", True)):
        sim = Simulation(sc.variants[name], 1, Observer())
        run(sim.run())
        stored = [sorted(a.stored) for a in sim.agents.values() if hasattr(a, "stored")]
        assert len(stored) == 10
        assert stored[0] == ([10, 20] if stores else []), name

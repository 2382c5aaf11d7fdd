"""The headline question at small scale: does unlearning remove a poisoning client's damage?"""

from pathlib import Path

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.runtime.agent import client_id
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
                assert cost["strategy"] == "federaser"
                assert cost["rounds"] == 20  # T / Delta_t = 200 / 10
                assert cost["retrain_interactions"] == 200 * 9 * 5
                assert cost["interactions"] == 20 * 9 * 2
                assert cost["messages"] == 2 * 20 * 9  # the leaver never takes part
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


STRATEGIES = HEADLINE.with_name("unlearn_strategies.toml")


def test_each_strategy_forgets_three_poisoners_at_its_own_cost():
    sc = load_scenario(STRATEGIES, ["federation.rounds=40"])
    scores = {v: [] for v in sc.variants}
    costs = {}
    for seed in (1, 2, 3):
        for name, cfg in sc.variants.items():
            value, result = final(cfg, seed)
            scores[name].append(value)
            costs[name] = result.get("unlearning")
    mean = {v: np.mean(s) for v, s in scores.items()}
    clean, attacked = mean["7H-0M"], mean["7H-3M"]
    assert attacked < clean - 0.1, mean  # three poisoners hurt
    for name in ("retrain", "finetune", "federaser", "pga", "fedremove"):
        assert mean[f"7H-3M-{name}"] > attacked + 0.1, (name, mean)  # forgetting them recovers
    # retraining, fine-tuning and PGA's post-training play training's 40 rounds with the 7
    # remaining clients; PGA's leavers first ascend once per query they own
    for name in ("7H-3M-retrain", "7H-3M-finetune", "7H-3M-pga"):
        assert costs[name]["rounds"] == 40 and costs[name]["messages"] == 2 * 40 * 7
    for name in ("7H-3M-retrain", "7H-3M-finetune"):
        assert costs[name]["interactions"] == 40 * 7 * 5
    assert costs["7H-3M-pga"]["interactions"] > 40 * 7 * 5
    assert costs["7H-3M-federaser"]["rounds"] == 4  # one per stored round: 40 / Delta_t
    # FedRemove replays the 40 stored rounds on the server: no client works, nothing is sent
    fedremove = costs["7H-3M-fedremove"]
    assert fedremove["rounds"] == 40 and fedremove["interactions"] == fedremove["messages"] == 0
    # the model and 10 updates of 46 weights per round, 7 in the last (the leavers are gone)
    assert fedremove["storage_bytes_server"] == (39 * (1 + 10) + 1 + 7) * 46 * 8
    assert costs["7H-3M-original"]["rounds"] == costs["7H-3M-original"]["interactions"] == 0
    # simulated time: the server's replay and keeping the model take none; the phases that
    # ask clients take their rounds' time, FedEraser's 4 short rounds less than 40 full ones
    assert fedremove["sim_s"] == costs["7H-3M-original"]["sim_s"] == 0.0
    assert 0.0 < costs["7H-3M-federaser"]["sim_s"] < costs["7H-3M-retrain"]["sim_s"]
    leavers = ["client-0007", "client-0008", "client-0009"]
    assert all(c["clients"] == leavers for c in costs.values() if c)


class Events(Observer):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def event(self, event: str, **fields) -> None:
        self.seen.append(event)


def test_fedremoves_replay_rounds_are_the_servers_own_not_empty_rounds():
    sc = load_scenario(STRATEGIES, ["federation.rounds=12"])
    events = Events()
    result = run(Simulation(sc.variants["7H-3M-fedremove"], 1, events).run())
    c = result["contributions"]
    assert len(c["per_round"]) == 24 and c["server_rounds"] == 12  # training, then the replay
    assert c["empty_rounds"] == 0 and "round_empty" not in events.seen
    assert c["per_round"][:12] == [10] * 11 + [7] and c["per_round"][12:] == [0] * 12


def test_the_distance_to_retraining_tells_a_model_that_was_not_unlearned(tmp_path):
    from foltr_async.api import run as run_file

    res = run_file(STRATEGIES, ["federation.rounds=30", "scenario.repeats=3"], out=tmp_path)
    block = res.raw["unlearning"]
    assert block["7H-3M-retrain"]["l2_to_retrained"] is None  # the yardstick itself
    far, near = block["7H-3M-original"], block["7H-3M-finetune"]
    assert far["l2_to_retrained"]["n"] == 3
    assert far["cosine_to_retrained"]["mean"] > near["cosine_to_retrained"]["mean"]
    assert "## Unlearning" in (tmp_path / "summary.md").read_text()


def test_retraining_with_dp_is_refused_in_one_line():
    with pytest.raises(ScenarioError, match="'retrain' with dp = true is not supported"):
        load_scenario(
            STRATEGIES, ["federation.rounds=2", "federation.params.dp=true"], only=["7H-3M-retrain"]
        )


def test_retraining_is_the_federation_that_never_had_the_forgotten_clients():
    """Retraining reruns the remaining clients from their seeds: its model is, bit for bit,
    that of the same federation whose three poisoners left before the first round."""
    sc = load_scenario(STRATEGIES, ["federation.rounds=20"])
    retrained = Simulation(sc.variants["7H-3M-retrain"], 1, Observer())
    run(retrained.run())
    leave_at_once = 'timeline=[{round = 1, action = "leave", agents = ["attackers"]}]'
    never = load_scenario(STRATEGIES, ["federation.rounds=20", leave_at_once])
    without = Simulation(never.variants["7H-3M"], 1, Observer())
    result = run(without.run())
    assert result["rounds"][-1] == 20
    assert np.array_equal(retrained.proto.strategy.model, without.proto.strategy.model)


def test_the_relevance_reset_tells_a_model_that_kept_the_relabelling():
    """Three honest clients whose hardest queries were relabelled upside down ask to be
    forgotten: unlearning raises the loss on those labels; the original model keeps it."""
    forgotten = 'agents = ["client-0007", "client-0008", "client-0009"]'
    sc = load_scenario(
        STRATEGIES,
        [
            "federation.rounds=30",
            "federation.clients=10",
            "agents=[]",
            f'timeline=[{{round = -1, action = "unlearn", {forgotten}}}]',
            "federation.params.relevance_reset=true",
        ],
    )
    differences = {name: [] for name in ("original", "retrain", "finetune", "pga", "fedremove")}
    for seed in (1, 2):
        trained = set()
        for name, diffs in differences.items():
            _, result = final(sc.variants[f"7H-3M-{name}"], seed)
            reset = result["unlearning"]["relevance_reset"]
            diffs.append(reset["difference"])
            trained.add(reset["loss_trained"])
            assert "relevance_reset_loss" in result["offline"]  # its curve, every evaluation
        assert len(trained) == 1  # one training for every strategy
    assert differences["original"] == [0.0, 0.0]
    for name in ("retrain", "finetune", "pga", "fedremove"):
        assert np.mean(differences[name]) > 0.02, differences


def test_pga_and_fedremove_refuse_what_they_cannot_make_true():
    with pytest.raises(ScenarioError, match="'pga' needs a reference model"):
        load_scenario(
            STRATEGIES, ["federation.rounds=2", "federation.participation=0.5"], only=["7H-3M-pga"]
        )
    with pytest.raises(ScenarioError, match="relevance_reset: expected a timeline 'unlearn'"):
        load_scenario(
            STRATEGIES,
            ["federation.rounds=2", "federation.params.relevance_reset=true"],
            only=["7H-0M"],
        )


def as_code(name: str, rounds: int, *extra: str):
    """Variant 7H-3M-``name`` of the strategies scenario, its simulation and its results."""
    variant = f"7H-3M-{name}"
    sc = load_scenario(STRATEGIES, [f"federation.rounds={rounds}", *extra], only=[variant])
    sim = Simulation(sc.variants[variant], 1, Observer())
    return sim, run(sim.run())


LEAVERS = ("client-0007", "client-0008", "client-0009")


def test_finetune_as_code_takes_the_round_count_of_interactions_capped_by_the_partition():
    """The study's code passes its round count as the batch: each remaining client takes that
    many interactions a round, its whole partition (102 queries here) when smaller."""
    two = "federation.params.unlearn_rounds=2"
    _, plain = as_code("finetune", 20, two)
    sim, coded = as_code("finetune", 20, two, "federation.params.finetune_as_code=true")
    own = {len(sim.agents[client_id(i)].users.queries) for i in range(7)}
    assert own == {102}
    assert plain["unlearning"]["interactions"] == 2 * 7 * 5  # B = 5 a round
    assert coded["unlearning"]["interactions"] == 2 * 7 * 20  # 20 training rounds
    assert coded["unlearning"]["messages"] == plain["unlearning"]["messages"] == 2 * 2 * 7
    assert coded["unlearning"]["final_model"] != plain["unlearning"]["final_model"]
    _, capped = as_code("finetune", 110, two, "federation.params.finetune_as_code=true")
    assert capped["unlearning"]["interactions"] == 2 * 7 * 102  # the partition, not 110


def test_original_as_code_trains_every_client_on_the_forgotten_ones_included():
    _, plain = as_code("original", 20)
    _, coded = as_code("original", 20, "federation.params.original_as_code=true")
    cost = coded["unlearning"]
    assert plain["unlearning"]["interactions"] == 0
    # as many rounds again, all ten clients (the three forgotten rejoin), B = 5 each
    assert cost["rounds"] == 20 and cost["interactions"] == 20 * 10 * 5
    assert cost["messages"] == 2 * 20 * 10
    assert coded["rounds"][-1] == 40
    assert cost["final_model"] != plain["unlearning"]["final_model"]
    # the same training: the curves agree up to its last round
    n = len(plain["offline"]["ndcg@10"])
    assert coded["offline"]["ndcg@10"][:n] == plain["offline"]["ndcg@10"]


def test_pga_as_code_has_the_forgotten_clients_ascend_every_round_while_the_others_train():
    """pga_test: no reference model, no projection; every round of the budget each forgotten
    client takes B reversed steps on random queries of the whole training set."""
    _, plain = as_code("pga", 20)
    sim, coded = as_code("pga", 20, "federation.params.pga_as_code=true")
    cost = coded["unlearning"]
    assert "ascent_interactions" not in plain["unlearning"]
    assert cost["rounds"] == 20 and cost["messages"] == 2 * 20 * 10
    assert cost["ascent_interactions"] == 20 * 3 * 5  # rounds x forgotten clients x B
    assert cost["interactions"] == 20 * 10 * 5  # the ascents and the others' training
    assert all(sim.agents[a].reference is None for a in LEAVERS)  # no reference model
    assert sim.proto.strategy.ascended == {}  # nothing ascended at the request
    assert cost["final_model"] != plain["unlearning"]["final_model"]


def test_a_code_variant_of_another_strategy_is_refused_in_one_line():
    with pytest.raises(ScenarioError, match="pga_as_code: applies to unlearning = 'pga' only"):
        load_scenario(
            STRATEGIES,
            ["federation.rounds=2", "federation.params.pga_as_code=true"],
            only=["7H-3M-finetune"],
        )
    with pytest.raises(ScenarioError, match="original_as_code: with dp = true not supported"):
        load_scenario(
            STRATEGIES,
            [
                "federation.rounds=2",
                "federation.params.original_as_code=true",
                "federation.params.dp=true",
            ],
            only=["7H-3M-original"],
        )
    coded = "federation.params.federaser_as_code=true"
    with pytest.raises(ScenarioError, match="federaser_as_code: the study's code rebuilds"):
        load_scenario(
            STRATEGIES,
            ["federation.rounds=2", coded, "federation.participation=0.5"],
            only=["7H-3M-federaser"],
        )


def test_federaser_as_code_rebuilds_round_by_round_with_clients_in_a_chain(monkeypatch):
    """The study's FedEraser: U0 the initial model, U1 the remaining clients' mean of round 1;
    every later round the remaining clients train one after another from the previous one's
    model (Ut ends as the last one's), U(t+1) their mean, calibrated every fifth round; the
    result is the trained model plus lr x the sum of every U."""
    from foltr_async.protocols import fpdgd

    seen: dict = {"sent": {}, "got": {}}
    init, configure, aggregate = (
        fpdgd.ChainStrategy.__init__,
        fpdgd.ChainStrategy.configure_round,
        fpdgd.ChainStrategy.aggregate,
    )

    def spy_init(self, base, history, forgotten, trained):
        seen["trained"], seen["history"] = np.array(trained), history
        init(self, base, history, forgotten, trained)

    def spy_configure(self, round):
        body = configure(self, round)
        seen["sent"][round] = np.array(body["params"])
        return body

    def spy_aggregate(self, round, replies):
        seen["got"][round] = [np.array(r.body["params"]) for r in replies]
        return aggregate(self, round, replies)

    monkeypatch.setattr(fpdgd.ChainStrategy, "__init__", spy_init)
    monkeypatch.setattr(fpdgd.ChainStrategy, "configure_round", spy_configure)
    monkeypatch.setattr(fpdgd.ChainStrategy, "aggregate", spy_aggregate)
    _, result = as_code("federaser", 12, "federation.params.federaser_as_code=true")
    cost = result["unlearning"]
    assert cost["rounds"] == 11 * 7 and cost["interactions"] == 11 * 7 * 5  # a turn each
    assert cost["messages"] == 2 * 11 * 7
    history = seen["history"]
    assert len(history) == 12
    kept = [[m for c, m, _ in sent if c not in LEAVERS] for _, sent in history]
    got = [seen["got"][12 + i][0] for i in range(1, 78)]  # every turn replied
    sent = [seen["sent"][12 + i] for i in range(1, 78)]
    u = [history[0][0], np.mean(kept[0], axis=0)]  # U0, U1
    for t in range(1, 12):
        turns = got[(t - 1) * 7 : t * 7]
        assert np.array_equal(sent[(t - 1) * 7], u[t])  # its first client starts from Ut
        for k in range(1, 7):  # each later client from the previous one's model
            assert np.array_equal(sent[(t - 1) * 7 + k], turns[k - 1])
        u[t] = last = turns[-1]  # the shared array: Ut ends as the last client's model
        mean = np.mean(turns, axis=0)
        if t % 5 == 0:
            old = np.mean(kept[t], axis=0) - history[t][0]
            new = mean - last
            u.append(last + np.linalg.norm(old) * new / np.linalg.norm(new))
        else:
            u.append(mean)
    expected = seen["trained"] + 0.1 * np.sum(u, axis=0)
    assert np.allclose(cost["final_model"], expected, rtol=0, atol=1e-12)

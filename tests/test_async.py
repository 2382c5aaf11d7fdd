"""Asynchronous FPDGD (FedAsync, FedBuff) on the asynchronous server loop."""

import asyncio

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.observe.timecurve import at_common, is_timed
from foltr_async.protocols.fpdgd_async import ServerOptimizer, staleness_weight
from foltr_async.rng import stream
from foltr_async.runtime.agent import Agent, handles
from foltr_async.runtime.async_engine import AsyncServerAgent, AsyncStrategy, staleness_summary
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.clock import run
from foltr_async.runtime.engine import RoundPlan
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.schema import Int, register_kind
from foltr_async.scenario.load import load_scenario, revise
from foltr_async.simulation import Simulation

register_kind("test_async.model", {"x": Int()})
register_kind("test_async.update", {"x": Int()})


def test_staleness_functions_follow_fedasync():
    assert staleness_weight("constant", 7, 0.5, 4.0) == 1.0
    assert staleness_weight("polynomial", 3, 0.5, 4.0) == pytest.approx(0.5)  # 1/sqrt(4)
    assert staleness_weight("hinge", 4, 10.0, 4.0) == 1.0
    assert staleness_weight("hinge", 6, 10.0, 4.0) == pytest.approx(1.0 / 21.0)


class _Counting(AsyncStrategy):
    """Every update is a new version (as FedAsync)."""

    broadcast_kind = "test_async.model"
    reply_kind = "test_async.update"
    period = 5.5

    def configure(self, clients, version):
        return {"x": version}

    def apply(self, reply, staleness):
        return True

    def evaluate(self):
        return {}


class _Device(Agent):
    role = "client"

    def __init__(self, agent_id, bus, delay):
        super().__init__(agent_id, bus)
        self.delay = delay

    @handles("test_async.model")
    async def on_model(self, env):
        await asyncio.sleep(self.delay)
        self.send(env.src, "test_async.update", {"x": env.body["x"]}, env.round)


def test_staleness_is_the_versions_applied_since_the_client_got_its_model():
    async def main():
        bus = MemoryBus(NetworkModel(), stream(0, "net"))
        clients = [_Device("client-0000", bus, 1.0), _Device("client-0001", bus, 2.4)]
        server = AsyncServerAgent(
            bus,
            _Counting(),
            RoundPlan(rounds=1, deadline=100.0),
            stream(0, "server"),
            clients=lambda: [c.id for c in clients],
        )
        for agent in (server, *clients):
            agent.start()
        await server.run_rounds()
        return server

    server = run(main())
    # fast client at t = 1, 2, 3, 4, 5; slow one at 2.4 (from version 0) and 4.8 (from 3)
    assert server.staleness == [0, 0, 2, 1, 0, 2, 1]
    assert server.version == 7
    summary = staleness_summary(server.staleness)
    assert summary["histogram"] == {"0": 3, "1": 2, "2": 2} and summary["max"] == 2


SCENARIO = """
[scenario]
seed = 3
[dataset]
profile = "mq2007-like"
n_queries = 120
[federation]
protocol = "fpdgd"
clients = 6
queries_per_client = 4
rounds = 5
data = "shared"
deadline = 1000.0
[evaluation]
every = 5
max_test_queries = 40
[variants.sync]
federation.params = { compute_time = 1.0 }
[variants.fedbuff]
federation.protocol = "fpdgd_async"
federation.rounds = 1
federation.params.mode = "fedbuff"
federation.params.buffer = 6
federation.params.staleness = "constant"
federation.params.compute_time = 1.0
federation.params.period = 22.0
[variants.fedasync]
federation.protocol = "fpdgd_async"
federation.rounds = 4
federation.params = { mode = "fedasync", compute_time = 1.0, period = 10.0 }
evaluation.every = 1
network = { availability = 0.8, compute_scale = { kind = "lognormal", median = 1.0, sigma = 0.8 } }
"""


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    p = tmp_path_factory.mktemp("async") / "a.toml"
    p.write_text(SCENARIO)
    return load_scenario(p).variants


def simulate(cfg, seed=3):
    sim = Simulation(cfg, seed, Observer())
    return run(sim.run()), sim


def test_fedbuff_with_every_client_and_equal_devices_plays_the_synchronous_rounds(variants):
    sync, sync_sim = simulate(variants["sync"])
    buff, buff_sim = simulate(variants["fedbuff"])
    assert buff["versions"] == 5  # one server step per 4 s cycle of 6 updates, 22 s
    assert buff["staleness"]["histogram"] == {"0": 30}
    np.testing.assert_allclose(buff_sim.proto.strategy.model, sync_sim.proto.strategy.model)
    assert buff["online"]["interactions"] >= sync["online"]["interactions"] == 5 * 6 * 4


def test_fedasync_learns_under_heterogeneous_devices_and_is_deterministic(variants):
    a, sim = simulate(variants["fedasync"])
    b, _ = simulate(variants["fedasync"])
    curve = a["offline"]["ndcg@10"]
    sim.proto.strategy.model = sim.proto.strategy.ranker.get_params() * 0.0
    start = sim.proto.strategy.evaluate()["ndcg@10"]  # the zero model it started from
    assert curve[-1] > start + 0.05
    assert a["sim_times"] == [10.0, 20.0, 30.0, 40.0]
    assert a["staleness"]["max"] > 0  # slow devices' updates arrive stale
    assert a["messages"]["dropped"].get("offline", 0) > 0  # availability < 1 bites
    for key in ("offline", "online", "staleness", "versions", "messages"):
        assert a[key] == b[key]


def test_partial_participation_caps_concurrency_and_rotates_clients(variants):
    cfg = revise(
        variants["fedbuff"],
        {
            "federation": {
                "participation": 0.5,
                "rounds": 4,
                "params": {"buffer": 3, "period": 10.0},
            }
        },
    )
    result, sim = simulate(cfg)
    contributors = {c for r in sim.records.reports for c in r.clients}
    assert contributors == {f"client-{i:04d}" for i in range(6)}  # freed slots rotate
    # 3 of the 6 clients at a time, 4 s per update, 40 s: 3 x 9 updates (10 at t = 40 at most)
    assert 27 <= result["staleness"]["updates"] <= 30


def test_asynchronous_fpdgd_needs_compute_time(variants):
    with pytest.raises(ScenarioError, match=r"compute_time: expected a number > 0"):
        simulate(revise(variants["fedasync"], {"federation": {"params": {"compute_time": 0.0}}}))


def test_variants_are_compared_at_the_latest_time_every_repeat_reached():
    variants = {
        "async": [{"sim_times": [5.0, 10.0, 15.0], "offline": {"m": [0.1, 0.2, 0.3]}}],
        "sync": [{"sim_times": [4.0, 12.0], "offline": {"m": [0.5, 0.6]}}],
    }
    assert not is_timed(variants)
    variants["async"][0]["staleness"] = {"updates": 0}
    assert is_timed(variants)
    same = at_common(variants, "m")
    assert same["time"] == same["at"] == 12.0
    assert same["variants"]["async"]["mean"] == 0.2 and same["variants"]["sync"]["mean"] == 0.6


def test_variants_are_compared_at_the_most_interactions_every_repeat_reached():
    """Asynchronous clients serve more users in the same time: equal interactions reads the
    fast variant early in its run, where the slow one ended."""
    variants = {
        "async": [
            {"interactions": [400, 800, 1200], "offline": {"m": [0.1, 0.2, 0.3]}},
            {"interactions": [300, 700, 1100], "offline": {"m": [0.2, 0.3, 0.4]}},
        ],
        "sync": [
            {"interactions": [200, 400], "offline": {"m": [0.5, 0.6]}},
            {"interactions": [300, 500], "offline": {"m": [0.4, 0.7]}},
        ],
    }
    same = at_common(variants, "m", "interactions")
    assert same["at"] == 400 and "time" not in same
    assert same["variants"]["async"]["mean"] == pytest.approx(0.15)  # 0.1 at 400, 0.2 at 300
    assert same["variants"]["sync"]["mean"] == pytest.approx(0.5)  # 0.6 at 400, 0.4 at 300


def test_results_report_interactions_by_each_evaluation_and_both_equal_horizons(variants):
    a, _ = simulate(variants["fedasync"])
    assert len(a["interactions"]) == len(a["sim_times"]) == 4
    assert a["interactions"] == sorted(a["interactions"])  # cumulative
    assert a["interactions"][-1] <= a["online"]["interactions"]
    s, _ = simulate(variants["sync"])
    assert s["interactions"] == [5 * 6 * 4]  # evaluated once, after 5 rounds of 6 x 4
    # the online metric through each evaluated round: a synchronous run's users record the round
    # they were served in; an asynchronous run's the model version, not the evaluations' round
    assert s["online_at"] == [s["online"]["ndcg@10_discounted"]] and "online_at" not in a


def test_fedbuff_server_optimisers_follow_their_formulas():
    w, g1, g2 = np.array([1.0, -1.0]), np.array([0.5, 0.25]), np.array([-0.5, 1.0])
    plain = ServerOptimizer("sgd", 0.1, 0.0, 0.99, 1e-3)
    assert np.array_equal(plain.step(w, g1), w + 0.1 * g1)
    avgm = ServerOptimizer("sgd", 0.1, 0.9, 0.99, 1e-3)  # FedAvgM: m = 0.9 m + g
    w1 = avgm.step(w, g1)
    np.testing.assert_allclose(avgm.step(w1, g2), w1 + 0.1 * (0.9 * g1 + g2))
    adam = ServerOptimizer("adam", 0.1, 0.9, 0.99, 1e-3)  # FedAdam, no bias correction
    m, v = 0.1 * g1, 0.01 * g1**2
    np.testing.assert_allclose(adam.step(w, g1), w + 0.1 * m / (np.sqrt(v) + 1e-3))


def test_fedbuff_with_server_momentum_moves_further_than_plain_sgd(variants):
    """Same clients, same updates in the first step; momentum carries the earlier steps on."""
    runs = {}
    for beta in (0.0, 0.9):
        params = {"buffer": 3, "period": 10.0, "server_momentum": beta}
        fed = {"participation": 0.5, "rounds": 4, "params": params}
        _, sim = simulate(revise(variants["fedbuff"], {"federation": fed}))
        runs[beta] = sim.proto.strategy.model
    assert np.linalg.norm(runs[0.9]) > 1.5 * np.linalg.norm(runs[0.0])


def test_fedasync_rho_keeps_local_models_near_the_model_they_started_from(variants):
    """FedAsync's proximal term pulls every local step back toward the received model, so
    from the zero model the mixed global model moves less than without it."""
    moved = {}
    for rho in (0.0, 10.0):
        cfg = revise(variants["fedasync"], {"federation": {"rounds": 2, "params": {"rho": rho}}})
        moved[rho] = np.linalg.norm(simulate(cfg)[1].proto.strategy.model)
    assert 0.0 < moved[10.0] < 0.5 * moved[0.0]


def test_a_rho_whose_proximal_step_overshoots_is_refused(variants):
    with pytest.raises(ScenarioError, match=r"rho: expected lr \* rho < 2"):
        simulate(revise(variants["fedasync"], {"federation": {"params": {"rho": 20.0}}}))

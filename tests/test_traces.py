"""Trace-driven devices and availability: FedScale and FLGo formats, the diurnal model."""

import json

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.runtime.network import NetworkModel, Presence
from foltr_async.runtime.traces import load_trace
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

FEDSCALE = {
    "format": "fedscale",
    "device": {
        "10": {"computation": 50.0, "communication": 800.0},
        "2": {"computation": 100.0, "communication": 8000.0},
        "7": {"computation": 400.0, "communication": 80.0},
    },
    "behaviour": {
        "2": {"active": [0.0, 60.0], "inactive": [30.0, 70.0], "finish_time": 100.0},
        "7": {"active": [50.0], "inactive": [100.0], "finish_time": 100.0},
    },
}


def write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_fedscale_devices_map_to_factors_over_the_median_and_bytes_per_second(tmp_path):
    trace = load_trace(write(tmp_path, "fs.json", FEDSCALE))
    # clients in numeric key order 2, 7, 10; median computation 100 ms/sample
    assert [c.compute_factor for c in trace.clients] == [1.0, 4.0, 0.5]
    assert [c.bandwidth for c in trace.clients] == [1e6, 1e4, 1e5]  # kbit/s * 1000 / 8
    assert trace.of("client-0001") is trace.clients[1]
    assert trace.of("client-0004") is trace.clients[1]  # i mod n
    assert trace.of("server") is None
    csv_trace = load_trace(
        write(
            tmp_path,
            "fs.csv",
            "client_id,computation,communication\n2,100,8000\n7,400,80\n10,50,800\n",
        )
    )
    assert [c.compute_factor for c in csv_trace.clients] == [1.0, 4.0, 0.5]


def test_fedscale_behaviour_windows_repeat_every_finish_time(tmp_path):
    first = load_trace(write(tmp_path, "fs.json", FEDSCALE)).clients[0]  # client "2"
    online = [t for t in range(0, 200, 5) if first.online_at(float(t))]
    assert online[:10] == [0, 5, 10, 15, 20, 25, 30, 60, 65, 70]  # [0, 30] and [60, 70]
    assert online[10:] == [t + 100 for t in online[:10]]


def test_trace_availability_and_bandwidth_reach_the_network_model(tmp_path):
    path = write(tmp_path, "fs.json", FEDSCALE)
    net = NetworkModel.from_dict({"trace": path, "availability_model": "trace", "bandwidth": 1e9})
    ids = ["client-0000", "client-0001", "server"]
    rng = np.random.default_rng(0)
    assert net.online(ids, 1, rng, now=10.0) == {"client-0000", "server"}
    assert net.online(ids, 2, rng, now=55.0) == {"client-0001", "server"}
    # a link runs at its slower end: client-0001 has 1e4 bytes/s, the server 1e9
    assert net.transit_time("server", "client-0001", 100_000, rng) == pytest.approx(10.0)
    times = net.transit_times("server", ["client-0000", "client-0001"], 100_000, rng)
    np.testing.assert_allclose(times, [0.1, 10.0])
    assert net.device_scale("client-0001", rng) == 4.0


def test_flgo_availability_is_a_markov_chain_per_client(tmp_path):
    doc = {
        "format": "flgo",
        "clients": {
            "0": {"prob_available": 1.0, "prob_unavailable": 1.0, "latency": 10},
            "1": {"prob_available": 0.0, "prob_unavailable": 0.0, "latency": 30},
        },
    }
    with pytest.raises(ScenarioError, match="both 0"):
        load_trace(write(tmp_path, "bad.json", doc))
    doc["clients"]["1"]["prob_available"] = 1.0  # never leaves once online
    trace = load_trace(write(tmp_path, "flgo.json", doc))
    assert [c.compute_factor for c in trace.clients] == [0.5, 1.5]  # latency over the median
    net = NetworkModel(trace=trace, availability_model="trace")
    state, rng = Presence(), np.random.default_rng(1)
    seen = [net.online(["client-0000", "client-0001"], r, rng, state=state) for r in range(6)]
    zero = [("client-0000" in s) for s in seen]
    assert all(a != b for a, b in zip(zero, zero[1:], strict=False))  # p_on = p_off = 1 flips
    assert all("client-0001" in s for s in seen)  # stationary start: online, and stays


def test_diurnal_availability_follows_the_day():
    net = NetworkModel.from_dict(
        {
            "availability": 0.5,
            "availability_model": "diurnal",
            "diurnal": {"amplitude": 1.0, "day": 100.0, "spread": 0.0},
        }
    )
    ids = [f"client-{i:04d}" for i in range(50)]
    state, rng = Presence(), np.random.default_rng(2)
    noon = net.online(ids, 1, rng, state=state, now=25.0)  # sin = 1: p = 1
    night = net.online(ids, 2, rng, state=state, now=75.0)  # sin = -1: p = 0
    dusk = net.online(ids, 3, rng, state=state, now=50.0)  # sin = 0: p = 0.5
    assert len(noon) == 50 and not night and 10 < len(dusk) < 40


def test_bad_traces_and_keys_are_one_line_errors(tmp_path):
    scenario = tmp_path / "s.toml"
    base = '[federation]\nprotocol = "fpdgd"\n[network]\n'
    cases = {
        'trace = "nope.json"': "network.trace: nope.json: no such file",
        'availability_model = "trace"': 'network.availability_model: expected "trace" only',
        'availability_model = "weekly"': "network.availability_model: expected one of",
        "diurnal = { amplitude = 2.0 }": "network.diurnal.amplitude: expected a number in",
    }
    bad = write(tmp_path, "t.json", {"format": "fedscale", "device": {"1": {"computation": -1}}})
    cases[f'trace = "{bad}"'] = "client 1: computation: expected a number"
    for line, message in cases.items():
        scenario.write_text(base + line + "\n")
        with pytest.raises(ScenarioError) as err:
            load_scenario(scenario)
        text = str(err.value)
        assert text.startswith(str(scenario)) and message in text and "\n" not in text


def test_the_bundled_example_traces_load():
    for name in ("fedscale_example.json", "fedscale_devices.csv", "flgo_example.json"):
        trace = load_trace(f"scenarios/traces/{name}")
        assert len(trace.clients) == 40
        factors = [c.compute_factor for c in trace.clients]
        assert np.median(factors) == pytest.approx(1.0)


def test_trace_compute_factors_set_each_clients_training_time(tmp_path):
    path = write(tmp_path, "fs.json", FEDSCALE)
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        '[dataset]\nn_queries = 60\n[federation]\nprotocol = "fpdgd"\nclients = 4\n'
        'data = "shared"\nparams = { compute_time = 2.0 }\n'
        f'[network]\ntrace = "{path}"\ncompute_scale = {{ kind = "constant", value = 1.5 }}\n'
    )
    cfg = load_scenario(scenario).variants["default"]
    sim = Simulation(cfg, 0, Observer())
    sim.build()
    times = [sim.agents[f"client-{i:04d}"].compute_time for i in range(4)]
    assert times == [2.0 * 1.5 * f for f in (1.0, 4.0, 0.5, 1.0)]


def test_a_relative_trace_path_is_also_read_from_the_scenario_folder(tmp_path):
    write(tmp_path, "t.json", FEDSCALE)
    scenario = tmp_path / "s.toml"
    scenario.write_text('[federation]\nprotocol = "fpdgd"\n[network]\ntrace = "t.json"\n')
    cfg = load_scenario(scenario).variants["default"]
    assert cfg.network.trace.path == str(tmp_path / "t.json")

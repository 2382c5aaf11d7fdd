"""FedScale trace semantics: trace time (start, speed), the completion rule, the time nobody was
online, and the pairing of device and behaviour tables."""

import io
import json
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from foltr_async.errors import ScenarioError
from foltr_async.observe.console import LiveConsole
from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.traces import load_trace
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation


def trace_file(tmp_path, windows, cycle=1000.0):
    """Two paired clients: equal devices, these on/off windows."""
    doc = {
        "format": "fedscale",
        "device": {
            str(i): {"computation": 100.0, "communication": 1e6} for i in range(len(windows))
        },
        "behaviour": {
            str(i): {
                "active": [a for a, _ in w],
                "inactive": [b for _, b in w],
                "finish_time": cycle,
            }
            for i, w in enumerate(windows)
        },
    }
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(doc))
    return str(p)


def scenario(tmp_path, trace, network="", protocol="fpdgd", rounds=2, params=""):
    p = tmp_path / "s.toml"
    p.write_text(
        "[dataset]\nn_queries = 60\n"
        f'[federation]\nprotocol = "{protocol}"\nclients = 2\nrounds = {rounds}\n'
        f'data = "shared"\nqueries_per_client = 4\ndeadline = 20.0\n'
        f"params = {{ compute_time = 1.0{params} }}\n"
        f'[network]\ntrace = "{trace}"\navailability_model = "trace"\n{network}\n'
    )
    return p


def play(path):
    cfg = load_scenario(path).variants["default"]
    sim = Simulation(cfg, 0, Observer())
    return run(sim.run()), sim


def test_trace_time_starts_at_trace_start_and_runs_at_trace_speed(tmp_path):
    path = trace_file(tmp_path, [[(0.0, 30.0), (60.0, 70.0)]], cycle=100.0)
    ids = ["client-0000"]

    def online_at(now, **keys):
        net = NetworkModel.from_dict({"trace": path, "availability_model": "trace", **keys})
        return "client-0000" in net.online(ids, 1, np.random.default_rng(0), now=now)

    assert online_at(0.0) and not online_at(0.0, trace_start=40.0)
    assert online_at(5.0, trace_start=60.0) and not online_at(15.0, trace_start=60.0)
    assert not online_at(4.0, trace_speed=10.0) and online_at(6.0, trace_speed=10.0)  # 40, 60 s
    # the cycle repeats in trace time: 1 simulated second = 1 trace hour lands on 0 mod 100
    assert online_at(1.0, trace_start=50.0, trace_speed=3650.0)  # 3700 mod 100 = 0


def test_trace_timing_keys_are_checked_in_one_line(tmp_path):
    path = trace_file(tmp_path, [[(0.0, 30.0)]])
    flgo = tmp_path / "flgo.json"
    flgo.write_text(
        json.dumps(
            {"format": "flgo", "clients": {"0": {"prob_available": 0.5, "prob_unavailable": 0.5}}}
        )
    )
    cases = {
        f'trace = "{path}"\navailability_model = "trace"\ntrace_speed = 0': (
            "network.trace_speed: expected a number > 0"
        ),
        f'trace = "{path}"\navailability_model = "trace"\ntrace_start = -1': (
            "network.trace_start: expected a number >= 0"
        ),
        f'trace = "{path}"\navailability_model = "trace"\ntrace_rule = "end"': (
            "network.trace_rule: expected one of completion, round_start"
        ),
        f'trace = "{path}"\ntrace_start = 10': "network.trace_start: only with availability_model",
        f'trace = "{flgo}"\navailability_model = "trace"\ntrace_rule = "round_start"': (
            "network.trace_rule: only with availability_model"
        ),
    }
    s = tmp_path / "s.toml"
    for body, message in cases.items():
        s.write_text(f'[federation]\nprotocol = "fpdgd"\n[network]\n{body}\n')
        with pytest.raises(ScenarioError) as err:
            load_scenario(s)
        assert message in str(err.value) and "\n" not in str(err.value)


# client-0000 is online all the time; client-0001 only for the first 2 s of each 1,000 s,
# so it is online when round 1 starts but not when its update (4 interactions x 1 s) arrives
ONE_LEAVES = [[(0.0, 1000.0)], [(0.0, 2.0)]]


@pytest.mark.parametrize("protocol", ["fpdgd", "fpdgd_async"])
def test_a_client_gone_before_its_update_arrives_does_not_count(tmp_path, protocol):
    path = trace_file(tmp_path, ONE_LEAVES)
    params = ', mode = "fedbuff", buffer = 1, period = 30.0' if protocol == "fpdgd_async" else ""
    res, sim = play(scenario(tmp_path, path, protocol=protocol, params=params))
    assert {c for r in sim.records.reports for c in r.clients} == {"client-0000"}
    assert res["messages"]["dropped"]["offline"] >= 1
    # the same scenario under the round-start rule counts it
    res, sim = play(
        scenario(tmp_path, path, 'trace_rule = "round_start"', protocol=protocol, params=params)
    )
    assert "client-0001" in sim.records.reports[0].clients


def test_the_run_reports_rounds_and_time_nobody_was_online(tmp_path, capsys):
    # both online for the first 5 s: round 1 (updates at 4 s) counts, round 2 starts at 4 s
    # with both online but their updates arrive at 8 s (dropped: it lasts its 20 s deadline),
    # round 3 starts at 24 s with nobody online and lasts its deadline
    path = trace_file(tmp_path, [[(0.0, 5.0)], [(0.0, 5.0)]])
    res, _ = play(scenario(tmp_path, path, rounds=3))
    c = res["contributions"]
    assert c["per_round"] == [2, 0, 0] and c["nobody_online_rounds"] == 1
    assert c["nobody_online_s"] == pytest.approx(20.0)
    assert c["rounds_s"] == pytest.approx(res["sim_s"])
    from foltr_async.cli import main

    out = tmp_path / "out"
    assert main([str(scenario(tmp_path, path, rounds=3)), "--out", str(out), "--quiet"]) == 0
    said = capsys.readouterr()
    line = "Nobody online at the start of 1 of 3 rounds of default (45.5% of its simulated time"
    assert line in said.out
    assert "nobody_online='1 of 3 rounds, 45.5% of the simulated time'" in said.err
    assert line in (out / "summary.md").read_text()


def test_the_live_console_says_when_an_empty_round_had_nobody_online():
    live = LiveConsole(Console(file=io.StringIO()))
    live.start = lambda: None
    live.run_started({"scenario": "s", "variants": ["v"], "repeats": 1, "rounds": {"v": 5}})
    live.repeat_started("v", 0, 1)
    live.round_done("v", 0, 1, metrics=None, messages={}, sim_time=1.0)
    live.event("round_empty", variant="v", repeat=0, round=1, online=2, selected=2, replied=0)
    live.event("round_empty", variant="v", repeat=0, round=2, online=0, selected=0, replied=0)
    out = io.StringIO()
    Console(file=out, width=160).print(live._render())
    assert "empty rounds 2 (nobody online in 1)" in out.getvalue()


def test_unequal_device_and_behaviour_tables_pair_by_one_seeded_mapping(tmp_path):
    device = {str(k): {"computation": float(k), "communication": 8.0} for k in range(1, 13)}
    behaviour = {
        str(k): {"active": [float(k)], "inactive": [float(k) + 0.5], "finish_time": 100.0}
        for k in range(3)
    }
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"format": "fedscale", "device": device, "behaviour": behaviour}))
    trace = load_trace(str(p))
    assert len(trace.clients) == 12
    starts = [int(c.intervals[0][0]) for c in trace.clients]
    assert Counter(starts) == {0: 4, 1: 4, 2: 4}  # each behaviour row as often
    assert starts != [i % 3 for i in range(12)]  # not the row-aligned i mod 3
    # device rows stay in key order, one per client
    assert [c.compute_factor for c in trace.clients] == pytest.approx(
        [k / 6.5 for k in range(1, 13)]
    )
    p.write_text(p.read_text() + " ")  # another file with the same tables: the same mapping
    assert [int(c.intervals[0][0]) for c in load_trace(str(p)).clients] == starts

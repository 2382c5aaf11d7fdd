"""End-to-end runs through the bus in virtual time, on the real MQ2008 sample."""

import asyncio
import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]


def scenario_text(data: Path, extra: str = "") -> str:
    return f"""
[scenario]
name = "t"
seed = 4
repeats = 2
reference = "fpdgd"
[dataset]
path = "{data.as_posix()}"
[clicks]
model = "perfect"
[federation]
protocol = "fpdgd"
clients = 5
queries_per_client = 4
rounds = 20
[network]
latency = {{ kind = "lognormal", median = 30.0, sigma = 0.5 }}
[evaluation]
every = 5
{extra}
[variants.fpdgd]
[variants.es]
federation = {{ protocol = "foltr_es", params = {{ lr = 0.01 }} }}
"""


@pytest.fixture
def scenario_file(tmp_path, mq2008_dir):
    p = tmp_path / "t.toml"
    p.write_text(scenario_text(mq2008_dir))
    return p


def simulate(cfg, seed=4, inject=None):
    sim = Simulation(cfg, seed, Observer())

    async def main():
        if inject is not None:
            asyncio.get_running_loop().call_later(100.0, inject, sim)
        return await sim.run()

    return run(main()), sim


def test_virtual_time_rounds_take_simulated_not_wall_time(scenario_file):
    cfg = load_scenario(scenario_file, ["federation.deadline=10000.0"]).variants["fpdgd"]
    result, _ = simulate(cfg)
    # 20 rounds x 2 lognormal(median 30 s) hops: many simulated minutes, a fraction of a second
    assert result["sim_s"] > 20 * 30
    assert result["wall_s"] < result["sim_s"]  # however loaded the machine
    assert result["rounds"] == [5, 10, 15, 20]
    assert result["messages"]["sent"] == 2 * 20 * 5
    assert result["online"]["interactions"] == 20 * 5 * 4


def test_curves_start_at_round_0_from_the_untrained_model_and_learning_rises_from_it(
    scenario_file,
):
    """Each repeat records the model's offline metrics before round 1; the summary curve (the
    one console, summary.md and figures draw) starts there, and FPDGD learns from it."""
    from foltr_async.observe.results import summarise_variant

    cfg = load_scenario(scenario_file).variants["fpdgd"]
    reps = [simulate(cfg, seed=s)[0] for s in (4, 5)]
    assert reps[0]["initial"] == reps[1]["initial"]  # a linear ranker starts at the same weights
    assert set(reps[0]["initial"]) == set(reps[0]["offline"])
    cur = summarise_variant(reps, "ndcg@10")["curve"]
    assert cur["rounds"] == [0, 5, 10, 15, 20] and cur["n"][0] == 2
    assert cur["mean"][0] == reps[0]["initial"]["ndcg@10"] and cur["std"][0] == 0.0
    assert all(r["offline"]["ndcg@10"][-1] > r["initial"]["ndcg@10"] for r in reps)


def test_a_run_freezes_its_heap_while_it_plays_and_thaws_it_after(scenario_file):
    cfg = load_scenario(scenario_file).variants["fpdgd"]
    during, thresholds = [], gc.get_threshold()

    class Watch(Observer):
        def round_done(self, *args, **kwargs):
            during.append((gc.get_freeze_count(), gc.get_threshold()[0]))

    run(Simulation(cfg, 4, Watch()).run())
    assert min(during)[0] > 0  # agents (and round 1's compiled code) out of the collector's scans
    assert min(during)[1] >= 10_000  # fewer young collections while it plays
    assert gc.get_freeze_count() == 0  # nothing kept from the collector once the run is over
    assert gc.get_threshold() == thresholds


def test_the_young_threshold_grows_with_the_frozen_heap():
    """A run with many agents allocates more per round: its young collections are spaced by
    its frozen heap, not by a fixed count (62,500 clients spent ~1.2 CPU s a round there)."""
    from foltr_async.runtime import heap

    thresholds = gc.get_threshold()
    heap.freeze()
    try:
        small = gc.get_threshold()[0]
    finally:
        heap.thaw()
    agents = [[i] for i in range(4 * heap.BLOCKS_PER_YOUNG * heap.YOUNG_THRESHOLD)]  # tracked
    heap.freeze()
    try:
        young = gc.get_threshold()[0]
        assert gc.get_freeze_count() >= len(agents)
        assert young > max(small, heap.YOUNG_THRESHOLD) and young > len(agents) // 16
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


FRAGMENTS = """
import numpy as np
from foltr_async.runtime import heap
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
base = rss()
big, small = [], []
for _ in range(4000):  # 64 KB blocks (below the mmap threshold) pinned apart by small ones
    big.append(np.ones(8192))
    small.append(np.ones(4))
del big
kept = rss() - base
heap.release()
print(kept, rss() - base)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/status").exists(),
    reason="measures RSS from /proc; malloc_trim is glibc's",
)
def test_release_returns_a_finished_runs_freed_heap_pages_to_the_system():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTS], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    kept, released = map(int, out.split())
    assert kept > 200_000  # kB: glibc keeps the 256 MB the blocks were freed from
    assert released < kept - 200_000


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the size from /proc")
def test_release_collects_once_the_process_has_grown_not_after_every_small_run():
    """A full collection rescans every live object: a small run's few cycles wait for the
    collector's schedule, a run that held hundreds of MB in cycles is freed at once."""
    import weakref

    from foltr_async.runtime import heap

    class Node:
        pass

    def cycle(payload) -> weakref.ref:
        node = Node()
        node.me, node.payload = node, payload
        return weakref.ref(node)

    gc.disable()  # no automatic collection in between: release alone decides
    try:
        heap.release(force=True)
        small = cycle(np.ones(1000))
        heap.release()
        assert small() is not None  # left for later: not worth a full collection
        big = cycle(np.ones(20_000_000))  # 160 MB
        heap.release()
        assert small() is None and big() is None
    finally:
        gc.enable()


def test_same_seed_gives_identical_results_and_another_seed_does_not(scenario_file):
    cfg = load_scenario(scenario_file).variants["fpdgd"]
    a, _ = simulate(cfg)
    b, _ = simulate(cfg)
    c, _ = simulate(cfg, seed=5)
    for r in (a, b, c):
        r.pop("wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["offline"] != c["offline"]


def test_malformed_messages_are_dropped_and_counted_and_the_run_goes_on(scenario_file):
    cfg = load_scenario(scenario_file).variants["fpdgd"]

    def inject(sim):
        sim.bus.inject(b"\xc1 not msgpack", "server")
        sim.bus.inject(b"\x93\x01\x02\x03", "client-0001")

    result, _ = simulate(cfg, inject=inject)
    assert result["messages"]["dropped"].get("malformed") == 2
    assert result["rounds"][-1] == 20


def test_dropout_and_deadline_keep_rounds_going(scenario_file):
    cfg = load_scenario(
        scenario_file, ["network.availability=0.5", "federation.deadline=100.0"]
    ).variants["fpdgd"]
    result, _ = simulate(cfg)
    # offline clients are not asked; a few replies miss the 100 s deadline and arrive late
    assert result["messages"]["sent"] < 2 * 20 * 5 * 0.8
    assert result["late_replies"] > 0
    assert result["rounds"][-1] == 20


def test_federated_protocols_learn_on_real_data(scenario_file):
    sc = load_scenario(scenario_file, ["federation.rounds=40"])
    for name in ("fpdgd", "es"):
        result, sim = simulate(sc.variants[name])
        zero = sim.ctx.evaluate(sim.ctx.new_ranker())["ndcg@10"]
        assert result["offline"]["ndcg@10"][-1] > zero + 0.05, name


def test_cli_writes_every_output_and_explains_bad_input(scenario_file, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "foltr_async",
            str(scenario_file),
            "--out",
            str(out),
            "--quiet",
            "--set",
            "federation.rounds=10",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for name in ("results.json", "curves.csv", "summary.md", "curves.png", "events.jsonl"):
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and set(res["variants"]) == {"fpdgd", "es"}
    assert res["variants"]["fpdgd"]["summary"]["final"]["ndcg@10"]["n"] == 2
    assert res["comparisons"][0]["variant"] == "es" and res["comparisons"][0]["n"] == 2
    events = [json.loads(line)["event"] for line in (out / "events.jsonl").open()]
    assert "round" in events

    bad = tmp_path / "bad.toml"
    bad.write_text(scenario_file.read_text().replace("rounds = 20", "rounds = 0"))
    done = subprocess.run(
        [sys.executable, "-m", "foltr_async", str(bad), "--out", str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "federation.rounds: expected an integer >= 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_partition_gives_each_client_its_own_queries(scenario_file):
    cfg = load_scenario(scenario_file).variants["fpdgd"]
    _, sim = simulate(cfg)
    owned = [set(sim.agents[a].learner.users.queries.tolist()) for a in sim.groups["clients"]]
    assert sum(len(s) for s in owned) == len(set().union(*owned)) == 69
    assert np.all([len(s) >= 13 for s in owned])


def test_the_runtime_puts_each_ranking_shown_in_the_round_of_the_message_served(scenario_file):
    """A client's handler never sets its users' round: the rankings it shows while serving a
    round's model count toward that round (clients x B of them in each of rounds 1..R)."""
    cfg = load_scenario(scenario_file, ["federation.deadline=10000.0"]).variants["fpdgd"]
    _, sim = simulate(cfg)
    rounds = [r for r, _, _ in sim.probe.records()]
    assert sorted(set(rounds)) == list(range(1, 21))
    assert all(rounds.count(r) == 5 * 4 for r in range(1, 21))

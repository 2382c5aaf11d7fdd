"""The run contract's timeline actions: generic ones (lifecycle, attack switch) plus the ones a
protocol declares, checked against the chosen protocol when the scenario is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.experiment import run_scenario
from foltr_async.observe.observer import Observer
from foltr_async.plugins import load_plugins
from foltr_async.protocols import fpdgd, pdgd_central
from foltr_async.protocols.learner import PDGDLearner
from foltr_async.registry import PLUGINS_ENV, REGISTRY
from foltr_async.scenario.load import load_scenario, validate

ROOT = Path(__file__).resolve().parents[1]
RETIRE = '{ round = 3, action = "retire", agents = ["client-0001"] }'


def scenario(path: Path, data: Path, protocol: str, timeline: str) -> Path:
    path.write_text(f"""
[scenario]
name = "actions"
seed = 3
[dataset]
path = "{data.as_posix()}"
[federation]
protocol = "{protocol}"
clients = 3
queries_per_client = 2
rounds = 4
[evaluation]
every = 2
[variants.v]
timeline = [{timeline}]
""")
    return path


def test_an_action_the_protocol_lacks_is_refused_in_one_line():
    raw = {
        "federation": {"protocol": "foltr_es"},
        "timeline": [{"round": 1, "action": "unlearn", "agents": ["clients"]}],
    }
    with pytest.raises(ScenarioError) as e:
        validate(raw, "x.toml")
    assert str(e.value) == (
        "x.toml: timeline[0].action: 'unlearn' is not an action of protocol 'foltr_es' (its "
        "actions: join, rejoin, leave, crash, attack_start, attack_stop)"
    )
    raw["federation"]["protocol"] = "fpdgd"
    raw["timeline"][0]["action"] = "unlern"
    with pytest.raises(ScenarioError, match=r"did you mean 'unlearn'\?\) \(its actions: .*unlearn"):
        validate(raw, "x.toml")


def test_protocols_declare_their_actions_and_the_state_each_leaves():
    assert fpdgd.FPDGD.takes()[-1] == "unlearn"
    assert fpdgd.FPDGD.state_after("unlearn") == "left"
    assert fpdgd.FPDGD.state_after("crash") == "crashed"
    assert fpdgd.FPDGD.state_after("attack_start") is None
    assert "unlearn" not in pdgd_central.CentralPDGD.takes()


@pytest.fixture
def retire_plugin():
    """tests/plugin_retire.py loaded for one test: the others see the shipped protocols."""
    load_plugins()
    saved = dict(REGISTRY.protocols)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PLUGINS_ENV, "tests.plugin_retire")
        yield load_plugins()
    REGISTRY.protocols.clear()
    REGISTRY.protocols.update(saved)


def test_a_plugin_protocol_runs_its_own_action(tmp_path, mq2008_dir, retire_plugin):
    """``retire`` (tests/plugin_retire.py) is declared by the plugin's run: the timeline takes
    it, and the retired client sends no update after it."""
    path = scenario(
        tmp_path / "s.toml",
        mq2008_dir,
        "fpdgd_retire",
        RETIRE,
    )
    res = run_scenario(load_scenario(path), tmp_path / "out", Observer())
    sent = res["variants"]["v"]["repeats"][0]["messages"]["kinds"]["fpdgd.update"]["sent"]
    assert sent == 3 * 2 + 2 * 2  # rounds 1-2: three clients, rounds 3-4: two
    # the built-in protocol it extends does not take it
    with pytest.raises(ScenarioError, match="'retire' is not an action of protocol 'fpdgd'"):
        load_scenario(scenario(tmp_path / "f.toml", mq2008_dir, "fpdgd", RETIRE))


def test_a_plugin_action_runs_over_zmq_workers(tmp_path, mq2008_dir):
    path = scenario(
        tmp_path / "s.toml",
        mq2008_dir,
        "fpdgd_retire",
        RETIRE,
    )
    out = tmp_path / "zmq"
    done = subprocess.run(
        [sys.executable, "-m", "foltr_async", str(path), "--transport", "zmq", "--workers", "2"]
        + ["--out", str(out), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "FOLTR_ASYNC_PLUGINS": "tests.plugin_retire"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads((out / "results.json").read_text())["variants"]["v"]["repeats"][0]
    assert rep["messages"]["kinds"]["fpdgd.update"]["sent"] == 3 * 2 + 2 * 2


@pytest.mark.parametrize("ranker", [None, {"kind": "mlp", "hidden": [4]}])
def test_the_central_server_learns_through_the_pdgd_learner(ranker):
    """One step of lr * scale on the summed gradients of the logged interactions (a linear
    ranker in the compiled call, an MLP one interaction at a time)."""
    from foltr_async.ltr.pdgd import pdgd_gradient
    from tests.test_pdgd_batch import make_ctx, make_queryset

    ctx = make_ctx(make_queryset(3), 3, ranker, lr=0.5)
    learner = PDGDLearner(ctx, np.arange(4), np.random.default_rng(0), "server", lr=0.5)
    train = ctx.data.train
    rng = np.random.default_rng(1)
    queries = np.array([3, 4, 5, 6])  # 5 to 11 documents each
    rankings = np.full((4, 10), -1)
    clicks = np.zeros((4, 10), dtype=bool)
    for t, q in enumerate(queries):
        rankings[t, :5] = rng.permutation(int(np.diff(train.qptr)[q]))[:5]
        clicks[t, :5] = rng.random(5) < 0.4
    start = np.linspace(-0.1, 0.1, learner.ranker.n_params)
    learner.ranker.set_params(start)
    total = 0.0
    for q, r, c in zip(queries, rankings, clicks, strict=True):
        f = train.features[train.doc_range(q)]
        total = total + pdgd_gradient(learner.ranker, f, r[:5], c[:5], learner.ranker.score(f))
    theta = learner.learn_logged(start, train, queries, rankings, clicks, scale=0.25)
    np.testing.assert_allclose(theta, start + 0.5 * 0.25 * total, rtol=1e-12, atol=1e-15)


def test_the_attack_switch_reaches_attackers_and_nobody_else(tmp_path, mq2008_dir):
    """``attack_start`` wakes a dormant attacker from that round on; on honest clients (whose
    ``Agent.on_attack`` is the default) it changes nothing."""
    path = scenario(tmp_path / "s.toml", mq2008_dir, "fpdgd", "")
    dormant = '[{ behaviour = "scaled_reversal", count = 1, attacking = false }]'
    path.write_text(
        path.read_text()
        + f"""
[variants.dormant]
agents = {dormant}
[variants.woken]
agents = {dormant}
timeline = [{{ round = 3, action = "attack_start", agents = ["attackers"] }}]
[variants.honest-switched]
timeline = [{{ round = 1, action = "attack_start", agents = ["clients"] }}]
"""
    )
    res = run_scenario(load_scenario(path), tmp_path / "out", Observer())

    def curve(name):
        return res["variants"][name]["repeats"][0]["offline"]["ndcg@10"]

    assert curve("woken")[0] == curve("dormant")[0]  # round 2: still honest
    assert curve("woken")[1] != curve("dormant")[1]  # round 4: reversed updates since round 3
    assert curve("honest-switched") == curve("v")


def test_a_protocol_declaring_actions_without_act_is_refused_when_defined():
    from foltr_async.contract import ProtocolRun

    with pytest.raises(TypeError, match=r"Forgetful declares actions \['retire'\] but no act"):
        type("Forgetful", (ProtocolRun,), {"actions": {"retire": "left"}})

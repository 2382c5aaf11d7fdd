"""The worked examples of docs/EXTENDING.md: a protocol and an attack written against
``foltr_async.protocols.api`` and loaded as plugins, run in a small scenario."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from foltr_async.cli import main
from foltr_async.errors import FoltrError
from foltr_async.observe.observer import Observer
from foltr_async.plugins import load_plugins
from foltr_async.registry import PLUGINS_ENV, REGISTRY
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation
from tests.test_simulation import simulate

SCENARIO = """
[scenario]
name = "extending"
seed = 3
reference = "fedavgm"
[dataset]
profile = "mq2007-like"
[clicks]
model = "informational"
[federation]
protocol = "fedavgm"
clients = 6
queries_per_client = 4
rounds = 30
[evaluation]
every = 10
[variants.fedavgm]
[variants.attacked]
federation = { clients = 4 }
agents = [{ behaviour = "sign_flip", count = 2 }]
"""


@pytest.fixture(scope="module")
def plugins():
    """The examples registered for this module's tests only: other tests see the shipped
    protocols (a listing of what supports secure aggregation, say)."""
    load_plugins()  # the shipped protocols first: they are what is restored afterwards
    saved = dict(REGISTRY.protocols), dict(REGISTRY.behaviours)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PLUGINS_ENV, "examples.fedavgm, examples.signflip, examples.fedprox")
        yield load_plugins()
    for table, before in zip((REGISTRY.protocols, REGISTRY.behaviours), saved, strict=True):
        table.clear()
        table.update(before)
    for name in ("examples.signflip", "examples.fedavgm", "examples.fedprox"):
        sys.modules.pop(name, None)


def test_plugins_register_the_example_protocol_and_attack(plugins):
    assert "fedavgm" in plugins.protocols and plugins.behaviours["sign_flip"].role == "attacker"


def test_a_plugin_that_cannot_be_imported_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, "examples.no_such_protocol")
    with pytest.raises(FoltrError, match=r"^FOLTR_ASYNC_PLUGINS: cannot import "):
        load_plugins()


def test_the_example_protocol_learns_and_the_attack_hurts_it(plugins, tmp_path):
    path = tmp_path / "extending.toml"
    path.write_text(SCENARIO)
    variants = load_scenario(path).variants
    honest, sim = simulate(variants["fedavgm"])
    zero = sim.ctx.evaluate(sim.ctx.new_ranker())["ndcg@10"]
    curve = honest["offline"]["ndcg@10"]
    assert curve[-1] > zero + 0.1
    attacked, _ = simulate(variants["attacked"])
    assert attacked["offline"]["ndcg@10"][-1] < curve[-1] - 0.1


def test_the_guides_attacker_is_an_attacker_on_the_bus_and_the_console(plugins, tmp_path):
    """Its class inherits the honest client's; its role still comes from its behaviour: the
    link rules (``attacker->server``) apply to it and the console counts it as one."""
    path = tmp_path / "extending.toml"
    link = '"attacker->server" = { kind = "constant", value = 5.0 }'
    path.write_text(SCENARIO + "[network]\nlinks = { " + link + " }\n")
    changed: list[tuple[str, str]] = []

    class Roles(Observer):
        def agent_changed(self, agent_id, role, state, rounds, last_kind) -> None:
            changed.append((agent_id, role))

    sim = Simulation(load_scenario(path).variants["attacked"], 3, Roles())
    result = run(sim.run())
    attackers = sim.groups["attackers"]
    assert attackers == ["client-0004", "client-0005"]
    assert {r for a, r in changed if a in attackers} == {"attacker"}
    assert {r for a, r in changed if a not in attackers} == {"client"}
    assert [sim.bus._roles[a] for a in attackers] == ["attacker", "attacker"]
    # the attacker->server link applies to them: every round waits 5 s for their updates
    assert result["sim_times"][-1] == pytest.approx(30 * 5.0)


def test_the_attack_speaks_fpdgd_too_and_hurts_it(plugins, tmp_path):
    """One mixin over the one ``make_update`` hook: the same behaviour attacks FPDGD."""
    path = tmp_path / "extending.toml"
    path.write_text(SCENARIO.replace('protocol = "fedavgm"', 'protocol = "fpdgd"'))
    variants = load_scenario(path).variants
    honest, _ = simulate(variants["fedavgm"])
    attacked, sim = simulate(variants["attacked"])
    assert type(sim.agents["client-0004"]).__name__ == "FPDGDSignFlipClient"
    assert attacked["offline"]["ndcg@10"][-1] < honest["offline"]["ndcg@10"][-1] - 0.1


def test_the_example_trains_through_fpdgds_batched_learner(plugins, tmp_path):
    """A protocol written from the guide reaches the run's batch pool, as FPDGD does: one
    batched call per round (zero latency: every client's training at the same instant)."""
    path = tmp_path / "extending.toml"
    path.write_text(SCENARIO)
    _, sim = simulate(load_scenario(path).variants["fedavgm"])
    pool = sim.ctx.shared("fpdgd.train_pool", lambda: None)
    assert pool.jobs == 6 * 30 and pool.batches == 30


def test_the_fedprox_plugin_changes_the_local_step_and_stays_batched(plugins, monkeypatch):
    """The guide's FedProx plugin: its proximal step is the batched kernel's (every
    interaction on the batched path, one call per round), it changes what is learned, and the
    run is the run one query at a time up to float rounding."""
    import numpy as np

    import foltr_async.protocols.learner as pdgd_learner

    root = Path(__file__).resolve().parents[1]
    sets = ["federation.rounds=12", "scenario.repeats=1"]
    variants = load_scenario(root / "examples/fedprox.toml", sets).variants
    prox, sim = simulate(variants["fedprox-1"])
    pool = sim.ctx.shared("fpdgd.train_pool", lambda: None)
    assert pool.batches == 12 and pool.jobs == 10 * 12
    assert prox["learner_interactions"]["batched"] == 10 * 4 * 12
    plain, _ = simulate(variants["fedavg"])
    assert prox["offline"]["ndcg@10"] != plain["offline"]["ndcg@10"]
    monkeypatch.setattr(pdgd_learner, "train_pool", lambda ctx: None)
    one, _ = simulate(variants["fedprox-1"])
    assert one["learner_interactions"]["one query at a time: no batched pool in this run"] == 480
    np.testing.assert_allclose(one["offline"]["ndcg@10"], prox["offline"]["ndcg@10"], rtol=1e-9)
    assert one["online"] == pytest.approx(prox["online"], rel=1e-12)


def _imports(tree: ast.Module) -> set[tuple[str, str]]:
    """(module, name) of every import statement at the top of a module."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            out |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {(alias.name, alias.name) for alias in node.names}
    return out


def test_the_tutorial_shows_the_examples_code_with_its_imports():
    """Every block of the guide is the examples' code: its imports (each block starts with
    them) are the files' own, and the rest is copied verbatim."""
    root = Path(__file__).resolve().parents[1]
    names = ("fedavgm.py", "signflip.py", "fedprox.py")
    files = [(root / "examples" / f).read_text() for f in names]
    code = "".join(files)
    imported = set().union(*(_imports(ast.parse(f)) for f in files))
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "EXTENDING.md").read_text(), re.S)
    assert len(blocks) == 7
    for block in blocks:
        tree = ast.parse(block)
        first = next(n for n in tree.body if not isinstance(n, ast.Import | ast.ImportFrom))
        assert first is not tree.body[0], f"no imports before: {block.splitlines()[0]}"
        assert _imports(tree) <= imported, block.splitlines()[0]
        start = min([first.lineno] + [d.lineno for d in getattr(first, "decorator_list", [])])
        body = "\n".join(block.splitlines()[start - 1 :]) + "\n"
        assert body in code, block.splitlines()[0]


def test_a_plugins_cross_key_rule_is_checked_by_validate(capsys):
    fedavgm = str(Path(__file__).resolve().parents[1] / "examples" / "fedavgm.toml")
    assert main(["validate", fedavgm, "--set", "federation.rounds=1", "--only", "fedavgm"]) == 2
    assert "federation.params.momentum: has no effect in one round" in capsys.readouterr().err
    assert main(["validate", fedavgm, "--set", "federation.rounds=1", "--only", "fedavg"]) == 0

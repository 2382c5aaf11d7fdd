"""The protocol-author API: ``@parameters`` classes give the scenario fields and typed values."""

from __future__ import annotations

import pytest

from foltr_async.errors import ScenarioError
from foltr_async.params import Field, check_table
from foltr_async.protocols import fpdgd
from foltr_async.protocols.api import param, parameters


@parameters
class Example:
    rounds: int = param(help="required")
    lr: float = param(0.1, "step", min=0.0)
    name: str | None = param(None, "optional name")
    targets: list | str = param(["a"], "ids or all")


def test_fields_come_from_the_annotations_and_param():
    assert {
        "rounds": Field(int, help="required"),
        "lr": Field(float, 0.1, "step", min=0.0),
        "name": Field(str, None, "optional name", nullable=True),
        "targets": Field((list, str), ["a"], "ids or all"),
    } == Example.FIELDS


def test_checked_table_becomes_typed_values():
    table = check_table({"rounds": 3, "lr": 1}, Example.FIELDS, "x.toml", "federation.params")
    p = Example(**table)
    assert (p.lr, p.name, p.targets, p.rounds) == (1.0, None, ["a"], 3)
    assert Example.of({**table, "count": 2}) == p  # other keys of an agent group are ignored
    with pytest.raises(ScenarioError, match=r"federation.params.lr: expected a finite number >= "):
        check_table({"rounds": 3, "lr": -1.0}, Example.FIELDS, "x.toml", "federation.params")


def test_list_defaults_are_not_shared_between_instances():
    a, b = Example(rounds=1), Example(rounds=1)
    assert a.targets == b.targets and a.targets is not b.targets


def test_run_context_params_are_the_protocols_class():
    from foltr_async.protocols import noniid
    from tests.test_pdgd_batch import make_ctx, make_queryset

    ctx = make_ctx(make_queryset(3), 3, lr=0.5, dp=True)
    p = ctx.params
    assert isinstance(p, fpdgd.Params)
    assert ctx.params is p  # built once with the context, not on every read
    assert (p.lr, p.dp, p.epsilon, p.clip_bound, p.clip_norm) == (0.5, True, 4.5, 2.5, "l2")
    # a protocol extending another's parameters extends its class
    assert list(noniid.Params.FIELDS)[: len(fpdgd.Params.FIELDS)] == list(fpdgd.Params.FIELDS)


def test_the_context_reads_the_scenario_once_into_typed_values(mq2008_dir):
    """Protocols read the federation's size, evaluation cadence, ... from the context, built
    once, not from the raw ``cfg`` tables."""
    from foltr_async.observe.observer import Observer
    from foltr_async.scenario.load import validate
    from foltr_async.simulation import Simulation

    raw = {
        "dataset": {"path": str(mq2008_dir)},
        "federation": {"protocol": "fpdgd", "clients": 4, "queries_per_client": 3, "rounds": 5},
        "agents": [{"behaviour": "scaled_reversal", "count": 2}],
        "timeline": [{"round": 3, "action": "unlearn", "agents": ["attackers"]}],
        "evaluation": {"every": 2},
    }
    sim = Simulation(validate(raw, "t"), 1, Observer())
    sim.build()
    ctx = sim.ctx
    assert (
        ctx.config.federation.protocol,
        ctx.config.federation.clients,
        ctx.config.n_clients,
    ) == ("fpdgd", 4, 6)
    assert (
        ctx.config.federation.queries_per_client,
        ctx.config.federation.rounds,
        ctx.config.evaluation.every,
    ) == (3, 5, 2)
    assert (
        "unlearn" in ctx.config.timeline_actions
        and not ctx.config.federation.secure_aggregation
        and ctx.config.ranker.kind == "linear"
    )
    assert [g.behaviour for g in ctx.config.agents] == ["scaled_reversal"]
    assert not any(a.remote for a in sim.agents.values())

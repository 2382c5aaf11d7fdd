"""Secure aggregation in whole FPDGD runs on the real MQ2008 sample: it learns exactly as the
plaintext federation, survives dropouts, hides single uploads, and bad combinations are one-line
scenario errors."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]


def scenario(data: Path, extra: str = "", variants: str = "") -> str:
    return f"""
[scenario]
name = "sa"
seed = 3
[dataset]
path = "{data.as_posix()}"
[clicks]
model = "perfect"
[federation]
protocol = "fpdgd"
clients = 10
queries_per_client = 4
rounds = 16
{extra}
[network]
latency = {{ kind = "lognormal", median = 0.05, sigma = 0.5 }}
[evaluation]
every = 4
{variants}
"""


def load(tmp_path, text, overrides=()):
    p = tmp_path / "sa.toml"
    p.write_text(text)
    return load_scenario(p, list(overrides))


def simulate(cfg, seed=3):
    sim = Simulation(cfg, seed, Observer())
    return run(sim.run()), sim


EVE = """
[[agents]]
behaviour = "secagg_eavesdropper"
targets = "all"
candidates = 10
"""


def test_fpdgd_with_dp_learns_exactly_as_without_secure_aggregation(tmp_path, mq2008_dir):
    sc = load(
        tmp_path,
        scenario(
            mq2008_dir,
            "params = { dp = true }",
            """
[variants.plain]
[variants.secagg]
federation.secure_aggregation = true
""",
        ),
    )
    plain, sim = simulate(sc.variants["plain"])
    secure, _ = simulate(sc.variants["secagg"])
    assert np.allclose(secure["offline"]["ndcg@10"], plain["offline"]["ndcg@10"], rtol=1e-6)
    assert secure["online"]["ndcg@10_discounted"] == pytest.approx(
        plain["online"]["ndcg@10_discounted"], rel=1e-6
    )
    zero = sim.ctx.evaluate(sim.ctx.new_ranker())["ndcg@10"]
    assert secure["offline"]["ndcg@10"][-1] > zero + 0.05
    sa = secure["secure_aggregation"]
    assert sa["failed_rounds"] == 0 and sa["unmasked_rounds"] == 16
    assert sa["mean_masked_inputs"] == 10 and sa["scheme"].startswith("SecAgg (Bonawitz")
    assert plain["messages"]["sent"] == 2 * 10 * 16
    assert secure["messages"]["sent"] == 9 * 10 * 16  # 7 secagg messages per client and round
    assert "fpdgd.update" not in secure["messages"]["kinds"]  # no update ever left in the clear
    assert "secure_aggregation" not in plain


def test_thirty_percent_dropout_after_key_sharing_and_learning_goes_on(tmp_path, mq2008_dir):
    sc = load(
        tmp_path, scenario(mq2008_dir, "params = { dp = true }\n[federation.secagg]\ndropout = 0.3")
    )
    cfg = sc.variants["default"]
    assert cfg.federation.secure_aggregation is True  # the table alone turns it on
    result, sim = simulate(cfg)
    sa = result["secure_aggregation"]
    # 10 clients, threshold 5 of 9 neighbours: a round survives up to 4 dropouts
    assert sa["keys_rebuilt"] > 10 and 2 < sa["mean_dropped_after_sharing"] < 4
    assert sa["failed_rounds"] <= 4
    for f in sa["failures"]:
        assert re.fullmatch(
            r"\d+ of 10 clients dropped after sharing keys; client-\d{4} has \d "
            r"surviving neighbours, threshold 5",
            f["error"],
        ), f
    zero = sim.ctx.evaluate(sim.ctx.new_ranker())["ndcg@10"]
    assert result["offline"]["ndcg@10"][-1] > zero + 0.05


def test_eavesdropper_reads_plain_uploads_but_not_masked_ones(tmp_path, mq2008_dir):
    sc = load(
        tmp_path,
        scenario(
            mq2008_dir,
            variants="""
[variants.plain]
[variants.secagg]
federation.secure_aggregation = true
""",
        )
        + EVE,
    )
    plain = simulate(sc.variants["plain"])[0]["eavesdrop"]["eve-0"]
    masked = simulate(sc.variants["secagg"])[0]["eavesdrop"]["eve-0"]
    assert plain["updates"] > 100 and plain["cosine_mean"] > 0.99  # the message is the model
    assert masked["masked_updates"] == 160 and masked["updates"] > 100
    assert abs(masked["cosine_mean"]) < 0.1  # a masked upload is noise to the reader
    qi_plain, qi_masked = plain["query_inference"], masked["query_inference"]
    assert qi_plain["top1_accuracy"] > qi_plain["chance"] + 0.1
    assert abs(qi_masked["top1_accuracy"] - qi_masked["chance"]) < 0.1
    assert masked["secure_aggregation"] and not plain["secure_aggregation"]


def test_unlearning_calibration_runs_in_plaintext_after_secure_rounds(tmp_path, mq2008_dir):
    sc = load(
        tmp_path,
        scenario(
            mq2008_dir,
            """secure_aggregation = true
params = { store_every = 8 }
[[timeline]]
round = -1
action = "unlearn"
agents = ["client-0003"]""",
        ),
    )
    result, _ = simulate(sc.variants["default"])
    assert result["secure_aggregation"]["unmasked_rounds"] == 16
    assert result["unlearning"]["rounds"] == 2
    assert result["messages"]["kinds"]["fpdgd.calibrated"]["delivered"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            'aggregator = "krum"\nsecure_aggregation = true',
            "federation.aggregator: 'krum' needs single updates and cannot combine with secure "
            "aggregation",
        ),
        ('aggregator = "median"\n[federation.secagg]\ndegree = 4', "'median' needs single updates"),
        (
            "[federation.secagg]\ndgree = 4",
            "federation.secagg.dgree: unknown key (did you mean 'degree'?)",
        ),
        (
            "[federation.secagg]\nthreshold = 0.3",
            "federation.secagg.threshold: expected a finite number in [0.5, 1.0], got 0.3",
        ),
    ],
)
def test_bad_secure_aggregation_settings_are_one_line_errors(tmp_path, mq2008_dir, extra, message):
    with pytest.raises(ScenarioError) as err:
        load(tmp_path, scenario(mq2008_dir, extra))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_protocols_that_cannot_sum_refuse_and_the_cli_says_it_in_one_line(tmp_path, mq2008_dir):
    text = scenario(mq2008_dir, "secure_aggregation = true").replace('"fpdgd"', '"foltr_es"')
    with pytest.raises(
        ScenarioError,
        match="protocol 'foltr_es' does not support secure "
        r"aggregation \(supported: fpdgd\)",
    ):
        load(tmp_path, text)
    bad = tmp_path / "bad.toml"
    bad.write_text(scenario(mq2008_dir, 'aggregator = "trimmed_mean"\nsecure_aggregation = true'))
    done = subprocess.run(
        [sys.executable, "-m", "foltr_async", str(bad), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "'trimmed_mean' needs single updates" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_explicit_false_wins_over_a_secagg_table(tmp_path, mq2008_dir):
    sc = load(
        tmp_path,
        scenario(
            mq2008_dir,
            "[federation.secagg]\ndegree = 4",
            """
[variants.on]
[variants.off]
federation.secure_aggregation = false
""",
        ),
    )
    on, off = sc.variants["on"].federation, sc.variants["off"].federation
    assert on.secure_aggregation and not off.secure_aggregation
    assert on.secagg["degree"] == 4 and on.secagg["threshold"] == 0.5


def test_shipped_dropout_scenario_runs_a_short_secure_round_trip():
    sc = load_scenario(
        ROOT / "scenarios" / "secagg_dropout.toml", ["federation.rounds=2", "evaluation.every=2"]
    )
    assert not sc.variants["plain"].federation.secure_aggregation
    assert [
        sc.variants[v].federation.secagg["dropout"]
        for v in ("secagg", "secagg-drop30", "secagg-drop60")
    ] == [0.0, 0.3, 0.6]
    assert sc.variants["secaggplus-k10-drop10"].federation.secagg["degree"] == 10
    result, _ = simulate(sc.variants["secagg-drop30"], seed=sc.seed)
    assert result["secure_aggregation"]["unmasked_rounds"] == 2
    assert result["eavesdrop"]["eve-0"]["masked_updates"] > 0


def test_clients_and_attackers_are_built_with_their_secure_half(tmp_path, mq2008_dir):
    """The half is a capability the agent is constructed with (from the run context), not
    patched in afterwards: the protocol's own client factory and an attack behaviour's build
    return agents that already handle the scheme's kinds and mask their update."""
    text = scenario(mq2008_dir, "secure_aggregation = true")
    text += '[[agents]]\nbehaviour = "scaled_reversal"\ncount = 1\n'
    cfg = load(tmp_path, text).variants["default"]
    sim = Simulation(cfg, 3, Observer())
    sim.build()
    ctx = sim.ctx
    built = sim.proto.client("client-0099", np.arange(4), ctx.rng("client", "client-0099"))
    attacker = sim.agents[sim.groups["attackers"][0]]
    for agent in (built, attacker):
        assert agent.secure is not None and agent.secure.spec.kind == "fpdgd.update"
        assert set(agent.secure.kinds) <= set(agent.kinds)
    # without secure aggregation the same factory builds agents without a half
    plain = Simulation(load(tmp_path, scenario(mq2008_dir)).variants["default"], 3, Observer())
    plain.build()
    assert plain.proto.client("client-0099", np.arange(4), plain.ctx.rng("x")).secure is None


def test_sending_the_summable_reply_with_send_is_refused_naming_reply(tmp_path, mq2008_dir):
    """Under secure aggregation the update must go through ``reply`` (which masks it); a
    client that ``send``s it gets an error saying so instead of leaking it in the clear."""
    cfg = load(tmp_path, scenario(mq2008_dir, "secure_aggregation = true")).variants["default"]
    sim = Simulation(cfg, 3, Observer())
    sim.build()
    client = sim.agents["client-0000"]
    with pytest.raises(TypeError, match=r"'fpdgd.update'.*self\.reply\(dst, kind, body, round\)"):
        client.send("server", "fpdgd.update", {"params": np.zeros(3), "n_interactions": 1}, 1)

"""Eavesdroppers: the scoring pieces on hand-made inputs, then taps on real runs."""

from pathlib import Path

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.ltr.queryset import QuerySet
from foltr_async.observe.observer import Observer
from foltr_async.protocols.eavesdrop import bayes_guess_rate, cosine, query_directions, query_scores
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

# --------------------------------------------------------------------------- scoring pieces


def test_query_directions_are_relevant_minus_non_relevant_means():
    features = np.array([[1, 0], [3, 0], [0, 2], [5, 5], [6, 6], [0, 0], [0, 4]], dtype=np.float32)
    labels = np.array([2, 1, 0, 0, 0, 1, 0], dtype=np.int8)
    qs = QuerySet(features, labels, np.array([0, 3, 5, 7]), np.array(["a", "b", "c"]))
    g = query_directions(qs)
    assert np.allclose(g[0], [2.0, -2.0])  # mean(rel) (2, 0) - mean(non-rel) (0, 2)
    assert np.allclose(g[1], 0.0)  # no relevant document: no direction
    assert np.allclose(g[2], [0.0, -4.0])
    s = query_scores(np.array([1.0, -1.0]), g)
    assert s[0] == pytest.approx(1.0) and s[1] == -np.inf and s[2] == pytest.approx(np.sqrt(0.5))


def test_cosine_of_zero_vector_is_nan():
    assert cosine(np.array([1.0, 0.0]), np.array([2.0, 0.0])) == pytest.approx(1.0)
    assert np.isnan(cosine(np.zeros(2), np.ones(2)))


def _confusion(prior, p, n_msgs, rng):
    n = len(prior)
    true = rng.choice(n, size=n_msgs, p=prior)
    keep = rng.random(n_msgs) < p
    other = rng.integers(n - 1, size=n_msgs)
    sent = np.where(keep, true, np.where(other < true, other, other + 1))
    c = np.zeros((n, n), dtype=np.int64)
    np.add.at(c, (sent, true), 1)
    return c


def test_bayes_guess_matches_p_for_a_uniform_prior_and_beats_it_for_a_skewed_one():
    rng = np.random.default_rng(0)
    uniform = np.full(11, 1 / 11)
    c = _confusion(uniform, 0.5, 20000, rng)
    assert np.trace(c) / c.sum() == pytest.approx(0.5, abs=0.02)
    assert bayes_guess_rate(c, 0.5) == pytest.approx(0.5, abs=0.03)
    skewed = np.r_[0.7, np.full(10, 0.03)]
    c = _confusion(skewed, 0.25, 20000, rng)
    assert np.trace(c) / c.sum() == pytest.approx(0.25, abs=0.02)
    assert bayes_guess_rate(c, 0.25) == pytest.approx(0.7, abs=0.03)  # always guess level 0


# --------------------------------------------------------------------------- taps on runs


def scenario(
    tmp_path: Path, data: Path, body: str, protocol: str = "fpdgd", only: list[str] = ()
) -> dict:
    p = tmp_path / "e.toml"
    p.write_text(f"""
[scenario]
name = "e"
seed = 5
[dataset]
path = "{data.as_posix()}"
[clicks]
model = "informational"
[federation]
protocol = "{protocol}"
clients = 10
queries_per_client = 2
rounds = 40
[network]
latency = {{ kind = "lognormal", median = 0.05, sigma = 0.5 }}
[evaluation]
every = 40
{body}
""")
    return load_scenario(p, only=only).variants


def simulate(cfg):
    return run(Simulation(cfg, 5, Observer()).run())


EVE_ALL = '[[agents]]\nbehaviour = "eavesdropper"\ntargets = "all"\n'


def test_dp_noise_lowers_what_the_eavesdropper_recovers(tmp_path, mq2008_dir):
    v = scenario(
        tmp_path,
        mq2008_dir,
        EVE_ALL
        + """
[variants.plain]
[variants.dp]
federation = { params = { dp = true, epsilon = 4.5, sensitivity = 5.0 } }
""",
    )
    plain = simulate(v["plain"])
    dp = simulate(v["dp"])
    a, b = plain["eavesdrop"]["eve-0"], dp["eavesdrop"]["eve-0"]
    assert a["updates"] + a["zero_updates"] == 400 and a["missed"] == 0
    assert a["cosine_mean"] == pytest.approx(1.0)  # without DP the message is the model
    assert b["cosine_mean"] < 0.8 and b["updates"] > 300
    qa, qb = a["query_inference"], b["query_inference"]
    assert qa["trials"] == a["updates"]
    assert qa["top1_accuracy"] > qa["chance"] + 0.1  # the update says which query it came from
    assert qb["top1_accuracy"] < qa["top1_accuracy"]
    # it listened only: the run sent what a run without it sends
    assert plain["messages"]["sent"] == 2 * 40 * 10


@pytest.mark.parametrize("protocol", ["fpdgd", "foltr_es"])
def test_clients_leave_oracle_truths_only_when_the_run_has_a_reader(tmp_path, mq2008_dir, protocol):
    """Without an eavesdropper nothing reads the oracle, so clients write none (62,500 FPDGD
    clients held ~80 MB of them); with one, every client's latest truth is there."""
    v = scenario(tmp_path, mq2008_dir, EVE_ALL + "[variants.eve]\n", protocol=protocol)
    (quiet,) = scenario(tmp_path, mq2008_dir, "", protocol=protocol).values()
    listened, alone = Simulation(v["eve"], 5, Observer()), Simulation(quiet, 5, Observer())
    run(listened.run())
    run(alone.run())
    assert listened.probe.oracle_read and not alone.probe.oracle_read
    assert alone.probe.oracle == {}
    assert {aid for _, aid in listened.probe.oracle} == set(listened.groups["clients"])


def test_foltr_es_guess_rate_is_close_to_the_randomised_response_bound(tmp_path, mq2008_dir):
    v = scenario(
        tmp_path,
        mq2008_dir,
        EVE_ALL
        + """
[variants.p05]
federation = { params = { p = 0.5 } }
[variants.p09]
federation = { params = { p = 0.9 } }
""",
        protocol="foltr_es",
    )
    for name, p in (("p05", 0.5), ("p09", 0.9)):
        e = simulate(v[name])["eavesdrop"]["eve-0"]
        assert e["metrics"] == 2 * 40 * 10 and e["missed"] == 0  # antithetic: two per message
        assert e["bound"] == pytest.approx(p)
        sd = np.sqrt(p * (1 - p) / e["metrics"])
        assert abs(e["guess_rate"] - e["bound"]) < 4 * sd, name
        assert e["bayes_guess_rate"] >= e["guess_rate"] - 4 * sd


def test_targets_pick_the_tapped_links_and_bad_targets_are_scenario_errors(tmp_path, mq2008_dir):
    body = """
[variants.one]
agents = [{ behaviour = "eavesdropper", targets = ["client-0003"] }]
[variants.bad]
agents = [{ behaviour = "eavesdropper", targets = ["client-0042"] }]
[variants.word]
agents = [{ behaviour = "eavesdropper", targets = "some" }]
"""
    v = scenario(tmp_path, mq2008_dir, body, only=["one"])
    e = simulate(v["one"])["eavesdrop"]["eve-0"]
    assert e["targets"] == ["client-0003"] and e["updates"] + e["zero_updates"] == 40
    refusals = (("bad", "no client 'client-0042'"), ("word", 'expected "all" or a non-empty list'))
    for variant, says in refusals:  # by the loader, before any data is read
        with pytest.raises(ScenarioError, match=says):
            scenario(tmp_path, mq2008_dir, body, only=[variant])

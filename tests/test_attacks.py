"""Model-poisoning attacks: the crafting rules on hand-made updates, then colluders in real runs."""

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from foltr_async.errors import ScenarioError
from foltr_async.observe.observer import Observer
from foltr_async.protocols.aggregation import krum, multi_krum
from foltr_async.protocols.attacks import (
    SHARE,
    benign_direction,
    coalition_fang_krum,
    fang_krum,
    fang_krum_lambda_max,
    fang_trimmed,
    lie_update,
    lie_z,
    reversed_gradient,
)
from foltr_async.protocols.fpdgd import UPDATE
from foltr_async.runtime.clock import run
from foltr_async.runtime.wire import decode
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- crafting rules


@pytest.mark.parametrize(("n", "m", "s"), [(10, 2, 4), (10, 3, 3), (10, 4, 2), (11, 1, 5)])
def test_lie_z_follows_the_supporters_formula(n, m, s):
    assert s == np.floor(n / 2 + 1) - m
    assert lie_z(n, m) == pytest.approx(norm.ppf((n - s) / n))


def test_lie_z_grows_with_the_coalition_and_refuses_a_majority():
    assert lie_z(10, 1) < lie_z(10, 2) < lie_z(10, 3) < lie_z(10, 4)
    with pytest.raises(ValueError, match="LIE needs"):
        lie_z(10, 6)


def test_lie_update_is_mean_minus_z_sigma_per_coordinate():
    known = np.array([[1.0, 0.0, 5.0], [3.0, 2.0, 5.0], [2.0, 4.0, 5.0]])
    z = lie_z(10, 3)
    expect = np.array([2.0, 2.0, 5.0]) - z * np.array([1.0, 2.0, 0.0])  # unbiased std
    assert np.allclose(lie_update(known, 10, 3), expect)


def _benign(rng, k=8, d=6, shift=0.1, spread=0.3):
    """k honest models around w_global + shift (moving the same way, spread like real clients)."""
    w_global = rng.normal(size=d)
    return w_global, w_global + shift + spread * rng.normal(size=(k, d))


def test_fang_krum_is_selected_by_krum_and_moves_against_the_benign_direction():
    rng = np.random.default_rng(0)
    w_global, known = _benign(rng)
    c = 2
    crafted, lam, selected = fang_krum(known, w_global, c, m_defender=c)
    assert selected
    assert 0 < lam <= fang_krum_lambda_max(known, w_global, c)
    s = benign_direction(known, w_global)
    assert np.allclose(crafted, w_global - lam * s)
    stack = np.vstack([known, crafted, crafted + 1e-7])
    picked = krum(stack, np.ones(len(stack)), c)
    assert np.linalg.norm(picked - crafted) < 1e-6
    # the aggregate now moves away from where honest training was going
    assert (picked - w_global) @ (known.mean(0) - w_global) < 0
    # Multi-Krum averages the copies in: it moves less than the honest mean would
    honest = known.mean(0) - w_global
    assert (multi_krum(stack, np.ones(len(stack)), c) - w_global) @ honest < honest @ honest


def test_fang_krum_halves_lambda_until_krum_picks_it():
    rng = np.random.default_rng(1)
    w_global, known = _benign(rng)
    known[0] += 5.0  # one far-away benign model inflates the upper bound
    crafted, lam, selected = fang_krum(known, w_global, 2, m_defender=2)
    lam_max = fang_krum_lambda_max(known, w_global, 2)
    assert selected and lam < lam_max / 8
    assert np.log2(lam_max / lam) == pytest.approx(round(np.log2(lam_max / lam)))


def test_fang_krum_gives_up_when_the_honest_models_are_tight_and_far():
    """No lambda makes Krum pick w_global - lambda s when honest models agree closely and all
    moved far: the search stops below its tolerance and says so."""
    rng = np.random.default_rng(0)
    w_global, known = _benign(rng, shift=0.3, spread=0.05)
    crafted, lam, selected = fang_krum(known, w_global, 2, m_defender=2)
    assert not selected and lam < 1e-5


def test_a_coalition_searches_once_for_equal_knowledge(monkeypatch):
    """Colluders asking with the same knowledge and global model get the search's result, each
    its own copy, from one search; other inputs search again."""
    from foltr_async.protocols import attacks

    searches = []
    monkeypatch.setattr(attacks, "fang_krum", lambda *a: searches.append(a) or fang_krum(*a))
    rng = np.random.default_rng(3)
    w_global, known = _benign(rng)
    first = coalition_fang_krum(known, w_global, 3, 3)
    first[0][:] = 0.0  # a colluder changing its copy changes nobody else's
    again = coalition_fang_krum(known.copy(), w_global.copy(), 3, 3)
    expect = fang_krum(known, w_global, 3, 3)
    assert np.array_equal(again[0], expect[0]) and again[1:] == expect[1:]
    assert len(searches) == 1
    coalition_fang_krum(known[1:], w_global, 3, 3)
    coalition_fang_krum(known, w_global, 2, 3)
    assert len(searches) == 3


def test_fang_trimmed_full_knowledge_samples_in_the_specified_ranges():
    rng = np.random.default_rng(2)
    # coordinates: up & positive, up & negative, down & positive, down & negative
    known = np.array([[1.0, -1.0, -0.5, 0.5], [2.0, -0.5, -0.2, 0.8], [1.5, -0.2, -0.1, 0.9]])
    w_global = np.array([0.0, -2.0, 0.0, 2.0])
    s = benign_direction(known, w_global)
    assert list(s) == [1, 1, -1, -1]
    w_max, w_min = known.max(0), known.min(0)
    out = np.array([fang_trimmed(known, w_global, rng, partial=False) for _ in range(200)])
    # s = +1: below w_min ([w_min / b, w_min] if w_min > 0 else [b w_min, w_min])
    assert np.all((out[:, 0] >= w_min[0] / 2) & (out[:, 0] <= w_min[0]))
    assert np.all((out[:, 1] >= 2 * w_min[1]) & (out[:, 1] <= w_min[1]))
    # s = -1: above w_max ([w_max, b w_max] if w_max > 0 else [w_max, w_max / b])
    assert np.all((out[:, 2] >= w_max[2]) & (out[:, 2] <= w_max[2] / 2))
    assert np.all((out[:, 3] >= w_max[3]) & (out[:, 3] <= 2 * w_max[3]))
    assert out.std(axis=0).min() > 0  # sampled, not a fixed point


def test_fang_trimmed_partial_knowledge_uses_three_to_four_sigma():
    rng = np.random.default_rng(3)
    known = np.array([[1.0, -1.0, 0.0], [3.0, -3.0, 0.0]])
    w_global = np.array([0.0, 0.0, 0.0])  # s = +1, -1, 0
    mu, sigma = known.mean(0), known.std(0, ddof=1)
    out = np.array([fang_trimmed(known, w_global, rng, partial=True) for _ in range(200)])
    assert np.all((out[:, 0] >= mu[0] - 4 * sigma[0]) & (out[:, 0] <= mu[0] - 3 * sigma[0]))
    assert np.all((out[:, 1] >= mu[1] + 3 * sigma[1]) & (out[:, 1] <= mu[1] + 4 * sigma[1]))
    assert np.all(out[:, 2] == 0.0)  # no known movement: keep the mean


# --------------------------------------------------------------------------- colluders in runs


def scenario(tmp_path: Path, data: Path, body: str) -> Path:
    p = tmp_path / "a.toml"
    p.write_text(f"""
[scenario]
name = "a"
seed = 3
reference = "clean"
[dataset]
path = "{data.as_posix()}"
[clicks]
model = "informational"
[federation]
protocol = "fpdgd"
clients = 7
queries_per_client = 4
rounds = 30
aggregator = "krum"
[network]
latency = {{ kind = "lognormal", median = 0.05, sigma = 0.5 }}
[evaluation]
every = 10
[variants.clean]
agents = [{{ behaviour = "data_poison", count = 3, attacking = false }}]
{body}
""")
    return p


def simulate(cfg, taps=()):
    sim = Simulation(cfg, 3, Observer())
    for cb, kw in taps:
        sim.bus.tap(cb, **kw)
    return run(sim.run())


def test_model_poisoning_lowers_ndcg_against_its_defence(tmp_path, mq2008_dir):
    sc = load_scenario(
        scenario(
            tmp_path,
            mq2008_dir,
            """
[variants.fang]
agents = [{ behaviour = "fang", count = 3, knowledge = "full" }]
[variants.lie]
agents = [{ behaviour = "lie", count = 3, knowledge = "full" }]
[variants.fang-tm]
federation = { aggregator = "trimmed_mean" }
agents = [{ behaviour = "fang", count = 3, knowledge = "full", target = "trimmed_mean" }]
""",
        )
    )
    clean = simulate(sc.variants["clean"])["offline"]["ndcg@10"][-1]
    results = {name: simulate(sc.variants[name]) for name in ("fang", "lie", "fang-tm")}
    for name, res in results.items():
        assert res["offline"]["ndcg@10"][-1] < clean - 0.1, name
    facts = results["fang"]["attacks"]
    assert set(facts) == {"client-0007", "client-0008", "client-0009"}
    for f in facts.values():
        # full knowledge: every round the colluders knew the 7 honest updates, no timeouts,
        # and their own Krum run picked the crafted model
        assert f["rounds_attacked"] == 30 and f["waits_timed_out"] == 0
        assert f["known_updates"] == 30 * 7 and f["krum_selected"] == 30


def test_colluders_share_over_the_bus_and_lie_sends_one_update(tmp_path, mq2008_dir):
    cfg = load_scenario(
        scenario(
            tmp_path,
            mq2008_dir,
            """
[variants.lie]
agents = [{ behaviour = "lie", count = 3 }]
""",
        )
    ).variants["lie"]
    sent: dict[int, dict[str, np.ndarray]] = {}

    def on_update(data, header):
        sent.setdefault(header.round, {})[header.src] = decode(data).body["params"]

    attackers = ["client-0007", "client-0008", "client-0009"]
    res = simulate(cfg, [(on_update, {"kinds": UPDATE, "src": attackers})])
    shares = res["messages"]["kinds"][SHARE]
    assert shares["sent"] == shares["delivered"] == 30 * 3 * 2  # each to the two others
    for r in range(1, 31):
        a, b, c = (sent[r][x] for x in attackers)
        assert np.array_equal(a, b) and np.array_equal(b, c)  # same knowledge, same craft
    assert all(f["waits_timed_out"] == 0 for f in res["attacks"].values())


def test_a_missing_colluder_costs_a_timeout_not_the_run(tmp_path, mq2008_dir):
    cfg = load_scenario(
        scenario(
            tmp_path,
            mq2008_dir,
            """
[variants.lie]
agents = [{ behaviour = "lie", count = 3, wait = 5.0 }]
timeline = [{ round = 11, action = "crash", agents = ["client-0009"] }]
""",
        )
    ).variants["lie"]
    res = simulate(cfg)
    assert res["rounds"][-1] == 30
    for aid in ("client-0007", "client-0008"):
        assert res["attacks"][aid]["waits_timed_out"] == 20  # rounds 11..30 without 0009
    assert res["late_replies"] == 0  # the 5 s wait stays inside the 60 s deadline


def test_lie_with_an_attacker_majority_is_a_one_line_scenario_error(tmp_path, mq2008_dir):
    path = scenario(
        tmp_path,
        mq2008_dir,
        """
[variants.lie]
federation = { clients = 3 }
agents = [{ behaviour = "lie", count = 4 }]
""",
    )
    with pytest.raises(ScenarioError, match=r"agents: behaviour 'lie': LIE needs 0 < m"):
        load_scenario(path)  # by the loader, before any data is read


@pytest.mark.parametrize(
    "name", ["data_poisoning", "model_poisoning", "defense_no_attack", "eavesdropper"]
)
def test_scenario_files_validate(name):
    sc = load_scenario(ROOT / "scenarios" / f"{name}.toml")
    assert sc.reference in sc.variants and len(sc.variants) >= 8
    for cfg in sc.variants.values():
        assert cfg.dataset.path is None  # the embedded synthetic data
        if name != "eavesdropper":
            assert cfg.n_clients == 10


def test_gradient_reversal_poisons_every_step_and_says_its_path(tmp_path, mq2008_dir):
    """The unlearning study's model poisoning against FedAvg: it lowers nDCG, and its learners'
    interactions are counted on the one-query path that names the step transform."""
    sc = load_scenario(
        scenario(
            tmp_path,
            mq2008_dir,
            """
[variants.reversed]
agents = [{ behaviour = "gradient_reversal", count = 3 }]
""",
        ),
        ["federation.aggregator=fedavg"],
    )
    clean = simulate(sc.variants["clean"])
    poisoned = simulate(sc.variants["reversed"])
    assert poisoned["offline"]["ndcg@10"][-1] < clean["offline"]["ndcg@10"][-1] - 0.03
    paths = poisoned["learner_interactions"]
    assert paths["one query at a time: a transform of every step's gradient (an attack's)"] == (
        3 * 30 * 4
    )
    assert paths["batched"] == 7 * 30 * 4


def test_reversed_gradient_is_amplified_against_g_with_its_spread():
    rng = np.random.default_rng(0)
    g = np.array([1.0, -1.0, 2.0, 0.0])
    out = np.stack([reversed_gradient(g, rng) for _ in range(4000)])
    # E[-2 gamma g + mu] = -3 g + mean(g), gamma ~ U(1, 2)
    assert np.allclose(out.mean(axis=0), -3.0 * g + g.mean(), atol=0.1)

"""Privacy audits: a correct mechanism's audited lower bound stays within its claimed epsilon,
and deliberately broken mechanisms (the code patched as a regression would change it) are caught:
their lower bound exceeds the epsilon the run claims."""

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from foltr_async.cli import main
from foltr_async.observe.audit import audit_variant, clopper_pearson, epsilon_lower_bound
from foltr_async.observe.observer import Observer
from foltr_async.protocols import foltr_es, fpdgd
from foltr_async.protocols.fpdgd import FPDGDClient, gamma_noise
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import load_scenario
from foltr_async.simulation import Simulation

ROOT = Path(__file__).resolve().parent.parent
#: the confidence of these checks: a correct mechanism's bound exceeds its claim in at most
#: 0.1% of seeds, so a failure here is a broken mechanism, not bad luck
CONFIDENCE = 0.999

SCENARIO = """
[scenario]
name = "audit"
seed = 1
[dataset]
profile = "mq2007-like"
n_queries = 60
[federation]
protocol = "{protocol}"
clients = {clients}
queries_per_client = 2
rounds = {rounds}
data = "shared"
{federation}
params = {params}
[evaluation]
every = {rounds}
max_test_queries = 10
[[agents]]
behaviour = "canary"
count = {canaries}
bits = "{bits}"
[[agents]]
behaviour = "auditor"
view = "{view}"
confidence = {confidence}
"""
L1 = "{ dp = true, epsilon = 1.2, sensitivity = 3.0, clip_norm = 'l1' }"


def audited(
    tmp_path,
    *,
    protocol="fpdgd",
    clients=4,
    rounds=400,
    federation="",
    params=L1,
    canaries=3,
    bits="round",
    view="aggregate",
    seeds=(1,),
) -> dict:
    """The audit of a small run (its repeats: ``seeds``), as results.json holds it."""
    path = tmp_path / "audit.toml"
    path.write_text(SCENARIO.format(confidence=CONFIDENCE, **locals()))
    cfg = load_scenario(path).variants["default"]
    reps = [run(Simulation(cfg, s, Observer()).run()) for s in seeds]
    return audit_variant(reps)["eve-0"]


def test_clopper_pearson_is_scipys_exact_interval():
    for k, n in [(0, 50), (3, 50), (25, 50), (50, 50), (7, 1000)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
        lo, hi = clopper_pearson(k, n, 0.05)
        assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)


def test_the_bound_of_a_known_mechanism_is_below_it_and_close_to_it():
    """Laplace(1/eps) around 0 or 1 (sensitivity 1): the optimal audit nears eps from below."""
    rng = np.random.default_rng(3)
    eps = 1.0
    bits = rng.integers(2, size=40_000)
    x = bits + rng.laplace(0.0, 1.0 / eps, bits.size)
    out = epsilon_lower_bound(x, bits, confidence=CONFIDENCE)
    assert 0.75 * eps < out["epsilon_lower"] <= eps
    noise = epsilon_lower_bound(rng.normal(size=bits.size), bits, confidence=CONFIDENCE)
    assert noise["epsilon_lower"] < 0.1  # nothing to learn: nothing found


def test_too_few_trials_give_no_verdict():
    out = audit_variant(
        [
            {
                "audit": {
                    "eve-0": {
                        "mechanism": "m",
                        "view": "link",
                        "threat": "t",
                        "bits": "round",
                        "trials": {"round": [1], "canary": ["c"], "bit": [1], "score": [0.3]},
                        "claim": {"round": {"value": 1.0}, "run": {"delta": ["x"]}},
                    }
                }
            }
        ]
    )
    assert out["eve-0"]["per_release"]["verdict"] == "not audited"


@pytest.mark.parametrize(
    "case",
    [
        dict(),  # L1 clipping, every client every round
        dict(clients=8, federation="participation = 0.5"),  # the noise split over the selected
        dict(federation="secure_aggregation = true"),  # the server sees only the sum
        dict(params="{ dp = true, epsilon = 4.5, sensitivity = 5.0 }", canaries=1, rounds=800),
    ],
    ids=["l1", "partial", "secagg", "l2"],
)
def test_a_correct_fpdgd_mechanism_stays_within_its_claimed_epsilon(tmp_path, case):
    a = audited(tmp_path, **case)["per_release"]
    assert a["trials"] >= 300 and a["claimed_epsilon"] is not None
    assert a["verdict"] == "within claim", a
    assert a["epsilon_lower"] > 0.0  # the canary is seen: the audit has power


def test_l1_clipping_is_audited_tight(tmp_path):
    """Laplace noise on an L1 sensitivity is exactly epsilon-DP: the audit gets most of it."""
    a = audited(tmp_path, rounds=800)["per_release"]
    assert 0.6 * a["claimed_epsilon"] < a["epsilon_lower"] <= a["claimed_epsilon"]


def test_a_link_eavesdropper_sees_past_the_aggregate_claim_unless_uploads_are_masked(tmp_path):
    """One upload carries only its share of the noise: the accountant claims nothing for it
    (and the audit finds far more than the round's epsilon); masked, it tells nothing."""
    plain = audited(tmp_path, view="link")["per_release"]
    assert plain["verdict"] == "no claim" and plain["epsilon_lower"] > 1.2
    masked = audited(tmp_path, view="link", federation="secure_aggregation = true")
    assert masked["per_release"]["claimed_epsilon"] == 0.0
    assert masked["per_release"]["verdict"] == "within claim"


def test_noise_halved_is_caught(tmp_path, monkeypatch):
    honest = fpdgd.gamma_noise
    monkeypatch.setattr(
        fpdgd, "gamma_noise", lambda rng, n, scale, size: honest(rng, n, scale / 2, size)
    )
    a = audited(tmp_path)["per_release"]
    assert a["verdict"] == "violated" and a["epsilon_lower"] > a["claimed_epsilon"]


def test_noise_shares_sized_by_all_clients_under_partial_participation_are_caught(
    tmp_path, monkeypatch
):
    def privatise(self, theta):  # the federation's size, not the round's clients
        return theta + gamma_noise(
            self.rng, self.ctx.config.n_clients, self.noise_scale, theta.size
        )

    monkeypatch.setattr(FPDGDClient, "privatise", privatise)
    a = audited(tmp_path, clients=8, federation="participation = 0.25")["per_release"]
    assert a["verdict"] == "violated"


def test_l2_clipping_reported_with_the_l1_epsilon_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(fpdgd.Params, "l1_sensitivity", lambda self, d: 2.0 * self.clip_bound)
    params = "{ dp = true, epsilon = 3.0, sensitivity = 3.0 }"
    a = audited(tmp_path, params=params, canaries=1, rounds=8000)["per_release"]
    assert a["claimed_epsilon"] == pytest.approx(3.0)
    assert a["verdict"] == "violated"


ES = "{ p = 0.5 }"


def test_randomised_response_stays_within_its_epsilon(tmp_path):
    a = audited(tmp_path, protocol="foltr_es", params=ES, view="link", rounds=300)
    r = a["per_release"]
    assert r["claimed_epsilon"] == pytest.approx(math.log(10.0))
    assert r["verdict"] == "within claim" and r["epsilon_lower"] > 0.5 * r["claimed_epsilon"]


def test_randomised_response_with_p_misreported_is_caught(tmp_path, monkeypatch):
    honest = foltr_es.response_draw
    monkeypatch.setattr(foltr_es, "response_draw", lambda p, rng: honest(min(1.0, p + 0.3), rng))
    a = audited(tmp_path, protocol="foltr_es", params=ES, view="link", rounds=300)
    assert a["per_release"]["verdict"] == "violated"


def test_run_bits_audit_the_composed_run_one_trial_per_repeat_and_canary(tmp_path):
    params = "{ dp = true, epsilon = 0.5, sensitivity = 3.0, clip_norm = 'l1' }"
    a = audited(tmp_path, params=params, rounds=3, bits="run", seeds=range(1, 41))
    run_bound = a["per_run"]
    assert run_bound["trials"] == 40 * 3
    # three rounds of epsilon 0.5: the run claims at most 1.5 for a canary
    assert 0.0 < run_bound["claimed_epsilon"] <= 1.5 + 1e-9
    assert run_bound["verdict"] == "within claim"


def test_audit_refuses_a_scenario_without_an_auditor(capsys):
    assert main(["audit", str(ROOT / "scenarios" / "eavesdropper.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "auditor" in err and "canaries" in err


def test_canaries_need_dp_and_one_l2_canary(tmp_path):
    from foltr_async.errors import ScenarioError

    with pytest.raises(ScenarioError, match="dp = true"):
        audited(tmp_path, params="{ dp = false }")
    with pytest.raises(ScenarioError, match="expected 1 with L2"):
        audited(tmp_path, params="{ dp = true }", canaries=2)


CSFLTR = """
[scenario]
name = "audit-csfltr"
seed = 1
[dataset]
profile = "mq2007-like"
n_queries = 20
[federation]
protocol = "csfltr"
clients = 3
rounds = 1
deadline = 600.0
[federation.params]
docs_per_party = 300
queries_per_party = 200
epsilon = 2.0
canary = true
[evaluation]
every = 1
[[agents]]
behaviour = "auditor"
view = "estimate"
confidence = {confidence}
[variants.estimate]
[variants.answer]
agents = [{{ behaviour = "auditor", view = "answer", confidence = {confidence} }}]
"""


def sketch_audit(tmp_path, variant: str) -> dict:
    path = tmp_path / "csfltr.toml"
    path.write_text(CSFLTR.format(confidence=CONFIDENCE))
    cfg = load_scenario(path).variants[variant]
    return audit_variant([run(Simulation(cfg, 1, Observer()).run())])["eve-0"]["per_release"]


def test_a_sketch_answers_estimate_stays_within_epsilon_while_the_whole_answer_does_not(
    tmp_path,
):
    """The per-answer noise is one shared draw: the canary term's estimate is epsilon-DP (the
    stated guarantee), but contrasting the answer's entries removes the noise."""
    est = sketch_audit(tmp_path, "estimate")
    assert est["trials"] >= 300 and est["claimed_epsilon"] == 2.0
    assert est["verdict"] == "within claim" and est["epsilon_lower"] > 0.5
    whole = sketch_audit(tmp_path, "answer")
    assert whole["verdict"] == "no claim" and whole["epsilon_lower"] > 2.0


def test_sketch_noise_too_small_is_caught(tmp_path, monkeypatch):
    from foltr_async.protocols.csfltr import party

    honest = party.noisy_answer
    monkeypatch.setattr(
        party, "noisy_answer", lambda v, eps, rng, per="answer": honest(v, 3 * eps, rng, per)
    )
    assert sketch_audit(tmp_path, "estimate")["verdict"] == "violated"

"""FedIPS: the PBM users, the IPS weights, the hinge and LambdaRank pieces, federated EM, runs."""

import numpy as np
import pytest

from foltr_async.errors import ScenarioError
from foltr_async.ltr.clicks import PositionBasedModel
from foltr_async.ltr.data import load_letor
from foltr_async.ltr.metrics import ndcg
from foltr_async.ltr.rankers import LinearRanker
from foltr_async.observe.observer import Observer
from foltr_async.protocols.fedips import (
    FedIPSClient,
    _sigmoid,
    em_statistics,
    em_theta,
    examination,
    fit_relevance,
    hinge_score_gradient,
    lambda_weights,
    m_clicks,
    pbm_click_probability,
    top_k_table,
    truncated_normal,
)
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import revise, validate
from foltr_async.simulation import Simulation

# ------------------------------------------------------------------------------ users


def test_truncated_normal_stays_above_zero_and_keeps_its_centre():
    rng = np.random.default_rng(0)
    g = truncated_normal(rng, 1.0, 0.1, size=20000)
    assert g.min() > 0 and abs(g.mean() - 1.0) < 0.005 and abs(g.std() - 0.1) < 0.005
    low = truncated_normal(rng, 0.05, 0.1, size=20000)  # most of the mass is cut away
    assert low.min() > 0 and low.mean() > 0.05
    assert isinstance(truncated_normal(rng, 1.0, 0.1), float)
    with pytest.raises(ValueError):
        truncated_normal(rng, 0.0, 0.0)


def test_pbm_click_probability_is_examination_times_relevance():
    labels = np.array([[4, 0, 3, 1, 2], [0, 0, 4, -1, -1]])
    exam = examination(1.5, 5)
    p = pbm_click_probability(labels, exam, np.array([3, 4]), 0.1)
    np.testing.assert_allclose(exam, [1, 2**-1.5, 3**-1.5, 4**-1.5, 5**-1.5])
    np.testing.assert_allclose(p[0], exam * [1, 0.1, 1, 0.1, 0.1])
    np.testing.assert_allclose(p[1], exam * [0.1, 0.1, 1, 0, 0])  # padding is never clicked
    # the same as the library's per-list position-based model
    model = PositionBasedModel(gamma_user=1.5)
    np.testing.assert_allclose(p[0], model.click_probability(labels[0]))


def test_simulated_pbm_click_rates_match_the_model():
    rng = np.random.default_rng(1)
    labels = np.tile(np.array([3, 0, 4, 0, 3]), (40000, 1))
    exam = examination(2.0, 5)
    p = pbm_click_probability(labels, exam, np.array([3, 4]), 0.1)
    clicks = rng.random(labels.shape) < p
    rate = clicks.mean(axis=0)
    assert np.all(np.abs(rate - p[0]) <= 4 * np.sqrt(p[0] * (1 - p[0]) / 40000) + 1e-4)


def test_m_clicks_gives_exactly_m_clicks_in_proportion_to_the_click_probabilities():
    rng = np.random.default_rng(4)
    labels = np.array([[3, 0, 4, 0, 3], [0, 4, -1, -1, -1]])
    p = pbm_click_probability(labels, examination(1.0, 5), np.array([3, 4]), 0.1)
    draws = np.stack([m_clicks(rng, p, 10) for _ in range(20000)])
    assert draws.shape == (20000, 2, 5) and np.all(draws.sum(axis=(1, 2)) == 10)
    assert not draws[:, 1, 2:].any()  # padding is never clicked
    share = draws.sum(axis=0) / draws.sum()
    np.testing.assert_allclose(share, p / p.sum(), atol=0.004)
    assert not m_clicks(rng, np.zeros((2, 5)), 10).any()


def test_m_clicks_draws_what_rng_choice_draws():
    """The cheaper draw is numpy's weighted choice, slot for slot and state for state."""
    for seed in range(300):
        r = np.random.default_rng(seed)
        n, m = int(r.integers(1, 40)), int(r.integers(1, 30))
        prob = r.random(n) * (r.random(n) < 0.7)
        if prob.sum() <= 0:
            continue
        a, b = np.random.default_rng(seed + 1000), np.random.default_rng(seed + 1000)
        want = np.bincount(a.choice(n, size=m, p=prob / prob.sum()), minlength=n)
        np.testing.assert_array_equal(m_clicks(b, prob, m), want)
        assert a.bit_generator.state == b.bit_generator.state


def test_m_clicks_keep_ips_unbiased_within_a_round():
    """Weighting a slot clicked n times by n / p gives, in expectation, m / S times the
    full-information target (S the round's total click probability): the same target up to a
    per-round scale, where the naive weights n keep the position bias."""
    rng = np.random.default_rng(5)
    n_docs, k, m = 30, 5, 10
    scores = rng.normal(size=n_docs)
    shown = np.argsort(-scores)[:k][::-1].copy()
    labels = np.array([[4, 0, 3, 0, 1]])
    exam = examination(2.0, k)
    p = pbm_click_probability(labels, exam, np.array([3, 4]), 0.1)
    rel = p[0] / exam
    per_doc = np.array([hinge_score_gradient(scores, shown[[i]], np.ones(1))[0] for i in range(k)])
    counts = np.stack([m_clicks(rng, p, m)[0] for _ in range(50000)])
    ips = counts @ (per_doc / exam)
    target = m / p.sum() * (rel @ per_doc)
    assert abs(ips.mean() - target) < 4 * ips.std() / np.sqrt(len(ips))
    naive = counts @ per_doc
    assert abs(naive.mean() - target) > 20 * naive.std() / np.sqrt(len(naive))
    # the loss of a count-weighted click set is the count-weighted sum of single clicks
    loss, _ = hinge_score_gradient(scores, shown[[0, 2]], exam[[0, 2]] / np.array([3, 1]))
    assert loss == pytest.approx(3 * per_doc[0] / exam[0] + per_doc[2] / exam[2])


# ------------------------------------------------------------------------------ IPS


def test_ips_weighted_loss_and_gradient_are_unbiased_and_the_naive_ones_are_not():
    """E over clicks of sum_c h(c)/p_c equals the loss over relevant documents weighted by
    their click probability when examined (the full-information target); naive is not."""
    rng = np.random.default_rng(2)
    n_docs, k, draws = 30, 5, 200000
    scores = rng.normal(size=n_docs)
    shown = np.argsort(-scores)[:k][::-1].copy()  # some order, not the model's
    labels = np.array([4, 0, 3, 0, 1])
    exam = examination(2.0, k)
    rel = np.where(np.isin(labels, [3, 4]), 1.0, 0.1)  # P(click | examined)
    per_doc = np.array(
        [hinge_score_gradient(scores, shown[[i]], np.ones(1))[0] for i in range(k)]
    )  # h(q, d) of each shown document
    target = rel @ per_doc
    clicks = rng.random((draws, k)) < exam * rel
    ips = clicks @ (per_doc / exam)
    naive = clicks @ per_doc
    se = ips.std() / np.sqrt(draws)
    assert abs(ips.mean() - target) < 4 * se
    assert naive.mean() < target - 20 * naive.std() / np.sqrt(draws)
    # the gradient of the sum over a click set is the same per-document sum, so it is
    # unbiased too: compare the expected gradient with the IPS one on one click pattern
    loss, grad = hinge_score_gradient(scores, shown[[0, 2]], exam[[0, 2]])
    l0, g0 = hinge_score_gradient(scores, shown[[0]], exam[[0]])
    l2, g2 = hinge_score_gradient(scores, shown[[2]], exam[[2]])
    np.testing.assert_allclose(grad, g0 + g2)
    assert loss == pytest.approx(l0 + l2)


def test_hinge_gradient_matches_finite_differences_and_the_formula():
    rng = np.random.default_rng(3)
    s = rng.normal(scale=0.7, size=12)
    clicked, prop = np.array([1, 7, 4]), np.array([1.0, 0.5, 0.2])
    loss, grad = hinge_score_gradient(s, clicked, prop)
    expected = sum(
        np.maximum(0, 1 - (s[c] - s)).sum() / p for c, p in zip(clicked, prop, strict=True)
    )
    assert loss == pytest.approx(expected)
    eps = 1e-6
    for i in range(s.size):
        d = np.zeros_like(s)
        d[i] = eps
        num = (
            hinge_score_gradient(s + d, clicked, prop)[0]
            - hinge_score_gradient(s - d, clicked, prop)[0]
        ) / (2 * eps)
        assert grad[i] == pytest.approx(num, abs=1e-5)
    assert grad.sum() == pytest.approx(0.0, abs=1e-12)  # pairwise: shifts cancel


# ------------------------------------------------------------------------------ LambdaRank


def _reference_lambdas(s, y, k):
    n, gain = s.size, 2.0**y - 1
    cut = min(k, n)
    ideal = np.sort(gain)[::-1][:cut] @ (1 / np.log2(np.arange(2, cut + 2)))
    rank = np.empty(n, int)
    rank[np.argsort(-s, kind="stable")] = np.arange(n)
    disc = np.where(rank < cut, 1 / np.log2(rank + 2.0), 0)
    out = np.zeros(n)
    for i in range(n):
        for j in range(n):
            if y[i] > y[j]:
                lam = abs((gain[i] - gain[j]) * (disc[i] - disc[j])) / ideal
                lam /= 1 + np.exp(s[i] - s[j])
                out[i] += lam
                out[j] -= lam
    return out


@pytest.mark.parametrize(("n", "k"), [(3, 10), (15, 5), (40, 10)])
def test_truncated_lambdas_equal_the_all_pairs_definition(n, k):
    rng = np.random.default_rng(n)
    s, y = rng.normal(size=n), rng.integers(0, 5, n).astype(float)
    np.testing.assert_allclose(lambda_weights(s, y, k), _reference_lambdas(s, y, k), atol=1e-12)
    assert not lambda_weights(s, np.zeros(n), k).any()  # nothing relevant: no signal


def test_top_k_table_lists_each_querys_best_documents(mq2008_dir):
    qs = load_letor(mq2008_dir / "train.txt")
    scores = np.random.default_rng(4).normal(size=qs.n_docs)
    table = top_k_table(qs, scores, 5)
    for q in range(qs.n_queries):
        s = scores[qs.doc_range(q)]
        want = np.argsort(-s, kind="stable")[:5]
        got = table[q][table[q] >= 0]
        np.testing.assert_array_equal(got, want)
        assert (table[q] == -1).sum() == max(0, 5 - s.size)


@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize(
    ("estimator", "counts"),  # Bernoulli clicks or m-click counts; LambdaRank's labels
    [("ips", False), ("ips", True), ("full_info", False)],
)
def test_compiled_local_sgd_equals_the_numpy_path(mq2008_dir, epochs, estimator, counts):
    """A linear client's round in one compiled call: the numpy path's weights up to rounding."""
    from types import SimpleNamespace

    from foltr_async.ltr import ips_kernel

    qs = load_letor(mq2008_dir / "train.txt")
    rng = np.random.default_rng(7)
    table = top_k_table(qs, rng.normal(size=qs.n_docs), 5)
    run = SimpleNamespace(
        ctx=SimpleNamespace(data=SimpleNamespace(train=qs)),
        logging=SimpleNamespace(table=table),
        scratch=LinearRanker(qs.n_features),
        lr_local=0.05,
        local_epochs=epochs,
        estimator=estimator,
        compiled=None,
    )
    client = SimpleNamespace(proto=run)
    moved = 0
    for _ in range(40):
        batch = rng.integers(qs.n_queries, size=int(rng.integers(1, 8)))
        shown = (table[batch] >= 0) & (rng.random((batch.size, 5)) < 0.5)
        clicks = shown * rng.integers(1, 4, size=shown.shape) if counts else shown
        prop = examination(float(rng.uniform(0.5, 2.0)), 5)
        start = rng.normal(size=qs.n_features) * rng.choice([0.0, 0.1, 3.0])
        want = FedIPSClient.local_sgd(client, start, batch, clicks, prop)
        run.compiled = ips_kernel
        got = FedIPSClient.local_sgd(client, start, batch, clicks, prop)
        run.compiled = None
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        moved += bool(np.any(want))
    assert moved > 20  # most rounds learned something


# ------------------------------------------------------------------------------ EM


def test_compiled_relevance_regression_equals_its_numpy_definition():
    rng = np.random.default_rng(9)
    for rows in (0, 1, 7, 25):
        x = rng.random((rows, 46)).astype(np.float32)
        targets, w_rel = rng.random(rows), rng.normal(size=47) * 0.3
        w = w_rel.copy()
        xd, n = x.astype(np.float64), max(rows, 1)
        for _ in range(20):  # the M-step's definition, in numpy
            r = targets - _sigmoid(xd @ w[:-1] + w[-1])
            w[:-1] += 1.5 * (xd.T @ r) / n
            w[-1] += 1.5 * r.sum() / n
        got = fit_relevance(w_rel, x, targets, 20, 1.5)
        np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12)
        assert rows == 0 or not np.array_equal(got, w_rel)


def test_regression_em_recovers_the_position_bias():
    rng = np.random.default_rng(5)
    n, d, k = 30000, 6, 5
    x = rng.random((n, d))
    gamma = _sigmoid(x @ rng.normal(0, 3, d) - 2.0)
    pos = rng.integers(k, size=n)
    truth = examination(1.0, k)
    clicks = rng.random(n) < truth[pos] * gamma
    theta, w = np.full(k, 0.5), np.zeros(d + 1)
    for _ in range(300):
        examined, shown, targets = em_statistics(theta, w, x, pos, clicks)
        theta = em_theta(theta, examined, shown, 1.0)
        w = fit_relevance(w, x, targets, 5, 2.0)
    np.testing.assert_allclose(theta / theta[0], truth, atol=0.08)
    # the relevance regression ranks by the true relevance
    est = _sigmoid(x @ w[:-1] + w[-1])
    assert np.corrcoef(est, gamma)[0, 1] > 0.95


# ------------------------------------------------------------------------------ runs


def config(mq2008_dir, **params):
    raw = {
        "scenario": {"seed": 2},
        "dataset": {"path": str(mq2008_dir)},
        "federation": {
            "protocol": "fedips",
            "clients": 30,
            "queries_per_client": 5,
            "rounds": 30,
            "data": "shared",
            "params": {"logging_fraction": 0.05, "logging_epochs": 10, "gamma": 1.5, **params},
        },
        "evaluation": {"every": 10},
    }
    return validate(raw, "t")


def simulate(cfg, seed=2):
    sim = Simulation(cfg, seed, Observer())
    return run(sim.run()), sim


def test_fedips_runs_clients_see_the_logging_policy_and_models_learn(mq2008_dir):
    result, sim = simulate(config(mq2008_dir, lr_local=0.01))
    assert result["rounds"] == [10, 20, 30]
    assert set(result["offline"]) == {"ndcg@5", "ndcg@10"}
    assert result["online"]["interactions"] == 30 * 30 * 5
    facts = result["fedips"]
    n_train = sim.ctx.data.train.n_queries
    assert facts["estimator"] == "ips"
    assert facts["logging_queries"] == max(1, round(0.05 * n_train))
    # users only ever see f0's top k: the online metric is f0's on the issued queries
    logging = sim.proto.logging
    assert np.all(np.diff(np.flatnonzero(logging.table[0] >= 0)) == 1)
    gammas = [a.gamma_user for a in sim.agents.values() if hasattr(a, "gamma_user")]
    assert len(gammas) == 30 and min(gammas) > 0 and 1.3 < np.mean(gammas) < 1.7
    zero = sim.proto.metrics(LinearRanker(46))
    assert result["offline"]["ndcg@10"][-1] > zero["ndcg@10"] + 0.05
    assert result["messages"]["kinds"]["fedips.update"]["delivered"] == 30 * 30


def test_fedips_is_deterministic_and_the_estimators_differ(mq2008_dir):
    a, _ = simulate(config(mq2008_dir, lr_local=0.01))
    b, _ = simulate(config(mq2008_dir, lr_local=0.01))
    assert a["offline"] == b["offline"]
    naive, _ = simulate(config(mq2008_dir, lr_local=0.01, estimator="naive"))
    full, _ = simulate(config(mq2008_dir, lr_local=0.01, estimator="full_info"))
    assert naive["offline"] != a["offline"]
    # the full-information skyline beats both click learners on the same budget
    assert full["offline"]["ndcg@10"][-1] > max(
        a["offline"]["ndcg@10"][-1], naive["offline"]["ndcg@10"][-1]
    )


def test_federated_em_learns_the_position_bias_from_the_flat_start(mq2008_dir):
    result, _ = simulate(config(mq2008_dir, propensity="em", gamma=1.0, em_step=0.3), seed=3)
    est = np.array(result["fedips"]["em"]["propensity"])  # theta_k / theta_1, started flat
    truth = examination(1.0, 5)
    assert est[0] == 1.0 and np.all(est[1:] < 0.9) and est[-1] < est[1]
    assert np.abs(est - truth).mean() < 0.3 * np.abs(1.0 - truth).mean()


def test_m_clicks_per_user_fix_the_clicks_a_round_and_change_the_run(mq2008_dir):
    _, sim = simulate(config(mq2008_dir, lr_local=0.01, clicks=10))
    client = next(a for a in sim.agents.values() if hasattr(a, "gamma_user"))
    for _ in range(5):
        qs, clicks = client.interact()
        assert qs.size == 5 and clicks.shape == (5, 5) and clicks.sum() == 10
    a, _ = simulate(config(mq2008_dir, lr_local=0.01, clicks=10))
    b, _ = simulate(config(mq2008_dir, lr_local=0.01))
    assert a["offline"] != b["offline"]
    zero = sim.proto.metrics(LinearRanker(46))
    assert a["offline"]["ndcg@10"][-1] > zero["ndcg@10"] + 0.05


def test_fedips_refuses_secure_aggregation(mq2008_dir):
    with pytest.raises(ScenarioError, match="'fedips' does not support secure aggregation"):
        revise(config(mq2008_dir), {"federation": {"secure_aggregation": True}})


def test_logging_policy_uses_full_information_on_a_small_share(mq2008_dir):
    _, sim = simulate(config(mq2008_dir, lr_local=0.01))
    logging = sim.proto.logging
    test = sim.ctx.data.test
    f0 = ndcg(logging.ranker.score(test.features), test, k=10)
    assert np.nanmean(f0) > np.nanmean(ndcg(np.zeros(test.n_docs), test, k=10))

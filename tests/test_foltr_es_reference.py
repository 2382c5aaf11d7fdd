"""FOLtR-ES as its authors' public code (facebookresearch/foltr-es) builds it: the rankers and
their start, the ranking, the gradient and Adam step, the privatisation of every interaction;
then the two-layer network learning on the real MQ2008 sample."""

from types import SimpleNamespace

import numpy as np
import pytest

import foltr_async.protocols.foltr_es as es
from foltr_async.ltr.metrics import maxrr
from foltr_async.ltr.rankers import MLPRanker
from foltr_async.observe.observer import Observer
from foltr_async.protocols.learner import batch_kind
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import revise, validate
from foltr_async.simulation import Simulation

N_FEATURES = 46  # MQ2008


def config(
    data_dir, ranker=None, params=None, protocol="foltr_es", agents=(), **federation
) -> dict:
    raw = {
        "dataset": {"path": str(data_dir)},
        "clicks": {"model": "informational"},
        "ranker": ranker or {"kind": "linear"},
        "federation": {
            "protocol": protocol,
            "clients": 4,
            "queries_per_client": 4,
            "rounds": 2,
            "data": "shared",
            "params": params or {},
            **federation,
        },
        "evaluation": {"every": 1},
        "agents": list(agents),
    }
    return validate(raw, "test")


def built(cfg, seed=3) -> Simulation:
    sim = Simulation(cfg, seed, Observer())
    sim.build()
    return sim


def test_rankers_start_at_zero_the_two_layer_one_with_relu_units(mq2008_dir):
    linear = built(config(mq2008_dir)).ctx.new_ranker()
    assert linear.n_params == N_FEATURES and not linear.get_params().any()
    mlp10 = {"kind": "mlp", "hidden": [10]}
    two_layer = built(config(mq2008_dir, mlp10)).ctx.new_ranker()
    # fc1 (46 x 10 weights + 10 biases), ReLU, fc2 (10 weights, no bias): all zero
    assert two_layer.n_params == N_FEATURES * 10 + 10 + 10
    assert two_layer.activation == "relu" and not two_layer.get_params().any()
    # the authors' choice is FOLtR-ES's default only: FPDGD keeps its Glorot tanh network,
    # and a scenario can still ask FOLtR-ES for one
    pdgd_net = built(config(mq2008_dir, mlp10, protocol="fpdgd")).ctx.new_ranker()
    assert pdgd_net.activation == "tanh" and pdgd_net.get_params().any()
    asked = {**mlp10, "activation": "tanh", "init": "glorot"}
    glorot = built(config(mq2008_dir, asked)).ctx.new_ranker()
    assert glorot.activation == "tanh" and glorot.get_params().any()


def test_the_relu_network_scores_by_hand():
    net = MLPRanker(2, (2,), activation="relu", init="zero")
    # W (in x out) [[1, -1], [2, 0.5]], b [0, -0.8], output w [1, 3]
    net.set_params(np.array([1.0, -1.0, 2.0, 0.5, 0.0, -0.8, 1.0, 3.0]))
    x = np.array([[1.0, 1.0], [0.0, 2.0], [-1.0, 1.0]])
    # hidden relu([3, -1.3]) = [3, 0] -> 3; relu([4, 0.2]) -> 4 + 0.6; relu([1, 0.7]) -> 1 + 2.1
    assert net.score(x) == pytest.approx([3.0, 4.6, 3.1], abs=1e-12)
    # its gradient (for protocols that backpropagate) is the finite difference of the score
    weights = np.array([0.3, -1.2, 0.7])
    g = net.grad(x, weights)
    theta, h = net.get_params(), 1e-6
    for i in range(theta.size):
        up, down = theta.copy(), theta.copy()
        up[i] += h
        down[i] -= h
        net.set_params(up)
        f_up = weights @ net.score(x)
        net.set_params(down)
        f_down = weights @ net.score(x)
        assert g[i] == pytest.approx((f_up - f_down) / (2 * h), abs=1e-6), i
    # FPDGD's batched trainer computes tanh networks: a ReLU one trains through ``grad``
    assert batch_kind(net) is None and batch_kind(MLPRanker(2, (2,), init="zero")) == ("mlp", 2)


def test_gradient_and_adam_steps_by_hand(mq2008_dir):
    """g = 1/(N sigma^2) sum 1/2 (m+ - m-) e; the authors hand -g to torch's Adam (lr, betas
    (0.9, 0.999), eps 1e-8), which minimises: the same step as ascending g."""
    sigma, lr = 0.5, 0.1
    strategy = built(config(mq2008_dir, params={"sigma": sigma, "lr": lr})).proto.strategy

    def noise(seed):  # the seed's perturbation, as client and server draw it
        return np.random.Generator(np.random.PCG64(seed)).normal(0.0, sigma, N_FEATURES)

    def reply(seed, m_plus, m_minus):
        return SimpleNamespace(body={"seed": seed, "metric": m_plus, "antithetic_metric": m_minus})

    e1, e2 = noise(11), noise(12)
    g1 = (0.5 * (1.0 - 0.5) * e1 + 0.5 * (0.2 - 0.0) * e2) / (2 * sigma**2)
    strategy.aggregate(1, [reply(11, 1.0, 0.5), reply(12, 0.2, 0.0)])
    # first step: m_hat = g, v_hat = g^2
    step1 = lr * g1 / (np.abs(g1) + 1e-8)
    assert np.allclose(strategy.model, step1, rtol=1e-12, atol=0)
    # without antithetic variates: g = 1/(N sigma^2) sum m e
    g2 = (0.25 * e1) / (1 * sigma**2)
    strategy.aggregate(2, [reply(11, 0.25, None)])
    m = 0.9 * (0.1 * g1) + 0.1 * g2
    v = 0.999 * (0.001 * g1**2) + 0.001 * g2**2
    m_hat, v_hat = m / (1 - 0.9**2), v / (1 - 0.999**2)
    assert np.allclose(strategy.model, step1 + lr * m_hat / (np.sqrt(v_hat) + 1e-8), rtol=1e-12)


def spied_client(mq2008_dir, params):
    """A client of a built run whose users' ``show`` also records (query, ranking, clicks)."""
    sim = built(config(mq2008_dir, params=params))
    client = sim.agents["client-0000"]
    shown, show = [], client.users.show

    def record(q, ranking, stream=None):
        clicks = show(q, ranking, stream)
        shown.append((q, ranking, clicks))
        return clicks

    client.users.show = record
    return client, shown


def test_a_client_shows_a_descending_sort_and_sends_the_exact_mean_maxrr(mq2008_dir):
    client, shown = spied_client(mq2008_dir, {"p": 1.0})
    train = client.users.train
    theta = np.random.default_rng(0).normal(0.0, 1.0, N_FEATURES)
    not_a_level = 0
    for _ in range(30):
        shown.clear()
        sent = client._serve(theta, 3)
        for q, ranking, _ in shown:
            scores = train.features[train.doc_range(q)].astype(np.float64) @ theta
            assert np.array_equal(ranking, np.argsort(scores)[::-1][:10])  # the authors' sort
        values = [maxrr(clicks, 10) for _, _, clicks in shown]
        assert sent == sum(values) / 3  # p = 1: the mean itself, never rounded to a level
        not_a_level += not np.isclose(es.LEVELS, sent).any()
    assert not_a_level > 0  # the means that a rounding to the 11 levels would change


def test_randomised_response_keeps_the_truth_with_p_else_a_uniform_other_level():
    rng = np.random.default_rng(1)
    n, p, true = 40_000, 0.6, 1.0 / 3
    sent = np.array([es.privatise(true, p, rng) for _ in range(n)])
    levels, counts = np.unique(sent, return_counts=True)
    assert np.allclose(levels, es.LEVELS)  # every one of the 11 values, nothing else
    expected = np.where(np.isclose(levels, true), p, (1 - p) / 10)
    assert np.all(np.abs(counts / n - expected) < 4 * np.sqrt(expected * (1 - expected) / n))


def test_every_interaction_is_privatised_before_the_half_is_averaged(mq2008_dir):
    p = 0.5
    client, shown = spied_client(mq2008_dir, {"p": p})
    theta = np.random.default_rng(2).normal(0.0, 1.0, N_FEATURES)
    total = es.LEVELS.sum()
    residuals, not_a_level = [], 0
    for _ in range(3000):
        shown.clear()
        sent = client._serve(theta, 2)
        true = [maxrr(clicks, 10) for _, _, clicks in shown]
        # twice the sent value is a sum of two levels: one privatised value per interaction
        pair_sums = es.LEVELS[:, None] + es.LEVELS[None, :]
        assert np.isclose(pair_sums, 2 * sent).any()
        not_a_level += not np.isclose(es.LEVELS, sent).any()
        # E[privatised t] = p t + (1 - p) (sum of the other levels) / 10
        expected = np.mean([p * t + (1 - p) * (total - t) / 10 for t in true])
        residuals.append(sent - expected)
    assert not_a_level > 1000  # a half's single privatised mean would always be a level
    assert abs(np.mean(residuals)) < 4 * np.std(residuals) / np.sqrt(len(residuals))


def test_the_eavesdropper_scores_only_values_that_are_one_privatised_level(mq2008_dir):
    eve = [{"behaviour": "eavesdropper", "targets": "all"}]
    for b, privatise, scored in ((4, "interaction", 0), (2, "interaction", 16), (4, "mean", 16)):
        params = {"p": 0.5, "privatise": privatise}
        cfg = config(mq2008_dir, params=params, agents=eve, queries_per_client=b)
        e = run(Simulation(cfg, 3, Observer()).run())["eavesdrop"]["eve-0"]
        # 4 clients x 2 rounds x 2 antithetic halves, each of b / 2 interactions
        assert (e["metrics"], e["averaged"]) == (scored, 16 - scored), (b, privatise)


def test_the_two_layer_network_learns_on_real_mq2008(mq2008_dir):
    """The authors' settings (sigma 0.01, Adam lr 1e-3, B = 4, antithetic, MaxRR, p = 1): a
    Glorot-initialised tanh network barely moved in as many rounds (its random start dwarfs
    what 1e-3 steps change); the zero-initialised ReLU one learns."""
    cfg = config(mq2008_dir, {"kind": "mlp", "hidden": [10]}, clients=50, rounds=80)
    cfg = revise(cfg, {"evaluation": {"every": 80}})
    sim = built(cfg, seed=1)
    assert not sim.proto.strategy.model.any()
    zero = sim.ctx.evaluate(sim.ctx.new_ranker())
    sim = Simulation(cfg, 1, Observer())
    result = run(sim.run())
    net = sim.ctx.new_ranker()
    net.set_params(sim.proto.strategy.model)
    for layer, part in net.layer_slices().items():
        assert np.linalg.norm(sim.proto.strategy.model[part]) > 0.01, layer
    assert result["offline"]["ndcg@10"][-1] > zero["ndcg@10"] + 0.1
    assert result["offline"]["maxrr@10"][-1] > zero["maxrr@10"] + 0.02

"""FOLtR-ES with ``streams = "authors"``: the randomness of the authors' client as published
(facebookresearch/foltr-es: a numpy RandomState per client, reseeded each round with the seed it
sends, which also seeds the noise; clicks drawn down the list, a stop draw only after a click)."""

from types import SimpleNamespace

import numpy as np

import foltr_async.protocols.foltr_es as es
from foltr_async.ltr.clicks import cascade
from foltr_async.ltr.rankers import MLPRanker
from foltr_async.observe.observer import Observer
from foltr_async.runtime.clock import run
from foltr_async.scenario.load import revise
from foltr_async.simulation import Simulation
from tests.test_foltr_es_reference import N_FEATURES, built, config


def config_of(mq2008_dir, **federation):
    return config(mq2008_dir, params={"streams": "authors"}, **federation)


class Uniforms:
    """A stream handing out the given uniforms in order (counting how many were taken)."""

    def __init__(self, values):
        self.values, self.taken = list(values), 0

    def random_sample(self):
        self.taken += 1
        return self.values[self.taken - 1]


def test_scan_draws_one_uniform_per_position_and_a_stop_draw_only_after_a_click():
    nav = cascade("navigational", 3)  # P(click) 0.05 / 0.5 / 0.95, P(stop) 0.2 / 0.5 / 0.9
    labels = np.array([2, 0, 1, 2, 2])
    # grade 2 clicked (0.5 < 0.95), no stop (0.95); grade 0 not clicked (0.9), so no stop
    # draw; grade 1 clicked (0.1 < 0.5) and stops (0.4 < 0.5): the last two are never drawn
    stream = Uniforms([0.5, 0.95, 0.9, 0.1, 0.4, 0.0, 0.0])
    assert nav.scan(labels, stream).tolist() == [True, False, True, False, False]
    assert stream.taken == 5


def test_scan_clicks_as_often_as_the_cascade_model_says():
    model = cascade("informational", 3)
    labels = np.array([1, 0, 2, 2, 1, 0, 0, 2, 1, 0])
    stream, n = np.random.RandomState(4), 20_000
    rate = np.mean([model.scan(labels, stream) for _ in range(n)], axis=0)
    p = model.click_probability(labels)
    assert np.all(np.abs(rate - p) < 4 * np.sqrt(p * (1 - p) / n))


def test_the_noise_is_their_per_parameter_draw_in_our_layout(mq2008_dir):
    """Their ``perturb_model``: a RandomState(seed), then per parameter in torch's order (fc1
    weight (10, 46), fc1 bias, fc2 weight (1, 10)) a normal draw, each cast to float32."""
    seed, sigma = 123456789, 0.01
    net = MLPRanker(N_FEATURES, (10,), activation="relu", init="zero")
    e = es.authors_noise(seed, sigma, es.torch_layout(net))
    rnd = np.random.RandomState(seed)
    fc1_w, fc1_b, fc2_w = (
        rnd.normal(np.zeros(shape, np.float32), sigma, size=shape).astype(np.float32)
        for shape in ((10, N_FEATURES), (10,), (1, 10))
    )
    views = net.layer_slices()
    hidden = e[views["hidden0"]]
    assert np.array_equal(hidden[: 10 * N_FEATURES].reshape(N_FEATURES, 10), fc1_w.T)
    assert np.array_equal(hidden[10 * N_FEATURES :], fc1_b)
    assert np.array_equal(e[views["output"]], fc2_w[0])
    linear = built(config_of(mq2008_dir)).ctx.new_ranker()
    line = np.random.RandomState(seed).normal(0.0, sigma, N_FEATURES).astype(np.float32)
    assert np.array_equal(es.authors_noise(seed, sigma, es.torch_layout(linear)), line)


def test_the_server_regenerates_the_authors_noise_from_the_seed(mq2008_dir):
    sigma = 0.01
    strategy = built(config_of(mq2008_dir)).proto.strategy
    reply = SimpleNamespace(body={"seed": 77, "metric": 0.5, "antithetic_metric": 0.25})
    e = np.random.RandomState(77).normal(0.0, sigma, N_FEATURES).astype(np.float32)
    e = e.astype(np.float64)  # the float32 values, in float64
    # 1 / (N sigma^2) * 1/2 (m+ - m-) e, one reply
    assert np.allclose(strategy.gradient([reply]), 0.5 * 0.25 * e / sigma**2, rtol=1e-12)


def first_queries_follow_the_seed(mq2008_dir, streams: str) -> float:
    """Over a client's rounds: how often the first query its users issue is the one
    ``RandomState(seed)`` picks first, ``seed`` being the one the client sends."""
    params = {"streams": streams}
    client = built(config(mq2008_dir, params=params)).agents["client-0000"]
    users, theta, hits = client.users, np.zeros(N_FEATURES), 0
    pool = users.queries
    for _ in range(200):
        users.issued = []
        seed = client._draw_seed()
        client._serve(theta + es.noise(seed, N_FEATURES, client.sigma, client.layout), 2)
        first = np.random.RandomState(seed % 2**32).randint(0, len(pool))  # ours: < 2**63
        hits += users.issued[0] == pool[first]
    return hits / 200


def test_the_users_draws_come_from_the_stream_the_sent_seed_starts(mq2008_dir):
    """The coupling this mode restores: the round's queries (and clicks) are drawn from a
    stream reseeded with the seed the client sends; ours draws them independently of it."""
    assert first_queries_follow_the_seed(mq2008_dir, "authors") == 1.0
    assert first_queries_follow_the_seed(mq2008_dir, "independent") < 0.1  # chance: 1 / 69


def test_authors_streams_learn_and_repeat_bit_for_bit(mq2008_dir):
    cfg = config_of(mq2008_dir, clients=50, rounds=60)
    cfg = revise(cfg, {"clicks": {"model": "perfect"}, "evaluation": {"every": 60}})
    ctx = built(cfg).ctx
    zero = ctx.evaluate(ctx.new_ranker())
    models, results = [], []
    for _ in range(2):
        sim = Simulation(cfg, 5, Observer())
        results.append(run(sim.run()))
        models.append(sim.proto.strategy.model)
    assert results[0]["offline"]["maxrr@10"][-1] > zero["maxrr@10"] + 0.02
    assert np.array_equal(models[0], models[1])
    assert results[0]["online"] == results[1]["online"]

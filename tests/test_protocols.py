"""Protocol pieces checked in isolation: messages, DP noise, privatisation, calibration."""

import math

import numpy as np
import pytest
from scipy import stats

from foltr_async.protocols.foltr_es import LEVELS, epsilon_bound, perturbation, privatise
from foltr_async.protocols.fpdgd import gamma_noise
from foltr_async.protocols.learner import clip_norm
from foltr_async.protocols.unlearning import calibrate
from foltr_async.runtime.wire import DropMessage, Envelope, decode, encode

MESSAGES = [
    ("fpdgd.model", {"params": np.arange(5.0)}),
    ("fpdgd.update", {"params": np.ones(5), "n_interactions": 4}),
    ("fpdgd.calibrate", {"params": np.ones(3), "stored_round": 10}),
    ("fpdgd.calibrated", {"update": np.ones(3), "n_interactions": 2}),
    ("unlearn.request", {"client": "client-0009"}),
    (
        "foltr_es.seed_metric",
        {"seed": 2**40, "metric": 0.5, "antithetic_metric": None, "n_interactions": 4},
    ),
    (
        "central.log",
        {
            "queries": np.arange(2),
            "rankings": np.zeros((2, 10), dtype=np.int64),
            "clicks": np.zeros((2, 10), dtype=bool),
        },
    ),
]


@pytest.mark.parametrize(("kind", "body"), MESSAGES)
def test_message_schemas_round_trip(kind, body):
    env = decode(encode(Envelope(kind, "a", "b", body, round=3, seq=1)))
    assert env.kind == kind and env.round == 3
    for key, value in body.items():
        assert (
            np.array_equal(env.body[key], value)
            if isinstance(value, np.ndarray)
            else (env.body[key] == value)
        )


def test_wrong_body_is_rejected_by_schema():
    with pytest.raises(DropMessage) as e:
        decode(encode(Envelope("fpdgd.update", "a", "b", {"params": np.ones(3)})))
    assert e.value.reason == "bad_schema"


def test_gamma_shares_sum_to_laplace_over_the_clients():
    """FPDGD Algorithm 3: sum over |C| clients of gamma - gamma' is Laplace(Delta/epsilon)."""
    rng = np.random.default_rng(0)
    n_clients, scale, draws = 20, 5.0 / 4.5, 4000
    total = sum(gamma_noise(rng, n_clients, scale, draws) for _ in range(n_clients))
    assert stats.kstest(total, stats.laplace(scale=scale).cdf).pvalue > 0.01
    assert stats.kstest(total, stats.laplace(scale=2 * scale).cdf).pvalue < 1e-6
    # one client's share alone is far from Laplace(scale): much smaller spread
    assert np.std(gamma_noise(rng, n_clients, scale, draws)) < 0.5 * np.std(total)


def test_clip_norm():
    v = np.array([3.0, 4.0])
    assert np.allclose(clip_norm(v, 2.5), [1.5, 2.0])
    assert clip_norm(v, 10.0) is v


def test_privatisation_keeps_the_true_level_with_probability_p():
    rng = np.random.default_rng(1)
    for p in (0.25, 0.5, 0.9):
        sent = np.array([privatise(1 / 3, p, rng) for _ in range(20000)])
        kept = np.mean(sent == LEVELS[np.argmin(np.abs(LEVELS - 1 / 3))])
        assert abs(kept - p) < 0.015, p
        others = sent[sent != 1 / 3]
        counts = np.unique(others, return_counts=True)[1]
        assert len(counts) == 10 and stats.chisquare(counts).pvalue > 0.001
    assert privatise(0.34, 1.0, rng) == pytest.approx(1 / 3)  # rounds to the nearest level


def test_epsilon_bound():
    assert epsilon_bound(0.9) == pytest.approx(math.log(0.9 * 10 / 0.1))
    assert epsilon_bound(1.0) == math.inf
    assert epsilon_bound(1 / 11) == pytest.approx(0.0, abs=1e-12)


def test_perturbation_is_reproducible_from_its_seed():
    assert np.array_equal(perturbation(7, 5, 0.1), perturbation(7, 5, 0.1))
    assert np.std(perturbation(8, 100000, 0.1)) == pytest.approx(0.1, rel=0.02)


def test_fedEraser_calibration_keeps_direction_of_new_and_length_of_stored():
    stored, new = np.array([0.0, 10.0]), np.array([3.0, 4.0])
    out = calibrate(stored, new)
    assert np.linalg.norm(out) == pytest.approx(10.0)
    assert np.allclose(out / np.linalg.norm(out), new / 5.0)
    assert np.all(calibrate(stored, np.zeros(2)) == 0)

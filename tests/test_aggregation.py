"""Aggregators on hand-made updates whose answers can be worked out by hand."""

import numpy as np
import pytest

from foltr_async.protocols.aggregation import fedavg, krum, median, multi_krum, trimmed_mean

HONEST = np.array([[1.0, 0.0], [1.1, 0.1], [0.9, -0.1], [1.0, 0.2]])
BAD = np.array([[-50.0, 40.0]])
ALL = np.vstack([HONEST, BAD])
W = np.ones(len(ALL))


def test_fedavg_weights_by_interactions():
    ups = np.array([[0.0, 0.0], [3.0, 6.0]])
    assert np.allclose(fedavg(ups, np.array([2.0, 1.0])), [1.0, 2.0])


def test_fedavg_is_pulled_by_an_outlier_but_robust_rules_are_not():
    assert fedavg(ALL, W)[0] < 0  # one attacker drags the mean far away
    for rule in (krum, multi_krum, trimmed_mean, median):
        out = rule(ALL, W, 1)
        assert np.all(np.abs(out - HONEST.mean(axis=0)) < 0.25), rule.__name__


def test_krum_picks_the_most_central_update():
    # client 0 (1.0, 0.0) has the smallest summed squared distance to its n - m - 2 = 2 nearest
    dists = ((HONEST[:, None] - HONEST[None]) ** 2).sum(-1)
    np.fill_diagonal(dists, np.inf)
    scores = np.sort(dists, axis=1)[:, :2].sum(1)
    assert np.array_equal(krum(ALL, W, 1), HONEST[np.argmin(scores)])


def test_multi_krum_averages_the_n_minus_m_best():
    assert np.allclose(multi_krum(ALL, W, 1), HONEST.mean(axis=0))


def test_trimmed_mean_drops_m_per_side_per_coordinate():
    ups = np.array([[1.0], [2.0], [3.0], [100.0], [-100.0]])
    assert trimmed_mean(ups, np.ones(5), 1)[0] == pytest.approx(2.0)
    assert trimmed_mean(ups, np.ones(5), 0)[0] == pytest.approx(ups.mean())


def test_median_of_even_count_is_mean_of_middle_pair():
    ups = np.array([[1.0], [2.0], [4.0], [10.0]])
    assert median(ups, np.ones(4))[0] == pytest.approx(3.0)

"""Aggregators: pure functions from the round's client models to the next global model.

Every function takes ``updates`` (n x d, one row per client, rows in client-id order),
``weights`` (n, e.g. interactions per client) and ``m`` (the number of malicious clients the
defender assumes) and returns a d-vector. Robust rules ignore the weights, as in their papers.
"""

from __future__ import annotations

import numpy as np

from foltr_async.registry import AggregatorEntry


def fedavg(updates: np.ndarray, weights: np.ndarray, m: int = 0) -> np.ndarray:
    """FedAvg (McMahan et al. 2017): the average of client models weighted by their data."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if total <= 0:
        return updates.mean(axis=0)
    return (w / total) @ updates


def _krum_scores(updates: np.ndarray, m: int) -> np.ndarray:
    n = len(updates)
    sq = np.einsum("ij,ij->i", updates, updates)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * updates @ updates.T, 0.0)
    np.fill_diagonal(dist, np.inf)
    k = max(1, n - m - 2)
    k = min(k, n - 1) if n > 1 else 0
    if k == 0:
        return np.zeros(n)
    nearest = np.partition(dist, k - 1, axis=1)[:, :k]
    return nearest.sum(axis=1)


def krum(updates: np.ndarray, weights: np.ndarray, m: int = 0) -> np.ndarray:
    """Krum (Blanchard et al. 2017): the update with the smallest summed squared distance to its
    n - m - 2 nearest neighbours; ties go to the lowest client id."""
    return updates[int(np.argmin(_krum_scores(updates, m)))].copy()


def multi_krum(updates: np.ndarray, weights: np.ndarray, m: int = 0) -> np.ndarray:
    """Multi-Krum (Blanchard et al. 2017): the plain mean of the f = n - m lowest Krum scores."""
    f = max(1, len(updates) - m)
    chosen = np.argsort(_krum_scores(updates, m), kind="stable")[:f]
    return updates[chosen].mean(axis=0)


def trimmed_mean(updates: np.ndarray, weights: np.ndarray, m: int = 0) -> np.ndarray:
    """Coordinate-wise trimmed mean (Yin et al. 2018): drop the beta = m largest and m smallest
    values per coordinate, average the rest (beta is capped so at least one value remains)."""
    n = len(updates)
    beta = min(m, (n - 1) // 2)
    ordered = np.sort(updates, axis=0)
    return ordered[beta : n - beta].mean(axis=0)


def median(updates: np.ndarray, weights: np.ndarray, m: int = 0) -> np.ndarray:
    """Coordinate-wise median (Yin et al. 2018); mean of the two middle values when n is even."""
    return np.median(updates, axis=0)


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    AggregatorEntry("fedavg", "FedAvg, weighted by interactions", fedavg),
    AggregatorEntry("krum", "Krum: the single most central update", krum, robust=True),
    AggregatorEntry(
        "multi_krum", "Multi-Krum: mean of the n - m most central updates", multi_krum, robust=True
    ),
    AggregatorEntry(
        "trimmed_mean", "coordinate-wise trimmed mean, beta = m", trimmed_mean, robust=True
    ),
    AggregatorEntry("median", "coordinate-wise median", median, robust=True),
)

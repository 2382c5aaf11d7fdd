"""Simulated users: the cascade click model of the OLTR literature and a position-based model.

Cascade instantiations (perfect, navigational, informational) follow Hofmann et al. (2013) and
Oosterhuis & de Rijke (2018) for 5-grade data and Wang et al. (2021, FPDGD) for 3-grade data; the
``poison`` model inverts relevance for untargeted poisoning attacks (Wang & Zuccon, ICTIR 2023). The
position-based model is the FedIPS user (Wang et al. 2021): examination ``(1/rank)^gamma``, click
when examined with probability 1 on relevant grades and 0.1 otherwise. A mixture draws one of its
models per interaction.

Every model has ``simulate(labels_in_displayed_order, rng) -> bool clicks`` drawing all its
uniforms in one call, so one interaction costs a few numpy operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# name -> (P(click | grade), P(stop | click, grade)), indexed by grade.
CASCADE_5 = {
    "perfect": ((0.0, 0.2, 0.4, 0.8, 1.0), (0.0, 0.0, 0.0, 0.0, 0.0)),
    "navigational": ((0.05, 0.3, 0.5, 0.7, 0.95), (0.2, 0.3, 0.5, 0.7, 0.9)),
    "informational": ((0.4, 0.6, 0.7, 0.8, 0.9), (0.1, 0.2, 0.3, 0.4, 0.5)),
    "poison": ((1.0, 0.8, 0.4, 0.2, 0.0), (0.0, 0.0, 0.0, 0.0, 0.0)),
}
CASCADE_3 = {
    "perfect": ((0.0, 0.5, 1.0), (0.0, 0.0, 0.0)),
    "navigational": ((0.05, 0.5, 0.95), (0.2, 0.5, 0.9)),
    "informational": ((0.4, 0.7, 0.9), (0.1, 0.3, 0.5)),
    "poison": ((1.0, 0.5, 0.0), (0.0, 0.0, 0.0)),
}
CASCADE_NAMES = tuple(CASCADE_5)
MODEL_NAMES = (*CASCADE_NAMES, "pbm")


def _grade_index(labels: np.ndarray, n: int) -> np.ndarray:
    """Grades as table indices: above the table clamps to the top grade, below to 0.

    (``np.minimum`` / ``np.maximum``: the same integers as ``np.clip`` at a fraction of its
    call cost, which showed in one-query-at-a-time simulation.)
    """
    return np.minimum(np.maximum(np.asarray(labels, dtype=np.int64), 0), n - 1)


@dataclass(frozen=True, eq=False)
class CascadeModel:
    """Top-down scan: click with P(click|r); only after a click, stop with P(stop|click, r)."""

    name: str
    p_click: np.ndarray
    p_stop: np.ndarray

    def simulate(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        g = _grade_index(labels, len(self.p_click))
        u = rng.random((2, g.size))
        clicks = u[0] < self.p_click[g]
        stops = clicks & (u[1] < self.p_stop[g])
        if stops.any():
            clicks[int(np.argmax(stops)) + 1 :] = False
        return clicks

    def scan(self, labels: np.ndarray, stream: np.random.RandomState) -> np.ndarray:
        """Clicks drawn in the order of the FOLtR-ES authors' click model: down the list, one
        uniform for the click, a second only after a click for the stop, none past the stop
        (so how many are drawn depends on the clicks: a stream shared with other draws, as
        theirs is, must be read in this order)."""
        g = _grade_index(labels, len(self.p_click))
        p_click, p_stop = self.p_click[g].tolist(), self.p_stop[g].tolist()
        clicks = np.zeros(g.size, dtype=bool)
        draw = stream.random_sample
        for i in range(g.size):
            if draw() < p_click[i]:
                clicks[i] = True
                if draw() < p_stop[i]:
                    break
        return clicks

    def click_probability(self, labels: np.ndarray) -> np.ndarray:
        """Per-position P(click) of a displayed list, accounting for earlier stops (for tests)."""
        g = _grade_index(labels, len(self.p_click))
        pc = self.p_click[g]
        cont = 1.0 - pc * self.p_stop[g]  # P(not stopping at this position)
        reach = np.concatenate(([1.0], np.cumprod(cont)[:-1]))
        return reach * pc


def grade_scale(max_grade: int) -> int:
    """The click tables' grade scale for data whose highest grade is ``max_grade``: 3 for
    LETOR 4.0's 0-2 (MQ2007/2008), 5 above it (MSLR-WEB10K, Yahoo!, Istella-S grade 0-4), as
    the thesis instantiates the cascade models per dataset (seeds/000, Section 2.2.1, Tables
    2.1 and 2.2). Runs and ``dataset check`` both decide by this one rule."""
    return 3 if max_grade <= 2 else 5


def cascade(name: str, n_grades: int) -> CascadeModel:
    """The named cascade model for a dataset with grades ``0..n_grades-1``.

    Datasets with at most 3 grades (MQ2007/2008) use the 3-grade table; others the 5-grade one.
    """
    table = CASCADE_3 if n_grades <= 3 else CASCADE_5
    if name not in table:
        raise ValueError(f"unknown click model {name!r}; known: {', '.join(MODEL_NAMES)}")
    pc, ps = table[name]
    return CascadeModel(name, np.array(pc, dtype=np.float64), np.array(ps, dtype=np.float64))


@dataclass(frozen=True)
class PositionBasedModel:
    """Examination ``(1/rank)^gamma_user``; click = exam on relevant grades, ``noise * exam`` else.

    FedIPS uses 5-grade data with relevant grades {3, 4}; for 3-grade data pass ``{2}``
    (``click_model("pbm", 3)`` does).
    """

    gamma_user: float = 1.0
    relevant: frozenset[int] = frozenset({3, 4})
    noise: float = 0.1
    name: str = "pbm"

    def examination(self, n: int) -> np.ndarray:
        """P(examine) at ranks 1..n: the propensities an IPS learner divides by."""
        return (1.0 / np.arange(1, n + 1, dtype=np.float64)) ** self.gamma_user

    def click_probability(self, labels: np.ndarray) -> np.ndarray:
        labels = np.asarray(labels)
        rel = np.isin(labels, np.fromiter(self.relevant, dtype=np.int64))
        return self.examination(labels.size) * np.where(rel, 1.0, self.noise)

    def simulate(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        p = self.click_probability(labels)
        return rng.random(p.size) < p


@dataclass(frozen=True, eq=False)
class MixtureClickModel:
    """Users from a population: each interaction's click model is drawn uniformly (``models``:
    cascade or position-based models; non-IID type 3's IID mixture)."""

    models: tuple
    name: str = "mixture"

    def simulate(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return self.models[int(rng.integers(len(self.models)))].simulate(labels, rng)


def click_model(name: str, n_grades: int, **kw) -> CascadeModel | PositionBasedModel:
    """Look a user model up by the name a scenario gives (``kw`` configures ``pbm`` only)."""
    if name == "pbm":
        if "relevant" not in kw:
            kw["relevant"] = frozenset({2}) if n_grades <= 3 else frozenset({3, 4})
        else:
            kw["relevant"] = frozenset(int(r) for r in kw["relevant"])
        return PositionBasedModel(**kw)
    if kw:
        raise ValueError(f"cascade click model {name!r} takes no options, got {sorted(kw)}")
    return cascade(name, n_grades)

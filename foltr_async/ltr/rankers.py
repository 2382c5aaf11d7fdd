"""Scoring functions whose parameters live in one flat float64 vector.

Every federated protocol moves, averages, clips, noises and attacks *vectors*, so a ranker
exposes its parameters only as one flat vector (``get_params`` / ``set_params``), and the
layers as named slices of it (``layer_slices``) for FedPer, which shares the base layers and
keeps the last one personal (Arivazhagan et al. 2019).

``grad(features, doc_weights)`` is the gradient of ``sum_i doc_weights[i] * score_i``: PDGD
(Oosterhuis & de Rijke 2018) and FedIPS (Wang et al. 2021) both reduce their update to per-document
weights, so one backward pass serves both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

_CHUNK = 8192  # rows scored in one call; a larger input goes in blocks
_BLOCK = 2048  # rows per block of a larger input (2.2 MB as float64 at 136 features: in cache)


class Ranker(ABC):
    """Common flat-parameter plumbing; subclasses define ``score`` and ``grad``."""

    _flat: np.ndarray

    @property
    def n_params(self) -> int:
        return self._flat.size

    def get_params(self) -> np.ndarray:
        """A copy, so a caller (an update message, a stored checkpoint) never aliases the model."""
        return self._flat.copy()

    def set_params(self, flat: np.ndarray) -> None:
        """Copy ``flat`` in place: the layer views stay valid."""
        flat = np.asarray(flat, dtype=np.float64)
        if flat.shape != self._flat.shape:
            raise ValueError(f"expected {self._flat.size} parameters, got shape {flat.shape}")
        self._flat[:] = flat

    @abstractmethod
    def layer_slices(self) -> dict[str, slice]:
        """Which slices of the flat vector belong to which layer (FedPer shares some)."""

    def score(self, features: np.ndarray) -> np.ndarray:
        """float64 scores of any (n, n_features) array: one query or a whole QuerySet.

        More than ``_CHUNK`` rows (a large held-out set) go in blocks of ``_BLOCK``, float32 ones
        upcast into one reused float64 buffer that stays in cache: no float64 copy of the whole
        matrix, nor a fresh one per block, and the same products bit for bit (timings in
        docs/PERFORMANCE.md, "Held-out scoring").
        """
        n = features.shape[0]
        if n <= _CHUNK:
            return self._score(features)
        out = np.empty(n, dtype=np.float64)
        buffer = None if features.dtype == np.float64 else np.empty((_BLOCK, features.shape[1]))
        for i in range(0, n, _BLOCK):
            rows = features[i : i + _BLOCK]
            if buffer is not None:
                np.copyto(buffer[: rows.shape[0]], rows)
                rows = buffer[: rows.shape[0]]
            out[i : i + _BLOCK] = self._score(rows)
        return out

    @abstractmethod
    def _score(self, features: np.ndarray) -> np.ndarray:
        """Scores of at most ``_CHUNK`` rows."""

    @abstractmethod
    def grad(self, features: np.ndarray, doc_weights: np.ndarray) -> np.ndarray:
        """Gradient of sum_i doc_weights[i] * score_i with respect to the flat parameters."""

    @abstractmethod
    def copy(self) -> Ranker:
        """An independent ranker with the same parameters."""


class LinearRanker(Ranker):
    """score = features @ w; zero-initialised as in PDGD and FPDGD (Wang et al. 2021)."""

    def __init__(self, n_features: int) -> None:
        self.n_features = int(n_features)
        self._flat = np.zeros(self.n_features, dtype=np.float64)

    def layer_slices(self) -> dict[str, slice]:
        return {"output": slice(0, self.n_features)}

    def _score(self, features: np.ndarray) -> np.ndarray:
        # batched PDGD scores in its compiled kernel instead, equal up to float rounding
        return features @ self._flat

    def grad(self, features: np.ndarray, doc_weights: np.ndarray) -> np.ndarray:
        # PDGD weights are non-zero on a handful of documents: skip the rest.
        nz = np.flatnonzero(doc_weights)
        return features[nz].T.astype(np.float64) @ doc_weights[nz]

    def copy(self) -> LinearRanker:
        other = LinearRanker(self.n_features)
        other.set_params(self._flat)
        return other


class MLPRanker(Ranker):
    """A multi-layer perceptron with a linear output.

    Flat layout: for each hidden layer ``W (in, out)`` then ``b (out,)``; the output layer is
    ``w (last_hidden,)`` without bias, since a constant shift never changes a ranking.

    ``activation`` "tanh" with ``init`` "glorot" (Glorot-uniform weights, zero biases: tanh starts
    near-linear) is the PDGD paper's neural ranker; "relu" with "zero" (every parameter 0) is
    FOLtR-ES's two-layer ranker (Kharitonov, WSDM 2019, as its authors' code builds it): ES
    perturbs all the parameters at once, so it needs no random start, whereas a gradient
    through a zero network would vanish.
    """

    ACTIVATIONS = ("tanh", "relu")
    INITS = ("glorot", "zero")

    def __init__(
        self,
        n_features: int,
        hidden: tuple[int, ...] | list[int] = (64,),
        rng: np.random.Generator | None = None,
        init_scale: float = 1.0,
        activation: str = "tanh",
        init: str = "glorot",
    ) -> None:
        hidden = tuple(int(h) for h in hidden)
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden must list one or more positive layer sizes, got {hidden}")
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation must be one of {self.ACTIVATIONS}, got {activation!r}")
        if init not in self.INITS:
            raise ValueError(f"init must be one of {self.INITS}, got {init!r}")
        self.n_features = int(n_features)
        self.hidden = hidden
        self.activation = activation
        sizes = (self.n_features, *hidden)
        shapes: list[tuple[str, tuple[int, ...]]] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            shapes += [(f"hidden{i}.W", (a, b)), (f"hidden{i}.b", (b,))]
        shapes.append(("output.w", (hidden[-1],)))
        total = sum(int(np.prod(s)) for _, s in shapes)
        self._flat = np.zeros(total, dtype=np.float64)
        self._views: dict[str, np.ndarray] = {}
        self._slices: dict[str, slice] = {}
        start = 0
        for name, shape in shapes:
            size = int(np.prod(shape))
            self._views[name] = self._flat[start : start + size].reshape(shape)
            self._slices[name] = slice(start, start + size)
            start += size
        if init == "glorot" and rng is not None:
            for name, shape in shapes:
                if name.endswith(".b"):
                    continue
                fan_in, fan_out = (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)
                lim = init_scale * np.sqrt(6.0 / (fan_in + fan_out))
                self._views[name][...] = rng.uniform(-lim, lim, size=shape)

    def _weights(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [
            (self._views[f"hidden{i}.W"], self._views[f"hidden{i}.b"])
            for i in range(len(self.hidden))
        ]

    def layer_slices(self) -> dict[str, slice]:
        """One slice per layer (weights and bias together), input side first, ``output`` last."""
        out = {}
        for i in range(len(self.hidden)):
            out[f"hidden{i}"] = slice(
                self._slices[f"hidden{i}.W"].start, self._slices[f"hidden{i}.b"].stop
            )
        out["output"] = self._slices["output.w"]
        return out

    def _forward(self, features: np.ndarray) -> list[np.ndarray]:
        acts = [np.asarray(features, dtype=np.float64)]
        for W, b in self._weights():
            pre = acts[-1] @ W + b
            acts.append(np.tanh(pre) if self.activation == "tanh" else np.maximum(pre, 0.0))
        return acts

    def _score(self, features: np.ndarray) -> np.ndarray:
        return self._forward(features)[-1] @ self._views["output.w"]

    def grad(self, features: np.ndarray, doc_weights: np.ndarray) -> np.ndarray:
        nz = np.flatnonzero(doc_weights)
        w = np.asarray(doc_weights, dtype=np.float64)[nz]
        acts = self._forward(features[nz])
        g = np.zeros_like(self._flat)
        g[self._slices["output.w"]] = acts[-1].T @ w
        # delta = d(sum w_i s_i) / d(activation) of the current layer, one row per document
        delta = w[:, None] * self._views["output.w"][None, :]
        for i in range(len(self.hidden) - 1, -1, -1):
            a = acts[i + 1]
            dpre = delta * ((1.0 - a**2) if self.activation == "tanh" else (a > 0.0))
            g[self._slices[f"hidden{i}.W"]] = (acts[i].T @ dpre).ravel()
            g[self._slices[f"hidden{i}.b"]] = dpre.sum(axis=0)
            if i:
                delta = dpre @ self._views[f"hidden{i}.W"].T
        return g

    def copy(self) -> MLPRanker:
        other = MLPRanker(self.n_features, self.hidden, activation=self.activation, init="zero")
        other.set_params(self._flat)
        return other


RANKER_KINDS = ("linear", "mlp")


def make_ranker(
    kind: str, n_features: int, rng: np.random.Generator | None = None, **kw
) -> LinearRanker | MLPRanker:
    """Build a ranker by the name a scenario gives; a Glorot MLP needs ``rng`` for its init."""
    if kind == "linear":
        if kw:
            raise ValueError(f"linear ranker takes no options, got {sorted(kw)}")
        return LinearRanker(n_features)
    if kind == "mlp":
        if rng is None and kw.get("init", "glorot") == "glorot":
            raise ValueError("mlp ranker needs an rng (numpy Generator) for its initial weights")
        return MLPRanker(n_features, rng=rng, **kw)
    raise ValueError(f"unknown ranker kind {kind!r}; known: {', '.join(RANKER_KINDS)}")

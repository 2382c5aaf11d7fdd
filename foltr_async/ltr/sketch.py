"""Count Sketch / Count-Min per document, private sketch queries, and the RTK-Sketch.

CS-F-LTR (Wang, Tong, Shi, Xu, ICDE 2021) lets a party learn term frequencies of another party's
documents without either side revealing text: the owner keeps, per document and field, a Count
Sketch (Charikar, Chen, Farach-Colton, ICALP 2002) of its term counts: ``z`` rows of ``w``
signed counters, row ``a`` adding ``g_a(t) * tf(t)`` at column ``h_a(t)``. ``h_a`` and ``g_a`` are
keyed pairwise-independent hashes ``((alpha x + beta) mod p) mod w`` (p = 2^31 - 1) whose key the
parties share (the relay does not need it). ``g_a(t) C[a, h_a(t)]`` is an unbiased estimate of
``tf(t)`` with variance at most ``||f||_2^2 / w``; the median over rows concentrates it: with
``w >= 3 / eps^2`` every row errs by more than ``eps ||f||_2`` with probability at most 1/3, and the
median of ``z`` rows does so with probability at most ``exp(-z / 18)`` (Chernoff). Count-Min
(Cormode and Muthukrishnan 2005, ``kind="min"``: no signs, estimate = min over rows) never
underestimates and errs by more than ``e / w * ||f||_1`` with probability at most ``exp(-z)``.

Private query (the paper's obfuscated, differentially private sketch query; :func:`obfuscate`,
:func:`noisy_answer`, :func:`median_estimate`): the querier hashes its real term in ``z1`` rows
chosen at random and private to it; the other rows are filled in groups of ``z1`` by decoy terms,
so anyone who can hash (even with the key) sees ``ceil(z / z1)`` terms equally well supported, and
guesses the real one with probability about ``z1 / z``. It sends per row a column and the sign its
term has there. The owner answers every requested entry ``s_a * C[a, col_a]`` with one shared
Laplace(1/epsilon) noise added per (document, term): the querier's median over its private rows is
then the sketch estimate plus exactly that noise, an epsilon-DP release of a count of sensitivity
1. (Differences between entries are noiseless: the guarantee is for the estimate the protocol
uses, not for every cell; we note it rather than hide it.)

RTK-Sketch (reverse top-K): ``z x w`` cells, cell (a, j) a min-heap of at most ``alpha * K``
(document, count) pairs holding the documents with the largest value at (a, j): the largest count
of a term of the document hashing there. (The paper keeps the Count-Min counter, the *sum* of
those counts; the max is still an upper bound of every term's count there, and is less crowded by
collisions: cover 0.86 instead of 0.78 on the embedded corpus at 10,000 documents, defaults.) A
term's reverse top-K reads its ``z`` cells (``alpha K`` pairs each) instead of estimating the term
in every document (NAIVE: ``n_docs x z`` entries), keeps documents seen in at least ``beta`` of the
cells used, bounds each one's count by the minimum over those cells (a cell that does not hold it,
being full, bounds it by its own minimum), and returns the K largest bounds (ties: see
:func:`soft_intersection`). Heaps live in one
``(z*w, alpha K)`` int64 array, key = count << 32 | (2^32 - 1 - doc) (ties prefer low ids), and
insert / delete sift all affected cells at once (vectorised over cells, ``log(alpha K)`` steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from foltr_async.ltr.text import BagOfWords

__all__ = [
    "PRIME",
    "DocSketch",
    "Obfuscated",
    "RTKSketch",
    "SketchHashes",
    "cover_rate",
    "frequency_decoys",
    "matched_decoys",
    "median_estimate",
    "noisy_answer",
    "obfuscate",
    "soft_intersection",
    "top_k",
    "uniform_decoys",
]

PRIME = (1 << 31) - 1
_LOW = (1 << 32) - 1
_SENTINEL = np.iinfo(np.int64).max


@dataclass(frozen=True, eq=False)
class SketchHashes:
    """Keyed pairwise-independent column hashes h_a and sign hashes g_a of ``z`` rows."""

    z: int
    w: int
    ha: np.ndarray  # (z, 2) int64: multiplier, offset of h_a
    ga: np.ndarray  # (z, 2) int64: multiplier, offset of g_a

    @classmethod
    def from_key(cls, rng: np.random.Generator, z: int, w: int) -> SketchHashes:
        """Draw the hash parameters (the shared key) from ``rng``."""
        if z < 1 or w < 2:
            raise ValueError(f"a sketch needs z >= 1 rows and w >= 2 columns, got z={z}, w={w}")
        ha = np.stack([rng.integers(1, PRIME, z), rng.integers(0, PRIME, z)], axis=1)
        ga = np.stack([rng.integers(1, PRIME, z), rng.integers(0, PRIME, z)], axis=1)
        return cls(z, w, ha.astype(np.int64), ga.astype(np.int64))

    def columns(self, terms: np.ndarray) -> np.ndarray:
        """h_a(t) for every row: terms (...,) -> (..., z); terms (..., z) -> per-row hashes."""
        return _hash(self.ha, terms, self.z) % self.w

    def signs(self, terms: np.ndarray) -> np.ndarray:
        """g_a(t) in {-1, +1}, shaped like :meth:`columns`."""
        return (1 - 2 * (_hash(self.ga, terms, self.z) & 1)).astype(np.int8)


def _hash(params: np.ndarray, terms: np.ndarray, z: int) -> np.ndarray:
    t = np.asarray(terms, dtype=np.int64)
    if t.ndim == 0 or t.shape[-1] != z:
        t = t[..., None]
    return (params[:, 0] * t + params[:, 1]) % PRIME  # < 2^62: no int64 overflow


def _row_counts(bow: BagOfWords, hashes: SketchHashes, a: int, signed: bool) -> np.ndarray:
    """(n_docs, w) counters of row ``a`` for every document: one bincount."""
    col = _hash(hashes.ha[a : a + 1], bow.terms, 1)[:, 0] % hashes.w
    weight = bow.counts.astype(np.float64)
    if signed:
        weight = weight * (1 - 2 * (_hash(hashes.ga[a : a + 1], bow.terms, 1)[:, 0] & 1))
    cells = bow.row * hashes.w + col
    out = np.bincount(cells, weights=weight, minlength=bow.n_docs * hashes.w)
    return np.rint(out).astype(np.int64).reshape(bow.n_docs, hashes.w)


def _row_max(bow: BagOfWords, hashes: SketchHashes, a: int) -> np.ndarray:
    """(n_docs, w): per document and column of row ``a``, the largest count of a term there."""
    col = _hash(hashes.ha[a : a + 1], bow.terms, 1)[:, 0] % hashes.w
    out = np.zeros(bow.n_docs * hashes.w, dtype=np.int64)
    np.maximum.at(out, bow.row * hashes.w + col, bow.counts)
    return out.reshape(bow.n_docs, hashes.w)


def _smallest_int(lo: int, hi: int) -> np.dtype:
    for dt in (np.int8, np.int16, np.int32):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dt)
    return np.dtype(np.int64)


class DocSketch:
    """One field's per-document sketches (Count Sketch, or Count-Min with ``kind="min"``).

    Stored compactly: the smallest integer dtype that holds every counter, dense
    ``(n_docs, z*w)`` when most counters are non-zero (long bodies), otherwise as sorted
    (document, cell) keys and values (short titles, where a dense table would be mostly zeros).
    """

    def __init__(self, bow: BagOfWords, hashes: SketchHashes, kind: str = "count") -> None:
        if kind not in ("count", "min"):
            raise ValueError(f"kind must be 'count' or 'min', got {kind!r}")
        self.hashes, self.kind, self.n_docs = hashes, kind, bow.n_docs
        z, w = hashes.z, hashes.w
        rows = [_row_counts(bow, hashes, a, kind == "count") for a in range(z)]
        table = np.stack(rows, axis=1).reshape(bow.n_docs, z * w)
        lo, hi = (int(table.min()), int(table.max())) if table.size else (0, 0)
        dtype = _smallest_int(lo, hi)
        nnz = int(np.count_nonzero(table))
        # sparse costs 8 (key) + itemsize bytes per non-zero; dense costs itemsize per counter
        if nnz * (8 + dtype.itemsize) < table.size * dtype.itemsize:
            flat = np.flatnonzero(table)
            self.dense = None
            self.keys = flat.astype(np.int64)  # doc * z*w + cell, ascending
            self.values = table.ravel()[flat].astype(dtype)
        else:
            self.dense = table.astype(dtype)
            self.keys = self.values = None

    @property
    def nbytes(self) -> int:
        if self.dense is not None:
            return self.dense.nbytes
        return self.keys.nbytes + self.values.nbytes

    def lookup(self, docs: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Counters C_d[a, cols[..., a]]: docs (n,), cols (..., z) -> (n, ..., z) int64."""
        z, w = self.hashes.z, self.hashes.w
        cols = np.asarray(cols, dtype=np.int64)
        cells = (np.arange(z) * w + cols).reshape(-1)
        docs = np.asarray(docs, dtype=np.int64)
        if self.dense is not None:
            out = self.dense[docs[:, None], cells[None, :]].astype(np.int64)
        else:
            want = docs[:, None] * (z * w) + cells[None, :]
            pos = np.minimum(np.searchsorted(self.keys, want), max(len(self.keys) - 1, 0))
            hit = (self.keys[pos] == want) if len(self.keys) else np.zeros(want.shape, bool)
            out = np.where(hit, self.values[pos] if len(self.values) else 0, 0).astype(np.int64)
        return out.reshape((len(docs), *cols.shape))

    def estimate(self, docs: np.ndarray, terms: np.ndarray) -> np.ndarray:
        """Non-private estimates (n, m) of tf(terms) in docs: median (count) or min (Count-Min)."""
        terms = np.asarray(terms, dtype=np.int64)
        vals = self.lookup(docs, self.hashes.columns(terms))
        if self.kind == "min":
            return vals.min(axis=-1).astype(np.float64)
        return np.median(vals * self.hashes.signs(terms), axis=-1)


# ---------------------------------------------------------------------- private query


@dataclass(frozen=True, eq=False)
class Obfuscated:
    """An obfuscated query of m terms: what is sent (cols, signs) and what stays private."""

    cols: np.ndarray  # (m, z) int32 column per row
    signs: np.ndarray  # (m, z) int8 sign of the row's term there
    private: np.ndarray  # (m, z) bool: rows that hash the real term (never sent)
    row_terms: np.ndarray  # (m, z) term hashed in each row (never sent)


Decoys = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def uniform_decoys(n_terms: int) -> Decoys:
    """Decoys drawn uniformly from the vocabulary."""
    return lambda real, rng: rng.integers(0, n_terms, len(real))


def frequency_decoys(cf: np.ndarray) -> Decoys:
    """Decoys drawn in proportion to collection frequency (the querier's own collection)."""
    terms = np.flatnonzero(cf)
    p = cf[terms] / cf[terms].sum()
    return lambda real, rng: rng.choice(terms, size=len(real), p=p)


def matched_decoys(cf: np.ndarray, window: int = 50) -> Decoys:
    """Decoys of about the real term's collection frequency: uniform among the ``window``
    terms ranked just above and below it, so frequency gives no hint which term is real."""
    order = np.argsort(-cf, kind="stable")
    rank = np.empty(len(cf), dtype=np.int64)
    rank[order] = np.arange(len(cf))
    n = len(cf)

    def draw(real: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        off = rng.integers(1, window + 1, len(real)) * rng.choice([-1, 1], len(real))
        r = rank[real] + off
        r = np.where((r < 0) | (r >= n), rank[real] - off, r)
        return order[np.clip(r, 0, n - 1)]

    return draw


def obfuscate(
    terms: np.ndarray,
    hashes: SketchHashes,
    z1: int,
    rng: np.random.Generator,
    decoys: Decoys,
) -> Obfuscated:
    """Hash each real term in ``z1`` random rows; fill the rest with decoy terms, ``z1`` rows each.

    ``decoys(real, rng)`` draws one decoy per entry of ``real``; one equal to its real term is
    drawn again. Grouping decoys by ``z1`` rows is what makes the real term no better supported
    than a decoy for an adversary who can hash every vocabulary term.
    """
    z = hashes.z
    if not 1 <= z1 <= z:
        raise ValueError(f"z1 must be in [1, z={z}], got {z1}")
    terms = np.asarray(terms, dtype=np.int64)
    m = len(terms)
    n_groups = -(-z // z1)
    group_terms = np.repeat(terms[:, None], n_groups, axis=1)
    clash = np.zeros((m, n_groups), dtype=bool)
    clash[:, 1:] = True
    for _ in range(100):  # redraw decoys equal to the real term (rare: a handful of rounds)
        if not clash.any():
            break
        real = group_terms[clash]
        group_terms[clash] = np.asarray(decoys(real, rng), dtype=np.int64)
        clash = np.zeros_like(clash)
        clash[:, 1:] = group_terms[:, 1:] == terms[:, None]
    slot = np.argsort(rng.random((m, z)), axis=1)  # a random permutation of rows per term
    group = np.argsort(slot, axis=1) // z1  # rows in permuted order, cut into groups of z1
    row_terms = np.take_along_axis(group_terms, group, axis=1)
    return Obfuscated(
        hashes.columns(row_terms).astype(np.int32), hashes.signs(row_terms), group == 0, row_terms
    )


def noisy_answer(
    values: np.ndarray, epsilon: float, rng: np.random.Generator, per: str = "answer"
) -> np.ndarray:
    """Add Laplace(1/epsilon) noise shared by every entry of an answer (``per="answer"``: one
    draw for the whole array) or of each row of the last axis (``per="row"``: one draw per
    document of a NAIVE answer, each being a query of its own)."""
    out = np.asarray(values)
    if out.dtype != np.float32:  # float32 answers stay float32 (what they travel as)
        out = out.astype(np.float64)
    if math.isinf(epsilon):
        return out.copy()
    if per == "answer":
        return out + out.dtype.type(rng.laplace(0.0, 1.0 / epsilon))
    return out + rng.laplace(0.0, 1.0 / epsilon, size=(*out.shape[:-1], 1)).astype(out.dtype)


def median_estimate(answer: np.ndarray, private: np.ndarray) -> np.ndarray:
    """Median over each term's private rows: answer (..., m, z), private (m, z) -> (..., m).

    Every term has the same number of private rows (z1), so the selection stays rectangular.
    """
    m, z = private.shape
    idx = np.nonzero(private)[1].reshape(m, -1)
    sel = np.take_along_axis(
        answer, np.broadcast_to(idx, (*answer.shape[:-2], *idx.shape)), axis=-1
    )
    return np.median(sel, axis=-1)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, best first (ties: lower index first)."""
    scores = np.asarray(scores)
    k = min(k, len(scores))
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    part = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    return part[np.lexsort((part, -scores[part]))]


def cover_rate(found: np.ndarray, true_counts: np.ndarray, k: int) -> float:
    """Share of the exact top-K a result covers, ties counted as covered.

    A returned document counts when its true count reaches the exact K-th largest count (any of
    several tied documents is an equally correct answer). Documents without the term never
    count, and the denominator is min(K, documents that have the term).
    """
    true_counts = np.asarray(true_counts)
    n_pos = int(np.count_nonzero(true_counts > 0))
    want = min(k, n_pos)
    if want == 0:
        return 1.0
    kth = np.partition(true_counts, len(true_counts) - want)[len(true_counts) - want]
    found = np.unique(np.asarray(found, dtype=np.int64))
    good = true_counts[found] >= max(kth, 1)
    return min(1.0, float(np.count_nonzero(good)) / want)


# ---------------------------------------------------------------------- RTK-Sketch


class RTKSketch:
    """Reverse top-K sketch over one field's Count-Min counters (see the module docstring)."""

    def __init__(self, hashes: SketchHashes, k: int, alpha: float) -> None:
        if k < 1 or alpha <= 0:
            raise ValueError(f"RTK-Sketch needs k >= 1 and alpha > 0, got k={k}, alpha={alpha}")
        self.hashes = hashes
        self.k = int(k)
        self.alpha = float(alpha)
        self.cap = max(1, math.ceil(alpha * k))
        n_cells = hashes.z * hashes.w
        self.keys = np.full((n_cells, self.cap), _SENTINEL, dtype=np.int64)
        self.size = np.zeros(n_cells, dtype=np.int64)
        self.docs: set[int] = set()
        self._view: tuple[np.ndarray, np.ndarray] | None = None

    # -------------------------------------------------------------- building

    @classmethod
    def build(cls, bow: BagOfWords, hashes: SketchHashes, k: int, alpha: float) -> RTKSketch:
        """Bulk build over every document of ``bow`` (document i has id i).

        Row by row: top ``alpha K`` keys per cell by one argpartition over documents, then an
        ascending sort (a sorted array is a valid min-heap).
        """
        self = cls(hashes, k, alpha)
        n, w, cap = bow.n_docs, hashes.w, self.cap
        low = _LOW - np.arange(n, dtype=np.int64)
        for a in range(hashes.z):
            counts = _row_max(bow, hashes, a)  # (n, w)
            keys = np.where(counts > 0, (counts << 32) | low[:, None], -1)
            if n > cap:
                keys = np.take_along_axis(
                    keys, np.argpartition(keys, n - cap, axis=0)[n - cap :], axis=0
                )
            keys = np.where(keys < 0, _SENTINEL, keys)
            keys.sort(axis=0)
            block = slice(a * w, (a + 1) * w)
            self.keys[block, : keys.shape[0]] = keys.T
            self.size[block] = (keys != _SENTINEL).sum(axis=0)
        self.docs = set(range(n))
        return self

    def cell_counts(self, terms: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """One document's cell values over all z*w cells: its largest term count hashing there."""
        cells = (np.arange(self.hashes.z) * self.hashes.w + self.hashes.columns(terms)).ravel()
        out = np.zeros(self.keys.shape[0], dtype=np.int64)
        np.maximum.at(out, cells, np.repeat(np.asarray(counts, dtype=np.int64), self.hashes.z))
        return out

    def insert(self, doc: int, terms: np.ndarray, counts: np.ndarray) -> None:
        """Add one document (its term ids and counts) to every cell where it makes the top."""
        doc = int(doc)
        if doc in self.docs:
            raise ValueError(f"document {doc} is already in the sketch; delete it first")
        if not 0 <= doc < 2**31:  # answers carry ids as int32
            raise ValueError(f"document ids must be in [0, 2^31), got {doc}")
        self.docs.add(doc)
        self._view = None
        cc = self.cell_counts(terms, counts)
        cells = np.flatnonzero(cc)
        key = (cc[cells] << 32) | (_LOW - doc)
        n = self.size[cells]
        room = n < self.cap
        c, p = cells[room], n[room]
        self.keys[c, p] = key[room]
        self.size[c] += 1
        self._sift_up(c, p)
        c, kk = cells[~room], key[~room]
        better = kk > self.keys[c, 0]
        c = c[better]
        self.keys[c, 0] = kk[better]
        self._sift_down(c, np.zeros(len(c), dtype=np.int64))

    def delete(self, doc: int) -> int:
        """Remove a document from every cell holding it; returns how many cells held it.

        Documents the cell evicted earlier do not come back (the sketch's approximation).
        """
        doc = int(doc)
        self.docs.discard(doc)
        self._view = None
        live = np.arange(self.cap)[None, :] < self.size[:, None]
        cells, pos = np.nonzero(live & ((self.keys & _LOW) == _LOW - doc))
        last = self.size[cells] - 1
        self.keys[cells, pos] = self.keys[cells, last]
        self.keys[cells, last] = _SENTINEL
        self.size[cells] = last
        inside = pos < last
        cells, pos = cells[inside], pos[inside]
        parent = np.maximum(pos - 1, 0) // 2
        up = (pos > 0) & (self.keys[cells, pos] < self.keys[cells, parent])
        self._sift_up(cells[up], pos[up])
        self._sift_down(cells[~up], pos[~up])
        return int(len(last))

    def _sift_up(self, cells: np.ndarray, pos: np.ndarray) -> None:
        H = self.keys
        while len(cells):
            parent = (pos - 1) // 2
            move = pos > 0
            move[move] = H[cells[move], pos[move]] < H[cells[move], parent[move]]
            cells, pos, parent = cells[move], pos[move], parent[move]
            a, b = H[cells, pos], H[cells, parent]
            H[cells, pos], H[cells, parent] = b, a
            pos = parent

    def _sift_down(self, cells: np.ndarray, pos: np.ndarray) -> None:
        H, size = self.keys, self.size
        while len(cells):
            left = 2 * pos + 1
            n = size[cells]
            keep = left < n
            cells, pos, left, n = cells[keep], pos[keep], left[keep], n[keep]
            right = left + 1
            child = np.where(
                (right < n) & (H[cells, np.minimum(right, self.cap - 1)] < H[cells, left]),
                right,
                left,
            )
            cur, low = H[cells, pos], H[cells, child]
            swap = low < cur
            cells, pos, child = cells[swap], pos[swap], child[swap]
            H[cells, pos], H[cells, child] = low[swap], cur[swap]
            pos = child

    def check(self) -> None:
        """Assert the heap property of every cell (for tests)."""
        n = np.arange(self.cap)
        child = 2 * n[None, :] + np.array([1, 2])[:, None, None]  # (2, 1, cap)
        for c in range(self.keys.shape[0]):
            s = self.size[c]
            ch = child[:, 0, :s]
            ok = ch < s
            parents = np.broadcast_to(self.keys[c, :s], ch.shape)[ok]
            assert np.all(parents <= self.keys[c][ch[ok]]), f"heap order broken in cell {c}"

    # -------------------------------------------------------------- querying

    @property
    def nbytes(self) -> int:
        view = 0 if self._view is None else sum(a.nbytes for a in self._view)
        return self.keys.nbytes + self.size.nbytes + view

    def _decoded(self) -> tuple[np.ndarray, np.ndarray]:
        """Every cell's documents (int32) and counts (float32), ascending, live entries first.

        The heaps are for updates; queries read this decoded copy, made on the first query after
        an insert or delete (one sort of every cell), in the types an answer travels in, so an
        answer is two row gathers and one add of noise: the owner's side of a reverse top-K is
        bound by memory bandwidth, and a decode and casts per entry would triple its traffic.
        It doubles the memory while it exists (counted in :attr:`nbytes`).
        """
        if self._view is None:
            keys = np.sort(self.keys, axis=1)  # sentinels (int64 max) sort last
            docs = (_LOW - (keys & _LOW)).astype(np.int32)
            self._view = (docs, (keys >> 32).astype(np.float32))
        return self._view

    def cells(self, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Contents of the requested cells: cols (..., z) -> (ptr, docs, counts, full).

        Cell i of the flattened request holds ``docs[ptr[i]:ptr[i+1]]`` (int32) and their
        counters (float32), fresh arrays the caller may change; ``full[i]`` says the cell is at
        capacity, so a document it lacks has a counter no larger than its minimum.
        """
        cols = np.asarray(cols, dtype=np.int64)
        cells = (np.arange(self.hashes.z) * self.hashes.w + cols).reshape(-1)
        sizes = self.size[cells]
        docs, counts = self._decoded()
        docs, counts = docs[cells], counts[cells]
        ptr = np.zeros(len(cells) + 1, dtype=np.int64)
        np.cumsum(sizes, out=ptr[1:])
        full = sizes >= self.cap
        if full.all():  # the usual case once the collection is larger than alpha K
            return ptr, docs.ravel(), counts.ravel(), full
        live = np.arange(self.cap)[None, :] < sizes[:, None]
        return ptr, docs[live], counts[live], full

    def query(
        self, term: int, k: int | None = None, beta: float = 0.1
    ) -> tuple[np.ndarray, np.ndarray]:
        """Non-private reverse top-K of one term over all z cells: (docs, count bounds)."""
        ptr, docs, counts, full = self.cells(self.hashes.columns(np.asarray([term]))[0])
        return soft_intersection(
            ptr, docs, counts, full, np.ones(self.hashes.z, bool), self.k if k is None else k, beta
        )


def soft_intersection(
    ptr: np.ndarray,
    docs: np.ndarray,
    counts: np.ndarray,
    full: np.ndarray,
    use: np.ndarray,
    k: int,
    beta: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k documents over the cells ``use`` marks: seen in >= beta of them, by upper bound.

    ``ptr``/``docs``/``counts``/``full`` describe cells as :meth:`RTKSketch.cells` returns them
    (counts may carry noise). A document's bound is the minimum of its values in the used cells
    that hold it and of the minima of the used full cells that do not (which it cannot exceed).
    Linear in the entries read: per-document minima by ``minimum.at``, and the first full cell
    missing a document from a bitmask of the cells holding it (cells ranked by their minimum).
    """
    used = np.flatnonzero(np.asarray(use, dtype=bool))
    if len(used) > 52:
        raise ValueError("soft_intersection supports at most 52 used cells (float64 bitmask)")
    starts, ends = ptr[used].tolist(), ptr[used + 1].tolist()
    sizes = np.asarray(ptr[used + 1] - ptr[used], dtype=np.int64)
    if not sizes.sum():
        return np.zeros(0, np.int64), np.zeros(0)
    d = np.concatenate([docs[a:b] for a, b in zip(starts, ends, strict=True)])
    cnt = np.concatenate([counts[a:b] for a, b in zip(starts, ends, strict=True)])
    cnt = cnt.astype(np.float64)
    offsets = np.cumsum(sizes) - sizes
    nonempty = sizes > 0
    cell_min = np.full(len(used), np.inf)
    cell_min[nonempty] = np.minimum.reduceat(cnt, offsets[nonempty])
    cell_min[~np.asarray(full)[used]] = np.inf  # a cell with room bounds nothing it lacks
    order = np.argsort(cell_min, kind="stable")
    rank = np.empty(len(used), dtype=np.int64)
    rank[order] = np.arange(len(used))
    bounds = np.append(cell_min[order], np.inf)  # bounds[r]: minimum of the r-th ranked cell
    n = int(d.max()) + 1
    seen = np.bincount(d, minlength=n)
    low = np.full(n, np.inf)
    np.minimum.at(low, d, cnt)
    # bit r set: the r-th ranked cell holds the document
    held = np.bincount(d, weights=np.repeat(np.exp2(rank), sizes), minlength=n)
    need = max(1, math.ceil(beta * len(used) - 1e-9))
    cand = np.flatnonzero(seen >= need)
    bits = held[cand].astype(np.int64)
    first_missing = np.log2((~bits & (bits + 1)).astype(np.float64)).astype(np.int64)
    absent = bounds[np.minimum(first_missing, len(used))]
    est = np.minimum(low[cand], absent)
    # Rank by the bound, but at an equal bound prefer a document whose bound is a value seen in a
    # cell over one bounded only by a cell that left it out (its count may be anything below),
    # then the document held by more cells. Values differ by >= 1 (integer counts plus one shared
    # noise draw), so the half step and seen / 128 (< 0.41) only break ties.
    score = np.minimum(low[cand], absent - 0.5) + seen[cand] / 128.0
    best = top_k(score, k)
    return cand[best], est[best]

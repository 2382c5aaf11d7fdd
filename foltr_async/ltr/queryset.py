"""The one in-memory shape of a learning-to-rank dataset: contiguous arrays plus query offsets.

Every agent shares these arrays read-only; a client owns only an index array of query numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``starts[0]..starts[0]+sizes[0]-1``, then the next range, ...: the document rows of
    queries whose first rows and document counts are given (int64)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    return np.repeat(np.asarray(starts, dtype=np.int64) - ends + sizes, sizes) + np.arange(total)


@dataclass(frozen=True, eq=False)
class QuerySet:
    """Documents of many queries, stored query after query.

    ``features[qptr[i]:qptr[i+1]]`` are the documents of query ``i`` (id ``qids[i]``).
    ``intent_labels`` (optional, n_intents x n_docs) holds alternative label sets for
    datasets whose queries have several intents (non-IID type 1).
    """

    features: np.ndarray  # (n_docs, n_features) float32, C-contiguous
    labels: np.ndarray  # (n_docs,) int8 relevance grades
    qptr: np.ndarray  # (n_queries + 1,) int64 offsets into the document axis
    qids: np.ndarray  # (n_queries,) str query ids
    name: str = ""
    intent_labels: np.ndarray | None = field(default=None)

    def __post_init__(self) -> None:
        for arr in (self.features, self.labels, self.qptr, self.qids):
            arr.setflags(write=False)
        if self.intent_labels is not None:
            self.intent_labels.setflags(write=False)

    @property
    def n_queries(self) -> int:
        return len(self.qptr) - 1

    @property
    def n_docs(self) -> int:
        return len(self.labels)

    @property
    def n_features(self) -> int:
        return self.features.shape[1]

    @property
    def max_grade(self) -> int:
        return int(self.labels.max()) if self.n_docs else 0

    def doc_range(self, q: int) -> slice:
        return slice(int(self.qptr[q]), int(self.qptr[q + 1]))

    def query(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Feature and label views (no copy) of query ``q``."""
        s = self.doc_range(q)
        return self.features[s], self.labels[s]

    def subset(self, queries: np.ndarray | list[int], name: str | None = None) -> QuerySet:
        """A new QuerySet holding only the given queries (copies; for splits, not hot paths)."""
        queries = np.asarray(queries, dtype=np.int64)
        sizes = self.qptr[queries + 1] - self.qptr[queries]
        qptr = np.zeros(len(queries) + 1, dtype=np.int64)
        np.cumsum(sizes, out=qptr[1:])
        idx = ranges(self.qptr[queries], sizes)
        return QuerySet(
            features=np.ascontiguousarray(self.features[idx]),
            labels=self.labels[idx].copy(),
            qptr=qptr,
            qids=self.qids[queries].copy(),
            name=self.name if name is None else name,
            intent_labels=None if self.intent_labels is None else self.intent_labels[:, idx].copy(),
        )

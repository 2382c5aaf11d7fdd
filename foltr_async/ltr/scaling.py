"""Query-level feature scaling: min-max within every query."""

from __future__ import annotations

import numpy as np

__all__ = ["normalise_per_query"]


def normalise_per_query(features: np.ndarray, qptr: np.ndarray) -> np.ndarray:
    """Min-max scale every feature within every query to [0, 1]; constant features become 0.

    This is the query-level normalisation the PDGD/FPDGD authors apply to MSLR-WEB10K (and
    LETOR 4.0 ships as ``QueryLevelNorm``); it removes per-query scale effects a linear ranker
    cannot undo. Returns a new float32 array.
    """
    out = np.array(features, dtype=np.float32, copy=True, order="C")
    sizes = np.diff(qptr)
    nonempty = sizes > 0
    if out.size == 0 or not nonempty.any():
        return out
    starts = qptr[:-1][nonempty]
    lo = np.minimum.reduceat(out, starts, axis=0)
    span = np.maximum.reduceat(out, starts, axis=0) - lo
    doc_q = np.repeat(np.arange(len(starts)), sizes[nonempty])
    for r0 in range(0, len(out), 1 << 16):  # bounded temporaries on MSLR-size data
        rows = doc_q[r0 : r0 + (1 << 16)]
        block = out[r0 : r0 + len(rows)]
        s = span[rows]
        np.divide(block - lo[rows], s, out=block, where=s > 0)
        block[s <= 0] = 0.0
    return out

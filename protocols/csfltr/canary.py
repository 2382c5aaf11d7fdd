"""A canary owner for the privacy audit (``federation.params.canary``): party 0 answers every
term-frequency query as if its first asked document held one more occurrence of a canary term
when its secret bit (one per answer) is 1, the neighbouring pair of counts the per-answer
Laplace(1/epsilon) is for.

The canary term of an answer is public: among the vocabulary, the term whose column and sign
hashes agree with the first query slot's (column, sign) in the most rows (the smallest id on a
tie), as anyone holding the hash key finds the candidates. The occurrence is added to the body
field's sketch only; the document's length and distinct-term count are sent as they are (the
audit covers the counts, the release the guarantee is stated for).
"""

from __future__ import annotations

import numpy as np

from foltr_async.protocols.canary_truth import CANARY_TRUTH, CanaryTruth
from foltr_async.protocols.csfltr.party import Party

#: the sketch (field) the canary occurrence is added to: the body
BODY = 1


def canary_shift(
    h: np.ndarray, g: np.ndarray, shape: tuple, cols: np.ndarray, signs: np.ndarray
) -> np.ndarray:
    """How an answer of ``shape`` (2, n, m, z) moves when document 0 of the answer holds one
    more occurrence of the answer's canary term: +-1 where a slot asks that term's column
    (``h``, ``g``: every vocabulary term's column and sign hashes, (n_terms, z))."""
    agree = ((h == cols[0]) & (g == signs[0])).sum(axis=1)
    t = int(np.argmax(agree))  # the first of the best-supported terms
    shift = np.zeros(shape)
    # entry (j, a) = signs[j, a] * C[a, cols[j, a]]; the occurrence adds g_a(t) at h_a(t)
    shift[BODY, 0] = np.where(cols == h[t], signs * g[t], 0)
    return shift


class CanaryParty(Party):
    """Party 0 of an audited run: its term-frequency answers carry the canary by a fresh bit."""

    def __init__(self, agent_id, run, p, rng) -> None:
        super().__init__(agent_id, run, p, rng)
        self.truth = CanaryTruth()
        run.probe.oracle[CANARY_TRUTH, agent_id] = self.truth
        terms = np.arange(run.corpus.n_terms)  # the vocabulary's hashes, once
        self.term_hashes = (self.hashes.columns(terms), self.hashes.signs(terms))

    def answered_counts(self, req, tf, cols, signs):
        shift = canary_shift(*self.term_hashes, tf.shape, cols, signs)
        bit = int(self.rng.integers(2))
        self.truth.bits[req, 0] = bit
        self.truth.answers[req] = (tf.astype(np.float64), shift)  # the auditor's knowledge
        return tf + bit * shift

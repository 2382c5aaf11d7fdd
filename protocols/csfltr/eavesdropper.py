"""What the relay (or anyone tapping the parties' links to it) learns from the sketch queries."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from foltr_async.protocols.csfltr.messages import QUERIES, TF_QUERY
from foltr_async.protocols.eavesdrop import TapEavesdropper
from foltr_async.runtime.wire import decode

if TYPE_CHECKING:
    from foltr_async.protocols.csfltr.corpus import CorpusRun


class RelayEavesdropper(TapEavesdropper):
    """Taps every sketch query a party sends to the relay and guesses the queried terms.

    It knows the parties' hash key (the worst case: a curious party, or a relay colluding with
    one), hashes the whole vocabulary once and, per query term, votes: a vocabulary term scores
    the rows whose (column, sign) it matches. The real term and each decoy match about z1 rows
    each, so its guess uniform among the top-voted is right with probability about
    1 / floor(z / z1) (reported next to z1 / z). A second guess picks the rarest of the
    top-voted terms by public term statistics (query terms are rarer than typical text): it
    beats the bound when decoys are drawn by frequency, not when they are frequency-matched.
    It also sees the answers' noisy counts; their noise is what ``epsilon`` bounds.
    """

    taps = dict.fromkeys(QUERIES, "dst")  # the parties' queries to the relay

    def __init__(self, agent_id: str, run: CorpusRun, rng: np.random.Generator) -> None:
        super().__init__(agent_id, run.ctx, ["server"])
        self.rng = rng
        V = run.corpus.n_terms
        self.cols = run.hashes.columns(np.arange(V)).astype(np.int32)  # (V, z)
        self.signs = run.hashes.signs(np.arange(V))
        self.cf = run.corpus.body.coll_freq()  # public term statistics (a reference corpus)
        self.hits = self.prior_hits = self.trials = 0
        self.tied: list[int] = []

    def observe(self, header, data: bytes) -> None:
        body = decode(data).body
        truth = self.probe.oracle.get((header.kind, header.src, body["req"]))
        if truth is None or header.kind == TF_QUERY:  # a TF query repeats its RTK query's hashes
            return
        for i, t in enumerate(np.asarray(truth).tolist()):  # a tuple when a worker sent it
            votes = ((self.cols == body["cols"][i]) & (self.signs == body["signs"][i])).sum(1)
            best = np.flatnonzero(votes == votes.max())
            self.tied.append(len(best))
            self.hits += int(self.rng.choice(best) == t)
            self.prior_hits += int(best[np.argmin(self.cf[best])] == t)  # query terms are rare
            self.trials += 1

    def summary(self) -> dict:
        p = self.ctx.params
        z, z1 = p.z, p.z1
        return {
            "protocol": "csfltr",
            "sees": "per query term: z (column, sign) pairs; per answer: counts with one "
            "shared Laplace(1/epsilon) draw",
            "epsilon": p.epsilon,
            "knows_hash_key": True,
            "terms": self.trials,
            "vote_accuracy": self.hits / self.trials if self.trials else None,
            "rarest_accuracy": self.prior_hits / self.trials if self.trials else None,
            "z1_over_z": z1 / z,
            "expected": 1.0 / math.floor(z / z1) if z1 <= z else 1.0,
            "mean_tied_candidates": float(np.mean(self.tied)) if self.tied else None,
        }

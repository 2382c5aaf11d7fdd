"""What a CS-F-LTR run measures: reverse top-K cover rates against the exact top-K, compute
time per term, term-frequency estimate errors, bytes per term and memory, for RTK-Sketch and
NAIVE alike.

Each party's measurements go to the probe's extras under its id, so those of parties hosted by
worker processes reach the server with the workers' flushes; ``report`` takes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from foltr_async.ltr.sketch import cover_rate
from foltr_async.ltr.text import TextCorpus
from foltr_async.protocols.csfltr.corpus import CorpusRun, PartyIndex, PartyText, party_text
from foltr_async.protocols.csfltr.messages import NAIVE_ANSWER, NAIVE_QUERY, RTK_ANSWER, RTK_QUERY
from foltr_async.runtime.trust import worker_extras

if TYPE_CHECKING:
    from foltr_async.contract import Probe

MEASURED = "csfltr.measured"  # probe extras key of the parties' raw measurements
worker_extras(MEASURED, "per_client")  # a worker reports its own parties' entries
_STATS = (
    "rtk_cover",
    "rtk_rankable",
    "rtk_query_s",
    "rtk_owner_s",
    "naive_cover",
    "naive_rankable",
    "naive_query_s",
    "naive_owner_s",
    "tf_abs_err",
    "tf_true",
)


class Measurements:
    """The parties record here; a cover rate or a term-frequency error is measured against the
    owner's exact text (``k``: the reverse top-K size; ``stop``: the stop list's length)."""

    def __init__(self, probe: Probe, k: int, corpus: TextCorpus, stop: int) -> None:
        self.probe, self.k, self.corpus, self.stop = probe, k, corpus, stop

    def _text(self, p: int) -> PartyText:
        return party_text(self.corpus, p, self.stop)

    def _measured(self, aid: str) -> dict:
        per = self.probe.extras.setdefault(MEASURED, {})
        return per.setdefault(
            aid, {"stats": {k: [] for k in _STATS}, "instances": None, "memory": None}
        )

    def instances(self, aid: str, value: dict) -> None:
        """A party's training set size (queries, instances, cross-party instances)."""
        self._measured(aid)["instances"] = value

    def memory(self, aid: str, index: PartyIndex) -> None:
        """The party's structures' bytes at the end (with the RTK-Sketch's query view, if any
        query built it)."""
        mem = {"rtk": index.rtk.nbytes, "sketch": index.doc_sketch[1].nbytes}
        self._measured(aid)["memory"] = mem

    def time(self, aid: str, key: str, seconds: float) -> None:
        self._measured(aid)["stats"][key].append(seconds)

    def _cover(self, aid: str, prefix: str, owner: int, term: int, found: np.ndarray) -> None:
        true = self._text(owner).fields[1].term_counts(int(term))
        c = cover_rate(found, true, self.k)
        stats = self._measured(aid)["stats"]
        stats[f"{prefix}_cover"].append(c)
        if (true >= 2).sum() >= self.k:  # K documents hold the term at least twice
            stats[f"{prefix}_rankable"].append(c)

    def rtk(self, aid: str, owner: int, terms: np.ndarray, found: list, seconds: float) -> None:
        for t, f in zip(terms.tolist(), found, strict=True):
            self._cover(aid, "rtk", owner, t, f)
            self._measured(aid)["stats"]["rtk_query_s"].append(seconds)

    def naive(self, aid: str, owner: int, term: int, top: np.ndarray, seconds: float) -> None:
        self._cover(aid, "naive", owner, term, top)
        self._measured(aid)["stats"]["naive_query_s"].append(seconds)

    def tf(
        self, aid: str, owner: int, docs: np.ndarray, terms: np.ndarray, est: np.ndarray
    ) -> None:
        true = np.stack([f.tf(docs, terms) for f in self._text(owner).fields])
        stats = self._measured(aid)["stats"]
        stats["tf_abs_err"].append(float(np.abs(est - true).mean()))
        stats["tf_true"].append(float(true.mean()))

    def report(self, run: CorpusRun) -> dict:
        """The run's measurements, summarised for results.json (the raw lists are not written)."""
        measured = self.probe.extras.pop(MEASURED, {})  # raw lists: summarised here, not written
        parties = sorted(measured)
        s = {k: [v for a in parties for v in measured[a]["stats"][k]] for k in _STATS}
        instances = {a: measured[a]["instances"] for a in parties if measured[a]["instances"]}
        p = run.ctx.params
        kinds = run.ctx.bus.stats.as_dict()["kinds"]

        def mean(key: str) -> float | None:
            return float(np.mean(s[key])) if s[key] else None

        def per_term(q: str, a: str, n_terms: int) -> float | None:
            b = sum(kinds.get(k, {}).get("bytes_sent", 0) for k in (q, a))
            return b / n_terms if n_terms else None

        n_rtk_terms = len(s["rtk_cover"])
        n_naive = len(s["naive_cover"])
        rtk_t = (mean("rtk_query_s") or 0.0) + (mean("rtk_owner_s") or 0.0)
        naive_t = (mean("naive_query_s") or 0.0) + (mean("naive_owner_s") or 0.0)
        memory = [measured[a]["memory"] for a in parties if measured[a]["memory"]]
        out = {
            "mode": run.mode,
            "parties": run.corpus.n_parties,
            "docs": int(run.corpus.n_docs),
            "params": {k: getattr(p, k) for k in ("alpha", "beta", "w", "z", "z1", "k", "epsilon")},
            "instances": instances,
            "test_queries": run.test.n_queries,
        }
        if n_rtk_terms:
            out["rtk"] = {
                "terms": n_rtk_terms,
                "cover_rate": mean("rtk_cover"),
                "cover_rate_rankable": mean("rtk_rankable"),
                "rankable_terms": len(s["rtk_rankable"]),
                "query_ms": rtk_t * 1e3,
                "bytes_per_term": per_term(RTK_QUERY, RTK_ANSWER, n_rtk_terms),
                "memory_bytes": int(sum(m["rtk"] for m in memory)),
            }
            out["tf_estimate"] = {
                "mean_abs_error": mean("tf_abs_err"),
                "mean_true_tf": mean("tf_true"),
            }
        if n_naive:
            out["naive"] = {
                "terms": n_naive,
                "cover_rate": mean("naive_cover"),
                "cover_rate_rankable": mean("naive_rankable"),
                "query_ms": naive_t * 1e3,
                "bytes_per_term": per_term(NAIVE_QUERY, NAIVE_ANSWER, n_naive),
                "memory_bytes": int(sum(m["sketch"] for m in memory)),
            }
            if n_rtk_terms and rtk_t > 0:
                out["speedup"] = naive_t / rtk_t
                out["bytes_ratio"] = out["naive"]["bytes_per_term"] / out["rtk"]["bytes_per_term"]
        return out

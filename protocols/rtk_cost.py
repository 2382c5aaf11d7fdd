"""What a reverse top-K costs on one owner's collection: RTK-Sketch against NAIVE.

CS-F-LTR's querier needs, per query term, the owner's K documents with the most occurrences.
:func:`cost` times the protocol's own halves of both answers (``rtk_answer`` / ``rtk_top`` and
``naive_answer`` / ``naive_top`` in :mod:`.csfltr.primitives`: obfuscated query,
noise, private rows) on an embedded synthetic collection of ``docs`` documents, and scores them
against the exact top-K by cover rate (ties counted as covered) over every query term and over
*rankable* terms (at least K documents hold the term twice, so the top-K is a ranking rather than
a tie among single occurrences). It also reports bytes per answer and the two structures' memory.

The shape to expect: RTK reads ``z * alpha * K`` cell entries whatever the collection size, NAIVE
``docs * z``, so the speed-up grows linearly with ``docs`` (about 13x less data at 10,000
documents with the defaults); the RTK cells' capacity is fixed too, so with more documents
competing for the same ``alpha * K`` slots the cover rate falls.
"""

from __future__ import annotations

import time

import numpy as np

from foltr_async.ltr.sketch import (
    DocSketch,
    RTKSketch,
    SketchHashes,
    cover_rate,
    matched_decoys,
    obfuscate,
)
from foltr_async.ltr.text import make_corpus
from foltr_async.protocols.csfltr.corpus import stop_mask
from foltr_async.protocols.csfltr.primitives import naive_answer, naive_top, rtk_answer, rtk_top
from foltr_async.rng import stream


def cost(
    docs: int,
    *,
    queries: int = 100,
    k: int = 150,
    alpha: float = 5.0,
    beta: float = 0.1,
    w: int = 200,
    z: int = 30,
    z1: int = 10,
    epsilon: float = 0.5,
    stopwords: int = 100,
    seed: int = 0,
) -> dict:
    """Per-term time (owner + querier), cover rate, bytes and memory of both answers."""
    corpus = make_corpus(stream(seed, "rtk-cost", "corpus"), n_parties=1, docs_per_party=docs)
    stop = stop_mask(corpus, stopwords)
    body = corpus.body.without(stop)
    hashes = SketchHashes.from_key(stream(seed, "rtk-cost", "hash-key"), z, w)
    t0 = time.perf_counter()
    rtk = RTKSketch.build(body, hashes, k, alpha)
    t1 = time.perf_counter()
    sketch = DocSketch(body, hashes)
    t2 = time.perf_counter()

    rng = stream(seed, "rtk-cost", "queries")
    qs = [corpus.query(q).astype(np.int64) for q in range(corpus.n_queries)]
    qs = [t[~stop[t]] for t in qs]
    qs = [t for t in qs if len(t)]
    qs = [qs[i] for i in np.sort(rng.choice(len(qs), min(queries, len(qs)), replace=False))]
    decoys = matched_decoys(body.coll_freq().astype(np.float64))
    # RTK as the protocol asks it: one obfuscated query per user query (its terms together);
    # NAIVE as the protocol probes it: one term at a time
    rtk_q = [obfuscate(t, hashes, z1, rng, decoys) for t in qs]
    terms = np.unique(np.concatenate(qs))
    naive_q = [obfuscate(np.array([t]), hashes, z1, rng, decoys) for t in terms.tolist()]
    n_rtk_terms = sum(len(t) for t in qs)

    def timed(step, inputs, n_terms):
        start = time.perf_counter()
        out = [step(*x) for x in inputs]
        return out, (time.perf_counter() - start) / n_terms

    noise = stream(seed, "rtk-cost", "noise")
    rtk.cells(rtk_q[0].cols)  # warm: an owner decodes its cells once, on the first query
    rtk_ans, rtk_owner = timed(
        lambda o: rtk_answer(rtk, o.cols, epsilon, noise), [(o,) for o in rtk_q], n_rtk_terms
    )
    rtk_res, rtk_querier = timed(
        lambda o, a: rtk_top(a, o.private, k, beta)[0],
        list(zip(rtk_q, rtk_ans, strict=True)),
        n_rtk_terms,
    )
    naive_ans, naive_owner = timed(
        lambda o: naive_answer(sketch, o.cols, o.signs, epsilon, noise),
        [(o,) for o in naive_q],
        len(terms),
    )
    naive_res, naive_querier = timed(
        lambda o, v: naive_top(v, o.private, k),
        list(zip(naive_q, naive_ans, strict=True)),
        len(terms),
    )

    def kth(true: np.ndarray) -> int:
        """The K-th largest count: 0 when fewer than K documents hold the term."""
        return int(np.partition(true, len(true) - k)[len(true) - k]) if len(true) >= k else 0

    covers: dict[str, list[tuple[float, int]]] = {"rtk": [], "naive": []}
    for query, found in zip(qs, rtk_res, strict=True):
        for t, f in zip(query.tolist(), found, strict=True):
            true = body.term_counts(t)
            covers["rtk"].append((cover_rate(f, true, k), kth(true)))
    for t, f in zip(terms.tolist(), naive_res, strict=True):
        true = body.term_counts(t)
        covers["naive"].append((cover_rate(f, true, k), kth(true)))

    def summary(name: str, owner_s: float, querier_s: float, nbytes: float, memory: int) -> dict:
        c = np.array([x[0] for x in covers[name]])
        kths = np.array([x[1] for x in covers[name]])
        r = kths >= 2  # rankable: at least K documents hold the term twice
        buckets = {"0": kths == 0, "1": kths == 1, "2": kths == 2, "3": kths == 3, "4+": kths >= 4}
        return {
            "ms_per_term": (owner_s + querier_s) * 1e3,
            "owner_ms": owner_s * 1e3,
            "querier_ms": querier_s * 1e3,
            "cover_rate": float(c.mean()),
            "cover_rate_rankable": float(c[r].mean()) if r.any() else None,
            # by the term's K-th largest count (0: fewer than K documents hold it): the RTK
            # cells keep the alpha K largest values, so a top-K is found once it stands out
            "cover_by_kth": {
                b: [float(c[m].mean()), int(m.sum())] for b, m in buckets.items() if m.any()
            },
            "bytes_per_term": nbytes,
            "memory_bytes": memory,
        }

    rtk_out = summary(
        "rtk",
        rtk_owner,
        rtk_querier,
        sum(sum(v.nbytes for v in a.values()) for a in rtk_ans) / n_rtk_terms,
        rtk.nbytes,
    )
    naive_out = summary(
        "naive",
        naive_owner,
        naive_querier,
        float(np.mean([a.nbytes for a in naive_ans])),
        sketch.nbytes,
    )
    return {
        "docs": docs,
        "queries": len(qs),
        "terms": len(terms),
        "rankable_terms": int(sum(x >= 2 for _, x in covers["naive"])),
        "build_s": {"rtk": t1 - t0, "doc_sketch": t2 - t1},
        "rtk": rtk_out,
        "naive": naive_out,
        "speedup": naive_out["ms_per_term"] / rtk_out["ms_per_term"],
        "entries_ratio": docs / (alpha * k),  # NAIVE reads docs*z entries, RTK z*alpha*K
    }

"""The run's text corpus and what each party builds over its own documents (sketches,
RTK-Sketch, exact statistics), cached per process; candidates, feature blocks and the external
test set.

What is derived from a corpus is kept on the corpus object (``_on_corpus``), so it is freed
with the corpus when ``_corpus``'s cache drops it: caches keyed by the corpus itself kept up to
16 old corpora and their sketches alive in a long-lived pool worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from foltr_async.contract import RunContext
from foltr_async.errors import ScenarioError
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.sketch import DocSketch, RTKSketch, SketchHashes, top_k
from foltr_async.ltr.text import BagOfWords, TextCorpus, load_msmarco, make_corpus
from foltr_async.ltr.textfeatures import (
    FEATURE_NAMES,
    CollectionStats,
    exact_features,
    field_features,
    query_minmax,
)
from foltr_async.rng import stream
from foltr_async.runtime import heap

N_FEATURES = len(FEATURE_NAMES)
T = TypeVar("T")


@heap.process_cache(maxsize=2)
def _corpus(key: tuple) -> TextCorpus:
    kind, seed, *rest = key
    if kind == "msmarco":
        collection, queries, qrels, run, n_parties, test_fraction = rest
        return load_msmarco(
            collection,
            queries,
            qrels,
            stream(seed, "csfltr", "corpus"),
            run=run,
            n_parties=n_parties,
            test_fraction=test_fraction,
        )
    n_parties, docs, vocab, topics, body_len, nq, ntest, rel2, rel1 = rest
    return make_corpus(
        stream(seed, "csfltr", "corpus"),
        n_parties=n_parties,
        docs_per_party=docs,
        vocab_size=vocab,
        n_topics=topics,
        body_len=body_len,
        queries_per_party=nq,
        test_queries=ntest,
        rel2=rel2,
        rel1=rel1,
    )


def corpus_for(ctx: RunContext) -> TextCorpus:
    """The run's corpus (shared read-only; cached so variants of one seed reuse it)."""
    p = ctx.params
    seed = p.corpus_seed if p.corpus_seed is not None else ctx.seed
    if p.corpus == "msmarco":
        missing = [k for k in ("collection", "queries", "qrels") if getattr(p, k) is None]
        if missing:
            raise ScenarioError(
                f'federation.params.{missing[0]}: required for corpus = "msmarco" (a TSV file path)'
            )
        key = (
            "msmarco",
            seed,
            p.collection,
            p.queries,
            p.qrels,
            p.run,
            ctx.config.federation.clients,
            p.test_fraction,
        )
    else:
        judged = p.judged
        if len(judged) != 2 or not all(isinstance(j, int) and j >= 0 for j in judged):
            raise ScenarioError(
                f"federation.params.judged: expected [grade-2 count, grade-1 "
                f"count] (two integers >= 0), got {judged!r}"
            )
        key = (
            "synthetic",
            seed,
            ctx.config.federation.clients,
            p.docs_per_party,
            p.vocab_size,
            p.topics,
            p.body_len,
            p.queries_per_party,
            p.test_queries,
            *judged,
        )
    return _corpus(key)


@dataclass(frozen=True, eq=False)
class PartyText:
    """One party's text: what the test set and the measurements read for every party (cheap
    next to the sketches, which only the party's own process builds)."""

    fields: tuple[BagOfWords, BagOfWords]  # title, body of its documents (local ids)
    indexed: tuple[BagOfWords, BagOfWords]  # the same without stop words: what is sketched
    stats: tuple[CollectionStats, CollectionStats]


@dataclass(frozen=True, eq=False)
class PartyIndex(PartyText):
    """What one party builds over its own documents: sketches and RTK-Sketch."""

    doc_sketch: tuple[DocSketch, DocSketch]
    rtk: RTKSketch


class CorpusRun(Protocol):
    """What a party, the relay's eavesdropper and the measurements read of the run
    (``server.CSFLTR``, which builds them: named here so that they need not import it)."""

    ctx: RunContext
    mode: str
    corpus: TextCorpus
    hashes: SketchHashes
    test: QuerySet

    def index(self, p: int) -> PartyIndex: ...

    def terms(self, q: int) -> np.ndarray: ...


def _derived(corpus: TextCorpus) -> dict:
    """The corpus's own memo (module doc); a frozen dataclass, so through its __dict__."""
    return vars(corpus).setdefault("_derived", {})


def _on_corpus(corpus: TextCorpus, key: tuple, make: Callable[[], T]) -> T:
    """``make()`` once per (corpus, key), stored on the corpus."""
    memo = _derived(corpus)
    if key not in memo:
        memo[key] = make()
    return memo[key]


def stop_mask(corpus: TextCorpus, n: int) -> np.ndarray:
    """The public stop list: the ``n`` most frequent terms of the whole corpus (mask)."""

    def make() -> np.ndarray:
        mask = np.zeros(corpus.n_terms, dtype=bool)
        mask[np.argsort(-corpus.body.coll_freq(), kind="stable")[:n]] = True
        return mask

    return _on_corpus(corpus, ("stop", n), make)


def party_text(corpus: TextCorpus, p: int, stop: int) -> PartyText:
    """A party's fields, their stop-word-free versions and the exact statistics of its text."""

    def make() -> PartyText:
        own = corpus.party_docs(p)
        fields = (corpus.title.rows(own), corpus.body.rows(own))
        mask = stop_mask(corpus, stop)
        indexed = tuple(f.without(mask) for f in fields)
        return PartyText(fields, indexed, tuple(CollectionStats.of(f) for f in fields))

    return _on_corpus(corpus, ("text", p, stop), make)


def party_index(
    corpus: TextCorpus, p: int, hashes: SketchHashes, k: int, alpha: float, stop: int
) -> PartyIndex:
    """A party's index: sketches of stop-word-free text (stop words would dominate every
    sketch's error, ||f||_2, and every RTK cell) and exact statistics of its full text.
    Only the latest sketch setting's indexes are kept (a sweep builds one per variant)."""
    setting = (hashes, k, alpha, stop)
    memo = _derived(corpus)
    if memo.get("index_setting") != setting:
        memo["index_setting"], memo["index"] = setting, {}
    if p not in memo["index"]:
        t = party_text(corpus, p, stop)
        memo["index"][p] = PartyIndex(
            fields=t.fields,
            indexed=t.indexed,
            stats=t.stats,
            doc_sketch=tuple(DocSketch(f, hashes) for f in t.indexed),
            rtk=RTKSketch.build(t.indexed[1], hashes, k, alpha),
        )
    return memo["index"][p]


@heap.process_cache(maxsize=4)
def party_hashes(seed: int, z: int, w: int) -> SketchHashes:
    """The parties' shared hash key (the relay never needs it)."""
    return SketchHashes.from_key(stream(seed, "csfltr", "hash-key"), z, w)


def _bm25_top(index: PartyText, terms: np.ndarray, n: int) -> np.ndarray:
    """The party's own BM25 top-n documents (body field, exact) for a query."""
    body, st = index.fields[1], index.stats[1]
    docs = np.arange(body.n_docs)
    f = field_features(
        body.tf(docs, terms),
        body.lengths,
        body.unique,
        st.df[terms],
        st.cf[terms],
        st.n_docs,
        st.total_len,
    )
    return np.sort(top_k(f[:, 4], n))


def block_norm(x: np.ndarray) -> np.ndarray:
    """Min-max normalise one (query, collection) block of features."""
    return query_minmax(x, np.array([0, len(x)], dtype=np.int64))


def query_set(blocks: list[tuple[np.ndarray, np.ndarray]], qids: list[str], name: str) -> QuerySet:
    """One QuerySet from per-query (features, labels) blocks (already normalised)."""
    sizes = [len(b[1]) for b in blocks]
    qptr = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum(sizes, out=qptr[1:])
    if blocks:
        x = np.vstack([b[0] for b in blocks])
        y = np.concatenate([b[1] for b in blocks]).astype(np.int8)
    else:
        x, y = np.zeros((0, N_FEATURES)), np.zeros(0, np.int8)
    return QuerySet(
        np.ascontiguousarray(x, dtype=np.float32), y, qptr, np.asarray(qids, dtype=str), name
    )


def query_terms(corpus: TextCorpus, q: int, stop: int) -> np.ndarray:
    """A query's terms without stop words (int64)."""
    t = corpus.query(q).astype(np.int64)
    return t[~stop_mask(corpus, stop)[t]]


def test_set(corpus: TextCorpus, n_cand: int, stop: int) -> QuerySet:
    """The external test set: held-out queries over every party (simulator-side, exact)."""
    return _on_corpus(corpus, ("test", n_cand, stop), lambda: _test_set(corpus, n_cand, stop))


def _test_set(corpus: TextCorpus, n_cand: int, stop: int) -> QuerySet:
    blocks, qids = [], []
    indexes = [party_text(corpus, p, stop) for p in range(corpus.n_parties)]
    for q in corpus.test_queries():
        terms = query_terms(corpus, q, stop)
        if not len(terms):
            continue
        xs, ys = [], []
        for p, idx in enumerate(indexes):
            docs = own_candidates(corpus, idx, p, q, terms, n_cand)
            xs.append(block_norm(exact_features(idx.fields, idx.stats, docs, terms)))
            ys.append(corpus.labels(q, docs + corpus.party_ptr[p]))
        y = np.concatenate(ys)
        if y.any():
            blocks.append((np.vstack(xs), y))
            qids.append(str(corpus.query_ids[q]))
    return query_set(blocks, qids, "csfltr-test")


def own_candidates(
    corpus: TextCorpus, idx: PartyText, p: int, q: int, terms: np.ndarray, n: int
) -> np.ndarray:
    """A party's candidates for a query over its own documents: its run (or BM25 top-n) plus
    the query's judged documents it owns (local ids)."""
    off = corpus.party_ptr[p]
    run = corpus.run(q)
    if run is not None and len(run):
        mine = run[corpus.party_of(run) == p] - off
    else:
        mine = _bm25_top(idx, terms, n)
    jd, _ = corpus.judged(q)
    return np.union1d(mine, jd[corpus.party_of(jd) == p] - off).astype(np.int64)

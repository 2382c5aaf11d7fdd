"""CS-F-LTR: cross-silo federated learning to rank (Wang, Tong, Shi, Xu, ICDE 2021).

Parties (companies; the run's ``client-NNNN`` agents, ``federation.clients`` of them) each hold
raw documents, their own training queries and the qrels of those queries over *every* party's
documents (as the querier's click logs would give them), but never another party's text. To
train on (own query, other party's document) pairs, a party needs features of documents it
cannot read. It gets them with private sketch queries relayed by the server:

1. *Reverse top-K* (``csfltr.rtk_query`` / ``csfltr.rtk_answer``): for each of its queries and
   each other party, the querier sends the obfuscated hash columns and signs of the query's terms
   (:func:`foltr_async.ltr.sketch.obfuscate`: z1 private rows per real term, the rest decoys).
   The owner returns the contents of the requested cells of its body-field RTK-Sketch, every
   count shifted by one shared Laplace(1/epsilon) draw. The querier intersects softly
   over its private rows only and keeps the ``pool`` best documents (plus the query's judged
   documents of that owner, whose ids its qrels name).
2. *Term frequencies* (``csfltr.tf_query`` / ``csfltr.tf_answer``): for those documents the
   querier sends the same obfuscated columns; the owner answers every requested Count Sketch
   entry of both fields with one shared Laplace(1/epsilon) draw added to all of them (so each
   estimate alone is epsilon-DP; see :mod:`foltr_async.ltr.sketch` for what that does not
   cover), plus document lengths and distinct-term counts (document metadata, sent exactly).
   The querier's median over its private rows, rounded to an integer (post-processing), gives
   the term frequencies; with the owner's collection statistics it computes the 16 features
   (:mod:`foltr_async.ltr.textfeatures`) and keeps the estimated-BM25 top ``candidates`` plus
   the judged documents, as it does for its own documents.

An owner draws each answer's noise from a generator keyed by its own secret and the query's
content (kind, columns, signs, documents): a repeated query gets the same answer, so repeats
cannot be averaged away, and answers do not depend on the order queries arrive in, so a run gives
the same results on the memory bus and over ZeroMQ.

Collection statistics (``csfltr.stats``): each party publishes once, through the relay, its
document count, field lengths and per-term df and cf with Laplace(1/epsilon) noise per term
(a deviation: a vocabulary-wide df vector has so large an L2 norm that a w = 200 Count Sketch of
it is useless for IDF; a document changes many terms' df, so the document-level guarantee of
this table is weaker than epsilon). Sketches and queries leave out the ``stopwords`` most
frequent terms of the corpus (a public stop list): stop words would dominate every sketch's
error and every RTK cell. Features are min-max normalised per (query, collection) block, which
cancels an answer's shared noise in the features linear in tf and the per-collection scale of
the statistics.

The server relays: it forwards a query to its owner under a fresh token and the answer back,
so an owner never learns which party asked. Every message crosses the bus as bytes, so the
byte counts per kind in results.json are real.

Then training runs on the generic round engine: the server broadcasts ``csfltr.model`` (linear
weights over the 16 normalised features); each party takes ``local_epochs`` full-batch
ListNet steps (Cao et al., ICML 2007) on its instances and replies ``csfltr.update``. Feature
generation is the first round's local work: a party receiving a round-1 model with
``generate = true`` runs steps 1-2 (event driven: its own inbox handles answers and the other
parties' queries meanwhile) and replies once its features are complete. Modes (``mode``):

- ``local``: own queries x own documents (exact features), trained alone;
- ``local+``: plus the cross-party instances, trained alone;
- ``global``: own instances, FedAvg across parties (horizontal FL, no privacy mechanism);
- ``csfltr``: own plus cross-party instances, FedAvg (the paper's method).

In the two local modes the parties still send their weights each round, but only so the server
can evaluate them (it never averages them): the reported metric is the mean over parties. The
evaluation is on an external test set: held-out queries whose candidates are each party's BM25
top ``local_candidates`` plus the judged documents, with exact features (each document's
statistics from its own party's collection, normalised per party block as in training);
nDCG@10 (queries with a relevant document), ERR@10 and nDCG over all candidates.

Measurements (``report()``, under ``csfltr``): for every reverse top-K answered during
generation, its cover rate against the exact top-K of the owner's collection (ties counted as
covered; see :func:`foltr_async.ltr.sketch.cover_rate`), the owner's and querier's compute time
per term and the bytes per term; NAIVE (``csfltr.naive_query``: every document's z entries of one
term, each document with its own noise, then the querier's median and top-K) is run on
``probe_terms`` terms per (querier, owner) pair for the same numbers, so the speed-up, byte
ratio and memory compare like with like. The big measurement (>= 10,000 documents per party) is
a documented command in the README.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from foltr_async.errors import ScenarioError
from foltr_async.ltr.metrics import err, ndcg
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.sketch import (
    DocSketch,
    Obfuscated,
    RTKSketch,
    SketchHashes,
    cover_rate,
    frequency_decoys,
    matched_decoys,
    median_estimate,
    noisy_answer,
    obfuscate,
    soft_intersection,
    top_k,
    uniform_decoys,
)
from foltr_async.ltr.text import BagOfWords, TextCorpus, load_msmarco, make_corpus
from foltr_async.ltr.textfeatures import (
    FEATURE_NAMES,
    CollectionStats,
    exact_features,
    field_features,
    query_minmax,
)
from foltr_async.registry import REGISTRY, BehaviourEntry, ProtocolEntry
from foltr_async.rng import stream
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.codec import Array, Bool, Int, Str, decode, register_kind
from foltr_async.runtime.engine import Strategy
from foltr_async.scenario.fields import Field
from foltr_async.simulation import ProtocolRun, RunContext
from protocols.eavesdrop import TapEavesdropper

MODEL = "csfltr.model"
UPDATE = "csfltr.update"
RTK_QUERY = "csfltr.rtk_query"
RTK_ANSWER = "csfltr.rtk_answer"
TF_QUERY = "csfltr.tf_query"
TF_ANSWER = "csfltr.tf_answer"
NAIVE_QUERY = "csfltr.naive_query"
NAIVE_ANSWER = "csfltr.naive_answer"
STATS = "csfltr.stats"
MEASURED = "csfltr.measured"  # probe extras key of the parties' raw measurements
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
QUERIES = {RTK_QUERY: RTK_ANSWER, TF_QUERY: TF_ANSWER, NAIVE_QUERY: NAIVE_ANSWER}

_REQ = Int(min=0, max=2**62)
_COLS = {"cols": Array("int32", ndim=2), "signs": Array("int8", ndim=2)}
register_kind(MODEL, {"params": Array("float64", ndim=1, finite=True), "generate": Bool()})
register_kind(
    UPDATE,
    {
        "params": Array("float64", ndim=1, finite=True),
        "n_queries": Int(min=0),
        "instances": Int(min=0),
    },
)
register_kind(RTK_QUERY, {"req": _REQ, "owner": Str(max_len=64), **_COLS})
register_kind(
    RTK_ANSWER,
    {
        "req": _REQ,
        "ptr": Array("int64"),
        "docs": Array("int32"),
        "counts": Array("float32"),
        "full": Array("bool"),
    },
)
register_kind(TF_QUERY, {"req": _REQ, "owner": Str(max_len=64), "docs": Array("int32"), **_COLS})
register_kind(
    TF_ANSWER,
    {
        "req": _REQ,
        "tf": Array("float32", ndim=4),  # (field, doc, term, row)
        "length": Array("int32", ndim=2),  # (field, doc)
        "unique": Array("int32", ndim=2),
    },
)
register_kind(
    STATS,
    {
        "owner": Str(max_len=64),
        "df": Array("float32", ndim=2),  # (field, term)
        "cf": Array("float32", ndim=2),
        "n_docs": Int(min=0),
        "total_len": Array("float64"),  # (field,)
    },
)
register_kind(NAIVE_QUERY, {"req": _REQ, "owner": Str(max_len=64), **_COLS})
register_kind(NAIVE_ANSWER, {"req": _REQ, "values": Array("float32", ndim=2)})  # (doc, row)

MODES = ("csfltr", "local", "local+", "global")

PARAMS = {
    "mode": Field(str, "csfltr", "training mode", choices=MODES),
    "corpus": Field(
        str,
        "synthetic",
        "embedded generator or MS MARCO TSV files",
        choices=("synthetic", "msmarco"),
    ),
    "collection": Field(str, None, "msmarco: collection TSV", nullable=True),
    "queries": Field(str, None, "msmarco: queries TSV", nullable=True),
    "qrels": Field(str, None, "msmarco: qrels (TREC format)", nullable=True),
    "run": Field(str, None, "msmarco: optional top-100 run (candidate lists)", nullable=True),
    "test_fraction": Field(
        float, 0.2, "msmarco: queries kept as the external test set", min=0.0, max=0.9
    ),
    "corpus_seed": Field(int, None, "corpus seed (default: the run's seed)", nullable=True, min=0),
    "docs_per_party": Field(int, 2000, "synthetic: documents per party", min=10),
    "vocab_size": Field(int, 20000, "synthetic: vocabulary size", min=1000),
    "topics": Field(int, 40, "synthetic: topics", min=1),
    "body_len": Field(int, 1000, "synthetic: mean body length (tokens)", min=10),
    "queries_per_party": Field(int, 40, "synthetic: training queries per party", min=1),
    "test_queries": Field(int, 100, "synthetic: external test queries", min=1),
    "judged": Field(list, [1, 3], "synthetic: documents judged 2 and 1 per query, corpus-wide"),
    "alpha": Field(float, 5.0, "RTK-Sketch: heap size alpha * K", min=1e-3),
    "beta": Field(float, 0.1, "RTK-Sketch: soft intersection share of cells", min=0.0, max=1.0),
    "w": Field(int, 200, "sketch columns", min=2),
    "z": Field(int, 30, "sketch rows (hash functions)", min=1, max=52),
    "z1": Field(int, 10, "rows hashing the real term (private to the querier)", min=1),
    "k": Field(int, 150, "reverse top-K size K", min=1),
    "epsilon": Field(
        float, 0.5, "Laplace(1/epsilon) noise per answer (inf: none)", min=1e-6, infinite=True
    ),
    "decoys": Field(
        str,
        "matched",
        "decoy terms: of matched frequency, frequency-weighted or uniform",
        choices=("matched", "frequency", "uniform"),
    ),
    "candidates": Field(
        int, 30, "cross-party documents per (query, owner), by estimated BM25", min=1
    ),
    "pool": Field(int, 90, "RTK documents per (query, owner) whose frequencies are asked", min=1),
    "local_candidates": Field(int, 30, "own documents per query (BM25 top-N)", min=1),
    "probe_terms": Field(int, 4, "terms per (querier, owner) measured with NAIVE too", min=0),
    "stopwords": Field(int, 100, "most frequent terms left out of sketches and queries", min=0),
    "lr": Field(float, 0.5, "ListNet learning rate", min=0.0),
    "local_epochs": Field(int, 10, "full-batch ListNet steps per round", min=1),
}

N_FEATURES = len(FEATURE_NAMES)


# ------------------------------------------------------------------------ data (cached)


@lru_cache(maxsize=2)
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
    p, fed = ctx.params, ctx.cfg["federation"]
    seed = p["corpus_seed"] if p["corpus_seed"] is not None else ctx.seed
    if p["corpus"] == "msmarco":
        missing = [k for k in ("collection", "queries", "qrels") if p[k] is None]
        if missing:
            raise ScenarioError(
                f'federation.params.{missing[0]}: required for corpus = "msmarco" (a TSV file path)'
            )
        key = (
            "msmarco",
            seed,
            p["collection"],
            p["queries"],
            p["qrels"],
            p["run"],
            fed["clients"],
            p["test_fraction"],
        )
    else:
        judged = p["judged"]
        if len(judged) != 2 or not all(isinstance(j, int) and j >= 0 for j in judged):
            raise ScenarioError(
                f"federation.params.judged: expected [grade-2 count, grade-1 "
                f"count] (two integers >= 0), got {judged!r}"
            )
        key = (
            "synthetic",
            seed,
            fed["clients"],
            p["docs_per_party"],
            p["vocab_size"],
            p["topics"],
            p["body_len"],
            p["queries_per_party"],
            p["test_queries"],
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


@lru_cache(maxsize=2)
def stop_mask(corpus: TextCorpus, n: int) -> np.ndarray:
    """The public stop list: the ``n`` most frequent terms of the whole corpus (mask)."""
    mask = np.zeros(corpus.n_terms, dtype=bool)
    mask[np.argsort(-corpus.body.coll_freq(), kind="stable")[:n]] = True
    return mask


@lru_cache(maxsize=16)
def _party_text(corpus: TextCorpus, p: int, stop: int) -> PartyText:
    """A party's fields, their stop-word-free versions and the exact statistics of its text."""
    own = corpus.party_docs(p)
    fields = (corpus.title.rows(own), corpus.body.rows(own))
    mask = stop_mask(corpus, stop)
    indexed = tuple(f.without(mask) for f in fields)
    return PartyText(fields, indexed, tuple(CollectionStats.of(f) for f in fields))


@lru_cache(maxsize=16)
def _party_index(
    corpus: TextCorpus, p: int, hashes: SketchHashes, k: int, alpha: float, stop: int
) -> PartyIndex:
    """A party's index: sketches of stop-word-free text (stop words would dominate every
    sketch's error, ||f||_2, and every RTK cell) and exact statistics of its full text."""
    t = _party_text(corpus, p, stop)
    return PartyIndex(
        fields=t.fields,
        indexed=t.indexed,
        stats=t.stats,
        doc_sketch=tuple(DocSketch(f, hashes) for f in t.indexed),
        rtk=RTKSketch.build(t.indexed[1], hashes, k, alpha),
    )


@lru_cache(maxsize=4)
def _hashes(seed: int, z: int, w: int) -> SketchHashes:
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


def _block_norm(x: np.ndarray) -> np.ndarray:
    """Min-max normalise one (query, collection) block of features."""
    return query_minmax(x, np.array([0, len(x)], dtype=np.int64))


def _group(blocks: list[tuple[np.ndarray, np.ndarray]], qids: list[str], name: str) -> QuerySet:
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


@lru_cache(maxsize=2)
def _test_set(corpus: TextCorpus, n_cand: int, stop: int) -> QuerySet:
    """The external test set: held-out queries over every party (simulator-side, exact)."""
    blocks, qids = [], []
    indexes = [_party_text(corpus, p, stop) for p in range(corpus.n_parties)]
    for q in corpus.test_queries():
        terms = query_terms(corpus, q, stop)
        if not len(terms):
            continue
        xs, ys = [], []
        for p, idx in enumerate(indexes):
            docs = _own_candidates(corpus, idx, p, q, terms, n_cand)
            xs.append(_block_norm(exact_features(idx.fields, idx.stats, docs, terms)))
            ys.append(corpus.labels(q, docs + corpus.party_ptr[p]))
        y = np.concatenate(ys)
        if y.any():
            blocks.append((np.vstack(xs), y))
            qids.append(str(corpus.query_ids[q]))
    return _group(blocks, qids, "csfltr-test")


def _own_candidates(
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


# ------------------------------------------------------------------------ training


def listnet_step(w: np.ndarray, qs: QuerySet, lr: float) -> np.ndarray:
    """One full-batch ListNet ascent step (top-one cross entropy, Cao et al. 2007).

    Per query, softmax over scores against the target distribution of gains 2^grade - 1 (a
    softmax over raw grades is nearly uniform on long candidate lists, most of them irrelevant,
    and teaches little); the gradient is X^T (P_target - P_scores) / n_queries, with segment
    sums by ``reduceat`` (no query loop). Every query needs a relevant document.
    """
    if qs.n_queries == 0:
        return w
    x = qs.features
    starts, sizes = qs.qptr[:-1], np.diff(qs.qptr)

    def softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - np.repeat(np.maximum.reduceat(v, starts), sizes))
        return e / np.repeat(np.add.reduceat(e, starts), sizes)

    gain = np.exp2(qs.labels.astype(np.float64)) - 1.0
    target = gain / np.repeat(np.add.reduceat(gain, starts), sizes)
    pred = softmax(x @ w)
    return w + lr * (x.T.astype(np.float64) @ (target - pred)) / qs.n_queries


def evaluate(w: np.ndarray, test: QuerySet) -> dict[str, float]:
    """nDCG@10, ERR@10 and nDCG (all candidates) of a linear model on the test set."""
    scores = test.features @ w
    full = int(np.diff(test.qptr).max()) if test.n_queries else 10
    return {
        "ndcg@10": float(np.nanmean(ndcg(scores, test, k=10))),
        "err@10": float(np.mean(err(scores, test, k=10, max_grade=2))),
        "ndcg": float(np.nanmean(ndcg(scores, test, k=full))),
    }


# ------------------------------------------------------------------------ reverse top-K steps
# The owner's and the querier's halves of a reverse top-K, by RTK-Sketch and by NAIVE: the agents
# call them on message bodies, and ``protocols.rtk_cost`` times them on one collection.


def rtk_answer(rtk: RTKSketch, cols: np.ndarray, eps: float, rng: np.random.Generator) -> dict:
    """Owner: the requested RTK cells, every count shifted by one shared Laplace(1/eps) draw."""
    ptr, docs, counts, full = rtk.cells(cols)
    return {"ptr": ptr, "docs": docs, "counts": noisy_answer(counts, eps, rng), "full": full}


def rtk_top(
    answer: dict, private: np.ndarray, k: int, beta: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Querier: each term's top-k documents and count bounds from its private cells only."""
    m, z = private.shape
    ptr = answer["ptr"]
    found, bounds = [], []
    for i in range(m):  # a handful of query terms; each term's cells are vectorised
        lo, hi = ptr[i * z], ptr[(i + 1) * z]
        docs, est = soft_intersection(
            ptr[i * z : (i + 1) * z + 1] - lo,
            answer["docs"][lo:hi],
            answer["counts"][lo:hi],
            answer["full"][i * z : (i + 1) * z],
            private[i],
            k,
            beta,
        )
        found.append(docs)
        bounds.append(np.maximum(est, 0.0))
    return found, bounds


def naive_answer(
    sketch: DocSketch, cols: np.ndarray, signs: np.ndarray, eps: float, rng: np.random.Generator
) -> np.ndarray:
    """Owner: one term's z signed entries in every document, each document with its own noise
    (NAIVE asks every document, each a query of its own)."""
    vals = sketch.lookup(np.arange(sketch.n_docs), cols[0]) * signs[0]  # (n, z)
    return noisy_answer(vals, eps, rng, per="row").astype(np.float32)


def naive_top(values: np.ndarray, private: np.ndarray, k: int) -> np.ndarray:
    """Querier: the top-k documents by the median over its private rows."""
    est = median_estimate(values.astype(np.float64)[:, None, :], private)
    return top_k(est[:, 0], k)


# ------------------------------------------------------------------------ party agent


@dataclass
class _Pending:
    """A cross-party block under way: one own query against one owner."""

    q: int
    owner: int
    obf: Obfuscated
    docs: np.ndarray | None = None  # the owner's documents asked for (after the RTK answer)


class Party(Agent):
    """A silo: answers other parties' sketch queries and builds its own training data."""

    role = "client"

    def __init__(self, agent_id: str, run: CSFLTR, p: int, rng: np.random.Generator) -> None:
        super().__init__(agent_id, run.ctx.bus)
        self.proto, self.p, self.rng = run, p, rng
        self.noise_key = int(rng.integers(2**63))  # secret of the owner's answer noise
        prm = run.ctx.params
        self.eps, self.z1, self.beta = prm["epsilon"], prm["z1"], prm["beta"]
        self.corpus, self.hashes = run.corpus, run.hashes
        self.index = run.index(p)
        self.queries = np.array(
            [q for q in run.corpus.train_queries(p).tolist() if len(run.terms(q))], dtype=np.int64
        )
        cf = self.index.stats[1].cf.astype(np.float64)
        self.decoys = {
            "matched": lambda: matched_decoys(cf),
            "frequency": lambda: frequency_decoys(cf),
            "uniform": lambda: uniform_decoys(run.corpus.n_terms),
        }[prm["decoys"]]()
        self.local = {int(q): self._local_block(int(q)) for q in self.queries}
        self.cross: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # q -> owner -> block
        self.weights = np.zeros(N_FEATURES)
        self.train_set: QuerySet | None = None
        self.pending: dict[int, _Pending] = {}
        self.owner_stats: dict[int, dict] = {}
        self.held: list = []  # TF answers waiting for their owner's statistics
        self.naive: dict[int, tuple[int, int, Obfuscated]] = {}
        self.next_req = 0
        self.generating = False
        self.waiting: tuple[int, np.ndarray] | None = None  # (round, model) held until ready

    def _local_block(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        terms = self.proto.terms(q)
        docs = _own_candidates(
            self.corpus, self.index, self.p, q, terms, self.proto.ctx.params["local_candidates"]
        )
        x = _block_norm(exact_features(self.index.fields, self.index.stats, docs, terms))
        return x, self.corpus.labels(q, docs + self.corpus.party_ptr[self.p])

    # -------------------------------------------------------------- rounds

    @handles(MODEL)
    def on_model(self, env) -> None:
        body = env.body
        if body["generate"] and not self.generating and self.train_set is None:
            self.generating = True
            self.waiting = (env.round, np.array(body["params"]))
            self._generate()
            self._maybe_ready()
            return
        if self.generating:  # a later round arrived first: answer it when ready
            self.waiting = (env.round, np.array(body["params"]))
            return
        self._train_and_reply(env.round, np.array(body["params"]))

    def _train_and_reply(self, round: int, model: np.ndarray) -> None:
        if self.train_set is None:
            self.train_set = self._build_train_set()
        mode = self.proto.mode
        w = self.weights if mode in ("local", "local+") else model
        for _ in range(self.proto.ctx.params["local_epochs"]):
            w = listnet_step(w, self.train_set, self.proto.ctx.params["lr"])
        self.weights = w
        self.send(
            "server",
            UPDATE,
            {
                "params": w,
                "n_queries": self.train_set.n_queries,
                "instances": self.train_set.n_docs,
            },
            round,
        )

    def _build_train_set(self) -> QuerySet:
        use_cross = self.proto.mode in ("csfltr", "local+")
        blocks, qids = [], []
        for q in self.queries.tolist():
            cross = self.cross.get(q, {}) if use_cross else {}
            parts = [self.local[q]] + [cross[o] for o in sorted(cross)]  # not arrival order
            y = np.concatenate([b[1] for b in parts])
            if y.any():  # ListNet learns nothing from a query without a relevant document
                blocks.append((np.vstack([b[0] for b in parts]), y))
                qids.append(str(self.corpus.query_ids[q]))
        ts = _group(blocks, qids, f"{self.id}-train")
        self.proto.record(
            self.id,
            {
                "queries": ts.n_queries,
                "instances": ts.n_docs,
                "cross_instances": int(
                    sum(len(b[1]) for per in self.cross.values() for b in per.values())
                ),
            },
        )
        return ts

    # -------------------------------------------------------------- querier side

    def _generate(self) -> None:
        """Send one reverse top-K query per (own query, other party), and the NAIVE probes."""
        n_probe = self.proto.ctx.params["probe_terms"]
        ix, eps = self.index, self.eps
        self.send(
            "server",
            STATS,
            {
                "owner": self.id,
                "df": np.stack(
                    [noisy_answer(s.df, eps, self.rng, per="row") for s in ix.stats]
                ).astype(np.float32),
                "cf": np.stack(
                    [noisy_answer(s.cf, eps, self.rng, per="row") for s in ix.stats]
                ).astype(np.float32),
                "n_docs": int(ix.stats[0].n_docs),
                "total_len": np.array([s.total_len for s in ix.stats], dtype=np.float64),
            },
        )
        for o in range(self.corpus.n_parties):
            if o == self.p:
                continue
            owner = self.proto.party_id(o)
            for q in self.queries.tolist():
                terms = self.proto.terms(q)
                obf = obfuscate(terms, self.hashes, self.z1, self.rng, self.decoys)
                req = self._req()
                self.pending[req] = _Pending(q, o, obf)
                self.proto.probe.oracle[RTK_QUERY, self.id, req] = terms
                self.send(
                    "server",
                    RTK_QUERY,
                    {"req": req, "owner": owner, "cols": obf.cols, "signs": obf.signs},
                )
            probe = np.unique(np.concatenate([self.proto.terms(q) for q in self.queries.tolist()]))[
                :n_probe
            ]
            for t in probe.tolist():
                obf = obfuscate(np.array([t]), self.hashes, self.z1, self.rng, self.decoys)
                req = self._req()
                self.naive[req] = (t, o, obf)
                self.proto.probe.oracle[NAIVE_QUERY, self.id, req] = np.array([t])
                self.send(
                    "server",
                    NAIVE_QUERY,
                    {"req": req, "owner": owner, "cols": obf.cols, "signs": obf.signs},
                )

    def _req(self) -> int:
        self.next_req += 1
        return self.next_req

    @handles(RTK_ANSWER)
    def on_rtk_answer(self, env) -> None:
        b = env.body
        job = self.pending[b["req"]]
        t0 = time.perf_counter()
        m = job.obf.cols.shape[0]
        found, bounds = rtk_top(b, job.obf.private, self.proto.k, self.beta)
        # candidates: documents by their bounds summed over the query's terms
        alld, inv = np.unique(np.concatenate(found), return_inverse=True)
        score = np.bincount(inv, weights=np.concatenate(bounds), minlength=len(alld))
        cand = alld[np.lexsort((alld, -score))][: self.proto.ctx.params["pool"]]
        elapsed = time.perf_counter() - t0
        self.proto.measure_rtk(self.id, job.owner, self.proto.terms(job.q), found, elapsed / m)
        jd, _ = self.corpus.judged(job.q)
        off = self.corpus.party_ptr[job.owner]
        mine = jd[self.corpus.party_of(jd) == job.owner] - off
        docs = np.union1d(cand, mine).astype(np.int32)
        job.docs = docs
        self.send(
            "server",
            TF_QUERY,
            {
                "req": b["req"],
                "owner": self.proto.party_id(job.owner),
                "docs": docs,
                "cols": job.obf.cols,
                "signs": job.obf.signs,
            },
        )

    @handles(TF_ANSWER)
    def on_tf_answer(self, env) -> None:
        job = self.pending[env.body["req"]]
        if job.owner not in self.owner_stats:  # its statistics are still on their way
            self.held.append(env)
            return
        del self.pending[env.body["req"]]
        b = env.body
        docs = job.docs
        st = self.owner_stats[job.owner]
        terms = self.proto.terms(job.q)
        # counts are integers: rounding (post-processing) removes the sketch's small errors,
        # which the concave BM25 and the log-likelihoods would otherwise blow up at tf = 0
        tf = np.rint(median_estimate(b["tf"].astype(np.float64), job.obf.private))
        x = np.hstack(
            [
                field_features(
                    tf[f],
                    b["length"][f],
                    b["unique"][f],
                    st["df"][f][terms],
                    st["cf"][f][terms],
                    st["n_docs"],
                    st["total_len"][f],
                )
                for f in range(2)
            ]
        )
        glob = docs.astype(np.int64) + self.corpus.party_ptr[job.owner]
        y = self.corpus.labels(job.q, glob)
        # like the own candidates: the estimated BM25 top-n plus the judged documents
        keep = np.zeros(len(docs), dtype=bool)
        keep[top_k(x[:, 12], self.proto.ctx.params["candidates"])] = True  # body BM25
        keep |= y > 0
        self.cross.setdefault(job.q, {})[job.owner] = (_block_norm(x[keep]), y[keep])
        self.proto.measure_tf(self.id, job.owner, docs, terms, tf)
        self._maybe_ready()

    @handles(STATS)
    def on_stats(self, env) -> None:
        b = env.body
        o = int(b["owner"].rsplit("-", 1)[-1])
        self.owner_stats[o] = {
            "df": b["df"].astype(np.float64),
            "cf": b["cf"].astype(np.float64),
            "n_docs": b["n_docs"],
            "total_len": b["total_len"],
        }
        held, self.held = self.held, []
        for env2 in held:
            self.on_tf_answer(env2)

    @handles(NAIVE_ANSWER)
    def on_naive_answer(self, env) -> None:
        t, o, obf = self.naive.pop(env.body["req"])
        t0 = time.perf_counter()
        top = naive_top(env.body["values"], obf.private, self.proto.k)
        self.proto.measure_naive(self.id, o, t, top, time.perf_counter() - t0)
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        if self.generating and not self.pending and not self.naive:
            self.generating = False
            if self.waiting is not None:
                r, model = self.waiting
                self.waiting = None
                self._train_and_reply(r, model)

    # -------------------------------------------------------------- owner side

    def _noise(self, kind: str, *query: np.ndarray) -> np.random.Generator:
        """The generator of one answer's noise: keyed by this owner's secret and the query's
        content, so a repeated query gets the same answer (repeats cannot be averaged) and no
        answer depends on the order queries arrive in (memory and ZeroMQ runs agree)."""
        h = hashlib.blake2b(kind.encode(), digest_size=16)
        for a in query:
            h.update(np.ascontiguousarray(a).tobytes())
        d = h.digest()
        return np.random.default_rng(
            [self.noise_key, int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")]
        )

    async def on_leave(self) -> None:
        # every party leaves at the end of a run, before results (and workers' flushes)
        self.proto.note_memory(self.id, self.index)

    @handles(RTK_QUERY)
    def on_rtk_query(self, env) -> None:
        t0 = time.perf_counter()
        b = env.body
        rng = self._noise(RTK_QUERY, b["cols"], b["signs"])
        answer = rtk_answer(self.index.rtk, b["cols"], self.eps, rng)
        self.proto.time(self.id, "rtk_owner_s", (time.perf_counter() - t0) / b["cols"].shape[0])
        self.send(env.src, RTK_ANSWER, {"req": b["req"], **answer})

    @handles(TF_QUERY)
    def on_tf_query(self, env) -> None:
        b = env.body
        docs = b["docs"].astype(np.int64)
        if len(docs) and (docs.min() < 0 or docs.max() >= self.index.fields[0].n_docs):
            raise ValueError(f"tf query names documents outside 0..{self.index.fields[0].n_docs}")
        cols, signs = b["cols"], b["signs"]
        ix = self.index
        tf = np.stack([s.lookup(docs, cols) * signs for s in ix.doc_sketch])  # (2, n, m, z)
        noisy = noisy_answer(tf, self.eps, self._noise(TF_QUERY, cols, signs, docs))
        self.send(
            env.src,
            TF_ANSWER,
            {
                "req": b["req"],
                "tf": noisy.astype(np.float32),
                "length": np.stack([f.lengths[docs] for f in ix.fields]).astype(np.int32),
                "unique": np.stack([f.unique[docs] for f in ix.fields]).astype(np.int32),
            },
        )

    @handles(NAIVE_QUERY)
    def on_naive_query(self, env) -> None:
        t0 = time.perf_counter()
        b = env.body
        rng = self._noise(NAIVE_QUERY, b["cols"], b["signs"])
        values = naive_answer(self.index.doc_sketch[1], b["cols"], b["signs"], self.eps, rng)
        self.proto.time(self.id, "naive_owner_s", time.perf_counter() - t0)
        self.send(env.src, NAIVE_ANSWER, {"req": b["req"], "values": values})


# ------------------------------------------------------------------------ server side


class CSFLTRStrategy(Strategy):
    """FedAvg (csfltr, global) or per-party evaluation only (local, local+)."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, run: CSFLTR) -> None:
        self.proto = run
        self.model = np.zeros(N_FEATURES)
        self.party_models: dict[str, np.ndarray] = {}
        self.generated = False

    def configure_round(self, round: int) -> dict:
        gen = not self.generated and self.proto.mode in ("csfltr", "local+")
        self.generated = True
        return {"params": self.model, "generate": gen}

    def aggregate(self, round: int, replies: list) -> dict:
        for r in replies:
            self.party_models[r.src] = np.array(r.body["params"])
        if self.proto.mode in ("csfltr", "global"):
            updates = np.stack([r.body["params"] for r in replies])
            weights = np.array([max(r.body["n_queries"], 1) for r in replies], dtype=np.float64)
            self.model = self.proto.ctx.aggregator.fn(updates, weights, self.proto.ctx.n_malicious)
        return {"parties": len(replies)}

    def evaluate(self) -> dict[str, float]:
        test = self.proto.test
        if self.proto.mode in ("csfltr", "global"):
            return evaluate(self.model, test)
        per = [evaluate(w, test) for _, w in sorted(self.party_models.items())]
        if not per:
            return evaluate(self.model, test)
        out = {k: float(np.mean([m[k] for m in per])) for k in per[0]}
        out["ndcg@10_min"] = float(min(m["ndcg@10"] for m in per))
        out["ndcg@10_max"] = float(max(m["ndcg@10"] for m in per))
        return out


class CSFLTR(ProtocolRun):
    """One CS-F-LTR run: the corpus, the parties, the relaying server and the measurements."""

    def __init__(self, ctx: RunContext) -> None:
        p, fed = ctx.params, ctx.cfg["federation"]
        if p["z1"] > p["z"]:
            raise ScenarioError(
                f"federation.params.z1: expected at most z = {p['z']}, got {p['z1']}"
            )
        if fed["clients"] < 2 and p["mode"] in ("csfltr", "local+"):
            raise ScenarioError("federation.clients: cross-silo modes need at least 2 parties")
        if ctx.n_malicious:
            raise ScenarioError("agents: csfltr has no attacker roles")
        self.ctx, self.mode, self.k = ctx, p["mode"], p["k"]
        self.probe = ctx.probe
        self.corpus = corpus_for(ctx)
        self.hashes = _hashes(ctx.seed, p["z"], p["w"])
        self.stop = p["stopwords"]
        self.test = _test_set(self.corpus, p["local_candidates"], self.stop)
        self.strategy = CSFLTRStrategy(self)
        self.routes: dict[int, tuple[str, int]] = {}

    def index(self, p: int) -> PartyIndex:
        return _party_index(
            self.corpus, p, self.hashes, self.k, self.ctx.params["alpha"], self.stop
        )

    def text(self, p: int) -> PartyText:
        return _party_text(self.corpus, p, self.stop)

    def terms(self, q: int) -> np.ndarray:
        return query_terms(self.corpus, q, self.stop)

    def party_id(self, p: int) -> str:
        return client_id(p)

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        # a worker process builds only its own parties: the number is in the id
        ids = {self.party_id(p): p for p in range(self.corpus.n_parties)}
        if agent_id not in ids:
            raise ScenarioError(f"csfltr: unexpected party id {agent_id}")
        return Party(agent_id, self, ids[agent_id], rng)

    # -------------------------------------------------------------- relay

    def attach_server(self, server) -> None:
        self.server = server
        token = iter(range(1, 2**62))

        def forward(env) -> None:
            t = next(token)
            self.routes[t] = (env.src, env.body["req"])
            server.send(env.body["owner"], env.kind, {**env.body, "req": t}, env.round)

        def back(env) -> None:
            route = self.routes.pop(env.body["req"], None)
            if route is None:
                server.bus.report_drop(
                    "no_handler", "answer to an unknown relay token", env.src, server.id, env.kind
                )
                return
            server.send(route[0], env.kind, {**env.body, "req": route[1]}, env.round)

        for q, a in QUERIES.items():
            server.on(q, forward)
            server.on(a, back)

        def publish(env) -> None:  # collection statistics go to every other party
            for p in range(self.corpus.n_parties):
                if self.party_id(p) != env.src:
                    server.send(self.party_id(p), STATS, env.body, env.round)

        server.on(STATS, publish)

    # -------------------------------------------------------------- measurement

    # Each party's measurements go to the probe's extras under its id, so those of parties
    # hosted by worker processes reach the server with the workers' flushes; report() takes them.

    def _measured(self, aid: str) -> dict:
        per = self.probe.extras.setdefault(MEASURED, {})
        return per.setdefault(
            aid, {"stats": {k: [] for k in _STATS}, "instances": None, "memory": None}
        )

    def record(self, aid: str, value: dict) -> None:
        self._measured(aid)["instances"] = value

    def note_memory(self, aid: str, index: PartyIndex) -> None:
        """The party's structures' bytes at the end (with the RTK-Sketch's query view, if any
        query built it)."""
        mem = {"rtk": index.rtk.nbytes, "sketch": index.doc_sketch[1].nbytes}
        self._measured(aid)["memory"] = mem

    def time(self, aid: str, key: str, seconds: float) -> None:
        self._measured(aid)["stats"][key].append(seconds)

    def _cover(self, aid: str, prefix: str, owner: int, term: int, found: np.ndarray) -> None:
        true = self.text(owner).fields[1].term_counts(int(term))
        c = cover_rate(found, true, self.k)
        stats = self._measured(aid)["stats"]
        stats[f"{prefix}_cover"].append(c)
        if (true >= 2).sum() >= self.k:  # K documents hold the term at least twice
            stats[f"{prefix}_rankable"].append(c)

    def measure_rtk(
        self, aid: str, owner: int, terms: np.ndarray, found: list, seconds: float
    ) -> None:
        for t, f in zip(terms.tolist(), found, strict=True):
            self._cover(aid, "rtk", owner, t, f)
            self._measured(aid)["stats"]["rtk_query_s"].append(seconds)

    def measure_naive(
        self, aid: str, owner: int, term: int, top: np.ndarray, seconds: float
    ) -> None:
        self._cover(aid, "naive", owner, term, top)
        self._measured(aid)["stats"]["naive_query_s"].append(seconds)

    def measure_tf(
        self, aid: str, owner: int, docs: np.ndarray, terms: np.ndarray, est: np.ndarray
    ) -> None:
        true = np.stack([f.tf(docs, terms) for f in self.text(owner).fields])
        stats = self._measured(aid)["stats"]
        stats["tf_abs_err"].append(float(np.abs(est - true).mean()))
        stats["tf_true"].append(float(true.mean()))

    def report(self) -> dict:
        measured = self.probe.extras.pop(MEASURED, {})  # raw lists: summarised here, not written
        parties = sorted(measured)
        s = {k: [v for a in parties for v in measured[a]["stats"][k]] for k in _STATS}
        instances = {a: measured[a]["instances"] for a in parties if measured[a]["instances"]}
        p = self.ctx.params
        kinds = self.ctx.bus.stats.as_dict()["kinds"]

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
            "mode": self.mode,
            "parties": self.corpus.n_parties,
            "docs": int(self.corpus.n_docs),
            "params": {k: p[k] for k in ("alpha", "beta", "w", "z", "z1", "k", "epsilon")},
            "instances": instances,
            "test_queries": self.test.n_queries,
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
        return {"csfltr": out}


# ------------------------------------------------------------------------ eavesdropper


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

    def __init__(self, agent_id: str, run: CSFLTR, rng: np.random.Generator) -> None:
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
        z, z1 = p["z"], p["z1"]
        return {
            "protocol": "csfltr",
            "sees": "per query term: z (column, sign) pairs; per answer: counts with one "
            "shared Laplace(1/epsilon) draw",
            "epsilon": p["epsilon"],
            "knows_hash_key": True,
            "terms": self.trials,
            "vote_accuracy": self.hits / self.trials if self.trials else None,
            "rarest_accuracy": self.prior_hits / self.trials if self.trials else None,
            "z1_over_z": z1 / z,
            "expected": 1.0 / math.floor(z / z1) if z1 <= z else 1.0,
            "mean_tied_candidates": float(np.mean(self.tied)) if self.tied else None,
        }


def _eavesdropper(ctx, proto, group, aid, queries, rng):
    return RelayEavesdropper(aid, proto, rng)


REGISTRY.add(
    ProtocolEntry(
        "csfltr",
        "CS-F-LTR: cross-silo LTR with private sketch queries and RTK-Sketch",
        PARAMS,
        CSFLTR,
    )
)
REGISTRY.add(
    BehaviourEntry(
        "csfltr_eavesdropper",
        "eavesdropper",
        "taps the CS-F-LTR relay and guesses queried terms from the obfuscated hashes",
        ("csfltr",),
        {},
        _eavesdropper,
    )
)

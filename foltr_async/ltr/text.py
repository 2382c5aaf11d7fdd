"""Party-partitioned text corpora for cross-silo LTR (CS-F-LTR, Wang, Tong, Shi, Xu, ICDE 2021).

CS-F-LTR parties hold *raw text*: documents (title and body) and queries with graded relevance
judgements. Everything here is plain arrays, shared read-only; which party may read what is the
protocol's business (``protocols/csfltr/``), not this module's.

A text field of many documents is a :class:`BagOfWords`: sparse term counts in CSR form (terms
sorted within a document), because features, sketches and relevance all need term frequencies,
never token order. A :class:`TextCorpus` concatenates the parties' documents (party ``p`` owns
documents ``party_ptr[p]:party_ptr[p+1]``) and holds the queries (owner party, or -1 for the
external test set) and the qrels (graded 0/1/2, over documents of any party, as the querier's
click logs would give them).

Two sources:

- :func:`make_corpus`, the embedded default: a deterministic generator with a Zipfian background
  vocabulary and topics. Each document draws its own weights over its topic's words (so the term
  frequency of a topical word varies strongly across documents, as it does in real text), a body
  of about ``body_len`` tokens and a short title. Parties mix topics differently (non-IID). Each
  query takes a few words of one topic; its qrels come from a hidden relevance score (saturated
  body term frequencies weighted by rarity, title hits, query-term coverage, and a per-document
  quality no feature sees), cut into grade 2 for the best ``rel2`` documents of the whole corpus
  and grade 1 for the next ``rel1``.
- :func:`load_msmarco`: MS MARCO-style TSV files (collection, queries, qrels, optionally a top-100
  run giving candidate lists), split over parties by a seeded permutation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from foltr_async.errors import DatasetError

__all__ = ["BagOfWords", "TextCorpus", "load_msmarco", "make_corpus", "tokenize"]


@dataclass(frozen=True, eq=False)
class BagOfWords:
    """One text field of many documents as sparse term counts (CSR; terms sorted per document)."""

    indptr: np.ndarray  # (n_docs + 1,) int64
    terms: np.ndarray  # (nnz,) int32, ascending within each document
    counts: np.ndarray  # (nnz,) int32, > 0
    n_terms: int  # vocabulary size

    def __post_init__(self) -> None:
        for arr in (self.indptr, self.terms, self.counts):
            arr.setflags(write=False)

    @classmethod
    def from_tokens(
        cls, doc: np.ndarray, term: np.ndarray, n_docs: int, n_terms: int
    ) -> BagOfWords:
        """Count (document, term) token pairs; one sort over all tokens, no per-document loop."""
        keys, counts = np.unique(doc.astype(np.int64) * n_terms + term, return_counts=True)
        docs = keys // n_terms
        indptr = np.zeros(n_docs + 1, dtype=np.int64)
        np.cumsum(np.bincount(docs, minlength=n_docs), out=indptr[1:])
        return cls(indptr, (keys % n_terms).astype(np.int32), counts.astype(np.int32), n_terms)

    @property
    def n_docs(self) -> int:
        return len(self.indptr) - 1

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per document."""
        return np.bincount(self.row, weights=self.counts, minlength=self.n_docs).astype(np.int64)

    @cached_property
    def unique(self) -> np.ndarray:
        """Distinct terms per document."""
        return np.diff(self.indptr)

    @cached_property
    def row(self) -> np.ndarray:
        """Document index of every stored entry."""
        return np.repeat(np.arange(self.n_docs, dtype=np.int64), np.diff(self.indptr))

    @cached_property
    def _keys(self) -> np.ndarray:
        return self.row * self.n_terms + self.terms  # ascending: rows, then sorted terms

    def tf(self, docs: np.ndarray, terms: np.ndarray) -> np.ndarray:
        """Exact counts, shape (len(docs), len(terms)), by one binary search per cell."""
        docs = np.asarray(docs, dtype=np.int64)
        terms = np.asarray(terms, dtype=np.int64)
        want = (docs[:, None] * self.n_terms + terms[None, :]).ravel()
        pos = np.searchsorted(self._keys, want)
        pos = np.minimum(pos, max(len(self._keys) - 1, 0))
        hit = self._keys[pos] == want if len(self._keys) else np.zeros(len(want), bool)
        out = np.where(hit, self.counts[pos] if len(self.counts) else 0, 0)
        return out.reshape(len(docs), len(terms)).astype(np.int32)

    def rows(self, docs: np.ndarray | slice) -> BagOfWords:
        """The documents ``docs`` (a slice keeps views; an index array copies)."""
        if isinstance(docs, slice):
            start, stop, _ = docs.indices(self.n_docs)
            a, b = self.indptr[start], self.indptr[stop]
            return BagOfWords(
                self.indptr[start : stop + 1] - a, self.terms[a:b], self.counts[a:b], self.n_terms
            )
        docs = np.asarray(docs, dtype=np.int64)
        sizes = self.indptr[docs + 1] - self.indptr[docs]
        indptr = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(sizes, out=indptr[1:])
        idx = np.repeat(self.indptr[docs] - indptr[:-1], sizes) + np.arange(indptr[-1])
        return BagOfWords(indptr, self.terms[idx], self.counts[idx], self.n_terms)

    def without(self, drop: np.ndarray) -> BagOfWords:
        """The same documents without the terms ``drop`` marks (a boolean mask over the vocabulary),
        e.g. a stop list; lengths and distinct-term counts then count only what is kept."""
        keep = ~np.asarray(drop, dtype=bool)[self.terms]
        indptr = np.zeros(self.n_docs + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.row[keep], minlength=self.n_docs), out=indptr[1:])
        return BagOfWords(indptr, self.terms[keep], self.counts[keep], self.n_terms)

    def doc_freq(self) -> np.ndarray:
        """Documents containing each term, (n_terms,) int64."""
        return np.bincount(self.terms, minlength=self.n_terms)

    def coll_freq(self) -> np.ndarray:
        """Occurrences of each term over all documents, (n_terms,) int64."""
        return np.bincount(self.terms, weights=self.counts, minlength=self.n_terms).astype(np.int64)

    @cached_property
    def postings(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Term-major index: (tptr, docs, counts); documents of term t at tptr[t]:tptr[t+1]."""
        order = np.argsort(self.terms, kind="stable")
        tptr = np.zeros(self.n_terms + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.terms, minlength=self.n_terms), out=tptr[1:])
        return tptr, self.row[order], self.counts[order]

    def term_counts(self, term: int) -> np.ndarray:
        """Occurrences of one term in every document, (n_docs,) int64 (from the postings)."""
        tptr, tdocs, tcounts = self.postings
        out = np.zeros(self.n_docs, dtype=np.int64)
        out[tdocs[tptr[term] : tptr[term + 1]]] = tcounts[tptr[term] : tptr[term + 1]]
        return out

    @property
    def nbytes(self) -> int:
        return self.indptr.nbytes + self.terms.nbytes + self.counts.nbytes


def _csr(groups: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([len(g) for g in groups], out=ptr[1:])
    flat = np.concatenate(groups).astype(dtype) if groups else np.zeros(0, dtype)
    return ptr, flat


@dataclass(frozen=True, eq=False)
class TextCorpus:
    """Documents of every party (concatenated), queries and graded qrels over all documents."""

    vocab: np.ndarray  # (n_terms,) str
    title: BagOfWords
    body: BagOfWords
    doc_ids: np.ndarray  # (n_docs,) str
    party_ptr: np.ndarray  # (n_parties + 1,) int64
    query_ptr: np.ndarray  # (n_queries + 1,) int64 into query_terms
    query_terms: np.ndarray  # int32 term ids (distinct within a query)
    query_ids: np.ndarray  # (n_queries,) str
    query_party: np.ndarray  # (n_queries,) int16: owner party, -1 for the external test set
    qrel_ptr: np.ndarray  # (n_queries + 1,) int64 into qrel_docs / qrel_grades
    qrel_docs: np.ndarray  # int64 global document indices
    qrel_grades: np.ndarray  # int8 grades 1..2 (unjudged documents are 0)
    run_ptr: np.ndarray | None = None  # optional candidate lists (a top-100 run)
    run_docs: np.ndarray | None = None

    @property
    def n_parties(self) -> int:
        return len(self.party_ptr) - 1

    @property
    def n_docs(self) -> int:
        return self.body.n_docs

    @property
    def n_queries(self) -> int:
        return len(self.query_ptr) - 1

    @property
    def n_terms(self) -> int:
        return len(self.vocab)

    def party_docs(self, p: int) -> slice:
        return slice(int(self.party_ptr[p]), int(self.party_ptr[p + 1]))

    def party_of(self, docs: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.party_ptr, np.asarray(docs), side="right") - 1

    def query(self, q: int) -> np.ndarray:
        return self.query_terms[self.query_ptr[q] : self.query_ptr[q + 1]]

    def judged(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        s = slice(int(self.qrel_ptr[q]), int(self.qrel_ptr[q + 1]))
        return self.qrel_docs[s], self.qrel_grades[s]

    def run(self, q: int) -> np.ndarray | None:
        if self.run_ptr is None:
            return None
        return self.run_docs[self.run_ptr[q] : self.run_ptr[q + 1]]

    def train_queries(self, p: int) -> np.ndarray:
        return np.flatnonzero(self.query_party == p)

    def test_queries(self) -> np.ndarray:
        return np.flatnonzero(self.query_party < 0)

    def labels(self, q: int, docs: np.ndarray) -> np.ndarray:
        """Grades of ``docs`` for query ``q`` (0 where unjudged)."""
        jd, jg = self.judged(q)
        out = np.zeros(len(docs), dtype=np.int8)
        if len(jd):
            order = np.argsort(jd)
            pos = np.minimum(np.searchsorted(jd[order], docs), len(jd) - 1)
            hit = jd[order][pos] == docs
            out[hit] = jg[order][pos[hit]]
        return out


# ------------------------------------------------------------------------ synthetic corpus


def _zipf(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return p / p.sum()


def _alias(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias table of a categorical (Vose's construction, O(n) once per corpus).

    Sampling is then two array lookups per draw, which keeps millions of background tokens
    cheap where a CDF binary search over a large vocabulary would not be.
    """
    n = len(p)
    prob = p * n
    alias = np.zeros(n, dtype=np.int64)
    small = [i for i in range(n) if prob[i] < 1.0]
    large = [i for i in range(n) if prob[i] >= 1.0]
    while small and large:
        s, g = small.pop(), large.pop()
        alias[s] = g
        prob[g] -= 1.0 - prob[s]
        (small if prob[g] < 1.0 else large).append(g)
    prob[small + large] = 1.0
    return prob, alias


def _draw_rows(cdf: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per entry of ``rows`` from the categorical whose CDF is ``cdf[row]``.

    The CDFs of all rows are laid end to end (row r shifted by r), so one searchsorted samples
    every token of every document at once.
    """
    n_rows, width = cdf.shape
    flat = (cdf + np.arange(n_rows)[:, None]).ravel()
    u = rows + rng.random(len(rows)) * (1.0 - 1e-12)
    return np.searchsorted(flat, u, side="right") - rows * width


def make_corpus(
    rng: np.random.Generator,
    *,
    n_parties: int = 4,
    docs_per_party: int = 2000,
    vocab_size: int = 20000,
    n_topics: int = 40,
    topic_words: int = 150,
    body_len: int = 1000,
    title_len: int = 8,
    topic_share: float = 0.25,
    zipf: float = 1.05,
    party_skew: float = 0.5,
    queries_per_party: int = 40,
    test_queries: int = 100,
    query_terms: tuple[int, int] = (2, 4),
    rel2: int = 4,
    rel1: int = 16,
    quality: float = 0.6,
) -> TextCorpus:
    """The embedded synthetic corpus (see the module docstring); deterministic given ``rng``."""
    if n_parties < 1 or docs_per_party < 1:
        raise ValueError("need at least one party with at least one document")
    if topic_words * 2 > vocab_size:
        raise ValueError("topic_words must be at most half the vocabulary")
    n_docs = n_parties * docs_per_party
    V = vocab_size
    bg_prob, bg_alias = _alias(_zipf(V, zipf))
    # topic words come from below the most frequent 1% (no stop words as topic words)
    lo = max(1, V // 100)
    topics = np.stack(
        [rng.choice(np.arange(lo, V), topic_words, replace=False) for _ in range(n_topics)]
    )
    topic_w = _zipf(topic_words, 0.8)
    mix = rng.dirichlet(np.full(n_topics, party_skew), size=n_parties)
    party = np.repeat(np.arange(n_parties), docs_per_party)
    doc_topic = _draw_rows(np.cumsum(mix, axis=1), party, rng)
    # each document's own weights over its topic's words: gamma(0.5) lets a few words dominate
    w = topic_w[None, :] * rng.gamma(0.5, 1.0, size=(n_docs, topic_words))
    doc_cdf = np.cumsum(w / w.sum(axis=1, keepdims=True), axis=1)

    def tokens(lengths: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
        doc = np.repeat(np.arange(n_docs), lengths)
        topical = rng.random(len(doc)) < share
        term = rng.integers(0, V, len(doc))
        term = np.where(rng.random(len(doc)) < bg_prob[term], term, bg_alias[term])
        idx = _draw_rows(doc_cdf, doc[topical], rng)
        term[topical] = topics[doc_topic[doc[topical]], idx]
        return doc, term

    body_lengths = np.maximum(50, np.rint(body_len * rng.lognormal(0.0, 0.3, n_docs))).astype(
        np.int64
    )
    title_lengths = rng.integers(max(1, title_len // 2), title_len * 3 // 2 + 1, n_docs)
    body = BagOfWords.from_tokens(*tokens(body_lengths, topic_share), n_docs, V)
    title = BagOfWords.from_tokens(*tokens(title_lengths, 0.7), n_docs, V)

    # queries: training queries follow their party's topic mix, test queries are uniform
    q_party = np.concatenate(
        [np.repeat(np.arange(n_parties), queries_per_party), np.full(test_queries, -1)]
    ).astype(np.int16)
    q_topic = np.where(
        q_party >= 0,
        _draw_rows(np.cumsum(mix, axis=1), np.maximum(q_party, 0), rng),
        rng.integers(0, n_topics, len(q_party)),
    )
    sizes = rng.integers(query_terms[0], query_terms[1] + 1, len(q_party))
    qgroups = [
        np.sort(rng.choice(topics[k], int(m), replace=False, p=topic_w))
        for k, m in zip(q_topic, sizes, strict=True)
    ]
    query_ptr, query_terms_arr = _csr(qgroups, np.int32)

    doc_quality = rng.normal(0.0, quality, n_docs)
    rel_groups, grade_groups = [], []
    for q in range(len(q_party)):  # per query, vectorised over documents
        docs, grades = _qrels(
            body, title, query_terms_arr[query_ptr[q] : query_ptr[q + 1]], doc_quality, rel2, rel1
        )
        rel_groups.append(docs)
        grade_groups.append(grades)
    qrel_ptr, qrel_docs = _csr(rel_groups, np.int64)
    _, qrel_grades = _csr(grade_groups, np.int8)
    party_ptr = np.arange(n_parties + 1, dtype=np.int64) * docs_per_party
    doc_ids = np.char.add(
        np.char.add("p", party.astype(str)),
        np.char.add("-d", np.char.zfill(np.arange(n_docs).astype(str), 6)),
    )
    return TextCorpus(
        vocab=np.char.add("w", np.char.zfill(np.arange(V).astype(str), 5)),
        title=title,
        body=body,
        doc_ids=doc_ids,
        party_ptr=party_ptr,
        query_ptr=query_ptr,
        query_terms=query_terms_arr,
        query_ids=np.char.add("q", np.char.zfill(np.arange(len(q_party)).astype(str), 5)),
        query_party=q_party,
        qrel_ptr=qrel_ptr,
        qrel_docs=qrel_docs,
        qrel_grades=qrel_grades,
    )


def _qrels(
    body: BagOfWords,
    title: BagOfWords,
    terms: np.ndarray,
    doc_quality: np.ndarray,
    rel2: int,
    rel1: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Hidden relevance of every document containing a query term; the best get grades 2, 1."""
    tptr, tdocs, tcounts = body.postings
    hptr, hdocs, _ = title.postings
    n = body.n_docs
    avg = body.lengths.mean()
    score = np.zeros(n)
    hits = np.zeros(n)
    in_title = np.zeros(n)
    for t in terms:  # a query has a handful of terms
        d = tdocs[tptr[t] : tptr[t + 1]]
        c = tcounts[tptr[t] : tptr[t + 1]].astype(np.float64)
        idf = np.log(1.0 + n / (len(d) + 1.0))
        sat = c / (c + 1.5 * (0.25 + 0.75 * body.lengths[d] / avg))
        score[d] += idf * sat
        hits[d] += 1.0
        in_title[hdocs[hptr[t] : hptr[t + 1]]] += 1.0
    cand = np.flatnonzero(hits > 0)
    if not len(cand):
        return np.zeros(0, np.int64), np.zeros(0, np.int8)
    s = score[cand] + 0.8 * in_title[cand] + 1.5 * hits[cand] / len(terms) + doc_quality[cand]
    order = cand[np.argsort(-s, kind="stable")][: rel2 + rel1]
    grades = np.where(np.arange(len(order)) < rel2, 2, 1).astype(np.int8)
    return order, grades


# ------------------------------------------------------------------------ MS MARCO loader

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric tokens (the loader's only text processing: no stemming)."""
    return _TOKEN.findall(text.lower())


def _rows(
    path: Path, min_cols: int, max_cols: int, what: str, sep: str | None = "\t"
) -> list[tuple[int, list[str]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such {what} file") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cols = line.rstrip("\r\n").split(sep) if sep else line.split()
        if not min_cols <= len(cols) <= max_cols:
            want = str(min_cols) if min_cols == max_cols else f"{min_cols} to {max_cols}"
            raise DatasetError(
                f"{path}:{i}: expected {want} columns in a {what} line, got {len(cols)}"
            )
        out.append((i, cols))
    if not out:
        raise DatasetError(f"{path}: empty {what} file")
    return out


def load_msmarco(
    collection: str | Path,
    queries: str | Path,
    qrels: str | Path,
    rng: np.random.Generator,
    *,
    run: str | Path | None = None,
    n_parties: int = 4,
    test_fraction: float = 0.2,
) -> TextCorpus:
    """Read MS MARCO-style TSV files into a party-partitioned corpus.

    - ``collection``: ``pid<TAB>passage`` (passage ranking: empty titles), ``docid<TAB>title<TAB>
      body`` or ``docid<TAB>url<TAB>title<TAB>body`` (document ranking).
    - ``queries``: ``qid<TAB>text``.
    - ``qrels``: TREC ``qid 0 docid grade`` (tabs or spaces); grades above 2 are capped at 2,
      grade 0 lines are skipped (unjudged and judged-irrelevant are both 0 here).
    - ``run`` (optional top-100 candidates): TREC ``qid Q0 docid rank score tag``, or
      ``qid<TAB>docid<TAB>rank``; the candidate lists replace BM25 retrieval for those queries.

    Documents are dealt to parties by a seeded permutation; queries that have qrels are dealt to
    parties too, except a ``test_fraction`` kept as the external test set. Every malformed line
    is a one-line DatasetError naming file and line.
    """
    if n_parties < 1:
        raise ValueError("n_parties must be >= 1")
    coll_path = Path(collection)
    vocab: dict[str, int] = {}

    def ids(words: list[str]) -> list[int]:
        return [vocab.setdefault(w, len(vocab)) for w in words]

    doc_ids, titles, bodies = [], [], []
    for _, cols in _rows(coll_path, 2, 4, "collection"):
        doc_ids.append(cols[0].strip())
        body = cols[-1]
        title = cols[-2] if len(cols) >= 3 else ""
        titles.append(ids(tokenize(title)))
        bodies.append(ids(tokenize(body)))
    index = {d: i for i, d in enumerate(doc_ids)}
    if len(index) != len(doc_ids):
        raise DatasetError(f"{coll_path}: duplicate document ids")
    q_text: dict[str, list[int]] = {}
    q_path = Path(queries)
    for i, cols in _rows(q_path, 2, 2, "queries"):
        words = tokenize(cols[1])
        if not words:
            raise DatasetError(f"{q_path}:{i}: query {cols[0]!r} has no terms")
        q_text[cols[0].strip()] = ids(words)
    judged: dict[str, dict[int, int]] = {}
    r_path = Path(qrels)
    for i, cols in _rows(r_path, 4, 4, "qrels", sep=None):
        qid, _, did, grade = cols
        if qid not in q_text:
            raise DatasetError(f"{r_path}:{i}: query {qid!r} is not in {q_path.name}")
        if did not in index:
            raise DatasetError(f"{r_path}:{i}: document {did!r} is not in {coll_path.name}")
        try:
            g = int(grade)
        except ValueError:
            raise DatasetError(f"{r_path}:{i}: grade must be an integer, got {grade!r}") from None
        if g > 0:
            judged.setdefault(qid, {})[index[did]] = min(g, 2)
    runs: dict[str, list[int]] = {}
    if run is not None:
        run_path = Path(run)
        for i, cols in _rows(run_path, 3, 6, "run", sep=None):
            if len(cols) not in (3, 6):
                raise DatasetError(
                    f"{run_path}:{i}: expected 3 or 6 columns in a run line, got {len(cols)}"
                )
            qid, did = cols[0], cols[2] if len(cols) == 6 else cols[1]
            if did not in index:
                raise DatasetError(f"{run_path}:{i}: document {did!r} is not in {coll_path.name}")
            runs.setdefault(qid, []).append(index[did])
    qids = sorted(judged)
    if not qids:
        raise DatasetError(f"{r_path}: no positive judgements")
    n_docs = len(doc_ids)
    perm = rng.permutation(n_docs)  # new position of every document
    order = np.argsort(perm)
    V = len(vocab)

    def field(rows: list[list[int]]) -> BagOfWords:
        lens = np.array([len(r) for r in rows], dtype=np.int64)
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(lens.sum()))
        return BagOfWords.from_tokens(perm[np.repeat(np.arange(n_docs), lens)], flat, n_docs, V)

    q_perm = rng.permutation(len(qids))
    n_test = int(round(test_fraction * len(qids)))
    q_party = np.full(len(qids), -1, dtype=np.int16)
    q_party[q_perm[n_test:]] = np.arange(len(qids) - n_test) % n_parties
    qgroups = [np.unique(np.asarray(q_text[q], dtype=np.int32)) for q in qids]
    query_ptr, query_terms = _csr(qgroups, np.int32)
    rel = [np.asarray(perm[list(judged[q])], dtype=np.int64) for q in qids]
    grades = [np.asarray(list(judged[q].values()), dtype=np.int8) for q in qids]
    qrel_ptr, qrel_docs = _csr(rel, np.int64)
    _, qrel_grades = _csr(grades, np.int8)
    run_ptr = run_docs = None
    if run is not None:
        run_ptr, run_docs = _csr(
            [perm[np.asarray(runs.get(q, []), dtype=np.int64)] for q in qids], np.int64
        )
    bounds = np.linspace(0, n_docs, n_parties + 1).round().astype(np.int64)
    return TextCorpus(
        vocab=np.array(list(vocab)),
        title=field(titles),
        body=field(bodies),
        doc_ids=np.asarray(doc_ids)[order],
        party_ptr=bounds,
        query_ptr=query_ptr,
        query_terms=query_terms,
        query_ids=np.asarray(qids),
        query_party=q_party,
        qrel_ptr=qrel_ptr,
        qrel_docs=qrel_docs,
        qrel_grades=qrel_grades,
        run_ptr=run_ptr,
        run_docs=run_docs,
    )

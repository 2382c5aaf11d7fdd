"""Text corpora for CS-F-LTR: the synthetic generator and the MS MARCO-style TSV loader."""

import numpy as np
import pytest

from foltr_async.errors import DatasetError
from foltr_async.ltr.text import BagOfWords, load_msmarco, make_corpus, tokenize
from foltr_async.ltr.textfeatures import (
    FEATURE_NAMES,
    CollectionStats,
    exact_features,
    field_features,
    query_minmax,
)
from foltr_async.rng import stream


def small_corpus(seed: int):
    return make_corpus(
        stream(seed, "t"),
        n_parties=3,
        docs_per_party=150,
        vocab_size=3000,
        n_topics=6,
        body_len=300,
        queries_per_party=5,
        test_queries=6,
    )


@pytest.fixture(scope="module")
def corpus():
    return small_corpus(3)


def test_synthetic_corpus_is_deterministic_and_shaped_as_asked(corpus):
    again = small_corpus(3)
    assert np.array_equal(corpus.body.terms, again.body.terms)
    assert np.array_equal(corpus.qrel_docs, again.qrel_docs)
    assert corpus.n_parties == 3 and corpus.n_docs == 450
    assert list(corpus.party_ptr) == [0, 150, 300, 450]
    assert 200 < corpus.body.lengths.mean() < 400 and corpus.title.lengths.max() <= 12
    assert len(corpus.train_queries(1)) == 5 and len(corpus.test_queries()) == 6
    other = small_corpus(4)
    assert not np.array_equal(corpus.body.terms[:100], other.body.terms[:100])


def test_qrels_are_graded_and_spread_over_parties(corpus):
    owners = set()
    for q in range(corpus.n_queries):
        docs, grades = corpus.judged(q)
        assert list(grades) == [2] * 4 + [1] * 16  # rel2 = 4, rel1 = 16 by default
        # judged documents contain a query term (relevance comes from the text)
        assert (corpus.body.tf(docs, corpus.query(q)).sum(axis=1) > 0).all()
        owners |= set(corpus.party_of(docs).tolist())
        assert list(corpus.labels(q, docs[:3])) == list(grades[:3])
    assert owners == {0, 1, 2}


def test_bag_of_words_counts_rows_and_postings():
    doc = np.array([0, 0, 0, 1, 2, 2])
    term = np.array([5, 1, 5, 3, 1, 1])
    bow = BagOfWords.from_tokens(doc, term, 4, 8)
    assert list(bow.lengths) == [3, 1, 2, 0] and list(bow.unique) == [2, 1, 1, 0]
    assert bow.tf(np.array([0, 2, 3]), np.array([5, 1, 7])).tolist() == [
        [2, 1, 0],
        [0, 2, 0],
        [0, 0, 0],
    ]
    sub = bow.rows(np.array([2, 0]))
    assert sub.tf(np.array([0, 1]), np.array([1, 5])).tolist() == [[2, 0], [1, 2]]
    assert list(bow.doc_freq()[[1, 3, 5]]) == [2, 1, 1] and bow.coll_freq()[1] == 3
    tptr, docs, counts = bow.postings
    assert list(docs[tptr[1] : tptr[2]]) == [0, 2] and list(counts[tptr[1] : tptr[2]]) == [1, 2]
    stop = np.zeros(8, bool)
    stop[5] = True
    assert list(bow.without(stop).lengths) == [1, 1, 2, 0]


def test_features_follow_their_definitions():
    tf = np.array([[3.0, 0.0], [0.0, 0.0]])
    x = field_features(
        tf,
        np.array([10, 20]),
        np.array([5, 8]),
        np.array([2.0, 50.0]),
        np.array([4.0, 60.0]),
        100,
        1000.0,
    )
    assert x.shape == (2, 8) and len(FEATURE_NAMES) == 16
    idf = np.log(101 / 2.5) + np.log(101 / 50.5)
    assert x[0, 0] == 10 and x[0, 1] == 3 and np.isclose(x[0, 2], idf)
    assert np.isclose(x[0, 3], 3 * np.log(101 / 2.5))
    bm = np.log1p((100 - 2 + 0.5) / 2.5) * 3 * 2.2 / (3 + 1.2 * (0.25 + 0.75 * 10 / 10))
    assert np.isclose(x[0, 4], bm) and x[1, 4] == 0
    assert (x[0, 5:] > x[1, 5:]).all()  # the document with the term is more likely
    # noisy estimates are clipped into range: negative tf counts as 0, df at most N
    y = field_features(
        -tf,
        np.array([10, 20]),
        np.array([5, 8]),
        np.array([500.0, -3.0]),
        np.array([4.0, 60.0]),
        100,
        1000.0,
    )
    assert np.isfinite(y).all() and y[0, 1] == 0


def test_exact_features_and_query_normalisation(corpus):
    fields = (corpus.title, corpus.body)
    stats = tuple(CollectionStats.of(f) for f in fields)
    q = 0
    docs, _ = corpus.judged(q)
    x = exact_features(fields, stats, docs, corpus.query(q))
    assert x.shape == (len(docs), 16) and np.all(x[:, 8] == corpus.body.lengths[docs])
    n = query_minmax(np.vstack([x, x[:2] * 2]), np.array([0, len(docs), len(docs) + 2]))
    assert n.min() >= 0 and n.max() <= 1
    assert np.allclose(n[len(docs) :].max(axis=0)[np.ptp(x[:2], axis=0) > 0], 1)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_msmarco_loader_reads_tsv_partitions_and_maps_ids(tmp_path):
    coll = write(
        tmp_path / "c.tsv",
        "D1\thttp://a\tCats\tcats purr and cats sleep\n"
        "D2\thttp://b\tDogs\tdogs bark loudly\nD3\thttp://c\tBirds\tbirds sing\n"
        "D4\thttp://d\tFish\tfish swim in water\n",
    )
    qs = write(tmp_path / "q.tsv", "1\twhy do cats purr\n2\tdo dogs bark\n3\tfish water\n")
    qrels = write(tmp_path / "r.txt", "1 0 D1 1\n2 0 D2 2\n3 0 D4 1\n3 0 D3 0\n")
    run = write(tmp_path / "run.txt", "1 Q0 D1 1 9.0 bm25\n1 Q0 D3 2 3.0 bm25\n")
    c = load_msmarco(coll, qs, qrels, stream(0, "m"), run=run, n_parties=2, test_fraction=0.34)
    assert c.n_docs == 4 and c.n_parties == 2 and c.n_queries == 3
    assert sorted(c.doc_ids.tolist()) == ["D1", "D2", "D3", "D4"]
    assert (c.query_party < 0).sum() == 1
    d1 = int(np.flatnonzero(c.doc_ids == "D1")[0])
    cats = int(np.flatnonzero(c.vocab == "cats")[0])
    assert c.body.tf(np.array([d1]), np.array([cats]))[0, 0] == 2
    assert c.title.tf(np.array([d1]), np.array([cats]))[0, 0] == 1
    q1 = int(np.flatnonzero(c.query_ids == "1")[0])
    assert list(c.doc_ids[c.judged(q1)[0]]) == ["D1"]
    assert sorted(c.doc_ids[c.run(q1)].tolist()) == ["D1", "D3"]
    assert tokenize("Don't STOP-me now!") == ["don", "t", "stop", "me", "now"]


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("qrels", "1 0 D1\n", "r.txt:1: expected 4 columns in a qrels line, got 3"),
        ("qrels", "1 0 D9 1\n", "r.txt:1: document 'D9' is not in c.tsv"),
        ("qrels", "7 0 D1 1\n", "r.txt:1: query '7' is not in q.tsv"),
        ("qrels", "1 0 D1 x\n", "r.txt:1: grade must be an integer, got 'x'"),
        ("collection", "D1\n", "c.tsv:1: expected 2 to 4 columns in a collection line, got 1"),
    ],
)
def test_msmarco_loader_errors_name_file_and_line(tmp_path, name, text, message):
    files = {"collection": "D1\tcats purr\n", "queries": "1\tcats\n", "qrels": "1 0 D1 1\n"}
    files[name] = text
    coll = write(tmp_path / "c.tsv", files["collection"])
    qs = write(tmp_path / "q.tsv", files["queries"])
    qrels = write(tmp_path / "r.txt", files["qrels"])
    with pytest.raises(DatasetError) as e:
        load_msmarco(coll, qs, qrels, stream(0, "m"))
    assert str(e.value).endswith(message) and "\n" not in str(e.value)
    with pytest.raises(DatasetError, match="no such collection file"):
        load_msmarco(tmp_path / "none.tsv", qs, qrels, stream(0, "m"))


def test_term_counts_are_the_postings_as_a_dense_column(corpus):
    body = corpus.body
    for t in (0, 7, int(body.terms[5])):
        assert np.array_equal(body.term_counts(t), body.tf(np.arange(body.n_docs), [t])[:, 0])

import ir_measures
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foltr_async.ltr.data import load_letor
from foltr_async.ltr.metrics import (
    OnlineDiscounted,
    dcg_at_k,
    err,
    expected_maxrr,
    ideal_dcg,
    maxrr,
    mean_ndcg,
    ndcg,
    ndcg_of_ranking,
    offline_metrics,
)
from foltr_async.ltr.queryset import QuerySet


def _qs(labels_per_query, n_features=3, seed=0) -> QuerySet:
    rng = np.random.default_rng(seed)
    sizes = [len(lab) for lab in labels_per_query]
    qptr = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=qptr[1:])
    labels = np.concatenate([np.asarray(lab, dtype=np.int8) for lab in labels_per_query])
    return QuerySet(
        features=rng.random((len(labels), n_features)).astype(np.float32),
        labels=labels,
        qptr=qptr,
        qids=np.array([f"q{i}" for i in range(len(sizes))]),
    )


def _loop_reference(scores, qs, k, gmax):
    """Per-query nDCG@k and ERR@k with plain loops: stable sort, ties in document order."""
    out_ndcg, out_err = [], []
    for q in range(qs.n_queries):
        s = scores[qs.doc_range(q)]
        lab = qs.labels[qs.doc_range(q)].astype(float)
        ranked = lab[np.argsort(-s, kind="stable")][:k]
        ideal = np.sort(lab)[::-1][:k]
        dcg = sum((2**g - 1) / np.log2(i + 2) for i, g in enumerate(ranked))
        idcg = sum((2**g - 1) / np.log2(i + 2) for i, g in enumerate(ideal))
        out_ndcg.append(dcg / idcg if idcg > 0 else np.nan)
        e, keep = 0.0, 1.0
        for i, g in enumerate(ranked):
            r = (2**g - 1) / 2**gmax
            e += keep * r / (i + 1)
            keep *= 1 - r
        out_err.append(e)
    return np.array(out_ndcg), np.array(out_err)


@pytest.mark.parametrize("split", ["train", "test"])
def test_ndcg_and_err_match_ir_measures_on_mq2008(mq2008_dir, split):
    qs = load_letor(mq2008_dir / f"{split}.txt")
    rng = np.random.default_rng(2024)
    # A fixed random linear model; MQ2008 holds duplicate feature vectors, so a tiny jitter makes
    # every score distinct (trec_eval breaks ties by docid, we by document order).
    scores = qs.features.astype(np.float64) @ rng.normal(size=qs.n_features)
    scores += rng.uniform(0, 1e-4, size=qs.n_docs)
    for q in range(qs.n_queries):
        s = scores[qs.doc_range(q)]
        assert np.unique(s).size == s.size
    docids = [f"d{i}" for i in range(qs.n_docs)]
    qids = [str(qs.qids[q]) for q in np.repeat(np.arange(qs.n_queries), np.diff(qs.qptr))]
    qrels = [
        ir_measures.Qrel(q, d, int(g)) for q, d, g in zip(qids, docids, qs.labels, strict=True)
    ]
    run = [
        ir_measures.ScoredDoc(q, d, float(s)) for q, d, s in zip(qids, docids, scores, strict=True)
    ]

    # pytrec_eval with exponential gains: full precision.
    gains = {g: 2**g - 1 for g in range(qs.max_grade + 1)}
    ref_ndcg = {
        m.query_id: m.value
        for m in ir_measures.pytrec_eval.iter_calc([ir_measures.nDCG(gains=gains) @ 10], qrels, run)
    }
    ours = ndcg(scores, qs, k=10, no_relevant="zero")
    np.testing.assert_allclose(ours, [ref_ndcg[str(q)] for q in qs.qids], atol=1e-6)
    skipped = np.isnan(ndcg(scores, qs, k=10))
    assert skipped.any() and not skipped.all()
    np.testing.assert_array_equal(skipped, ideal_dcg(qs, 10) == 0)
    assert mean_ndcg(scores, qs) == pytest.approx(ours[~skipped].mean())
    assert mean_ndcg(scores, qs, no_relevant="zero") == pytest.approx(ours.mean())

    # gdeval (ERR; it fixes the top grade at 4 and prints 5 decimals).
    ref_err = {
        m.query_id: m.value
        for m in ir_measures.gdeval.iter_calc([ir_measures.ERR @ 10], qrels, run)
    }
    np.testing.assert_allclose(
        err(scores, qs, k=10, max_grade=4), [ref_err[str(q)] for q in qs.qids], atol=1e-5
    )
    # With the dataset's own top grade (2), against a loop reference.
    ref_loop_ndcg, ref_loop_err = _loop_reference(scores, qs, 10, qs.max_grade)
    np.testing.assert_allclose(err(scores, qs, k=10), ref_loop_err, rtol=1e-12)
    np.testing.assert_allclose(ndcg(scores, qs), ref_loop_ndcg, rtol=1e-12)


def test_ties_break_by_document_order_and_short_or_empty_queries_work():
    qs = _qs([[0, 2, 1], [], [1], [0, 0], [2, 0, 1, 1, 0, 2, 1, 0, 0, 1, 2, 2]])
    scores = np.zeros(qs.n_docs)  # all tied: the displayed order is document order
    got = ndcg(scores, qs, k=5)
    ref, ref_err = _loop_reference(scores, qs, 5, 2)
    np.testing.assert_allclose(got, ref)
    assert np.isnan(got[1]) and np.isnan(got[3]) and got[2] == 1.0
    np.testing.assert_allclose(err(scores, qs, k=5), ref_err)
    expect0 = (3 / np.log2(3) + 1 / np.log2(4)) / (3 + 1 / np.log2(3))
    assert got[0] == pytest.approx(expect0)
    rng = np.random.default_rng(0)
    for _ in range(20):  # coarse scores: many ties within and across queries
        s = rng.integers(0, 3, size=qs.n_docs).astype(float)
        ref, ref_err = _loop_reference(s, qs, 4, 2)
        np.testing.assert_allclose(ndcg(s, qs, k=4), ref)
        np.testing.assert_allclose(err(s, qs, k=4), ref_err)
    assert np.isnan(mean_ndcg(np.zeros(2), _qs([[0], [0]])))
    with pytest.raises(ValueError, match="no_relevant"):
        ndcg(scores, qs, no_relevant="drop")
    with pytest.raises(ValueError, match="one per document"):
        ndcg(np.zeros(3), qs)


label_lists = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=15), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(labels=label_lists, seed=st.integers(0, 2**16), k=st.integers(1, 12))
def test_ndcg_properties(labels, seed, k):
    qs = _qs(labels)
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=qs.n_docs)
    vals = ndcg(scores, qs, k=k, no_relevant="zero")
    assert np.all((vals >= 0) & (vals <= 1 + 1e-12))
    # Ordering by label is ideal: every query with a relevant document scores 1.
    perfect = ndcg(qs.labels.astype(float), qs, k=k)
    has_rel = np.array([max(lab) > 0 for lab in labels])
    np.testing.assert_allclose(perfect[has_rel], 1.0)
    assert np.all(np.isnan(perfect[~has_rel]))
    # The ideal does not depend on the order documents are stored in.
    shuffled = _qs([list(rng.permutation(lab)) for lab in labels])
    np.testing.assert_allclose(ideal_dcg(shuffled, k), ideal_dcg(qs, k))
    # nDCG depends on the score order only, not on the values.
    np.testing.assert_allclose(ndcg(np.exp(scores) * 3 + 1, qs, k=k, no_relevant="zero"), vals)
    e = err(scores, qs, k=k)
    assert np.all((e >= 0) & (e <= 1))


def test_dcg_and_ndcg_of_one_displayed_ranking():
    assert dcg_at_k(np.array([2, 0, 1]), k=10) == pytest.approx(3 + 1 / np.log2(4))
    assert dcg_at_k(np.array([2, 0, 1]), k=1) == pytest.approx(3)
    np.testing.assert_allclose(dcg_at_k(np.array([[1, 0], [0, 1]])), [1, 1 / np.log2(3)])
    all_labels = np.array([0, 1, 0, 2, 0, 0])
    assert ndcg_of_ranking(np.array([2, 1, 0]), all_labels) == pytest.approx(1.0)
    got = ndcg_of_ranking(np.array([0, 2]), all_labels, k=2)
    assert got == pytest.approx((3 / np.log2(3)) / (3 + 1 / np.log2(3)))
    assert ndcg_of_ranking(np.array([0, 0]), np.zeros(5, dtype=int)) == 0.0


def test_maxrr_has_eleven_values_at_cutoff_ten():
    assert maxrr(np.zeros(10, dtype=bool)) == 0.0
    assert maxrr(np.array([0, 0, 1, 1, 0], dtype=bool)) == pytest.approx(1 / 3)
    assert maxrr(np.array([0] * 10 + [1], dtype=bool)) == 0.0  # beyond the cutoff
    batch = np.eye(10, dtype=bool)
    np.testing.assert_allclose(maxrr(batch), 1 / np.arange(1, 11))
    rng = np.random.default_rng(0)
    values = maxrr(rng.random((5000, 10)) < 0.1)
    assert len(np.unique(values)) == 11


def test_online_discounted_sums_gamma_powers_from_zero():
    acc = OnlineDiscounted(gamma=0.5)
    for v in (1.0, 0.5, 0.25):
        acc.add(v)
    assert acc.value == pytest.approx(1.0 + 0.25 + 0.0625) and acc.t == 3
    acc = OnlineDiscounted()
    v = acc.add_ranking(np.array([0, 2]), np.array([2, 0, 0]))
    acc.add_ranking(np.array([2, 0]), np.array([2, 0, 0]))
    assert v == pytest.approx(1 / np.log2(3))
    assert acc.value == pytest.approx(1 / np.log2(3) + 0.9995)


def test_expected_maxrr_matches_simulated_cascade_users():
    """The closed form equals the mean MaxRR of sampled cascade clicks (with stops) on the
    ranking by the scores, and ranks the same documents as nDCG's top k."""
    from foltr_async.ltr.clicks import cascade

    qs = _qs([[2, 0, 1, 0], [0, 0, 0]])
    scores = np.array([0.1, 0.9, 0.5, 0.3, 0.2, 0.1, 0.3], dtype=np.float32)
    model = cascade("navigational", 3)
    got = expected_maxrr(scores, qs, model.p_click, k=3)
    rng = np.random.default_rng(0)
    for q in range(qs.n_queries):
        docs = qs.labels[qs.doc_range(q)]
        shown = docs[np.argsort(-scores[qs.doc_range(q)], kind="stable")][:3]
        sampled = np.mean([maxrr(model.simulate(shown, rng), 3) for _ in range(20000)])
        assert got[q] == pytest.approx(sampled, abs=0.01)
    assert got[1] > 0.0  # grade-0 documents still get clicks from navigational users
    perfect = expected_maxrr(scores, qs, cascade("perfect", 3).p_click, k=3)
    assert perfect.tolist() == [0.25, 0.0]  # grade 1 at rank 2 (P 0.5); grade 0 never clicked


def test_offline_metrics_are_the_per_query_functions_averaged():
    qs = _qs([[0, 1, 2, 0], [0, 0, 0], [2, 1], [1, 0, 0, 0, 2]])
    scores = np.random.default_rng(3).standard_normal(qs.n_docs)
    p_click = np.array([0.1, 0.5, 0.9])
    names = ("ndcg@10", "ndcg@2", "ndcg", "err@10", "maxrr@10")
    got = offline_metrics(scores, qs, names, p_click=p_click, max_grade=2)
    assert list(got) == list(names)
    assert got["ndcg@2"] == float(np.nanmean(ndcg(scores, qs, 2)))  # the empty query left out
    assert got["ndcg"] == float(np.nanmean(ndcg(scores, qs, 5)))  # the longest query's depth
    assert got["err@10"] == float(np.mean(err(scores, qs, 10, max_grade=2)))
    assert got["maxrr@10"] == float(expected_maxrr(scores, qs, p_click, 10).mean())
    zero = offline_metrics(scores, qs, ("ndcg@10",), no_relevant="zero")["ndcg@10"]
    assert zero == float(np.mean(ndcg(scores, qs, 10, no_relevant="zero")))
    none = _qs([[0, 0], [0]])
    assert offline_metrics(np.zeros(3), none, ("ndcg@10",)) == {"ndcg@10": 0.0}
    for bad in ("map@10", "err", "maxrr@10"):  # maxrr needs the users' click probabilities
        with pytest.raises(ValueError, match="offline metric"):
            offline_metrics(scores, qs, (bad,))

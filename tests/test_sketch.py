"""Count Sketch / Count-Min, the private sketch query and the RTK-Sketch."""

import math

import numpy as np
import pytest
from scipy import stats

from foltr_async.ltr.sketch import (
    DocSketch,
    RTKSketch,
    SketchHashes,
    cover_rate,
    matched_decoys,
    median_estimate,
    noisy_answer,
    obfuscate,
    soft_intersection,
    top_k,
    uniform_decoys,
)
from foltr_async.ltr.text import BagOfWords
from foltr_async.rng import stream


def zipf_docs(n_docs=60, vocab=2000, length=400, seed=0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1)
    p /= p.sum()
    doc = np.repeat(np.arange(n_docs), length)
    return BagOfWords.from_tokens(doc, rng.choice(vocab, len(doc), p=p), n_docs, vocab)


def test_hashes_are_keyed_and_in_range():
    a = SketchHashes.from_key(stream(1, "k"), 7, 50)
    b = SketchHashes.from_key(stream(2, "k"), 7, 50)
    t = np.arange(1000)
    ca, sa = a.columns(t), a.signs(t)
    assert ca.shape == (1000, 7) and ca.min() >= 0 and ca.max() < 50
    assert set(np.unique(sa)) == {-1, 1} and abs(sa.mean()) < 0.1
    assert (ca != b.columns(t)).mean() > 0.9  # another key, other columns
    # per-row hashes of a (m, z) term matrix agree with the per-term form
    assert np.array_equal(a.columns(np.repeat(t[:5, None], 7, axis=1)), ca[:5])


def test_count_sketch_is_unbiased_and_within_the_bound():
    bow = zipf_docs()
    docs = np.arange(bow.n_docs)
    terms = np.arange(5, 205, 10)
    true = bow.tf(docs, terms).astype(np.float64)
    norm2 = np.sqrt(np.bincount(bow.row, weights=bow.counts.astype(float) ** 2))[:, None]
    w, z = 100, 15
    errs, row_fail, med_fail = [], [], []
    for key in range(40):
        h = SketchHashes.from_key(stream(key, "cs"), z, w)
        sk = DocSketch(bow, h)
        one_row = sk.lookup(docs, h.columns(terms)) * h.signs(terms)  # (n, m, z)
        errs.append((one_row - true[..., None]).mean())
        bound = math.sqrt(3.0 / w) * norm2  # eps with w = 3 / eps^2
        row_fail.append((np.abs(one_row - true[..., None]) > bound[..., None]).mean())
        med_fail.append((np.abs(sk.estimate(docs, terms) - true) > bound).mean())
    # unbiased: keys are independent, so the per-key mean errors give a t statistic
    assert abs(np.mean(errs)) < 4 * np.std(errs, ddof=1) / math.sqrt(len(errs))
    assert np.mean(row_fail) <= 1 / 3  # Chebyshev, per row
    assert np.mean(med_fail) <= math.exp(-z / 18)  # the median over z rows


def test_count_min_never_underestimates_and_respects_its_bound():
    bow = zipf_docs(seed=1)
    docs, terms = np.arange(bow.n_docs), np.arange(0, 400, 7)
    h = SketchHashes.from_key(stream(0, "cm"), 5, 200)
    est = DocSketch(bow, h, kind="min").estimate(docs, terms)
    true = bow.tf(docs, terms)
    assert (est >= true).all()
    over = (est - true) > math.e / 200 * bow.lengths[:, None]
    assert over.mean() <= math.exp(-5) + 0.01


def test_sketch_storage_is_compact_and_lookups_agree():
    long_docs = zipf_docs(n_docs=30, length=800)
    short = BagOfWords.from_tokens(
        np.repeat(np.arange(30), 5), np.random.default_rng(0).integers(0, 2000, 150), 30, 2000
    )
    h = SketchHashes.from_key(stream(0, "s"), 10, 100)
    dense, sparse = DocSketch(long_docs, h), DocSketch(short, h)
    assert dense.dense is not None and dense.dense.dtype.itemsize <= 2  # smallest that fits
    assert sparse.dense is None and sparse.nbytes < 30 * 10 * 100
    cols = h.columns(np.array([3, 77, 1999]))
    docs = np.array([0, 5, 29])
    table = np.zeros((30, 1000), dtype=np.int64)
    for a in range(10):  # a reference build straight from the definition
        np.add.at(
            table,
            (short.row, a * 100 + h.columns(short.terms)[:, a]),
            h.signs(short.terms)[:, a] * short.counts,
        )
    want = table[docs[:, None, None], np.arange(10) * 100 + cols[None]]
    assert np.array_equal(sparse.lookup(docs, cols), want)


def test_noise_is_one_laplace_draw_per_answer_with_scale_one_over_epsilon():
    rng = stream(0, "dp")
    values = np.arange(24.0).reshape(2, 3, 4)
    shifts = []
    for _ in range(4000):
        out = noisy_answer(values, 0.5, rng)
        d = out - values
        assert np.allclose(d, d.flat[0])  # one draw shared by every entry
        shifts.append(d.flat[0])
    shifts = np.array(shifts)
    assert abs(np.abs(shifts).mean() - 2.0) < 0.1  # E|Lap(b)| = b = 1 / epsilon
    assert stats.kstest(shifts, stats.laplace(scale=2.0).cdf).pvalue > 0.001
    rows = noisy_answer(np.zeros((500, 6)), 1.0, rng, per="row")
    assert np.allclose(rows, rows[:, :1]) and len(np.unique(rows[:, 0])) == 500
    assert np.array_equal(noisy_answer(values, math.inf, rng), values)


def test_obfuscation_keeps_the_real_rows_private_and_hides_the_term():
    z, z1, w, vocab = 30, 10, 200, 5000
    h = SketchHashes.from_key(stream(0, "ob"), z, w)
    rng = stream(1, "ob")
    terms = np.array([17, 402, 3333])
    obf = obfuscate(terms, h, z1, rng, uniform_decoys(vocab))
    assert obf.private.sum(axis=1).tolist() == [z1] * 3
    assert (obf.row_terms[obf.private] == np.repeat(terms, z1)).all()
    assert (obf.row_terms[~obf.private] != np.repeat(terms, z - z1)).all()
    assert np.array_equal(obf.cols, h.columns(obf.row_terms))
    # what is sent is (cols, signs): every decoy group looks like the real term's group
    for i in range(3):
        _, counts = np.unique(obf.row_terms[i], return_counts=True)
        assert sorted(counts.tolist()) == [z1] * (z // z1)
    # an adversary with the key votes over the vocabulary: right about z1 / z of the time
    all_cols, all_signs = h.columns(np.arange(vocab)), h.signs(np.arange(vocab))
    hits, n = 0, 300
    guess_rng = np.random.default_rng(0)
    for _ in range(n):
        t = int(rng.integers(vocab))
        o = obfuscate(np.array([t]), h, z1, rng, matched_decoys(1.0 / np.arange(1, vocab + 1)))
        votes = ((all_cols == o.cols[0]) & (all_signs == o.signs[0])).sum(axis=1)
        best = np.flatnonzero(votes == votes.max())
        hits += int(guess_rng.choice(best) == t)
    assert abs(hits / n - z1 / z) < 0.1
    # the querier's median over its private rows is the sketch estimate
    bow = zipf_docs()
    sk = DocSketch(bow, h)
    answer = sk.lookup(np.arange(bow.n_docs), obf.cols) * obf.signs
    est = median_estimate(answer.astype(float), obf.private)
    ref = np.median(np.where(obf.private, answer, 0)[..., obf.private[0]], axis=-1)
    assert est.shape == (bow.n_docs, 3) and np.allclose(est[:, 0], ref[:, 0])
    with pytest.raises(ValueError, match="z1 must be in"):
        obfuscate(terms, h, 31, rng, uniform_decoys(vocab))


def test_top_k_and_cover_rate_count_ties_as_covered():
    assert list(top_k(np.array([1.0, 5.0, 5.0, 3.0]), 3)) == [1, 2, 3]
    true = np.array([5, 3, 3, 3, 0, 0])
    assert cover_rate(np.array([0, 3]), true, 2) == 1.0  # doc 3 ties doc 1 at the 2nd count
    assert cover_rate(np.array([0, 4]), true, 2) == 0.5
    assert cover_rate(np.array([0, 1, 4, 5]), true, 10) == 0.5  # only 4 docs have the term
    assert cover_rate(np.array([], dtype=int), np.zeros(3), 2) == 1.0


def peaked_docs(n_docs=400, vocab=3000, seed=2):
    """Documents where a few terms are frequent in a few documents (what RTK is for)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** 1.05
    p /= p.sum()
    doc = np.repeat(np.arange(n_docs), 300)
    term = rng.choice(vocab, len(doc), p=p)
    hot = rng.random(len(doc)) < 0.2  # a fifth of each document is about its own topic terms
    term[hot] = 100 + (doc[hot] % 40) * 5 + rng.integers(0, 5, hot.sum())
    return BagOfWords.from_tokens(doc, term, n_docs, vocab)


def heaps(rtk):
    """Cell contents as sets of keys (comparable across builds)."""
    return [frozenset(rtk.keys[c, : rtk.size[c]].tolist()) for c in range(len(rtk.size))]


def test_rtk_incremental_insert_equals_bulk_build_and_keeps_heaps():
    bow = peaked_docs(n_docs=120)
    h = SketchHashes.from_key(stream(0, "rtk"), 6, 40)
    bulk = RTKSketch.build(bow, h, k=4, alpha=2.0)
    inc = RTKSketch(h, k=4, alpha=2.0)
    for d in np.random.default_rng(0).permutation(bow.n_docs):
        s = slice(bow.indptr[d], bow.indptr[d + 1])
        inc.insert(int(d), bow.terms[s], bow.counts[s])
    inc.check()
    bulk.check()
    assert heaps(inc) == heaps(bulk)
    assert (inc.size == inc.cap).all()
    with pytest.raises(ValueError, match="already in the sketch"):
        inc.insert(0, bow.terms[:2], bow.counts[:2])


def test_rtk_delete_removes_a_document_everywhere_and_keeps_heaps():
    bow = peaked_docs(n_docs=120)
    h = SketchHashes.from_key(stream(0, "rtk"), 6, 40)
    rtk = RTKSketch.build(bow, h, k=4, alpha=2.0)
    assert 7 in rtk.query(135, k=4, beta=0.1)[0]  # one of its topic terms (and the query view)
    held_before = (
        ((rtk.keys & 0xFFFFFFFF) == 0xFFFFFFFF - 7) & (np.arange(rtk.cap) < rtk.size[:, None])
    ).sum()
    assert rtk.delete(7) == held_before > 0
    rtk.check()
    live = np.arange(rtk.cap) < rtk.size[:, None]
    assert not ((rtk.keys & 0xFFFFFFFF) == 0xFFFFFFFF - 7)[live].any()
    fresh = RTKSketch(h, k=4, alpha=2.0)  # the same heaps, decoded anew: the query view followed
    fresh.keys, fresh.size = rtk.keys.copy(), rtk.size.copy()
    cols = h.columns(np.arange(100, 300, 5))
    for a, b in zip(rtk.cells(cols), fresh.cells(cols), strict=True):
        assert np.array_equal(a, b)
    for t in range(100, 300, 5):
        assert 7 not in rtk.query(t, k=4, beta=0.1)[0]
    s = slice(bow.indptr[7], bow.indptr[8])  # and it can come back
    rtk.insert(7, bow.terms[s], bow.counts[s])
    rtk.check()


def test_rtk_query_covers_the_exact_top_k_and_bounds_counts():
    bow = peaked_docs()
    h = SketchHashes.from_key(stream(1, "rtk"), 30, 200)
    k = 10
    rtk = RTKSketch.build(bow, h, k=k, alpha=5.0)
    covers = []
    for t in range(100, 300, 5):
        true = bow.tf(np.arange(bow.n_docs), [t])[:, 0]
        docs, est = rtk.query(t, k=k, beta=0.1)
        assert len(docs) == k and (est >= true[docs]).all()  # upper bounds without noise
        covers.append(cover_rate(docs, true, k))
    assert np.mean(covers) >= 0.9
    assert rtk.nbytes == h.z * h.w * (rtk.cap + 1) * 8 + h.z * h.w * rtk.cap * 8  # + query view


def test_soft_intersection_uses_only_the_private_cells():
    # two cells hold doc 1 and 2 (the private ones); decoy cells push doc 9
    ptr = np.array([0, 2, 4, 6, 8])
    docs = np.array([1, 2, 1, 2, 9, 3, 9, 3])
    counts = np.array([8.0, 5.0, 7.0, 6.0, 50.0, 1.0, 40.0, 1.0])
    full = np.array([True, True, True, True])
    got, est = soft_intersection(ptr, docs, counts, full, np.array([1, 1, 0, 0], bool), 2, 1.0)
    assert list(got) == [1, 2] and list(est) == [7.0, 5.0]
    got, _ = soft_intersection(ptr, docs, counts, full, np.array([0, 0, 1, 1], bool), 1, 1.0)
    assert list(got) == [9]


def test_soft_intersection_breaks_equal_bounds_by_what_the_cells_show():
    # docs 2 and 3 reach 9 in one cell but are left out of the other (minimum 5): bound 5, like
    # doc 7, whose 5 was seen in both cells; the seen value wins over lower ids
    ptr = np.array([0, 2, 4])
    got, est = soft_intersection(
        ptr,
        np.array([2, 7, 3, 7]),
        np.array([9.0, 5, 9, 5]),
        np.array([True, True]),
        np.array([True, True]),
        3,
        0.5,
    )
    assert list(got) == [7, 2, 3] and list(est) == [5.0, 5.0, 5.0]
    # at an equal seen bound, the document more cells hold comes first
    got, _ = soft_intersection(
        np.array([0, 2, 3, 4]),
        np.array([4, 7, 7, 7]),
        np.array([5.0, 5, 5, 5]),
        np.array([True, False, False]),
        np.array([True, True, True]),
        2,
        0.1,
    )
    assert list(got) == [7, 4]

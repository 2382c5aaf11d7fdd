import numpy as np
import pytest

from foltr_async.ltr.rankers import LinearRanker, MLPRanker, make_ranker


def _data(seed: int = 0, n: int = 9, f: int = 6):
    rng = np.random.default_rng(seed)
    return rng.random((n, f)).astype(np.float32), rng.normal(size=n)


def _finite_diff(ranker, X, w, eps=1e-6):
    base = ranker.get_params()
    g = np.empty_like(base)
    for j in range(base.size):
        for sign in (1, -1):
            p = base.copy()
            p[j] += sign * eps
            ranker.set_params(p)
            val = float(w @ ranker.score(X))
            g[j] = val if sign == 1 else (g[j] - val) / (2 * eps)
    ranker.set_params(base)
    return g


def test_linear_starts_at_zero_and_scores_features_dot_weights():
    X, w = _data()
    r = LinearRanker(X.shape[1])
    assert r.n_params == X.shape[1]
    assert not r.get_params().any()
    params = np.arange(X.shape[1], dtype=float) - 2.0
    r.set_params(params)
    s = r.score(X)
    assert s.dtype == np.float64 and s.shape == (X.shape[0],)
    np.testing.assert_allclose(s, X.astype(np.float64) @ params)
    np.testing.assert_allclose(r.grad(X, w), X.astype(np.float64).T @ w)
    np.testing.assert_allclose(r.grad(X, w), _finite_diff(r, X, w), atol=1e-6)
    assert r.layer_slices() == {"output": slice(0, X.shape[1])}


@pytest.mark.parametrize("hidden", [(7,), (5, 4)])
def test_mlp_gradient_matches_finite_differences(hidden):
    X, w = _data(1)
    w[2] = 0.0  # rows with zero weight are skipped: must not change the gradient
    r = MLPRanker(X.shape[1], hidden=hidden, rng=np.random.default_rng(3))
    np.testing.assert_allclose(r.grad(X, w), _finite_diff(r, X, w), rtol=1e-5, atol=1e-7)


def test_mlp_layer_slices_tile_the_flat_vector_and_name_layers():
    r = MLPRanker(6, hidden=(5, 4), rng=np.random.default_rng(0))
    sl = r.layer_slices()
    assert list(sl) == ["hidden0", "hidden1", "output"]
    assert sl["hidden0"] == slice(0, 6 * 5 + 5)
    assert sl["hidden1"] == slice(35, 35 + 5 * 4 + 4)
    assert sl["output"] == slice(59, 63) and r.n_params == 63
    # The "output" slice alone decides the scale of the scores (FedPer keeps it personal).
    X, _ = _data(2)
    p = r.get_params()
    p[sl["output"]] = 0.0
    r.set_params(p)
    np.testing.assert_array_equal(r.score(X), 0.0)


def test_mlp_init_is_random_small_and_reproducible():
    a = MLPRanker(6, rng=np.random.default_rng(5))
    b = MLPRanker(6, rng=np.random.default_rng(5))
    c = MLPRanker(6, rng=np.random.default_rng(6))
    np.testing.assert_array_equal(a.get_params(), b.get_params())
    assert not np.array_equal(a.get_params(), c.get_params())
    assert np.abs(a.get_params()).max() < 1.0
    assert a.get_params()[a.layer_slices()["output"]].any()


def test_params_are_copies_and_copy_is_independent():
    r = make_ranker("mlp", 4, rng=np.random.default_rng(0), hidden=(3,))
    p = r.get_params()
    p[:] = 9.0
    assert not np.any(r.get_params() == 9.0)
    c = r.copy()
    np.testing.assert_array_equal(c.get_params(), r.get_params())
    c.set_params(np.zeros(c.n_params))
    assert r.get_params().any()
    X, _ = _data(0, f=4)
    assert r.score(X).shape == (9,)
    lin = make_ranker("linear", 4)
    lc = lin.copy()
    lc.set_params(np.ones(4))
    assert not lin.get_params().any()


def test_bad_input_raises_clear_errors():
    r = LinearRanker(3)
    with pytest.raises(ValueError, match="expected 3 parameters"):
        r.set_params(np.zeros(4))
    with pytest.raises(ValueError, match="known: linear, mlp"):
        make_ranker("tree", 3)
    with pytest.raises(ValueError, match="needs an rng"):
        make_ranker("mlp", 3)
    with pytest.raises(ValueError, match="positive layer sizes"):
        MLPRanker(3, hidden=())


def test_large_inputs_are_scored_in_chunks_with_the_same_result():
    rng = np.random.default_rng(4)
    X = rng.random((20_000, 5)).astype(np.float32)
    for r in (LinearRanker(5), MLPRanker(5, hidden=(4,), rng=rng)):
        r.set_params(rng.normal(size=r.n_params))
        s = r.score(X)
        assert s.dtype == np.float64 and s.shape == (20_000,)
        np.testing.assert_allclose(s, np.concatenate([r.score(X[:7]), r.score(X[7:])]), rtol=1e-12)
        if isinstance(r, LinearRanker):
            np.testing.assert_allclose(s, X.astype(np.float64) @ r.get_params(), rtol=1e-12)


@pytest.mark.parametrize("n", [2049, 8192, 8193, 20_000, 42_182])
def test_many_float32_rows_score_bit_for_bit_as_numpys_own_upcast(n):
    """Held-out sets are upcast a block at a time into one reused buffer; the scores must not
    move by a bit, or evaluation (and every reported nDCG) would change with the speed-up."""
    rng = np.random.default_rng(n)
    X = rng.random((n, 136)).astype(np.float32)
    r = LinearRanker(136)
    r.set_params(rng.normal(size=136))
    w = r.get_params()
    expected = np.concatenate([X[i : i + 8192] @ w for i in range(0, n, 8192)])
    np.testing.assert_array_equal(r.score(X), expected)

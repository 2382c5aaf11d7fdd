import math

import numpy as np
import pytest
from scipy import stats as sps

from foltr_async.observe.stats import curve, detectable_difference, paired_test, summarise


def test_summarise_uses_sample_std():
    s = summarise([0.1, 0.2, 0.4])
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(0.7 / 3)
    assert s["std"] == pytest.approx(np.std([0.1, 0.2, 0.4], ddof=1))


def test_summarise_single_and_empty_and_missing():
    assert summarise([0.5]) == {"mean": 0.5, "std": 0.0, "n": 1}
    assert summarise([]) == {"mean": None, "std": None, "n": 0}
    s = summarise([1.0, None, float("nan"), 3.0])
    assert s["n"] == 2 and s["mean"] == 2.0 and s["std"] == pytest.approx(math.sqrt(2))


def test_paired_test_matches_scipy():
    rng = np.random.default_rng(4)
    b = rng.normal(0.4, 0.02, size=6)
    a = b + rng.normal(0.01, 0.005, size=6)
    diff, p = paired_test(a, b)
    assert diff == pytest.approx(float(np.mean(a - b)))
    assert p == pytest.approx(sps.ttest_rel(a, b).pvalue)
    assert 0 < p < 0.05


def test_paired_test_undefined_cases_give_no_p():
    assert paired_test([0.5], [0.4]) == (pytest.approx(0.1), None)
    diff, p = paired_test([0.5, 0.6, 0.7], [0.4, 0.5, 0.6])  # constant difference
    assert diff == pytest.approx(0.1) and p is None
    assert paired_test([], []) == (None, None)
    diff, p = paired_test([0.5, np.nan, 0.7, 0.2], [0.4, 0.5, 0.4, 0.3])  # nan pair dropped
    assert diff == pytest.approx(np.mean([0.1, 0.3, -0.1]))
    assert p == pytest.approx(sps.ttest_rel([0.5, 0.7, 0.2], [0.4, 0.4, 0.3]).pvalue)
    with pytest.raises(ValueError):
        paired_test([1.0, 2.0], [1.0])


def test_curve_aligns_rounds_that_differ_between_repeats():
    cur = curve([[10, 20, 30], [10, 20]], [[0.1, 0.2, 0.3], [0.3, 0.4]])
    assert cur["rounds"] == [10, 20, 30]
    assert cur["mean"] == pytest.approx([0.2, 0.3, 0.3])
    assert cur["std"] == pytest.approx([np.std([0.1, 0.3], ddof=1)] * 2 + [0.0])
    assert cur["n"] == [2, 2, 1]


def test_curve_empty_and_misaligned():
    assert curve([], []) == {"rounds": [], "mean": [], "std": [], "n": []}
    with pytest.raises(ValueError):
        curve([[1, 2]], [[0.1]])


def test_holm_matches_the_step_down_definition_and_keeps_missing_tests_out():
    from foltr_async.observe.stats import holm

    # sorted 0.01, 0.02, 0.04 of m = 3 tests: 3 x 0.01, max(0.03, 2 x 0.02), max(0.04, 1 x 0.04)
    assert holm([0.04, None, 0.01, 0.02]) == pytest.approx([0.04, None, 0.03, 0.04])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert holm([None]) == [None] and holm([]) == []


def test_bonferroni_multiplies_by_the_tests_and_never_rejects_more_than_holm():
    from foltr_async.observe.stats import bonferroni, holm

    assert bonferroni([0.04, None, 0.01, 0.02]) == pytest.approx([0.12, None, 0.03, 0.06])
    assert bonferroni([0.5, 0.6]) == [1.0, 1.0] and bonferroni([None]) == [None]
    ps = list(np.random.default_rng(3).uniform(0, 0.05, 12))
    assert all(b >= h for b, h in zip(bonferroni(ps), holm(ps), strict=True))


@pytest.mark.parametrize("n", [3, 5, 25])
def test_detectable_difference_is_found_with_the_stated_power(n):
    """Simulated paired t-tests at the returned difference reject at alpha 0.05 in ~80 % of
    experiments; at half of it, far less often."""
    rng = np.random.default_rng(7)
    sd = 0.02
    delta = detectable_difference(sd, n)
    trials = 20000

    def rejected(effect: float) -> float:
        d = rng.normal(effect, sd, size=(trials, n))
        p = sps.ttest_1samp(d, 0.0, axis=1).pvalue
        return float((p < 0.05).mean())

    assert rejected(delta) == pytest.approx(0.8, abs=0.015)
    assert rejected(delta / 2) < 0.5


def test_detectable_difference_grows_with_a_stricter_alpha_and_fewer_pairs():
    assert detectable_difference(0.01, 5, alpha=0.05 / 60) > detectable_difference(0.01, 5)
    assert detectable_difference(0.01, 5) > detectable_difference(0.01, 25)
    assert detectable_difference(0.01, 1) is None
    assert detectable_difference(0.0, 5) == 0.0
    with pytest.raises(ValueError):
        detectable_difference(0.01, 5, power=1.0)


def test_paired_test_equals_scipy_up_to_float_rounding_on_random_pairs():
    """The p-value comes from scipy.special's Student's t (scipy.stats is not imported by a
    run): the same number as ``scipy.stats.ttest_rel``, whatever the n and the spread."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(2, 60))
        a = rng.normal(size=n)
        b = a + rng.normal(rng.normal() * 0.3, rng.uniform(0.01, 2.0), size=n)
        _, p = paired_test(a, b)
        assert p == pytest.approx(sps.ttest_rel(a, b).pvalue, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("n", [2, 5, 25, 400])
@pytest.mark.parametrize("power", [0.5, 0.8, 0.95])
def test_detectable_difference_equals_the_noncentral_t_solution(n, power):
    crit = sps.t.ppf(0.975, n - 1)
    delta = detectable_difference(1.0, n, power=power)
    nc = delta * math.sqrt(n)
    reached = sps.nct.sf(crit, n - 1, nc) + np.nan_to_num(sps.nct.cdf(-crit, n - 1, nc))
    assert reached == pytest.approx(power, abs=1e-8)

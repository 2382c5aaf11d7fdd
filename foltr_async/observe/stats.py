"""Summary statistics over repeats: what a researcher reports as mean ± std and a p-value.

Non-finite values (a metric a repeat never produced) are left out of every statistic and the
count ``n`` says how many repeats a number rests on. Standard deviations are sample standard
deviations (ddof=1), 0 for a single repeat, so a table never hides a one-seed result behind a
NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from scipy import special as _special  # Student's t: ~0.45 CPU s less to import than stats

PAIRED_TEST = (
    "paired t-test (two-sided, as scipy.stats.ttest_rel; Student's t from scipy.special), "
    "repeats paired by seed"
)


def _finite(values: Iterable[float | None]) -> np.ndarray:
    arr = np.array([np.nan if v is None else v for v in values], dtype=float)
    return arr[np.isfinite(arr)]


def summarise(values: Iterable[float | None]) -> dict:
    """``{"mean", "std", "n"}`` of the finite values; mean and std are None when n = 0."""
    arr = _finite(values)
    n = int(arr.size)
    if n == 0:
        return {"mean": None, "std": None, "n": 0}
    std = float(arr.std(ddof=1)) if n > 1 else 0.0
    return {"mean": float(arr.mean()), "std": std, "n": n}


def fmt_num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def mean_std(s: dict | None, fmt: str, std_fmt: str | None = None, *, n: bool = True) -> str:
    """A ``summarise`` dict as "mean ± std (n)" for a table; "–" when nothing was measured."""
    if not s or s.get("n", 0) == 0:
        return "–"
    text = f"{fmt_num(s['mean'], fmt)} ± {fmt_num(s['std'], std_fmt or fmt)}"
    return f"{text} ({s['n']})" if n else text


def paired_test(a: Sequence[float], b: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean of ``a - b`` and the two-sided paired t-test p-value.

    Pairs with a non-finite member are dropped. The p-value is None when fewer than two pairs
    remain or the differences do not vary (the t statistic is undefined, not significant).
    """
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired_test needs equal lengths, got {x.size} and {y.size}")
    keep = np.isfinite(x) & np.isfinite(y)
    d = x[keep] - y[keep]
    if d.size == 0:
        return None, None
    diff = float(d.mean())
    if d.size < 2 or float(d.std()) <= 1e-12 * max(1.0, abs(diff)):
        return diff, None
    t = diff / np.sqrt(np.var(d, ddof=1) / d.size)
    p = float(2.0 * _special.stdtr(d.size - 1, -abs(t)))
    return diff, (p if np.isfinite(p) else None)


def detectable_difference(
    sd_diff: float, n: int, alpha: float = 0.05, power: float = 0.8
) -> float | None:
    """The smallest mean paired difference a two-sided paired t-test over ``n`` pairs finds at
    level ``alpha`` with probability ``power``, when the differences are normal with standard
    deviation ``sd_diff``: what a null result over n repeats can rule out.

    Exact (noncentral t with n - 1 degrees of freedom), not the normal approximation, which
    understates it badly at n = 5. None below two pairs; 0 when the differences do not vary.
    """
    if n < 2:
        return None
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha} and {power}")
    if sd_diff <= 0:
        return 0.0
    df = n - 1
    crit = float(_special.stdtrit(df, 1 - alpha / 2))

    def shortfall(effect: float) -> float:
        """Power at ``effect`` standard deviations, less the wanted power (increasing)."""
        nc = effect * np.sqrt(n)
        wrong_side = float(_special.nctdtr(df, nc, -crit))  # NaN far out, where it is ~0
        return 1.0 - float(_special.nctdtr(df, nc, crit)) + np.nan_to_num(wrong_side) - power

    lo, hi = 0.0, 1.0
    while shortfall(hi) < 0:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-10:  # bisection: the power grows with the effect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if shortfall(mid) < 0 else (lo, mid)
    return (lo + hi) / 2 * sd_diff


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1), in input order.

    A scenario that compares many variants with one reference makes a family of tests; a raw
    p < 0.05 in one of twenty is expected by chance. Holm controls the family-wise error rate
    without assuming independence. None (no test) stays None and is not counted in the family.
    """
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    out: list[float | None] = [None] * len(pvalues)
    m = len(idx)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def bonferroni(pvalues: Sequence[float | None]) -> list[float | None]:
    """Bonferroni adjusted p-values (m x p, capped at 1), in input order; m counts the tests
    (None stays None). The correction the published FOLTR studies use (thesis §2.2.1); Holm
    rejects at least as much, so a Holm-significant result can fail it."""
    m = sum(p is not None for p in pvalues)
    return [None if p is None else min(1.0, m * float(p)) for p in pvalues]


def curve(rounds: Sequence[Sequence[int]], values: Sequence[Sequence[float | None]]) -> dict:
    """Mean and sample std per round over repeats whose evaluated rounds may differ.

    Every round any repeat evaluated is kept (sorted); a round's statistics use the repeats that
    have a finite value there and ``n`` says how many (a partial repeat shortens no curve).
    """
    if len(rounds) != len(values):
        raise ValueError("curve needs one rounds list per values list")
    pairs = [
        (np.asarray(r, dtype=np.int64), np.array([np.nan if v is None else v for v in vals], float))
        for r, vals in zip(rounds, values, strict=True)
    ]
    for r, v in pairs:
        if r.shape != v.shape:
            raise ValueError(f"rounds ({r.size}) and values ({v.size}) are not aligned")
    if not pairs:
        return {"rounds": [], "mean": [], "std": [], "n": []}
    grid = np.unique(np.concatenate([r for r, _ in pairs]))
    mat = np.full((len(pairs), grid.size), np.nan)
    for i, (r, v) in enumerate(pairs):
        mat[i, np.searchsorted(grid, r)] = v
    ok = np.isfinite(mat)
    n = ok.sum(axis=0)
    filled = np.where(ok, mat, 0.0)
    safe_n = np.maximum(n, 1)
    mean = filled.sum(axis=0) / safe_n
    sq = np.where(ok, (mat - mean) ** 2, 0.0).sum(axis=0)
    std = np.where(n > 1, np.sqrt(sq / np.maximum(n - 1, 1)), 0.0)
    mean_out = [float(m) if k else None for m, k in zip(mean, n, strict=True)]
    std_out = [float(s) if k else None for s, k in zip(std, n, strict=True)]
    return {
        "rounds": grid.tolist(),
        "mean": mean_out,
        "std": std_out,
        "n": n.tolist(),
    }

"""The verdict rules: one vocabulary, each verdict computed from a comparison by a written rule.

A comparison is ``arm - against`` on the claim's metric at its round, over repeats paired by
(fold, seed): the mean difference d, the two-sided paired t-test's p, Bonferroni-adjusted over
the claim's family (p_adj = min(1, m p)), and the smallest difference the pairs would detect
with 80 % power at alpha / m (``mde``). With "significant" meaning p_adj < alpha:

expected greater or less, the seed reporting a significant difference or giving no test:
    right sign, significant -> reproduced; right sign, not significant -> direction only;
    wrong sign, significant -> contradicted; wrong sign, not significant -> no difference
    detected at this n.
expected greater or less, the seed reporting the difference as not significant:
    right sign, not significant, and mde <= the published difference -> reproduced (the runs
    would have found a difference that large); otherwise right sign -> direction only; wrong
    sign as above.
expected equal (the seed reports no significant difference):
    not significant and mde <= the published difference -> reproduced; not significant
    otherwise -> no difference detected at this n; significant -> contradicted.

A claim's verdict is its weakest comparison's (reproduced > direction only > no difference
detected at this n), contradicted when any comparison is; not run when no record answers it;
not comparable when the claim says why no run can.
"""

from __future__ import annotations

from dataclasses import dataclass

from foltr_async.observe.stats import detectable_difference, paired_test

REPRODUCED = "reproduced"
DIRECTION = "direction only"
NULL = "no difference detected at this n"
CONTRADICTED = "contradicted"
NOT_COMPARABLE = "not comparable"
NOT_RUN = "not run"
#: strongest first; a claim takes its weakest comparison's verdict
ORDER = (REPRODUCED, DIRECTION, NULL)
VOCABULARY = (REPRODUCED, DIRECTION, NULL, CONTRADICTED, NOT_COMPARABLE, NOT_RUN)


@dataclass(frozen=True)
class Outcome:
    """One comparison's numbers and verdict."""

    run: str
    arm: str
    against: str
    n: int
    arm_mean: float | None
    against_mean: float | None
    diff: float | None
    p: float | None
    p_adj: float | None
    mde: float | None
    verdict: str


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def judge(
    a: list[float],
    b: list[float],
    *,
    expect: str,
    published_significant: bool | None,
    published_effect: float | None,
    m: int,
    alpha: float,
    run: str = "",
    arm: str = "",
    against: str = "",
) -> Outcome:
    """The verdict of one comparison of paired values ``a`` (the arm) and ``b``."""
    n = len(a)
    diff, p = paired_test(a, b)
    p_adj = None if p is None else min(1.0, m * p)
    sd = None
    if n >= 2 and diff is not None:
        d = [x - y for x, y in zip(a, b, strict=True)]
        sd = (sum((x - diff) ** 2 for x in d) / (n - 1)) ** 0.5
    mde = None if sd is None else detectable_difference(sd, n, alpha=alpha / m)
    significant = p_adj is not None and p_adj < alpha
    if diff is None:
        verdict = NULL
    elif expect == "equal":
        if significant:
            verdict = CONTRADICTED
        elif published_effect is not None and mde is not None and mde <= published_effect:
            verdict = REPRODUCED
        else:
            verdict = NULL
    else:
        right = diff > 0 if expect == "greater" else diff < 0
        if not right:
            verdict = CONTRADICTED if significant else NULL
        elif published_significant is False:
            detects = published_effect is not None and mde is not None and mde <= published_effect
            verdict = REPRODUCED if not significant and detects else DIRECTION
        else:
            verdict = REPRODUCED if significant else DIRECTION
    return Outcome(run, arm, against, n, _mean(a), _mean(b), diff, p, p_adj, mde, verdict)


def combine(verdicts: list[str]) -> str:
    """A claim's verdict from its comparisons' (see the module's rules)."""
    if not verdicts:
        return NOT_RUN
    if CONTRADICTED in verdicts:
        return CONTRADICTED
    return max(verdicts, key=ORDER.index)

"""Privacy audits: an empirical lower bound on epsilon next to the accountant's upper bound.

A canary (``protocols/audit.py``) sends one of two worst-case inputs, chosen by a secret fair bit;
an auditor that sees what its threat model allows scores each release (a log-likelihood ratio of
the two inputs). Any rule "guess 1 when the score exceeds t" has a true-positive rate TPR and a
false-positive rate FPR, and an (epsilon, delta)-DP mechanism forces TPR <= e^epsilon FPR + delta
for every rule and both orientations (Kairouz et al. 2015; the audits of Jagielski et al. 2020 and
Nasr et al. 2021). So epsilon >= log((TPR - delta) / FPR), and with Clopper-Pearson bounds
(TPR's lower, FPR's upper, each at (1 - confidence) / 2) the bound holds at ``confidence``.

The rule is chosen honestly: the trials are split in two (even and odd positions), the threshold
and orientation that give the best bound on the first half are fixed, and only the second half's
counts make the reported bound, so a lucky threshold cannot inflate it.

A bound above the claimed epsilon refutes the claim (at the stated confidence); one at or below
it says nothing against it, and the gap between the two is how much the attack or the accounting
leaves on the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: confidence of every reported lower bound (Clopper-Pearson, both rates jointly by Bonferroni)
CONFIDENCE = 0.95
#: thresholds tried on the selection half at most (quantiles of its scores)
MAX_THRESHOLDS = 512
#: the written verdict rule: the claim is refuted when the lower bound exceeds it
VERDICT_RULE = (
    "violated when the audited lower bound exceeds the claimed epsilon; no claim when the "
    "accountant bounds nothing for that view"
)


def clopper_pearson(k, n, alpha: float):
    """One-sided Clopper-Pearson bounds on a binomial rate from k of n: (lower, upper), each
    holding with probability at least 1 - alpha (k, n: numbers or arrays alike)."""
    from scipy.stats import beta

    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # the edge cases are set just below
        lower = np.where(k == 0, 0.0, beta.ppf(alpha, k, n - k + 1))
        upper = np.where(k == n, 1.0, beta.ppf(1.0 - alpha, k + 1, n - k))
    if lower.ndim == 0:
        return float(lower), float(upper)
    return lower, upper


def _bounds(hits, n_hit: int, false, n_false: int, delta: float, alpha: float) -> np.ndarray:
    """log((TPR_lower - delta) / FPR_upper) per threshold (0 where that is not positive)."""
    tpr_lo = np.atleast_1d(clopper_pearson(hits, n_hit, alpha)[0])
    fpr_hi = np.atleast_1d(clopper_pearson(false, n_false, alpha)[1])
    ok = (tpr_lo - delta > 0.0) & (fpr_hi > 0.0)
    ratio = np.where(ok, (tpr_lo - delta) / np.where(ok, fpr_hi, 1.0), 1.0)
    return np.maximum(0.0, np.log(ratio))


def _rules(scores: np.ndarray, bits: np.ndarray, thresholds: np.ndarray):
    """For every threshold and the four (event, classes) pairings, the counts of the event in
    the class it should favour (hits) and in the other (false)."""
    pos, neg = np.sort(scores[bits == 1]), np.sort(scores[bits == 0])
    above_pos = len(pos) - np.searchsorted(pos, thresholds, side="right")
    above_neg = len(neg) - np.searchsorted(neg, thresholds, side="right")
    below_pos, below_neg = len(pos) - above_pos, len(neg) - above_neg
    n1, n0 = len(pos), len(neg)
    # (name, hits, n of hits' class, false, n of false's class)
    return [
        ("score > t favours 1", above_pos, n1, above_neg, n0),
        ("score <= t favours 0", below_neg, n0, below_pos, n1),
        ("score > t favours 0", above_neg, n0, above_pos, n1),
        ("score <= t favours 1", below_pos, n1, below_neg, n0),
    ]


def epsilon_lower_bound(
    scores: Sequence[float],
    bits: Sequence[int],
    delta: float = 0.0,
    confidence: float = CONFIDENCE,
) -> dict:
    """The audited lower bound from trials (score, secret bit): a rule chosen on the even
    trials, its bound from the odd ones at ``confidence``."""
    s = np.asarray(scores, dtype=np.float64)
    b = np.asarray(bits, dtype=np.int64)
    alpha = (1.0 - confidence) / 2.0
    out: dict = {"epsilon_lower": 0.0, "confidence": confidence, "delta": delta, "trials": len(s)}
    select, judge = slice(0, None, 2), slice(1, None, 2)
    if min(np.sum(b[half] == bit) for half in (select, judge) for bit in (0, 1)) == 0:
        out["note"] = "too few trials of each bit to choose and judge a rule"
        return out
    sel_s, sel_b = s[select], b[select]
    thresholds = np.unique(np.quantile(sel_s, np.linspace(0.0, 1.0, MAX_THRESHOLDS)))
    best = (-1.0, 0, 0.0)  # (selection bound, rule index, threshold)
    for i, (_, hits, n_hit, false, n_false) in enumerate(_rules(sel_s, sel_b, thresholds)):
        # the best threshold of this pairing on the selection half (same confidence)
        values = _bounds(hits, n_hit, false, n_false, delta, alpha)
        j = int(np.argmax(values))
        if values[j] > best[0]:
            best = (float(values[j]), i, float(thresholds[j]))
    _, rule, t = best
    name, hits, n_hit, false, n_false = _rules(s[judge], b[judge], np.array([t]))[rule]
    h, f = int(hits[0]), int(false[0])
    out.update(
        epsilon_lower=float(_bounds(h, n_hit, f, n_false, delta, alpha)[0]),
        rule=name,
        threshold=t,
        judged=int(n_hit + n_false),
        tpr=h / n_hit,
        fpr=f / n_false,
    )
    return out


def _at(tree: dict, path: Sequence) -> object:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _eps(value) -> float:
    """A claimed epsilon as results.json holds it (None: unbounded)."""
    return math.inf if value is None else float(value)


def _round_claim(rep: dict, claim: dict, rounds: list[int]) -> float:
    """The largest epsilon the repeat claims for the rounds that made trials (``value``: the
    auditor states it, e.g. none for a message the accountant makes no claim about)."""
    value = claim["value"] if "value" in claim else _at(rep, claim["path"])
    if not isinstance(value, list):
        return _eps(value)
    index = _at(rep, claim["index"]) or []
    per = dict(zip(index, value, strict=False))
    wanted = set(rounds)
    return max((_eps(per.get(r)) for r in wanted), default=0.0)


def _run_claim(rep: dict, claim: dict, canary: str) -> float:
    """The tightest of the accountants' run epsilons the repeat claims for the canary."""
    figures = _at(rep, [*claim["path"], canary]) or {}
    values = [_eps(figures.get(k)) for k in claim["accountants"] if k in figures]
    return min(values, default=math.inf)


def audit_variant(repeats: list[dict]) -> dict:
    """Per auditor of a variant: its trials pooled over the repeats, the lower bounds (per
    release, and per run when the canaries kept one bit for a whole run) beside the claims."""
    by_auditor: dict[str, list[tuple[dict, dict]]] = {}
    for rep in repeats:
        for eve, entry in (rep.get("audit") or {}).items():
            by_auditor.setdefault(eve, []).append((rep, entry))
    out = {}
    for eve, pairs in by_auditor.items():
        first = pairs[0][1]
        scores, bits, claims = [], [], []
        run_scores, run_bits, run_claims = [], [], []
        skipped: dict[str, int] = {}
        for rep, entry in pairs:
            t = entry["trials"]
            scores += t["score"]
            bits += t["bit"]
            claims.append(_round_claim(rep, entry["claim"]["round"], t["round"]))
            for k, v in entry.get("skipped", {}).items():
                skipped[k] = skipped.get(k, 0) + v
            if entry["bits"] == "run":
                for c in sorted(set(t["canary"])):
                    mine = [i for i, x in enumerate(t["canary"]) if x == c]
                    run_scores.append(sum(t["score"][i] for i in mine))
                    run_bits.append(t["bit"][mine[0]])
                    run_claims.append(_run_claim(rep, entry["claim"]["run"], c))
        delta = float(_at(pairs[0][0], first["claim"]["run"]["delta"]) or 0.0)
        conf = first.get("confidence", CONFIDENCE)
        result = {
            "mechanism": first["mechanism"],
            "view": first["view"],
            "threat": first["threat"],
            "bits": first["bits"],
            "repeats": len(pairs),
            "skipped": skipped,
            "per_release": _judge(
                epsilon_lower_bound(scores, bits, confidence=conf), max(claims, default=0.0)
            ),
        }
        if first["bits"] == "run":
            result["per_run"] = _judge(
                epsilon_lower_bound(run_scores, run_bits, delta, conf),
                max(run_claims, default=0.0),
            )
        out[eve] = result
    return out


def _judge(bound: dict, claimed: float) -> dict:
    """A bound beside its claim, and the verdict by ``VERDICT_RULE``."""
    lower = bound["epsilon_lower"]
    if "note" in bound:  # no rule could be judged: no bound, no verdict
        return {
            **bound,
            "claimed_epsilon": None if math.isinf(claimed) else claimed,
            "verdict": "not audited",
            "share_of_claim": None,
        }
    return {
        **bound,
        "claimed_epsilon": None if math.isinf(claimed) else claimed,
        "verdict": "no claim"
        if math.isinf(claimed)
        else "violated"
        if lower > claimed
        else "within claim",
        "share_of_claim": lower / claimed if 0 < claimed < math.inf else None,
    }


def audit_results(variants: dict[str, list[dict]]) -> dict:
    """results.json's ``audit``: per variant with auditors, ``audit_variant``."""
    out = {name: audit_variant(reps) for name, reps in variants.items()}
    out = {name: a for name, a in out.items() if a}
    if out:
        out = {"rule": VERDICT_RULE, "variants": out}
    return out


def _cell(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.3g}"


def audit_rows(audit: dict) -> list[list[str]]:
    """The audit table's rows: variant, mechanism, view, unit, trials, confidence, lower bound,
    claimed, verdict."""
    rows = []
    for name, auditors in (audit.get("variants") or {}).items():
        for a in auditors.values():
            for unit in ("per_release", "per_run"):
                b = a.get(unit)
                if b is None:
                    continue
                rows.append(
                    [
                        name,
                        a["mechanism"],
                        a["view"],
                        unit.replace("_", " "),
                        f"{b['trials']:,}",
                        f"{b['confidence']:.3g}",
                        f"{b['epsilon_lower']:.3g}",
                        _cell(b["claimed_epsilon"]),
                        b["verdict"],
                    ]
                )
    return rows


AUDIT_HEADER = (
    "variant",
    "mechanism",
    "view",
    "unit",
    "trials",
    "confidence",
    "epsilon lower",
    "epsilon claimed",
    "verdict",
)


def audit_lines(audit: dict) -> list[str]:
    """The console's audit lines: one per auditor and release unit."""
    return [
        f"audit {r[0]} ({r[2]} view, {r[3]}): epsilon >= {r[6]} at confidence {r[5]} from "
        f"{r[4]} trials; claimed {r[7]}: {r[8]}"
        for r in audit_rows(audit)
    ]


def render_audit_md(audit: dict) -> list[str]:
    """summary.md's privacy-audit section (nothing when the run had no auditor)."""
    rows = audit_rows(audit)
    if not rows:
        return []
    lines = [
        "",
        "## Privacy audit",
        "",
        "Epsilon lower = audited lower bound at the confidence given (Clopper-Pearson, the rule "
        "chosen on half the trials, judged on the other half); claimed = the run's accountant; "
        f"verdict: {VERDICT_RULE}.",
        "",
        "| " + " | ".join(AUDIT_HEADER) + " |",
        "|" + "---|" * len(AUDIT_HEADER),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def plot_audit(audit: dict, path: Path) -> Path | None:
    """audit.png / audit.pdf: per audited release unit, the lower bound beside the claim."""
    rows = audit_rows(audit)
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from foltr_async.observe.plots import DPI

    labels = [f"{r[0]}\n{r[2]}, {r[3]}" for r in rows]
    lower = [float(r[6]) for r in rows]
    claimed = [math.nan if r[7] == "unbounded" else float(r[7]) for r in rows]
    fig = Figure(figsize=(7.0, 0.9 + 0.45 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    y = np.arange(len(rows))[::-1]
    ax.barh(y, claimed, height=0.6, color="0.85", edgecolor="0.4", label="claimed (accountant)")
    ax.plot(lower, y, "o", color="C3", label="audited lower bound")
    for yi, c, lo in zip(y, claimed, lower, strict=True):
        if math.isnan(c):  # the accountant bounds nothing for this view
            ax.annotate(
                "no claim", (lo, yi), xytext=(8, -3), textcoords="offset points", fontsize="small"
            )
    ax.set_yticks(y, labels, fontsize="small")
    ax.set_xlabel("epsilon")
    ax.set_title("privacy audit: empirical lower bound vs claimed epsilon", fontsize="medium")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    fig.savefig(path.with_suffix(".pdf"))
    return path

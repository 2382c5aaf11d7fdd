"""Conclusions respect n and significance and state the numbers the table states."""

import re

from foltr_async.experiment import conclusions
from foltr_async.observe.results import compare, render_summary_md, summarise_variant

ROUNDS = [10, 20, 30, 40]


def _results(curves: dict[str, list[list[float]]]) -> dict:
    """results.json-shaped dict; unlearned variants' curves get one calibration evaluation more."""
    variants = {}
    for name, per_seed in curves.items():
        reps = []
        for seed, values in enumerate(per_seed, start=1):
            rounds = ROUNDS + [41] if "-unlearned" in name else ROUNDS
            reps.append({"seed": seed, "rounds": rounds, "offline": {"ndcg@10": values}})
        variants[name] = reps
    return {
        "reference": "9H-0M",
        "config": {name: {"federation": {"rounds": 40}} for name in curves},
        "variants": {
            n: {"repeats": r, "summary": summarise_variant(r, "ndcg@10")}
            for n, r in variants.items()
        },
        "comparisons": compare(variants, "9H-0M", "ndcg@10"),
    }


def test_one_seed_gives_numbers_but_no_recovery_claim():
    res = _results(
        {
            "9H-0M": [[0.60, 0.62, 0.63, 0.63]],
            "9H-1M": [[0.58, 0.66, 0.66, 0.45]],
            "9H-1M-unlearned": [[0.58, 0.66, 0.66, 0.45, 0.70]],
        }
    )
    lines = " ".join(conclusions(res))
    assert "of the gap" not in lines and "recovered" not in lines
    assert "too few seeds for a conclusion" in lines and "n = 1" in lines


def _recovery() -> dict:
    clean = [[0.5, 0.6, 0.62 + d, 0.62 + d] for d in (0.0, 0.01, -0.01, 0.005)]
    attacked = [[0.5, 0.4, 0.42 + d, 0.30 + d] for d in (0.0, 0.012, -0.008, 0.004)]
    unlearned = [a + [0.52 + d] for a, d in zip(attacked, (0.0, 0.01, -0.01, 0.002), strict=True)]
    return {"9H-0M": clean, "9H-1M": attacked, "9H-1M-unlearned-s10": unlearned}


def test_recovery_share_uses_the_final_values_and_needs_significance():
    curves = _recovery()
    line = next(s for s in conclusions(_results(curves)) if s.startswith("Unlearning"))
    # finals: attacked 0.30 + d (mean 0.302), clean 0.62 + d (0.62125), unlearned 0.5205
    assert line.startswith("Unlearning recovered 68% of the gap")
    assert "n = 4" in line and "p=" in line
    unlearned = curves["9H-1M-unlearned-s10"]
    noisy = [u[:-1] + [u[-1] - 0.2 + 0.1 * (i % 2)] for i, u in enumerate(unlearned)]
    res = _results({"9H-0M": curves["9H-0M"], "9H-1M": curves["9H-1M"], "9H-1M-unlearned": noisy})
    line = next(s for s in conclusions(res) if s.startswith("Unlearning"))
    assert line.startswith("Unlearning did not significantly recover")


def test_the_headline_states_each_arms_number_of_the_table():
    """The unlearning sentence and the summary table read one definition (the final value):
    a last snapshot unlike the arm's previous evaluations (the attacked arm's 0.30 after 0.42)
    is the number both state."""
    res = _results(_recovery())
    res["conclusions"] = conclusions(res)
    md = render_summary_md(res)
    line = next(s for s in res["conclusions"] if s.startswith("Unlearning"))
    for arm in ("9H-0M", "9H-1M", "9H-1M-unlearned-s10"):
        table = re.search(rf"^\| {re.escape(arm)} \| (\d\.\d{{4}}) ±", md, re.M).group(1)
        said = re.search(rf"(?<![-\w]){re.escape(arm)} (\d\.\d{{4}})(?![-\w])", line).group(1)
        assert said == table, arm
    assert "9H-1M 0.3020" in line


def test_comparison_sentences_judge_significance_by_holm():
    base = [[0.5, 0.5, 0.5, 0.50 + d] for d in (0.0, 0.01, -0.01, 0.02, -0.02)]
    curves = {"9H-0M": base}
    # each variant alone is significant (p = 0.012); Holm over the 5 comparisons gives 0.059
    for k in range(5):
        curves[f"v{k}"] = [
            r[:-1] + [r[-1] + 0.01 + e]
            for r, e in zip(base, (0.006, -0.006, 0.004, -0.004, 0.0), strict=True)
        ]
    lines = [s for s in conclusions(_results(curves)) if s.startswith("v")]
    assert len(lines) == 5
    assert all("not significant, p=0.0118, Holm p=0.0591" in s for s in lines)


def test_recovery_of_many_unlearned_variants_is_judged_by_holm():
    clean = [[0.6, 0.6, 0.6, 0.62 + d] for d in (0.0, 0.01, -0.01, 0.005, 0.0)]
    attacked = [[0.4, 0.4, 0.4, 0.4 + d] for d in (0.0, 0.012, -0.006, 0.004, 0.001)]
    # recovery +0.01: raw p = 0.042 for each; Holm over the 4 unlearned variants: 0.168
    noise = (0.008, -0.006, 0.0, 0.007, -0.009)
    unlearned = [a + [a[-1] + 0.01 + e] for a, e in zip(attacked, noise, strict=True)]
    curves = {"9H-0M": clean, "9H-1M": attacked}
    curves |= {f"9H-1M-unlearned-s{k}": unlearned for k in range(4)}
    lines = [s for s in conclusions(_results(curves)) if s.startswith("Unlearning")]
    assert len(lines) == 4
    assert all(s.startswith("Unlearning did not significantly recover") for s in lines)
    assert all("(p=0.042, Holm p=0.168)" in s for s in lines)

"""Conclusions respect n and significance and compare stable levels, not one snapshot."""

from foltr_async.experiment import conclusions
from foltr_async.observe.results import compare, summarise_variant

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
    # The attacked run's last snapshot dips to 0.45: against it the unlearned 0.70 "closes 139 %
    # of the gap" to 0.63, although the attacked level (mean of the last evaluations) was 0.59.
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


def test_recovery_share_uses_the_stable_level_and_needs_significance():
    clean = [[0.5, 0.6, 0.62 + d, 0.62 + d] for d in (0.0, 0.01, -0.01, 0.005)]
    attacked = [[0.5, 0.4, 0.42 + d, 0.30 + d] for d in (0.0, 0.012, -0.008, 0.004)]
    unlearned = [a + [0.52 + d] for a, d in zip(attacked, (0.0, 0.01, -0.01, 0.002), strict=True)]
    res = _results({"9H-0M": clean, "9H-1M": attacked, "9H-1M-unlearned-s10": unlearned})
    line = next(s for s in conclusions(res) if s.startswith("Unlearning"))
    # stable attacked level: mean of rounds 20-40 = 0.3733 + d; clean 0.6133 + d'; unlearned 0.52
    assert line.startswith("Unlearning recovered 61% of the gap")
    assert "n = 4" in line and "p=" in line
    noisy = [u[:-1] + [u[-1] - 0.2 + 0.1 * (i % 2)] for i, u in enumerate(unlearned)]
    res = _results({"9H-0M": clean, "9H-1M": attacked, "9H-1M-unlearned": noisy})
    line = next(s for s in conclusions(res) if s.startswith("Unlearning"))
    assert line.startswith("Unlearning did not significantly recover")


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
    # recovery +0.0115: raw p = 0.029 for each; Holm over the 4 unlearned variants: 0.116
    noise = (0.008, -0.006, 0.0, 0.007, -0.009)
    unlearned = [a + [a[-1] + 0.01 + e] for a, e in zip(attacked, noise, strict=True)]
    curves = {"9H-0M": clean, "9H-1M": attacked}
    curves |= {f"9H-1M-unlearned-s{k}": unlearned for k in range(4)}
    lines = [s for s in conclusions(_results(curves)) if s.startswith("Unlearning")]
    assert len(lines) == 4
    assert all(s.startswith("Unlearning did not significantly recover") for s in lines)
    assert all("(p=0.0289, Holm p=0.116)" in s for s in lines)

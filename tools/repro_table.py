"""Markdown table of a finished run for docs/REPRODUCTION.md, read from its results.json.

    python tools/repro_table.py results/repro_unlearning/<time>/results.json [--only PREFIX ...]

Per variant: final offline nDCG@10 and expected MaxRR@10 (mean ± sample std, n repeats = folds x
seeds), the online discounted nDCG@10, and the paired difference to the reference with its raw and
Holm-adjusted p (as results.json holds them); unlearned variants add their calibration cost
against re-training from scratch. ``--conclusions`` adds the unlearning sentences of the current
code (``foltr_async.experiment.conclusions``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ms(s: dict | None, fmt: str = ".4f") -> str:
    if not s or not s.get("n"):
        return "–"
    return f"{s['mean']:{fmt}} ± {s['std']:{fmt}}"


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}"


def table(results: dict, only: list[str]) -> str:
    comps = {c["variant"]: c for c in results.get("comparisons", [])}
    rows = [
        "| variant | nDCG@10 | MaxRR@10 | online nDCG@10 | n | Δ nDCG@10 vs ref | p | Holm p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    costs = []
    for name, entry in results["variants"].items():
        if only and not any(name.startswith(o) for o in only):
            continue
        s = entry["summary"]
        final = s["final"]
        c = comps.get(name, {})
        delta = "reference" if name == results.get("reference") else "–"
        if c.get("diff_mean") is not None:
            delta = f"{c['diff_mean']:+.4f}"
        rows.append(
            f"| {name} | {_ms(final.get('ndcg@10'))} | {_ms(final.get('maxrr@10'))} | "
            f"{_ms(s['online'].get('ndcg@10_discounted'), '.1f')} | "
            f"{final.get('ndcg@10', {}).get('n', 0)} | {delta} | {_p(c.get('p_value'))} | "
            f"{_p(c.get('p_holm'))} |"
        )
        unl = [r["unlearning"] for r in entry["repeats"] if r.get("unlearning")]
        if unl:
            cal = sum(u["calibration_interactions"] for u in unl) / len(unl)
            full = sum(u["retrain_interactions"] for u in unl) / len(unl)
            costs.append(f"| {name} | {cal:,.0f} | {full:,.0f} | {cal / full:.1%} |")
    out = "\n".join(rows)
    if costs:
        head = [
            "",
            "| variant | calibration interactions | re-training interactions | ratio |",
            "|---|---|---|---|",
        ]
        out += "\n" + "\n".join(head + costs)
    return out + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--only", action="append", default=[], help="variant name prefix")
    ap.add_argument("--conclusions", action="store_true", help="also the unlearning sentences")
    args = ap.parse_args()
    results = json.loads(args.results.read_text())
    print(table(results, args.only), end="")
    if args.conclusions:
        from foltr_async.experiment import conclusions

        print("\n" + "\n".join(f"- {s}" for s in conclusions(results) if "nlearning" in s))


if __name__ == "__main__":
    main()

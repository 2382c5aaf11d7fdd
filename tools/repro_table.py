"""Markdown table of a finished run for docs/REPRODUCTION-NOTES.md, read from its results.json.

    python tools/repro_table.py results/repro_unlearning/<time>/results.json [--only PREFIX ...]

Per variant: final offline nDCG@10 and expected MaxRR@10 (mean ± sample std, n repeats = folds x
seeds), the online discounted nDCG@10, and the paired difference to the reference with its raw,
Holm-adjusted and Bonferroni-adjusted p (the published studies' correction; results written
before it was recorded get it from the raw p and the run's comparisons); unlearned variants add
their calibration cost against re-training from scratch; ``--metric NAME`` adds another final
offline metric as a column (e.g. FedIPS's ndcg@5, FedPer's ndcg@10_personal); CS-F-LTR runs add
a table of the reverse top-K's cover rate and query time. ``--conclusions`` adds the unlearning
sentences of the current code (``foltr_async.experiment.conclusions``). ``--power`` prints
instead, per comparison, what its n repeats could find: the spread of the paired differences and
the smallest mean difference a paired t-test detects with 80 % power at alpha 0.05, and at
0.05 / m (Bonferroni over the run's m comparisons, the strictest step of Holm).

Given several runs of one file (e.g. one per click model), prints one table instead: per
variant its paired difference to each run's reference with the Holm p, a column per run:

    python tools/repro_table.py results/reproduce/data_poisoning-{perfect,navigational}

``--read-at NAME=VARIANT@ROUND`` (repeatable) adds the row NAME: VARIANT's repeats read at
their evaluation of round ROUND, for an arm that is another's first ROUND rounds (the same
settings but fewer rounds, when nothing depends on the total: e.g. fpdgd_batch_dp.toml's
rounds1000-B2-dp is budget4M-B2-dp's first 1000 rounds), so it need not run. The row takes the
place of a variant of that name; the comparisons, Holm and Bonferroni are computed again over
the table's variants. Its online metric is the cumulative one through round ROUND (the
repeats' ``online_at``); results written before that was recorded hold only the whole run's,
so it is left out ("–"), as are the row's messages, privacy and costs.
``--at-round ROUND`` reads every variant so (after ``--read-at``), for the order of the arms at
one round: those not evaluated there are left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from foltr_async.errors import FoltrError
from foltr_async.observe.results import compare, load_results, paired_finals, summarise_variant
from foltr_async.observe.stats import bonferroni, detectable_difference, summarise


def _ms(s: dict | None, fmt: str = ".4f") -> str:
    if not s or not s.get("n"):
        return "–"
    return f"{s['mean']:{fmt}} ± {s['std']:{fmt}}"


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}"


def _stat(values: list[float], fmt: str) -> str:
    if not values:
        return "–"
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:{fmt}}"
    sd = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{m:{fmt}} ± {sd:{fmt}}"


def csfltr_table(results: dict, only: list[str]) -> str:
    """CS-F-LTR's reverse top-K measurements per variant (mean ± std over repeats): cover rate
    against the exact top-K (all queried terms, and terms at least K documents hold twice),
    query time per term (owner + querier) of RTK-Sketch and NAIVE, and their ratio."""
    rows = [
        "| variant | RTK cover | RTK cover (rankable) | RTK ms/term | NAIVE ms/term | speed-up "
        "| n |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["variants"].items():
        if only and not any(name.startswith(o) for o in only):
            continue
        cs = [r["csfltr"] for r in entry["repeats"] if r.get("csfltr", {}).get("rtk")]
        if not cs:
            continue

        def col(path: tuple[str, ...], fmt: str, cs: list = cs) -> str:
            vals = []
            for c in cs:
                v = c
                for key in path:
                    v = v.get(key) if isinstance(v, dict) else None
                if v is not None:
                    vals.append(float(v))
            return _stat(vals, fmt)

        rows.append(
            f"| {name} | {col(('rtk', 'cover_rate'), '.3f')} | "
            f"{col(('rtk', 'cover_rate_rankable'), '.3f')} | {col(('rtk', 'query_ms'), '.2f')} | "
            f"{col(('naive', 'query_ms'), '.2f')} | {col(('speedup',), '.1f')} | {len(cs)} |"
        )
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""


def _comparisons(results: dict) -> dict[str, dict]:
    """A run's paired comparisons with its reference, by variant (``p_bonferroni`` filled in
    for results written before it was recorded)."""
    comps = results.get("comparisons", [])
    adjusted = bonferroni([c.get("p_value") for c in comps])
    return {c["variant"]: {"p_bonferroni": b, **c} for c, b in zip(comps, adjusted, strict=True)}


def table(results: dict, only: list[str], extra: list[str] | None = None) -> str:
    comps = _comparisons(results)
    extra = extra or []
    rows = [
        "| variant | nDCG@10 | MaxRR@10 | "
        + "".join(f"{m} | " for m in extra)
        + "online nDCG@10 | n | Δ nDCG@10 vs ref | p | Holm p | Bonferroni p |",
        "|---|---|---|" + "---|" * len(extra) + "---|---|---|---|---|---|",
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
            + "".join(f"{_ms(final.get(m))} | " for m in extra)
            + f"{_ms(s['online'].get('ndcg@10_discounted'), '.1f')} | "
            f"{final.get('ndcg@10', {}).get('n', 0)} | {delta} | {_p(c.get('p_value'))} | "
            f"{_p(c.get('p_holm'))} | {_p(c.get('p_bonferroni'))} |"
        )
        unl = [r["unlearning"] for r in entry["repeats"] if r.get("unlearning")]
        if unl:
            cal = sum(u["interactions"] for u in unl) / len(unl)
            full = sum(u["retrain_interactions"] for u in unl) / len(unl)
            costs.append(f"| {name} | {cal:,.0f} | {full:,.0f} | {cal / full:.1%} |")
    out = "\n".join(rows)
    if costs:
        head = [
            "",
            "| variant | unlearning interactions | re-training interactions | ratio |",
            "|---|---|---|---|",
        ]
        out += "\n" + "\n".join(head + costs)
    return out + "\n"


def power_table(results: dict, only: list[str]) -> str:
    """Per comparison with the reference (on the metric the run compared): n pairs, the observed
    Δ, the sample std of the paired differences and the Δ detectable with 80 % power at alpha
    0.05 and at 0.05 / m."""
    comps = _comparisons(results)
    metric = next(iter(comps.values()))["metric"]
    m = sum(1 for c in comps.values() if c.get("p_value") is not None)
    ref = results["variants"][results["reference"]]["repeats"]
    rows = [
        f"| variant | n | Δ {metric} | std of Δ | detectable Δ (α 0.05) | "
        f"detectable Δ (α 0.05/{m}) |",
        "|---|---|---|---|---|---|",
    ]
    for name in comps:
        if only and not any(name.startswith(o) for o in only):
            continue
        mine, theirs = paired_finals(results["variants"][name]["repeats"], ref, metric)
        d = summarise(a - b for a, b in zip(mine, theirs, strict=True))
        n, sd = d["n"], d["std"]
        if n < 2:
            rows.append(f"| {name} | {n} | – | – | – | – |")
            continue
        cells = [detectable_difference(sd, n), detectable_difference(sd, n, alpha=0.05 / max(m, 1))]
        rows.append(
            f"| {name} | {n} | {d['mean']:+.4f} | {sd:.4f} | "
            + " | ".join(f"{x:.4f}" for x in cells)
            + " |"
        )
    return "\n".join(rows) + "\n"


def _label(path: Path) -> str:
    """A run's column title: its output folder's name."""
    return (path.parent if path.name == "results.json" else path).name


def delta_table(runs: list[tuple[str, dict]], only: list[str]) -> str:
    """One row per variant of the first run: Δ nDCG@10 against each run's own reference (Holm
    p), a column per run; the reference row gives each run's reference level."""
    head = "| variant | " + " | ".join(f"{label}: Δ (Holm p)" for label, _ in runs) + " |"
    rows = [head, "|---|" + "---|" * len(runs)]
    comps = [_comparisons(r) for _, r in runs]
    for name in runs[0][1]["variants"]:
        if only and not any(name.startswith(o) for o in only):
            continue
        cells = []
        for (_, r), comp in zip(runs, comps, strict=True):
            c = comp.get(name, {})
            if name == r.get("reference"):
                level = r["variants"][name]["summary"]["final"].get("ndcg@10", {})
                cells.append(f"reference {level.get('mean', float('nan')):.4f}")
            elif c.get("diff_mean") is not None:
                cells.append(f"{c['diff_mean']:+.4f} ({_p(c.get('p_holm'))})")
            else:
                cells.append("–")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _read(repeats: list[dict], round_: int, label: str) -> list[dict]:
    """``repeats`` as they stood at their evaluation of ``round_``: only what is known there
    (the whole run's messages, privacy and costs describe more rounds)."""
    out = []
    for rep in repeats:
        i = rep["rounds"].index(round_) + 1
        kept = {k: rep[k] for k in ("seed", "repeat", "fold", "judged_queries") if k in rep}
        aligned = {
            k: rep[k][:i] for k in ("rounds", "sim_times", "interactions", "online_at") if k in rep
        }
        offline = {m: values[:i] for m, values in rep["offline"].items()}
        row = {**kept, **aligned, "offline": offline, "read_at": label}
        if "online_at" in rep:
            row["online"] = {"ndcg@10_discounted": rep["online_at"][i - 1]}
        out.append(row)
    return out


def _with_rows(results: dict, rows: dict[str, list[dict]]) -> dict:
    """``results`` with the variants ``rows`` (name -> repeats) added or replaced, their
    summaries and every comparison computed again, once."""
    metric = results.get("metric", "ndcg@10")
    variants = dict(results["variants"])
    for name, repeats in rows.items():
        variants[name] = {"repeats": repeats, "summary": summarise_variant(repeats, metric)}
    reps = {n: e["repeats"] for n, e in variants.items()}
    return {
        **results,
        "variants": variants,
        "comparisons": compare(reps, results["reference"], metric),
    }


def read_at(results: dict, specs: list[str]) -> dict:
    """``results`` with a row per ``NAME=VARIANT@ROUND`` of ``specs`` (see the module's
    docstring); raises ``FoltrError`` naming what is wrong in a spec."""
    rows = {}
    for spec in specs:
        name, _, source = spec.partition("=")
        variant, _, at = source.rpartition("@")
        if not name or not variant or not at.isdigit():
            raise FoltrError(f"--read-at {spec!r}: expected NAME=VARIANT@ROUND")
        if variant not in results["variants"]:
            known = ", ".join(results["variants"])
            raise FoltrError(f"--read-at {spec!r}: no variant {variant!r} (variants: {known})")
        repeats = results["variants"][variant]["repeats"]
        missing = [r for r in repeats if int(at) not in r.get("rounds", [])]
        if missing:
            rep = missing[0]
            raise FoltrError(
                f"--read-at {spec!r}: repeat {rep.get('repeat')} of {variant} has no evaluation "
                f"at round {at} (evaluated: {rep.get('rounds', [])[:3]}...)"
            )
        rows[name] = _read(repeats, int(at), f"{variant}@{at}")
    return _with_rows(results, rows)


def at_round(results: dict, round_: int) -> dict:
    """Every variant of ``results`` read at its evaluation of ``round_``; those without one in
    some repeat are left out, and so is the reference comparison if it has none."""
    kept = {
        name: entry["repeats"]
        for name, entry in results["variants"].items()
        if entry["repeats"] and all(round_ in r.get("rounds", []) for r in entry["repeats"])
    }
    if not kept:
        raise FoltrError(f"--at-round {round_}: no variant was evaluated at round {round_}")
    rows = {name: _read(repeats, round_, f"{name}@{round_}") for name, repeats in kept.items()}
    return _with_rows({**results, "variants": {}}, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "results", type=Path, nargs="+", help="a run's results.json, or its output folder"
    )
    ap.add_argument("--only", action="append", default=[], help="variant name prefix")
    ap.add_argument("--conclusions", action="store_true", help="also the unlearning sentences")
    ap.add_argument(
        "--power", action="store_true", help="what each comparison's n repeats could detect"
    )
    ap.add_argument(
        "--metric",
        action="append",
        default=[],
        help="another final offline metric as a column (e.g. ndcg@5, ndcg@10_personal)",
    )
    ap.add_argument(
        "--read-at",
        action="append",
        default=[],
        metavar="NAME=VARIANT@ROUND",
        help="a row read from a longer variant at one of its evaluated rounds",
    )
    ap.add_argument(
        "--at-round", type=int, metavar="ROUND", help="every variant read at this round"
    )
    args = ap.parse_args()
    try:
        runs = [(_label(path), load_results(path)) for path in args.results]
        if (args.read_at or args.at_round is not None) and len(runs) == 1:
            if args.read_at:
                runs[0] = (runs[0][0], read_at(runs[0][1], args.read_at))
            if args.at_round is not None:
                runs[0] = (runs[0][0], at_round(runs[0][1], args.at_round))
    except FoltrError as exc:
        sys.exit(f"repro_table: {exc}")
    if len(runs) > 1:
        if args.metric or args.conclusions or args.power or args.read_at or args.at_round:
            sys.exit(
                "repro_table: --metric, --conclusions, --power, --read-at and --at-round take "
                "one run, not several"
            )
        print(delta_table(runs, args.only), end="")
        return
    results = runs[0][1]
    if args.power:
        if not results.get("reference") or not results.get("comparisons"):
            sys.exit(f"repro_table: {args.results[0]} has no comparisons with a reference")
        print(power_table(results, args.only), end="")
        return
    print(table(results, args.only, args.metric), end="")
    cs = csfltr_table(results, args.only)
    if cs:
        print("\n" + cs, end="")
    if args.conclusions:
        from foltr_async.experiment import conclusions

        print("\n" + "\n".join(f"- {s}" for s in conclusions(results) if "nlearning" in s))


if __name__ == "__main__":
    main()

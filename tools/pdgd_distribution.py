"""Does FPDGD still learn as the PDGD reference does? A distribution check on real MQ2008.

    python tools/pdgd_distribution.py                       # 3 click models x (no DP, DP), 5 folds
    python tools/pdgd_distribution.py --clicks informational --no-dp-arm --folds 1
    python tools/pdgd_distribution.py --json out.json       # the table as JSON too
    python tools/pdgd_distribution.py --no-dp-arm --set federation.params.dp=true \
        --set federation.params.epsilon=0.5                 # noise the reference lacks: FAILs

Speed work may change FPDGD's results in their last bits (another summation order, another
order of events within a virtual instant); such a change is acceptable only when FPDGD still
learns as PDGD does. This tool runs, for every click model and DP setting, the simulator's
FPDGD (every message through the bus and codec, the batched kernel) and an independent
reference built only from ``ltr/pdgd.py`` (one query at a time: ``interaction_gradient``, the
same clipping and Gamma-difference noise, weighted FedAvg) on the same folds and seeds, and
compares the mean final offline nDCG@10 over folds x seeds. The run-to-run spread is the
pooled standard deviation over seeds within a fold (fold differences are not run-to-run
noise). A cell passes when the two means differ by less than the reference's spread; the exit
code is 1 when a cell fails, 2 on bad arguments or a missing dataset.

The two sides share nothing but the data, the click model's definition and ``ltr/pdgd.py``:
their random streams differ, so equal means are evidence of equal distributions, not equal
runs. Defaults are a scaled-down FPDGD setting (50 clients x 4 queries, 100 rounds; the paper's
is 1000 clients x 4 queries, 1000 rounds), enough for the curves to be well above their start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "MQ2008"
SCENARIO = ROOT / "reproduce" / "fpdgd_dp.toml"
CLICKS = ("perfect", "navigational", "informational")
#: the paper's DP setting this check uses (fpdgd_dp.toml's epsilon 4.5, Delta 5)
DP = {"epsilon": 4.5, "sensitivity": 5.0}


def reference_run(
    train,
    test,
    n_grades: int,
    click: str,
    *,
    clients: int,
    queries: int,
    rounds: int,
    lr: float,
    dp: bool,
    seed: int,
) -> float:
    """FPDGD from ltr/pdgd.py alone: the final offline nDCG@10 of one run."""
    from foltr_async.ltr.clicks import click_model
    from foltr_async.ltr.metrics import mean_ndcg
    from foltr_async.ltr.pdgd import interaction_gradient
    from foltr_async.ltr.rankers import LinearRanker

    rng = np.random.default_rng([seed, 20261125])
    model = click_model(click, n_grades)
    ranker = LinearRanker(train.n_features)
    global_w = np.zeros(train.n_features)
    bound = DP["sensitivity"] / 2.0  # the paper's Algorithm 3: clip to Delta / 2 (L2)
    scale = DP["sensitivity"] / DP["epsilon"]
    for _ in range(rounds):
        updates = np.empty((clients, global_w.size))
        for c in range(clients):
            theta = global_w.copy()
            for q in rng.integers(train.n_queries, size=queries):
                ranker.set_params(theta)
                features, labels = train.query(int(q))
                _, _, g = interaction_gradient(ranker, features, labels, model, rng)
                theta = theta + lr * g
                if dp:
                    norm = float(np.linalg.norm(theta))
                    if norm > bound:
                        theta = theta * (bound / norm)
            if dp:  # this client's share of a Laplace(scale) draw split over the clients
                shape = 1.0 / clients
                theta = (
                    theta
                    + rng.gamma(shape, scale, theta.size)
                    - rng.gamma(shape, scale, theta.size)
                )
            updates[c] = theta
        global_w = updates.mean(axis=0)  # equal interactions: weighted FedAvg is the mean
    ranker.set_params(global_w)
    return mean_ndcg(ranker.score(test.features), test, 10, "skip")


def simulator_runs(
    data: Path,
    folds: list[int],
    seeds: int,
    click: str,
    *,
    clients: int,
    queries: int,
    rounds: int,
    dp: bool,
    extra: list[str] = (),
) -> dict[tuple[int, int], float]:
    """The simulator's FPDGD (reproduce/fpdgd_dp.toml, scaled down): (fold, seed) -> final."""
    from foltr_async.experiment import run_scenario
    from foltr_async.observe.observer import Observer
    from foltr_async.scenario.load import load_scenario

    variant = "FPDGD"
    dp_sets = [f"federation.params.{k}={v}" for k, v in {"dp": "true", **DP}.items()]
    sets = [
        f"dataset.path={data}",
        f"dataset.folds={folds}",
        f"clicks.model={click}",
        f"federation.clients={clients}",
        f"federation.queries_per_client={queries}",
        f"federation.rounds={rounds}",
        f"evaluation.every={rounds}",
        f"scenario.repeats={seeds * len(folds)}",
        *(dp_sets if dp else []),
        *extra,
    ]
    scenario = load_scenario(SCENARIO, sets)
    scenario = replace(scenario, reference=variant, variants={variant: scenario.variants[variant]})
    with tempfile.TemporaryDirectory() as out:
        results = run_scenario(scenario, Path(out), Observer())
    finals = {}
    for rep in results["variants"][variant]["repeats"]:
        finals[rep["fold"], rep["seed"]] = rep["offline"]["ndcg@10"][-1]
    return finals


def pooled_spread(finals: dict[tuple[int, int], float]) -> float:
    """Pooled within-fold standard deviation over seeds (ddof 1)."""
    by_fold: dict[int, list[float]] = {}
    for (fold, _), v in finals.items():
        by_fold.setdefault(fold, []).append(v)
    num = sum(((np.array(v) - np.mean(v)) ** 2).sum() for v in by_fold.values())
    dof = sum(len(v) - 1 for v in by_fold.values())
    return float(np.sqrt(num / dof)) if dof else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MQ2008 folder (Fold1-5)")
    ap.add_argument("--folds", default="1,2,3,4,5")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per fold (>= 2)")
    ap.add_argument("--clicks", action="append", choices=CLICKS, help="default: all three")
    ap.add_argument("--no-dp-arm", action="store_true", help="only FPDGD without DP")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--queries", type=int, default=4, help="queries per client and round")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", type=Path, help="also write the table here")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the simulator's side only (e.g. to see the check catch a changed FPDGD)",
    )
    args = ap.parse_args(argv)
    try:
        folds = [int(f) for f in args.folds.split(",")]
    except ValueError:
        print(f"--folds: expected numbers like 1,2,3, got {args.folds!r}", file=sys.stderr)
        return 2
    if args.seeds < 2 or min(args.clients, args.queries, args.rounds) < 1:
        print("--seeds must be >= 2 and --clients/--queries/--rounds >= 1", file=sys.stderr)
        return 2
    missing = [f for f in folds if not (args.data / f"Fold{f}" / "train.txt").is_file()]
    if missing:
        print(
            f"{args.data}: no Fold{missing[0]}/train.txt (MQ2008 with Fold1-5 expected)",
            file=sys.stderr,
        )
        return 2

    from foltr_async.ltr.clicks import grade_scale
    from foltr_async.ltr.data import load_fold

    size = {"clients": args.clients, "queries": args.queries, "rounds": args.rounds}
    # normalised as the scenario loads the collection (what `dataset check` recognises)
    from foltr_async.ltr.catalog import recognise

    normalise = recognise(args.data).collection.normalise
    data = {f: load_fold(args.data / f"Fold{f}", normalise=normalise) for f in folds}
    rows, failed = [], 0
    print(f"{'clicks':14} {'dp':6} {'FPDGD':>8} {'ref':>8} {'diff':>8} {'spread':>7}  verdict")
    for click in args.clicks or CLICKS:
        for dp in (False,) if args.no_dp_arm else (False, True):
            t0 = time.process_time()
            sim = simulator_runs(args.data, folds, args.seeds, click, dp=dp, extra=args.set, **size)
            t1 = time.process_time()
            ref = {}
            for f in folds:
                train, test = data[f]["train"], data[f]["test"]
                grades = grade_scale(max(train.max_grade, test.max_grade))
                for s in range(args.seeds):
                    ref[f, s] = reference_run(
                        train, test, grades, click, lr=0.1, dp=dp, seed=1000 * f + s, **size
                    )
            t2 = time.process_time()
            m_sim, m_ref = float(np.mean(list(sim.values()))), float(np.mean(list(ref.values())))
            spread = pooled_spread(ref)
            ok = abs(m_sim - m_ref) < spread
            failed += not ok
            row = {
                "clicks": click,
                "dp": DP if dp else None,
                "fpdgd_mean": m_sim,
                "reference_mean": m_ref,
                "spread": spread,
                "fpdgd_spread": pooled_spread(sim),
                "runs": len(sim),
                "pass": ok,
                "cpu_s": {"fpdgd": t1 - t0, "reference": t2 - t1},
            }
            rows.append(row)
            print(
                f"{click:14} {'eps4.5' if dp else 'no':6} {m_sim:8.4f} {m_ref:8.4f} "
                f"{m_sim - m_ref:+8.4f} {spread:7.4f}  {'pass' if ok else 'FAIL'}",
                flush=True,
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"setting": size | {"folds": folds, "seeds": args.seeds}, "cells": rows}, indent=1
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

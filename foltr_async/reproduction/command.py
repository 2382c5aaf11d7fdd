"""``python -m foltr_async claims``: the claims' verdicts from the records, the report, its
check, and new records from finished runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from foltr_async.errors import FoltrError
from foltr_async.observe.results import load_results
from foltr_async.reproduction.claims import check_quotes, load_claims
from foltr_async.reproduction.records import load_records, make_record, write_record
from foltr_async.reproduction.report import differences, evaluate, ours, render

CLAIMS = Path("reproduce/claims/claims.toml")
RECORDS = Path("reproduce/claims/records")
REPORT = Path("docs/REPRODUCTION.md")
SEEDS = Path("../shared/seeds")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async claims",
        description="Every published claim's verdict, computed from the committed records "
        "(run from the repository root). With no option: the table on the terminal.",
    )
    p.add_argument("--write", action="store_true", help=f"write the report to {REPORT}")
    p.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1, naming the claims, when {REPORT} differs from the records, or "
        "a quote is not in its seed",
    )
    p.add_argument(
        "--record",
        type=Path,
        metavar="RUN",
        action="append",
        default=[],
        help="make the record of a finished run folder (its name is the folder's)",
    )
    p.add_argument("--command", default="", help="with --record: the command that made it")
    p.add_argument("--claims", type=Path, default=CLAIMS)
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--report", type=Path, default=REPORT)
    p.add_argument("--seeds", type=Path, default=SEEDS, help="the seed texts, for --check")
    args = p.parse_args(argv)

    for run in args.record:
        record = make_record(load_results(run), run.name, args.command)
        print(f"{write_record(record, args.records)}: {len(record['variants'])} variants")
    if args.record and not (args.write or args.check):
        return 0
    claims = load_claims(args.claims)
    records = load_records(args.records) if args.records.is_dir() else {}
    evaluated = evaluate(claims, records)
    text = render(evaluated, records, claims)
    if args.write:
        args.report.write_text(text)
        print(f"{args.report}: {len(evaluated)} claims")
    if args.check:
        return _check(args, claims, text)
    if not args.write:
        for e in evaluated:
            print(f"{e.claim.id:40s} {e.verdict:34s} {ours(e)}")
    return 0


def _check(args: argparse.Namespace, claims, text: str) -> int:
    problems = []
    if args.seeds.is_dir():
        problems += check_quotes(claims, args.seeds)
    else:
        print(f"claims --check: {args.seeds} not found: quotes not checked", file=sys.stderr)
    try:
        written = args.report.read_text()
    except OSError as e:
        raise FoltrError(f"{args.report}: cannot read: {e.strerror}") from None
    for key in differences(written, text):
        problems.append(
            f"{args.report}: {key}: differs from what the records give "
            "(python -m foltr_async claims --write)"
        )
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0

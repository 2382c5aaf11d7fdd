"""Run the whole reproduction set one run after another and gather its tables in one report.

    python tools/reproduce_all.py --jobs 2                  # tools/reproduce_plan.toml, all
    python tools/reproduce_all.py --plan                    # the runs, nothing started
    python tools/reproduce_all.py --only fpdgd_dp --jobs 2  # runs whose name starts so

Each run goes to ``OUT/<name>/`` (``--out``, default ``results/reproduce``) with its console
output in ``OUT/<name>.log``. A run whose folder holds a complete ``results.json`` is skipped,
so an interrupted night resumes where it stopped; a folder without one (the run was killed or
failed part-way) is kept, renamed ``<name>.incomplete-N``, and the run starts again.
``OUT/runs.jsonl`` records every run's wall time, CPU time, exit code and the load average
around it; ``OUT/REPORT.md`` holds ``tools/repro_table.py``'s table of every finished run of the
plan (with ``--only`` too). A failed run does not stop the others; the exit code is 1 when any
failed, 2 on a bad plan or argument.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

CLICK_MODELS = ("perfect", "navigational", "informational")
TOOLS = Path(__file__).parent
TABLE = TOOLS / "repro_table.py"


@dataclass(frozen=True)
class Run:
    name: str
    file: Path
    sets: tuple[str, ...]
    only: tuple[str, ...] = ()  # a part of the file's variants (merge the parts afterwards)

    def command(self, out: Path, jobs: int, extra: list[str]) -> list[str]:
        sets = [a for s in (*self.sets, *extra) for a in ("--set", s)]
        only = [a for v in self.only for a in ("--only", v)]
        cli = [sys.executable, "-m", "foltr_async", str(self.file), "--jobs", str(jobs)]
        return [*cli, "--quiet", "--out", str(out), *sets, *only]


def fail(message: str) -> NoReturn:
    """A bad plan or argument: one line, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_plan(path: Path) -> list[Run]:
    """The plan's runs, each click model of a ``clicks`` list its own run; one-line errors."""
    try:
        plan = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        fail(f"{path}: {e}")
    entries = plan.get("run")
    if not isinstance(entries, list) or not entries:
        fail(f"{path}: expected [[run]] tables with a file each")
    runs: list[Run] = []
    for i, entry in enumerate(entries, 1):
        where = f"{path}: run {i}"
        unknown = set(entry) - {"name", "file", "clicks", "set", "only"}
        if unknown:
            fail(f"{where}: unknown key {sorted(unknown)[0]!r}")
        file = Path(str(entry.get("file", "")))
        if not entry.get("file") or not file.is_file():
            fail(f"{where}: file {str(file)!r} not found (run from the root)")
        clicks = entry.get("clicks", [None])
        bad = [c for c in clicks if c is not None and c not in CLICK_MODELS]
        if not isinstance(clicks, list) or bad:
            fail(f"{where}: clicks must be a list of {', '.join(CLICK_MODELS)}")
        sets = entry.get("set", [])
        if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
            fail(f'{where}: set must be a list of "key=value" strings')
        only = entry.get("only", [])
        if not isinstance(only, list) or not all(isinstance(v, str) and v for v in only):
            fail(f"{where}: only must be a list of variant names")
        stem = str(entry.get("name", file.stem))
        if not stem or not stem.isprintable() or any(c in stem for c in "/\\"):
            fail(f"{where}: name must name one folder (no '/')")
        for click in clicks:
            name = stem if click is None else f"{stem}-{click}"
            extra = () if click is None else (f"clicks.model={click}",)
            runs.append(Run(name, file, (*extra, *sets), tuple(only)))
    names = [r.name for r in runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"{path}: run {twice[0]!r} is planned twice")
    return runs


def finished(folder: Path) -> bool:
    """Whether the run in ``folder`` completed (a failed run may leave partial results)."""
    try:
        return json.loads((folder / "results.json").read_text()).get("complete") is True
    except (OSError, ValueError, AttributeError):
        return False


def set_aside(folder: Path) -> Path:
    """A killed run's folder, renamed out of the way with its log inside (never deleted)."""
    n = 1
    while (aside := folder.with_name(f"{folder.name}.incomplete-{n}")).exists():
        n += 1
    folder.rename(aside)
    log = folder.with_name(f"{folder.name}.log")
    if log.exists():
        log.rename(aside / "run.log")
    return aside


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def execute(run: Run, out: Path, jobs: int, extra: list[str]) -> dict:
    """One run through the command line, its output to a log file; what it cost."""
    folder = out / run.name
    cmd = run.command(folder, jobs, extra)
    record = {
        "run": run.name,
        "command": " ".join(["python", *cmd[1:]]),
        "load_start": load_average(),
    }
    cpu, start = children_cpu(), time.monotonic()
    with open(out / f"{run.name}.log", "wb") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    record.update(
        exit_code=rc,
        wall_s=round(time.monotonic() - start, 1),
        cpu_s=round(children_cpu() - cpu, 1),
        load_end=load_average(),
    )
    with open(out / "runs.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    return record


def last_records(out: Path) -> dict[str, dict]:
    """The latest record of each run in ``runs.jsonl`` (a resumed night appends)."""
    path = out / "runs.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["run"]: r for r in records}


def write_report(out: Path, runs: list[Run]) -> Path:
    """OUT/REPORT.md: per finished run, its command, cost and repro_table's tables."""
    records = last_records(out)
    parts = ["# Reproduction report", ""]
    for run in runs:
        folder = out / run.name
        if not finished(folder):
            continue
        rec = records.get(run.name, {})
        parts += [f"## {run.name}", ""]
        if rec:
            parts += [
                f"`{rec['command']}`: wall {rec['wall_s']} s, CPU {rec['cpu_s']} s, "
                f"load {rec['load_start']} -> {rec['load_end']}",
                "",
            ]
        table = subprocess.run(
            [sys.executable, str(TABLE), str(folder), "--conclusions"],
            capture_output=True,
            text=True,
        )
        parts += [table.stdout.strip() or f"(no table: {table.stderr.strip()})", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(parts))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan-file", type=Path, default=TOOLS / "reproduce_plan.toml")
    ap.add_argument("--out", type=Path, default=Path("results/reproduce"))
    ap.add_argument("--jobs", type=int, default=1, help="processes per run (--jobs of each run)")
    ap.add_argument("--only", action="append", default=[], help="runs whose name starts so")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every run, e.g. federation.rounds=20 for a dry pass",
    )
    ap.add_argument("--plan", action="store_true", help="print the runs and stop")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    plan = runs = load_plan(args.plan_file)
    if args.only:
        runs = [r for r in plan if any(r.name.startswith(o) for o in args.only)]
        if not runs:
            fail(f"--only {args.only}: no run of the plan starts so")
    if args.plan:
        for run in runs:
            done = finished(args.out / run.name)
            cmd = " ".join(run.command(args.out / run.name, args.jobs, args.set)[1:])
            print(f"{run.name:34} {'done  ' if done else 'to run'}  python {cmd}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for i, run in enumerate(runs, 1):
        folder = args.out / run.name
        head = f"[{i}/{len(runs)}] {run.name}"
        if finished(folder):
            print(f"{head}: done before, skipped", flush=True)
            continue
        if folder.exists():
            print(f"{head}: an unfinished folder kept as {set_aside(folder).name}", flush=True)
        print(f"{head}: running (log {args.out / (run.name + '.log')})", flush=True)
        rec = execute(run, args.out, args.jobs, args.set)
        if rec["exit_code"] != 0:
            failed.append(run.name)
        status = "ok" if rec["exit_code"] == 0 else f"FAILED (exit {rec['exit_code']})"
        print(f"{head}: {status}, wall {rec['wall_s']} s, CPU {rec['cpu_s']} s", flush=True)
    report = write_report(args.out, plan)  # every finished run of the plan, not only these
    print(f"report: {report}")
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)} (see their .log)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the whole reproduction set one run after another and gather its tables in one report.

    python tools/reproduce_all.py --jobs 2                  # tools/reproduce_plan.toml, all
    python tools/reproduce_all.py --plan                    # the runs, nothing started
    python tools/reproduce_all.py --only fpdgd_dp --jobs 2  # runs whose name starts so
    python tools/reproduce_all.py --runs 2                  # two runs at once, one process each

Each run goes to ``OUT/<name>/`` (``--out``, default ``results/reproduce``) with its console
output in ``OUT/<name>.log``. A run whose folder holds a complete ``results.json`` is skipped,
so an interrupted night resumes where it stopped; a folder without one (the run was killed or
failed part-way) is kept, renamed ``<name>.incomplete-N``, and the run starts again.
A plan entry's ``reuse = ["other"]`` passes ``--reuse OUT/other[-<click model>]`` when that run
has written results with this code (``foltr_async.provenance``): repeats both files compute
with the same settings and seed (e.g. ``fpdgd_clients``'s 1,000-client arms, ``fpdgd_dp``'s
FPDGD and (4.5, 5)) are taken, not run again; the results are the same either way, only the
time differs. ``read_at = ["NAME=VARIANT@ROUND"]`` adds a row to the run's table in REPORT.md,
read from a longer arm (``repro_table.py --read-at``): with ``only`` leaving out an arm that is
another's first rounds, it is not computed twice.
``--runs N`` keeps N runs going at once (each with ``--jobs`` processes), longest first by
the CPU time ``runs.jsonl`` recorded for them (runs without a record keep the plan's order,
after those): on a few cores ``--runs 2 --jobs 1`` leaves no core idle at the end of each run
and spends no second process per run. Each run's PDGD kernel gets the cores divided by the
processes going at once (``FOLTR_ASYNC_THREADS`` when set wins), so parallel runs do not each
start threads for every core. ``OUT/runs.jsonl`` records every run's wall time, CPU
time (the run's process tree), exit code and the load average around it; ``OUT/REPORT.md``
holds ``tools/repro_table.py``'s table of every finished run of the plan (with ``--only`` too).
``--record`` writes each finished run's record of results to
``reproduce/claims/records/NAME.json.gz`` (``foltr_async.reproduction.records``), which
``python -m foltr_async claims`` computes the claims' verdicts from; a dry pass with ``--set``
is not recorded. ``--check`` re-runs, for each selected run whose record is stale, the
record's first fold and seed of every variant with this code into ``OUT/check/``; a re-run
equal to the record in every field marks the record checked (no longer stale), one that differs
leaves it stale and says to record the run again. Ctrl-C stops the runs going (each keeps
the repeats it finished) and exits 130; the same command resumes. A failed run does not stop
the others; the exit code is 1 when any failed (or a check differed), 2 on a bad plan or
argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout too

from foltr_async.errors import FoltrError  # noqa: E402
from foltr_async.ltr import threads  # noqa: E402
from foltr_async.observe.results import load_results  # noqa: E402
from foltr_async.provenance import check_same_code  # noqa: E402
from foltr_async.reproduction.records import (  # noqa: E402
    checked_record,
    load_records,
    make_record,
    repeat_name,
    sample_of,
    write_record,
)

CLICK_MODELS = ("perfect", "navigational", "informational")
TOOLS = Path(__file__).parent
RECORDS = TOOLS.parent / "reproduce" / "claims" / "records"
TABLE = TOOLS / "repro_table.py"


@dataclass(frozen=True)
class Run:
    name: str
    file: Path
    sets: tuple[str, ...]
    only: tuple[str, ...] = ()  # a part of the file's variants (merge the parts afterwards)
    reuse: tuple[str, ...] = ()  # runs of the plan whose finished repeats this one may take
    read_at: tuple[str, ...] = ()  # rows its report reads from longer arms (repro_table)

    def command(self, out: Path, jobs: int, extra: list[str]) -> list[str]:
        sets = [a for s in (*self.sets, *extra) for a in ("--set", s)]
        only = [a for v in self.only for a in ("--only", v)]
        sources = (out.parent / name for name in self.reuse)
        reuse = [a for f in sources if _reusable(f) for a in ("--reuse", str(f))]
        cli = [sys.executable, "-m", "foltr_async", str(self.file), "--jobs", str(jobs)]
        # events at info: a 10,000-round run of a small federation wrote ~200 MB of per-round
        # debug lines nobody reads (its results hold the same facts)
        quiet = ["--quiet", "--events-level", "info"]
        return [*cli, *quiet, "--out", str(out), *sets, *only, *reuse]


def _reusable(folder: Path) -> bool:
    """A run's folder whose results this code may take: written, and by this code (results
    made by other code run again, as ``--reuse`` would refuse them; older ones carry no stamp)."""
    try:
        check_same_code(load_results(folder), str(folder), "--reuse")
    except FoltrError:
        return False
    return True


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
        unknown = set(entry) - {"name", "file", "clicks", "set", "only", "reuse", "read_at"}
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
        reuse = entry.get("reuse", [])
        if not isinstance(reuse, list) or not all(isinstance(v, str) and v for v in reuse):
            fail(f"{where}: reuse must be a list of the plan's run names")
        read_at = entry.get("read_at", [])
        if not isinstance(read_at, list) or not all(
            isinstance(v, str) and "=" in v and "@" in v for v in read_at
        ):
            fail(f'{where}: read_at must be a list of "NAME=VARIANT@ROUND" strings')
        stem = str(entry.get("name", file.stem))
        if not stem or not stem.isprintable() or any(c in stem for c in "/\\"):
            fail(f"{where}: name must name one folder (no '/')")
        for click in clicks:
            name = stem if click is None else f"{stem}-{click}"
            extra = () if click is None else (f"clicks.model={click}",)
            sources = tuple(r if click is None else f"{r}-{click}" for r in reuse)
            runs.append(Run(name, file, (*extra, *sets), tuple(only), sources, tuple(read_at)))
    names = [r.name for r in runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"{path}: run {twice[0]!r} is planned twice")
    for run in runs:
        unknown = [r for r in run.reuse if r not in names]
        if unknown:
            fail(f"{path}: run {run.name!r}: reuse names {unknown[0]!r}, not a run of the plan")
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


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


@dataclass
class Started:
    """A run whose command is going: its process, log file and what was known at its start."""

    run: Run
    proc: subprocess.Popen
    log: BinaryIO
    record: dict
    start: float


def start(run: Run, out: Path, jobs: int, extra: list[str], n_threads: int) -> Started:
    """One run through the command line (its kernel on ``n_threads`` threads per process), its
    output to a log file."""
    cmd = run.command(out / run.name, jobs, extra)
    record = {
        "run": run.name,
        "command": " ".join(["python", *cmd[1:]]),
        "threads": n_threads,
        "load_start": load_average(),
    }
    log = open(out / f"{run.name}.log", "wb")  # noqa: SIM115 (closed when the run ends)
    env = {**os.environ, threads.ENV: str(n_threads)}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
    )
    return Started(run, proc, log, record, time.monotonic())


def wait_any(going: dict[int, Started], out: Path) -> Started:
    """Wait for one of the runs to end; its wall time and CPU time (``wait4``'s usage of that
    process and the workers it waited for, so runs going at once are told apart) to
    ``runs.jsonl``."""
    pid, status, usage = os.wait4(-1, 0)
    while pid not in going:  # not ours (nothing else runs children here; be safe)
        pid, status, usage = os.wait4(-1, 0)
    done = going.pop(pid)
    done.proc.returncode = os.waitstatus_to_exitcode(status)
    done.log.close()
    done.record.update(
        exit_code=done.proc.returncode,
        wall_s=round(time.monotonic() - done.start, 1),
        cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
        load_end=load_average(),
    )
    with open(out / "runs.jsonl", "a") as fh:
        fh.write(json.dumps(done.record) + "\n")
    return done


def longest_first(runs: list[Run], out: Path) -> list[Run]:
    """The runs by the CPU time their last record in ``runs.jsonl`` took, most first; runs
    without one after those, in the plan's order (a stable sort)."""
    cost = {name: rec.get("cpu_s", 0.0) for name, rec in last_records(out).items()}
    return sorted(runs, key=lambda r: (r.name not in cost, -cost.get(r.name, 0.0)))


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
        read_at = [a for spec in run.read_at for a in ("--read-at", spec)]
        table = subprocess.run(
            [sys.executable, str(TABLE), str(folder), "--conclusions", *read_at],
            capture_output=True,
            text=True,
        )
        parts += [table.stdout.strip() or f"(no table: {table.stderr.strip()})", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(parts))
    return path


def record(run: Run, out: Path, folder: Path) -> None:
    """The run's record of results (reproduce/claims/records/NAME.json.gz), with its cost from
    ``runs.jsonl``."""
    cost = last_records(out).get(run.name, {})
    try:
        rec = make_record(
            load_results(out / run.name),
            run.name,
            f"python tools/reproduce_all.py --jobs 2 --only {run.name} --record",
            cost={k: cost[k] for k in ("wall_s", "cpu_s", "threads") if k in cost},
        )
    except FoltrError as e:
        print(f"  not recorded: {e}", flush=True)
        return
    print(f"  recorded: {write_record(rec, folder)}", flush=True)


def check(runs: list[Run], out: Path, folder: Path, args, n_threads: int, going: dict) -> int:
    """Check the stale records of ``runs`` (see the module): 1 when a re-run differs or
    fails, else 0."""
    records = load_records(folder)
    out.mkdir(parents=True, exist_ok=True)
    todo, bad, where = [], [], {}
    for run in runs:
        rec = records.get(run.name)
        if rec is None:
            print(f"{run.name}: no record to check (make it with --record)", flush=True)
        elif not rec.stale:
            print(f"{run.name}: its record is current, nothing to check", flush=True)
        else:
            todo.append(run)
    while todo or going:
        while todo and len(going) < args.runs:
            run = todo.pop(0)
            fold, seed = sample_of(records[run.name].data)
            extra = [f"scenario.seed={seed}", "scenario.repeats=1"]
            extra += [] if fold is None else [f"dataset.folds=[{fold}]"]
            shutil.rmtree(out / run.name, ignore_errors=True)  # a check's re-run, not a result
            print(f"{run.name}: re-running {repeat_name(fold, seed)} of every variant", flush=True)
            started = start(dataclasses.replace(run, reuse=()), out, args.jobs, extra, n_threads)
            going[started.proc.pid] = started
            where[run.name] = fold, seed
        done = wait_any(going, out)
        name, cost = done.run.name, done.record
        fold, seed = where[name]
        again = f"record it again: python tools/reproduce_all.py --only {name} --record"
        if cost["exit_code"] != 0 or not finished(out / name):
            print(f"{name}: the re-run FAILED (see {out / name}.log); {again}", flush=True)
            bad.append(name)
            continue
        rec = records[name].data
        sample = load_results(out / name)
        n = sum(len(v["repeats"]) for v in sample["variants"].values())
        total = sum(len(v) for v in rec["variants"].values())
        how = f"{repeat_name(fold, seed)} of every variant: {n} of the {total} repeats"
        costs = {k: cost[k] for k in ("wall_s", "cpu_s", "threads")}
        try:
            write_record(checked_record(rec, sample, how, costs), folder)
        except FoltrError as e:
            print(f"{name}: {e}; {again}", flush=True)
            bad.append(name)
            continue
        print(f"{name}: checked, {how} equal (CPU {cost['cpu_s']} s)", flush=True)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan-file", type=Path, default=TOOLS / "reproduce_plan.toml")
    ap.add_argument("--out", type=Path, default=Path("results/reproduce"))
    ap.add_argument("--jobs", type=int, default=1, help="processes per run (--jobs of each run)")
    ap.add_argument("--runs", type=int, default=1, help="runs going at once, longest first")
    ap.add_argument("--only", action="append", default=[], help="runs whose name starts so")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every run, e.g. federation.rounds=20 for a dry pass",
    )
    ap.add_argument("--plan", action="store_true", help="print the runs and stop")
    ap.add_argument(
        "--record",
        type=Path,
        nargs="?",
        const=RECORDS,
        metavar="FOLDER",
        help="write each finished run's record of results (default reproduce/claims/records)",
    )
    ap.add_argument(
        "--check",
        type=Path,
        nargs="?",
        const=RECORDS,
        metavar="FOLDER",
        help="re-run one repeat of every variant of each stale record's run with this code; "
        "equal to the record, mark it checked (default reproduce/claims/records)",
    )
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.runs < 1:
        ap.error("--jobs and --runs must be at least 1")
    if args.record and args.set:
        ap.error("--record keeps results of record: not with --set, which departs from the plan")
    if args.check and (args.set or args.record):
        ap.error("--check re-runs what the records hold: not with --set or --record")
    plan = runs = load_plan(args.plan_file)
    if args.only:
        runs = [r for r in plan if any(r.name.startswith(o) for o in args.only)]
        if not runs:
            fail(f"--only {args.only}: no run of the plan starts so")
    if args.plan:
        width = max(len(run.name) for run in runs)
        for run in runs:
            done = finished(args.out / run.name)
            cmd = " ".join(run.command(args.out / run.name, args.jobs, args.set)[1:])
            print(f"{run.name:{width}}  {'done  ' if done else 'to run'}  python {cmd}")
        return 0
    try:  # the processes going at once share the cores (results never depend on it; the CPU
        # does: on 2 cores beside two other runs a 10-client round took 1.55 CPU ms with 2
        # kernel threads and 1.16 with one)
        n_threads = threads.per_process(args.runs * args.jobs)
    except FoltrError as e:
        fail(str(e))
    going: dict[int, Started] = {}
    try:
        if args.check:
            return check(runs, args.out / "check", args.check, args, n_threads, going)
        return play(runs, plan, args, n_threads, going)
    except KeyboardInterrupt:
        return interrupted(going)


def interrupted(going: dict[int, Started]) -> int:
    """Ctrl-C: each run going gets it too (and keeps the repeats it finished); wait for them
    to stop, so none is left running, then say how to resume."""
    for started in going.values():
        if started.proc.poll() is None:
            started.proc.send_signal(signal.SIGINT)
    for started in going.values():
        try:
            started.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            started.proc.kill()
            started.proc.wait()
    names = ", ".join(s.run.name for s in going.values()) or "none"
    print(f"interrupted: runs stopped ({names}); run the same command again to resume", flush=True)
    return 130


def play(runs: list[Run], plan: list[Run], args, n_threads: int, going: dict) -> int:
    """Run ``runs`` (``args.runs`` at once), record them when asked, write the plan's report."""
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    order = longest_first(runs, args.out) if args.runs > 1 else runs
    heads = {run.name: f"[{i}/{len(runs)}] {run.name}" for i, run in enumerate(order, 1)}
    todo = list(order)
    while todo or going:
        while todo and len(going) < args.runs:
            run = todo.pop(0)
            folder, head = args.out / run.name, heads[run.name]
            if finished(folder):
                print(f"{head}: done before, skipped", flush=True)
                if args.record:
                    record(run, args.out, args.record)
                continue
            if folder.exists():
                print(f"{head}: an unfinished folder kept as {set_aside(folder).name}", flush=True)
            print(f"{head}: running (log {args.out / (run.name + '.log')})", flush=True)
            started = start(run, args.out, args.jobs, args.set, n_threads)
            going[started.proc.pid] = started
        if not going:
            continue
        done = wait_any(going, args.out)
        rec = done.record
        if rec["exit_code"] != 0:
            failed.append(done.run.name)
        status = "ok" if rec["exit_code"] == 0 else f"FAILED (exit {rec['exit_code']})"
        print(
            f"{heads[done.run.name]}: {status}, wall {rec['wall_s']} s, CPU {rec['cpu_s']} s",
            flush=True,
        )
        if args.record and finished(args.out / done.run.name):
            record(done.run, args.out, args.record)
    report = write_report(args.out, plan)  # every finished run of the plan, not only these
    print(f"report: {report}")
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)} (see their .log)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

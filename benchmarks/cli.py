"""``python -m foltr_async bench``: run the suites, check the targets, print a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from foltr_async.benchmarks.costs import bench_csfltr, bench_secagg
from foltr_async.benchmarks.footprint import (
    bench_memory,
    bench_startup,
    memory_child,
    startup_child,
)
from foltr_async.benchmarks.measure import (
    FULL,
    QUICK,
    ROOT,
    Sizes,
    check_data,
    progress,
    quiet_logs,
    resolve_data,
)
from foltr_async.benchmarks.parse import bench_parse
from foltr_async.benchmarks.report import TARGETS, compare, load_reference, render
from foltr_async.benchmarks.rounds import bench_foltr_es, bench_fpdgd
from foltr_async.benchmarks.transport import bench_bus, bench_zmq, zmq_sender
from foltr_async.errors import FoltrError
from foltr_async.ltr.threads import facts as kernel_facts
from foltr_async.provenance import code_stamp, git

SUITES = ("fpdgd", "foltr_es", "bus", "startup", "memory", "zmq", "parse", "secagg", "csfltr")


def child_main(spec_json: str) -> None:
    """Entry point of the bench's child processes: one JSON line on stdout."""
    spec = json.loads(spec_json)
    quiet_logs()
    task = {"startup": startup_child, "memory": memory_child, "zmq_send": zmq_sender}
    print(json.dumps(task[spec["task"]](spec)), flush=True)


def _meta(quick: bool, scale: float) -> dict:
    # Code that differs from the commit (edited or not yet added) changes what was measured.
    stamp = code_stamp()
    status = git(ROOT, "status", "--porcelain", "--", "foltr_async", "protocols", "benchmarks")
    changed = [line[3:] for line in (status or "").splitlines() if line.endswith(".py")]
    return {
        "commit": stamp.get("commit"),
        "source": stamp["source"],  # the simulator's code, as results.json's code.source
        "dirty": bool(changed) if status is not None else None,
        "local_changes": changed,
        "python": stamp["python"],
        "numpy": stamp["numpy"],
        "cores": os.cpu_count(),
        "machine": f"{platform.system()} {platform.machine()}",
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "kernel": kernel_facts(),
        "load_average": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
        "quick": quick,
        "scale": scale,
    }


def _thread_counts(value: str | None) -> list[int]:
    """``--threads`` as a list of counts; sets the largest for this process and the ones the
    suites start (or checks FOLTR_ASYNC_THREADS when not given)."""
    from foltr_async.ltr.threads import set_threads, threads

    if value is None:
        threads()  # a bad FOLTR_ASYNC_THREADS fails here
        return []
    counts = []
    for part in value.split(","):
        set_threads(part.strip())  # one line naming --threads for anything but a count >= 1
        counts.append(threads())
    set_threads(max(counts), children=True)
    return counts


def run_suites(
    suites: list[str],
    sizes: Sizes,
    *,
    data: Path | None = None,
    seed: int = 0,
    profile: bool = False,
    threads: Sequence[int] = (),
) -> dict[str, Any]:
    """Run the named suites; a suite that fails is reported as ``{"error": ...}``.

    ``threads``: the PDGD kernel alone is timed at each count (fpdgd suite); the suites run at
    the thread count in force.

    fpdgd, foltr_es and parse use ``data`` when given; start-up and memory always measure the
    embedded dataset (what a user gets without any files).
    """
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="foltr-bench-") as tmp:
        workdir = Path(tmp)
        src, embedded = resolve_data(data, seed), resolve_data(None, seed)
        runners: dict[str, Callable[[], dict]] = {
            "fpdgd": lambda: bench_fpdgd(src, sizes, seed, profile, threads),
            "foltr_es": lambda: bench_foltr_es(src, sizes, seed, profile),
            "bus": lambda: bench_bus(sizes, seed),
            "startup": lambda: bench_startup(embedded, seed, workdir),
            "memory": lambda: bench_memory(embedded, sizes, seed),
            "zmq": lambda: bench_zmq(sizes, seed),
            "parse": lambda: bench_parse(
                sizes, seed, workdir, None if data is None else check_data(data)
            ),
            "secagg": lambda: bench_secagg(sizes, seed),
            "csfltr": lambda: bench_csfltr(sizes, seed),
        }
        for name in suites:
            t0 = time.perf_counter()
            try:
                results.update(runners[name]())
            except FoltrError:
                raise
            except Exception as e:  # one broken suite must not hide the others' numbers
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                progress(f"{name}: FAILED: {type(e).__name__}: {e}")
            progress(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    results["checks"] = [
        {
            "metric": f"{c.suite}.{c.key}",
            "label": c.label,
            "value": results[c.suite][c.key],
            "target": f"{c.op} {c.limit:g}",
            "ok": c.ok(results[c.suite][c.key]),
        }
        for c in TARGETS
        if c.suite in results and c.key in results[c.suite]
    ]
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async bench",
        description="Measure simulator speed and memory against the project's targets.",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    p.add_argument(
        "--data",
        type=Path,
        metavar="LETOR_FILE_OR_FOLD_DIR",
        help="a LETOR training file (test.txt beside it) or fold directory for the "
        "fpdgd / foltr_es / parse suites (default: the embedded mslr-like profile)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--suite",
        action="append",
        choices=SUITES,
        metavar="NAME",
        help=f"run only these suites (repeatable): {', '.join(SUITES)}",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every count (clients, messages, lines) by this factor",
    )
    p.add_argument(
        "--clients",
        type=int,
        help="clients of the fpdgd, foltr_es and bus suites (e.g. 62500; default 1000 / 2000)",
    )
    p.add_argument(
        "--interactions",
        type=int,
        help="interactions in FPDGD's timed rounds (e.g. 1000000; rounded up to whole rounds)",
    )
    p.add_argument(
        "--reference",
        type=Path,
        metavar="FILE.json",
        help="recorded figures of another implementation (e.g. the authors' code) to print "
        "next to this run's, with the ratio",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the runs")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a measured metric misses its target (default: FAIL is only shown)",
    )
    p.add_argument(
        "--threads",
        metavar="N[,N...]",
        help="threads of the compiled PDGD kernel: the suites run at the largest count, and the "
        "kernel alone is timed at each (a scaling table; default: FOLTR_ASYNC_THREADS, else "
        "the cores this process may use)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile the timed FPDGD and FOLtR-ES rounds (top functions in the output)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 0 when every suite ran, 1 when one failed (or, with ``--check``, a
    metric missed its target), 2 on bad input."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error
        return int(e.code or 0)
    for name in ("scale", "clients", "interactions"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            print(f"error: --{name} must be > 0", file=sys.stderr)
            return 2
    try:
        threads = _thread_counts(args.threads)
    except FoltrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quiet_logs()
    suites = list(dict.fromkeys(args.suite or SUITES))
    sizes = (QUICK if args.quick else FULL).scaled(args.scale)
    sizes = sizes.at_scale(args.clients, args.interactions)
    try:
        if args.data is not None:
            check_data(args.data)
        reference = None if args.reference is None else load_reference(args.reference)
        progress(f"{'quick' if args.quick else 'full'} run of {', '.join(suites)}")
        results = {"meta": _meta(args.quick, args.scale)}
        results.update(
            run_suites(
                suites,
                sizes,
                data=args.data,
                seed=args.seed,
                profile=args.profile,
                threads=threads,
            )
        )
        if reference is not None:
            results["reference"] = {
                "name": str(reference.get("name", args.reference.name)),
                "rows": compare(results, reference),
            }
    except FoltrError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(results, indent=2, default=float))
    else:
        render(results)
    missed = [c["metric"] for c in results["checks"] if not c["ok"]]
    if args.check and missed:
        print(
            f"error: --check: {len(missed)} target{'s' if len(missed) > 1 else ''} missed: "
            + ", ".join(missed),
            file=sys.stderr,
        )
        return 1
    return 1 if any(isinstance(v, dict) and "error" in v for v in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Command line: ``python -m foltr_async SCENARIO.toml [...]`` and its helper commands.

Exit codes: 0 success; 1 internal error (traceback saved to error.log in the output folder);
2 bad input (scenario, dataset, arguments), one line on stderr; 3 the run finished but measured
nothing meaningful: a variant learned nothing (no round took in a client update) or measured
nothing (no held-out query has a relevant document), or in a distributed run no honest client
took part (results are kept); 130 interrupted (results written so far are kept).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from foltr_async import __version__
from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.outdir import lock, new_folder, refuse_taken, release_locks

#: exit code of a finished run in which some variant learned or measured nothing
NO_RESULT = 3
COMMANDS = (
    "run",
    "new",
    "validate",
    "list",
    "dataset",
    "traces",
    "bench",
    "serve",
    "join",
    "keys",
    "merge",
    "claims",
    "audit",
)


def _refuse_unaudited(scenario) -> None:
    """``audit``: every variant runs an auditor (which refuses a run without its canary)."""
    for name, cfg in scenario.variants.items():
        if not any(g.behaviour == "auditor" for g in cfg.agents):
            raise FoltrError(
                f"{scenario.path}: variant {name!r}: expected an [[agents]] group with behaviour "
                "'auditor', and its canaries (docs/PROTOCOLS.md, Privacy auditing)"
            )


def _run_parser(serve: bool = False, audit: bool = False) -> argparse.ArgumentParser:
    if audit:
        p = argparse.ArgumentParser(
            prog="python -m foltr_async audit",
            description="Run a scenario whose variants have canaries and auditors and print "
            "each mechanism's empirical epsilon lower bound beside its claimed epsilon.",
        )
    elif serve:
        p = argparse.ArgumentParser(
            prog="python -m foltr_async serve",
            description="Run a scenario's server side; workers host the clients "
            "(python -m foltr_async join ...).",
        )
    else:
        p = argparse.ArgumentParser(
            prog="python -m foltr_async",
            description="Run a federated online learning-to-rank scenario. Other commands: "
            "audit SCENARIO, new NAME --protocol P, validate SCENARIO, list, dataset "
            "make|check, traces import, bench, serve, join, keys, merge, claims.",
        )
    p.add_argument("scenario", type=Path, help="scenario TOML file")
    p.add_argument("--version", action="version", version=f"foltr-async {__version__}")
    p.add_argument(
        "--out",
        type=Path,
        help="output folder, new or empty (default results/<name>/<time>/, with -2, -3, ... "
        "when a run started in the same second has it)",
    )
    p.add_argument("--seed", type=int, help="override scenario.seed")
    _add_set(p, "override a scenario value for every variant, e.g. federation.rounds=50")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="VARIANT",
        help="run only these variants (repeatable)",
    )
    if serve:
        p.add_argument(
            "--bind",
            required=True,
            metavar="ENDPOINT",
            help="where workers connect, e.g. tcp://*:5555",
        )
        p.add_argument(
            "--keys",
            type=Path,
            metavar="DIR",
            help="key folder (python -m foltr_async keys init): server.key_secret and "
            "the authorised worker keys in authorized/",
        )
        p.add_argument(
            "--max-empty-rounds",
            type=int,
            default=3,
            metavar="N",
            help="stop the run (exit 3, results so far kept) after N rounds in a row with no "
            "client online to ask (no worker hosts them; default 3); such rounds end at once",
        )
    else:
        p.add_argument(
            "--transport",
            choices=("memory", "zmq"),
            default="memory",
            help="memory: one process, virtual time; zmq: the server here and "
            "--workers local worker processes, real time",
        )
        p.add_argument(
            "--workers",
            type=int,
            default=None,
            metavar="N",
            help="zmq: worker processes to start (default 2)",
        )
        p.add_argument(
            "--bind",
            default="tcp://127.0.0.1:0",
            metavar="ENDPOINT",
            help="zmq: the hub's address (default: a free loopback port)",
        )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="zmq: plaintext, no authentication (default: CURVE keys)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="zmq: seconds to wait for every client's worker before round 1",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="zmq: a worker silent this long counts as lost (its clients crash)",
    )
    if not serve:
        _add_parallel(p)
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--json-logs", action="store_true", help="machine-readable log lines")
    p.add_argument(
        "--events-level",
        default="debug",
        choices=("debug", "info", "warning", "error"),
        help="lowest level written to OUT/events.jsonl (default debug: every round's "
        "aggregation and every dropped message; info leaves those out, for long runs of small "
        "federations)",
    )
    p.add_argument(
        "--track",
        action="append",
        default=[],
        choices=("mlflow", "tensorboard"),
        help="also export every repeat to MLflow (OUT/mlflow.db) or TensorBoard (OUT/tensorboard); "
        "needs the tracking extra",
    )
    p.add_argument(
        "--mlflow-uri",
        metavar="URI",
        help="MLflow tracking URI (default: sqlite:///OUT/mlflow.db)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="write OUT/checkpoint.pkl every K rounds (and after every repeat)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the interrupted run whose output folder is DIR",
    )
    p.add_argument(
        "--reuse",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="take the repeats an earlier run (any scenario, this code and data) finished with "
        "the same settings, seed and fold from its output folder DIR instead of running them "
        "again",
    )
    _add_threads(
        p,
        "the cores this process may use, shared among --jobs processes or --workers workers",
    )
    return p


def _add_parallel(p: argparse.ArgumentParser) -> None:
    """``--jobs`` / ``--executor``: repeats of the memory transport in parallel."""
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run N (variant, repeat) jobs at once in local processes (same results as 1)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="ray: fan the jobs out over a Ray cluster (RAY_ADDRESS, else a local Ray with "
        "--jobs CPUs; pip install 'foltr-async[ray]')",
    )


def _check_parallel(args: argparse.Namespace) -> None:
    """``--jobs`` and ``--executor`` as given, before anything is read or written: a run
    refused here leaves no output folder, so the same command can be given again."""
    if args.jobs < 1:
        raise FoltrError(f"--jobs: expected an integer >= 1, got {args.jobs}")
    if args.executor == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise FoltrError(
                "--executor ray: Ray is not installed (pip install 'foltr-async[ray]')"
            )


def _add_threads(p: argparse.ArgumentParser, default: str) -> None:
    """The ``--threads N`` option of the commands that train FPDGD clients."""
    p.add_argument(
        "--threads",
        metavar="N",
        help="threads of the compiled PDGD kernel per process (default: the "
        f"FOLTR_ASYNC_THREADS environment variable, else {default}); results do not depend on it",
    )


def _apply_threads(value: str | None, processes: int = 1) -> None:
    """``--threads`` for this process and the ones it starts; without it, ``processes`` local
    processes share the cores. A bad value (or FOLTR_ASYNC_THREADS) fails here in one line."""
    from foltr_async.ltr.threads import per_process, set_threads, threads

    if value is not None:
        set_threads(value, children=True)
    elif processes > 1:
        set_threads(per_process(processes), children=True)
    threads()


def _add_set(p: argparse.ArgumentParser, help: str) -> None:
    """The repeatable ``--set key.path=value`` option every scenario command takes."""
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


@contextmanager
def _sigterm_as_ctrl_c():
    """A SIGTERM (``kill``'s default, a batch scheduler's stop) ends a run as Ctrl-C does:
    ``--jobs`` workers are stopped rather than left computing, and what was written is kept.
    Python's default SIGTERM ends the process without that cleanup.

    While an event loop runs (a run in this process), the interrupt is raised from a loop
    callback rather than inside whichever agent's task the signal happened to land in: a task
    that ends with KeyboardInterrupt keeps it as an exception nobody retrieves, which asyncio
    prints as a traceback when the task is collected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise KeyboardInterrupt from None
        loop.call_soon_threadsafe(_raise_interrupt)

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        release_locks()  # the command is done with its output folder


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            cmd, rest = argv[0], argv[1:]
            if cmd == "run":
                return _cmd_run(rest)
            if cmd == "serve":
                return _cmd_run(rest, serve=True)
            if cmd == "audit":
                return _cmd_run(rest, audit=True)
            return {
                "new": _cmd_new,
                "validate": _cmd_validate,
                "list": _cmd_list,
                "dataset": _cmd_dataset,
                "traces": _cmd_traces,
                "bench": _cmd_bench,
                "join": _cmd_join,
                "keys": _cmd_keys,
                "merge": _cmd_merge,
                "claims": _cmd_claims,
            }[cmd](rest)
        return _cmd_run(argv)
    except FoltrError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: results written so far are kept", file=sys.stderr)
        return 130


def _cmd_run(argv: list[str], serve: bool = False, audit: bool = False) -> int:
    args = _run_parser(serve, audit).parse_args(argv)
    if not serve:
        _check_parallel(args)
    if serve:
        _apply_threads(args.threads)
    else:
        _apply_threads(args.threads, (args.workers or 2) if args.transport == "zmq" else args.jobs)
    # what a bad input needs, first: its one line does not wait for the results writer's
    # statistics, the plots or the compiled kernel (scipy, matplotlib, numba)
    from foltr_async.scenario.load import load_scenario

    scenario = load_scenario(args.scenario, args.sets, seed=args.seed, only=args.only)
    if audit:
        _refuse_unaudited(scenario)
    from foltr_async.preflight import check_scenario

    if args.checkpoint_every < 0:
        raise FoltrError(
            f"--checkpoint-every: expected an integer >= 0, got {args.checkpoint_every}"
        )
    zmq = serve or args.transport == "zmq"
    if not zmq and args.workers is not None:
        raise FoltrError("--workers: only with --transport zmq")
    check_scenario(scenario)  # bad input fails here, before an output folder exists
    jobs, executor = (1, "local") if serve else (args.jobs, args.executor)
    if zmq and (jobs != 1 or executor != "local"):
        raise FoltrError("--jobs / --executor: only with the memory transport")
    from foltr_async.experiment import reused_repeats, run_scenario
    from foltr_async.observe.console import make_reporter
    from foltr_async.observe.log import configure_logging

    reused = reused_repeats(scenario, args.reuse) if args.reuse else None
    out = _out_dir(args, scenario)
    live = not args.quiet and sys.stdout.isatty()
    configure_logging(
        events_path=out / "events.jsonl",
        json_logs=args.json_logs,
        console=live,
        events_level=args.events_level,
    )
    reporter = make_reporter(quiet=not live)
    if args.mlflow_uri is not None and "mlflow" not in args.track:
        raise FoltrError("--mlflow-uri: only with --track mlflow")
    if args.track:
        from foltr_async.observe.observer import Observers
        from foltr_async.observe.tracking import make_trackers

        trackers = make_trackers(args.track, out, scenario.settings(), args.mlflow_uri)
        reporter = Observers([reporter, *trackers])
    remote = _zmq_server(args, scenario, serve, out) if zmq else None
    try:
        with _sigterm_as_ctrl_c(), reporter if hasattr(reporter, "__enter__") else _nullcontext():
            results = run_scenario(
                scenario,
                out,
                reporter,
                checkpoint_every=args.checkpoint_every,
                resume=args.resume is not None,
                remote=remote,
                jobs=jobs,
                executor=executor,
                reused=reused,
            )
    except FoltrError:
        raise
    except KeyboardInterrupt:
        raise
    except OSError as e:
        if e.errno not in _NO_ROOM:
            return _internal_error(e, out)
        where = e.filename or out
        raise FoltrError(
            f"cannot write {where}: {e.strerror}; free space there or give another --out"
        ) from None
    except Exception as e:  # a bug, not bad input: say so in one line, keep the details
        return _internal_error(e, out)
    print(f"results: {out}")
    for line in results.get("conclusions", []):
        print(f"  {line}")
    from foltr_async.observe.audit import audit_lines

    for line in audit_lines(results.get("audit") or {}):
        print(f"  {line}")
    from foltr_async.observe.results import not_as_asked

    variants = results.get("variants") or {}
    for name, entry in variants.items():
        for rep in entry["repeats"]:
            t = rep.get("transport") or {}
            hostile = {**t.get("frames_dropped", {})}
            if t.get("refused_handshakes"):
                hostile["refused_handshakes"] = t["refused_handshakes"]
            if hostile:
                counts = ", ".join(f"{k} {v}" for k, v in sorted(hostile.items()))
                print(f"  {name} repeat {rep.get('repeat')}: at the hub: {counts}")
    idle_stops = [
        f"{name} repeat {rep.get('repeat')} at round {rep['transport']['stopped_idle_at']}"
        for name, entry in variants.items()
        for rep in entry["repeats"]
        if (rep.get("transport") or {}).get("stopped_idle_at") is not None
    ]
    if idle_stops:
        print(
            f"error: stopped ({'; '.join(idle_stops)}): "
            f"{getattr(args, 'max_empty_rounds', 3)} rounds in a row "
            f"had no client online, no worker hosts them (--max-empty-rounds; results kept in "
            f"{out})",
            file=sys.stderr,
        )
    unmet = not_as_asked(variants)
    for line in unmet["lines"]:
        print(f"warning: {line}", file=sys.stderr)
    idle, unmeasured = results.get("nothing_learned"), results.get("nothing_measured")
    if idle:
        print(
            f"error: nothing was learned in {', '.join(idle)}: no client update reached the "
            f"model in any round (results kept in {out})",
            file=sys.stderr,
        )
    if unmeasured:
        print(
            f"error: nothing was measured in {', '.join(unmeasured)}: no held-out query has a "
            f"relevant document, so {results.get('metric')} is undefined (results kept in {out})",
            file=sys.stderr,
        )
    if unmet["no_clients"]:
        print(
            f"error: no honest client took part in {', '.join(unmet['no_clients'])}: no worker "
            f"hosted them, so nothing was measured (results kept in {out})",
            file=sys.stderr,
        )
    return NO_RESULT if idle or unmeasured or unmet["no_clients"] or idle_stops else 0


#: write errors that say the folder has no room (full disk, quota, read-only), not a bug
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _internal_error(e: BaseException, out: Path) -> int:
    """A bug, not bad input: one line, the traceback in OUT/error.log when it can be written."""
    try:
        (out / "error.log").write_text(traceback.format_exc())
        kept = f" (traceback in {out / 'error.log'})"
    except OSError as log_error:
        kept = f" (no traceback kept: {out / 'error.log'}: {log_error.strerror})"
    print(f"internal error: {type(e).__name__}: {e}{kept}", file=sys.stderr)
    return 1


def _zmq_server(args: argparse.Namespace, scenario, serve: bool, out: Path):
    """The server side of a zmq run: bound as asked (serve) or with local workers (run)."""
    from foltr_async.distributed.control import wire_limits
    from foltr_async.distributed.launcher import LocalWorkers
    from foltr_async.distributed.server import ZmqServer
    from foltr_async.runtime.zmq_keys import load_server_keys

    replayed = [name for name, cfg in scenario.variants.items() if cfg.dataset.replayed]
    if replayed:  # its clients' queries arrive by the one run's simulated clock
        raise ScenarioError(
            f"{scenario.where(replayed[0])}: dataset.format: 'aol4foltr' replays its log in "
            "simulated time: expected an in-memory run, not a ZeroMQ one"
        )
    common = {"join_timeout": args.join_timeout, "heartbeat_timeout": args.heartbeat_timeout}
    if serve:
        if args.keys is None and not args.insecure:
            raise FoltrError(
                "serve: give --keys DIR (python -m foltr_async keys init DIR), or "
                "--insecure for plaintext without authentication"
            )
        keys = None if args.insecure else load_server_keys(args.keys)
        if args.max_empty_rounds < 1:
            raise FoltrError(
                f"--max-empty-rounds: expected an integer >= 1, got {args.max_empty_rounds}"
            )
        return ZmqServer(
            args.bind,
            keys=keys,
            limits=wire_limits(scenario),
            max_empty_rounds=args.max_empty_rounds,
            **common,
        )
    scenario_args = [str(args.scenario)]
    for flag, values in (("--set", args.sets), ("--only", args.only)):
        scenario_args += [a for v in values for a in (flag, v)]
    if args.seed is not None:
        scenario_args += ["--seed", str(args.seed)]
    workers = LocalWorkers(
        scenario,
        scenario_args,
        2 if args.workers is None else args.workers,
        out / "workers",
        insecure=args.insecure,
    )
    return ZmqServer(
        args.bind,
        keys=workers.server_keys(),
        launch=workers.launch,
        stop=workers.stop,
        check=workers.check,
        limits=wire_limits(scenario),
        **common,
    )


def _out_dir(args: argparse.Namespace, scenario) -> Path:
    """The output folder: --out, the resumed run's folder, or results/<name>/<time>/. A
    resumed folder's checkpoint is read first: a refused one leaves the folder as it was."""
    from foltr_async.experiment import Checkpoints

    name = scenario.name
    if args.resume is not None:
        out = args.resume
        if args.out is not None and args.out.resolve() != out.resolve():
            raise FoltrError("--resume DIR writes into DIR; leave out --out (or give the same)")
        if not (out / "checkpoint.pkl").is_file():
            raise FoltrError(
                f"--resume: {out}: no checkpoint.pkl (was the run started with "
                "--checkpoint-every K?)"
            )
        Checkpoints(out, scenario, resume=True)  # format, checksum, layout, configuration
        lock(out, "--resume")  # after the read-only checks: a refused one changes nothing
        for tmp in out.glob(".*.tmp"):  # half-written files of a killed run: never read
            tmp.unlink(missing_ok=True)
        events = out / "events.jsonl"
        if events.exists():  # keep the interrupted part's log beside the new one
            n = 1
            while (out / f"events.{n}.jsonl").exists():
                n += 1
            events.rename(out / f"events.{n}.jsonl")
        return out
    if args.out is None:
        out = new_folder(Path("results") / name / datetime.now().strftime("%Y%m%d-%H%M%S"))
        lock(out, "--out")
        return out
    out = args.out
    refuse_taken(out)
    try:  # create and claim it: of two runs started on it at once, one gets it
        out.mkdir(parents=True, exist_ok=True)
        (out / "events.jsonl").open("x").close()
    except FileExistsError:
        refuse_taken(out, ["events.jsonl"])
    except OSError as e:
        raise FoltrError(f"--out {out}: cannot create the folder: {e.strerror}") from None
    lock(out, "--out")
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cmd_new(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async new",
        description="Write NAME.toml: a minimal, commented scenario that runs as written "
        "(docs/SCENARIOS.md explains it).",
    )
    p.add_argument("name", help="the scenario's name (its results go to results/NAME/)")
    p.add_argument("--protocol", default="fpdgd", help="federated protocol (default fpdgd)")
    p.add_argument(
        "--out", type=Path, help="file to write (default NAME.toml here); never replaced"
    )
    args = p.parse_args(argv)
    import tomllib

    from foltr_async.plugins import load_plugins
    from foltr_async.scenario.load import validate
    from foltr_async.scenario.template import scenario_text

    text = scenario_text(args.name, args.protocol, load_plugins())
    try:  # the file as a run reads it: a name no folder can have is refused here
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise FoltrError(f"new: {args.name!r}: not usable as a scenario name") from None
    raw.pop("variants")
    validate(raw, f"new {args.name}")
    out = args.out or Path(f"{args.name}.toml")
    try:
        with open(out, "x", encoding="utf-8") as fh:
            fh.write(text)
    except FileExistsError:
        raise FoltrError(f"new: {out} exists already; nothing was replaced") from None
    except OSError as e:
        raise FoltrError(f"new: cannot write {out}: {e.strerror}") from None
    print(
        f"{out}: written; check it with: foltr-async validate {out}; run it with: foltr-async {out}"
    )
    return 0


def _cmd_validate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async validate",
        description="Check scenario files: keys, types, names, and that the data files they "
        "name are there and start in their format (nothing is built: seconds for every "
        "shipped scenario). Each file gets one line; the exit code is 2 if any failed.",
    )
    p.add_argument("scenario", type=Path, nargs="+")
    _add_set(p, "override a scenario value for every variant")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="VARIANT",
        help="check only these variants (repeatable), as a run given --only does",
    )
    p.add_argument(
        "--build",
        action="store_true",
        help="also build every variant as a run does before writing anything (datasets, "
        "protocol, attackers, timeline): every data line, enough queries for the clients",
    )
    args = p.parse_args(argv)
    from foltr_async.scenario.load import load_scenario

    if args.build:  # building may convert datasets: only warnings go to stderr, never stdout
        from foltr_async.observe.log import configure_logging

        configure_logging(events_path=None, json_logs=False, level="warning", console=False)
    failed = 0
    for path in args.scenario:
        try:
            sc = load_scenario(path, args.sets, only=args.only)
            from foltr_async.preflight import check_inputs, check_scenario

            (check_scenario if args.build else check_inputs)(sc)
        except FoltrError as e:
            if len(args.scenario) == 1:
                raise
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        n = len(sc.variants)
        variants = f"{n} variant" if n == 1 else f"{n} variants"
        print(f"{path}: ok ({variants} x {sc.repeats} repeats: {', '.join(sc.variants)})")
    if failed:
        print(f"{failed} of {len(args.scenario)} scenario files failed", file=sys.stderr)
    return 2 if failed else 0


def _cmd_merge(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async merge",
        description="One results folder from runs of one scenario made in parts (--only, later "
        "--seed, other machines): repeats pair by seed, the paired tests and Holm are over every "
        "variant.",
    )
    p.add_argument("runs", type=Path, nargs="+", help="run output folders (or results.json)")
    p.add_argument("--out", type=Path, required=True, help="output folder, new or empty")
    args = p.parse_args(argv)
    refuse_taken(args.out)
    if len(args.runs) < 2:
        raise FoltrError("merge: give at least two run folders")
    for run in args.runs:  # before the merge's imports (the statistics): a typo answers at once
        if not run.exists():
            raise FoltrError(f"{run}: no such run folder or results.json")
    from foltr_async.merge import merge_runs

    res = merge_runs(args.runs, args.out)
    seeds = sorted(
        {r["seed"] for v in res["variants"].values() for r in v["repeats"] if "seed" in r}
    )
    n = sum(len(v["repeats"]) for v in res["variants"].values())
    span = f" (seeds {seeds[0]}-{seeds[-1]})" if seeds else ""
    print(
        f"{args.out}: {len(res['variants'])} variants, {n} repeats{span}"
        f"{'' if res['complete'] else '; not complete: some planned repeats are in no part'}"
    )
    return 0


def _cmd_claims(argv: list[str]) -> int:
    from foltr_async.reproduction.command import main as claims

    return claims(argv)


def _cmd_list(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="python -m foltr_async list").parse_args(argv)
    from foltr_async.ltr.synthetic import profile_names, profile_summary
    from foltr_async.plugins import load_plugins

    reg = load_plugins()
    sections = [
        ("protocols", {n: e.help + _own_actions(e.build) for n, e in reg.protocols.items()}),
        ("aggregators", {n: e.help for n, e in reg.aggregators.items()}),
        ("behaviours", {n: f"[{e.role}] {e.help}" for n, e in reg.behaviours.items()}),
        ("dataset profiles", {n: profile_summary(n) for n in profile_names()}),
        ("scenarios", {str(p): _first_line(p) for p in sorted(Path("scenarios").glob("*.toml"))}),
    ]
    for title, items in sections:
        print(f"{title}:")
        for name, text in items.items():
            print(f"  {name:28s} {text}")
    return 0


def _own_actions(run: type) -> str:
    """A protocol's timeline actions beyond the generic ones, for ``list``."""
    return f" (timeline actions: {', '.join(sorted(run.actions))})" if run.actions else ""


def _first_line(path: Path) -> str:
    import tomllib

    try:
        return tomllib.loads(path.read_text())["scenario"].get("description", "").split("\n")[0]
    except (OSError, tomllib.TOMLDecodeError, KeyError, AttributeError):
        return "(unreadable)"


def _cmd_dataset(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m foltr_async dataset")
    sub = p.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make", help="write a synthetic profile as LETOR files")
    make.add_argument("--profile", default="mslr-like")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--queries", type=int, default=None, help="total queries (all splits)")
    check = sub.add_parser(
        "check",
        help="recognise a published collection (MQ2007/MQ2008, MSLR-WEB10K/30K, Yahoo! LTR "
        "set 1, Istella-S) as distributed, validate every line, report what runs would see",
    )
    check.add_argument(
        "path",
        type=Path,
        help="the collection's folder, one fold's folder (train.txt, test.txt, optional "
        "vali.txt) or a training file with test.txt beside it",
    )
    convert = sub.add_parser(
        "convert",
        help="convert LETOR files (or an AOL4FOLTR folder) into their memory-mapped stores now, "
        "with progress, so runs map them instead of reading the text",
    )
    convert.add_argument("paths", type=Path, nargs="+", help="LETOR files or fold folders")
    convert.add_argument(
        "--aol",
        action="store_true",
        help="the paths are AOL4FOLTR folders (metadata.csv, letor.txt)",
    )
    args = p.parse_args(argv)
    if args.action == "check":
        return _dataset_check(args.path)
    if args.action == "convert":
        return _dataset_convert(args.paths, args.aol)
    from foltr_async.ltr.synthetic import make_dataset_files

    for path in make_dataset_files(args.profile, args.out, args.seed, n_queries=args.queries):
        print(path)
    return 0


def _cmd_traces(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m foltr_async traces")
    sub = p.add_subparsers(dest="action", required=True)
    imp = sub.add_parser("import", help="convert published trace files to a network.trace file")
    fam = imp.add_subparsers(dest="family", required=True)
    fs = fam.add_parser(
        "fedscale",
        help="FedScale's client_device_capacity and client_behave_trace pickles (read as data "
        "only: a pickle that would call anything is refused)",
    )
    fs.add_argument("device", type=Path, help="client_device_capacity (pickle)")
    fs.add_argument("behaviour", type=Path, help="client_behave_trace (pickle)")
    fs.add_argument("--out", type=Path, required=True, help="trace file to write (JSON, new)")
    fs.add_argument(
        "--clients",
        type=int,
        default=None,
        metavar="N",
        help="trace clients to draw (default: the smaller table's rows); client-000j gets the "
        "j-th row of a seeded permutation of each table",
    )
    fs.add_argument("--seed", type=int, default=0, help="seed of the two permutations")
    args = p.parse_args(argv)
    from foltr_async.runtime.trace_import import import_fedscale

    f = import_fedscale(args.device, args.behaviour, args.out, clients=args.clients, seed=args.seed)
    print(
        f"{args.out}: {f['clients']} clients (seed {args.seed}): device rows {f['device_used']} "
        f"of {f['device_rows']}, behaviour rows {f['behaviour_used']} of {f['behaviour_rows']}; "
        f"over one {f['cycle_s'] / 3600:.4g} h cycle {100 * f['online_mean']:.3g}% of them "
        f"online on average, nobody online {100 * f['nobody_online']:.3g}% of the time"
    )
    return 0


#: files larger than this report their progress while ``dataset check`` reads them
PROGRESS_BYTES = 100 * 2**20


def _file_progress(verb: str):
    """``progress(file, bytes_done, size)`` for large files on stderr: a line redrawn on a
    terminal, quarters when stderr is a file."""
    tty = sys.stderr.isatty()
    shown: dict[Path, int] = {}

    def progress(file: Path, done: int, size: int) -> None:
        if size < PROGRESS_BYTES:
            return
        step = done * 4 // size
        if tty or step > shown.get(file, 0):
            shown[file] = step
            end = "\n" if done >= size or not tty else ""
            print(
                f"\r  {verb} {file}: {done / 2**20:,.0f} of {size / 2**20:,.0f} MB",
                end=end,
                file=sys.stderr,
                flush=True,
            )

    return progress


def _dataset_check(path: Path) -> int:
    """``dataset check PATH``: the report on stdout, progress of large files on stderr."""
    import time

    from foltr_async.ltr.catalog import check

    t0 = time.perf_counter()
    report = check(path, _file_progress("reading"))
    for line in report.lines():
        print(line)
    print(
        f"  checked {report.bytes / 2**20:,.1f} MB in {time.perf_counter() - t0:.1f} s "
        f"({report.parsed / 2**20:,.1f} MB parsed; the rest repeats parsed files byte for byte)"
    )
    return 0


def _dataset_convert(paths: list[Path], aol: bool) -> int:
    """``dataset convert PATH...``: each file's store, converted unless current."""
    import time

    import numpy as np

    from foltr_async.errors import DatasetError
    from foltr_async.ltr.aol import aol_files, cached_metadata, letor_store
    from foltr_async.ltr.column_store import CacheUnwritable, store_for
    from foltr_async.ltr.data import fold_files
    from foltr_async.observe.log import configure_logging

    # the progress line and the line per file say what the conversion's log events would
    configure_logging(events_path=None, json_logs=False, level="warning", console=False)
    progress = _file_progress("converting")
    files: list[Path] = []
    for p in paths:
        if aol or p.is_file():
            files.append(p)
        else:
            files.extend(f for f in fold_files(p).values() if f is not None)
    for f in files:
        t0 = time.perf_counter()
        try:
            if aol:
                meta, letor = aol_files(f)
                log = cached_metadata(meta)
                store = letor_store(letor, progress=progress)
                extra = f", {len(np.unique(log.users)):,} users"
            else:
                store = store_for(f, progress=progress)
                extra = ""
        except CacheUnwritable as exc:
            raise DatasetError(
                f"{exc.filename}: cannot write the cache folder ({exc.strerror})"
            ) from None
        mb = sum(x.stat().st_size for x in store.folder.iterdir()) / 2**20
        print(
            f"{f}: {store.n_queries:,} queries, {len(store.labels):,} documents x "
            f"{store.features.shape[1]} features{extra}; store {store.folder} ({mb:,.0f} MB), "
            f"ready in {time.perf_counter() - t0:.1f} s"
        )
    return 0


def _cmd_join(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async join",
        description="Host a group of clients for a server started with 'serve' (each loads "
        "its own data from this host; client data never travels).",
    )
    p.add_argument("scenario", type=Path, help="the server's scenario TOML file")
    p.add_argument(
        "--connect",
        required=True,
        metavar="ENDPOINT",
        help="the server's address, e.g. tcp://10.0.0.1:5555",
    )
    p.add_argument(
        "--agents",
        required=True,
        metavar="SPEC",
        help="clients to host, e.g. client-0..client-99 or client-3,client-7",
    )
    p.add_argument(
        "--keys",
        type=Path,
        metavar="DIR",
        help="key folder holding NAME.key_secret and the server's server.key",
    )
    p.add_argument("--name", default="worker-0", help="this worker's key name (default worker-0)")
    p.add_argument("--insecure", action="store_true", help="plaintext, no authentication")
    p.add_argument("--seed", type=int, help="as given to the server")
    _add_set(p, "as given to the server")
    p.add_argument(
        "--only", action="append", default=[], metavar="VARIANT", help="as given to the server"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="the server counts as lost after this much silence",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="give up when no server answers within S seconds",
    )
    p.add_argument(
        "--server-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="after losing the server, wait this long for it (or a restarted one)",
    )
    p.add_argument("--json-logs", action="store_true", help="machine-readable log lines")
    p.add_argument("--exit-with", type=int, default=None, help=argparse.SUPPRESS)
    _add_threads(p, "the cores this process may use")
    args = p.parse_args(argv)
    _apply_threads(args.threads)
    from foltr_async.scenario.load import load_scenario

    if args.keys is None and not args.insecure:
        raise FoltrError(
            "join: give --keys DIR --name NAME (python -m foltr_async keys ...), or "
            "--insecure for plaintext without authentication"
        )
    scenario = load_scenario(args.scenario, args.sets, seed=args.seed, only=args.only)
    from foltr_async.distributed.claims import parse_agents
    from foltr_async.distributed.worker import join
    from foltr_async.observe.log import configure_logging
    from foltr_async.runtime.clock import run as run_loop
    from foltr_async.runtime.zmq_keys import load_worker_keys

    claims = parse_agents(args.agents)
    keys = None if args.insecure else load_worker_keys(args.keys, args.name)
    configure_logging(events_path=None, json_logs=args.json_logs, console=False)
    run_loop(
        join(
            scenario,
            args.connect,
            claims,
            keys=keys,
            name=args.name,
            heartbeat_timeout=args.heartbeat_timeout,
            connect_timeout=args.connect_timeout,
            server_timeout=args.server_timeout,
            parent=args.exit_with,
        ),
        virtual=False,
    )
    return 0


def _cmd_keys(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foltr_async keys", description="CurveZMQ keys for serve / join"
    )
    sub = p.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="a server key pair and N authorised worker key pairs")
    init.add_argument("dir", type=Path)
    init.add_argument("--workers", type=int, default=1, metavar="N")
    add = sub.add_parser("add", help="one more authorised worker key pair")
    add.add_argument("dir", type=Path)
    add.add_argument("name")
    for sp in (init, add):
        sp.add_argument(
            "--in-work-tree",
            action="store_true",
            help="write the secret keys even inside a git work tree that does not ignore them",
        )
    args = p.parse_args(argv)
    if args.action == "init" and args.workers < 0:
        raise FoltrError(f"keys init --workers: expected an integer >= 0, got {args.workers}")
    _refuse_committable_secrets(
        args.dir / ("server.key_secret" if args.action == "init" else f"{args.name}.key_secret"),
        args.in_work_tree,
    )
    from foltr_async.runtime.zmq_keys import add_worker_key, make_keys

    if args.action == "init":
        paths = make_keys(args.dir, args.workers)
    else:
        paths = add_worker_key(args.dir, args.name)
    for path in paths:
        print(path)
    print(
        f"server host: {args.dir}/server.key_secret + authorized/; worker host: its "
        f"NAME.key_secret + server.key"
    )
    return 0


def _refuse_committable_secrets(secret: Path, allowed: bool) -> None:
    """A secret key git would pick up is refused before any key is made (or, asked for with
    --in-work-tree, written with a warning): one ``git add .`` would publish it."""
    from foltr_async.worktree import unignored_in

    root = unignored_in(secret)
    if root is None:
        return
    where = f"{secret.parent} is inside the git work tree {root}, which does not ignore it"
    if not allowed:
        raise FoltrError(
            f"keys: {where}: secret keys written there could be committed; choose a folder "
            "outside the work tree, add it to .gitignore, or give --in-work-tree"
        )
    print(f"warning: keys: {where}; keep the *.key_secret files out of commits", file=sys.stderr)


def _cmd_bench(argv: list[str]) -> int:
    # The bench drives protocols, so it lives beside the runtime, imported only when asked for.
    from foltr_async.benchmarks.cli import main as bench_main

    return bench_main(argv)

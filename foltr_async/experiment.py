"""A whole scenario: every variant for every repeat seed, reported to the observers as it goes.

Repeats are the outer loop, so an interrupted run already holds a full side-by-side comparison
for the seeds it finished. Variants of one repeat share its seed (paired comparisons).

With ``checkpoint_every = K`` the runner keeps ``checkpoint.pkl`` in the output folder: the
finished repeats and, every K rounds, the state of the one in progress. ``resume`` continues
from it: finished repeats are not run again, the interrupted one restarts after its last
checkpointed round, and the results equal those of an uninterrupted run.

``reuse`` takes finished repeats from earlier runs' results (of this or another scenario) that
this one would compute again (``reused_repeats``), so a study can share its reference arm with
another study's run instead of running it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import structlog

from foltr_async.config import recorded_data_seed
from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.executors import Executor, Parallel, Remote, Serial
from foltr_async.ltr import threads
from foltr_async.observe.log import close_logging, configure_logging
from foltr_async.observe.observer import Observer, Observers
from foltr_async.observe.results import ResultsWriter, final_value, load_results
from foltr_async.observe.stats import holm, paired_test
from foltr_async.provenance import check_same_code, code_stamp
from foltr_async.runtime.checkpoint import CheckpointError, read_checkpoint, write_atomic
from foltr_async.scenario.load import Scenario, repeat_config
from foltr_async.simulation import RunCheckpoint

METRIC = "ndcg@10"
CHECKPOINT = "checkpoint.pkl"
_FORMAT = 3  # 3: plain data with a checksum (runtime.checkpoint), no pickle


def fingerprint(scenario: Scenario) -> str:
    """What a checkpoint must match to be resumed: every resolved variant, repeats and seed."""
    text = json.dumps(
        [scenario.seed, scenario.repeats, scenario.settings()], sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()


class Checkpoints:
    """The scenario's checkpoint file: finished repeats and the latest state of the current one.

    Written atomically (``write_atomic``) at every run checkpoint and after every repeat, only
    when checkpointing is on (``every > 0``) or the run was resumed.
    """

    def __init__(
        self, out_dir: Path, scenario: Scenario, every: int = 0, resume: bool = False
    ) -> None:
        self.path = Path(out_dir) / CHECKPOINT
        self.fingerprint = fingerprint(scenario)
        if resume:
            data = read_checkpoint(self.path)
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise CheckpointError(f"{self.path}: not a checkpoint of this version")
            _check_layout(self.path, data)
            if data["fingerprint"] != self.fingerprint:
                raise CheckpointError(
                    f"{self.path}: written for another configuration (the scenario file, --set, "
                    "--seed and --only must be those of the interrupted run)"
                )
            mine = code_stamp()["source"]
            if data.get("code", mine) != mine:
                raise CheckpointError(
                    f"{self.path}: written by other code (source {data['code']}, this code "
                    f"{mine}); its finished repeats would not pair with what this code "
                    "computes: resume with the code that started it, or start again"
                )
            every = every or data["every"]
        else:
            data = {
                "format": _FORMAT,
                "fingerprint": self.fingerprint,
                "code": code_stamp()["source"],
                "done": {},
                "current": None,
            }
        self.data = data
        self.every = data["every"] = every
        self.active = every > 0 or resume

    def done(self, variant: str, repeat: int) -> dict | None:
        """The result of a repeat the checkpointed run finished."""
        return self.data["done"].get((variant, repeat))

    def run(self, variant: str, repeat: int) -> RunCheckpoint | None:
        """Checkpointing of one repeat (with its saved state when it is the interrupted one)."""
        cur = self.data["current"]
        state = cur["state"] if cur is not None and cur["run"] == (variant, repeat) else None
        if not self.active:
            return None

        def save(st: dict) -> None:
            self.data["current"] = {"run": (variant, repeat), "state": st}
            write_atomic(self.path, self.data)

        if not (self.every or state):
            return None
        return RunCheckpoint(self.every, save, state, str(self.path))

    def finished(self, variant: str, repeat: int, result: dict) -> None:
        self.data["done"][variant, repeat] = result
        self.data["current"] = None
        if self.active:
            write_atomic(self.path, self.data)


def _settings(cfg: dict) -> str:
    """What a variant's repeat computes from, besides its seed and fold, as a key: its settings
    without the scenario section (name, description, repeats, reference and seed only say
    which repeats run) and the folds list (the repeat's own fold is matched separately), but
    with the scenario seed when the data are drawn from it (a synthetic profile or AOL users
    without ``dataset.seed``)."""
    key = {k: v for k, v in cfg.items() if k != "scenario"}
    data = {k: v for k, v in cfg["dataset"].items() if k != "folds"}
    return json.dumps({**key, "dataset": {**data, "seed": recorded_data_seed(cfg)}}, sort_keys=True)


def reused_repeats(scenario: Scenario, runs: list[Path]) -> dict[tuple[str, int], dict]:
    """The repeats of ``scenario`` that the runs in ``runs`` (output folders or results.json,
    of any scenario, seed or repeat count) already finished: the same settings (``_settings``),
    the same seed and the same fold; each result says where it came from (``reused``). So a run
    of seeds 6-25 takes them from a run of seeds 1-25, and one of fold 3 from a five-fold run.
    A run made by other code is refused (``check_same_code``); that the data are the same is
    the caller's word, as for ``merge``."""
    found: dict[tuple[str, int, int | None], tuple[dict, str]] = {}
    for path in runs:
        res = load_results(path)
        check_same_code(res, str(path), "--reuse")
        for name, entry in res["variants"].items():
            cfg = (res.get("config") or {}).get(name)
            if not isinstance(cfg, dict):
                raise FoltrError(f"--reuse {path}: variant {name} has no settings recorded")
            key, where = _settings(cfg), f"{path}:{name}"
            for rep in entry.get("repeats") or []:
                if isinstance(rep.get("seed"), int):
                    found.setdefault((key, rep["seed"], rep.get("fold")), (rep, where))
    reused = {}
    for name, cfg in scenario.settings().items():
        key = _settings(cfg)
        for r in range(scenario.repeats):
            fold = scenario.folds[r % len(scenario.folds)] if scenario.folds else None
            hit = found.get((key, scenario.seed + r, fold))
            if hit is not None:
                reused[name, r] = {**hit[0], "repeat": r, "reused": hit[1]}
    return reused


def _check_layout(path: Path, data: dict) -> None:
    """The layout ``Checkpoints`` writes; the run state inside is checked as it loads."""
    cur = data.get("current")
    fields = {
        "fingerprint": type(data.get("fingerprint")) is str,
        "every": type(data.get("every")) is int and data["every"] >= 0,
        "code": data.get("code") is None or type(data["code"]) is str,  # None: older files
        "done": type(data.get("done")) is dict
        and all(
            type(k) is tuple and len(k) == 2 and type(k[0]) is str and type(k[1]) is int
            and type(v) is dict
            for k, v in data["done"].items()
        ),
        "current": cur is None
        or (
            type(cur) is dict and type(cur.get("state")) is dict
            and type(cur.get("run")) is tuple and len(cur["run"]) == 2
        ),
    }  # fmt: skip
    for key, ok in fields.items():
        if not ok:
            raise CheckpointError(f"{path}: {key}: not what this version writes there")


ALPHA = 0.05


def _nobody_online(variants: dict) -> list[str]:
    """For each variant with rounds (periods) that began with no client online: how many, and
    their share of the simulated time (means over repeats)."""
    lines = []
    for name, v in variants.items():
        c = (v.get("summary") or {}).get("contributions") or {}
        rounds = (c.get("nobody_online_rounds") or {}).get("mean")
        if not rounds:
            continue
        share = (c.get("nobody_online_share") or {}).get("mean") or 0.0
        lines.append(
            f"Nobody online at the start of {rounds:.4g} of {c['rounds']['mean']:.4g} rounds of "
            f"{name} ({100 * share:.3g}% of its simulated time; mean over "
            f"{c['nobody_online_rounds']['n']} repeats)."
        )
    return lines


def conclusions(results: dict) -> list[str]:
    """Plain sentences a reader can check against the table.

    A claim needs a test: with fewer than two paired seeds a difference is reported as a number
    and nothing more; "significant" uses the Holm-adjusted p of the scenario's comparisons.
    Every level is a variant's final value, the table's (``final_value``: the unlearned model's
    is the calibrated one). Unlearning says what share of the gap it closed only when both the
    gap and the recovery are significant (the recovery's p Holm-adjusted over the scenario's
    unlearned variants).
    """
    variants = results.get("variants", {})
    idle = results.get("nothing_learned") or {}
    lines = [
        f"Nothing was learned in {name}: in {n} of {len(variants[name]['repeats'])} repeats no "
        "client update reached the model in any round (its metric is the initial model's)."
        for name, n in idle.items()
    ]
    lines += _nobody_online(variants)
    lines += [
        f"Nothing was measured in {name}: in {n} of {len(variants[name]['repeats'])} repeats no "
        f"held-out query has a relevant document, so {METRIC} is undefined (its 0 is no result)."
        for name, n in (results.get("nothing_measured") or {}).items()
    ]
    finals = _finals(variants, METRIC, idle)
    folds = _folds(results)
    if not finals:
        return lines
    lines.append(_highest(finals, METRIC))
    ref = results.get("reference")
    unlearned = [
        _unlearning(results, name, before, ref)
        for name in finals
        for before, mark, _ in [name.partition("-unlearned")]  # "9H-1M-unlearned[-s10-n2]"
        if mark and before in finals and ref in finals
    ]
    adjusted = holm([u["recovery"][1] for u in unlearned])
    lines += [_unlearning_sentence(u, p, folds) for u, p in zip(unlearned, adjusted, strict=True)]
    for name, v in variants.items():
        reports = [r.get("privacy") or {} for r in v.get("repeats", [])]
        if reports and all(p.get("run") for p in reports):
            lines.append(_privacy_sentence(name, reports))
    for key, axis, where, span in (
        ("equal_time", "simulated time", "simulated time {:.0f} s", "{:.0f}-{:.0f} s"),
        ("equal_interactions", "user interactions", "{:,.0f} user interactions", "{:,.0f}-{:,.0f}"),
    ):
        same = results.get(key)
        if same and same.get("at") is None:
            spans = ", ".join(
                f"{name} {span.format(*lo_hi)}" for name, lo_hi in same["measured"].items()
            )
            lines.append(
                f"{METRIC} at equal {axis}: no point at which every repeat of every variant was "
                f"measured, so no comparison (measured in: {spans})."
            )
        elif same:
            at = ", ".join(
                f"{name} {s['mean']:.4f}" for name, s in same["variants"].items() if s["n"]
            )
            lines.append(f"{METRIC} at equal {where.format(same['at'])}: {at}.")
    lines += _comparison_lines(results.get("comparisons", []), folds)
    for metric, comps in (results.get("comparisons_by_metric") or {}).items():
        finals = _finals(variants, metric, idle)
        if finals:
            lines.append(_highest(finals, f"{metric} (the paper's metric)"))
        lines += _comparison_lines(comps, folds)
    return lines


def _finals(variants: dict, metric: str, idle: dict) -> dict[str, float]:
    """Each variant's mean final ``metric`` (the table's), but for those that learned nothing."""
    return {
        name: final["mean"]
        for name, v in variants.items()
        for final in [v.get("summary", {}).get("final", {}).get(metric) or {}]
        if final.get("mean") is not None and name not in idle
    }


def _highest(finals: dict[str, float], what: str) -> str:
    best = max(finals, key=finals.get)
    return f"Highest final {what}: {best} ({finals[best]:.4f})."


def _comparison_lines(comps: list[dict], folds: int) -> list[str]:
    """One sentence per comparison with the reference, significance judged by its Holm p."""
    lines = []
    for comp in comps:
        if comp.get("diff_mean") is None:
            continue
        p, holm_p = comp.get("p_value"), comp.get("p_holm", comp.get("p_value"))
        if p is None:
            test = f"n = {comp['n']}: no test"
        else:
            sig = "significant" if holm_p < ALPHA else "not significant"
            test = (
                f"paired t-test over {_runs(comp['n'], folds)}: {sig}, p={p:.3g}, "
                f"Holm p={holm_p:.3g}"
            )
        metric = comp.get("metric", METRIC)
        lines.append(
            f"{comp['variant']} vs {comp['reference']}: {comp['diff_mean']:+.4f} {metric} ({test})."
        )
    return lines


def _folds(results: dict) -> int:
    """How many folds the repeats cycle through (``dataset.folds``; 0: none, repeats are seeds)."""
    return max(
        (
            len((cfg.get("dataset") or {}).get("folds") or ())
            for cfg in (results.get("config") or {}).values()
            if isinstance(cfg, dict)
        ),
        default=0,
    )


def _runs(n: int, folds: int) -> str:
    """``n`` paired repeats as they are: seeds, or (fold, seed) runs."""
    if not folds:
        return f"{n} seeds"
    return f"{n} runs ({folds} folds x {n // folds} seeds)" if n % folds == 0 else f"{n} runs"


def _unlearning(results: dict, name: str, before: str, ref: str) -> dict:
    """Levels and paired tests of one unlearned variant (``recovery``: vs the attacked one)."""
    variants = results["variants"]
    unlearned, attacked, clean = (_per_seed(variants[v]) for v in (name, before, ref))
    seeds = sorted(set(unlearned) & set(attacked) & set(clean))
    u, a, c = (np.array([d[s] for s in seeds]) for d in (unlearned, attacked, clean))
    out = {"name": name, "before": before, "ref": ref, "n": len(seeds), "recovery": (None, None)}
    if seeds:
        out["levels"] = (
            f"{name} {u.mean():.4f} vs {before} {a.mean():.4f} and {ref} {c.mean():.4f} "
            f"(final values; {name}'s is the calibrated model; n = {len(seeds)})"
        )
    if len(seeds) >= 2:
        out |= {
            "gap": paired_test(c, a),
            "recovery": paired_test(u, a),
            "rest": paired_test(u, c),
        }
    return out


def _privacy_sentence(name: str, reports: list[dict]) -> str:
    """The variant's privacy: the worst client over every repeat (a bound must hold for each
    seed's every client, so the largest, not a mean), realised and a priori kept apart, and the
    paper's nominal figure when the mechanism's differs from it (FPDGD)."""

    def worst(runs: list[dict], keys: tuple[str, ...]) -> str:
        out = []
        for k in keys:
            if all(r.get(k) is not None for r in runs):
                out.append(f"{k.removeprefix('a_priori_')} {max(r[k] for r in runs):.3g}")
            elif k.endswith("basic") and all(k in r for r in runs):
                # basic composition is None only where a release's loss is infinite (no noise,
                # randomised response that never tells the truth) or the sum overflows
                out.append(f"{k.removeprefix('a_priori_')} unbounded")
        return ", ".join(out)

    runs = [p["run"] for p in reports]
    text = (
        f"Privacy of {name} (worst client over {len(runs)} repeat(s), "
        f"delta={reports[0]['delta']:g}): realised epsilon "
        f"{worst(runs, ('basic', 'rdp', 'pld')) or 'not defined'}"
    )
    a_priori = worst(runs, ("a_priori_basic", "a_priori_pld"))
    if a_priori:
        text += f"; a priori with sampling, if who took part stays secret: {a_priori}"
    if all("nominal" in p for p in reports):
        nominal = worst([p["nominal"]["run"] for p in reports], ("basic", "pld"))
        text += f"; the paper's nominal reading (Laplace, L1 sensitivity Delta): {nominal}"
    return text + "."


def _unlearning_sentence(u: dict, rec_holm: float | None, folds: int) -> str:
    """Says what share of the gap was closed only when the gap and the recovery (Holm-adjusted
    over the scenario's unlearned variants) are significant."""
    name, before, ref = u["name"], u["before"], u["ref"]
    if u["n"] == 0:
        return f"Unlearning: no repeat finished {name}, {before} and {ref}."
    if u["n"] < 2:
        return (
            f"Unlearning: {u['levels']}: too few {'runs' if folds else 'seeds'} for a conclusion."
        )
    (gap_diff, gap_p), (rec_diff, rec_p), (rest_diff, rest_p) = (
        u["gap"],
        u["recovery"],
        u["rest"],
    )
    tests = (
        f"{ref} - {before} {gap_diff:+.4f} (p={_p(gap_p)}), {name} - {before} {rec_diff:+.4f} "
        f"(p={_p(rec_p)}, Holm p={_p(rec_holm)}), {name} - {ref} {rest_diff:+.4f} "
        f"(p={_p(rest_p)})"
    )
    if gap_p is None or gap_p >= ALPHA or gap_diff <= 0:
        return (
            f"Unlearning: {u['levels']}; {before} is not significantly worse: nothing to "
            f"recover ({tests})."
        )
    if rec_holm is None or rec_holm >= ALPHA or rec_diff <= 0:
        return f"Unlearning did not significantly recover: {u['levels']} ({tests})."
    return f"Unlearning recovered {rec_diff / gap_diff:.0%} of the gap: {u['levels']} ({tests})."


def _p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3g}"


def _per_seed(variant: dict) -> dict[int, float]:
    """Per seed: the repeat's final value (``final_value``, the table's), where it has one."""
    finals = {rep["seed"]: final_value(rep, METRIC) for rep in variant["repeats"]}
    return {seed: v for seed, v in finals.items() if v is not None}


def run_scenario(
    scenario: Scenario,
    out_dir: Path,
    reporter: Observer,
    *,
    checkpoint_every: int = 0,
    resume: bool = False,
    remote: Any = None,
    jobs: int = 1,
    executor: str = "local",
    reused: dict[tuple[str, int], dict] | None = None,
) -> dict:
    """Run every repeat of every variant; ``remote``: a multi-process transport's server side
    (``foltr_async.distributed.server.ZmqServer``) instead of the in-memory bus in virtual time.
    ``jobs`` > 1 or ``executor = "ray"`` runs the in-memory repeats in parallel
    (``foltr_async.parallel``; a checkpoint then keeps finished repeats only). ``reused``:
    repeats taken from earlier runs instead of run, by (variant, repeat) (``reused_repeats``).

    Called as a library with structlog unconfigured (its default prints every debug event to
    stdout), it logs as the CLI does for the run: ``events.jsonl`` in ``out_dir`` and warnings
    and errors on stderr.
    """
    own_logging = not structlog.is_configured()
    if own_logging:
        configure_logging(
            events_path=Path(out_dir) / "events.jsonl",
            json_logs=False,
            level="warning",
            console=False,
        )
    try:
        return _run_scenario(
            scenario,
            out_dir,
            reporter,
            checkpoint_every,
            resume,
            remote,
            jobs,
            executor,
            reused or {},
        )
    finally:
        if own_logging:
            close_logging()
            structlog.reset_defaults()


def _run_scenario(
    scenario: Scenario,
    out_dir: Path,
    reporter: Observer,
    checkpoint_every: int,
    resume: bool,
    remote: Any,
    jobs: int,
    executor: str,
    reused: dict[tuple[str, int], dict],
) -> dict:
    if scenario.folds and remote is not None:
        raise ScenarioError("dataset.folds: only with the memory transport")
    checkpoints = Checkpoints(out_dir, scenario, checkpoint_every, resume)
    writer = ResultsWriter(
        out_dir,
        scenario=scenario.name,
        seed=scenario.seed,
        config=scenario.settings(),
        reference=scenario.reference,
        metric=METRIC,
        conclusions=conclusions,
        throttled=True,
        code=code_stamp(),
    )
    observers = _Recording(reporter, writer)
    observers.run_started(
        {
            "scenario": scenario.name,
            "out_dir": str(out_dir),
            "seed": scenario.seed,
            "variants": list(scenario.variants),
            "repeats": scenario.repeats,
            "rounds": {n: c.federation.rounds for n, c in scenario.variants.items()},
            "reference": scenario.reference,
            "metric": METRIC,
        }
    )

    def finish(name: str, rep: int, result: dict) -> None:
        result = _plain(result)
        if scenario.folds:
            result["fold"] = scenario.folds[rep % len(scenario.folds)]
        with interrupts.held():  # checkpoint and results both get it, or neither
            checkpoints.finished(name, rep, result)
            observers.repeat_done(name, rep, result)

    with Interrupts() as interrupts:
        try:
            _run_todo(
                scenario, checkpoints, observers, finish, interrupts, remote, jobs, executor, reused
            )
        except BaseException:  # Ctrl-C, SIGTERM, an error: the files get every finished repeat
            keep_finished(writer, interrupts)
            raise
    writer.run_done({"environment": threads.facts()})  # the kernel's threads, per process
    final = writer.results
    reporter.run_done(final)
    return final


class _Recording(Observers):
    """The reporter's observers and the results writer: a watcher that fails is logged and
    the run goes on, but results that cannot be written (a full disk) end the run."""

    def __init__(self, reporter: Observer, writer: ResultsWriter) -> None:
        super().__init__([reporter])
        self.writer = writer

    def run_started(self, info: dict) -> None:
        self.writer.run_started(info)
        super().run_started(info)

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        self.writer.repeat_done(variant, repeat, result)
        super().repeat_done(variant, repeat, result)


def _run_todo(
    scenario: Scenario,
    checkpoints: Checkpoints,
    observers: Observers,
    finish: Callable[[str, int, dict], None],
    interrupts: Interrupts,
    remote: Any,
    jobs: int,
    executor: str,
    reused: dict[tuple[str, int], dict],
) -> None:
    """Every repeat not finished before: reused, or run by the run's executor."""
    todo = []
    for rep in range(scenario.repeats):
        seed = scenario.seed + rep
        for name, cfg in scenario.variants.items():
            done = checkpoints.done(name, rep)
            if done is not None:  # finished before the interruption
                observers.repeat_started(name, rep, seed)
                observers.repeat_done(name, rep, done)
            elif (name, rep) in reused:
                observers.repeat_started(name, rep, seed)
                finish(name, rep, reused[name, rep])
            else:
                todo.append((rep, seed, name, repeat_config(scenario, cfg, rep)))
    runner: Executor
    if remote is not None:
        runner = Remote(scenario, observers, finish, checkpoints.run, remote)
    elif jobs > 1 or executor != "local":
        runner = Parallel(scenario, observers, finish, jobs, executor)
    else:
        runner = Serial(scenario, observers, finish, checkpoints.run, interrupts.check)
    runner.run(todo)


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


class Interrupts:
    """Ctrl-C and SIGTERM during a run, acted on where nothing is lost (a context manager).

    Python's own handler raises KeyboardInterrupt wherever the signal lands, and one landing
    in a finaliser (``heap.release`` collects many between repeats) is printed and dropped:
    the run went on to the end. Here a signal marks the run stopped and raises from a loop
    callback in a running repeat, or at once outside one unless in a finaliser, where
    ``check`` raises it before the next repeat; inside ``held`` it waits until the block is
    done, so a finished repeat is recorded in the checkpoint, the results and the observers
    together.
    A signal ignored when the run starts (a shell's background job) stays ignored."""

    def __init__(self) -> None:
        self.requested = False
        self._holding = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                old = signal.getsignal(signum)
                if old is not None and old is not signal.SIG_IGN:  # None: set outside Python
                    self._old[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)
        self._old.clear()

    def _on_signal(self, _signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self._holding:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if not _in_finaliser(frame):  # one raised there is dropped, with a traceback
                raise KeyboardInterrupt from None
            return
        loop.call_soon_threadsafe(_raise_interrupt)

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    @contextmanager
    def held(self) -> Iterator[None]:
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if not self._holding:
            self.check()


def _in_finaliser(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def keep_finished(writer: ResultsWriter, interrupts: Interrupts) -> None:
    """Rewrite the results of a run that stops early: a throttled writer can be many repeats
    behind the checkpoint, and "results written so far are kept" must mean every finished
    one. A failing write (a full disk) is logged; the stop's own cause is what is reported."""
    with contextlib.suppress(KeyboardInterrupt), interrupts.held():
        try:
            writer.write(plot=False)
        except Exception as e:
            structlog.get_logger().error(
                "results_not_written", path=str(writer.out_dir), error=str(e)
            )


def _plain(obj):
    """numpy scalars and arrays -> JSON-ready Python values."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj

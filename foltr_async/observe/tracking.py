"""Export runs to experiment trackers: MLflow (a SQLite store in the results folder by default)
and TensorBoard.

An observer like the results writer: each repeat becomes one MLflow run, created when the repeat
starts and nested under one run per scenario invocation, or one TensorBoard log folder, with the
variant's resolved config as parameters (or text), every evaluated round's offline metrics and
simulated time as step series (logged as the round is evaluated, so a metric's timestamp is when
its round was; runs under ``--jobs`` report a repeat when it ends, and their series carry that
time), the privacy curve, and the final, online, message, privacy and staleness numbers. The
scenario run gets results.json, summary.md, curves.pdf and curves.png as artifacts when the run
ends.

Both libraries are optional (``pip install 'foltr-async[tracking]'``: mlflow-skinny with
SQLAlchemy and Alembic for its SQLite store, tensorboardX, and tensorboard to view the event
files) and imported only when asked for; a missing one is a one-line error before the run
starts. The default store is ``sqlite:///OUT/mlflow.db``, which current MLflow reads without
flags (its file store is in maintenance mode since MLflow 3); ``--mlflow-uri`` takes any other.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foltr_async.errors import FoltrError
from foltr_async.observe.observer import Observer
from foltr_async.observe.results import final_value

_BAD = re.compile(r"[^\w.\- :/]")


def _need(module: str, tracker: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise FoltrError(
            f"--track {tracker}: needs the tracking extra: python -m pip install "
            "'foltr-async[tracking]'"
        ) from None


def metric_name(key: str) -> str:
    """A key MLflow and TensorBoard accept: ``ndcg@10`` -> ``ndcg_at_10`` (letters, digits,
    _ - . : / space), the same in both."""
    return _BAD.sub("_", key.replace("@", "_at_"))


def flatten(cfg: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``{"federation": {"clients": 10}}`` -> ``("federation.clients", "10")``, lists as JSON."""
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            yield from flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], json.dumps(cfg) if isinstance(cfg, list) else str(cfg)


def round_series(round: int, metrics: dict[str, float], sim_time: float):
    """(name, value, step) of one evaluated round: its offline metrics and simulated time."""
    for metric, v in metrics.items():
        if v is not None:
            yield f"offline/{metric}", float(v), int(round)
    yield "sim_time_s", float(sim_time), int(round)


def series(result: dict, per_round: bool = True) -> Iterator[tuple[str, float, int]]:
    """(name, value, step) of a repeat: per evaluated round (unless they were logged as they
    happened), then final numbers (step 0)."""
    offline = result.get("offline") or {}
    if per_round:
        times = result.get("sim_times") or []
        for i, (r, t) in enumerate(zip(result.get("rounds") or [], times, strict=False)):
            yield from round_series(r, {m: vs[i] for m, vs in offline.items() if i < len(vs)}, t)
    for metric in offline:
        final = final_value(result, metric)  # the table's definition
        if final is not None:
            yield f"final/{metric}", float(final), 0
    privacy = result.get("privacy") or {}
    curve = privacy.get("curve") or {}
    for key, values in curve.items():
        if key != "rounds":
            for r, v in zip(curve["rounds"], values, strict=False):
                if v is not None:
                    yield f"privacy/epsilon_{key}", float(v), int(r)
    scalars = {
        **{f"online/{k}": v for k, v in (result.get("online") or {}).items()},
        **{f"privacy/run_{k}": v for k, v in (privacy.get("run") or {}).items()},
        **{f"staleness/{k}": v for k, v in (result.get("staleness") or {}).items()},
        "messages/sent": (result.get("messages") or {}).get("sent"),
        "messages/bytes": (result.get("messages") or {}).get("bytes"),
        "wall_s": result.get("wall_s"),
        "sim_s": result.get("sim_s"),
    }
    for key, v in scalars.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            yield key, float(v), 0


class MlflowTracker(Observer):
    """One MLflow run per repeat, created when it starts, nested under a run per invocation."""

    def __init__(self, out_dir: Path, variants: dict[str, dict], uri: str | None = None) -> None:
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.out_dir = Path(out_dir)
        self.variants = variants
        if uri is None:
            _need("sqlalchemy", "mlflow")  # the SQLite store's engine
            _need("alembic", "mlflow")  # and its schema migrations
            self.out_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(self.out_dir / 'mlflow.db').resolve()}"
            self.artifacts: str | None = (self.out_dir / "mlartifacts").resolve().as_uri()
        else:
            self.artifacts = None  # the tracking server's or store's own default
        for name in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(name).setLevel(logging.WARNING)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.parent: str | None = None
        self.experiment: str | None = None
        self.children: dict[tuple[str, int], str] = {}
        self.live: set[tuple[str, int]] = set()  # repeats whose rounds were logged as they ran

    def run_started(self, info: dict) -> None:
        name = info.get("scenario") or "scenario"
        exp = self.client.get_experiment_by_name(name)
        self.experiment = (
            exp.experiment_id
            if exp
            else self.client.create_experiment(name, artifact_location=self.artifacts)
        )
        run = self.client.create_run(
            self.experiment,
            run_name=f"{name} seed {info.get('seed')}",
            tags={"out_dir": str(info.get("out_dir", self.out_dir))},
        )
        self.parent = run.info.run_id

    def repeat_started(self, variant: str, repeat: int, seed: int) -> None:
        from mlflow.entities import Param

        run = self.client.create_run(
            self.experiment,
            run_name=f"{variant} #{repeat}",
            tags={
                "mlflow.parentRunId": self.parent,
                "variant": variant,
                "repeat": str(repeat),
                "seed": str(seed),
            },
        )
        self.children[(variant, repeat)] = run.info.run_id
        params = [Param(k[:250], v[:6000]) for k, v in flatten(self.variants.get(variant, {}))]
        for i in range(0, len(params), 100):  # the batch limits of log_batch
            self.client.log_batch(run.info.run_id, params=params[i : i + 100])

    def round_done(self, variant, repeat, round, *, metrics, messages, sim_time) -> None:
        rid = self.children.get((variant, repeat))
        if metrics is None or rid is None:
            return
        self.live.add((variant, repeat))
        self._log(rid, round_series(round, metrics, sim_time))

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        rid = self.children.pop((variant, repeat))
        live = (variant, repeat) in self.live
        self.live.discard((variant, repeat))
        self._log(rid, series(result, per_round=not live))
        self.client.set_terminated(rid)

    def _log(self, rid: str, points: Iterator[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(k), v, now, s) for k, v, s in points]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(rid, metrics=metrics[i : i + 1000])

    def run_done(self, results: dict) -> None:
        if self.parent is None:
            return
        for name in ("results.json", "summary.md", "curves.pdf", "curves.png"):
            path = self.out_dir / name
            if path.exists():
                self.client.log_artifact(self.parent, str(path))
        status = "FINISHED" if results.get("complete", True) else "KILLED"
        self.client.set_terminated(self.parent, status=status)


class TensorBoardTracker(Observer):
    """One TensorBoard log folder per repeat: OUT/tensorboard/<variant>/repeat-<n>."""

    def __init__(self, out_dir: Path, variants: dict[str, dict]) -> None:
        _need("tensorboardX", "tensorboard")
        self.root = Path(out_dir) / "tensorboard"
        self.variants = variants

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        from tensorboardX import SummaryWriter

        with SummaryWriter(str(self.root / variant / f"repeat-{repeat}")) as w:
            config = json.dumps(self.variants.get(variant, {}), indent=1, default=str)
            w.add_text("config", f"```\n{config}\n```", 0)
            for key, value, step in series(result):
                w.add_scalar(metric_name(key), value, step)


def make_trackers(
    names: list[str], out_dir: Path, variants: dict[str, dict], mlflow_uri: str | None
) -> list[Observer]:
    """The observers ``--track`` asks for (a missing library: a one-line FoltrError)."""
    out: list[Observer] = []
    for name in dict.fromkeys(names):
        if name == "mlflow":
            out.append(MlflowTracker(out_dir, variants, mlflow_uri))
        else:
            out.append(TensorBoardTracker(out_dir, variants))
    return out

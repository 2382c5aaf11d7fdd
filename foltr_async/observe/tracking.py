"""Export runs to experiment trackers: MLflow (a local file store by default) and TensorBoard.

An observer like the results writer: each finished repeat becomes one MLflow run (nested under
one run per scenario invocation) or one TensorBoard log folder, with the variant's resolved
config as parameters (or text), every evaluated round's offline metrics, simulated time and
privacy curve as step series, and the final, online, message, privacy and staleness numbers.
The scenario run gets results.json, summary.md and curves.png as artifacts when the run ends.

Both libraries are optional (``pip install 'foltr-async[tracking]'``: mlflow-skinny and
tensorboardX) and imported only when asked for; a missing one is a one-line error before the
run starts. MLflow 3 keeps its file store in maintenance mode behind
``MLFLOW_ALLOW_FILE_STORE``, which the default ``file:`` URI sets; any other tracking URI
(``sqlite:///mlflow.db``, a server) is used as given.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foltr_async.errors import FoltrError
from foltr_async.observe.observer import Observer

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


def series(result: dict) -> Iterator[tuple[str, float, int]]:
    """(name, value, step) of a repeat: per evaluated round, then final numbers (step 0)."""
    rounds = result.get("rounds") or []
    for metric, values in (result.get("offline") or {}).items():
        for r, v in zip(rounds, values, strict=False):
            if v is not None:
                yield f"offline/{metric}", float(v), int(r)
        if values and values[-1] is not None:
            yield f"final/{metric}", float(values[-1]), 0
    for r, t in zip(rounds, result.get("sim_times") or [], strict=False):
        yield "sim_time_s", float(t), int(r)
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
    """One MLflow run per repeat, nested under a run per scenario invocation."""

    def __init__(self, out_dir: Path, variants: dict[str, dict], uri: str | None = None) -> None:
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.out_dir = Path(out_dir)
        self.variants = variants
        if uri is None:
            uri = (self.out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.parent: str | None = None
        self.experiment: str | None = None

    def run_started(self, info: dict) -> None:
        name = info.get("scenario") or "scenario"
        exp = self.client.get_experiment_by_name(name)
        self.experiment = exp.experiment_id if exp else self.client.create_experiment(name)
        run = self.client.create_run(
            self.experiment,
            run_name=f"{name} seed {info.get('seed')}",
            tags={"out_dir": str(info.get("out_dir", self.out_dir))},
        )
        self.parent = run.info.run_id

    def repeat_done(self, variant: str, repeat: int, result: dict) -> None:
        from mlflow.entities import Metric, Param

        run = self.client.create_run(
            self.experiment,
            run_name=f"{variant} #{repeat}",
            tags={
                "mlflow.parentRunId": self.parent,
                "variant": variant,
                "repeat": str(repeat),
                "seed": str(result.get("seed")),
            },
        )
        rid = run.info.run_id
        now = int(time.time() * 1000)
        params = [Param(k[:250], v[:6000]) for k, v in flatten(self.variants.get(variant, {}))]
        metrics = [Metric(metric_name(k), v, now, s) for k, v, s in series(result)]
        for i in range(0, len(params), 100):  # the batch limits of log_batch
            self.client.log_batch(rid, params=params[i : i + 100])
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(rid, metrics=metrics[i : i + 1000])
        self.client.set_terminated(rid)

    def run_done(self, results: dict) -> None:
        if self.parent is None:
            return
        for name in ("results.json", "summary.md", "curves.png"):
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

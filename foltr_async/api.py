"""Running a scenario from Python (a notebook, a script): ``foltr_async.run``.

The same run as the command line's: the scenario is loaded and checked as the CLI does,
results files are written to the output folder, and the numbers come from the results it
wrote (``results.json``), so a notebook reads exactly what the console and summary.md say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foltr_async.errors import FoltrError
from foltr_async.scenario.load import Scenario, load_scenario


@dataclass(frozen=True)
class VariantResult:
    """One variant over its repeats: the final metric per repeat (None where a repeat measured
    nothing) and its summary as results.json records it."""

    name: str
    metric: str
    finals: list[float | None]
    summary: dict[str, Any] = field(repr=False)
    repeats: list[dict[str, Any]] = field(repr=False)

    @property
    def mean(self) -> float | None:
        """Mean final ``metric`` over the repeats (results.json's ``summary.final``)."""
        return (self.summary.get("final", {}).get(self.metric) or {}).get("mean")

    @property
    def std(self) -> float | None:
        return (self.summary.get("final", {}).get(self.metric) or {}).get("std")


@dataclass(frozen=True)
class Results:
    """A finished run: where its files are, its variants by name, its conclusions, and the
    whole results.json (``raw``)."""

    scenario: str
    metric: str
    out_dir: Path
    variants: dict[str, VariantResult]
    conclusions: list[str]
    raw: dict[str, Any] = field(repr=False)


def run(
    scenario: str | Path | Scenario,
    overrides: Sequence[str] = (),
    *,
    out: str | Path | None = None,
    seed: int | None = None,
    only: Sequence[str] = (),
    jobs: int = 1,
) -> Results:
    """Run ``scenario`` (a file, or one ``load_scenario`` returned) and return its results.

    ``overrides`` are ``--set`` values ("federation.rounds=50"), ``seed`` and ``only`` as the
    CLI's ``--seed`` and ``--only`` (with a file; a loaded scenario runs as it was loaded).
    ``out``: a new or empty folder (default ``results/NAME/<time>/``). Bad input raises
    ``FoltrError`` (one line, before anything is written)."""
    from foltr_async.experiment import run_scenario
    from foltr_async.observe.observer import Observer
    from foltr_async.observe.results import final_value
    from foltr_async.outdir import new_folder, refuse_taken
    from foltr_async.preflight import check_scenario

    if isinstance(scenario, Scenario):
        if overrides or seed is not None or only:
            raise FoltrError(
                "run: overrides, seed and only apply to a scenario file; give the path, or "
                "pass them to load_scenario"
            )
        sc = scenario
    else:
        sc = load_scenario(scenario, list(overrides), seed=seed, only=list(only))
    if jobs < 1:
        raise FoltrError(f"run: jobs: expected an integer >= 1, got {jobs}")
    check_scenario(sc)
    if out is None:
        from datetime import datetime

        folder = new_folder(Path("results") / sc.name / datetime.now().strftime("%Y%m%d-%H%M%S"))
    else:
        folder = Path(out)
        refuse_taken(folder)
        folder.mkdir(parents=True, exist_ok=True)
    raw = run_scenario(sc, folder, Observer(), jobs=jobs)
    metric = raw.get("metric", "ndcg@10")
    variants = {
        name: VariantResult(
            name,
            metric,
            [final_value(rep, metric) for rep in entry["repeats"]],
            entry.get("summary") or {},
            entry["repeats"],
        )
        for name, entry in (raw.get("variants") or {}).items()
    }
    return Results(sc.name, metric, folder, variants, list(raw.get("conclusions") or []), raw)

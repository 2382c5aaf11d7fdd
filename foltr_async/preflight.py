"""What a run would reject at its start, checked before anything is written: ``check_scenario``
(the CLI's run, ``validate --build``) builds every variant; ``check_inputs`` (``validate``)
only looks at the data files a scenario names; ``located`` names the file and variant of a
one-line error.

Apart from ``experiment`` on purpose: that module imports the results writer and its
statistics (scipy), which a bad scenario's one-line error should not wait for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from foltr_async.errors import DatasetError, FoltrError
from foltr_async.inputs import relative_note
from foltr_async.observe.observer import Observer
from foltr_async.scenario.load import Scenario, repeat_config
from foltr_async.simulation import Simulation


def check_scenario(scenario: Scenario) -> None:
    """Build every variant as a run would, without its honest clients or any round: what the
    run would reject at its start (a missing or broken dataset, more clients than queries, an
    unknown timeline agent) fails here, as one line naming the file
    and the variant (every fold of a ``dataset.folds`` scenario is built: each is its own
    data)."""
    for name, cfg in scenario.variants.items():
        for rep in range(max(1, len(scenario.folds))):
            with located(scenario, name):
                run_cfg = repeat_config(scenario, cfg, rep)
                Simulation(run_cfg, scenario.seed, Observer(), name, hosts=_no_clients).build()


def check_inputs(scenario: Scenario) -> None:
    """What ``validate`` checks beyond the file's keys and types, in seconds and without
    building anything: every dataset path a variant (and fold) reads is there, with the files
    its format needs, the first data line of each LETOR file valid (the loader checked every
    key and rule across keys). The data's content (every line, enough queries for the
    clients) is what ``check_scenario`` adds."""
    seen: set[tuple[str, str]] = set()
    for name, cfg in scenario.variants.items():
        for rep in range(max(1, len(scenario.folds))):
            d = repeat_config(scenario, cfg, rep).dataset
            if d.path is None or (d.format, d.path) in seen:
                continue
            seen.add((d.format, d.path))
            with located(scenario, name):
                try:
                    _data_files(d.format, Path(d.path))
                except DatasetError as e:
                    raise DatasetError(f"dataset.path: {e}{relative_note(d.path)}") from None


def _data_files(fmt: str, path: Path) -> None:
    if fmt == "aol4foltr":
        from foltr_async.ltr.aol import aol_files

        aol_files(path)
        return
    from foltr_async.ltr.data import check_first_line, fold_files

    if path.is_dir():
        files = [f for f in fold_files(path).values() if f is not None]
    else:
        test = path.with_name("test.txt")
        if path.is_file() and not test.is_file():  # as the run says it
            raise DatasetError(f"{path}: no test.txt beside the training data")
        files = [path, test]
    for f in files:
        check_first_line(f)


def _no_clients(agent_id: str, group: str) -> bool:
    return group != "clients"  # honest clients are many and their checks are the config's


@contextmanager
def located(scenario: Scenario, variant: str) -> Iterator[None]:
    """Prefix a one-line error raised for ``variant`` with its file and variant name."""
    try:
        yield
    except FoltrError as e:
        where = scenario.where(variant)
        if str(e).startswith(where):
            raise
        e.args = (f"{where}: {e}",)
        raise

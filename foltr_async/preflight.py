"""What a run would reject at its start, checked before anything is written: ``check_scenario``
(the CLI's run) and ``located``, which names the file and variant of a
one-line error.

Apart from ``experiment`` on purpose: that module imports the results writer and its
statistics (scipy), which a bad scenario's one-line error should not wait for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from foltr_async.errors import FoltrError
from foltr_async.observe.observer import Observer
from foltr_async.scenario.load import Scenario, repeat_config
from foltr_async.simulation import Simulation


def check_scenario(scenario: Scenario) -> None:
    """Build every variant as a run would, without its honest clients or any round: what the
    run would reject at its start (a missing or broken dataset, more clients than queries, an
    unknown timeline agent, a protocol's own checks) fails here, as one line naming the file
    and the variant (every fold of a ``dataset.folds`` scenario is built: each is its own
    data)."""
    for name, cfg in scenario.variants.items():
        for rep in range(max(1, len(scenario.folds))):
            with located(scenario, name):
                run_cfg = repeat_config(scenario, cfg, rep)
                Simulation(run_cfg, scenario.seed, Observer(), name, hosts=_no_clients).build()


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

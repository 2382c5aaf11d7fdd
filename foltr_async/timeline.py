"""A scenario's timeline resolved against one run's agents: who acts, at which round or time.

The agents' ids are known from the configuration before any agent is built (clients, then
attackers, then eavesdroppers), so the timeline is resolved once, before the agents exist, and
the same everywhere: a worker process that builds only its share of them reads the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foltr_async.config import TimelineItem
from foltr_async.errors import ScenarioError
from foltr_async.runtime.agent import client_id


def agent_groups(n_clients: int, n_attackers: int, n_eavesdroppers: int) -> dict[str, list[str]]:
    """Every agent id of a run by group, in the order the run builds them."""
    return {
        "clients": [client_id(i) for i in range(n_clients)],
        "attackers": [client_id(i) for i in range(n_clients, n_clients + n_attackers)],
        "eavesdroppers": [f"eve-{k}" for k in range(n_eavesdroppers)],
    }


@dataclass
class Timeline:
    """``items``: the scenario's ``[[timeline]]`` entries; ``groups``: ``agent_groups``. What
    the run reads of them is resolved once, here."""

    items: tuple[TimelineItem, ...]
    groups: dict[str, list[str]]
    #: each item's agent ids, in the items' order
    agents: list[list[str]] = field(init=False)
    #: (action, agent ids) of every item (``ProtocolRun.before_agents`` reads them)
    actions: list[tuple[str, list[str]]] = field(init=False)
    #: the agents a ``join`` item starts (the others start with the run)
    joins_later: set[str] = field(init=False)
    #: item indices by the round before which they act (items timed by round)
    by_round: dict[int, list[int]] = field(init=False)
    #: indices of the items timed in simulated seconds
    timed: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.agents = [
            self.resolve(item.agents, f"timeline[{i}].agents") for i, item in enumerate(self.items)
        ]
        self.actions = [
            (item.action, ids) for item, ids in zip(self.items, self.agents, strict=True)
        ]
        self.joins_later = {a for action, ids in self.actions if action == "join" for a in ids}
        self.by_round = {}
        for i, item in enumerate(self.items):
            if item.round is not None:
                self.by_round.setdefault(item.round, []).append(i)
        self.timed = [i for i, item in enumerate(self.items) if item.time is not None]

    def resolve(self, names: list[str], path: str) -> list[str]:
        """Agent ids of group names and ids (every agent of the run, wherever it is built)."""
        out: list[str] = []
        every = [a for ids in self.groups.values() for a in ids]
        for name in names:
            if name in self.groups:
                out += self.groups[name]
            elif name == "all":
                out += every
            elif name in every:
                out.append(name)
            else:
                raise ScenarioError(
                    f"{path}: unknown agent {name!r}; groups are "
                    f"{', '.join(self.groups)} or ids like client-0003"
                )
        return out

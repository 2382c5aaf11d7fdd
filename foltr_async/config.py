"""One variant's run configuration: typed, frozen, built once by the scenario loader.

Each section of a scenario file is a ``@parameters`` class (the same machinery as a protocol's
``[federation.params]``), so a key is checked once, with one-line errors, and read as an
attribute (``config.federation.rounds``). The values derived from several keys (client and
attacker counts, the parsed network, the protocol's typed params, each agent group's typed
params) are computed here once; nothing downstream reads the file's tables by string.
``as_dict`` gives the plain tables a results file records and a checkpoint or worker compares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from foltr_async.params import Field, parameters
from foltr_async.params import param as p

if TYPE_CHECKING:
    from foltr_async.runtime.network import NetworkModel


@parameters
class ScenarioSettings:
    name: str = p("", "short name used for the output folder")
    description: str = p("", "the research question this file answers")
    seed: int = p(0, "root of every random stream", min=0)
    repeats: int = p(1, "runs per variant, seeds seed, seed+1, ...", min=1)
    reference: str | None = p(None, "variant the others are compared with")


@parameters
class DatasetSettings:
    profile: str = p("mq2007-like", "embedded synthetic profile (when no path)")
    format: str = p(
        "letor",
        "what dataset.path holds: LETOR files, or an AOL4FOLTR folder (one client per user)",
        choices=("letor", "aol4foltr"),
    )
    path: str | None = p(None, "LETOR fold directory or train file")
    n_queries: int | None = p(None, "synthetic dataset size (all splits)", min=10)
    normalise: bool = p(False, "query-level min-max normalisation of LETOR features")
    seed: int | None = p(
        None, "synthetic data / aol4foltr user draw seed (default: scenario.seed)", min=0
    )
    folds: list[int] = p(
        [],
        "fold numbers under path (FoldN): every fold runs scenario.repeats seeds",
        items=Field(int, min=1),
    )
    min_queries: int = p(1, "aol4foltr: logged queries a user needs to be picked", min=1)
    select: str = p(
        "sample",
        "aol4foltr: users by a seeded draw (dataset.seed) or the most active",
        choices=("sample", "most_active"),
    )
    test_fraction: float = p(
        0.2, "aol4foltr: last share of queries in time held out", min=0.01, max=0.99
    )
    time_scale: float = p(3600.0, "aol4foltr: logged seconds per simulated second", min=1e-9)

    @property
    def replayed(self) -> bool:
        """An AOL4FOLTR log: one client per logged user."""
        return self.format == "aol4foltr"


def data_seed(path: str | None, format: str, seed: int | None, scenario_seed: int) -> int | None:
    """The seed a variant's data are drawn from (a synthetic profile, AOL users):
    ``dataset.seed``, else the scenario seed; None when they are read as they are (LETOR
    files). Runs of other scenario seeds share drawn data only through ``dataset.seed``."""
    if path is not None and format != "aol4foltr":
        return None
    return seed if seed is not None else scenario_seed


def recorded_data_seed(settings: dict[str, Any]) -> int | None:
    """``data_seed`` of a variant's tables as a results file records them (``as_dict``)."""
    d = settings["dataset"]
    return data_seed(d.get("path"), d.get("format"), d.get("seed"), settings["scenario"]["seed"])


@parameters
class RankerSettings:
    kind: str = p("linear", "ranker family", choices=("linear", "mlp"))
    hidden: list[int] = p([64], "MLP hidden layer sizes", items=Field(int, min=1))
    activation: str | None = p(
        None, "MLP hidden units (default: the protocol's, else tanh)", choices=("tanh", "relu")
    )
    init: str | None = p(
        None,
        "MLP initial weights: glorot or all zero (default: the protocol's, else glorot)",
        choices=("glorot", "zero"),
    )


@parameters
class ClicksSettings:
    model: str = p(
        "informational",
        "click model of honest users",
        choices=("perfect", "navigational", "informational"),
    )


@parameters
class FederationSettings:
    protocol: str = p(help="protocol name (see `python -m foltr_async list`)")
    clients: int = p(10, "honest clients", min=1)
    queries_per_client: int = p(4, "interactions per client per round (B)", min=1)
    rounds: int = p(100, "federated rounds", min=1)
    aggregator: str = p("fedavg", "how client updates combine")
    participation: float = p(1.0, "fraction of online clients per round", min=0.0, max=1.0)
    min_clients: int = p(1, "fewer replies keep the old model", min=1)
    deadline: float = p(60.0, "simulated seconds the server waits per round", min=0.0)
    round_gap: float = p(0.0, "simulated idle seconds between rounds", min=0.0)
    data: str = p(
        "partition",
        "client query sets: disjoint partition or shared pool",
        choices=("partition", "shared"),
    )
    assumed_malicious: int | None = p(
        None, "m the robust aggregators assume (default: the number of attacker agents)", min=0
    )
    params: dict = p({}, "protocol parameters")
    secure_aggregation: bool | None = p(
        None,
        "mask client updates so the server learns only "
        "their sum (default: on when [federation.secagg] is given)",
    )
    secagg: dict = p({}, "secure aggregation settings (degree, threshold, ...)")
    partition: dict = p(
        {},
        "non-IID client data (intents, grades, click models, "
        "queries per round; see protocols/noniid.py)",
    )


@parameters
class EvaluationSettings:
    every: int = p(10, "evaluate the global model every N rounds", min=1)
    no_relevant: str = p("skip", "queries without relevant documents", choices=("skip", "zero"))
    max_test_queries: int | None = p(None, "cap on held-out queries", min=1)


@parameters
class TimelineItem:
    action: str = p(
        help="what happens: join, leave, crash, rejoin, attack_start, "
        "attack_stop or an action of the protocol's"
    )
    round: int | None = p(None, "round the action happens before; -1 is the last round")
    time: float | None = p(None, "simulated time of the action (seconds)", min=0.0)
    agents: list[str] = p([], "agent ids, or groups: 'attackers', 'clients'")


@dataclass(frozen=True)
class AgentGroup:
    """One ``[[agents]]`` group: its behaviour, how many, their role, and the behaviour's own
    ``@parameters`` (``params``) as the scenario gives them."""

    behaviour: str
    count: int
    role: str
    params: Any
    #: the checked table as the scenario gives it (``as_dict``)
    table: dict = field(repr=False)


#: the sections of a variant, in the order a results file records them
SECTION_CLASSES = {
    "scenario": ScenarioSettings,
    "dataset": DatasetSettings,
    "ranker": RankerSettings,
    "clicks": ClicksSettings,
    "federation": FederationSettings,
    "evaluation": EvaluationSettings,
}


@dataclass(frozen=True)
class RunConfig:
    """A variant as one repeat runs it (``scenario.load.validate`` builds it; never by hand)."""

    scenario: ScenarioSettings
    dataset: DatasetSettings
    ranker: RankerSettings
    clicks: ClicksSettings
    federation: FederationSettings
    evaluation: EvaluationSettings
    #: ``[network]`` parsed once; a run plays on a copy of its own (``new_network``)
    network: NetworkModel
    #: ``[network]`` as the scenario gives it
    network_table: dict
    agents: tuple[AgentGroup, ...]
    timeline: tuple[TimelineItem, ...]
    #: the protocol's ``@parameters`` instance of ``[federation.params]``
    params: Any
    #: the partitioner's ``@parameters`` instance of ``[federation.partition]`` (None: no table)
    partition: Any = None
    n_attackers: int = field(init=False)
    n_eavesdroppers: int = field(init=False)

    def __post_init__(self) -> None:
        attackers = sum(g.count for g in self.agents if g.role == "attacker")
        object.__setattr__(self, "n_attackers", attackers)
        object.__setattr__(self, "n_eavesdroppers", sum(g.count for g in self.agents) - attackers)

    @property
    def n_clients(self) -> int:
        """Every client of the federation: the honest ones and the attackers."""
        return self.federation.clients + self.n_attackers

    @property
    def assumed_malicious(self) -> int:
        """m for the robust aggregators: ``federation.assumed_malicious`` or the attackers."""
        m = self.federation.assumed_malicious
        return self.n_attackers if m is None else m

    @property
    def timeline_actions(self) -> frozenset[str]:
        return frozenset(t.action for t in self.timeline)

    @property
    def data_seed(self) -> int | None:
        d = self.dataset
        return data_seed(d.path, d.format, d.seed, self.scenario.seed)

    def new_network(self) -> NetworkModel:
        """A copy of the network model with no run state (presence, resolved links) yet."""
        return dataclasses.replace(self.network)

    def with_dataset(self, **changes: Any) -> RunConfig:
        """The same variant on other data (a repeat's fold)."""
        return dataclasses.replace(self, dataset=dataclasses.replace(self.dataset, **changes))

    def as_dict(self) -> dict[str, Any]:
        """The plain tables, every default filled in (results.json's ``config``)."""
        out = {name: _table(getattr(self, name)) for name in SECTION_CLASSES}
        out = {
            **{k: out[k] for k in ("scenario", "dataset", "ranker", "clicks", "federation")},
            "network": _plain(self.network_table),
            "evaluation": out["evaluation"],
            "agents": [{**_plain(g.table), "role": g.role} for g in self.agents],
            # in the file's order of keys (a dataclass puts the required action first)
            "timeline": [
                {"round": t.round, "time": t.time, "action": t.action, "agents": list(t.agents)}
                for t in self.timeline
            ],
        }
        return out


def _table(section: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _plain(value: Any) -> Any:
    """A fresh copy of plain data (a caller may change what ``as_dict`` returns)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value

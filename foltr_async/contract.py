"""What a protocol may use of a run: its context, the run base class, the probe, partitions.

The orchestrator (``foltr_async.simulation``) builds these and plays the run; a protocol only
ever sees them, so protocols depend on this module and never on the orchestrator
(``protocols/api.py`` re-exports it for plugin authors).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.ltr.clicks import cascade
from foltr_async.ltr.metrics import OnlineDiscounted, count_judged, offline_metrics
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import make_ranker
from foltr_async.registry import REGISTRY, AggregatorEntry, Registry
from foltr_async.rng import stream
from foltr_async.runtime import heap
from foltr_async.runtime.agent import Agent
from foltr_async.runtime.bus import Bus
from foltr_async.runtime.checkpoint import Checkpointed, CheckpointError, capture, restore
from foltr_async.runtime.engine import RoundReport, ServerAgent
from foltr_async.runtime.flgo import FlgoSystem
from foltr_async.runtime.secure import SecureClient, SecureRun
from foltr_async.runtime.trust import worker_extras

if TYPE_CHECKING:
    from foltr_async.ltr.aol import UserLog

#: The timeline actions of an agent's lifecycle, each with the state it leaves the agent in.
LIFECYCLE: Mapping[str, str] = MappingProxyType(
    {"join": "joined", "rejoin": "joined", "leave": "left", "crash": "crashed"}
)
#: The timeline actions every protocol takes: the lifecycle and the attack switch
#: (``Agent.on_attack``); a protocol adds its own (``ProtocolRun.actions``).
GENERIC_ACTIONS = (*LIFECYCLE, "attack_start", "attack_stop")

#: The offline metrics of a run's global model: nDCG@10 (the FPDGD papers') and expected
#: MaxRR@10 under the scenario's users (the FOLtR-ES papers').
OFFLINE = ("ndcg@10", "maxrr@10")


@dataclass(frozen=True)
class Datasets:
    train: QuerySet
    test: QuerySet
    n_grades: int
    #: an AOL4FOLTR run's users, one per client: training queries with their logged times
    logs: tuple[UserLog, ...] | None = None


def _record(r: Any) -> bool:
    """A displayed-ranking record as ``Probe`` keeps it: (round, owner, nDCG)."""
    return (
        type(r) is tuple
        and len(r) == 3
        and type(r[0]) is int
        and type(r[1]) is str
        and type(r[2]) in (float, np.float64)
    )


def model_message_bytes(cfg: RunConfig, data: Datasets) -> int:
    """A generous bound on a message of a protocol whose messages carry the model: a few copies
    of it or a list of training query numbers, plus headers, and with secure aggregation one
    entry per client (its rosters and shares). For ``ProtocolEntry.wire_bytes``."""
    r = cfg.ranker
    kw = {"hidden": tuple(r.hidden)} if r.kind == "mlp" else {}
    ranker = make_ranker(r.kind, data.train.n_features, rng=np.random.default_rng(0), **kw)
    size = (64 << 10) + 16 * 8 * ranker.n_params + 8 * data.train.n_queries
    if cfg.federation.secure_aggregation:
        size += 512 * cfg.n_clients
    return size


worker_extras("replay", "counters")  # a replaying client's counts (simulation.replay_partition)


@dataclass
class Probe(Checkpointed):
    """Simulator-side measurements (never sent as messages): the online metric and extras.

    Displayed-ranking nDCGs are recorded with (round, client) and discounted in that order
    (stable within a client), so the online metric does not depend on delivery order, batching
    or transport.
    """

    #: checkpointed beside the other attributes as plain tuples (encoded as they are: fast);
    #: ``oracle_read`` is declared afresh by the rebuilt run's readers
    checkpoint_skip = ("_shown", "oracle_read")

    extras: dict[str, Any] = field(default_factory=dict)
    #: Truths agents leave for oracle scoring (e.g. a client's pre-noise update, read by an
    #: eavesdropper's score); never sent in a message and never written to results.
    oracle: dict[Any, Any] = field(default_factory=dict)
    #: Whether anything in the run reads ``oracle`` (readers say so when built, ``read_oracle``);
    #: writers skip their truths otherwise: 62,500 FPDGD clients held ~80 MB nobody read.
    oracle_read: bool = False
    _shown: list[tuple[int, str, float]] = field(default_factory=list)

    def read_oracle(self) -> None:
        """Declare a reader of ``oracle`` (an eavesdropper's score, a personalised evaluation)."""
        self.oracle_read = True

    def displayed(self, ndcg_value: float, owner: str = "", round: int = 0) -> None:
        self._shown.append((round, owner, ndcg_value))

    @property
    def interactions(self) -> int:
        """Rankings shown to users so far (in this process)."""
        return len(self._shown)

    def records(self, start: int = 0) -> list[tuple[int, str, float]]:
        """The displayed-ranking records from number ``start`` on, (round, owner, nDCG)."""
        return self._shown[start:]

    def add_records(self, records: list[tuple[int, str, float]]) -> None:
        """Records another process made (a worker's clients), in that process's order."""
        self._shown.extend(records)

    def checkpoint_state(self, shared: dict[str, Any]) -> tuple[bytes, list]:
        return capture(self, shared), list(self._shown)

    def restore_state(self, state: tuple[bytes, list], shared: dict[str, Any]) -> None:
        ok = type(state) is tuple and len(state) == 2 and type(state[1]) is list
        if not ok or not all(_record(r) for r in state[1]):
            raise CheckpointError("Probe: expected (attributes, [(round, owner, nDCG), ...])")
        attrs, shown = state
        restore(self, attrs, shared)
        self.add_records(shown)

    def online(self, rounds: Sequence[int] = ()) -> tuple[dict[str, float | int], list[float]]:
        """The online metric over every record, and its running value through each of
        ``rounds`` (ascending; records of rounds up to it), summed in the one order, so a run
        read at round r gives what the same run stopped at r gives. A run that showed no user a
        ranking (CS-F-LTR's parties have no online users) has no online metric: None, not 0."""
        acc, at = OnlineDiscounted(), []
        ends = iter(rounds)
        end = next(ends, None)
        for r, _, value in sorted(self._shown, key=lambda rec: (rec[0], rec[1])):
            while end is not None and r > end:  # every record of rounds up to ``end`` is in
                at.append(acc.value)
                end = next(ends, None)
            acc.add(value)
        at += [acc.value] * (len(rounds) - len(at))
        if not acc.t:
            return {"ndcg@10_discounted": None, "interactions": 0}, [None] * len(rounds)
        return {"ndcg@10_discounted": acc.value, "interactions": acc.t}, at


@dataclass
class RunContext:
    """What a protocol's run and agents use: the configuration, time, the bus, randomness, the
    data and its evaluation, the probe; nothing here is shared mutable state of agents."""

    config: RunConfig
    seed: int
    data: Datasets
    bus: Bus
    probe: Probe
    emit: Callable[..., None]
    #: Per-run objects a protocol's agents share through ``shared`` (e.g. a compute pool).
    _shared: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    #: ``[federation.partition]``: every client's own data (None: ``assign_queries``).
    partition: Partition | None = field(default=None, init=False, repr=False)
    #: ``[network.flgo]``: FLGo's system models of this run (None: not configured)
    flgo: FlgoSystem | None = field(default=None, init=False, repr=False)
    #: held-out queries with a relevant document in what ``evaluate`` scores (the fewest of
    #: any label view); None until it runs. 0: the offline metrics measured nothing.
    judged_queries: int | None = field(default=None, init=False, repr=False)
    #: ``federation.secure_aggregation``: the run's scheme (None: off); clients take their
    #: half from ``secure_half`` when they are built
    secure: SecureRun | None = field(default=None, init=False, repr=False)
    #: the loop time of simulated time zero (``now``: a replayed log's clock)
    clock0: float = field(default=0.0, init=False, repr=False)
    #: ``await act(agent_id, action)``: a lifecycle action (``rejoin``, ``leave``, ...) on an
    #: agent wherever it lives, as the timeline plays it (a protocol's later phase); the run
    #: sets it in the server's process
    act: Callable[[str, str], Awaitable[None]] | None = field(default=None, init=False, repr=False)

    @property
    def params(self) -> Any:
        """The protocol's ``@parameters`` instance of ``[federation.params]``."""
        return self.config.params

    @property
    def aggregator(self) -> AggregatorEntry:
        """``federation.aggregator``: how the server combines the replies."""
        return REGISTRY.aggregators[self.config.federation.aggregator]

    def now(self) -> float:
        """Simulated seconds since the run started: the clock a replayed log's queries arrive
        by (in-memory runs only: the CLI refuses a replayed log over ZeroMQ, where another
        process's clock does not share this zero)."""
        return asyncio.get_running_loop().time() - self.clock0

    def secure_half(self, agent_id: str) -> SecureClient | None:
        """The secure-aggregation half a client (or attacker) is built with
        (``Agent(..., secure=...)``): it masks the summable reply; None without secure
        aggregation."""
        return self.secure.client(agent_id) if self.secure is not None else None

    def rng(self, *path: str | int) -> np.random.Generator:
        return stream(self.seed, *path)

    def shared(self, name: str, make: Callable[[], Any]) -> Any:
        """The run's one object called ``name``, made by ``make()`` on first use.

        For simulator machinery a protocol's agents use together (a compute pool that batches
        their local training), never for protocol state: that travels in messages.
        """
        obj = self._shared.get(name)
        if obj is None:
            obj = self._shared[name] = make()
        return obj

    def shared_objects(self) -> dict[str, Any]:
        """Every object ``shared`` made so far, by name (checkpoints; a worker prepares the
        compute pools among them before real-time rounds)."""
        return dict(self._shared)

    def new_ranker(self):
        r = self.config.ranker
        kw = {}
        if r.kind == "mlp":
            own = REGISTRY.protocols[self.config.federation.protocol].mlp
            kw = {"hidden": tuple(r.hidden)}
            for key in ("activation", "init"):
                value = getattr(r, key) or own.get(key)
                if value:
                    kw[key] = value
        return make_ranker(r.kind, self.data.train.n_features, rng=self.rng("ranker-init"), **kw)

    def compute_scale(self, agent_id: str) -> float:
        """This client's device multiplier of local compute time (``network.compute_scale``)."""
        network = self.shared("network", self.config.new_network)
        return network.device_scale(agent_id, self.rng("device", agent_id))

    def click_model(self, name: str | None = None):
        return cascade(name or self.config.clicks.model, self.data.n_grades)

    def client_data(self, agent_id: str) -> ClientData | None:
        """This client's data under ``[federation.partition]`` (None: the run's defaults)."""
        return self.partition.by_agent.get(agent_id) if self.partition is not None else None

    def train_set(self, agent_id: str) -> QuerySet:
        """The training set a client's query numbers index (a partition may give it a view)."""
        own = self.client_data(agent_id)
        return own.train if own is not None and own.train is not None else self.data.train

    def users_click_model(self, agent_id: str):
        """The click model of a client's users (a partition may give each client its own)."""
        own = self.client_data(agent_id)
        if own is not None and own.click_model is not None:
            return own.click_model
        return self.click_model()

    def batch_of(self, agent_id: str) -> int:
        """Interactions per round of a client (a partition may vary it: non-IID type 4)."""
        own = self.client_data(agent_id)
        if own is not None and own.batch is not None:
            return own.batch
        return self.config.federation.queries_per_client

    def most_interactions(self, agent_id: str) -> int:
        """The most interactions one update of a client may report: its batch, or with a
        replayed log every query its user issued."""
        own = self.client_data(agent_id)
        if own is not None and own.arrivals is not None:
            return max(self.batch_of(agent_id), len(own.queries))
        return self.batch_of(agent_id)

    def local_work(self, agent_id: str, batch: int) -> int:
        """Interactions a client's next training does out of its ``batch`` (FLGo's
        completeness model may cut it short; the update then counts fewer)."""
        return batch if self.flgo is None else self.flgo.work(agent_id, batch)

    def evaluate(self, ranker, metrics: tuple[str, ...] = OFFLINE) -> dict[str, float]:
        """The ranker's offline ``metrics`` (``ltr.metrics.offline_metrics`` names) on the
        held-out queries (at most ``evaluation.max_test_queries``). With a partition that gives
        several label views of them (e.g. one per intent): nDCG@10 per view and their mean."""
        if self.partition is not None and self.partition.test_sets:
            views = self.partition.test_sets
            self.judged_queries = min(map(count_judged, views))
            return evaluate_views(ranker, views, self.config.evaluation.no_relevant)
        test = self.data.test
        cap = self.config.evaluation.max_test_queries
        if cap is not None and cap < test.n_queries:
            test = _capped(test, cap)
        self.judged_queries = count_judged(test)
        wants_clicks = any(m.startswith("maxrr") for m in metrics)
        return offline_metrics(
            held_out_scores(ranker, test.features),
            test,
            metrics,
            no_relevant=self.config.evaluation.no_relevant,
            p_click=self.click_model().p_click if wants_clicks else None,
        )


@heap.process_cache(maxsize=4)
def _capped(test: QuerySet, cap: int) -> QuerySet:
    return test.subset(np.arange(cap))


def held_out_scores(ranker, features: np.ndarray) -> np.ndarray:
    """The ranker's scores of held-out documents; a diverged model (nan or inf weights ranks
    every query in one tie, a constant nDCG that looks like a result) stops the run instead."""
    scores = ranker.score(features)
    if not np.isfinite(scores).all():
        raise FoltrError(
            "the model diverged: its scores of the held-out documents are not all finite"
            " (too large a federation.params.lr or attack scale?)"
        )
    return scores


def evaluate_views(ranker, views: tuple[QuerySet, ...], no_relevant: str) -> dict[str, float]:
    """nDCG@10 on label views of one held-out set (features shared: scored once), their mean
    as ``ndcg@10`` and each view's as ``ndcg@10/<view name>``."""
    scores = held_out_scores(ranker, views[0].features)
    out = {
        f"ndcg@10/{view.name}": offline_metrics(
            scores, view, ("ndcg@10",), no_relevant=no_relevant
        )["ndcg@10"]
        for view in views
    }
    return {"ndcg@10": float(np.mean(list(out.values()))), **out}


@dataclass(frozen=True)
class ClientData:
    """One client's data under a ``[federation.partition]`` (non-IID studies).

    ``None`` falls back to the run's default: the training set, the scenario's click model,
    ``federation.queries_per_client``. ``tests`` are the held-out label views the client's own
    users would judge by (for personalised evaluation, e.g. FedPer). ``arrivals`` (a replayed
    log): the simulated time each of ``queries`` is issued, ascending; the users then issue
    them in that order, once each, instead of drawing.
    """

    queries: np.ndarray
    train: QuerySet | None = None
    click_model: Any = None
    batch: int | None = None
    tests: tuple[QuerySet, ...] | None = None
    arrivals: np.ndarray | None = None


@dataclass
class Partition:
    """A partitioner's output: each client's data (in client order), the held-out label views
    the global model is scored on (empty: the test set as is), the global (IID) distribution
    for remedies that share data, and facts for results.json."""

    clients: list[ClientData]
    test_sets: tuple[QuerySet, ...] = ()
    global_data: ClientData | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    by_agent: dict[str, ClientData] = field(default_factory=dict)


@dataclass(frozen=True)
class PartitionEntry:
    """How ``[federation.partition]`` is checked (``params``, a ``@parameters`` class: the
    run reads it as ``config.partition``) and turned into client data (``build(ctx, n_clients,
    rng) -> Partition``); a module provides one (``PROVIDES``)."""

    help: str
    params: type
    build: Callable[[RunContext, int, np.random.Generator], Partition]
    #: its rules across keys, ``check(config)`` raising a ``ScenarioError``: the scenario
    #: loader's, on every variant with a partition (None: none)
    check: Callable[[RunConfig], None] | None = None

    @property
    def fields(self) -> dict[str, Any]:
        return self.params.FIELDS

    def install(self, registry: Registry) -> None:
        """Make this the partitioner ``[federation.partition]`` tables use (one per process;
        ``load_plugins`` calls it)."""
        if registry.partitioner is not None and registry.partitioner is not self:
            raise ValueError("a partitioner is already registered")
        registry.partitioner = self


def assign_queries(
    n_queries: int, n_clients: int, mode: str, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client's own query numbers: a disjoint shuffled partition, or the whole shared pool."""
    if mode == "shared":
        pool = np.arange(n_queries)
        pool.setflags(write=False)
        return [pool] * n_clients
    if n_clients > n_queries:
        raise ScenarioError(
            f"federation.clients: {n_clients} clients cannot each own queries of a training set "
            f'of {n_queries} queries; use federation.data = "shared" or more queries'
        )
    return np.array_split(rng.permutation(n_queries), n_clients)


class ProtocolRun(Checkpointed, ABC):
    """What a protocol's ``build(ctx)`` returns: the server strategy and its client agents.

    Subclasses set ``strategy`` and implement ``client``; the other hooks have safe defaults.
    Every attribute of a run is checkpoint state but the strategy, which is saved on its own.
    """

    strategy: Any
    checkpoint_skip = ("strategy",)
    #: True when its clients read per-client data (``RunContext.train_set`` / ``batch_of`` /
    #: ``users_click_model``), so ``[federation.partition]`` can apply.
    partitions: bool = False
    #: What it learns from when that is not the scenario's feature-vector dataset (CS-F-LTR:
    #: a text corpus); a ``dataset.path`` would then be silently unused, so it is refused.
    own_data: str | None = None
    #: Its own timeline actions (beyond ``GENERIC_ACTIONS``), which ``act`` carries out, each
    #: with the lifecycle state it leaves the agent in ("left", "crashed"; None: as it was),
    #: which a ZeroMQ server records for an agent whose worker is gone. FPDGD:
    #: ``{"unlearn": "left"}``. A timeline naming an action its protocol lacks is refused.
    actions: ClassVar[Mapping[str, str | None]] = MappingProxyType({})
    #: True when its clients ask ``RunContext.local_work`` how much to train (so FLGo's
    #: completeness models apply).
    completes: bool = False
    #: True when its clients replay a logged user's queries at their times
    #: (``ClientData.arrivals``, ``dataset.format = "aol4foltr"``).
    replays: bool = False

    @abstractmethod
    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        """A new honest client agent owning these query numbers."""

    def before_agents(
        self, queries: Mapping[str, np.ndarray], timeline: list[tuple[str, list[str]]]
    ) -> None:
        """Called in every process of the run before any agent is built, with each client's
        (attackers' too) query numbers and the timeline's actions and the agents they name
        (FPDGD's relevance reset relabels the data of the clients that will ask to be
        forgotten)."""

    def attach_server(self, server: ServerAgent) -> None:
        """Called once the server agent exists (e.g. to keep it: the round being played, a
        sender for the strategy's declared handlers)."""

    @classmethod
    def check(cls, config: RunConfig) -> None:
        """Its own rules across a variant's keys (a parameter another key rules out), run by
        the scenario loader on every variant, so ``validate`` reports them before any data is
        read: raise a ``ScenarioError`` naming the key and what was expected."""

    @classmethod
    def takes(cls) -> tuple[str, ...]:
        """Every timeline action a run of this protocol carries out."""
        return (*GENERIC_ACTIONS, *sorted(cls.actions))

    @classmethod
    def state_after(cls, action: str) -> str | None:
        """The lifecycle state ``action`` leaves an agent in (None: unchanged)."""
        return LIFECYCLE[action] if action in LIFECYCLE else cls.actions.get(action)

    def __init_subclass__(cls, **kwargs) -> None:
        """A protocol that declares its own actions carries them out: refused when defined,
        not when a timeline first reaches one."""
        super().__init_subclass__(**kwargs)
        if cls.actions and cls.act is ProtocolRun.act:
            raise TypeError(f"{cls.__name__} declares actions {sorted(cls.actions)} but no act()")

    async def act(self, agent: Agent, action: str) -> None:
        """A timeline action beyond the lifecycle on an agent of this process: one of
        ``actions`` (a subclass's ``act`` carries them out), or ``attack_start`` /
        ``attack_stop``, which go to the agent's ``on_attack(start)`` (``Agent``'s default
        ignores them)."""
        agent.on_attack(action == "attack_start")

    async def finish(self, server: ServerAgent, reports: list[RoundReport]) -> None:
        """After the last round (e.g. unlearning calibration rounds)."""

    def report(self) -> dict[str, Any]:
        """Protocol facts for results.json (privacy parameters, unlearning cost, ...)."""
        return {}

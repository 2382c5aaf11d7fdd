"""One run of one scenario variant: build the data, bus, agents and timeline, then play the rounds.

The protocol supplies the server strategy and the client agents; everything here is generic.
Measurement that is not part of any protocol (what users were shown, what an eavesdropper
guessed) goes through the ``Probe``, the simulator's oracle, never through messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import structlog

from foltr_async.config import RunConfig
from foltr_async.contract import (
    ClientData,
    Datasets,
    Partition,
    Probe,
    RunContext,
    assign_queries,
)
from foltr_async.errors import DatasetError, ScenarioError
from foltr_async.inputs import relative_note
from foltr_async.ltr.clicks import grade_scale
from foltr_async.ltr.threads import one_blas_thread
from foltr_async.observe.observer import Observer
from foltr_async.registry import REGISTRY
from foltr_async.rng import stream
from foltr_async.run_result import repeat_result
from foltr_async.run_saving import RunSaver
from foltr_async.run_state import Records, RunCheckpoint
from foltr_async.runtime import heap
from foltr_async.runtime.agent import Agent, client_id
from foltr_async.runtime.async_engine import AsyncServerAgent, AsyncStrategy
from foltr_async.runtime.bus import Bus, MemoryBus
from foltr_async.runtime.checkpoint import CheckpointError
from foltr_async.runtime.engine import RoundPlan, RoundReport, ServerAgent
from foltr_async.runtime.flgo import FlgoClient, FlgoSystem
from foltr_async.runtime.secure import SecureRun
from foltr_async.runtime.secure import build as build_secure
from foltr_async.timeline import Timeline, agent_groups

if TYPE_CHECKING:
    from foltr_async.ltr.aol import UserLog

log = structlog.get_logger()

#: an agent's role, from the run's group it is placed in (a behaviour's group: its entry's role)
ROLE_OF_GROUP = {"clients": "client", "attackers": "attacker", "eavesdroppers": "eavesdropper"}


@heap.process_cache(maxsize=4)
def _load(
    profile: str,
    path: str | None,
    n_queries: int | None,
    normalise: bool,
    seed: int | None,
    aol: tuple | None = None,
) -> Datasets:
    if aol is not None:
        from foltr_async.ltr.aol import load_aol

        n_users, min_queries, select, test_fraction = aol
        data = load_aol(
            path,
            n_users,
            min_queries=min_queries,
            select=select,
            seed=seed,
            test_fraction=test_fraction,
            normalise=normalise,
        )
        return Datasets(data.train, data.test, 3, data.users)
    if path is None:
        from foltr_async.ltr.synthetic import make_dataset

        splits = make_dataset(profile, seed, n_queries=n_queries)
        train, test = splits["train"], splits["test"]
    else:
        from foltr_async.ltr.data import load_fold, load_letor

        p = Path(path)
        if p.is_dir():
            splits = load_fold(p, normalise=normalise)
            train, test = splits["train"], splits.get("test")
        else:
            train = load_letor(p, normalise=normalise)
            test_file = p.with_name("test.txt")
            test = load_letor(test_file, normalise=normalise) if test_file.exists() else None
        if test is None:
            raise ScenarioError(f"dataset.path: {path}: no test.txt beside the training data")
    return Datasets(train, test, grade_scale(max(train.max_grade, test.max_grade)))


def load_datasets(cfg: RunConfig) -> Datasets:
    d = cfg.dataset
    aol = None
    if d.replayed:  # one user per client, attackers included
        aol = (cfg.n_clients, d.min_queries, d.select, d.test_fraction)
    return _load(d.profile, d.path, d.n_queries, d.normalise, cfg.data_seed, aol)


def flgo_clients(ctx: RunContext, queries: list[np.ndarray]) -> list[FlgoClient]:
    """What FLGo's modes read of each client (every client of the run, in id order): the
    labelled documents of its queries (FLGo's samples), their grades, its B."""
    out = []
    seen: dict[tuple[int, int], tuple[int, frozenset[int]]] = {}  # shared pools: once
    for i, q in enumerate(queries):
        aid = client_id(i)
        train = ctx.train_set(aid)
        key = (id(train), id(q))
        if key not in seen:
            rows = np.concatenate([np.arange(train.qptr[j], train.qptr[j + 1]) for j in q])
            seen[key] = (int(rows.size), frozenset(np.unique(train.labels[rows]).tolist()))
        out.append(FlgoClient(aid, *seen[key], ctx.batch_of(aid)))
    return out


def replay_partition(logs: tuple[UserLog, ...], time_scale: float, probe: Probe) -> Partition:
    """Client i replays user i's training queries, each ``offset / time_scale`` simulated
    seconds after the run starts (offsets count from the picked users' first training query).
    The probe counts what the replay did (``replay`` in results): queries played, empty
    updates (a synchronous client with no new query), holds (an asynchronous one waiting for
    its next query) and dispatches that found a client's log ended (it sends nothing)."""
    clients = [ClientData(u.queries, arrivals=u.offsets / time_scale) for u in logs]
    counts = [len(u.queries) for u in logs]
    probe.extras["replay"] = {"played": 0, "empty_updates": 0, "holds": 0, "exhausted": 0}
    last = max((float(u.offsets[-1]) for u in logs if len(u.offsets)), default=0.0)
    facts = {
        "users": [u.user for u in logs],
        "train_queries": int(sum(counts)),
        "queries_per_user": {"min": min(counts), "max": max(counts)},
        "time_scale": time_scale,
        "logged_span_s": last,
        "simulated_span_s": last / time_scale,
    }
    return Partition(clients, facts=facts)


class Remote(Protocol):
    """The server side of a multi-process transport (``foltr_async.distributed``).

    Agents hosted by other processes appear in the run as proxies (``remote = True``) with the
    attributes the run reads (``id``, ``role``, ``state``, ``rounds_joined``, ``last_kind``);
    their timeline actions, checkpoints and end-of-run measurements go through these calls.
    """

    def proxy(self, agent_id: str, group: str) -> Any:
        """The stand-in for an agent another process hosts."""

    async def begin_run(self, sim: Simulation, later: set[str], restore: dict | None) -> None:
        """Start the remote agents (all but ``later``, or as ``restore`` says); wait for them."""

    async def act(self, agent: Any, action: str, round: int) -> None:
        """Play one timeline action on a remote agent where it lives; wait until it is done."""

    async def snapshot(self, sim: Simulation) -> dict[str, dict]:
        """Between rounds: merge remote measurements into ``sim``; the remote agents' states."""

    async def end_run(self, sim: Simulation) -> None:
        """Stop the remote agents and merge their measurements (probe, extras, bus counters)."""

    def report(self) -> dict[str, Any]:
        """Transport facts for results.json (workers, frames, message rate, round latency)."""


class Simulation:
    """One repeat of one variant, run in virtual time on the memory bus.

    Multi-process runs use the same class: ``hosts(agent_id, group)`` says which agents this
    process builds (a worker builds its share of the clients); with ``remote`` the server's
    run stands proxies in for the others. ``checkpoint`` saves the run between rounds and, with
    a saved state, resumes from it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        seed: int,
        observer: Observer,
        variant: str = "default",
        repeat: int = 0,
        bus: Bus | None = None,
        *,
        hosts: Callable[[str, str], bool] | None = None,
        remote: Remote | None = None,
        checkpoint: RunCheckpoint | None = None,
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.observer = observer
        self.variant = variant
        self.repeat = repeat
        self.bus = bus or MemoryBus(cfg.new_network(), stream(seed, "net"))
        self.hosts = hosts
        self.remote = remote
        self.checkpoint = checkpoint
        self.agents: dict[str, Agent] = {}
        self.groups: dict[str, list[str]] = {"clients": [], "attackers": [], "eavesdroppers": []}
        #: its checkpoint state: what a checkpoint holds of this run, and loading it back
        self.saver = RunSaver(self)

    def emit(self, event: str, **fields: Any) -> None:
        log.info(event, variant=self.variant, repeat=self.repeat, **fields)
        self.observer.event(event, variant=self.variant, repeat=self.repeat, **fields)

    def build(self):
        """Data, run context, protocol and this process's agents (no server, nothing started)."""
        self.proto = self._build()
        return self.proto

    def _build(self):
        cfg, fed = self.cfg, self.cfg.federation
        try:
            data = load_datasets(cfg)
        except DatasetError as e:  # name the scenario key behind it
            path = cfg.dataset.path
            key = "dataset.path" if path else "dataset.n_queries"
            raise DatasetError(f"{key}: {e}{relative_note(path) if path else ''}") from None
        entry = REGISTRY.protocols[fed.protocol]
        self.probe = Probe()
        ctx = RunContext(cfg, self.seed, data, self.bus, self.probe, self.emit)
        self.ctx = ctx
        ctx.act = self.play
        proto = entry.build(ctx)
        # federation.secure_aggregation (build refuses a robust aggregator with it)
        self.secure: SecureRun | None = build_secure(ctx, REGISTRY)
        ctx.secure = self.secure  # clients and attackers are built with their halves
        n_clients = cfg.n_clients
        ctx.clock0 = getattr(self, "_sim0", 0.0)
        if data.logs is not None:  # a logged federation: each client replays one user
            ctx.partition = replay_partition(data.logs, cfg.dataset.time_scale, self.probe)
            ctx.partition.by_agent = {client_id(i): c for i, c in enumerate(ctx.partition.clients)}
            queries = [c.queries for c in ctx.partition.clients]
        elif fed.partition:  # non-IID: the partitioner gives each client its own data
            part = REGISTRY.partitioner.build(ctx, n_clients, ctx.rng("data"))
            part.by_agent = {client_id(i): c for i, c in enumerate(part.clients)}
            ctx.partition = part
            queries = [c.queries for c in part.clients]
        else:
            queries = assign_queries(data.train.n_queries, n_clients, fed.data, ctx.rng("data"))
        flgo = cfg.network.flgo
        if flgo is not None:
            ctx.flgo = FlgoSystem(flgo, flgo_clients(ctx, queries), data.test.labels, ctx.rng)
        # the agents' ids as they will be built: the timeline names them before they exist
        groups = agent_groups(fed.clients, cfg.n_attackers, cfg.n_eavesdroppers)
        self.timeline = Timeline(cfg.timeline, groups)
        proto.before_agents({client_id(i): q for i, q in enumerate(queries)}, self.timeline.actions)
        for i in range(fed.clients):
            aid = client_id(i)
            self._place(
                aid,
                "clients",
                lambda aid=aid, q=queries[i]: proto.client(aid, q, ctx.rng("client", aid)),
            )
        i = fed.clients
        n_eve = 0
        for group in cfg.agents:
            behaviour = REGISTRY.behaviours[group.behaviour]
            for _ in range(group.count):
                if group.role == "attacker":
                    aid, q = client_id(i), queries[i]
                    i += 1
                    kind = "attackers"
                else:
                    aid, q = f"eve-{n_eve}", None
                    n_eve += 1
                    kind = "eavesdroppers"
                self._place(
                    aid,
                    kind,
                    lambda b=behaviour, g=group, aid=aid, q=q: b.build(
                        ctx, proto, g, aid, q, ctx.rng("agent", aid)
                    ),
                )
        return proto

    def _place(self, aid: str, group: str, make: Callable[[], Agent]) -> None:
        """Build the agent here, stand a proxy in for it, or only know its id."""
        if self.hosts is None or self.hosts(aid, group):
            self._add(make(), group)
        elif self.remote is not None:
            self.agents[aid] = self.remote.proxy(aid, group)
            self.groups[group].append(aid)
        else:
            self.groups[group].append(aid)

    def _add(self, agent: Agent, group: str) -> None:
        # the group the scenario put the agent in is the one source of its role (on the bus,
        # for link rules, and on the console): an attack's class may inherit an honest client's
        agent.role = ROLE_OF_GROUP[group]
        self.agents[agent.id] = agent
        self.groups[group].append(agent.id)

    async def _act(self, i: int) -> None:
        """Timeline item ``i`` on each of its agents, wherever it lives."""
        action = self.timeline.items[i].action
        for aid in self.timeline.agents[i]:
            await self.play(aid, action)

    async def play(self, aid: str, action: str) -> None:
        """One action on an agent, wherever it lives, told to the observers (the timeline's,
        or a protocol's later phase through ``RunContext.act``)."""
        agent = self.agents[aid]
        if agent.remote:
            await self.remote.act(agent, action, self.server.plan_round)
        else:
            await self.act_locally(agent, action)
        self.emit(action, agent=aid, round=self.server.plan_round)
        self.observer.agent_changed(
            aid, agent.role, agent.state, agent.rounds_joined, agent.last_kind
        )

    async def act_locally(self, agent: Agent, action: str) -> None:
        """One timeline action on an agent of this process."""
        if action == "join" or action == "rejoin":
            if agent.state not in ("joined",):
                if agent.state == "new":
                    agent.start()
                else:
                    await agent.rejoin()
        elif action == "leave":
            await agent.leave()
        elif action == "crash":
            await agent.crash()
        else:  # the attack switch or the protocol's own (the scenario was checked against them)
            await self.proto.act(agent, action)

    async def run(self) -> dict:
        """One run (BLAS on one thread: ``threads.one_blas_thread``)."""
        with one_blas_thread():
            return await self._run()

    async def _run(self) -> dict:
        """The run's steps: start the clock, build, plan, make the server, resume from a
        checkpoint if there is one, start the agents, play, stop, collect the results."""
        self._start_clock()
        self.build()
        self._data_event()
        self._plan()
        self._make_server()
        if self._saved is not None:
            self._resume()
        else:  # the curves start at round 0: the model before any client trained
            self.records.initial = self.proto.strategy.evaluate()
        self._start_agents()
        heap.freeze()
        try:
            await self._play()
        finally:
            await self._stop()
            heap.thaw()
        return repeat_result(
            self, time.perf_counter() - self._wall0, self._loop.time() - self._sim0
        )

    def _data_event(self) -> None:
        """Log what the run reads, and which click tables its users follow (3 or 5 grades,
        chosen from the data's grades): events.jsonl then says so for every repeat."""
        d, data = self.cfg.dataset, self.ctx.data
        self.emit(
            "dataset",
            source=d.path or d.profile,
            train_queries=data.train.n_queries,
            test_queries=data.test.n_queries,
            features=data.train.n_features,
            max_grade=max(data.train.max_grade, data.test.max_grade),
            click_grades=data.n_grades,
        )

    def _start_clock(self) -> None:
        """Wall and simulated time zero; a resumed run continues the interrupted one's clock."""
        self._wall0 = time.perf_counter()
        self._loop = loop = asyncio.get_running_loop()
        saved = self._saved = self.checkpoint.state if self.checkpoint is not None else None
        self._sim0 = loop.time() if saved is None else saved["sim0"] + loop.time() - saved["now"]

    def _plan(self) -> None:
        """The round plan and empty records."""
        fed = self.cfg.federation
        self.plan = RoundPlan(
            rounds=fed.rounds,
            participation=fed.participation,
            min_clients=fed.min_clients,
            deadline=fed.deadline,
            round_gap=fed.round_gap,
            eval_every=self.cfg.evaluation.every,
        )
        self.records = Records()
        self._live_table = len(self.agents) <= 200  # per-agent updates where a table shows them

    def _make_server(self) -> None:
        """The server agent for the protocol's strategy (asynchronous ones get theirs)."""
        every = self.checkpoint.every if self.checkpoint is not None else 0
        asynchronous = isinstance(self.proto.strategy, AsyncStrategy)
        if asynchronous and self.checkpoint is not None:
            raise ScenarioError(
                f"federation.protocol: {self.cfg.federation.protocol!r} is asynchronous: "
                "expected no checkpoints (--checkpoint-every / --resume), its updates are "
                "always in flight"
            )
        self.server = (AsyncServerAgent if asynchronous else ServerAgent)(
            self.bus,
            self.proto.strategy,
            self.plan,
            stream(self.seed, "server"),
            clients=self._joined_clients,
            before_round=self._before_round,
            after_round=self._after_round,
            secure=self.secure.server if self.secure else None,
            checkpoint=self._checkpoint_round if every > 0 else None,
            flgo=self.ctx.flgo,
        )
        self.proto.attach_server(self.server)

    def _resume(self) -> None:
        """Load the checkpoint into the freshly built run."""
        saved = self._saved
        # agents by id, wherever the interrupted run hosted them (a run may resume on another
        # transport)
        self._saved_agents = {**saved["agents"], **saved["remote"]}
        try:
            self.saver.restore(saved, self._saved_agents)
        except CheckpointError as e:
            raise CheckpointError(f"{self.checkpoint.source}: {e}") from None
        self._wall0 -= saved["wall"]

    def _start_agents(self) -> None:
        """Start the server and this process's agents (as the checkpoint left them, or all
        but those the timeline joins later)."""
        self.server.start()
        for aid, agent in self.agents.items():
            if agent.remote:
                continue
            if self._saved is not None:
                was = self._saved_agents[aid]["state"]
                if was == "joined":
                    agent.start()
                elif was != "new":
                    agent.state = was
            elif aid not in self.timeline.joins_later:
                agent.start()
            self.observer.agent_changed(aid, agent.role, agent.state, agent.rounds_joined, None)

    async def _play(self) -> None:
        """Remote agents, timed timeline actions, the rounds, then the protocol's later phases."""
        saved, plan = self._saved, self.plan
        done = 0 if saved is None else saved["round"]
        if self.remote is not None:
            await self.remote.begin_run(
                self, self.timeline.joins_later, None if saved is None else self._saved_agents
            )
        for i in self.timeline.timed:
            at = self.timeline.items[i].time
            if saved is None or at > saved["now"] - saved["sim0"]:
                self._loop.call_at(self._sim0 + at, lambda i=i: asyncio.ensure_future(self._act(i)))
        if saved is not None and plan.round_gap:
            await asyncio.sleep(plan.round_gap)  # the gap after the checkpointed round
        reports = list(self.records.reports) + await self.server.run_rounds(skip=done)
        await self.proto.finish(self.server, reports)

    async def _stop(self) -> None:
        """Every local agent still joined leaves; remote agents stop where they live."""
        for agent in [*self.agents.values(), self.server]:
            if agent.state == "joined" and not agent.remote:
                await agent.leave()
        if self.remote is not None:
            await self.remote.end_run(self)

    # ------------------------------------------------------------------ the server's callbacks

    async def _before_round(self, r: int) -> None:
        """The timeline's actions for round ``r``."""
        for i in self.timeline.by_round.get(r, []):
            await self._act(i)

    def _after_round(self, report: RoundReport) -> None:
        """Record a finished round: agents' counts, events, the curve, observers."""
        for aid in report.clients:
            agent = self.agents.get(aid)
            if agent is not None:
                agent.rounds_joined += 1
                if self._live_table:
                    self.observer.agent_changed(
                        aid, agent.role, agent.state, agent.rounds_joined, agent.last_kind
                    )
        log.debug(
            "aggregation",
            variant=self.variant,
            repeat=self.repeat,
            round=report.round,
            selected=report.selected,
            replied=report.replied,
            aggregated=report.aggregated,
            **report.facts,
        )
        if not report.aggregated and not report.server_only:  # no update: say so where seen
            self.emit(
                "round_empty",
                round=report.round,
                online=report.online,
                selected=report.selected,
                replied=report.replied,
                min_clients=self.plan.min_clients,
            )
        if not self.records.reports:  # the first round loaded what training needs (compiled code)
            heap.refreeze()
        stats = self.bus.stats.as_dict()
        sim_time = self._loop.time() - self._sim0
        self.records.add(report, sim_time, self.probe.interactions)
        self.observer.round_done(
            self.variant,
            self.repeat,
            report.round,
            metrics=report.metrics,
            messages=stats,
            sim_time=sim_time,
        )

    def _joined_clients(self) -> list[str]:
        """Clients and attackers that are in the run now (the server selects among them)."""
        return [
            a
            for a in self.groups["clients"] + self.groups["attackers"]
            if self.agents[a].state == "joined"
        ]

    async def _checkpoint_round(self, report: RoundReport) -> None:
        """Every ``checkpoint.every`` rounds of the training phase: save the run."""
        if report.round <= self.plan.rounds and report.round % self.checkpoint.every == 0:
            await self.saver.save(
                report.round,
                self._loop.time(),
                self._sim0,
                time.perf_counter() - self._wall0,
            )

"""The one generic server loop every protocol runs on.

select -> broadcast -> collect until the simulated deadline -> (secure-aggregation unmask) ->
aggregate -> evaluate -> report. What is sent and how replies combine is the protocol's
``Strategy`` (compare Flower's configure/aggregate split); the engine only moves messages and
keeps time, so it knows nothing about any protocol.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from foltr_async.runtime.agent import Agent, declared_handlers
from foltr_async.runtime.bus import Bus
from foltr_async.runtime.flgo import FlgoSystem
from foltr_async.runtime.rounds import RoundPlan, Strategy
from foltr_async.runtime.secure import SecureServer
from foltr_async.runtime.wire import Envelope

log = structlog.get_logger()

#: refusals about a reply's values (not its shape): taken from the run's own agents
_VALUES = frozenset(("update_not_finite", "update_too_large"))


@dataclass
class RoundReport:
    round: int
    selected: int
    replied: int
    aggregated: bool
    metrics: dict[str, float] | None
    facts: dict = field(default_factory=dict)
    clients: list[str] = field(default_factory=list)  # who replied in time
    online: int | None = None  # clients online at the round's start
    duration: float = 0.0  # simulated seconds from the round's start to this report
    server_only: bool = False  # a round the server plays alone (``Strategy.asks_clients``)


class ServerAgent(Agent):
    """Runs the rounds; clients are reached only through the bus."""

    role = "server"
    #: Its own state between rounds; the rest is wiring (strategy, plan, callbacks, handlers)
    #: the rebuilt run makes again, and the strategy is checkpointed on its own.
    checkpoint_fields = ("rng", "late_replies", "counters", "last_kind", "plan_round")

    def __init__(
        self,
        bus: Bus,
        strategy: Strategy,
        plan: RoundPlan,
        rng: np.random.Generator,
        *,
        clients: Callable[[], list[str]],
        before_round: Callable[[int], Awaitable[None]] | None = None,
        after_round: Callable[[RoundReport], None] | None = None,
        agent_id: str = "server",
        secure: SecureServer | None = None,
        checkpoint: Callable[[RoundReport], Awaitable[None]] | None = None,
        flgo: FlgoSystem | None = None,
    ) -> None:
        super().__init__(agent_id, bus)
        self.strategy = strategy
        self.plan = plan
        self.rng = rng
        self._clients = clients
        self._before_round = before_round
        self._after_round = after_round
        #: awaited after ``after_round`` (between rounds, when no reply is pending): the run's
        #: checkpoint writer
        self._checkpoint = checkpoint
        self._round = 0
        self._expected: set[str] = set()
        self._replies: dict[str, Envelope] = {}
        self._all_in = asyncio.Event()
        self.late_replies = 0
        #: the round whose timeline actions are being played (set as each round opens)
        self.plan_round = 0
        self._side: dict[str, Callable[[Envelope], None]] = {}
        for kind, name in declared_handlers(type(strategy)).items():
            self.on(kind, getattr(strategy, name))
        #: secure aggregation (None: plaintext): its phases run around the collection, and the
        #: round's replies are its masked kind, unmasked into one plaintext reply
        self.secure = secure
        self._reply_kind = strategy.reply_kind
        if secure is not None:
            secure.attach(self)
        #: FLGo's system models (None: off): who is available, dropped replies, latencies
        self.flgo = flgo
        #: whether a round with nobody to ask lasts its deadline (in virtual time availability
        #: may change meanwhile; a real-time server with no worker online would only wait)
        self.wait_empty = True
        #: asked after every round: True ends the phase there (a server nobody serves)
        self.stop_when: Callable[[RoundReport], bool] | None = None
        #: whether an agent's replies come from another process (a worker): their values are
        #: screened too (``_screen``)
        self.untrusted: Callable[[str], bool] | None = None

    def on(self, kind: str, handler: Callable[[Envelope], None]) -> None:
        """Handle another message kind besides the round replies, as it is delivered: the
        strategy's declared handlers, secure aggregation's phase replies. Not through the inbox,
        so it must not await (a message may arrive while the server waits for a round)."""
        if inspect.iscoroutinefunction(handler):
            raise TypeError(f"the server's handler of {kind!r} must be a plain function")
        self._side[kind] = handler

    def deliver(self, env: Envelope) -> None:  # replies are collected here, other kinds dispatched
        if env.kind == self._reply_kind:
            self.last_kind = env.kind
            refused = self._screen(env)
            if refused is not None:  # a forged or corrupt reply: dropped and counted by reason
                self._drop(*refused, env)
                return
            if self.flgo is None or self.flgo.admit(env, self._take_reply):
                self._take_reply(env)
            return
        side = self._side.get(env.kind)
        if side is not None:
            self.last_kind = env.kind
            side(env)
            return
        super().deliver(env)

    def _screen(self, env: Envelope) -> tuple[str, str] | None:
        """Why the strategy refuses this reply, if it does. A reply of the run's own agents
        with NaN, inf or huge values is let through: its model then diverges and the run stops
        naming the learning rate; one from another process (``untrusted``) is dropped."""
        screen = getattr(self.strategy, "screen", None)
        if screen is None or env.kind != self.strategy.reply_kind:
            return None
        refused = screen(env)
        if refused is None or refused[0] not in _VALUES:
            return refused
        return refused if self.untrusted is not None and self.untrusted(env.src) else None

    def _take_reply(self, env: Envelope) -> bool:
        """Collect one reply of the round; False (counted late) when its round is over."""
        if env.round != self._round or env.src not in self._expected:
            self.late_replies += 1
            log.debug("late_reply", src=env.src, round=env.round, current=self._round)
            return False
        if env.src not in self._replies:
            self._replies[env.src] = env
            if len(self._replies) == len(self._expected):
                self._all_in.set()
        return True

    async def _open_round(self, r: int) -> None:
        """Round ``r`` begins: it is ``plan_round`` while ``before_round`` plays its actions."""
        self.plan_round = r
        if self._before_round is not None:
            await self._before_round(r)

    async def run_rounds(
        self,
        strategy: Strategy | None = None,
        plan: RoundPlan | None = None,
        first_round: int = 1,
        *,
        skip: int = 0,
    ) -> list[RoundReport]:
        """Play ``plan.rounds`` rounds numbered from ``first_round`` (a later phase, such as
        unlearning calibration, passes its own strategy and plan and continues the numbering).

        ``skip``: the phase's first ``skip`` rounds were played before a checkpoint this run
        resumes from; play the rest, evaluating on the same rounds as an uninterrupted run."""
        if strategy is not None:
            self.strategy = strategy
        if plan is not None:
            self.plan = plan
        loop = asyncio.get_running_loop()
        reports = []
        last = first_round + self.plan.rounds - 1
        for r in range(first_round + skip, last + 1):
            await self._open_round(r)
            t0 = loop.time()
            candidates = sorted(self._clients())
            online = self.bus.begin_round(r, candidates)
            if self.flgo is not None:
                online = self.flgo.available(r, online)
            selected = self.strategy.select(
                r, [c for c in candidates if c in online], self.rng, self.plan
            )
            self._round = r
            self._replies = {}
            self._all_in = asyncio.Event()
            secure = self.secure if self.secure and self.secure.covers(self.strategy) else None
            self._reply_kind = secure.masked_kind if secure else self.strategy.reply_kind
            takers = selected
            if secure is not None and selected:
                takers = await secure.setup(r, selected)  # e.g. key agreement, before the model
            self._expected = set(takers)
            if takers:
                if self.flgo is not None:
                    self.flgo.dispatched(takers, r)
                self.bus.broadcast(
                    self.id,
                    takers,
                    self.strategy.broadcast_kind,
                    self.strategy.configure_for(r, takers),
                    r,
                )
                deadline = loop.time() + self.plan.deadline
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._all_in.wait()
                except TimeoutError:
                    pass
            elif self.wait_empty:  # nobody to ask: the round lasts its deadline all the same
                await asyncio.sleep(self.plan.deadline)
            if self.flgo is not None:
                self.flgo.close_round()
            replies = [self._replies[k] for k in sorted(self._replies)]
            contributors = [e.src for e in replies]
            self._expected = set()
            facts: dict = {}
            aggregated = len(replies) >= max(1, self.plan.min_clients)
            if aggregated and secure is not None:
                total = await secure.unmask(r, replies)  # one plaintext reply: the sum
                aggregated = total is not None
                replies = [total] if total is not None else replies
            if aggregated:
                facts = self.strategy.aggregate(r, replies) or {}
            metrics = None
            if (r - first_round + 1) % self.plan.eval_every == 0 or r == last:
                metrics = self.strategy.evaluate()
            if secure is not None:
                facts["secure_aggregation"] = secure.facts(r)
            report = RoundReport(
                r,
                len(selected),
                len(contributors),
                aggregated,
                metrics,
                facts,
                contributors,
                sum(c in online for c in candidates),
                loop.time() - t0,
                not self.strategy.asks_clients,
            )
            reports.append(report)
            if self._after_round is not None:
                self._after_round(report)
            if self._checkpoint is not None:
                await self._checkpoint(report)
            if self.stop_when is not None and self.stop_when(report):
                break
            if self.plan.round_gap:
                await asyncio.sleep(self.plan.round_gap)
        return reports

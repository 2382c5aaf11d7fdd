"""Agents: asyncio tasks with an id, an inbox and one handler per message kind.

An agent learns about others only through messages. The bus calls ``deliver`` (synchronous,
never blocks) which queues the envelope; the agent's task takes envelopes one at a time and
awaits the handler registered for the kind, so one agent's handlers never interleave.
Anything that goes wrong with a message (no handler, a handler raising, the agent not
running) is a counted drop reported to the bus, never a crash of the loop.

Lifecycle: ``new`` -start()-> ``joined`` -leave()-> ``left`` | -crash()-> ``crashed``;
``rejoin()`` starts a left or crashed agent again under the same id. ``leave`` is graceful (the
``on_leave`` hook runs first, e.g. to say goodbye); ``crash`` is abrupt. Both unregister from
the bus, stop the task and lose the messages still in the inbox (counted ``not_running``).
Protocol state on the object survives; a subclass resets what a crash should lose in
``on_join``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import structlog

from foltr_async.runtime.checkpoint import Checkpointed
from foltr_async.runtime.wire import Envelope

if TYPE_CHECKING:
    from foltr_async.runtime.bus import Bus

__all__ = ["Agent", "Inbox", "client_id", "declared_handlers", "handles"]

log = structlog.get_logger()

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__foltr_handles__"


class Inbox:
    """The envelopes delivered to one agent and not yet handled, in order; one reader.

    ``asyncio.Queue`` without what a single unbounded reader never needs (putter and getter
    queues, task accounting): the reader waits on one future, set by the next ``put_nowait``.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Envelope] = deque()
        self._waiter: asyncio.Future | None = None

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, env: Envelope) -> None:
        self._items.append(env)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def get_nowait(self) -> Envelope:
        return self._items.popleft()

    async def get(self) -> Envelope:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


def client_id(i: int) -> str:
    """The id of the run's i-th client (honest clients first, then attackers): ``client-0007``."""
    return f"client-{i:04d}"


def handles(kind: str, *more: str) -> Callable[[F], F]:
    """Method decorator: this (coroutine) method handles messages of these kinds."""
    kinds = (kind, *more)

    def mark(fn: F) -> F:
        setattr(fn, _MARK, getattr(fn, _MARK, ()) + kinds)
        return fn

    return mark


def _secure_dispatch(agent: Agent, method: str, env: Envelope) -> None:
    # through ``agent.secure``, not a bound method: a checkpoint restore replaces the half
    getattr(agent.secure, method)(agent, env)


def declared_handlers(cls: type) -> dict[str, str]:
    """kind -> name of the method of ``cls`` marked ``@handles(kind)`` (subclass definitions
    win). Agents resolve theirs once per class; the round engine reads a strategy's the same
    way, so there is one way to declare a handler whatever receives the message."""
    names: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        own: dict[str, str] = {}
        for attr, val in vars(klass).items():
            for kind in getattr(val, _MARK, ()):
                if kind in own and own[kind] != attr:
                    raise TypeError(
                        f"{klass.__name__}: both {own[kind]} and {attr} handle {kind!r}"
                    )
                own[kind] = attr
        names.update(own)
    return names


class Agent(Checkpointed):
    """Base class of every participant (server, client, attacker, eavesdropper)."""

    role: str = "agent"
    #: hosted in this process (``distributed.server.RemoteAgent``, the stand-in for an agent
    #: another process hosts, says True)
    remote: ClassVar[bool] = False
    #: The run's machinery, rebuilt with it; the lifecycle ``state`` is checkpointed apart
    #: (it decides how the agent restarts). Every other attribute (a subclass's too) is state.
    checkpoint_skip = ("bus", "inbox", "_task", "_handlers", "state")
    #: kind -> method name, resolved once per class (subclass definitions win).
    _handler_names: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._handler_names = declared_handlers(cls)

    def __init__(self, agent_id: str, bus: Bus, secure: Any = None) -> None:
        """``secure``: the agent's secure-aggregation half (``runtime.secure.SecureClient``,
        ``RunContext.secure_half``) when the run masks its updates: its message kinds join the
        agent's handlers (one message at a time still) and ``reply`` masks through it."""
        self.id = agent_id
        self.bus = bus
        self.inbox = Inbox()
        self.state = "new"
        self.last_kind: str | None = None
        #: the round of the message being handled (set by ``dispatch``: a client's users show
        #: rankings in it, the online metric's order)
        self.round = 0
        self.rounds_joined = 0
        self.counters: Counter[str] = Counter()
        self._task: asyncio.Task | None = None
        self._handlers: dict[str, tuple[Callable[[Envelope], Any], bool]] = {}
        for kind, name in self._handler_names.items():
            fn = getattr(self, name)
            self._handlers[kind] = (fn, inspect.iscoroutinefunction(fn))
        self.secure = secure
        for kind, method in secure.kinds.items() if secure is not None else ():
            if kind in self._handlers:
                raise TypeError(f"{type(self).__name__} already handles {kind!r}")
            self._handlers[kind] = (partial(_secure_dispatch, self, method), False)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.state}>"

    @property
    def kinds(self) -> list[str]:
        """Message kinds this agent handles."""
        return sorted(self._handlers)

    # ---------------------------------------------------------------- messages

    def _drop(self, reason: str, detail: str, env: Envelope) -> None:
        self.counters[reason] += 1
        self.bus.report_drop(reason, detail, env.src, self.id, env.kind)

    def deliver(self, env: Envelope) -> None:
        """Called by the bus: queue the envelope if running, else a counted drop."""
        if self.state != "joined":
            self._drop("not_running", f"{self.id} is {self.state}", env)
            return
        self.counters["received"] += 1
        self.inbox.put_nowait(env)

    async def dispatch(self, env: Envelope) -> None:
        """Run the handler of ``env.kind``; failures are counted drops, never raised."""
        self.last_kind = env.kind
        self.round = env.round
        entry = self._handlers.get(env.kind)
        if entry is None:
            self._drop("no_handler", f"{type(self).__name__} has no handler", env)
            return
        fn, is_coro = entry
        try:
            if is_coro:
                await fn(env)
            else:
                fn(env)
        except Exception as e:
            log.error(
                "handler_error",
                agent=self.id,
                kind=env.kind,
                src=env.src,
                error=repr(e),
                exc_info=True,
            )
            self._drop("handler_error", repr(e), env)
            return
        self.counters["handled"] += 1

    async def run(self) -> None:
        """The inbox loop: one message at a time, until the task is cancelled."""
        while True:
            await self.dispatch(await self.inbox.get())

    def send(self, dst: str, kind: str, body: dict, round: int = 0) -> None:
        if self.secure is not None and self.secure.spec.kind == kind:
            # the rule: the summable reply goes through ``reply``; sent here it would travel in
            # the clear under secure aggregation
            raise TypeError(
                f"{type(self).__name__}.send({kind!r}): {kind!r} is the reply secure aggregation "
                f"masks; send it with self.reply(dst, kind, body, round)"
            )
        self.bus.send(self.id, dst, kind, body, round)

    def reply(self, dst: str, kind: str, body: dict, round: int) -> None:
        """Send a round reply the server aggregates: masked when the agent has a secure half
        that sums ``kind``, else plain (``send``). Use it for the reply the protocol declared
        ``summable``: sent with ``send`` it would travel unmasked under secure aggregation."""
        if self.secure is not None and self.secure.spec.kind == kind:
            self.secure.submit(self, dst, body, round)
        else:
            self.send(dst, kind, body, round)

    def broadcast(self, dsts: Sequence[str], kind: str, body: dict, round: int = 0) -> None:
        self.bus.broadcast(self.id, dsts, kind, body, round)

    # ---------------------------------------------------------------- lifecycle

    async def on_join(self) -> None:
        """Hook: runs in the agent's task when it (re)joins, before any message."""

    async def on_leave(self) -> None:
        """Hook: runs on a graceful leave while still on the bus (not on a crash)."""

    def on_attack(self, start: bool) -> None:
        """Hook: the timeline's ``attack_start`` (``start`` True) / ``attack_stop``. An attacker
        that attacks only between them switches here; every other agent, and an attacker that
        attacks all run long, ignores them (this default)."""

    def start(self) -> asyncio.Task:
        """Register on the bus, become ``joined`` and spawn the inbox loop."""
        if self.state == "joined":
            raise RuntimeError(f"agent {self.id} has already joined")
        self.bus.register(self)
        self.state = "joined"
        self.counters["joins"] += 1
        self._task = asyncio.get_running_loop().create_task(self._main(), name=self.id)
        return self._task

    async def _main(self) -> None:
        try:
            await self.on_join()
        except Exception as e:
            log.error("on_join_error", agent=self.id, error=repr(e), exc_info=True)
            self.counters["on_join_error"] += 1
        await self.run()

    async def leave(self) -> None:
        """Graceful: ``on_leave``, then unregister and stop (no-op unless joined)."""
        if self.state != "joined":
            return
        try:
            await self.on_leave()
        except Exception as e:
            log.error("on_leave_error", agent=self.id, error=repr(e), exc_info=True)
            self.counters["on_leave_error"] += 1
        if self.state == "joined":  # on_leave may itself have crashed the agent
            await self._stop("left")

    async def crash(self) -> None:
        """Abrupt: unregister and stop at once; the inbox is lost (no-op unless joined)."""
        if self.state == "joined":
            await self._stop("crashed")

    async def rejoin(self) -> None:
        """Start a left or crashed agent again under the same id."""
        if self.state not in ("left", "crashed"):
            raise RuntimeError(f"agent {self.id} is {self.state}; only left or crashed rejoin")
        self.start()

    async def _stop(self, state: str) -> None:
        self.state = state
        self.bus.unregister(self.id)
        while not self.inbox.empty():
            self._drop(
                "not_running", f"{self.id} {state} before handling it", self.inbox.get_nowait()
            )
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        if task is not asyncio.current_task():  # called from its own handler: cancels on return
            await asyncio.wait((task,))

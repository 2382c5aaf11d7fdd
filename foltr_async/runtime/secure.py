"""Secure-aggregation hooks: the server learns only the (weighted) sum of the clients' updates.

Protocol-agnostic plumbing between a masking scheme (``protocols/secagg/``), the round engine
and the client agents; the protocol's own messages and strategy do not change:

- **client side**: a client sends its round reply with ``agent.reply(dst, kind, body, round)``
  instead of ``agent.send``. Without secure aggregation that *is* ``agent.send``; with it, the
  agent's ``SecureClient`` half (passed to ``Agent.__init__`` when the agent is built, from
  ``RunContext.secure_half``) masks ``weight * vector`` and ``weight`` (the
  ``Summable`` view of the reply) and sends the masked ring vector in its own kind. The half's
  handlers (key advertisement, share relay, unmask requests) join the agent's, so the agent still
  handles one message at a time.
- **server side**: ``ServerAgent.run_rounds`` calls ``SecureServer.setup`` after selecting the
  round's clients (phases before the broadcast, e.g. key agreement; returns who may take part),
  collects ``masked_kind`` replies instead of the strategy's, and calls ``SecureServer.unmask``,
  which turns them into *one* plaintext reply: the weighted mean with the total weight. FedAvg of
  that single reply is the FedAvg of the individual ones, so the strategy runs unchanged. Robust
  aggregators (Krum, median, ...) need the single updates and are refused with a one-line error.

A round that cannot be completed (too few clients left, too many dropouts to reconstruct the
masks) keeps the old model, like a round with too few replies; the reason is one line in the
round's facts, in ``events.jsonl`` (``secagg_failed``) and in ``results.json``.

The runtime never imports a protocol: ``foltr_async.plugins.load_plugins`` installs the schemes
a module provides in the registry, and each protocol's ``ProtocolEntry`` names its ``Summable``
reply there; ``check_config`` and ``build`` are handed that registry (``SecureNames``).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import structlog

from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.runtime.checkpoint import Checkpointed
from foltr_async.runtime.wire import Envelope

if TYPE_CHECKING:
    from foltr_async.params import Field
    from foltr_async.runtime.agent import Agent
    from foltr_async.runtime.rounds import RoundPlan, Strategy

__all__ = [
    "Phase",
    "Scheme",
    "SecureAggregationError",
    "SecureClient",
    "SecureRun",
    "SecureServer",
    "DEFAULT_SCHEME",
    "SecureNames",
    "Summable",
    "build",
    "check_config",
]

log = structlog.get_logger()

#: The source id of the one plaintext reply ``unmask`` hands to the strategy.
AGGREGATE_SRC = "secure-aggregate"


class SecureAggregationError(FoltrError):
    """A secure-aggregation round cannot complete (one line: round, who, what was needed)."""


# --------------------------------------------------------------------------- what can be summed


@dataclass(frozen=True)
class Summable:
    """How a protocol's reply becomes a weighted sum, and the sum a reply again.

    ``vector`` names the body's float array, ``weight`` its non-negative integer weight (``None``:
    every reply weighs 1). Clients mask ``[weight * vector, weight]``; the server turns the sum
    back into ``{vector: sum / total_weight, weight: total_weight}``.
    """

    kind: str
    vector: str
    weight: str | None = None

    def encode(self, body: Mapping[str, Any]) -> np.ndarray:
        """The vector a client contributes: ``[w * vector, w]`` (float64)."""
        v = np.asarray(body[self.vector], dtype=np.float64)
        w = float(body[self.weight]) if self.weight is not None else 1.0
        return np.append(w * v, w)

    def decode(self, total: np.ndarray) -> dict[str, Any]:
        """The body of one reply standing for the sum ``total = [sum w*v, sum w]``."""
        weight = float(total[-1])
        if not weight > 0.0:
            raise SecureAggregationError(f"the unmasked total weight is {weight}, not positive")
        body: dict[str, Any] = {self.vector: total[:-1] / weight}
        if self.weight is not None:
            body[self.weight] = int(round(weight))
        return body


# --------------------------------------------------------------------------- server side


class Phase:
    """One request/response step a server half drives: send, then collect until all are in or the
    simulated deadline passes. Replies of another round, kind or sender are counted as late."""

    def __init__(self, kind: str, round: int, expected: Iterable[str]) -> None:
        self.kind = kind
        self.round = round
        self.expected = frozenset(expected)
        self.got: dict[str, Envelope] = {}
        self._done = asyncio.Event()
        if not self.expected:
            self._done.set()

    def offer(self, env: Envelope) -> bool:
        """Keep ``env`` if this phase waits for it (first reply per sender wins)."""
        if env.kind != self.kind or env.round != self.round or env.src not in self.expected:
            return False
        if env.src not in self.got:
            self.got[env.src] = env
            if len(self.got) == len(self.expected):
                self._done.set()
        return True

    async def wait(self, deadline: float) -> dict[str, Envelope]:
        """Replies in sender order, once all are in or at ``deadline`` (loop time)."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._done.wait()
        except TimeoutError:
            pass
        return {k: self.got[k] for k in sorted(self.got)}


class RoundServer(Protocol):
    """What a scheme's server half uses of the round engine's ``ServerAgent`` (named here, not
    imported: the engine imports this module to drive the hooks)."""

    id: str
    plan: RoundPlan

    def on(self, kind: str, handler: Callable[[Envelope], None]) -> None: ...

    def send(self, dst: str, kind: str, body: dict, round: int = 0) -> None: ...

    def broadcast(self, dsts: Sequence[str], kind: str, body: dict, round: int = 0) -> None: ...


class SecureServer(Checkpointed, ABC):
    """The server half of a scheme, driven by ``ServerAgent.run_rounds``.

    Subclasses implement ``_setup`` and ``_unmask`` and raise ``SecureAggregationError`` when a
    round cannot complete; the public methods turn that into a skipped round with its reason.
    """

    #: The kind clients send their masked input in (collected instead of the strategy's reply).
    masked_kind: str
    #: Kinds of the clients' answers to the server's phases (collected by ``phase``).
    phase_kinds: tuple[str, ...] = ()

    def __init__(self, spec: Summable, deadline: float | None, emit: Callable[..., None]) -> None:
        self.spec = spec
        self.deadline = deadline
        self.emit = emit
        self.server: RoundServer | None = None
        self.failures: list[dict[str, Any]] = []
        self.late = 0
        self._phase: Phase | None = None
        self._facts: dict[int, dict[str, Any]] = {}

    def attach(self, server: RoundServer) -> None:
        """Called once by the server agent: route the phase replies here."""
        self.server = server
        for kind in self.phase_kinds:
            server.on(kind, self._on_phase_reply)

    def covers(self, strategy: Strategy) -> bool:
        """Masking applies to strategies whose replies are this protocol's summable kind (an
        unlearning calibration phase, with another reply kind, runs in plaintext)."""
        return strategy.reply_kind == self.spec.kind

    def _on_phase_reply(self, env: Envelope) -> None:
        if self._phase is None or not self._phase.offer(env):
            self.late += 1
            log.debug("secagg_late", src=env.src, kind=env.kind, round=env.round)

    async def phase(
        self,
        round: int,
        to: Iterable[str],
        request: str,
        body: dict | Callable[[str], dict],
        reply_kind: str | None,
    ) -> dict[str, Envelope]:
        """Send ``request`` to ``to`` (one ``body`` broadcast, or ``body(client)`` each) and
        collect the ``reply_kind`` answers until all are in or the phase deadline passes."""
        server = self.server
        assert server is not None, "attach() first"
        dsts = sorted(to)
        if reply_kind is not None:
            self._phase = phase = Phase(reply_kind, round, dsts)
        if callable(body):
            for dst in dsts:
                server.send(dst, request, body(dst), round)
        elif dsts:
            server.broadcast(dsts, request, body, round)
        if reply_kind is None:
            return {}
        loop = asyncio.get_running_loop()
        wait = server.plan.deadline if self.deadline is None else self.deadline
        got = await phase.wait(loop.time() + wait)
        self._phase = None
        return got

    async def setup(self, round: int, selected: list[str]) -> list[str]:
        """Phases before the round's broadcast; returns the clients that may send masked input
        (empty when the round cannot go on; the reason is in ``facts(round)``)."""
        self._facts[round] = {"selected": len(selected)}
        try:
            return await self._setup(round, selected)
        except SecureAggregationError as e:
            self._fail(round, e)
            return []

    async def unmask(self, round: int, replies: list[Envelope]) -> Envelope | None:
        """The masked replies (sorted by client id) as one plaintext reply of the strategy's kind,
        or None when the masks cannot be removed (the reason is in ``facts(round)``)."""
        try:
            body = self.spec.decode(await self._unmask(round, replies))
        except SecureAggregationError as e:
            self._fail(round, e)
            return None
        assert self.server is not None
        return Envelope(self.spec.kind, AGGREGATE_SRC, self.server.id, body, round)

    def _fail(self, round: int, error: SecureAggregationError) -> None:
        text = f"round {round}: {error}"
        self._facts.setdefault(round, {})["error"] = text
        self.failures.append({"round": round, "error": str(error)})
        self.emit("secagg_failed", round=round, error=str(error))

    def note(self, round: int, **facts: Any) -> None:
        """Record per-round facts (set sizes, reconstructions) for the round report."""
        self._facts.setdefault(round, {}).update(facts)

    def facts(self, round: int) -> dict[str, Any]:
        return self._facts.pop(round, {})

    @abstractmethod
    async def _setup(self, round: int, selected: list[str]) -> list[str]: ...

    @abstractmethod
    async def _unmask(self, round: int, replies: list[Envelope]) -> np.ndarray:
        """The plaintext sum ``[sum w*v, sum w]`` of the masked replies."""

    def report(self) -> dict[str, Any]:
        """Facts for results.json: failed rounds (the first 20 reasons) and late phase replies."""
        return {
            "failed_rounds": len(self.failures),
            "failures": self.failures[:20],
            "late_phase_replies": self.late,
        }


# --------------------------------------------------------------------------- client side


class SecureClient(ABC):
    """The client half of a scheme: its handlers join the agent's; ``submit`` masks a reply.

    A half is plain state with no reference to its agent (the agent is passed to every call), and
    the agent's handler table reaches it through ``agent.secure`` (``Agent.__init__`` takes it),
    so a checkpoint can capture and restore it like any other attribute.
    """

    #: message kind -> name of the method ``(agent, env) -> None`` that handles it
    kinds: ClassVar[dict[str, str]] = {}

    def __init__(self, spec: Summable) -> None:
        self.spec = spec

    @abstractmethod
    def submit(self, agent: Agent, dst: str, body: dict, round: int) -> None:
        """Mask and send (now or once the round's key material is in) a summable reply."""


# --------------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class SecureRun:
    """One run's secure aggregation: the server half and a maker of client halves."""

    server: SecureServer
    client: Callable[[str], SecureClient]  # agent id -> its half

    def report(self) -> dict[str, Any]:
        return {"secure_aggregation": self.server.report()}


@dataclass(frozen=True)
class Scheme:
    """A secure-aggregation scheme: its ``[federation.secagg]`` fields and a run builder
    ``build(ctx, spec, settings) -> SecureRun``."""

    name: str
    help: str
    fields: dict[str, Field]
    build: Callable[..., SecureRun]

    def install(self, registry: Any) -> None:
        """Put this scheme in ``registry.secure_schemes`` (``load_plugins`` calls it)."""
        old = registry.secure_schemes.get(self.name)
        if old is not None and old is not self:
            raise ValueError(f"secure-aggregation scheme {self.name!r} registered twice")
        registry.secure_schemes[self.name] = self


DEFAULT_SCHEME = "secagg"


class SecureNames(Protocol):
    """What this module uses of the plugin registry (``foltr_async.registry.Registry``, named
    here, not imported: the runtime sits below it)."""

    def summable(self, protocol: str) -> Summable | None: ...

    def summable_protocols(self) -> list[str]: ...

    def scheme(self, name: str = DEFAULT_SCHEME) -> Scheme: ...


def check_config(fed: dict, names: SecureNames, robust: bool, where: str = "") -> None:
    """The scenario-level rules: the protocol must sum its replies, the aggregator must not
    need single updates (one-line ScenarioError naming the key)."""
    at = f"{where}: " if where else ""
    if names.summable(fed["protocol"]) is None:
        raise ScenarioError(
            f"{at}federation.secure_aggregation: protocol {fed['protocol']!r} does not support "
            f"secure aggregation (supported: {', '.join(names.summable_protocols()) or 'none'})"
        )
    if robust:
        raise ScenarioError(
            f"{at}federation.aggregator: {fed['aggregator']!r} needs single updates and cannot "
            "combine with secure aggregation (the server sees only the sum); use 'fedavg' or "
            "set federation.secure_aggregation = false"
        )


def build(ctx: Any, names: SecureNames) -> SecureRun | None:
    """The run's secure aggregation from ``federation.secure_aggregation`` / ``secagg``, or None
    (the loader checked the pair with ``check_config``)."""
    fed = ctx.config.federation
    if not fed.secure_aggregation:
        return None
    return names.scheme().build(ctx, names.summable(fed.protocol), fed.secagg)

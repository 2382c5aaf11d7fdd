"""What modules provide, in one ``REGISTRY``: protocols, agent behaviours, aggregators, message
kinds, secure-aggregation schemes, the partitioner and eavesdroppers, each in its own section.

The runtime never imports a protocol. A protocol module (and any plugin module named in
``FOLTR_ASYNC_PLUGINS``) declares its entries in its ``PROVIDES``, and only
``foltr_async.plugins.load_plugins`` installs them here (the CLI and worker processes call it
before reading a scenario): importing a module changes no table. The runner looks entries up by
the scenario's names; a name missing (nothing loaded yet, say) is a one-line error.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.names import suggest
from foltr_async.params import Field
from foltr_async.runtime.schema import MESSAGE_KINDS, SchemaRegistry
from foltr_async.runtime.secure import DEFAULT_SCHEME, Scheme, Summable


@dataclass(frozen=True)
class ProtocolEntry:
    """A federated protocol: its parameters and a builder of one run (server strategy + clients)."""

    name: str
    help: str
    #: a ``@parameters`` class: ``[federation.params]`` checked against its ``FIELDS``, and what
    #: ``RunContext.params`` returns
    params: type
    #: its ``contract.ProtocolRun`` subclass: ``build(ctx)`` is one run; its class attributes
    #: (``actions``, ``partitions``, ``own_data``) and ``check(config)`` are the scenario
    #: loader's, on every variant before any run
    build: Callable[
        ..., Any
    ]  #: bytes of the largest message a run may send, from the variant's config and its data
    #: (``contract.model_message_bytes`` for model-sized messages); a ZeroMQ server refuses
    #: bigger frames. None: unknown, the codec's 16 MB limit applies.
    wire_bytes: Callable[[dict, Any], int] | None = None
    #: its authors' MLP ranker choices (``activation``, ``init``), used where the scenario's
    #: ``[ranker]`` leaves them unset
    mlp: dict[str, str] = field(default_factory=dict)
    #: its update as secure aggregation may sum it (None: the server needs each reply)
    summable: Summable | None = None

    @property
    def fields(self) -> dict[str, Field]:
        return self.params.FIELDS

    def install(self, registry: Registry) -> None:
        _put(registry.protocols, self)


@dataclass(frozen=True)
class BehaviourEntry:
    """A non-honest agent kind (attacker or eavesdropper) and the protocols it speaks."""

    name: str
    role: str  # "attacker" | "eavesdropper"
    help: str
    #: the protocol names it speaks (any collection: ``in`` and iteration)
    protocols: Collection[str]
    #: a ``@parameters`` class: the agent group's own keys (``params.of(group)`` reads them)
    params: type
    build: Callable[..., Any]
    #: its rules across the scenario's keys for one of its groups, ``check(config, group)``
    #: raising a ``ScenarioError``: the scenario loader's, on every variant (None: none)
    check: Callable[[Any, Any], None] | None = None

    @property
    def fields(self) -> dict[str, Field]:
        return self.params.FIELDS

    def install(self, registry: Registry) -> None:
        _put(registry.behaviours, self)


@dataclass(frozen=True)
class AggregatorEntry:
    """A pure function over updates; ``robust`` ones need single updates (no secure aggregation)."""

    name: str
    help: str
    fn: Callable[..., Any]
    robust: bool = False

    def install(self, registry: Registry) -> None:
        _put(registry.aggregators, self)


def _put(table: dict[str, Any], entry: ProtocolEntry | BehaviourEntry | AggregatorEntry) -> None:
    if entry.name in table and table[entry.name] is not entry:
        raise ValueError(f"{type(entry).__name__} {entry.name!r} registered twice")
    table[entry.name] = entry


class Table(dict):
    """One kind of entry by name; a missing name is a one-line ``FoltrError`` (``unknown``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def __missing__(self, name: str) -> Any:
        raise FoltrError(unknown(self.kind, name, self))


@dataclass
class Registry:
    """Every name a module can provide, one section per kind of entry. Each entry type knows
    its section: ``entry.install(registry)`` puts it there (``plugins.install`` calls it)."""

    protocols: dict[str, ProtocolEntry] = field(default_factory=lambda: Table("protocol"))
    behaviours: dict[str, BehaviourEntry] = field(default_factory=lambda: Table("behaviour"))
    aggregators: dict[str, AggregatorEntry] = field(default_factory=lambda: Table("aggregator"))
    #: message kinds and their body schemas (``runtime.schema.Kind``): the runtime's own table,
    #: the one the buses decode with
    message_kinds: SchemaRegistry = field(default_factory=lambda: MESSAGE_KINDS)
    #: secure-aggregation schemes by name (``runtime.secure.Scheme``)
    secure_schemes: dict[str, Scheme] = field(default_factory=dict)
    #: the ``contract.PartitionEntry`` that ``[federation.partition]`` tables use (one at most)
    partitioner: Any = None
    #: protocol name -> the ``protocols.eavesdrop.TapEavesdropper`` class that taps its messages
    eavesdroppers: dict[str, type] = field(default_factory=dict)

    def summable(self, protocol: str) -> Summable | None:
        """How secure aggregation may sum ``protocol``'s replies (its entry's ``summable``)."""
        entry = self.protocols.get(protocol)
        return None if entry is None else entry.summable

    def summable_protocols(self) -> list[str]:
        return sorted(name for name, entry in self.protocols.items() if entry.summable is not None)

    def scheme(self, name: str = DEFAULT_SCHEME) -> Scheme:
        entry = self.secure_schemes.get(name)
        if entry is None:
            raise ScenarioError(
                f"federation.secure_aggregation: no scheme {name!r} is registered "
                "(load_plugins imports it)"
            )
        return entry


REGISTRY = Registry()


def unknown(kind: str, name: Any, known: Collection[str]) -> str:
    """Why ``name`` is no registered ``kind`` (protocol, behaviour, aggregator), with the
    nearest name, the known ones and where a plugin's names come from."""
    got = "" if name is None else f" {name!r}"
    if not known:  # nothing loaded them: a program reading scenarios without the CLI
        return f"unknown {kind}{got}: no {kind}s are registered (call load_plugins() first)"
    hint = suggest(name, sorted(known)) if isinstance(name, str) else ""
    return (
        f"unknown {kind}{got}{hint}; known: {', '.join(sorted(known))} (a plugin's {kind}s "
        f"register when its module is named in {PLUGINS_ENV}; `python -m foltr_async list` "
        "shows every name)"
    )


#: Comma-separated modules imported after ``protocols`` (a protocol or attack kept outside the
#: package, e.g. ``examples.fedavgm``); worker processes inherit it with the environment.
PLUGINS_ENV = "FOLTR_ASYNC_PLUGINS"

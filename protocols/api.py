"""What a protocol or attack author imports: one module, each name with why it is here.

A protocol is a module under ``protocols/`` (or a plugin module, see docs/EXTENDING.md) that,
on import, registers its message kinds, a ``@parameters`` class and a ``ProtocolEntry``:

- ``register_kind(kind, schema)`` with ``Array`` / ``Int`` / ``Float`` / ``Str``: every message
  kind and its body's wire schema; a body that does not match is dropped on decoding.
- ``Agent`` and ``@handles(kind)``: a client is an agent with one handler per message kind;
  ``self.send(dst, kind, body, round)`` is the only way to tell another agent anything.
  ``client_id(i)`` is the one format of client ids. ``self.reply(dst, kind, body, round)``
  sends a client's round update (masked when the scenario turns secure aggregation on; an
  ``OnlineClient`` is built with its secure half); ``summable(protocol, kind, vector, weight)``
  declares that a protocol's update may be masked (its server only needs the weighted sum).
- ``Strategy``: the server side of one round (``configure_round`` -> the broadcast body,
  ``aggregate`` over the replies in client-id order, ``evaluate``); the round engine does the
  rest (selection, deadline, late replies, secure aggregation). The server's other messages
  are the strategy's plain methods marked ``@handles(kind)``, run as they are delivered.
- ``ProtocolRun``: one run of the protocol (its ``strategy``, a ``client`` factory, optional
  hooks); ``RunContext``: what a run may use (data, bus, probe, rankers, typed ``params``,
  named random streams ``ctx.rng(...)``, the scenario's aggregator, ``evaluate``). ``Probe``:
  the simulator's measurements beside the messages (what users were shown, oracle truths).
  ``ClientData``, ``Partition``, ``PartitionEntry`` and ``register_partitioner``: per-client
  data under ``[federation.partition]`` (``assign_queries``: the default query split;
  ``evaluate_views``: nDCG@10 per label view). All of these live in ``foltr_async.contract``,
  never in the orchestrator that plays the run.
- ``@parameters`` and ``param(default, help, min=..., ...)``: a frozen dataclass of the
  protocol's ``[federation.params]``; the scenario is checked against it (one-line errors) and
  code reads ``ctx.params.lr``.
- ``Users`` and ``K``: a client's users (their queries, clicks and the online metric) and the
  result-page length. ``OnlineClient`` (the one PDGD learner: a ranker copy, users,
  ``make_update`` for a round's training, batched across clients, and the hook an attacker
  overrides; ``serve(q)`` -> ``Served``) and
  ``ModelStrategy`` (broadcast the global weights, aggregate the replies' weights with the
  scenario's aggregator, evaluate) are the halves most protocols start from; ``OnlineRun``
  puts one of each together.
- ``REGISTRY``, ``ProtocolEntry``, ``BehaviourEntry``: where a protocol or agent behaviour
  registers the name a scenario uses.
"""

from foltr_async.contract import (
    ClientData,
    Partition,
    PartitionEntry,
    Probe,
    ProtocolRun,
    RunContext,
    assign_queries,
    evaluate_views,
    register_partitioner,
)
from foltr_async.protocols.online import ModelStrategy, OnlineClient, OnlineRun, Served
from foltr_async.protocols.users import K, Users
from foltr_async.registry import REGISTRY, BehaviourEntry, ProtocolEntry
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.codec import Array, Float, Int, Str, register_kind
from foltr_async.runtime.engine import Strategy
from foltr_async.runtime.secure import summable
from foltr_async.scenario.fields import param, parameters

__all__ = [
    "K",
    "ModelStrategy",
    "OnlineClient",
    "OnlineRun",
    "Served",
    "REGISTRY",
    "Agent",
    "Array",
    "BehaviourEntry",
    "ClientData",
    "Float",
    "Int",
    "Partition",
    "PartitionEntry",
    "Probe",
    "ProtocolEntry",
    "ProtocolRun",
    "RunContext",
    "Str",
    "Strategy",
    "Users",
    "assign_queries",
    "client_id",
    "evaluate_views",
    "handles",
    "param",
    "parameters",
    "register_kind",
    "register_partitioner",
    "summable",
]

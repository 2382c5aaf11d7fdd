"""What a protocol or attack author imports: one module, each name with why it is here.

A protocol is a module under ``protocols/`` (or a plugin module, see docs/EXTENDING.md) that
declares what it provides in a module-level ``PROVIDES`` tuple: its message kinds, a
``ProtocolEntry`` (with its ``@parameters`` class), agent behaviours. Importing it changes
nothing; ``foltr_async.plugins.load_plugins`` installs each entry where it belongs:

- ``Kind(kind, schema)`` with ``Array`` / ``Int`` / ``Float`` / ``Str``: every message kind and
  its body's wire schema; a body that does not match is dropped on decoding.
- ``Agent`` and ``@handles(kind)``: a client is an agent with one handler per message kind;
  ``self.send(dst, kind, body, round)`` is the only way to tell another agent anything.
  ``client_id(i)`` is the one format of client ids. ``self.reply(dst, kind, body, round)``
  sends a client's round update (masked when the scenario turns secure aggregation on; an
  ``OnlineClient`` is built with its secure half); ``Summable(kind, vector, weight)`` in its
  ``ProtocolEntry`` declares that the update may be masked (its server only needs the weighted
  sum).
- ``Strategy``: the server side of one round (``configure_round`` -> the broadcast body,
  ``aggregate`` over the replies in client-id order, ``evaluate``); the round engine does the
  rest (selection, deadline, late replies, secure aggregation). The server's other messages
  are the strategy's plain methods marked ``@handles(kind)``, run as they are delivered.
  ``Strategy.screen(reply)`` says why a reply must not reach ``aggregate`` (it is then dropped
  and counted); ``screen_reply(body, vectors, max_abs, counts)`` is the check every protocol
  here uses: vectors of the model's length, finite and bounded, counts at most the client's.
- ``ProtocolRun``: one run of the protocol (its ``strategy``, a ``client`` factory, optional
  hooks, ``check(config)`` for its rules across keys, raising ``ScenarioError``);
  ``RunContext``: what a run may use (data, bus, probe, rankers, typed ``params``,
  named random streams ``ctx.rng(...)``, the scenario's aggregator, ``evaluate``) and
  ``ctx.config``, the variant's typed ``RunConfig`` (``config.federation.rounds``,
  ``config.n_clients``, ``config.agents``: each ``AgentGroup`` with its typed ``params``).
  ``Probe``: the simulator's measurements beside the messages (what users were shown, oracle
  truths).
  ``ClientData``, ``Partition`` and ``PartitionEntry`` (provided like the rest): per-client
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
  puts one of each together. The round a client's users show rankings in is the round of the
  message its agent handles: the runtime sets it (``Agent.round``), no handler has to.
- ``PDGDLearner``: the PDGD interaction loop a client trains with; a new local step is its
  keywords (``mu=``: FedProx's proximal term, ``clip=``: (bound, norm order) after every
  step), which keep it on the compiled batched path.
- ``FPDGDClient``: FPDGD's honest client, the class an attack on FPDGD derives from (override
  ``make_update``).
- ``model_message_bytes``: ``ProtocolEntry.wire_bytes`` for a protocol whose messages carry
  the model (the ZeroMQ hub's bound on one message).
- ``ProtocolEntry``, ``BehaviourEntry``: the name a scenario uses for a protocol or an agent
  behaviour (an attacker, an eavesdropper), and what it is built from.
"""

from foltr_async.config import AgentGroup, RunConfig
from foltr_async.contract import (
    ClientData,
    Partition,
    PartitionEntry,
    Probe,
    ProtocolRun,
    RunContext,
    assign_queries,
    evaluate_views,
    model_message_bytes,
)
from foltr_async.errors import ScenarioError
from foltr_async.params import param, parameters
from foltr_async.protocols.fpdgd import FPDGDClient
from foltr_async.protocols.learner import PDGDLearner
from foltr_async.protocols.online import ModelStrategy, OnlineClient, OnlineRun, Served
from foltr_async.protocols.users import K, Users
from foltr_async.registry import BehaviourEntry, ProtocolEntry
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.engine import Strategy
from foltr_async.runtime.rounds import screen_reply
from foltr_async.runtime.schema import Array, Float, Int, Kind, Str
from foltr_async.runtime.secure import Summable

__all__ = [
    "AgentGroup",
    "FPDGDClient",
    "PDGDLearner",
    "RunConfig",
    "ScenarioError",
    "model_message_bytes",
    "K",
    "ModelStrategy",
    "OnlineClient",
    "OnlineRun",
    "Served",
    "Agent",
    "Array",
    "BehaviourEntry",
    "ClientData",
    "Float",
    "Int",
    "Kind",
    "Partition",
    "PartitionEntry",
    "Probe",
    "ProtocolEntry",
    "ProtocolRun",
    "RunContext",
    "Str",
    "Strategy",
    "Summable",
    "Users",
    "assign_queries",
    "client_id",
    "evaluate_views",
    "handles",
    "param",
    "parameters",
    "screen_reply",
]

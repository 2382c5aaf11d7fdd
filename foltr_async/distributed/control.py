"""What a server and its workers must agree on: the control messages, the run digest, the limits.

Control protocol (simulator messages, not a protocol's; ``C`` frames of ``runtime.zmq_wire``)::

    worker -> hub   hello {worker, claims, run}       hub -> worker   welcome | wait {reason}
    hub -> worker   run {run, variant, repeat, seed, digest, code,
                         agents: {id: {state, blob, seq, seen}}}
    worker -> hub   ready {req, states: {id: [state, role]}}   | error {req, message}
    hub -> worker   act {run, agent, action, round}    -> ack {req, states}
    hub -> worker   snap {run, part}                   -> snapped_part {req, agents} ...
                                                          snapped {req, agents, flush}
    hub -> worker   end {run}                          -> done {req, flush}
    worker -> hub   oracle {run, key, value}  (a client's oracle truth, before its update)
    worker -> hub   flush {run, flush}        (before a client's message: shown, counters)
    hub -> worker   bye                       (the experiment is over: exit)

A *flush* carries what the worker measured since its last flush: displayed-ranking records
(the online metric), delivery counters and (at a checkpoint or the end) probe extras. A worker
is not trusted: what it may send is typed and bounded here (``WORKER_CONTROL``), and merged only
as far as it is about the clients the server assigned it (``runtime.trust.RunLedger``;
docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.registry import REGISTRY
from foltr_async.runtime.schema import Array, Bytes, Int, ListOf, Map, Opt, Spec, Str, Struct
from foltr_async.runtime.trust import Measured
from foltr_async.runtime.wire import DEFAULT_MAX_BYTES
from foltr_async.runtime.zmq_wire import HUB_CONTROL, WireLimits
from foltr_async.scenario.load import Scenario
from foltr_async.simulation import load_datasets

__all__ = ["WORKER_CONTROL", "run_digest", "wire_limits"]


def run_digest(config: RunConfig, data: Any) -> str:
    """What a worker's run must share with the server's: the variant's configuration (all but
    where the data lives) and the training data's shape and labels."""
    cfg = json.loads(json.dumps(config.as_dict(), default=str))
    cfg["dataset"].pop("path", None)
    train = data.train
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(np.asarray([train.n_queries, train.features.shape[0], train.n_features]).tobytes())
    h.update(np.ascontiguousarray(train.labels).tobytes())
    h.update(np.ascontiguousarray(train.qptr).tobytes())
    return h.hexdigest()[:32]


def wire_limits(scenario: Scenario) -> WireLimits:
    """What the hub accepts from a peer in this scenario's runs, from its largest variant.

    A data message is at most what the protocol declares (``ProtocolEntry.wire_bytes``: for
    model-sized messages a few models, a list of training queries or one entry per client),
    else the codec's 16 MB. A control frame carries measurements or saved client states, which
    a worker splits into parts of at most half a frame (``snapped_part``), so a frame of twice
    the largest message, at least 4 MB, fits every legal one.
    """
    message, clients = 0, 1
    for cfg in scenario.variants.values():
        bound = REGISTRY.protocols[cfg.federation.protocol].wire_bytes
        m = DEFAULT_MAX_BYTES if bound is None else bound(cfg, load_datasets(cfg))
        message = max(message, m)
        clients = max(clients, cfg.n_clients)
    return WireLimits(
        frame=max(4 << 20, 2 * message),
        message=message,
        hello=(64 << 10) + 9 * clients,  # a worker may claim every client (msgpack ints)
        clients=clients,
        items=max(1 << 16, 16 * clients),
    )


# --------------------------------------------------------------------------- control schemas


_STATES = Map(ListOf(Str(), max_len=2))
_FLUSH = Struct(
    {
        "shown": Struct(
            {
                "owners": ListOf(Str()),
                "owner": Array("int32"),
                "rounds": Array("int64"),
                "values": Array("float64"),
            }
        ),
        "extras": Map(Measured(), max_len=64),
        "stats": Struct(
            {
                "delivered": Int(min=0),
                "bytes_delivered": Int(min=0),
                "dropped": Map(Int(min=0), max_len=256),
                "kinds": Map(ListOf(Int(min=0), max_len=3), max_len=4096),
            }
        ),
    }
)
_SAVED = Struct({"state": Str(), "blob": Bytes(), "seq": Map(Int(min=0)), "seen": Map(Int(min=0))})


def _reply(**fields: Spec) -> Struct:
    return Struct({"t": Str(), "req": Int(), **fields})


#: What a worker may send the server; anything else is dropped and counted by the hub.
WORKER_CONTROL: dict[str, Struct] = {
    **HUB_CONTROL,
    "ready": _reply(states=_STATES),
    "ack": _reply(states=_STATES),
    "error": Struct({"t": Str(), "req": Opt(Int()), "message": Str(max_len=4000)}),
    "snapped": _reply(agents=Map(_SAVED), flush=_FLUSH),
    "snapped_part": _reply(agents=Map(_SAVED)),
    "done": _reply(flush=_FLUSH),
    "oracle": Struct({"t": Str(), "run": Int(), "key": Measured(), "value": Measured()}),
    "flush": Struct({"t": Str(), "run": Int(), "flush": _FLUSH}),
}

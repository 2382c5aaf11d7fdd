"""Centralised PDGD: the non-private baseline every FOLTR paper compares with.

Users still sit on clients and still see rankings from the current global model, but instead of
learning locally each client ships its raw interaction log (query, displayed ranking, clicks) to
the server, which learns with PDGD (Oosterhuis & de Rijke, CIKM 2018). To match FPDGD's budget and
update schedule (Wang et al., ICTIR 2021, Section 5), the server takes one step per round:
lr * (sum of the round's per-interaction PDGD gradients) / (number of reporting clients) — the
first-order equivalent of averaging the clients' B-step local trajectories. ``batch`` > 0 steps
every ``batch`` interactions instead (batch = 1 is classical online PDGD). A log its client's
users could not have produced (more interactions than the client's, a query number outside the
training set, a ranking that is not K distinct offsets within its query's list, clicks of
another shape or on padding) is dropped and counted before the server learns from it
(``CentralStrategy.screen``, docs/SECURITY.md).
"""

from __future__ import annotations

import numpy as np

from foltr_async.protocols.api import (
    Array,
    K,
    Kind,
    ModelStrategy,
    OnlineClient,
    OnlineRun,
    ProtocolEntry,
    handles,
    param,
    parameters,
    screen_reply,
)
from foltr_async.protocols.learner import PDGDLearner

MODEL = "central.model"
LOG = "central.log"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(MODEL, {"params": Array("float64", ndim=1)}),
    Kind(
        LOG,
        {
            "queries": Array("int64", ndim=1),
            "rankings": Array("int64", ndim=2),  # n x K document offsets, -1 pads short queries
            "clicks": Array("bool", ndim=2),
        },
    ),
)


@parameters
class Params:
    lr: float = param(0.1, "PDGD learning rate", min=0.0)
    batch: int = param(0, "interactions per step; 0 = one step per round (FPDGD's schedule)", min=0)


class LoggingClient(OnlineClient):
    """Shows the global model's rankings to its users and reports everything they did."""

    trains = False  # the server learns, from the logs

    def __init__(self, agent_id: str, ctx, queries, rng, **learner) -> None:
        super().__init__(agent_id, ctx, queries, rng, shows=True, **learner)

    @handles(MODEL)
    async def on_model(self, env) -> None:
        self.ranker.set_params(env.body["params"])
        queries, rankings, clicks = await self.learner.show(self.batch)
        self.send(
            env.src, LOG, {"queries": queries, "rankings": rankings, "clicks": clicks}, env.round
        )


class CentralStrategy(ModelStrategy):
    """The server learns with the one PDGD learner, from every reporting client's log."""

    broadcast_kind = MODEL
    reply_kind = LOG

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # its users are the clients': it only learns (learn_logged), never shows a ranking
        self.learner = PDGDLearner(
            ctx, np.empty(0, np.int64), ctx.rng("server-learner"), "server", lr=ctx.params.lr
        )

    def screen(self, reply) -> tuple[str, str] | None:
        """A log the client's users could have produced, or the reply is dropped: at most the
        client's interactions, every query a training query, every ranking K distinct
        document offsets within its query's list (-1 padding only at the end), clicks of the
        rankings' shape on shown documents only. A log out of range would otherwise crash the
        server's PDGD step or read another query's documents."""
        body = reply.body
        queries, rankings, clicks = body["queries"], body["rankings"], body["clicks"]
        n = queries.size
        most = {"queries": self.ctx.most_interactions(reply.src)}
        why = screen_reply({"queries": n}, {}, counts=most)
        if why is not None:
            return why
        if rankings.shape != (n, K) or clicks.shape != (n, K):
            return "log_wrong_shape", (
                f"rankings {rankings.shape} and clicks {clicks.shape} for {n} queries (K = {K})"
            )
        train = self.ctx.data.train
        if n and not (queries.min() >= 0 and queries.max() < train.n_queries):
            return "log_bad_query", f"query numbers outside 0..{train.n_queries - 1}"
        sizes = np.diff(train.qptr)[queries]
        padded = rankings < 0
        bad = (rankings < -1) | (rankings >= sizes[:, None])
        bad[:, :-1] |= padded[:, :-1] & ~padded[:, 1:]  # a shown document after the padding
        ordered = np.sort(rankings, axis=1)
        bad[:, 1:] |= (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)  # repeats
        if bad.any():
            return "log_bad_ranking", "rankings must be distinct offsets in their query"
        if (clicks & padded).any():
            return "log_bad_ranking", "a click on a padding slot"
        return None

    def aggregate(self, round: int, replies: list) -> dict:
        p = self.ctx.params
        scale = 1.0 / len(replies) if p.batch == 0 else 1.0
        logs = [r.body for r in replies]
        queries = np.concatenate([b["queries"] for b in logs])
        self.model = self.learner.learn_logged(
            self.model,
            self.ctx.data.train,
            queries,
            np.concatenate([b["rankings"] for b in logs]),
            np.concatenate([b["clicks"] for b in logs]),
            every=p.batch,
            scale=scale,
        )
        return {"interactions": len(queries)}


class CentralPDGD(OnlineRun):
    strategy_class = CentralStrategy
    client_class = LoggingClient

    def report(self) -> dict:
        return {"privacy": {"dp": False, "raw_clicks_leave_clients": True}}


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    ProtocolEntry(
        "pdgd_central", "centralised PDGD baseline: clients upload click logs", Params, CentralPDGD
    ),
)

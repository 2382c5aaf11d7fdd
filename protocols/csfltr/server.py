"""The server side: the strategy (FedAvg, or per-party evaluation in the local modes), which
also relays the parties' sketch queries under fresh tokens, and the run."""

from __future__ import annotations

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.contract import ProtocolRun, RunContext
from foltr_async.errors import ScenarioError
from foltr_async.protocols.csfltr.canary import CanaryParty
from foltr_async.protocols.csfltr.corpus import (
    N_FEATURES,
    PartyIndex,
    corpus_for,
    party_hashes,
    party_index,
    query_terms,
    test_set,
)
from foltr_async.protocols.csfltr.measurement import Measurements
from foltr_async.protocols.csfltr.messages import MODEL, QUERIES, STATS, UPDATE
from foltr_async.protocols.csfltr.party import Party
from foltr_async.protocols.csfltr.primitives import evaluate
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.engine import Strategy
from foltr_async.runtime.rounds import screen_reply


class CSFLTRStrategy(Strategy):
    """FedAvg (csfltr, global) or per-party evaluation only (local, local+); between the
    parties, the relay of sketch queries and collection statistics."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, run: CSFLTR) -> None:
        self.proto = run
        self.model = np.zeros(N_FEATURES)
        self.party_models: dict[str, np.ndarray] = {}
        self.generated = False
        self.routes: dict[int, tuple[str, int]] = {}  # relay token -> (querier, its request)
        self.last_token = 0

    def configure_round(self, round: int) -> dict:
        gen = not self.generated and self.proto.mode in ("csfltr", "local+")
        self.generated = True
        return {"params": self.model, "generate": gen}

    def turn(self, round: int) -> str:
        """round_robin: the party whose update becomes round ``round``'s model."""
        return self.proto.party_id((round - 1) % self.proto.corpus.n_parties)

    def select(self, round, candidates, rng, plan):
        if not self.proto.round_robin or round == 1:
            return super().select(round, candidates, rng, plan)
        # this round's party, or the next one online in turn
        n = self.proto.corpus.n_parties
        for step in range(n):
            pid = self.turn(round + step)
            if pid in candidates:
                return [pid]
        return []

    def screen(self, reply) -> tuple[str, str] | None:
        """A model of the features' length, finite and bounded, weighted (``n_queries``) by at
        most the party's training queries."""
        proto = self.proto
        p = proto.party_number(reply.src)
        most = proto.corpus.train_queries(p).size if p >= 0 else 0
        counts = {"n_queries": most}
        return screen_reply(reply.body, {"params": self.model.size}, counts=counts)

    def aggregate(self, round: int, replies: list) -> dict:
        for r in replies:
            self.party_models[r.src] = np.array(r.body["params"])
        if self.proto.round_robin:
            if replies:
                turn = self.turn(round)
                pick = next((r for r in replies if r.src == turn), replies[0])
                self.model = np.array(pick.body["params"])
            return {"parties": len(replies)}
        if self.proto.mode in ("csfltr", "global"):
            updates = np.stack([r.body["params"] for r in replies])
            weights = np.array([max(r.body["n_queries"], 1) for r in replies], dtype=np.float64)
            self.model = self.proto.ctx.aggregator.fn(
                updates, weights, self.proto.ctx.config.n_attackers
            )
        return {"parties": len(replies)}

    def evaluate(self) -> dict[str, float]:
        test = self.proto.test
        if self.proto.mode in ("csfltr", "global"):
            return evaluate(self.model, test)
        per = [evaluate(w, test) for _, w in sorted(self.party_models.items())]
        if not per:
            return evaluate(self.model, test)
        out = {k: float(np.mean([m[k] for m in per])) for k in per[0]}
        out["ndcg@10_min"] = float(min(m["ndcg@10"] for m in per))
        out["ndcg@10_max"] = float(max(m["ndcg@10"] for m in per))
        return out

    # -------------------------------------------------------------- relay

    @handles(*QUERIES)
    def forward(self, env) -> None:
        """A sketch query goes to its owner under a fresh token: the owner never learns who
        asked, and the answer finds its way back by the token."""
        self.last_token += 1
        self.routes[self.last_token] = (env.src, env.body["req"])
        body = {**env.body, "req": self.last_token}
        self.proto.server.send(env.body["owner"], env.kind, body, env.round)

    @handles(*QUERIES.values())
    def back(self, env) -> None:
        """An answer goes back to the querier under the request number it chose."""
        server = self.proto.server
        route = self.routes.pop(env.body["req"], None)
        if route is None:
            server.bus.report_drop(
                "no_handler", "answer to an unknown relay token", env.src, server.id, env.kind
            )
            return
        server.send(route[0], env.kind, {**env.body, "req": route[1]}, env.round)

    @handles(STATS)
    def publish(self, env) -> None:
        """Collection statistics go to every other party."""
        proto = self.proto
        for p in range(proto.corpus.n_parties):
            if proto.party_id(p) != env.src:
                proto.server.send(proto.party_id(p), STATS, env.body, env.round)


class CSFLTR(ProtocolRun):
    """One CS-F-LTR run: the corpus, the parties, the relaying server and the measurements."""

    own_data = "a text corpus (term statistics, federation.params.corpus)"

    @classmethod
    def check(cls, config: RunConfig) -> None:
        p = config.params
        if p.z1 > p.z:
            raise ScenarioError(f"federation.params.z1: expected at most z = {p.z}, got {p.z1}")
        if config.federation.clients < 2 and p.mode in ("csfltr", "local+"):
            raise ScenarioError("federation.clients: cross-silo modes need at least 2 parties")
        if config.n_attackers:
            raise ScenarioError("agents: csfltr has no attacker roles")
        if p.schedule == "round_robin" and p.mode not in ("csfltr", "global"):
            raise ScenarioError(
                f'federation.params.schedule: round_robin trains one shared model; mode "{p.mode}" '
                "trains every party alone (use csfltr or global)"
            )

    def __init__(self, ctx: RunContext) -> None:
        p = ctx.params
        self.ctx, self.mode, self.k = ctx, p.mode, p.k
        self.round_robin = p.schedule == "round_robin"
        self.probe = ctx.probe
        self.corpus = corpus_for(ctx)
        self.hashes = party_hashes(ctx.seed, p.z, p.w)
        self.stop = p.stopwords
        self.test = test_set(self.corpus, p.local_candidates, self.stop)
        self._numbers: dict[str, int] | None = None
        self.strategy = CSFLTRStrategy(self)
        self.measure = Measurements(ctx.probe, self.k, self.corpus, self.stop)

    def index(self, p: int) -> PartyIndex:
        return party_index(self.corpus, p, self.hashes, self.k, self.ctx.params.alpha, self.stop)

    def terms(self, q: int) -> np.ndarray:
        return query_terms(self.corpus, q, self.stop)

    def party_id(self, p: int) -> str:
        return client_id(p)

    def party_number(self, agent_id: str) -> int:
        """The party an id names (-1: none of this corpus's parties)."""
        if self._numbers is None:
            self._numbers = {self.party_id(p): p for p in range(self.corpus.n_parties)}
        return self._numbers.get(agent_id, -1)

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        # a worker process builds only its own parties: the number is in the id
        p = self.party_number(agent_id)
        if p < 0:
            raise ScenarioError(f"csfltr: unexpected party id {agent_id}")
        if p == 0 and self.ctx.params.canary:
            return CanaryParty(agent_id, self, p, rng)
        return Party(agent_id, self, p, rng)

    def attach_server(self, server) -> None:
        self.server = server  # the strategy's relay sends through it

    def report(self) -> dict:
        return {"csfltr": self.measure.report(self)}

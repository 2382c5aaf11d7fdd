"""The asynchronous server loop: the model changes as updates arrive, not once per round.

Synchronous rounds wait for the slowest selected client (or the deadline); with heterogeneous
devices the fast ones idle. An asynchronous server (FedAsync, Xie et al. 2019; FedBuff, Nguyen et
al. AISTATS 2022) hands the current model to every idle online client, folds each update in when
it arrives and gives that client the newest model at once, so clients keep training on the model
they hold. An update trained from model version ``v`` that arrives when the server is at version
``V`` has staleness ``V - v``; the envelope's ``round`` field carries ``v`` both ways.

The loop is generic (the runtime knows nothing about protocols): an ``AsyncStrategy`` says what a
dispatch carries and how one update changes the model. "Rounds" of the scenario become reporting
periods of ``strategy.period`` simulated seconds; at the start of each the bus re-draws who is
online (the network model's availability, once per period as once per round) and idle online
clients get the model, at most ``participation`` of the online ones training at a time (FedBuff's
concurrency). A client not heard from ``plan.deadline`` seconds after its dispatch (its update or
the model was dropped, or it went offline) is idle again. A period with no client online and
none training is an empty one, as a round with nobody to ask: without ``wait_empty`` (a
real-time server) it ends at once, and ``stop_when`` is asked after every period as after
every round. Models go out at the end of the
simulated instant in which they were asked for (one broadcast for every client freed in that
instant), so updates that arrive together are all applied before anyone gets the next model:
with equal devices and a buffer of every client, FedBuff then plays exactly the synchronous
rounds.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import structlog

from foltr_async.runtime.engine import RoundReport, ServerAgent
from foltr_async.runtime.rounds import round_half_up
from foltr_async.runtime.wire import Envelope

log = structlog.get_logger()


def staleness_summary(staleness: list[int]) -> dict:
    """Distribution of the staleness of applied updates: count, mean, quantiles, histogram."""
    if not staleness:
        return {"updates": 0}
    a = np.asarray(staleness)
    counts = np.bincount(a)
    return {
        "updates": int(a.size),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": int(a.max()),
        "histogram": {str(t): int(c) for t, c in enumerate(counts.tolist()) if c},
    }


class AsyncStrategy(ABC):
    """The server side of an asynchronous protocol: one update at a time."""

    broadcast_kind: str
    reply_kind: str
    #: simulated seconds per reporting period (one scenario "round")
    period: float

    @abstractmethod
    def configure(self, clients: list[str], version: int) -> dict:
        """Body of the dispatch of model ``version`` to these clients."""

    @abstractmethod
    def apply(self, reply: Envelope, staleness: int) -> bool:
        """Fold one update in; True when it produced a new model version."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current global model."""


@dataclass
class Dispatch:
    version: int
    at: float


class AsyncServerAgent(ServerAgent):
    """``run_rounds`` plays reporting periods of the asynchronous loop instead of rounds."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.version = 0
        self._busy: dict[str, Dispatch] = {}
        self._online: set[str] = set()
        self._to_send: list[str] = []
        self._flush_handle: asyncio.Handle | None = None
        self._period: dict = {}
        #: staleness of every applied update, in arrival order (results: its distribution)
        self.staleness: list[int] = []

    def _take_reply(self, env: Envelope) -> bool:
        sent = self._busy.get(env.src)
        if sent is None or sent.version != env.round:  # timed out and re-dispatched, or unknown
            self.late_replies += 1
            return False
        del self._busy[env.src]
        staleness = self.version - env.round
        self.staleness.append(staleness)
        p = self._period
        p["updates"] += 1
        p["clients"].add(env.src)
        p["staleness"].append(staleness)
        if self.strategy.apply(env, staleness):
            self.version += 1
        self._refill(env.src)
        return True

    def _refill(self, freed: str) -> None:
        """The finished client's slot goes to a uniformly drawn idle online client, itself among
        them (FedBuff keeps its concurrency by sampling anew); with full participation every
        online client is working, so it is the finished one, if still online."""
        if self.plan.participation >= 1.0:
            if freed in self._online:
                self._dispatch([freed])
            return
        working = set(self._busy) | set(self._to_send)
        idle = [c for c in sorted(self._online) if c not in working]
        if idle:
            self._dispatch([idle[int(self.rng.integers(len(idle)))]])

    def _dispatch(self, clients: list[str]) -> None:
        """Give these clients the newest model at the end of this simulated instant."""
        self._to_send += clients
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        clients, self._to_send = sorted(set(self._to_send)), []
        now = asyncio.get_running_loop().time()
        for c in clients:
            self._busy[c] = Dispatch(self.version, now)
        self._period["dispatched"] += len(clients)
        if self.flgo is not None:
            self.flgo.dispatched(clients, self.version)
        body = self.strategy.configure(clients, self.version)
        self.bus.broadcast(self.id, clients, self.strategy.broadcast_kind, body, self.version)

    def _start_period(self, r: int) -> None:
        """New availability draw; free timed-out clients; dispatch to idle online ones."""
        loop = asyncio.get_running_loop()
        candidates = sorted(self._clients())
        self._online = self.bus.begin_round(r, candidates) & set(candidates)
        if self.flgo is not None:
            self._online = self.flgo.available(r, self._online)
        now = loop.time()
        for c, d in list(self._busy.items()):
            if now - d.at >= self.plan.deadline or c not in candidates:
                del self._busy[c]
        online = [c for c in candidates if c in self._online]
        cap = len(online)
        if self.plan.participation < 1.0:
            share = round_half_up(self.plan.participation * len(online))
            cap = min(cap, max(self.plan.min_clients, share))
        working = set(self._busy) | set(self._to_send)  # training, or about to get a model
        room = cap - len(working & self._online)
        idle = [c for c in online if c not in working]
        if room > 0 and idle:
            if room < len(idle):
                picked = self.rng.choice(len(idle), size=room, replace=False)
                idle = [idle[i] for i in sorted(picked)]
            self._dispatch(idle)

    async def run_rounds(self, strategy=None, plan=None, first_round: int = 1, *, skip: int = 0):
        """Play ``plan.rounds`` reporting periods (evaluating every ``eval_every``-th)."""
        if strategy is not None or plan is not None or skip:
            raise ValueError("the asynchronous loop runs one phase, without checkpoints")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reports = []
        last = first_round + self.plan.rounds - 1
        for r in range(first_round, last + 1):
            await self._open_round(r)
            self._period = {"updates": 0, "dispatched": 0, "clients": set(), "staleness": []}
            v0 = self.version
            start = loop.time()
            self._start_period(r)
            end = t0 + (r - first_round + 1) * self.strategy.period
            wait = max(0.0, end - loop.time())
            if self.wait_empty or self._online or self._busy or self._to_send:
                await asyncio.sleep(wait)
            else:  # nobody to ask or to wait for: the period ends at once (real time)
                t0 -= wait
            metrics = None
            if (r - first_round + 1) % self.plan.eval_every == 0 or r == last:
                metrics = self.strategy.evaluate()
            p = self._period
            stale = p["staleness"]
            facts = {
                "version": self.version,
                "updates": p["updates"],
                "mean_staleness": sum(stale) / len(stale) if stale else None,
            }
            report = RoundReport(
                r,
                p["dispatched"],
                p["updates"],
                self.version > v0,
                metrics,
                facts,
                sorted(p["clients"]),
                len(self._online),
                loop.time() - start,
            )
            reports.append(report)
            if self._after_round is not None:
                self._after_round(report)
            if self.stop_when is not None and self.stop_when(report):
                break
        return reports

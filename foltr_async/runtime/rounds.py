"""What a round is made of: its plan and the protocol's server side (``Strategy``).

Below both the round engine (``engine.py``), which plays rounds with a strategy, and secure
aggregation (``secure.py``), which masks the replies of the strategies it covers, so neither
imports the other's module to name these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from foltr_async.runtime.checkpoint import Checkpointed
from foltr_async.runtime.wire import Envelope


@dataclass(frozen=True)
class RoundPlan:
    """How rounds are scheduled: who takes part, how long the server waits, when it evaluates."""

    rounds: int
    participation: float = 1.0  # fraction of online clients selected per round
    min_clients: int = 1  # fewer replies than this: the round keeps the old model
    deadline: float = 60.0  # simulated seconds the server waits for replies
    round_gap: float = 0.0  # simulated idle time between rounds (users come back later)
    eval_every: int = 1


class Strategy(Checkpointed, ABC):
    """The server side of a protocol: what a round broadcasts and how replies become a model.

    Other messages the server takes (an unlearning request, a relay) are the strategy's too:
    a plain method marked ``@handles(kind)``, as on an agent, which the server agent built with
    the strategy runs as each such message is delivered, between and during rounds alike.
    """

    broadcast_kind: str
    reply_kind: str
    #: False for a phase the server plays alone (FedRemove's replay of stored rounds): its
    #: rounds ask no client by design, so they are not reported as empty rounds
    asks_clients: ClassVar[bool] = True

    @abstractmethod
    def configure_round(self, round: int) -> dict:
        """Body of the round's broadcast (e.g. the global model)."""

    def configure_for(self, round: int, participants: list[str]) -> dict:
        """Body of the round's broadcast to ``participants``: ``configure_round``'s, unless the
        message depends on who (or how many) take part."""
        return self.configure_round(round)

    @abstractmethod
    def aggregate(self, round: int, replies: list[Envelope]) -> dict:
        """Fold the replies (sorted by client id) into the global model; return facts to log."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current global model."""

    def screen(self, reply: Envelope) -> tuple[str, str] | None:
        """Why a round reply must not reach ``aggregate`` (a drop reason and what is wrong), or
        None to take it. The server asks as each reply arrives: the codec checked its types,
        this checks what only the run knows (the model's length, a client's interactions)."""
        return None

    def select(
        self, round: int, candidates: list[str], rng: np.random.Generator, plan: RoundPlan
    ) -> list[str]:
        """Participants of a round: a seeded sample of the online clients (all by default)."""
        if plan.participation >= 1.0 or not candidates:
            return candidates
        n = max(plan.min_clients, round_half_up(plan.participation * len(candidates)))
        n = min(n, len(candidates))
        picked = rng.choice(len(candidates), size=n, replace=False)
        return [candidates[i] for i in sorted(picked)]


def round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


#: the largest |coordinate| a model a client sends may hold: far beyond what training reaches
#: (weights of normalised features), far below what overflows a dot product or a sum
MAX_ABS = 1e6


def screen_vector(
    body: dict, name: str, length: int, max_abs: float = MAX_ABS
) -> tuple[str, str] | None:
    """A reply's vector ``body[name]`` must have the model's ``length``, finite values and no
    coordinate beyond ``max_abs``: one float too many, NaN or x1e12 would otherwise end the run
    (in the aggregator, or as a "diverged" model the server never trained)."""
    vec = body[name]
    if vec.shape != (length,):
        return "update_wrong_length", f"{name} holds {vec.size} values, the model {length}"
    if not np.isfinite(vec).all():
        return "update_not_finite", f"{name} holds NaN or inf"
    big = float(np.abs(vec).max()) if vec.size else 0.0
    if big > max_abs:
        return "update_too_large", f"{name} holds {big:.3g} (at most {max_abs:.3g})"
    return None


def screen_interactions(
    body: dict, most: int, name: str = "n_interactions"
) -> tuple[str, str] | None:
    """A reply's ``n_interactions`` (its FedAvg weight) is at most what the client was given."""
    n = body[name]
    if n > most:
        return "update_interactions", f"{name} {n} > the client's {most}"
    return None


def screen_reply(
    body: dict,
    vectors: dict[str, int],
    max_abs: float = MAX_ABS,
    counts: dict[str, int] | None = None,
) -> tuple[str, str] | None:
    """The screen of a round reply made of vectors and counts (every protocol's ``screen``):
    each vector ``name: length`` present (an optional field of the kind's schema may be
    None), of its length, finite and within ``max_abs`` (``screen_vector``); each count
    ``name: most`` at most what the client was given (``screen_interactions``)."""
    for name, length in vectors.items():
        if body.get(name) is None:
            return "update_incomplete", f"{name} is missing"
        why = screen_vector(body, name, length, max_abs)
        if why is not None:
            return why
    for name, most in (counts or {}).items():
        why = screen_interactions(body, most, name)
        if why is not None:
            return why
    return None

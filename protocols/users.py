"""A client's users: they issue the client's own queries, look at a ranking and click.

Shared by every online protocol (FPDGD, FOLtR-ES, centralised PDGD) so that a displayed ranking
is scored for the online metric in exactly one way. The client owns only its query numbers; the
feature and label arrays are the shared read-only dataset.
"""

from __future__ import annotations

import numpy as np

from foltr_async.ltr.metrics import dcg_at_k, ideal_dcg
from foltr_async.ltr.queryset import QuerySet

K = 10


class Users:
    """Query sampling (or a logged user's queries in order), click simulation and
    online-metric recording for one client."""

    def __init__(
        self,
        train: QuerySet,
        queries: np.ndarray,
        click_model,
        rng: np.random.Generator,
        probe,
        owner: str = "",
        arrivals: np.ndarray | None = None,
        agent=None,
    ) -> None:
        self.owner = owner
        #: the agent whose users these are: the round they show rankings in is the round of
        #: the message it handles (``Agent.dispatch`` sets it; no protocol has to)
        self.agent = agent
        self._round = 0
        self.train = train
        self.queries = queries
        self.click_model = click_model
        self.rng = rng
        self.probe = probe
        self.ideal = ideal_dcg(train, K)  # cached per dataset, shared
        #: when a list, next_query appends each issued query (oracle truth for eavesdroppers)
        self.issued: list[int] | None = None
        #: a replayed log: when each of ``queries`` is issued (simulated s, ascending); None:
        #: queries are drawn uniformly at random
        self.arrivals = arrivals
        self.played = 0  # replay: queries issued so far, in order

    @property
    def round(self) -> int:
        return self.agent.round if self.agent is not None else self._round

    @round.setter
    def round(self, value: int) -> None:
        """For users no agent owns (a server stepping on logged interactions, a test)."""
        self._round = value

    def pending(self, now: float) -> int:
        """Replay: logged queries issued by simulated time ``now`` and not yet played."""
        return int(np.searchsorted(self.arrivals, now, side="right")) - self.played

    def next_arrival(self) -> float | None:
        """Replay: when the next unplayed query is issued (None: the log has ended)."""
        return float(self.arrivals[self.played]) if self.played < len(self.arrivals) else None

    def next_query(self, stream: np.random.RandomState | None = None) -> int:
        """The next query: drawn uniformly (from ``stream`` when given: FOLtR-ES's authors'
        streams) or a replayed log's next one."""
        if stream is not None:
            q = int(self.queries[stream.randint(0, len(self.queries))])
        elif self.arrivals is None:
            q = int(self.queries[self.rng.integers(len(self.queries))])
        else:  # the log's next query; callers ask ``pending`` first, so it has arrived
            q = int(self.queries[self.played])
            self.played += 1
        if self.issued is not None:
            self.issued.append(q)
        return q

    def show(
        self, q: int, ranking: np.ndarray, stream: np.random.RandomState | None = None
    ) -> np.ndarray:
        """The users see ``ranking`` (document offsets within query q) and click; returns clicks
        (drawn from ``stream`` in a cascade's scan order when given: FOLtR-ES's authors' streams).
        """
        labels = self.train.labels[self.train.doc_range(q)][ranking]
        if stream is not None:
            clicks = self.click_model.scan(labels, stream)
        else:
            clicks = self.click_model.simulate(labels, self.rng)
        ideal = self.ideal[q]
        self.record(float(dcg_at_k(labels, K)) / ideal if ideal > 0 else 0.0)
        return clicks

    def record(self, ndcg_value: float) -> None:
        """Report one displayed ranking's nDCG@10 to the simulator (the online metric)."""
        self.probe.displayed(ndcg_value, self.owner, self.round)

"""Non-IID client data in FOLTR (Wang & Zuccon, SIGIR 2022) and three remedies for FPDGD.

``[federation.partition]`` gives every client its own data; each option spreads values over the
clients (``assign``: in turn, or at random), and ``iid = true`` builds the IID counterpart of
the same options, in which every client draws from the mixture instead:

==========================  =================================  ==================================
option                      non-IID (one value per client)     IID counterpart
==========================  =================================  ==================================
``intents = [0, 1, ..]``    a client's users judge by one of   every client's queries come under
(type 1)                    these intents' labels (a dataset   each of them (a query issued is of
                            with intents, e.g.                 a uniformly random intent)
                            ``intent-change-like``)
``grades = R`` (type 2)     a client holds only documents of   clients hold whole queries
                            R relevance grades (#R = 1 or 2)
``click_models`` /          a client's users click by one      each interaction's click model is
``pbm_eta`` (type 3)        cascade model or one PBM eta       drawn from the list
``queries_per_round``       a client issues its own number of  every client issues the mean
(type 4)                    queries per round (1, 3, 5, ...)
==========================  =================================  ==================================

Queries go to clients as ``federation.data`` says (disjoint partition or shared pool); the
options above act on top. Every client's documents live in one stacked training set built once
per run (for each label view and grade subset that some client needs, the training queries with
only those documents), so clients still share read-only arrays and own only query numbers, and
FPDGD's batched training still runs them in one batch. A view's online nDCG is measured against
the documents its client holds. With ``intents`` the global model's offline nDCG@10 is the mean
over the listed intents' label views of the held-out queries (each also reported as
``ndcg@10/intentK``), for IID and non-IID alike. ``intents = [0]`` (every client the same
intent) is the IID baseline of the authors' code (``ielab/2022-SIGIR-noniid-foltr``): it asks
whether serving several intents at all costs effectiveness, where ``iid = true`` asks whether
their distribution over clients does. ``merge_intents = true`` is the study's published IID
baseline: one label view in which a document's grade is the highest any listed intent gives it
(relevant if relevant for any intent; the intent-change collection's merged judgements), used by
every client and by the offline evaluation (reported as ``ndcg@10/merged``).

Remedies (protocol ``fpdgd_remedies``: FPDGD with these parameters; all off, it is FPDGD):

- FedProx (Li et al., MLSys 2020), ``fedprox_mu``: every local PDGD ascent step also takes
  ``-lr * mu * (w - w_global)``, the gradient of the proximal term, pulling local models back.
- FedPer (Arivazhagan et al., 2019), ``fedper = true`` with an MLP ranker: the output layer is
  personal; a client trains from the global base layers plus its own output layer, keeps the
  output layer and sends the base (its output slice is the global one, so it never leaves the
  device). The deployed models are personal, so FedPer's ``ndcg@10`` is the mean over clients
  (up to ``eval_clients``) of their personal models on their own held-out views;
  ``ndcg@10_global`` is the global model's. ``fedper_mode = "study"`` runs and scores it as the
  SIGIR 2022 study's code does instead: a client still trains from its own output layer, but
  sends it with the base layers, so the server averages the personal layers into a complete
  global model, and ``ndcg@10`` is that global model on the evaluation views (the personal
  mean is ``ndcg@10_personal``).
- Data sharing (Zhao et al., 2018), ``share_alpha``: the server holds a globally shared set G
  (``share_size`` of the IID data's queries, i.e. of the (query, intent) pairs with intents,
  with users from the IID click mixture), warms the model up
  on it with ``warmup`` centralised PDGD interactions, and sends every client a random ``alpha``
  share of G (``noniid.shared``; query numbers stand for the shared documents, which the
  simulator keeps read-only) that the client mixes into local training: each local interaction
  draws uniformly from its own queries and its share. Interactions on shared data are training
  only, not shown to the client's users, so they do not enter the online metric.

FedProx's step, data sharing (its queries in the clients' training set) and per-client or mixed
click models train on the batched path like plain FPDGD (``PDGDLearner``: the same draws as one
query at a time, equal up to float rounding); FedPer needs an MLP, which batches when it has one
tanh hidden layer. A run's results name the path its learners took.
"""

from __future__ import annotations

import itertools

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.contract import (
    ClientData,
    Partition,
    PartitionEntry,
    RunContext,
    assign_queries,
    evaluate_views,
    model_message_bytes,
)
from foltr_async.errors import ScenarioError
from foltr_async.ltr.clicks import MODEL_NAMES, MixtureClickModel, cascade
from foltr_async.ltr.clicks import click_model as make_click_model
from foltr_async.ltr.pdgd import pdgd_interaction
from foltr_async.ltr.queryset import QuerySet
from foltr_async.params import Field, param, parameters
from foltr_async.protocols.fpdgd import FPDGD, FPDGDClient, FPDGDStrategy
from foltr_async.protocols.fpdgd import Params as FPDGDParams
from foltr_async.protocols.users import K, Users
from foltr_async.registry import ProtocolEntry
from foltr_async.runtime.agent import handles
from foltr_async.runtime.schema import Array, Kind

SHARED = "noniid.shared"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (Kind(SHARED, {"queries": Array("int64", ndim=1)}),)


@parameters
class PartitionParams:
    """``[federation.partition]``."""

    iid: bool = param(False, "the IID counterpart: every client draws from the mixture")
    intents: list = param(
        [],
        "type 1: intents spread over the clients (a dataset with intents); [] = the dataset's "
        "labels",
    )
    merge_intents: bool = param(
        False,
        "type 1's published IID baseline: one label view of the listed intents, a "
        "document's grade the highest any of them gives it (relevant if relevant for any)",
    )
    grades: int = param(
        0, "type 2: relevance grades (#R) of each client's documents; 0 = all", min=0
    )
    click_models: list = param([], "type 3: cascade click models spread over the clients")
    pbm_eta: list[float] = param(
        [], "type 3: PBM examination exponents spread over the clients", items=Field(float, min=0.0)
    )
    queries_per_round: list[int] = param(
        [], "type 4: queries per round spread over the clients", items=Field(int, min=1)
    )
    assign: str = param(
        "cycle", "values to clients in turn (cycle) or at random", choices=("cycle", "random")
    )


# ------------------------------------------------------------------------------ partitioner


def _slots(n_clients: int, n_values: int, how: str, rng: np.random.Generator) -> np.ndarray:
    """Which value each client gets: in turn (balanced) or uniformly at random."""
    if how == "cycle":
        return np.arange(n_clients) % n_values
    return rng.integers(n_values, size=n_clients)


def stack_views(
    base: QuerySet, blocks: list[tuple[np.ndarray, np.ndarray | None]], name: str = "stacked"
) -> tuple[QuerySet, list[np.ndarray]]:
    """One QuerySet holding, block after block, ``base``'s queries under other labels and
    document filters: block = (labels per base document, keep mask per document or None).

    Queries left without documents are dropped. Returns the set and, per block, the map from a
    base query number to its number in the set (-1: dropped). One gather, no per-query loop.
    """
    sizes = np.diff(base.qptr)
    qidx = np.repeat(np.arange(base.n_queries), sizes)
    docs, labels, counts, maps, qids = [], [], [], [], []
    start = 0
    for lab, keep in blocks:
        idx = np.arange(base.n_docs) if keep is None else np.flatnonzero(keep)
        per_q = np.bincount(qidx[idx], minlength=base.n_queries)
        has = per_q > 0
        qmap = np.full(base.n_queries, -1, dtype=np.int64)
        qmap[has] = start + np.arange(int(has.sum()))
        start += int(has.sum())
        docs.append(idx)
        labels.append(lab[idx])
        counts.append(per_q[has])
        qids.append(base.qids[has])
        maps.append(qmap)
    idx = np.concatenate(docs)
    qptr = np.zeros(start + 1, dtype=np.int64)
    np.cumsum(np.concatenate(counts), out=qptr[1:])
    qs = QuerySet(
        features=np.ascontiguousarray(base.features[idx]),
        labels=np.concatenate(labels).astype(np.int8),
        qptr=qptr,
        qids=np.concatenate(qids),
        name=name,
    )
    return qs, maps


def label_view(qs: QuerySet, labels: np.ndarray, name: str) -> QuerySet:
    """``qs`` judged by other labels: the same read-only features, offsets and ids."""
    return QuerySet(
        features=qs.features,
        labels=np.ascontiguousarray(labels, dtype=np.int8),
        qptr=qs.qptr,
        qids=qs.qids,
        name=name,
    )


def check_partition(config: RunConfig) -> None:
    """What the partition's keys rule out among themselves (the data's intents and grades are
    checked when it is built)."""
    spec = config.partition
    for i, name in enumerate(spec.click_models):
        if name not in MODEL_NAMES or name == "pbm":
            raise ScenarioError(
                f"federation.partition.click_models[{i}]: expected a cascade "
                f"model (perfect, navigational, informational, poison), got "
                f"{name!r}; use pbm_eta for position-based users"
            )
    if spec.merge_intents and not spec.intents:
        raise ScenarioError("federation.partition.merge_intents: needs intents to merge")


def _click_models(spec: PartitionParams, n_grades: int) -> list:
    models = [cascade(name, n_grades) for name in spec.click_models]
    for eta in spec.pbm_eta:
        models.append(make_click_model("pbm", n_grades, gamma_user=eta))
    return models


def build_partition(ctx: RunContext, n_clients: int, rng: np.random.Generator) -> Partition:
    """Every client's data under ``[federation.partition]`` (see the module docstring)."""
    spec = ctx.config.partition
    train, test = ctx.data.train, ctx.data.test
    cap = ctx.config.evaluation.max_test_queries
    if cap is not None and cap < test.n_queries:
        test = test.subset(np.arange(cap))
    iid, how = spec.iid, spec.assign
    facts: dict = {"iid": iid}

    # label views (type 1): one per intent, or the dataset's labels
    intents = spec.intents
    if intents:
        if train.intent_labels is None or test.intent_labels is None:
            raise ScenarioError(
                "federation.partition.intents: the dataset has no intents; use "
                'dataset.profile = "intent-change-like"'
            )
        n_int = len(train.intent_labels)
        for i, k in enumerate(intents):
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n_int:
                raise ScenarioError(
                    f"federation.partition.intents[{i}]: expected an intent in 0..{n_int - 1}, "
                    f"got {k!r}"
                )
        if spec.merge_intents:
            rows = list(intents)
            views = [train.intent_labels[rows].max(axis=0)]
            test_sets = (
                ctx.shared(
                    "noniid.test.merged",
                    lambda: label_view(test, test.intent_labels[rows].max(axis=0), "merged"),
                ),
            )
        else:
            views = [train.intent_labels[k] for k in intents]
            test_sets = tuple(
                ctx.shared(
                    f"noniid.test.{k}",
                    lambda k=k: label_view(test, test.intent_labels[k], f"intent{k}"),
                )
                for k in intents
            )
    else:
        views = [train.labels]
        test_sets = ()
    n_views = len(views)
    client_view = (
        None if iid or n_views == 1 else _slots(n_clients, n_views, how, rng)
    )  # None: every view

    # grade subsets (type 2)
    n_grades = ctx.data.n_grades
    r = spec.grades
    if r > n_grades:
        raise ScenarioError(
            f"federation.partition.grades: expected at most {n_grades} (the "
            f"dataset's grades), got {r}"
        )
    subsets = [] if r in (0, n_grades) or iid else list(itertools.combinations(range(n_grades), r))
    client_subset = _slots(n_clients, len(subsets), how, rng) if subsets else None

    # one stacked training set: every (view, subset) block some client needs, plus the whole
    # views (the global distribution, for data sharing)
    needed = {(v, None) for v in range(n_views)}
    for c in range(n_clients):
        for v in range(n_views) if client_view is None else (client_view[c],):
            needed.add((int(v), None if client_subset is None else int(client_subset[c])))
    keys = sorted(needed, key=lambda t: (t[1] is not None, t[1] or 0, t[0]))
    if keys == [(0, None)]:  # one view of whole queries: no copy of the features
        if not intents:
            stacked = train
        else:
            merged = spec.merge_intents
            stacked = label_view(train, views[0], "merged" if merged else f"intent{intents[0]}")
        maps, block = [np.arange(train.n_queries)], {(0, None): 0}
    else:
        blocks = [(views[v], None if s is None else np.isin(views[v], subsets[s])) for v, s in keys]
        stacked, maps = stack_views(train, blocks)
        block = {key: i for i, key in enumerate(keys)}
    if stacked is not train:
        ctx.shared("noniid.train", lambda: stacked)  # checkpoints name it, never copy it

    own = assign_queries(train.n_queries, n_clients, ctx.config.federation.data, rng)
    models = _click_models(spec, n_grades)
    model_slot = None if not models or iid else _slots(n_clients, len(models), how, rng)
    mixture = MixtureClickModel(tuple(models)) if models else None
    sizes = spec.queries_per_round
    size_slot = None if not sizes or iid else _slots(n_clients, len(sizes), how, rng)
    iid_batch = int(round(float(np.mean(sizes)))) if sizes and iid else None

    cache: dict = {}
    clients = []
    for c in range(n_clients):
        vs = range(n_views) if client_view is None else (int(client_view[c]),)
        s = None if client_subset is None else int(client_subset[c])
        key = (tuple(vs), s, id(own[c]))
        if key not in cache:  # clients of a shared pool with the same blocks share one array
            q = np.concatenate([maps[block[v, s]][own[c]] for v in vs])
            q = np.sort(q[q >= 0])
            q.setflags(write=False)
            cache[key] = q
        queries = cache[key]
        if queries.size == 0:
            raise ScenarioError(
                f"federation.partition: client {c} holds no documents of its "
                f"grades {subsets[s]}; use more queries per client or "
                'federation.data = "shared"'
            )
        users = models[int(model_slot[c])] if model_slot is not None else mixture
        batch = sizes[int(size_slot[c])] if size_slot is not None else iid_batch
        tests = (test_sets[vs[0]],) if test_sets and len(vs) == 1 else (test_sets or None)
        clients.append(
            ClientData(queries, None if stacked is train else stacked, users, batch, tests)
        )

    whole = np.concatenate([maps[block[v, None]] for v in range(n_views)])
    global_data = ClientData(np.sort(whole[whole >= 0]), stacked, mixture, None, test_sets or None)
    facts.update(
        intents=intents or None,
        merged_intents=bool(spec.merge_intents) or None,
        grade_subsets=[list(g) for g in subsets] or None,
        click_models=[getattr(m, "name", "pbm") for m in models] or None,
        queries_per_round=sizes or None,
        training_documents=int(stacked.n_docs),
    )
    return Partition(clients, test_sets, global_data, facts)


# ------------------------------------------------------------------------------ remedies


@parameters
class Params(FPDGDParams):
    fedprox_mu: float = param(0.0, "FedProx proximal weight mu (0: off)", min=0.0)
    fedper: bool = param(False, "FedPer: keep the ranker's output layer personal (MLP)")
    share_alpha: float = param(
        0.0, "data sharing: share of G sent to each client (0: off)", min=0.0, max=1.0
    )
    share_size: float = param(
        0.1, "data sharing: |G| as a share of the training queries", min=0.0, max=1.0
    )
    warmup: int = param(1000, "data sharing: the server's PDGD interactions on G", min=0)
    eval_clients: int = param(100, "FedPer: clients whose personal models are evaluated", min=1)
    fedper_mode: str = param(
        "personal",
        "FedPer: the output layer never leaves the device and ndcg@10 is the personal models' "
        "(personal), or, as the SIGIR 2022 study's code runs it, clients also send it, the "
        "server averages it and ndcg@10 is the global model's (study)",
        choices=("personal", "study"),
    )


class _Unseen:
    """A probe stand-in for training on shared data: no user saw those rankings."""

    def displayed(self, ndcg_value: float, owner: str = "", round: int = 0) -> None:
        pass


class RemedyClient(FPDGDClient):
    """A FPDGD client with the remedies its run enables."""

    def __init__(
        self, agent_id: str, ctx: RunContext, queries: np.ndarray, rng: np.random.Generator
    ) -> None:
        p = ctx.params
        # FedProx's step is batched with the others; training on shared data goes one query at
        # a time (the learner names its path in the results)
        super().__init__(agent_id, ctx, queries, rng, mu=p.fedprox_mu)
        self.fedper = p.fedper
        self.out = self.learner.ranker.layer_slices()["output"] if self.fedper else None
        self.head: np.ndarray | None = None  # FedPer: the personal output layer
        self.study = p.fedper_mode == "study"  # FedPer: the head is also sent (the study's code)

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        if not self.fedper:
            return await super().make_update(round, start)
        local = start.copy()
        if self.head is not None:
            local[self.out] = self.head
        theta = await super().make_update(round, local)
        self.head = theta[self.out].copy()
        if self.users.probe.oracle_read:
            # measurement only (never a message): the personal layer, for personalised evaluation
            self.users.probe.oracle["fedper.head", self.id] = self.head
        if not self.study:
            theta[self.out] = start[self.out]  # the personal layer stays on the device
        return theta

    @handles(SHARED)
    async def on_shared(self, env) -> None:
        """Data sharing: the server's share of G; train on it with the global users."""
        data = self.ctx.partition.global_data if self.ctx.partition is not None else None
        train = data.train if data is not None and data.train is not None else (self.ctx.data.train)
        users = (
            data.click_model
            if data is not None and data.click_model is not None
            else (self.ctx.click_model())
        )
        self.learner.shared_users = Users(
            train, env.body["queries"], users, self.learner.rng, _Unseen(), self.id
        )


class RemedyStrategy(FPDGDStrategy):
    """FPDGD's server plus data sharing (warm-up on G, shares sent) and FedPer evaluation."""

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        p = ctx.params
        self.alpha, self.fedper = p.share_alpha, p.fedper
        if self.fedper:
            ctx.probe.read_oracle()  # the clients' personal heads, for the personalised metric
        self.server = None
        self.shared: np.ndarray | None = None  # G, as query numbers of the global data
        self.sent: set[str] = set()
        self.rng = ctx.rng("server", "noniid")

    def _global_data(self) -> tuple[QuerySet, np.ndarray, object]:
        data = self.ctx.partition.global_data if self.ctx.partition is not None else None
        if data is None:
            return (
                self.ctx.data.train,
                np.arange(self.ctx.data.train.n_queries),
                (self.ctx.click_model()),
            )
        train = data.train if data.train is not None else self.ctx.data.train
        users = data.click_model if data.click_model is not None else self.ctx.click_model()
        return train, data.queries, users

    def _warm_up(self) -> None:
        """Pick G and train the initial global model on it (centralised PDGD, global users)."""
        p = self.ctx.params
        train, pool, users = self._global_data()
        n = max(1, int(round(p.share_size * len(pool))))
        self.shared = np.sort(self.rng.choice(pool, size=n, replace=False))
        ranker = self.ctx.new_ranker()
        ranker.set_params(self.model)
        for q in self.shared[self.rng.integers(n, size=p.warmup)].tolist():
            features, labels = train.query(q)
            pdgd_interaction(ranker, features, labels, users, self.rng, lr=p.lr, k=K)
        self.model = ranker.get_params()

    def select(self, round, candidates, rng, plan):
        picked = super().select(round, candidates, rng, plan)
        if self.alpha > 0:
            if self.shared is None:
                self._warm_up()
            size = max(1, int(round_half(self.alpha * len(self.shared))))
            for cid in picked:
                if cid not in self.sent:  # each client gets its share once, before its model
                    share = np.sort(self.rng.choice(self.shared, size=size, replace=False))
                    self.server.send(cid, SHARED, {"queries": share}, round)
                    self.sent.add(cid)
        return picked

    def evaluate(self) -> dict[str, float]:
        out = super().evaluate()
        if not self.fedper:
            return out
        heads = sorted(
            (aid, h) for (kind, aid), h in self.ctx.probe.oracle.items() if kind == "fedper.head"
        )[: self.ctx.params.eval_clients]
        if not heads:
            return {**out, "ndcg@10_global": out["ndcg@10"]}
        out_slice = self.ranker.layer_slices()["output"]
        values = []
        for aid, head in heads:
            theta = self.model.copy()
            theta[out_slice] = head
            self.ranker.set_params(theta)
            own = self.ctx.client_data(aid)
            tests = own.tests if own is not None and own.tests else None
            mode = self.ctx.config.evaluation.no_relevant
            values.append(
                evaluate_views(self.ranker, tests, mode)["ndcg@10"]
                if tests
                else self.ctx.evaluate(self.ranker)["ndcg@10"]
            )
        self.ranker.set_params(self.model)
        personal = float(np.mean(values))
        if self.ctx.params.fedper_mode == "study":
            return {**out, "ndcg@10_personal": personal, "personal_models": len(values)}
        return {
            "ndcg@10": personal,
            "ndcg@10_global": out["ndcg@10"],
            "personal_models": len(values),
        }


def round_half(x: float) -> int:
    return int(np.floor(x + 0.5))


class FPDGDRemedies(FPDGD):
    """FPDGD with FedProx, FedPer and data sharing (each off by default)."""

    @classmethod
    def check(cls, config: RunConfig) -> None:
        super().check(config)
        if config.params.fedper and config.ranker.kind != "mlp":
            raise ScenarioError(
                'federation.params.fedper: needs ranker.kind = "mlp" (a '
                "linear ranker is only its output layer)"
            )

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.strategy = RemedyStrategy(ctx)

    def attach_server(self, server) -> None:
        super().attach_server(server)
        self.strategy.server = server

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator):
        return RemedyClient(agent_id, self.ctx, queries, rng)

    def report(self) -> dict:
        out = super().report()
        p = self.ctx.params
        out["remedies"] = {
            "fedprox_mu": p.fedprox_mu,
            "fedper": p.fedper,
            "share_alpha": p.share_alpha,
            "shared_queries": None
            if self.strategy.shared is None
            else int(self.strategy.shared.size),
        }
        return out


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    PartitionEntry(
        "non-IID types 1-4 (Wang & Zuccon 2022) and their IID counterparts",
        PartitionParams,
        build_partition,
        check=check_partition,
    ),
    ProtocolEntry(
        "fpdgd_remedies",
        "FPDGD with non-IID remedies: FedProx (mu), "
        "FedPer (personal output layer), data sharing (alpha)",
        Params,
        FPDGDRemedies,
        wire_bytes=model_message_bytes,
    ),
)

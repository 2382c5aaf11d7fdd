"""A party (silo): the querier side builds its cross-party training data with private sketch
queries, the owner side answers other parties' queries with noise keyed by its secret, and each
round it trains ListNet locally."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.sketch import (
    Obfuscated,
    frequency_decoys,
    matched_decoys,
    median_estimate,
    noisy_answer,
    obfuscate,
    top_k,
    uniform_decoys,
)
from foltr_async.ltr.textfeatures import exact_features, field_features
from foltr_async.protocols.csfltr.corpus import (
    N_FEATURES,
    CorpusRun,
    block_norm,
    own_candidates,
    query_set,
)
from foltr_async.protocols.csfltr.messages import (
    MODEL,
    NAIVE_ANSWER,
    NAIVE_QUERY,
    RTK_ANSWER,
    RTK_QUERY,
    STATS,
    TF_ANSWER,
    TF_QUERY,
    UPDATE,
)
from foltr_async.protocols.csfltr.primitives import (
    STEPS,
    naive_answer,
    naive_top,
    rtk_answer,
    rtk_top,
)
from foltr_async.runtime.agent import Agent, handles


@dataclass
class _Pending:
    """A cross-party block under way: one own query against one owner."""

    q: int
    owner: int
    obf: Obfuscated
    docs: np.ndarray | None = None  # the owner's documents asked for (after the RTK answer)


class Party(Agent):
    """A silo: answers other parties' sketch queries and builds its own training data."""

    role = "client"

    def __init__(self, agent_id: str, run: CorpusRun, p: int, rng: np.random.Generator) -> None:
        super().__init__(agent_id, run.ctx.bus)
        self.proto, self.p, self.rng = run, p, rng
        self.noise_key = int(rng.integers(2**63))  # secret of the owner's answer noise
        prm = run.ctx.params
        self.eps, self.z1, self.beta = prm.epsilon, prm.z1, prm.beta
        self.corpus, self.hashes = run.corpus, run.hashes
        self.index = run.index(p)
        self.queries = np.array(
            [q for q in run.corpus.train_queries(p).tolist() if len(run.terms(q))], dtype=np.int64
        )
        cf = self.index.stats[1].cf.astype(np.float64)
        self.decoys = {
            "matched": lambda: matched_decoys(cf),
            "frequency": lambda: frequency_decoys(cf),
            "uniform": lambda: uniform_decoys(run.corpus.n_terms),
        }[prm.decoys]()
        self.local = {int(q): self._local_block(int(q)) for q in self.queries}
        self.cross: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # q -> owner -> block
        self.weights = np.zeros(N_FEATURES)
        self.train_set: QuerySet | None = None
        self.pending: dict[int, _Pending] = {}
        self.owner_stats: dict[int, dict] = {}
        self.held: list = []  # TF answers waiting for their owner's statistics
        self.naive: dict[int, tuple[int, int, Obfuscated]] = {}
        self.next_req = 0
        self.generating = False
        self.waiting: tuple[int, np.ndarray] | None = None  # (round, model) held until ready

    def _local_block(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        terms = self.proto.terms(q)
        docs = own_candidates(
            self.corpus, self.index, self.p, q, terms, self.proto.ctx.params.local_candidates
        )
        x = block_norm(exact_features(self.index.fields, self.index.stats, docs, terms))
        return x, self.corpus.labels(q, docs + self.corpus.party_ptr[self.p])

    # -------------------------------------------------------------- rounds

    @handles(MODEL)
    def on_model(self, env) -> None:
        body = env.body
        if body["generate"] and not self.generating and self.train_set is None:
            self.generating = True
            self.waiting = (env.round, np.array(body["params"]))
            self._generate()
            self._maybe_ready()
            return
        if self.generating:  # a later round arrived first: answer it when ready
            self.waiting = (env.round, np.array(body["params"]))
            return
        self._train_and_reply(env.round, np.array(body["params"]))

    def _train_and_reply(self, round: int, model: np.ndarray) -> None:
        if self.train_set is None:
            self.train_set = self._build_train_set()
        mode = self.proto.mode
        w = self.weights if mode in ("local", "local+") else model
        p = self.proto.ctx.params
        step = STEPS[p.learner]
        for _ in range(p.local_epochs):
            w = step(w, self.train_set, p.lr)
        self.weights = w
        self.send(
            "server",
            UPDATE,
            {
                "params": w,
                "n_queries": self.train_set.n_queries,
                "instances": self.train_set.n_docs,
            },
            round,
        )

    def _build_train_set(self) -> QuerySet:
        use_cross = self.proto.mode in ("csfltr", "local+")
        blocks, qids = [], []
        for q in self.queries.tolist():
            cross = self.cross.get(q, {}) if use_cross else {}
            parts = [self.local[q]] + [cross[o] for o in sorted(cross)]  # not arrival order
            y = np.concatenate([b[1] for b in parts])
            if y.any():  # ListNet learns nothing from a query without a relevant document
                blocks.append((np.vstack([b[0] for b in parts]), y))
                qids.append(str(self.corpus.query_ids[q]))
        ts = query_set(blocks, qids, f"{self.id}-train")
        self.proto.measure.instances(
            self.id,
            {
                "queries": ts.n_queries,
                "instances": ts.n_docs,
                "cross_instances": int(
                    sum(len(b[1]) for per in self.cross.values() for b in per.values())
                ),
            },
        )
        return ts

    # -------------------------------------------------------------- querier side

    def _generate(self) -> None:
        """Send one reverse top-K query per (own query, other party), and the NAIVE probes."""
        n_probe = self.proto.ctx.params.probe_terms
        ix, eps = self.index, self.eps
        self.send(
            "server",
            STATS,
            {
                "owner": self.id,
                "df": np.stack(
                    [noisy_answer(s.df, eps, self.rng, per="row") for s in ix.stats]
                ).astype(np.float32),
                "cf": np.stack(
                    [noisy_answer(s.cf, eps, self.rng, per="row") for s in ix.stats]
                ).astype(np.float32),
                "n_docs": int(ix.stats[0].n_docs),
                "total_len": np.array([s.total_len for s in ix.stats], dtype=np.float64),
            },
        )
        for o in range(self.corpus.n_parties):
            if o == self.p:
                continue
            owner = self.proto.party_id(o)
            for q in self.queries.tolist():
                terms = self.proto.terms(q)
                obf = obfuscate(terms, self.hashes, self.z1, self.rng, self.decoys)
                req = self._req()
                self.pending[req] = _Pending(q, o, obf)
                if self.proto.probe.oracle_read:
                    self.proto.probe.oracle[RTK_QUERY, self.id, req] = terms
                self.send(
                    "server",
                    RTK_QUERY,
                    {"req": req, "owner": owner, "cols": obf.cols, "signs": obf.signs},
                )
            probe = np.unique(np.concatenate([self.proto.terms(q) for q in self.queries.tolist()]))[
                :n_probe
            ]
            for t in probe.tolist():
                obf = obfuscate(np.array([t]), self.hashes, self.z1, self.rng, self.decoys)
                req = self._req()
                self.naive[req] = (t, o, obf)
                if self.proto.probe.oracle_read:
                    self.proto.probe.oracle[NAIVE_QUERY, self.id, req] = np.array([t])
                self.send(
                    "server",
                    NAIVE_QUERY,
                    {"req": req, "owner": owner, "cols": obf.cols, "signs": obf.signs},
                )

    def _req(self) -> int:
        self.next_req += 1
        return self.next_req

    @handles(RTK_ANSWER)
    def on_rtk_answer(self, env) -> None:
        b = env.body
        job = self.pending[b["req"]]
        t0 = time.perf_counter()
        m = job.obf.cols.shape[0]
        found, bounds = rtk_top(b, job.obf.private, self.proto.k, self.beta)
        # candidates: documents by their bounds summed over the query's terms
        alld, inv = np.unique(np.concatenate(found), return_inverse=True)
        score = np.bincount(inv, weights=np.concatenate(bounds), minlength=len(alld))
        cand = alld[np.lexsort((alld, -score))][: self.proto.ctx.params.pool]
        elapsed = time.perf_counter() - t0
        self.proto.measure.rtk(self.id, job.owner, self.proto.terms(job.q), found, elapsed / m)
        jd, _ = self.corpus.judged(job.q)
        off = self.corpus.party_ptr[job.owner]
        mine = jd[self.corpus.party_of(jd) == job.owner] - off
        docs = np.union1d(cand, mine).astype(np.int32)
        job.docs = docs
        self.send(
            "server",
            TF_QUERY,
            {
                "req": b["req"],
                "owner": self.proto.party_id(job.owner),
                "docs": docs,
                "cols": job.obf.cols,
                "signs": job.obf.signs,
            },
        )

    @handles(TF_ANSWER)
    def on_tf_answer(self, env) -> None:
        job = self.pending[env.body["req"]]
        if job.owner not in self.owner_stats:  # its statistics are still on their way
            self.held.append(env)
            return
        del self.pending[env.body["req"]]
        b = env.body
        docs = job.docs
        st = self.owner_stats[job.owner]
        terms = self.proto.terms(job.q)
        # counts are integers: rounding (post-processing) removes the sketch's small errors,
        # which the concave BM25 and the log-likelihoods would otherwise blow up at tf = 0
        tf = np.rint(median_estimate(b["tf"].astype(np.float64), job.obf.private))
        x = np.hstack(
            [
                field_features(
                    tf[f],
                    b["length"][f],
                    b["unique"][f],
                    st["df"][f][terms],
                    st["cf"][f][terms],
                    st["n_docs"],
                    st["total_len"][f],
                )
                for f in range(2)
            ]
        )
        glob = docs.astype(np.int64) + self.corpus.party_ptr[job.owner]
        y = self.corpus.labels(job.q, glob)
        # like the own candidates: the estimated BM25 top-n plus the judged documents
        keep = np.zeros(len(docs), dtype=bool)
        keep[top_k(x[:, 12], self.proto.ctx.params.candidates)] = True  # body BM25
        keep |= y > 0
        self.cross.setdefault(job.q, {})[job.owner] = (block_norm(x[keep]), y[keep])
        self.proto.measure.tf(self.id, job.owner, docs, terms, tf)
        self._maybe_ready()

    @handles(STATS)
    def on_stats(self, env) -> None:
        b = env.body
        o = int(b["owner"].rsplit("-", 1)[-1])
        self.owner_stats[o] = {
            "df": b["df"].astype(np.float64),
            "cf": b["cf"].astype(np.float64),
            "n_docs": b["n_docs"],
            "total_len": b["total_len"],
        }
        held, self.held = self.held, []
        for env2 in held:
            self.on_tf_answer(env2)

    @handles(NAIVE_ANSWER)
    def on_naive_answer(self, env) -> None:
        t, o, obf = self.naive.pop(env.body["req"])
        t0 = time.perf_counter()
        top = naive_top(env.body["values"], obf.private, self.proto.k)
        self.proto.measure.naive(self.id, o, t, top, time.perf_counter() - t0)
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        if self.generating and not self.pending and not self.naive:
            self.generating = False
            if self.waiting is not None:
                r, model = self.waiting
                self.waiting = None
                self._train_and_reply(r, model)

    # -------------------------------------------------------------- owner side

    def _noise(self, kind: str, *query: np.ndarray) -> np.random.Generator:
        """The generator of one answer's noise: keyed by this owner's secret and the query's
        content, so a repeated query gets the same answer (repeats cannot be averaged) and no
        answer depends on the order queries arrive in (memory and ZeroMQ runs agree)."""
        h = hashlib.blake2b(kind.encode(), digest_size=16)
        for a in query:
            h.update(np.ascontiguousarray(a).tobytes())
        d = h.digest()
        return np.random.default_rng(
            [self.noise_key, int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")]
        )

    async def on_leave(self) -> None:
        # every party leaves at the end of a run, before results (and workers' flushes)
        self.proto.measure.memory(self.id, self.index)

    @handles(RTK_QUERY)
    def on_rtk_query(self, env) -> None:
        t0 = time.perf_counter()
        b = env.body
        rng = self._noise(RTK_QUERY, b["cols"], b["signs"])
        answer = rtk_answer(self.index.rtk, b["cols"], self.eps, rng)
        self.proto.measure.time(
            self.id, "rtk_owner_s", (time.perf_counter() - t0) / b["cols"].shape[0]
        )
        self.send(env.src, RTK_ANSWER, {"req": b["req"], **answer})

    @handles(TF_QUERY)
    def on_tf_query(self, env) -> None:
        b = env.body
        docs = b["docs"].astype(np.int64)
        if len(docs) and (docs.min() < 0 or docs.max() >= self.index.fields[0].n_docs):
            raise ValueError(f"tf query names documents outside 0..{self.index.fields[0].n_docs}")
        cols, signs = b["cols"], b["signs"]
        ix = self.index
        tf = np.stack([s.lookup(docs, cols) * signs for s in ix.doc_sketch])  # (2, n, m, z)
        tf = self.answered_counts(b["req"], tf, cols, signs)
        noisy = noisy_answer(tf, self.eps, self._noise(TF_QUERY, cols, signs, docs))
        self.send(
            env.src,
            TF_ANSWER,
            {
                "req": b["req"],
                "tf": noisy.astype(np.float32),
                "length": np.stack([f.lengths[docs] for f in ix.fields]).astype(np.int32),
                "unique": np.stack([f.unique[docs] for f in ix.fields]).astype(np.int32),
            },
        )

    def answered_counts(
        self, req: int, tf: np.ndarray, cols: np.ndarray, signs: np.ndarray
    ) -> np.ndarray:
        """The counts a term-frequency answer releases (a canary owner changes them)."""
        return tf

    @handles(NAIVE_QUERY)
    def on_naive_query(self, env) -> None:
        t0 = time.perf_counter()
        b = env.body
        rng = self._noise(NAIVE_QUERY, b["cols"], b["signs"])
        values = naive_answer(self.index.doc_sketch[1], b["cols"], b["signs"], self.eps, rng)
        self.proto.measure.time(self.id, "naive_owner_s", time.perf_counter() - t0)
        self.send(env.src, NAIVE_ANSWER, {"req": b["req"], "values": values})

"""FOLtR-ES: federated online LTR with evolution strategies (Kharitonov, WSDM 2019).

Round: the server broadcasts ``foltr_es.model``; each client draws a seed, perturbs the model by
e ~ N(0, sigma^2 I) generated from that seed, serves half its B queries with theta + e and the other
half with theta - e (antithetic variates; deterministic ranking: sort by score), measures each
interaction's MaxRR@10 from its users' clicks, privatises it and replies ``foltr_es.seed_metric``
with only (seed, metric, antithetic metric): the means of the two halves. The server
regenerates every e from its seed, estimates the gradient of the expected metric as
(1 / (N sigma^2)) sum 1/2 (m+ - m-) e and takes an Adam ascent step (the reference code
minimises the negated estimate: the same step).

Privatisation (the paper's randomised response over the n = 11 MaxRR@10 values {0, 1/10, ...,
1/2, 1}): the true value is kept with probability p, otherwise one of the other n - 1 values is
sent, uniformly; epsilon = log(p (n - 1) / (1 - p)) per privatised value (infinite for p = 1).
By default (``privatise = "interaction"``) every interaction's MaxRR is privatised and the half's
mean of the privatised values is sent, as the authors' code does; ``privatise = "mean"`` (our
extension) rounds the half's true mean to the nearest level and privatises that once, so a client
releases two values per round instead of B (that rounding biases the metric even at p = 1).
Every message the server receives counts, aggregated or not (local DP: the release is the
message).

The authors' choices this module follows (their public code, facebookresearch/foltr-es; the
settings of its MQ2007/MQ2008 notebooks): rankers without randomness at the start, the linear
one (no bias) and the two-layer one (``ranker.kind = "mlp"``, ``hidden = [10]``: ReLU hidden
units with biases, a linear output without bias) with every parameter 0, the protocol's default
``ranker.activation = "relu"`` / ``ranker.init = "zero"``; a deterministic sort by score (ties: in
document order here, reversed there: ``np.argsort(scores)[::-1]``), the users examining the top 10;
MaxRR@10 from the clicks; sigma 0.01; antithetic halves of B // 2 queries; the gradient above
with 1 / (N sigma^2) and the 1/2 of the antithetic pair; Adam with lr 1e-3, betas (0.9, 0.999),
eps 1e-8; each query drawn uniformly, with replacement, from the whole training set
(``federation.data = "shared"``); features as the files hold them (``dataset.normalise`` false);
evaluation by the expected MaxRR@10 of the global ranker over every held-out query
(``maxrr@10``; nDCG@10 beside it). Their MQ2008 runs: 2,000 clients, B = 4, 2,000,000
interactions (250 rounds), p = 1.0 (0.9 for MQ2007).

One choice departs from their code on purpose: their client reseeds the generator of its users'
queries and clicks with the round's perturbation seed, so the noise and those draws come from
one stream (measured with their code, it ends their linear ranker ~0.015 MaxRR lower). Ours
draws them from independent streams (``streams = "independent"``); ``streams = "authors"``
(``AuthorsESClient``) restores their coupling, to reproduce their published numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.contract import ProtocolRun, RunContext, model_message_bytes
from foltr_async.errors import ScenarioError
from foltr_async.ltr.clicks import CascadeModel
from foltr_async.ltr.metrics import dcg_at_k, maxrr
from foltr_async.ltr.rankers import LinearRanker, MLPRanker
from foltr_async.ltr.serve_batch import linear_score, serve_linear
from foltr_async.observe.privacy import account, randomised_response
from foltr_async.params import param, parameters
from foltr_async.protocols.online import ModelStrategy, OnlineClient
from foltr_async.protocols.users import K
from foltr_async.registry import ProtocolEntry
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.compute import BatchPool
from foltr_async.runtime.schema import Array, Float, Int, Kind, Opt

#: its scenario name (``federation.protocol``), which its eavesdropper speaks
NAME = "foltr_es"
MODEL = "foltr_es.model"
SEED_METRIC = "foltr_es.seed_metric"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(MODEL, {"params": Array("float64", ndim=1)}),
    Kind(
        SEED_METRIC,
        {
            "seed": Int(min=0, max=2**63 - 1),
            "metric": Float(),
            "antithetic_metric": Opt(Float()),
            "n_interactions": Int(min=0),
        },
    ),
)

LEVELS = np.array([0.0] + [1.0 / r for r in range(K, 0, -1)])  # the 11 MaxRR@10 values
_LEVEL_OF = {v: i for i, v in enumerate(LEVELS.tolist())}

#: Fewer clients than this are served one query at a time (``ESClient._serve``): measured per
#: client, serving together is 2.5x slower for 1, even for 2, 1.3x faster for 3, 1.6x for 6.
MIN_BATCH = 3


@parameters
class Params:
    sigma: float = param(0.01, "perturbation standard deviation", min=1e-9)
    lr: float = param(0.001, "Adam learning rate", min=0.0)
    p: float = param(1.0, "privatisation: probability of sending the true metric", min=0.0, max=1.0)
    antithetic: bool = param(True, "serve half the queries with theta - e")
    privatise: str = param(
        "interaction",
        "randomised response on each interaction's MaxRR (the authors') or once on the half's mean",
        choices=("interaction", "mean"),
    )
    metric: str = param("maxrr", "click metric", choices=("maxrr", "dcg"))
    accounting_delta: float = param(
        1e-5, "delta at which the RDP / PLD accountants report epsilon", min=0.0, max=1.0
    )
    streams: str = param(
        "independent",
        "the clients' randomness: independent streams (ours) or the authors' code's, one numpy "
        "RandomState per client reseeded each round with the perturbation seed",
        choices=("independent", "authors"),
    )


#: Perturbations drawn and not yet asked for again, by (seed, size, sigma) (``authors_noise``'s
#: also by its layout); see ``perturbation``.
_DRAWN: dict[tuple, np.ndarray] = {}
_DRAWN_BYTES = 64 << 20


def perturbation(seed: int, size: int, sigma: float) -> np.ndarray:
    """The perturbation a seed stands for (read-only); client and server derive it identically.

    A pure function of the seed, kept from its first call to its second: a server in its
    clients' process takes the vector a client drew this round instead of regenerating it
    (~16 us each, twice per client and round otherwise). Nothing passes between agents but the
    seed; past ``_DRAWN_BYTES`` of waiting vectors the memo starts over (a miss only recomputes).
    """
    key = (seed, size, sigma)
    e = _DRAWN.pop(key, None)
    if e is None:
        e = _remember(key, np.random.Generator(np.random.PCG64(seed)).normal(0.0, sigma, size))
    return e


def _remember(key: tuple, e: np.ndarray) -> np.ndarray:
    e.setflags(write=False)
    if (len(_DRAWN) + 1) * e.nbytes > _DRAWN_BYTES:
        _DRAWN.clear()
    _DRAWN[key] = e
    return e


def authors_noise(seed: int, sigma: float, layout: np.ndarray) -> np.ndarray:
    """The perturbation of ``seed`` as the authors' code draws it (``streams = "authors"``):
    ``RandomState(seed).normal(0, sigma)`` for every parameter in their layout's order, each
    value rounded to float32; ``layout`` (``torch_layout``) puts it in ours. Memoised as
    ``perturbation``."""
    key = (seed, layout.size, sigma, layout.tobytes())
    e = _DRAWN.pop(key, None)
    if e is None:
        _MT.seed(seed)  # reseeding one stream: 3 us against 90 us for a new RandomState
        drawn = _MT.normal(0.0, sigma, layout.size)
        e = _remember(key, drawn.astype(np.float32).astype(np.float64)[layout])
    return e


_MT = np.random.RandomState(0)  # ``authors_noise``'s stream, reseeded on every call


def torch_layout(ranker: LinearRanker | MLPRanker) -> np.ndarray:
    """Where each of our flat parameters sits in the authors' torch order (``named_parameters``:
    per layer ``weight (out, in)`` then ``bias``, the output's ``(1, last)`` weight last).

    The layers come in the same order with the same sizes; only a hidden layer's weight matrix
    is stored transposed here (``(in, out)``): its block is a transposition of theirs.
    """
    index = np.arange(ranker.n_params)
    if isinstance(ranker, MLPRanker):
        sizes, start = (ranker.n_features, *ranker.hidden), 0
        for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
            block = index[start : start + n_in * n_out]
            block[:] = block.reshape(n_out, n_in).T.ravel()
            start += n_in * n_out + n_out  # the weights, then the bias as it is
    return index


def authors_layout(ctx: RunContext) -> np.ndarray | None:
    """The run's ``torch_layout`` when its clients use the authors' streams (built once per
    process: the server and the clients of one process share it), else None."""
    if ctx.params.streams != "authors":
        return None
    return ctx.shared("foltr_es.torch_layout", lambda: torch_layout(ctx.new_ranker()))


def noise(seed: int, size: int, sigma: float, layout: np.ndarray | None) -> np.ndarray:
    """A seed's perturbation as client and server draw it: ``perturbation``, or with the
    authors' streams (``layout``: ``authors_layout``) ``authors_noise``."""
    if layout is None:
        return perturbation(seed, size, sigma)
    return authors_noise(seed, sigma, layout)


def perturbations(seeds: list[int], size: int, sigma: float) -> list[np.ndarray]:
    """``perturbation`` of many seeds (memoised alike), equal vector for vector.

    Building a ``PCG64(seed)`` is ~9 us of its ~15, mostly the seed sequence's hashing; here
    that hashing runs for all seeds at once (``_pcg64_states``) and one generator is set to
    each state in turn before its ``normal`` draw.
    """
    bits = np.random.PCG64(0)
    draw = np.random.Generator(bits)
    out = []
    for seed, (state, inc) in zip(seeds, _pcg64_states(seeds), strict=True):
        bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": 0,
            "uinteger": 0,
        }
        out.append(_remember((seed, size, sigma), draw.normal(0.0, sigma, size)))
    return out


# numpy's SeedSequence (pool of 4 uint32 words) and PCG64 seeding constants
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _M32, _M128 = 0xCA01F9DD, 0x4973F715, 0xFFFFFFFF, (1 << 128) - 1
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


def _pcg64_states(seeds: list[int]) -> list[tuple[int, int]]:
    """``PCG64(seed).state``'s (state, inc) for seeds below 2**64, as numpy computes them:
    ``SeedSequence(seed).generate_state(4, uint64)`` (hashing the seed's two 32-bit words; a
    zero high word hashes as the pool's padding does) then PCG's ``srandom``."""
    u = np.uint32
    s = np.asarray(seeds, dtype=np.uint64)
    pool = [(s & np.uint64(_M32)).astype(u), (s >> np.uint64(32)).astype(u)]
    pool += [np.zeros(s.size, u), np.zeros(s.size, u)]
    h = _INIT_A  # the hash constant's sequence does not depend on the data

    def hashmix(v: np.ndarray) -> np.ndarray:
        nonlocal h
        v = v ^ u(h)
        h = (h * _MULT_A) & _M32
        v = v * u(h)
        return v ^ (v >> u(16))

    pool = [hashmix(w) for w in pool]
    for i in range(4):
        for j in range(4):
            if i != j:
                r = u(_MIX_L) * pool[j] - u(_MIX_R) * hashmix(pool[i])
                pool[j] = r ^ (r >> u(16))
    h, words = _INIT_B, []
    for i in range(8):
        v = pool[i % 4] ^ u(h)
        h = (h * _MULT_B) & _M32
        v = v * u(h)
        words.append(v ^ (v >> u(16)))
    state64 = np.stack(words, axis=1).astype("<u4").view("<u8").astype(np.uint64)
    out = []
    for a, b, c, d in state64.tolist():
        inc = ((((c << 64) | d) << 1) | 1) & _M128
        start = (((a << 64) | b) + inc) & _M128  # state 0, one step, plus the seed
        out.append(((start * _PCG_MULT + inc) & _M128, inc))
    return out


def epsilon_bound(p: float, n: int = len(LEVELS)) -> float:
    """Local DP of the randomised response: log(p (n - 1) / (1 - p))."""
    if p >= 1.0 or p <= 0.0:
        return math.inf  # the true value (or its exclusion) is certain
    return abs(math.log(p * (n - 1) / (1 - p)))


def privatise(value: float, p: float, rng: np.random.Generator) -> float:
    """Round to the nearest MaxRR level; keep it with probability p, else a uniform other level
    (one interaction's MaxRR is a level already: rounding leaves it as it is)."""
    return respond(value, response_draw(p, rng))


def response_draw(p: float, rng: np.random.Generator) -> int | None:
    """The randomised response's draws (how many never depends on the value): None keeps the
    true level, else the index of the level sent among the other ``len(LEVELS) - 1``."""
    if p < 1.0 and rng.random() >= p:
        return int(rng.integers(len(LEVELS) - 1))
    return None


def respond(value: float, other: int | None) -> float:
    """The level sent for ``value`` given the response's draw."""
    level = _LEVEL_OF.get(value)  # an interaction's MaxRR is a level: no search
    if level is None:
        level = int(np.argmin(np.abs(LEVELS - value)))
    if other is not None:
        level = other if other < level else other + 1
    return float(LEVELS[level])


class ESClient(OnlineClient):
    trains = False  # it serves deterministic rankings; the server's evolution strategy learns
    #: the users' queries and clicks come from the client's generator (``AuthorsESClient``: not)
    stream: np.random.RandomState | None = None
    #: its clients of a round may be served together (``AuthorsESClient``: each query in turn)
    pooled = True

    def __init__(
        self, agent_id: str, ctx: RunContext, queries: np.ndarray, rng: np.random.Generator
    ) -> None:
        super().__init__(agent_id, ctx, queries, rng)
        p = ctx.params
        self.sigma, self.p, self.antithetic, self.metric = (
            p.sigma,
            p.p,
            p.antithetic,
            p.metric,
        )
        #: the randomised response applies to every interaction (else once to each half's mean)
        self.per_interaction = p.metric == "maxrr" and p.privatise == "interaction"
        self.truth: list[float] = []  # this round's metrics before privatisation (oracle)
        self.layout = authors_layout(ctx)
        batched = (
            self.pooled
            and isinstance(self.ranker, LinearRanker | MLPRanker)
            and isinstance(self.users.click_model, CascadeModel)
        )
        #: the run's pool serving every client of a round at once (None: one query at a time)
        self.pool = (
            ctx.shared("foltr_es.serve_pool", lambda: BatchPool(_serve_jobs)) if batched else None
        )

    def _serve(self, theta: np.ndarray, n: int) -> float | None:
        """Mean click metric of n queries served deterministically by theta (None if n = 0)."""
        if n == 0:
            return None
        self.ranker.set_params(theta)
        train, total, sent = self.users.train, 0.0, 0.0
        for _ in range(n):
            q = self.users.next_query(self.stream)
            scores = self.ranker.score(train.features[train.doc_range(q)])
            ranking = np.argsort(-scores, kind="stable")[:K]
            clicks = self.users.show(q, ranking, self.stream)
            value = maxrr(clicks, K) if self.metric == "maxrr" else dcg_at_k(clicks, K)
            total += value
            if self.per_interaction:
                sent += privatise(value, self.p, self.rng)
        value = total / n
        self.truth.append(value)  # oracle: the metric before privatisation
        if self.per_interaction:
            return sent / n
        return privatise(value, self.p, self.rng) if self.metric == "maxrr" else value

    def _draw_seed(self) -> int:
        return int(self.rng.integers(2**63 - 1))

    @handles(MODEL)
    async def on_model(self, env) -> None:
        theta = env.body["params"]
        seed = self._draw_seed()
        n_minus = self.batch // 2 if self.antithetic else 0
        self.truth = []
        if self.pool is not None:  # every client of the round served together, same draws
            job = ServeJob(self, theta, seed, self.batch - n_minus, n_minus)
            m_plus, m_minus = await self.pool.submit(job)
        else:
            e = noise(seed, theta.size, self.sigma, self.layout)
            m_plus = self._serve(theta + e, self.batch - n_minus)
            m_minus = self._serve(theta - e, n_minus)
        if self.users.probe.oracle_read:
            # oracle truth for eavesdroppers' scores: the metrics before privatisation
            self.users.probe.oracle[SEED_METRIC, self.id] = (env.round, *self.truth)
        self.send(
            env.src,
            SEED_METRIC,
            {
                "seed": seed,
                "metric": m_plus,
                "antithetic_metric": m_minus,
                "n_interactions": self.batch,
            },
            env.round,
        )


class AuthorsESClient(ESClient):
    """``streams = "authors"``: the randomness of the authors' client as published.

    One numpy ``RandomState`` per client (seeded once from the client's generator; theirs from
    the run's seed plus the client's number) draws the round's seed, is then reseeded with it,
    and draws the users' queries and clicks (``Users.next_query`` / ``CascadeModel.scan``: their
    order); the perturbation is ``authors_noise`` of the same seed. The noise and the users'
    draws thus come from one Mersenne-Twister stream (the coupling that, measured with their
    code, lowers their linear ranker's end point; docs/REPRODUCTION-NOTES.md). Each query is served
    on its own, in float64 with ties in document order (theirs: float32, reversed ``argsort``).
    """

    pooled = False  # each query's draws depend on the clicks before it, in one stream

    def __init__(
        self, agent_id: str, ctx: RunContext, queries: np.ndarray, rng: np.random.Generator
    ) -> None:
        super().__init__(agent_id, ctx, queries, rng)
        # FOLtR-ES reads no per-client data: the users are a cascade model drawing queries
        self.stream = np.random.RandomState(int(self.rng.integers(2**32)))

    def _draw_seed(self) -> int:
        seed = int(self.stream.randint(0, 2**32))
        self.stream.seed(seed)
        return seed


@dataclass(eq=False)
class ServeJob:
    """One client's round: ``n_plus`` queries served by ``theta + e``, then ``n_minus`` by
    ``theta - e``, ``e`` the perturbation of ``seed`` (drawn for the whole batch at once)."""

    client: ESClient
    theta: np.ndarray
    seed: int
    n_plus: int
    n_minus: int


def _serve_jobs(jobs: list[ServeJob]) -> list[tuple[float | None, float | None]]:
    """The pool's batch function: ``ESClient._serve`` of both halves of every job, at once.

    Each client's generator is drawn from exactly as ``_serve`` would (per query the query
    number, then the click uniforms, then its randomised response when every interaction is
    privatised; else after a half, the half's response), so the draws are
    made first and the serving, done by ``serve_linear`` for all rows together, is equal to the
    sequential one. Per client its users record the shown nDCGs in order, and the half's metric
    is summed in the sequential order before privatisation.
    """
    if len(jobs) < MIN_BATCH:  # the reference loop is cheaper
        out = []
        for job in jobs:
            client = job.client
            e = perturbation(job.seed, job.theta.size, client.sigma)
            plus, minus = job.theta + e, job.theta - e
            out.append((client._serve(plus, job.n_plus), client._serve(minus, job.n_minus)))
        return out
    by_setup: dict[tuple, list[ServeJob]] = {}  # one serve per training set and click model
    keys: dict[tuple[int, int], tuple] = {}  # by objects: each table's bytes read once
    for job in jobs:
        users = job.client.users
        model = users.click_model
        key = keys.get((id(users.train), id(model)))
        if key is None:
            key = (id(users.train), model.p_click.tobytes(), model.p_stop.tobytes())
            keys[id(users.train), id(model)] = key
        by_setup.setdefault(key, []).append(job)
    results: dict[int, tuple[float | None, float | None]] = {}
    for group in by_setup.values():
        for job, result in zip(group, _serve_group(group), strict=True):
            results[id(job)] = result
    return [results[id(job)] for job in jobs]


def _serve_group(jobs: list[ServeJob]) -> list[tuple[float | None, float | None]]:
    """``_serve_jobs`` for jobs sharing one training set and click model."""
    users0 = jobs[0].client.users
    train, model = users0.train, users0.click_model
    shown_len = np.minimum(np.diff(train.qptr), K).tolist()  # list lengths, as Python ints
    queries: list[int] = []
    which: list[int] = []
    uniforms: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    drawn_rows: list[int | None] = []  # per row its response (per-interaction privatisation)
    halves: list[list[tuple[int, int, int | None] | None]] = []  # (first row, rows, response)
    # one run's clients: one sigma, one model size
    es = perturbations([job.seed for job in jobs], jobs[0].theta.size, jobs[0].client.sigma)
    for job, e in zip(jobs, es, strict=True):
        client = job.client
        rng, mine, next_query = client.rng, [], client.users.next_query
        per_row = client.per_interaction and client.p < 1.0  # p = 1 draws nothing
        for theta, n in ((job.theta + e, job.n_plus), (job.theta - e, job.n_minus)):
            if n == 0:
                mine.append(None)
                continue
            first, row_of = len(queries), len(weights)
            for _ in range(n):
                q = next_query()
                queries.append(q)
                which.append(row_of)
                uniforms.append(rng.random(2 * shown_len[q]))  # random((2, m)), raveled
                drawn_rows.append(response_draw(client.p, rng) if per_row else None)
            weights.append(theta)
            once = client.metric == "maxrr" and not client.per_interaction
            drawn = response_draw(client.p, rng) if once else None
            mine.append((first, n, drawn))
        halves.append(mine)
    served = serve_linear(
        train,
        np.array(queries, dtype=np.int64),
        np.array(weights),
        np.array(which, dtype=np.int64),
        uniforms,
        model.p_click,
        model.p_stop,
        K,
        _network_scores(jobs[0].client.ranker),
    )
    shown = served.ndcg.tolist()
    metrics = {"maxrr": served.maxrr.tolist(), "dcg": served.click_dcg.tolist()}
    out = []
    for job, mine in zip(jobs, halves, strict=True):
        client = job.client
        metric, record = metrics[client.metric], client.users.record
        sent = []
        for half in mine:
            if half is None:
                sent.append(None)
                continue
            first, n, drawn = half
            for v in shown[first : first + n]:
                record(v)
            total, privatised = 0.0, 0.0
            for row, v in enumerate(metric[first : first + n], first):
                total += v
                if client.per_interaction:
                    privatised += respond(v, drawn_rows[row])
            value = total / n
            client.truth.append(value)  # oracle: the metric before privatisation
            if client.per_interaction:
                sent.append(privatised / n)
            else:
                sent.append(respond(value, drawn) if client.metric == "maxrr" else value)
        out.append((sent[0], sent[1]))
    return out


def _network_scores(ranker: LinearRanker | MLPRanker):
    """The batch's scoring: the linear default, or a network's own ``score`` with each row's
    weights set on a copy (the same forward pass as ``_serve``, on the same float64 block)."""
    if isinstance(ranker, LinearRanker):
        return linear_score
    net = ranker.copy()

    def score(block: np.ndarray, w: np.ndarray) -> np.ndarray:
        net.set_params(w)
        return net.score(block)

    return score


class ESStrategy(ModelStrategy):
    """Regenerate perturbations from seeds, estimate the ES gradient, step with Adam."""

    broadcast_kind = MODEL
    reply_kind = SEED_METRIC

    def __init__(
        self, ctx: RunContext, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        super().__init__(ctx)
        self.sigma, self.lr = ctx.params.sigma, ctx.params.lr
        self.layout = authors_layout(ctx)  # None: ``perturbation``'s noise
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m = np.zeros_like(self.model)
        self.v = np.zeros_like(self.model)
        self.t = 0

    def gradient(self, replies: list) -> np.ndarray:
        g = np.zeros_like(self.model)
        for r in replies:
            b = r.body
            e = noise(b["seed"], g.size, self.sigma, self.layout)
            m_minus = b["antithetic_metric"]
            g += (0.5 * (b["metric"] - m_minus) if m_minus is not None else b["metric"]) * e
        return g / (len(replies) * self.sigma**2)

    def aggregate(self, round: int, replies: list) -> dict:
        g = self.gradient(replies)
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * g
        self.v = self.beta2 * self.v + (1 - self.beta2) * g * g
        m_hat = self.m / (1 - self.beta1**self.t)
        v_hat = self.v / (1 - self.beta2**self.t)
        self.model = self.model + self.lr * m_hat / (np.sqrt(v_hat) + self.eps)
        return {"grad_norm": float(np.linalg.norm(g))}


class FOLtRES(ProtocolRun):
    @classmethod
    def check(cls, config: RunConfig) -> None:
        if config.params.metric == "dcg" and config.params.p < 1.0:
            raise ScenarioError(
                "federation.params.p: privatisation needs the discrete "
                "metric 'maxrr' (set p = 1.0 with metric = 'dcg')"
            )

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.strategy = ESStrategy(ctx)
        self.taken_part: dict[int, list[str]] = {}  # round -> clients whose metrics came
        self.last_round = 0

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        kind = AuthorsESClient if self.ctx.params.streams == "authors" else ESClient
        return kind(agent_id, self.ctx, queries, rng)

    async def finish(self, server, reports: list) -> None:
        # every metric the server received was released, whether the round aggregated or not
        self.taken_part = {r.round: r.clients for r in reports if r.clients}
        self.last_round = reports[-1].round if reports else 0

    def report(self) -> dict:
        p = self.ctx.params.p
        eps = epsilon_bound(p)
        privacy = {"p": p, "levels": len(LEVELS), "epsilon": None if math.isinf(eps) else eps}
        if p < 1.0:
            privacy.update(self.accounting())
        return {"privacy": privacy}

    def accounting(self) -> dict:
        """Each client's local-DP epsilon over its randomised-response releases, by basic
        composition, RDP, PLD: per round taken part in, one per interaction (its B), or with
        ``privatise = "mean"`` one per half (m+ and, with antithetic variates, m-)."""
        p = self.ctx.params
        n = self.ctx.config.n_clients

        def per_round(client: str) -> int:
            b = self.ctx.batch_of(client)
            if p.privatise == "interaction":
                return b
            return 2 if p.antithetic and b >= 2 else 1

        every, last = self.ctx.config.evaluation.every, self.last_round
        return account(
            randomised_response(p.p, len(LEVELS)),
            self.taken_part,
            [client_id(i) for i in range(n)],
            [r for r in range(1, last + 1) if r % every == 0 or r == last],
            p.accounting_delta,
            releases_per_round=per_round,
        )


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    ProtocolEntry(
        NAME,
        "FOLtR-ES: seeds and privatised metrics, Adam server",
        Params,
        FOLtRES,
        wire_bytes=model_message_bytes,
        mlp={"activation": "relu", "init": "zero"},
    ),
)

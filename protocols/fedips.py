"""FedIPS: federated unbiased learning to rank from position-biased clicks (Li & Ouyang).

The counterfactual setting of unbiased LTR (Joachims, Swaminathan & Schnabel, WSDM 2017), on
users' own devices:

- a *logging policy* f0, a linear ranker trained with full information on 1% of the training
  queries (``logging_fraction``), is shared by every client; each user is shown the top ``k``
  documents of f0 for its query (a deterministic ranking);
- users click by a position-based model: each client's users examine rank r with probability
  ``(1/r)^gamma_user``, ``gamma_user`` drawn once per client from N(gamma, gamma_sd) truncated
  below at 0; an examined document is clicked with probability 1 if its grade is relevant (3-4
  on 5-grade data, 2 on 3-grade data) and ``noise`` (0.1) otherwise;
- with ``clicks = m`` (the paper's m clicks per user and round) a user instead gives exactly m
  clicks a round: m draws, with replacement, of a shown (query, rank) slot in proportion to its
  PBM click probability (the limit of repeating the round's sessions until m clicks have come);
  a slot clicked n times counts n times in the loss, so IPS stays unbiased within a round;
- every round a selected client issues B queries (``federation.queries_per_client``), minimises
  the IPS-weighted hinge surrogate ``sum_{clicked d} h(q, d) / p(d)`` with
  ``h(q, d) = sum_{d'} max(0, 1 - (f(d) - f(d')))`` over all the query's documents (the
  Propensity SVM-Rank bound on the rank of d) by local SGD (one step per query, ``lr_local``,
  ``local_epochs`` passes), and sends its update ``Delta = w_local - w``;
- the server applies FedOpt: ``w += lr_global * mean(Delta)`` (the mean is the scenario's
  aggregator with equal weights, so robust rules apply too); a reply of the wrong length,
  non-finite, oversized or claiming more queries than the client's is dropped and counted first
  (``FedIPSStrategy.screen``, docs/SECURITY.md).

Baselines (``estimator``): ``naive`` is FedAvg of the same loss without IPS (p = 1: clicks taken
at face value, so documents f0 ranks high look more relevant); ``full_info`` is linear
LambdaRank on the true labels of every document of the issued queries (a skyline no click
learner can pass). ``propensity`` says what p the clients divide by: ``oracle`` (each client
knows its own users' ``(1/r)^gamma_user``, the paper's setting), ``global`` (the population's
``(1/r)^gamma``) or ``em``: estimated federatedly by regression EM (Wang et al., WSDM 2018) as
training goes. With ``em`` the server broadcasts its position-bias estimate theta with the model;
each client runs the E-step on its round's log (P(examined | no click) and P(relevant | no click)
under theta and the relevance model sigma(w_rel . x)) and sends its sufficient statistics; the
server's M-step sets theta_k to the examined share at rank k (moved by ``em_step`` towards the
round's estimate) and takes one gradient step (``em_lr``) of the soft-label logistic relevance
regression. Clients divide by theta_k / theta_1.

Users only ever see f0's rankings, so the online metric (nDCG@10 of the shown top k) is f0's and
the same for every estimator; the offline metrics (nDCG@5, the paper's, and nDCG@10) of the
global model are what the estimators change.

Simulator shortcuts (documented, not hidden): f0's top-k table over the training queries is
computed once and shared read-only (every client holds f0 and would compute the same table);
local SGD runs on one scratch ranker per run (training is synchronous inside a handler, so it is
compute, not state shared between agents), or, for a linear ranker learning from clicks, in one
compiled call per client (``ltr/ips_kernel.py``, equal up to float rounding). A client keeps only
its id, generator, gamma_user (and its k propensities) and a reference to the shared query pool,
so a 62,500-client federation fits in memory; the round's participants are sampled by
``federation.participation``.
"""

from __future__ import annotations

import numpy as np

from foltr_async.contract import ProtocolRun, RunContext, model_message_bytes
from foltr_async.ltr.clicks import click_model as make_click_model
from foltr_async.ltr.metrics import dcg_at_k, ideal_dcg
from foltr_async.ltr.queryset import QuerySet
from foltr_async.ltr.rankers import LinearRanker, Ranker
from foltr_async.params import param, parameters
from foltr_async.registry import ProtocolEntry
from foltr_async.runtime.agent import Agent, handles
from foltr_async.runtime.engine import Strategy
from foltr_async.runtime.rounds import screen_reply
from foltr_async.runtime.schema import Array, Int, Kind, Opt

MODEL = "fedips.model"
UPDATE = "fedips.update"
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(
        MODEL,
        {
            "params": Array("float64", ndim=1, finite=True),
            # propensity = "em": the server's estimates (PBM examination theta_k, relevance w_rel)
            "propensity": Opt(Array("float64", ndim=1, finite=True)),
            "relevance": Opt(Array("float64", ndim=1, finite=True)),
        },
    ),
    Kind(
        UPDATE,
        {
            "delta": Array("float64", ndim=1, finite=True),
            "n_interactions": Int(min=0),
            # regression-EM sufficient statistics of the round's log (propensity = "em" only)
            "em_examined": Opt(Array("float64", ndim=1, finite=True)),
            "em_shown": Opt(Array("float64", ndim=1, finite=True)),
            "em_relevance": Opt(Array("float64", ndim=1, finite=True)),
        },
    ),
)

ESTIMATORS = ("ips", "naive", "full_info")
PROPENSITIES = ("oracle", "global", "em")


@parameters
class Params:
    estimator: str = param(
        "ips",
        "ips (FedIPS), naive (FedAvg without IPS) or full_info (LambdaRank on true labels)",
        choices=ESTIMATORS,
    )
    propensity: str = param(
        "oracle",
        "what clients divide by: their users' own examination, "
        "the population's, or a federated regression-EM estimate",
        choices=PROPENSITIES,
    )
    gamma: float = param(1.0, "position bias: mean of the users' examination exponent", min=0.0)
    gamma_sd: float = param(0.1, "spread of the users' exponents (left-truncated at 0)", min=0.0)
    noise: float = param(
        0.1, "click probability of an examined non-relevant document", min=0.0, max=1.0
    )
    k: int = param(5, "documents shown per query (top k of the logging policy)", min=1)
    clicks: int = param(
        0,
        "m: clicks a user gives per round, drawn over its queries' shown documents in "
        "proportion to their PBM click probabilities (0: one PBM draw per shown document)",
        min=0,
    )
    lr_local: float = param(0.003, "local SGD step (eta_l)", min=0.0)
    lr_global: float = param(1.0, "server step on the mean update (eta_g)", min=0.0)
    local_epochs: int = param(1, "passes over the round's queries", min=1)
    logging_fraction: float = param(
        0.01, "share of training queries f0 is trained on", min=0.0, max=1.0
    )
    logging_epochs: int = param(20, "full-information LambdaRank epochs training f0", min=0)
    logging_lr: float = param(0.01, "f0's LambdaRank step", min=0.0)
    em_lr: float = param(1.0, "regression EM: relevance regression step", min=0.0)
    em_local_steps: int = param(20, "regression EM: a client's relevance regression steps", min=1)
    em_step: float = param(
        0.2, "regression EM: move of theta towards a round's M-step", min=0.0, max=1.0
    )


# ------------------------------------------------------------------------------ pure pieces


def truncated_normal(
    rng: np.random.Generator, mean: float, sd: float, size: int | None = None, low: float = 0.0
) -> np.ndarray | float:
    """N(mean, sd) left-truncated at ``low`` (rejection: redraw what falls at or below)."""
    n = 1 if size is None else int(size)
    if sd == 0.0:
        if mean <= low:
            raise ValueError(f"a point mass at {mean} lies at or below the truncation {low}")
        out = np.full(n, float(mean))
    else:
        out = rng.normal(mean, sd, n)
        for _ in range(1000):
            bad = out <= low
            if not bad.any():
                break
            out[bad] = rng.normal(mean, sd, int(bad.sum()))
        else:
            raise ValueError(f"N({mean}, {sd}) has almost no mass above {low}")
    return float(out[0]) if size is None else out


def examination(gamma: float, k: int) -> np.ndarray:
    """PBM examination (1/rank)^gamma at ranks 1..k: the true propensities."""
    return (1.0 / np.arange(1, k + 1, dtype=np.float64)) ** gamma


def pbm_click_probability(
    labels: np.ndarray, exam: np.ndarray, relevant: np.ndarray, noise: float
) -> np.ndarray:
    """P(click) of shown documents (rows: queries, columns: ranks; label -1 pads an empty
    slot): examination times 1 for a relevant grade, ``noise`` otherwise, 0 on padding."""
    labels = np.asarray(labels)
    p = exam[: labels.shape[-1]] * np.where(np.isin(labels, relevant), 1.0, noise)
    return np.where(labels >= 0, p, 0.0)


def m_clicks(rng: np.random.Generator, prob: np.ndarray, m: int) -> np.ndarray:
    """Click counts per slot (shape of ``prob``) of exactly ``m`` clicks, each landing on a slot
    with probability proportional to ``prob``; none if no slot can be clicked."""
    flat = np.asarray(prob, dtype=np.float64).ravel()
    total = flat.sum()
    if total <= 0.0:
        return np.zeros(np.shape(prob), dtype=np.int64)
    # rng.choice(flat.size, size=m, p=flat / total) without its argument checks (a third of a
    # FedIPS client's round): the same cdf, uniforms and search, so the same slots
    cdf = np.cumsum(flat / total)
    cdf /= cdf[-1]
    slots = np.searchsorted(cdf, rng.random(m), side="right")
    return np.bincount(slots, minlength=flat.size).reshape(np.shape(prob))


def top_k_table(qs: QuerySet, scores: np.ndarray, k: int) -> np.ndarray:
    """(n_queries, k) document offsets of each query's top ``k`` by descending score (ties keep
    document order), -1 where a query has fewer documents. Vectorised over the whole set."""
    sizes = np.diff(qs.qptr)
    qidx = np.repeat(np.arange(qs.n_queries), sizes)
    order = np.lexsort((np.arange(qs.n_docs), -np.asarray(scores, dtype=np.float64), qidx))
    rank = np.arange(qs.n_docs) - qs.qptr[qidx]  # qidx is grouped, so it survives the sort
    keep = rank < k
    table = np.full((qs.n_queries, k), -1, dtype=np.int64)
    table[qidx[keep], rank[keep]] = order[keep] - qs.qptr[qidx[keep]]
    table.setflags(write=False)
    return table


def hinge_score_gradient(
    scores: np.ndarray, clicked: np.ndarray, propensity: np.ndarray
) -> tuple[float, np.ndarray]:
    """Loss and d loss / d scores of ``sum_c (1/p_c) sum_{d'} max(0, 1 - (s_c - s_d'))``.

    ``clicked`` are document offsets (distinct), ``propensity`` their p. The d' = c term is a
    constant 1 with zero gradient (it keeps the sum exactly the paper's rank bound).
    """
    s = np.asarray(scores, dtype=np.float64)
    inv = 1.0 / np.asarray(propensity, dtype=np.float64)
    margin = 1.0 - (s[clicked][:, None] - s[None, :])
    active = margin > 0.0
    loss = float(inv @ np.where(active, margin, 0.0).sum(axis=1))
    grad = inv @ active  # each active d' is pushed up by 1/p_c ...
    grad[clicked] -= inv * active.sum(axis=1)  # ... and c down by the same total
    return loss, grad


def lambda_weights(scores: np.ndarray, labels: np.ndarray, k: int = 10) -> np.ndarray:
    """LambdaRank (Burges 2010) ascent weights per document for nDCG@k: over pairs with
    label_i > label_j, |Delta nDCG@k_ij| / (1 + exp(s_i - s_j)), added to i, taken from j.

    Swapping two documents both ranked below k leaves nDCG@k unchanged, so only pairs with a
    member in the current top k count: a (k, n) matrix per query instead of (n, n).
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    n = s.size
    gain = np.exp2(y) - 1.0
    cut = min(k, n)
    ideal = float(np.sort(gain)[::-1][:cut] @ (1.0 / np.log2(np.arange(2, cut + 2))))
    if ideal <= 0.0:
        return np.zeros(n)
    order = np.argsort(-s, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    disc = np.where(rank < cut, 1.0 / np.log2(rank + 2.0), 0.0)
    top = order[:cut]
    # each unordered pair once: a top document with any document ranked below it
    pair = rank[None, :] > rank[top][:, None]
    dy = y[top][:, None] - y[None, :]
    delta = np.abs((gain[top][:, None] - gain[None, :]) * (disc[top][:, None] - disc[None, :]))
    sign = np.sign(dy)  # +1: the top document should be above, -1: the other one
    margin = sign * (s[top][:, None] - s[None, :])  # s_better - s_worse
    lam = np.where(pair & (dy != 0), delta / ideal * 0.5 * (1.0 - np.tanh(0.5 * margin)), 0.0)
    out = np.zeros(n)
    np.add.at(out, top, (lam * sign).sum(axis=1))
    out -= (lam * sign).sum(axis=0)
    return out


def train_lambdarank(
    ranker: Ranker,
    qs: QuerySet,
    queries: np.ndarray,
    epochs: int,
    lr: float,
    rng: np.random.Generator,
) -> None:
    """Full-information LambdaRank by SGD (one step per query, shuffled epochs), in place."""
    for _ in range(epochs):
        for q in rng.permutation(queries):
            features, labels = qs.query(int(q))
            w = lambda_weights(ranker.score(features), labels)
            if w.any():
                ranker.set_params(ranker.get_params() + lr * ranker.grad(features, w))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def em_statistics(
    theta: np.ndarray,
    w_rel: np.ndarray,
    features: np.ndarray,
    positions: np.ndarray,
    clicks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Regression-EM E-step over shown documents (rows of ``features``, 0-based ``positions``):

    P(click) = theta_k * gamma(x), gamma = sigmoid(w . x + b) with ``w_rel = [w, b]``. A click
    means examined and relevant; otherwise P(E | no click) = theta (1 - gamma) / (1 - theta
    gamma) and P(R | no click) = (1 - theta) gamma / (1 - theta gamma). Returns the examined
    mass per rank, the shown count per rank, and P(R) per document (the relevance regression's
    soft labels).
    """
    k = theta.size
    features = np.asarray(features, dtype=np.float64)
    gam = _sigmoid(features @ w_rel[:-1] + w_rel[-1])
    th = theta[positions]
    denom = np.maximum(1.0 - th * gam, 1e-12)
    examined = np.where(clicks, 1.0, th * (1.0 - gam) / denom)
    relevant = np.where(clicks, 1.0, (1.0 - th) * gam / denom)
    exam_sum = np.bincount(positions, weights=examined, minlength=k)
    shown = np.bincount(positions, minlength=k).astype(np.float64)
    return exam_sum, shown, relevant


def fit_relevance(
    w_rel: np.ndarray, features: np.ndarray, targets: np.ndarray, steps: int, lr: float
) -> np.ndarray:
    """The relevance half of the M-step: ``steps`` gradient ascent steps of the mean soft-label
    log-likelihood of sigmoid(w . x + b) on ``targets`` (a client's share of the M-step),
    compiled (``ips_kernel.logistic_ascent``): in numpy, a few calls a step made it ~0.36 ms a
    client at 20 steps, ~0.1 ms compiled."""
    from foltr_async.ltr.ips_kernel import logistic_ascent

    w = np.array(w_rel, dtype=np.float64)
    return logistic_ascent(w, features, np.asarray(targets, dtype=np.float64), steps, lr)


def relative_propensity(theta: np.ndarray) -> np.ndarray:
    """theta_k / theta_1 (IPS needs ratios only), floored so no weight exceeds 1e3."""
    return np.maximum(theta / max(float(theta[0]), 1e-12), 1e-3)


def em_theta(theta: np.ndarray, examined: np.ndarray, shown: np.ndarray, step: float) -> np.ndarray:
    """The examination half of the M-step from summed statistics: theta_k moves by ``step``
    towards the examined share at rank k (step 1: the exact M-step)."""
    theta = theta.copy()
    seen = shown > 0
    theta[seen] += step * (examined[seen] / shown[seen] - theta[seen])
    return np.clip(theta, 1e-6, 1.0)


# ------------------------------------------------------------------------------ the protocol


class Logging:
    """The logging policy f0 and its shared top-k table (built once per run, read-only)."""

    def __init__(self, ctx: RunContext, relevant: np.ndarray, noise: float) -> None:
        p = ctx.params
        train = ctx.data.train
        rng = ctx.rng("fedips", "logging")
        n = max(1, int(round(p.logging_fraction * train.n_queries)))
        self.queries = np.sort(rng.choice(train.n_queries, size=n, replace=False))
        ranker = ctx.new_ranker()
        train_lambdarank(ranker, train, self.queries, p.logging_epochs, p.logging_lr, rng)
        self.weights = ranker.get_params()
        self.ranker = ranker
        self.table = top_k_table(train, ranker.score(train.features), p.k)
        labels = np.where(self.table >= 0, train.labels[train.qptr[:-1, None] + self.table], -1)
        self.labels = labels.astype(np.int8)  # shown grades (oracle, for clicks and the metric)
        self.labels.setflags(write=False)
        # P(click | examined) of every shown document: a client multiplies by its examination
        self.click_factor = pbm_click_probability(self.labels, np.ones(p.k), relevant, noise)
        self.click_factor.setflags(write=False)
        shown = np.where(self.labels >= 0, self.labels, 0)
        ideal = ideal_dcg(train, 10)
        with np.errstate(invalid="ignore", divide="ignore"):
            self.shown_ndcg = np.where(ideal > 0, dcg_at_k(shown, 10) / ideal, 0.0)
        self.shown_ndcg.setflags(write=False)


class FedIPSClient(Agent):
    """One user's device: it issues B queries a round, sees f0's top k, clicks, trains locally."""

    role = "client"

    def __init__(
        self, agent_id: str, run: FedIPS, queries: np.ndarray, rng: np.random.Generator
    ) -> None:
        super().__init__(agent_id, run.ctx.bus)
        self.proto = run
        self.queries = queries
        self.rng = rng
        p = run.ctx.params
        self.gamma_user = truncated_normal(rng, p.gamma, p.gamma_sd)
        self.exam = examination(self.gamma_user, run.k)  # its users' true propensities
        self.exam.setflags(write=False)
        self.batch = run.ctx.batch_of(agent_id)

    def interact(self) -> tuple[np.ndarray, np.ndarray]:
        """The round's queries and the users' clicks on f0's top k: one draw per shown slot,
        or (``clicks = m``) m clicks spread over the slots, as counts per slot."""
        run, rng = self.proto, self.rng
        qs = self.queries[rng.integers(len(self.queries), size=self.batch)]
        prob = self.exam * run.logging.click_factor[qs]
        if run.m_clicks:
            clicks = m_clicks(rng, prob, run.m_clicks)
        else:
            clicks = rng.random(prob.shape) < prob
        probe = run.ctx.probe
        for v in run.logging.shown_ndcg[qs].tolist():
            probe.displayed(v, self.id, self.round)
        return qs, clicks

    def propensities(self, estimate: np.ndarray | None) -> np.ndarray:
        run = self.proto
        if run.estimator == "naive":
            return np.ones(run.k)
        if run.propensity == "oracle":
            return self.exam
        if run.propensity == "global":
            return examination(run.gamma, run.k)
        return relative_propensity(estimate)

    def local_sgd(
        self, start: np.ndarray, qs: np.ndarray, clicks: np.ndarray, prop: np.ndarray
    ) -> np.ndarray:
        run = self.proto
        train, table, ranker = run.ctx.data.train, run.logging.table, run.scratch
        if run.compiled and run.estimator == "full_info":
            w = run.compiled.lambdarank_sgd_linear(
                start.copy(), train.features, train.labels, train.qptr, qs,
                run.lr_local, run.local_epochs, 10,
            )  # fmt: skip
            return w - start
        if run.compiled:
            w = run.compiled.hinge_sgd_linear(
                start.copy(), train.features, train.qptr, table, qs,
                np.asarray(clicks, dtype=np.int64), prop, run.lr_local, run.local_epochs,
            )  # fmt: skip
            return w - start
        ranker.set_params(start)
        lr = run.lr_local
        for _ in range(run.local_epochs):
            for q, c in zip(qs.tolist(), clicks, strict=True):
                features, labels = train.query(q)
                if run.estimator == "full_info":
                    w = lambda_weights(ranker.score(features), labels)
                    step = lr * ranker.grad(features, w)
                else:
                    ranks = np.flatnonzero(c)
                    if ranks.size == 0:
                        continue
                    _, g = hinge_score_gradient(  # a slot clicked n times weighs n / p
                        ranker.score(features), table[q, ranks], prop[ranks] / c[ranks]
                    )
                    step = -lr * ranker.grad(features, g)
                ranker.set_params(ranker.get_params() + step)
        return ranker.get_params() - start

    @handles(MODEL)
    async def on_model(self, env) -> None:
        run = self.proto
        start, estimate = env.body["params"], env.body["propensity"]
        qs, clicks = self.interact()
        prop = self.propensities(estimate)
        delta = self.local_sgd(start, qs, clicks, prop)
        body = {
            "delta": delta,
            "n_interactions": int(qs.size),
            "em_examined": None,
            "em_shown": None,
            "em_relevance": None,
        }
        if estimate is not None:
            train, table = run.ctx.data.train, run.logging.table
            q_rows, pos = np.nonzero(table[qs] >= 0)
            docs = train.qptr[qs[q_rows]] + table[qs[q_rows], pos]
            features, w_rel = train.features[docs], env.body["relevance"]
            # with m clicks a slot clicked n >= 1 times counts as one click in the E-step
            e, n, targets = em_statistics(estimate, w_rel, features, pos, clicks[q_rows, pos])
            p = run.ctx.params
            w = fit_relevance(w_rel, features, targets, p.em_local_steps, p.em_lr)
            body.update(em_examined=e, em_shown=n, em_relevance=w - w_rel)
        self.send(env.src, UPDATE, body, env.round)


class FedIPSStrategy(Strategy):
    """FedOpt server; with ``propensity = "em"`` also the M-step of the federated EM."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, run: FedIPS) -> None:
        self.proto = run
        self.ctx = ctx = run.ctx
        self.ranker = ctx.new_ranker()
        self.model = self.ranker.get_params()
        self.em = run.propensity == "em" and run.estimator == "ips"
        self.theta = np.full(run.k, 0.5)  # away from the theta = 1 fixed point of EM
        self.w_rel = np.zeros(ctx.data.train.n_features + 1)  # relevance regression [w, b]

    def propensity(self) -> np.ndarray:
        return relative_propensity(self.theta)

    def configure_round(self, round: int) -> dict:
        if not self.em:
            return {"params": self.model, "propensity": None, "relevance": None}
        return {"params": self.model, "propensity": self.theta, "relevance": self.w_rel}

    def screen(self, reply) -> tuple[str, str] | None:
        """An update of the model's length, finite and bounded, of at most the client's
        queries; with the federated EM also its statistics: one value per rank (the relevance
        step one per relevance weight), at most one shown document per rank and query, at
        most as much examined mass as shown documents."""
        body, ctx = reply.body, self.ctx
        most = ctx.most_interactions(reply.src)
        vectors = {"delta": self.model.size}
        if self.em:
            k = self.theta.size
            vectors.update(em_examined=k, em_shown=k, em_relevance=self.w_rel.size)
        why = screen_reply(body, vectors, counts={"n_interactions": most})
        if why is not None or not self.em:
            return why
        shown, examined = body["em_shown"], body["em_examined"]
        if not ((shown >= 0).all() and (shown <= body["n_interactions"]).all()):
            return "update_out_of_range", "em_shown outside 0..n_interactions"
        if not ((examined >= 0).all() and (examined <= shown + 1e-6).all()):
            return "update_out_of_range", "em_examined outside 0..em_shown"
        return None

    def aggregate(self, round: int, replies: list) -> dict:
        deltas = np.stack([r.body["delta"] for r in replies])
        mean = self.ctx.aggregator.fn(
            deltas, np.ones(len(replies)), self.ctx.config.assumed_malicious
        )
        self.model = self.model + self.proto.lr_global * mean
        facts = {"clients": len(replies)}
        if self.em:
            self.theta = em_theta(
                self.theta,
                sum(r.body["em_examined"] for r in replies),
                sum(r.body["em_shown"] for r in replies),
                self.ctx.params.em_step,
            )
            self.w_rel = self.w_rel + np.mean([r.body["em_relevance"] for r in replies], axis=0)
            facts["theta"] = self.propensity().round(4).tolist()
        return facts

    def evaluate(self) -> dict[str, float]:
        self.ranker.set_params(self.model)
        return self.proto.metrics(self.ranker)


class FedIPS(ProtocolRun):
    def __init__(self, ctx: RunContext) -> None:
        p = ctx.params
        self.ctx = ctx
        self.estimator, self.propensity = p.estimator, p.propensity
        self.gamma, self.noise, self.k, self.m_clicks = p.gamma, p.noise, p.k, p.clicks
        self.lr_local, self.lr_global = p.lr_local, p.lr_global
        self.local_epochs = p.local_epochs
        self.relevant = np.array(sorted(make_click_model("pbm", ctx.data.n_grades).relevant))
        self.logging = ctx.shared("fedips.logging", lambda: Logging(ctx, self.relevant, self.noise))
        self.scratch = ctx.shared("fedips.scratch", ctx.new_ranker)
        #: a linear ranker's local SGD in one compiled call per client (equal to the numpy
        #: path up to float rounding; ~10x cheaper on MQ-sized queries)
        self.compiled = None
        if type(self.scratch) is LinearRanker:
            from foltr_async.ltr import ips_kernel

            self.compiled = ips_kernel
        self.strategy = FedIPSStrategy(self)

    def metrics(self, ranker: Ranker) -> dict[str, float]:
        """Offline nDCG@5 (the paper's) and nDCG@10 (the simulator's) of a ranker."""
        return self.ctx.evaluate(ranker, ("ndcg@5", "ndcg@10"))

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        return FedIPSClient(agent_id, self, queries, rng)

    def report(self) -> dict:
        s = self.strategy
        out = {
            "estimator": self.estimator,
            "propensity": self.propensity if self.estimator == "ips" else None,
            "gamma": self.gamma,
            "logging_queries": int(self.logging.queries.size),
            "logging_policy": self.metrics(self.logging.ranker),
        }
        if s.em:
            out["em"] = {
                "propensity": s.propensity().tolist(),
                "true_mean_propensity": examination(self.gamma, self.k).tolist(),
            }
        return {"fedips": out}


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    ProtocolEntry(
        "fedips",
        "FedIPS: IPS-weighted local SGD on position-biased clicks, "
        "FedOpt server (baselines: naive FedAvg, full-info LambdaRank)",
        Params,
        FedIPS,
        wire_bytes=model_message_bytes,
    ),
)

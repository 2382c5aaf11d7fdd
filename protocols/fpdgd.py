"""FPDGD: federated PDGD with FedAvg and optional differential privacy (Wang et al., ICTIR 2021).

Round: the server broadcasts ``fpdgd.model`` (the global weights); every selected client runs B
PDGD interactions on its own queries with its own users, updating its local copy after every
query, and replies ``fpdgd.update`` (its weights and B); the server combines the weights with the
scenario's aggregator (FedAvg weighted by interactions by default).

Differential privacy (the paper's Algorithm 3): after each local update the weights are clipped to
norm Delta/2 (``clip = "half"``; the authors' code clips to Delta: ``clip = "full"``); once before
sending, every coordinate gets ``gamma - gamma'`` with both Gamma(1/k, Delta/epsilon), so the
noise summed over k clients is Laplace(Delta/epsilon) per coordinate. The paper takes k = |C|,
every client in every aggregate; here the server tells each round's clients how many were asked
(``shares`` in the model message), so the shares of a round sum to Laplace whenever all of them
report (under full participation k = |C|: the paper's draws exactly). When only k' < k reports
reach the aggregate (deadline, dropout, loss), its noise is gamma - gamma' with Gamma(k'/k):
not Laplace, a weaker guarantee, which the results state per round (``privacy.rounds``).

Sensitivity: Laplace noise per coordinate is epsilon-DP for an L1 sensitivity Delta, but the
paper clips in the L2 norm, under which two clients' weights differ by up to sqrt(d) Delta in L1.
The results report the epsilon of the mechanism as clipped (``privacy.epsilon_mechanism``, and
all accounting) next to the paper's nominal one (``privacy.nominal``); ``clip_norm = "l1"``
clips in the L1 norm, for which the nominal epsilon is exact (with ``clip = "half"``).
A single client's message alone carries only its Gamma-difference share of the noise: it is
*not* epsilon-DP by itself unless a secure aggregation hides it.

Local training time and batching: ``compute_time`` is the simulated time one local interaction
takes, so a client replies ``B * compute_time`` simulated seconds after the model arrives (0 by
default: at once). Clients train through the one PDGD learner (``protocols/learner.py``):
with a linear ranker or a one-hidden-layer MLP it hands the training to the run's compute pool,
which trains every client with a pending job in one batched PDGD pass. Each client draws from
its own generator exactly as the one-query-at-a-time path (``PDGDLearner.train``, kept for
deeper MLPs, other click models and as the reference) does, so its weights and what its users
were shown are the same up to float rounding; the probe orders the online metric by (round,
client), so batching does not change it either. A client that crashes or leaves before its
batch runs never shows its users those rankings.

Replay (``dataset.format = "aol4foltr"``): a client is one logged user; on a model it trains on
the queries its user issued since its last training (``Users.pending``), in logged order, one
query at a time, instead of B random ones; with none it replies with the model it got and
``n_interactions = 0`` (no weight in FedAvg), counted as an empty update.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import numpy as np

from foltr_async.config import RunConfig
from foltr_async.contract import ProtocolRun, RunContext, model_message_bytes
from foltr_async.errors import ScenarioError
from foltr_async.observe.privacy import account, delta_at, gamma_difference, laplace
from foltr_async.params import param, parameters
from foltr_async.protocols.learner import learner_paths
from foltr_async.protocols.online import ModelStrategy, OnlineClient
from foltr_async.protocols.unlearning import (
    ReplayStrategy,
    calibrate,
    high_loss_queries,
    mean_reset_loss,
    pga_radius,
    project,
    reference_model,
    relabelled,
)
from foltr_async.registry import ProtocolEntry
from foltr_async.runtime.agent import Agent, client_id, handles
from foltr_async.runtime.engine import Strategy
from foltr_async.runtime.rounds import MAX_ABS, screen_reply
from foltr_async.runtime.schema import Array, Int, Kind, Opt, Str
from foltr_async.runtime.secure import Summable

#: its scenario name (``federation.protocol``), which its attacks and eavesdropper speak
NAME = "fpdgd"
#: the timeline action of a client that asks to be forgotten (and leaves)
UNLEARN_ACTION = "unlearn"
MODEL = "fpdgd.model"
UPDATE = "fpdgd.update"
UNLEARN = "unlearn.request"
CALIBRATE = "fpdgd.calibrate"
CALIBRATED = "fpdgd.calibrated"
#: how a leaver is forgotten when training ends (``federation.params.unlearning``)
UNLEARNING = ("federaser", "retrain", "finetune", "pga", "fedremove", "original")
#: the strategies that train the remaining clients after training (outside DP's accounting)
RETRAINING = ("retrain", "finetune", "pga")
#: the strategies the study's code runs otherwise, offered as ``<strategy>_as_code``
AS_CODE = ("federaser", "finetune", "original", "pga")
#: ``shares``: with DP, how many clients this round's noise is split over (the round's clients)
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    # ``restart``: retraining's first round: the clients start their generators over;
    # ``batch``: fine-tuning as the study's code: the interactions each client takes (at most
    # its partition); ``ascend``: PGA as the study's code: the forgotten clients ascend
    Kind(
        MODEL,
        {
            "params": Array("float64", ndim=1),
            "shares": Opt(Int(min=1)),
            "restart": Opt(Int(min=1, max=1)),
            "batch": Opt(Int(min=1)),
            "ascend": Opt(Int(min=1, max=1)),
        },
    ),
    Kind(UPDATE, {"params": Array("float64", ndim=1), "n_interactions": Int(min=0)}),
    # PGA: the leaver's model after its gradient ascent, and the ascent's interactions
    Kind(
        UNLEARN,
        {
            "client": Str(max_len=64),
            "params": Opt(Array("float64", ndim=1)),
            "n_interactions": Opt(Int(min=0)),
        },
    ),
    Kind(CALIBRATE, {"params": Array("float64", ndim=1), "stored_round": Int(min=0)}),
    Kind(CALIBRATED, {"update": Array("float64", ndim=1), "n_interactions": Int(min=0)}),
)


@parameters
class Params:
    lr: float = param(0.1, "PDGD learning rate", min=0.0)
    dp: bool = param(False, "differential privacy (clip + Gamma-difference noise)")
    epsilon: float = param(4.5, "DP epsilon per round", min=1e-6)
    sensitivity: float = param(5.0, "DP sensitivity Delta", min=1e-9)
    clip: str = param(
        "half", "clip norm: Delta/2 (paper) or Delta (authors' code)", choices=("half", "full")
    )
    clip_norm: str = param(
        "l2",
        "norm clipped: l2 (paper: the per-coordinate noise is then sqrt(d) short) or l1 (the "
        "nominal epsilon is exact)",
        choices=("l2", "l1"),
    )
    accounting_delta: float = param(
        1e-5, "delta at which the RDP / PLD accountants report epsilon", min=0.0, max=1.0
    )
    unlearning: str = param(
        "federaser",
        "how the leavers are forgotten when training ends: federaser (calibrated re-training "
        "from the updates stored every store_every rounds), retrain (from the initial model, "
        "without them), finetune (the trained model trained on by the remaining clients), pga "
        "(each leaver's projected gradient ascent from its reference model, then the remaining "
        "clients train on), fedremove (the server replays its stored updates without the "
        "leavers'), original (kept as trained: the do-nothing baseline)",
        choices=UNLEARNING,
    )
    unlearn_rounds: int = param(
        0,
        "unlearning: rounds retrain / finetune / pga's post-training play (0: as many as "
        "training played)",
        min=0,
    )
    pga_steps: int = param(
        0, "pga: gradient-ascent interactions of each leaver (0: one per query it owns)", min=0
    )
    pga_radius: float = param(
        2.0,
        "pga: the ball's radius around the reference model, in mean distances from it to random "
        "N(0, 0.01^2) models (the study's code: 2)",
        min=0.0,
    )
    fedremove_replay: str = param(
        "updates",
        "fedremove: replay the remaining clients' stored updates from the initial model "
        "(updates) or set each round's model to their stored models (models: the study's code)",
        choices=("updates", "models"),
    )
    federaser_as_code: bool = param(
        False,
        "federaser as the study's code runs it: the server stores every round's models; from "
        "the initial model it rebuilds one round per training round, the remaining clients "
        "training one after another on one model (each from the previous one's), calibrated "
        "every fifth round, averaged otherwise; the result is the trained model plus lr x the "
        "sum of every rebuilt model; false: one calibration round per stored round",
    )
    finetune_as_code: bool = param(
        False,
        "finetune as the study's code runs it: each remaining client takes as many interactions "
        "a round as training played rounds (the code passes its round count, 1,000, as the "
        "batch), at most its partition's size; false: B a round",
    )
    original_as_code: bool = param(
        False,
        "original as the study's code runs it: every client, the forgotten ones included (they "
        "rejoin), trains on for unlearn_rounds rounds (0: as many as training played); false: "
        "the model as trained",
    )
    pga_as_code: bool = param(
        False,
        "pga as the study's code runs it (pga_test): no reference model, no projection; for "
        "unlearn_rounds rounds (0: as many as training played) every client trains, the "
        "forgotten ones (they rejoin) taking B reversed PDGD steps on random queries of the "
        "whole training set; false: each leaver's projected ascent, then post-training",
    )
    relevance_reset: bool = param(
        False,
        "before training, relabel the leavers' queries of above-median loss upside down (the "
        "study's relevance-reset check; results: unlearning.relevance_reset)",
    )
    store_every: int = param(10, "unlearning: clients store their update every N rounds", min=1)
    calibration_steps: int = param(2, "unlearning: local interactions n' per calibration", min=1)
    compute_time: float = param(0.0, "simulated seconds of local training per interaction", min=0.0)

    @property
    def clip_bound(self) -> float:
        return self.sensitivity / (2.0 if self.clip == "half" else 1.0)

    @property
    def clip_order(self) -> int:
        return 1 if self.clip_norm == "l1" else 2

    def l1_sensitivity(self, d: int) -> float:
        """How far apart (L1) two clients' clipped d-dimensional weights can be: the shift of
        the aggregate when one client's data is replaced."""
        return 2.0 * self.clip_bound * (1.0 if self.clip_order == 1 else float(np.sqrt(d)))


def gamma_noise(rng: np.random.Generator, n_shares: int, scale: float, size: int) -> np.ndarray:
    """One client's share gamma - gamma' of Laplace(scale) noise split over n_shares: n_shares
    of them sum to Laplace(scale), k of them to gamma - gamma' with Gamma(k / n_shares)."""
    shape = 1.0 / max(1, n_shares)
    return rng.gamma(shape, scale, size) - rng.gamma(shape, scale, size)


class FPDGDClient(OnlineClient):
    """An honest FPDGD client: the PDGD learner (clipped after every step under DP), its
    update privatised before sending, stored for unlearning; attackers change ``make_update``."""

    #: whether it takes part in unlearning (stores its updates, calibrates): its protocol's
    #: parameters then carry ``store_every`` and ``calibration_steps`` (FPDGD's ``Params``)
    unlearns = True

    def __init__(
        self,
        agent_id: str,
        ctx: RunContext,
        queries: np.ndarray,
        rng: np.random.Generator,
        click_model=None,
        **learner,
    ) -> None:
        p = ctx.params
        clip = (p.clip_bound, p.clip_order) if p.dp else None
        super().__init__(agent_id, ctx, queries, rng, click_model=click_model, clip=clip, **learner)
        self.dp = p.dp
        self.noise_scale = p.sensitivity / p.epsilon if p.dp else 0.0
        #: how many clients the round's noise is split over: the server says it with the model
        #: (a server that does not gets the federation's size, the paper's choice)
        self.shares = ctx.config.n_clients
        # updates are stored for unlearning only in runs whose timeline may ask for it: 1000
        # clients' MLP(64) updates every 10 rounds held 2.5 GB by round 1000
        unlearns = self.unlearns and UNLEARN_ACTION in ctx.config.timeline_actions
        calibrates = unlearns and p.unlearning == "federaser" and not p.federaser_as_code
        self.store_every = p.store_every if calibrates else None
        self.calibration_steps = p.calibration_steps if calibrates else None
        self.stored: dict[int, np.ndarray] = {}  # unlearning: round -> this client's update
        #: its generator's first state: retraining reruns the federation from the same seeds
        self.rng_start = self.rng.bit_generator.state
        #: pga: (round, the model this client last sent) and the reference model it gives
        self.pga = unlearns and p.unlearning == "pga" and not p.pga_as_code
        #: it asked to be forgotten (PGA as the study's code: it ascends when it rejoins)
        self.forgotten = False
        self.sent: tuple[int, np.ndarray] | None = None
        self.reference: np.ndarray | None = None
        # this device's time per interaction: the protocol's, scaled by the system model
        self.compute_time = p.compute_time * ctx.compute_scale(agent_id)

    def privatise(self, theta: np.ndarray) -> np.ndarray:
        """DP: this client's share of the round's noise (nothing without DP)."""
        if not self.dp:
            return theta
        return theta + gamma_noise(self.rng, self.shares, self.noise_scale, theta.size)

    async def local_train(self, start: np.ndarray, n: int, ascend: bool = False) -> np.ndarray:
        if self.users.arrivals is not None:
            replayed(self.ctx, "played", n)
        return await super().local_train(start, n, ascend)

    async def make_update(self, round: int, start: np.ndarray) -> np.ndarray:
        """The weights this client sends for the round (async: training may be batched)."""
        users = self.users
        oracle = users.probe.oracle_read
        users.issued = [] if oracle else None
        theta = await super().make_update(round, start)
        if oracle:
            # oracle truth for eavesdroppers' scores (latest per client): the pre-noise local
            # update, the queries it came from and its FedAvg weight (an auditor's knowledge)
            users.probe.oracle[UPDATE, self.id] = (
                round,
                theta - start,
                users.issued,
                self.interactions,
            )
        return self.privatise(theta)

    @handles(MODEL)
    async def on_model(self, env) -> None:
        start = env.body["params"]
        users = self.users
        if env.body.get("restart"):
            self.rng.bit_generator.state = self.rng_start
        if env.body.get("shares"):
            self.shares = env.body["shares"]
        if users.arrivals is not None:  # a replayed log: the queries issued since last time
            self.interactions = users.pending(self.ctx.now())
            if self.interactions == 0:  # none: an empty update (weight 0), counted
                replayed(self.ctx, "empty_updates")
                self.reply(env.src, UPDATE, {"params": start, "n_interactions": 0}, env.round)
                return
        else:
            # fine-tuning as the study's code: its budget, at most the client's own queries
            batch = env.body.get("batch")
            batch = min(batch, len(users.queries)) if batch else self.batch
            self.interactions = self.ctx.local_work(self.id, batch)
        if env.body.get("ascend") and self.forgotten:
            theta = await self.ascend_anywhere(start, self.interactions)
            self.reply(
                env.src, UPDATE, {"params": theta, "n_interactions": self.interactions}, env.round
            )
            return
        if self.pga and self.sent is not None and self.sent[0] == env.round - 1:
            # the global model without this client's last contribution (FedAvg of n equal ones)
            self.reference = reference_model(start, self.sent[1], self.ctx.config.n_clients)
        theta = await self.make_update(env.round, start)
        if self.pga:
            self.sent = (env.round, theta)
        if self.store_every and env.round % self.store_every == 0:
            self.stored[env.round] = theta - start
        # reply() masks the update when secure aggregation is on (else it is self.send)
        self.reply(
            env.src, UPDATE, {"params": theta, "n_interactions": self.interactions}, env.round
        )

    @handles(CALIBRATE)
    async def on_calibrate(self, env) -> None:
        """Unlearning: n' local steps from the re-trained model, calibrated to the stored norm."""
        stored = self.stored.get(env.body["stored_round"])
        start = env.body["params"]
        if stored is None:  # not selected (or not yet joined) in that round: nothing to replay
            update, n = np.zeros_like(start), 0
        else:
            n = self.calibration_steps
            update = calibrate(stored, await self.local_train(start, n) - start)
        self.send(env.src, CALIBRATED, {"update": update, "n_interactions": n}, env.round)

    async def ascend_anywhere(self, start: np.ndarray, n: int) -> np.ndarray:
        """PGA as the study's code runs it: n reversed PDGD steps from ``start`` on queries
        drawn at random from the whole training set, not only its own."""
        users = self.users
        own, users.queries = users.queries, np.arange(users.train.n_queries)
        try:
            return await self.local_train(start, n, ascend=True)
        finally:
            users.queries = own

    async def forget(self) -> dict:
        """PGA, before it leaves: gradient ascent on its own users' clicks (PDGD's step
        reversed) from its reference model, projected back into the ball around it after every
        step; what it sends with its request (nothing before it has a reference model)."""
        reference = self.reference
        if reference is None:
            return {}
        p = self.ctx.params
        steps = p.pga_steps or len(self.users.queries)
        radius = pga_radius(reference, p.pga_radius, self.rng)
        theta = reference
        for _ in range(steps):
            theta = project(await self.local_train(theta, 1, ascend=True), reference, radius)
        return {"params": theta, "n_interactions": steps}


def replayed(ctx: RunContext, what: str, n: int = 1) -> None:
    """Count what a replaying client did (``replay`` in results; see
    ``simulation.replay_partition``)."""
    ctx.probe.extras["replay"][what] += n


class FPDGDStrategy(ModelStrategy):
    """Server side: broadcast the global weights, aggregate the clients' weights, and take the
    unlearning requests (the run calibrates the leavers away when training ends)."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.leavers: dict[str, int] = {}  # client id -> round of its request
        self.shares: dict[int, int] = {}  # DP: round -> clients its noise was split over
        self.interactions = 0  # the interactions of every update aggregated so far
        #: retraining's first round, whose model tells the clients to restart their generators
        self.restart_round: int | None = None
        #: pga: each leaver's model after its ascent and the ascent's interactions
        self.ascended: dict[str, tuple[np.ndarray, int]] = {}
        #: fedremove: every aggregated round's model before it and its (client, model, weight)
        self.history: list | None = None
        #: relevance reset: the relabelled training queries whose loss ``evaluate`` reports
        self.reset_queries: list[int] = []
        #: fine-tuning as the study's code: the interactions each client is asked for
        self.phase_batch: int | None = None
        #: PGA as the study's code: the forgotten clients ascend, and their interactions
        self.ascending = False
        self.ascent_interactions = 0

    def configure_for(self, round: int, participants: list[str]) -> dict:
        """With DP the model carries how many clients share the round's noise: its clients."""
        body = self.configure_round(round)
        if round == self.restart_round:
            body = {**body, "restart": 1}
        if self.phase_batch is not None:
            body = {**body, "batch": self.phase_batch}
        if self.ascending:
            body = {**body, "ascend": 1}
        if self.ctx.params.dp:
            self.shares[round] = len(participants)
            body = {**body, "shares": len(participants)}
        return body

    def screen(self, reply) -> tuple[str, str] | None:
        """As ``ModelStrategy.screen``; fine-tuning as the study's code allows its budget."""
        if self.phase_batch is None:
            return super().screen(reply)
        most = max(self.ctx.most_interactions(reply.src), self.phase_batch)
        vectors = {"params": self.model.size}
        return screen_reply(reply.body, vectors, self.max_abs(), {"n_interactions": most})

    def aggregate(self, round: int, replies: list) -> dict:
        self.interactions += sum(int(r.body["n_interactions"]) for r in replies)
        if self.ascending:
            forgotten = [r for r in replies if r.src in self.leavers]
            self.ascent_interactions += sum(int(r.body["n_interactions"]) for r in forgotten)
        if self.history is not None:
            sent = [(r.src, np.array(r.body["params"]), r.body["n_interactions"]) for r in replies]
            self.history.append((self.model.copy(), sent))
        return super().aggregate(round, replies)

    def evaluate(self) -> dict[str, float]:
        metrics = super().evaluate()
        if self.reset_queries:
            metrics["relevance_reset_loss"] = self.reset_loss()
        return metrics

    def reset_loss(self) -> float:
        """The relevance-reset loss of the global model on the relabelled queries."""
        self.ranker.set_params(self.model)
        return mean_reset_loss(self.ranker, self.ctx.data.train, self.reset_queries)

    def max_abs(self) -> float:
        """With DP, a share of the Laplace(Delta / epsilon) noise rides on every coordinate."""
        p = self.ctx.params
        return MAX_ABS + (100.0 * p.sensitivity / p.epsilon if p.dp else 0.0)

    @handles(UNLEARN)
    def on_unlearn_request(self, env) -> None:
        self.leavers.setdefault(env.body["client"], env.round)
        if env.body.get("params") is not None:
            bad = screen_reply(env.body, {"params": self.model.size}, self.max_abs())
            if bad is None:
                self.ascended[env.body["client"]] = (env.body["params"], env.body["n_interactions"])
            else:
                self.ctx.emit("unlearn_model_refused", agent=env.body["client"], reason=bad[0])
        self.ctx.emit("unlearn_request", agent=env.body["client"], round=env.round)


class CalibrationStrategy(Strategy):
    """Re-training from scratch with calibrated updates: one round per stored round."""

    broadcast_kind = CALIBRATE
    reply_kind = CALIBRATED

    def __init__(self, base: FPDGDStrategy, stored_rounds: list[int]) -> None:
        self.base = base
        self.stored_rounds = stored_rounds
        self.first_round = 0
        base.model = base.ctx.new_ranker().get_params()  # re-initialise the global model

    def configure_round(self, round: int) -> dict:
        return {
            "params": self.base.model,
            "stored_round": self.stored_rounds[round - self.first_round],
        }

    def screen(self, reply) -> tuple[str, str] | None:
        """A calibrated update of the model's length, of at most the calibration's steps."""
        base = self.base
        most = {"n_interactions": base.ctx.params.calibration_steps}
        return screen_reply(reply.body, {"update": base.model.size}, base.max_abs(), most)

    def aggregate(self, round: int, replies: list) -> dict:
        used = [r for r in replies if r.body["n_interactions"] > 0]
        if used:
            deltas = np.stack([r.body["update"] for r in used])
            self.base.model = self.base.model + deltas.mean(axis=0)
        return {"calibrated": len(used)}

    def evaluate(self) -> dict[str, float]:
        return self.base.evaluate()


class ChainStrategy(Strategy):
    """FedEraser as the study's code runs it (``federaser_as_code``), from the server's stored
    rounds (``FPDGDStrategy.history``): rebuilt model U0 is the initial model, U1 the mean of
    the remaining clients' models of training round 1; for each later training round t the
    remaining clients, in id order, train B interactions one after another, each from the
    model the previous one sent (the code's clients share one weight array, so Ut itself ends
    as the last client's model); U(t+1) is the mean of their models, or, when t is a multiple
    of 5, the last client's model plus the mean of their models minus it, rescaled to the
    length of the stored round's mean update (mean of the remaining clients' stored models
    minus round t's global model). The result is the trained model plus lr times the sum of
    every U. One engine round per client's turn; evaluations show the code's curve (the
    trained model plus lr times the sum of the rebuilt models so far)."""

    broadcast_kind = MODEL
    reply_kind = UPDATE

    def __init__(self, base: FPDGDStrategy, history: list, forgotten: set[str], trained) -> None:
        self.base = base
        self.history = history
        self.forgotten = forgotten
        self.order = sorted({c for _, sent in history for c, _, _ in sent} - forgotten)
        self.trained = np.array(trained, dtype=np.float64)
        self.lr = base.ctx.params.lr
        first = [m for c, m, _ in history[0][1] if c not in forgotten]
        start = history[0][0]
        self.rebuilt = [start.copy(), np.mean(first, axis=0) if first else start.copy()]
        #: the model of the round being rebuilt as its clients train it, and what they sent
        self.chain = self.rebuilt[-1].copy()
        self.sent: list[np.ndarray] = []
        self.rounds = (len(history) - 1) * len(self.order)
        self.first_round = 0
        self.round = 0
        self.interactions = 0
        self.done = False
        base.model = self.trained + self.lr * self.rebuilt[0]

    def select(self, round, candidates, rng, plan) -> list[str]:
        """The next remaining client's turn (nobody when it is offline)."""
        i = round - self.first_round
        if i and i % len(self.order) == 0:
            self._close()
        self.round = round
        client = self.order[i % len(self.order)]
        return [client] if client in candidates else []

    def configure_round(self, round: int) -> dict:
        return {"params": self.chain}

    def screen(self, reply) -> tuple[str, str] | None:
        return self.base.screen(reply)

    def aggregate(self, round: int, replies: list) -> dict:
        for r in replies:
            self.chain = np.array(r.body["params"], dtype=np.float64)
            self.sent.append(self.chain)
            self.interactions += int(r.body["n_interactions"])
        return {"clients": len(replies)}

    def _close(self) -> None:
        """The rebuilt round is over: Ut ends as the chain's last model; U(t+1) follows."""
        t = len(self.rebuilt) - 1
        self.rebuilt[-1] = last = self.chain
        if not self.sent:
            nxt = last.copy()
        elif t % 5 == 0:
            start, stored = self.history[t]
            old = [m for c, m, _ in stored if c not in self.forgotten]
            step = np.mean(old, axis=0) - start if old else np.zeros_like(start)
            nxt = last + calibrate(step, np.mean(self.sent, axis=0) - last)
        else:
            nxt = np.mean(self.sent, axis=0)
        self.rebuilt.append(nxt)
        self.chain, self.sent = nxt.copy(), []
        self.base.model = self.trained + self.lr * np.sum(self.rebuilt[:-1], axis=0)

    def finalise(self) -> None:
        """The last rebuilt round closed: the trained model plus lr times every U."""
        if self.done:
            return
        if self.rounds:
            self._close()
        self.done = True
        self.base.model = self.trained + self.lr * np.sum(self.rebuilt, axis=0)

    def evaluate(self) -> dict[str, float]:
        if self.round == self.first_round + self.rounds - 1:
            self.finalise()
        return self.base.evaluate()


class FPDGD(ProtocolRun):
    """FPDGD with unlearning: a client may ask to be forgotten (at any round; it stops taking
    part at once), and when training ends the run forgets the leavers by ``unlearning``: a
    FedEraser calibration phase, a retraining or fine-tuning phase of the remaining clients, or
    nothing (``original``). ``report`` gives the phase's cost beside retraining's."""

    partitions = True  # clients read their own data, users and batch from the run context
    completes = True  # and how many of the B interactions a training does
    actions = MappingProxyType({UNLEARN_ACTION: "left"})  # the leaver leaves for good
    replays = True  # a logged user's queries, at their times (dataset.format = "aol4foltr")

    @classmethod
    def check(cls, config: RunConfig) -> None:
        if config.params.dp and config.dataset.replayed:
            raise ScenarioError(
                "federation.params.dp: expected false with dataset.format = 'aol4foltr' (a "
                "client with no new query sends an empty update without its noise share, so "
                "the round's noise would not sum to the Laplace the accounting states)"
            )
        refuse_unlearning(config)

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.strategy = FPDGDStrategy(ctx)
        # the server stores every round (federaser_as_code applies to federaser alone)
        stores = ctx.params.unlearning == "fedremove" or ctx.params.federaser_as_code
        if stores and UNLEARN_ACTION in ctx.config.timeline_actions:
            self.strategy.history = []
        learner_paths(ctx)  # the names workers' counts are added to
        self.cost: dict = {}
        self.taken_part: dict[int, list[str]] = {}  # round -> clients it aggregated (privacy)
        self.last_round = 0

    def attach_server(self, server) -> None:
        self.server = server  # a request is stamped with the round being played

    def before_agents(self, queries: dict, timeline: list) -> None:
        """Relevance reset: relabel each leaver's queries of above-median loss under the initial
        model, in the training set every client of the run reads."""
        if not self.ctx.params.relevance_reset:
            return
        ctx = self.ctx
        ranker, train = ctx.new_ranker(), ctx.data.train
        leavers = sorted({a for action, ids in timeline if action == UNLEARN_ACTION for a in ids})
        reset = sorted(q for a in leavers for q in high_loss_queries(ranker, train, queries[a]))
        ctx.data = replace(ctx.data, train=relabelled(train, reset, ctx.data.n_grades))
        self.strategy.reset_queries = reset

    async def act(self, agent: Agent, action: str) -> None:
        if action != UNLEARN_ACTION:
            return await super().act(agent, action)
        body = {"client": agent.id}
        if getattr(agent, "pga", False):
            body |= await agent.forget()
        agent.send("server", UNLEARN, body, self.server.plan_round)
        if rejoins(self.ctx.params):  # the study code's original / PGA: it trains on at the end
            agent.forgotten = True
        await agent.leave()  # it takes no further part in training

    async def finish(self, server, reports: list) -> None:
        """Training is over: forget the leavers, if any asked, by the scenario's method."""
        self.taken_part = {r.round: r.clients for r in reports if r.aggregated}
        self.last_round = reports[-1].round if reports else 0
        leavers = self.strategy.leavers
        if not leavers:
            return
        p = self.ctx.params
        method = p.unlearning
        self.ctx.emit("unlearn_start", clients=sorted(leavers), strategy=method)
        trained_loss = self.strategy.reset_loss() if self.strategy.reset_queries else None
        if method == "federaser" and p.federaser_as_code:
            done = await self._rebuild(server, set(leavers))
        elif method == "federaser":
            done = await self._calibrate(server)
        elif method == "original" and p.original_as_code:  # all clients train on
            await self._rejoin(leavers)
            done = await self._train_on(server, reports, None)
        elif method == "original":
            done = [], 0
        elif method == "pga" and p.pga_as_code:
            await self._rejoin(leavers)
            self.strategy.ascending = True
            done = await self._train_on(server, reports, None)
        elif method == "pga":
            done = await self._ascend_and_train(server, reports)
        elif method == "fedremove":
            done = await self._replay(server, set(leavers))
        elif method == "retrain":  # from the same seeds: as if they had never taken part
            self.strategy.restart_round = self.last_round + 1
            done = await self._train_on(server, reports, self.ctx.new_ranker().get_params())
        else:
            if p.finetune_as_code:  # the study's code passes its round count as the batch
                self.strategy.phase_batch = len(reports)
            done = await self._train_on(server, reports, None)
        if done is None:
            return
        phase, interactions = done
        self.cost = {
            "strategy": method,
            "clients": sorted(leavers),
            "requested_round": min(leavers.values()),
            "rounds": len(phase),
            "interactions": interactions,
            "messages": sum(r.selected + r.replied for r in phase),
            # simulated seconds of the phase's rounds (PGA's ascent ran at the request)
            "sim_s": sum(r.duration for r in phase),
            # retraining = every training round again, without the leavers
            **self._retrain_cost(reports, len(leavers)),
        }
        d = self.strategy.model.size
        if method == "federaser" and not p.federaser_as_code:
            self.cost["storage_bytes_per_client"] = len(phase) * d * 8
        if method == "pga" and p.pga_as_code:
            self.cost["ascent_interactions"] = self.strategy.ascent_interactions
        if self.strategy.history is not None:  # fedremove, federaser as the study's code
            stored = sum(1 + len(sent) for _, sent in self.strategy.history)
            self.cost["storage_bytes_server"] = stored * d * 8
        if trained_loss is not None:
            unlearned_loss = self.strategy.reset_loss()
            self.cost["relevance_reset"] = {
                "queries": len(self.strategy.reset_queries),
                "loss_trained": trained_loss,
                "loss_unlearned": unlearned_loss,
                # the study's RelR difference: how far unlearning undid the relabelling
                "difference": unlearned_loss - trained_loss,
            }
        self.ctx.emit("unlearn_done", **self.cost)
        # the model it ends with: the distance to a retrained variant's (observe/unlearning.py)
        self.cost["final_model"] = self.strategy.model.tolist()

    def _retrain_cost(self, reports: list, n_leavers: int) -> dict:
        ctx = self.ctx
        remaining = ctx.config.n_clients - n_leavers
        return {
            "retrain_interactions": len(reports)
            * remaining
            * ctx.config.federation.queries_per_client,
            "retrain_messages": 2 * len(reports) * remaining,
        }

    async def _rejoin(self, leavers: dict[str, int]) -> None:
        """The study code's original and PGA: the forgotten clients take part again (wherever
        they live: the run plays the action, as the timeline's)."""
        for aid in sorted(leavers):
            await self.ctx.act(aid, "rejoin")

    async def _calibrate(self, server) -> tuple[list, int] | None:
        """FedEraser: one calibration round per stored round, from a re-initialised model (its
        reports and interactions; None when nothing was stored yet)."""
        p = self.ctx.params
        stored_rounds = list(range(p.store_every, self.last_round + 1, p.store_every))
        if not stored_rounds:
            self.ctx.emit("unlearn_skipped", reason="no stored updates yet")
            return None
        strategy = CalibrationStrategy(self.strategy, stored_rounds)
        strategy.first_round = self.last_round + 1
        plan = replace(server.plan, rounds=len(stored_rounds), eval_every=1)
        phase = await server.run_rounds(strategy, plan, first_round=self.last_round + 1)
        return phase, sum(r.replied for r in phase) * p.calibration_steps

    async def _ascend_and_train(self, server, reports: list) -> tuple[list, int] | None:
        """PGA: the leavers' ascended models averaged (by their interactions), then trained on
        by the remaining clients (None when no leaver could ascend: none had a reference)."""
        ascended = self.strategy.ascended
        if not ascended:
            self.ctx.emit("unlearn_skipped", reason="no leaver sent an ascended model")
            return None
        models = np.stack([m for m, _ in ascended.values()])
        weights = np.array([max(1, n) for _, n in ascended.values()], dtype=np.float64)
        phase, interactions = await self._train_on(
            server, reports, weights @ models / weights.sum()
        )
        return phase, interactions + sum(n for _, n in ascended.values())

    async def _rebuild(self, server, leavers: set[str]) -> tuple[list, int] | None:
        """FedEraser as the study's code: one round per remaining client's turn of every
        rebuilt training round after the first (None when no round was stored)."""
        history = self.strategy.history
        if not history:
            self.ctx.emit("unlearn_skipped", reason="no aggregated round stored")
            return None
        rebuild = ChainStrategy(self.strategy, history, leavers, self.strategy.model)
        rebuild.first_round = self.last_round + 1
        if rebuild.rounds == 0:
            rebuild.finalise()
            return [], 0
        every = len(rebuild.order) * server.plan.eval_every  # evaluated once per rebuilt round
        plan = replace(server.plan, rounds=rebuild.rounds, eval_every=every, min_clients=1)
        waits, server.wait_empty = server.wait_empty, False  # an offline client's turn: skipped
        try:
            phase = await server.run_rounds(rebuild, plan, first_round=rebuild.first_round)
        finally:
            server.wait_empty = waits
        rebuild.finalise()
        return phase, rebuild.interactions

    async def _replay(self, server, leavers: set[str]) -> tuple[list, int] | None:
        """FedRemove: one server-side round per stored training round, no client asked."""
        history = self.strategy.history
        if not history:
            self.ctx.emit("unlearn_skipped", reason="no aggregated round stored")
            return None
        replay = ReplayStrategy(self.strategy, history, leavers, self.ctx.params.fedremove_replay)
        replay.first_round = self.last_round + 1
        waits, server.wait_empty = server.wait_empty, False  # the server's own work: no wait
        try:
            phase = await server.run_rounds(
                replay, replace(server.plan, rounds=len(history)), first_round=replay.first_round
            )
        finally:
            server.wait_empty = waits
        return phase, 0

    async def _train_on(self, server, reports: list, start: np.ndarray | None) -> tuple[list, int]:
        """FPDGD rounds of the remaining clients from ``start`` (None: the trained model), as
        many as training played unless ``unlearn_rounds`` says: retraining from the initial
        model (the clients' generators restarted), fine-tuning and PGA's post-training (the
        clients go on from where training left their randomness)."""
        strategy = self.strategy
        if start is not None:
            strategy.model = start
        before = strategy.interactions
        rounds = self.ctx.params.unlearn_rounds or len(reports)
        phase = await server.run_rounds(
            strategy, replace(server.plan, rounds=rounds), first_round=self.last_round + 1
        )
        return phase, strategy.interactions - before

    def client(self, agent_id: str, queries: np.ndarray, rng: np.random.Generator) -> Agent:
        return FPDGDClient(agent_id, self.ctx, queries, rng)

    def report(self) -> dict:
        out = {"unlearning": self.cost} if self.cost else {}
        return {**out, "privacy": self.privacy() if self.ctx.params.dp else {"dp": False}}

    def privacy(self) -> dict:
        """What the run guaranteed: per round (how many shares the noise was split over, how
        many reached the aggregate, the resulting epsilon and delta at the nominal epsilon),
        per client and per run, under the sensitivity the clipping gives (``epsilon_mechanism``)
        and, for comparison, the paper's nominal reading (``nominal``: Laplace every round,
        sensitivity Delta). The guarantee is of the round's aggregate (central DP)."""
        p, ctx = self.ctx.params, self.ctx
        d = self.strategy.model.size
        eps_mech = p.l1_sensitivity(d) * p.epsilon / p.sensitivity
        played = sorted(self.taken_part)
        n = ctx.config.n_clients
        # a round the server announced nothing in: the clients split over everyone (the paper)
        shares = {r: self.strategy.shares.get(r, n) for r in played}
        shape = {r: len(self.taken_part[r]) / shares[r] for r in played}
        mechs = {r: gamma_difference(eps_mech, shape[r]) for r in played}
        pure = [mechs[r].pure_epsilon for r in played]
        clients = [client_id(i) for i in range(n)]
        every = ctx.config.evaluation.every
        curve = [r for r in range(1, self.last_round + 1) if r % every == 0 or r == self.last_round]
        nominal = account(laplace(p.epsilon), self.taken_part, clients, [], p.accounting_delta)
        return {
            "dp": True,
            "epsilon": p.epsilon,
            "sensitivity": p.sensitivity,
            "clip": p.clip,
            "clip_norm": p.clip_norm,
            "clip_bound": p.clip_bound,
            "dimension": d,
            "l1_sensitivity": p.l1_sensitivity(d),
            "epsilon_mechanism": eps_mech,
            "noise": "each of a round's k clients adds gamma - gamma', both Gamma(1/k, "
            "Delta/epsilon); the k' reports aggregated sum to gamma - gamma' with Gamma(k'/k), "
            "Laplace(Delta/epsilon) when k' = k",
            "rounds": {
                "round": played,
                "shares": [shares[r] for r in played],
                "aggregated": [len(self.taken_part[r]) for r in played],
                "epsilon": [e if np.isfinite(e) else None for e in pure],
                "delta_at_nominal_epsilon": [delta_at(mechs[r], p.epsilon) for r in played],
            },
            "nominal": {
                "epsilon_per_round": p.epsilon,
                "sensitivity": p.sensitivity,
                "epsilon_basic_composition_all_rounds": p.epsilon * ctx.config.federation.rounds,
                "run": nominal["run"],
            },
            **account(mechs, self.taken_part, clients, curve, p.accounting_delta),
        }


def rejoins(p) -> bool:
    """Whether the forgotten clients take part again when training ends (the study code's
    original and PGA)."""
    return (p.unlearning == "original" and p.original_as_code) or (
        p.unlearning == "pga" and p.pga_as_code
    )


def refuse_unlearning(config: RunConfig) -> None:
    """One line for an unlearning setting the run could not make true."""
    p, fed = config.params, config.federation
    key = "federation.params.unlearning"
    for strategy in AS_CODE:
        if getattr(p, f"{strategy}_as_code") and p.unlearning != strategy:
            raise ScenarioError(
                f"federation.params.{strategy}_as_code: applies to unlearning = {strategy!r} "
                f"only, not {p.unlearning!r}"
            )
    for name in ("original_as_code", "federaser_as_code"):
        if p.dp and getattr(p, name):
            raise ScenarioError(
                f"federation.params.{name}: with dp = true not supported (the privacy "
                "accounting covers the training rounds only); expected dp = false"
            )
    if p.federaser_as_code and (fed.participation < 1.0 or fed.secure_aggregation):
        raise ScenarioError(
            "federation.params.federaser_as_code: the study's code rebuilds from every "
            "client's model of every round; expected participation = 1 and "
            "federation.secure_aggregation off"
        )
    if p.dp and p.unlearning in RETRAINING:
        raise ScenarioError(
            f"{key}: {p.unlearning!r} with dp = true is not supported (the privacy accounting "
            "covers the training rounds only); use 'federaser', 'fedremove' or 'original', or "
            "dp = false"
        )
    if p.unlearning in ("pga", "fedremove") and fed.secure_aggregation:
        raise ScenarioError(
            f"{key}: {p.unlearning!r} needs each client's update, which secure aggregation "
            "hides; expected federation.secure_aggregation off"
        )
    if p.unlearning == "pga" and p.pga_as_code and config.dataset.replayed:
        raise ScenarioError(
            "federation.params.pga_as_code: its ascent draws random queries of the training "
            "set, which a replayed log does not have; expected a LETOR dataset"
        )
    projected = p.unlearning == "pga" and not p.pga_as_code
    if projected and (
        fed.participation < 1.0 or fed.aggregator != "fedavg" or config.dataset.replayed
    ):
        raise ScenarioError(
            f"{key}: 'pga' needs a reference model a leaver can compute (the global model as "
            "the FedAvg of every client's equal share): expected participation = 1, "
            "aggregator = 'fedavg' and a LETOR dataset"
        )
    if p.relevance_reset and (
        UNLEARN_ACTION not in config.timeline_actions or fed.partition or config.dataset.replayed
    ):
        raise ScenarioError(
            "federation.params.relevance_reset: expected a timeline 'unlearn' action (whose "
            "clients' queries are relabelled), no [federation.partition] and a LETOR dataset"
        )


#: what this module provides: ``foltr_async.plugins.load_plugins`` installs it
PROVIDES = (
    *KINDS,
    ProtocolEntry(
        NAME,
        "federated PDGD + FedAvg, optional DP and unlearning",
        Params,
        FPDGD,
        wire_bytes=model_message_bytes,
        # FPDGD's update is FedAvg'd by interactions: it may travel masked (secure
        # aggregation)
        summable=Summable(UPDATE, vector="params", weight="n_interactions"),
    ),
)

"""The round engine's contract, driven directly: a fake Strategy and scripted clients on a
MemoryBus in virtual time (no protocol, no data), so each test reads as a timeline."""

import asyncio

import pytest

from foltr_async.rng import stream
from foltr_async.runtime.agent import Agent, handles
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.clock import run
from foltr_async.runtime.engine import RoundPlan, ServerAgent, Strategy
from foltr_async.runtime.network import NetworkModel
from foltr_async.runtime.schema import Int, register_kind

register_kind("test_engine.model", {"model": Int()})
register_kind("test_engine.update", {"value": Int()})


class _Sum(Strategy):
    """The model is the running sum of every aggregated reply's value."""

    broadcast_kind = "test_engine.model"
    reply_kind = "test_engine.update"

    def __init__(self) -> None:
        self.model = 0
        #: (round, simulated time, [(src, reply round, value)]) per aggregate call
        self.aggregated: list[tuple[int, float, list[tuple[str, int, int]]]] = []
        self.evaluations = 0

    def configure_round(self, round):
        return {"model": self.model}

    def aggregate(self, round, replies):
        now = asyncio.get_running_loop().time()
        self.aggregated.append((round, now, [(e.src, e.round, e.body["value"]) for e in replies]))
        self.model += sum(e.body["value"] for e in replies)
        return {"n": len(replies)}

    def evaluate(self):
        self.evaluations += 1
        return {"model": float(self.model)}


class _Client(Agent):
    """Replies ``value`` to each model after ``delays[round]`` simulated seconds (else
    ``delay``); its handler sleeps, so a slow round also delays the next broadcast's reply."""

    role = "client"

    def __init__(self, agent_id, bus, delay, *, value=1, delays=None, copies=1):
        super().__init__(agent_id, bus)
        self.delay = delay
        self.delays = delays or {}
        self.value = value
        self.copies = copies

    @handles("test_engine.model")
    async def on_model(self, env):
        await asyncio.sleep(self.delays.get(env.round, self.delay))
        for i in range(self.copies):
            self.send(env.src, "test_engine.update", {"value": self.value + i}, env.round)


def _play(make_clients, plan, *, after=0.0, phases=()):
    """Run ``plan`` (then each (first_round, plan) of ``phases``) with zero-latency links and
    wait ``after`` more simulated seconds for stragglers. Returns (server, strategy, reports)."""

    async def main():
        bus = MemoryBus(NetworkModel(), stream(0, "net"))
        strategy = _Sum()
        clients = make_clients(bus)
        server = ServerAgent(
            bus, strategy, plan, stream(0, "server"), clients=lambda: [c.id for c in clients]
        )
        for agent in (server, *clients):
            agent.start()
        reports = await server.run_rounds()
        for first_round, later in phases:
            reports += await server.run_rounds(plan=later, first_round=first_round)
        await asyncio.sleep(after)
        return server, strategy, reports

    return run(main())


def test_the_deadline_closes_a_round_and_later_replies_are_counted_late_not_aggregated():
    def clients(bus):
        return [
            _Client("client-0000", bus, 1.0),
            _Client("client-0001", bus, 2.0),
            _Client("client-0002", bus, 15.0),
        ]

    server, strategy, reports = _play(clients, RoundPlan(rounds=2, deadline=10.0), after=20.0)
    # round 1 closes at its deadline (t=10) without the slow client; its round-1 reply lands at
    # t=15, inside round 2, and is not taken for round 2; round 2's reply (t=30) comes after
    # the last round
    assert strategy.aggregated == [
        (1, 10.0, [("client-0000", 1, 1), ("client-0001", 1, 1)]),
        (2, 20.0, [("client-0000", 2, 1), ("client-0001", 2, 1)]),
    ]
    assert server.late_replies == 2
    assert [(r.round, r.selected, r.replied, r.aggregated) for r in reports] == [
        (1, 3, 2, True),
        (2, 3, 2, True),
    ]
    assert reports[0].clients == ["client-0000", "client-0001"]
    assert reports[0].facts == {"n": 2}


def test_a_reply_landing_at_the_deadline_instant_is_already_late():
    def clients(bus):
        return [_Client("client-0000", bus, 1.0), _Client("client-0001", bus, 10.0)]

    server, strategy, _ = _play(clients, RoundPlan(rounds=1, deadline=10.0), after=1.0)
    assert strategy.aggregated == [(1, 10.0, [("client-0000", 1, 1)])]
    assert server.late_replies == 1


def test_a_round_ends_as_soon_as_every_selected_client_has_replied():
    def clients(bus):
        return [_Client("client-0000", bus, 1.0), _Client("client-0001", bus, 2.0)]

    server, strategy, _ = _play(clients, RoundPlan(rounds=2, deadline=10.0))
    assert [(r, t) for r, t, _ in strategy.aggregated] == [(1, 2.0), (2, 4.0)]
    assert server.late_replies == 0


def test_fewer_replies_than_min_clients_keep_the_old_model():
    def clients(bus):
        return [
            _Client("client-0000", bus, 1.0, value=1),
            _Client("client-0001", bus, 2.0, value=10),
            _Client("client-0002", bus, 1.0, value=100, delays={1: 15.0}),
        ]

    plan = RoundPlan(rounds=2, deadline=10.0, min_clients=3)
    server, strategy, reports = _play(clients, plan)
    # round 1: two replies < 3, no aggregate call, the old model is evaluated; round 2: the
    # slow client answers its second model at t=16 and all three are folded in
    assert [(r.replied, r.aggregated, r.facts, r.metrics) for r in reports] == [
        (2, False, {}, {"model": 0.0}),
        (3, True, {"n": 3}, {"model": 111.0}),
    ]
    assert [(r, t) for r, t, _ in strategy.aggregated] == [(2, 16.0)]
    assert server.late_replies == 1  # client-0002's round-1 reply, at t=15


def test_a_round_without_replies_is_not_aggregated_even_with_min_clients_zero():
    def clients(bus):
        return [_Client("client-0000", bus, 50.0)]

    _, strategy, reports = _play(clients, RoundPlan(rounds=1, deadline=10.0, min_clients=0))
    assert (reports[0].replied, reports[0].aggregated) == (0, False)
    assert strategy.aggregated == []


def test_replies_are_aggregated_in_client_id_order_not_arrival_order():
    def clients(bus):  # listed out of order; client-0003 answers first, client-0000 last
        return [_Client(f"client-{i:04d}", bus, 4.0 - i, value=i) for i in (3, 1, 0, 2)]

    _, strategy, reports = _play(clients, RoundPlan(rounds=1, deadline=10.0))
    ids = ["client-0000", "client-0001", "client-0002", "client-0003"]
    assert strategy.aggregated == [(1, 4.0, [(c, 1, i) for i, c in enumerate(ids)])]
    assert reports[0].clients == ids


def test_a_second_reply_in_the_same_round_is_ignored_and_not_counted_late():
    def clients(bus):
        return [_Client("client-0000", bus, 1.0, value=5, copies=2)]

    server, strategy, _ = _play(clients, RoundPlan(rounds=1, deadline=10.0))
    assert strategy.aggregated == [(1, 1.0, [("client-0000", 1, 5)])]
    assert server.late_replies == 0


class _Uninvited(Agent):
    """Sends a reply for round 1 without having been asked."""

    role = "client"

    async def on_join(self):
        await asyncio.sleep(0.5)
        self.send("server", "test_engine.update", {"value": 1000}, 1)


def test_a_reply_from_a_client_not_asked_this_round_is_counted_late():
    async def main():
        bus = MemoryBus(NetworkModel(), stream(0, "net"))
        strategy = _Sum()
        client = _Client("client-0000", bus, 1.0)
        server = ServerAgent(
            bus,
            strategy,
            RoundPlan(rounds=1, deadline=10.0),
            stream(0, "server"),
            clients=lambda: [client.id],
        )
        for agent in (server, client, _Uninvited("eve-0", bus)):
            agent.start()
        await server.run_rounds()
        return server, strategy

    server, strategy = run(main())
    assert strategy.aggregated == [(1, 1.0, [("client-0000", 1, 1)])]
    assert server.late_replies == 1


def test_evaluation_every_n_rounds_and_on_a_phase_s_last_round():
    def clients(bus):
        return [_Client("client-0000", bus, 1.0)]

    plan = RoundPlan(rounds=5, deadline=10.0, eval_every=2)
    # a later phase continues the numbering and counts its evaluation period from its start
    later = (6, RoundPlan(rounds=3, deadline=10.0, eval_every=2))
    _, strategy, reports = _play(clients, plan, phases=[later])
    assert [r.round for r in reports] == list(range(1, 9))
    assert [r.round for r in reports if r.metrics is not None] == [2, 4, 5, 7, 8]
    assert strategy.evaluations == 5
    assert reports[1].metrics == {"model": 2.0}


@pytest.mark.parametrize("participation", [0.5, 1.0])
def test_only_selected_online_clients_are_asked(participation):
    def clients(bus):
        return [_Client(f"client-{i:04d}", bus, 1.0) for i in range(4)]

    _, strategy, reports = _play(clients, RoundPlan(rounds=3, participation=participation))
    asked = round(4 * participation)
    assert [(r.selected, r.replied) for r in reports] == [(asked, asked)] * 3
    assert all(len(srcs) == asked for _, _, srcs in strategy.aggregated)


register_kind("test_engine.note", {"value": Int()})


class _Noting(_Sum):
    """Also takes notes the clients send besides their replies, as they arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[tuple[str, int, float]] = []

    @handles("test_engine.note")
    def on_note(self, env):
        self.notes.append((env.src, env.body["value"], asyncio.get_running_loop().time()))


class _NoteTaker(_Client):
    """Sends a note as the model arrives, then replies as ``_Client`` does."""

    @handles("test_engine.model")
    async def on_model(self, env):
        self.send(env.src, "test_engine.note", {"value": env.round}, env.round)
        await super().on_model(env)


def test_a_strategy_s_declared_handler_receives_its_kind_during_the_round():
    async def main():
        bus = MemoryBus(NetworkModel(), stream(0, "net"))
        strategy = _Noting()
        clients = [_NoteTaker("client-0000", bus, 1.0), _NoteTaker("client-0001", bus, 2.0)]
        server = ServerAgent(
            bus,
            strategy,
            RoundPlan(rounds=2),
            stream(0, "server"),
            clients=lambda: ["client-0000", "client-0001"],
        )
        for agent in (server, *clients):
            agent.start()
        await server.run_rounds()
        return server, strategy

    server, strategy = run(main())
    # taken as delivered (round 2 opens at t=2), the replies still aggregated as before
    assert strategy.notes == [
        ("client-0000", 1, 0.0),
        ("client-0001", 1, 0.0),
        ("client-0000", 2, 2.0),
        ("client-0001", 2, 2.0),
    ]
    assert [sum(v for *_, v in replies) for _, _, replies in strategy.aggregated] == [2, 2]
    assert server.counters["no_handler"] == 0


def test_a_strategy_s_handler_must_not_await():
    class _Awaiting(_Sum):
        @handles("test_engine.note")
        async def on_note(self, env):
            pass

    bus = MemoryBus(NetworkModel(), stream(0, "net"))
    with pytest.raises(TypeError, match="test_engine.note"):
        ServerAgent(bus, _Awaiting(), RoundPlan(rounds=1), stream(0, "server"), clients=list)

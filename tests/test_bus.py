"""Memory bus + network model: timing, loss, presence, taps, replay, drops, determinism."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import structlog
from scipy import stats

from foltr_async.errors import ScenarioError
from foltr_async.runtime import wire
from foltr_async.runtime.bus import AGENT_REASONS, MemoryBus
from foltr_async.runtime.clock import run
from foltr_async.runtime.network import Latency, NetworkModel, Presence, role_of
from foltr_async.runtime.schema import Array, Int, SchemaRegistry
from foltr_async.runtime.wire import Envelope, decode, encode

REG = SchemaRegistry()
REG.register("model", {"params": Array("float64")})
REG.register("ping", {"i": Int()})


class Recorder:
    """A minimal receiver: remembers (virtual arrival time, envelope)."""

    def __init__(self, agent_id: str, role: str = "client") -> None:
        self.id, self.role = agent_id, role
        self.got: list[tuple[float, Envelope]] = []

    def deliver(self, env: Envelope) -> None:
        self.got.append((asyncio.get_running_loop().time(), env))


def make_bus(network: NetworkModel | None = None, seed: int = 0, n: int = 3, **kw):
    bus = MemoryBus(network or NetworkModel(), np.random.default_rng(seed), registry=REG, **kw)
    server = Recorder("server", "server")
    clients = [Recorder(f"client-{i:04d}") for i in range(n)]
    for agent in (server, *clients):
        bus.register(agent)
    return bus, server, clients


def transport_drops(bus: MemoryBus) -> int:
    return sum(v for k, v in bus.stats.dropped.items() if k not in AGENT_REASONS)


def balanced(bus: MemoryBus) -> bool:
    st = bus.stats
    return st.sent + st.injected == st.delivered + transport_drops(bus) + bus.in_flight


def delays(agent: Recorder) -> np.ndarray:
    return np.array([t - env.sent_at for t, env in agent.got])


def test_constant_latency_and_bandwidth_set_exact_arrival_times():
    net = NetworkModel(latency=Latency.constant(0.25), bandwidth=1000.0)
    bus, server, (c0, c1, _) = make_bus(net)
    sizes = {}

    async def main() -> None:
        await asyncio.sleep(10)
        bus.tap(lambda data, h: sizes.__setitem__(h.dst, len(data)))
        bus.send("server", "client-0000", "ping", {"i": 1})
        bus.send("server", "client-0001", "model", {"params": np.zeros(500)})
        await asyncio.sleep(60)

    run(main())
    assert [env.body["i"] for _, env in c0.got] == [1]
    assert c0.got[0][0] == pytest.approx(10.25 + sizes["client-0000"] / 1000.0, abs=1e-9)
    assert sizes["client-0001"] > 4000  # 500 float64
    assert c1.got[0][0] == pytest.approx(10.25 + sizes["client-0001"] / 1000.0, abs=1e-9)
    assert balanced(bus) and bus.stats.delivered == 2


@pytest.mark.parametrize(
    "latency, dist",
    [
        (Latency.uniform(0.05, 0.3), stats.uniform(0.05, 0.25)),
        (Latency.lognormal(0.08, 0.6), stats.lognorm(0.6, scale=0.08)),
    ],
)
def test_latency_distributions_deliver_at_the_right_virtual_times(latency, dist):
    bus, server, clients = make_bus(NetworkModel(latency=latency), n=4)

    async def main() -> None:
        for i in range(500):
            bus.broadcast("server", [c.id for c in clients], "ping", {"i": i})
            bus.send("client-0000", "server", "ping", {"i": i})
            await asyncio.sleep(0.01)
        await asyncio.sleep(100)

    run(main())
    d = np.concatenate([delays(c) for c in (*clients, server)])
    assert d.size == 2500
    assert stats.kstest(d, dist.cdf).pvalue > 1e-3
    assert np.median(d) == pytest.approx(dist.median(), rel=0.08)


def test_messages_due_at_the_same_time_arrive_in_send_order():
    bus, server, (c0, *_) = make_bus(NetworkModel(latency=Latency.constant(1.0)))

    async def main() -> None:
        for i in range(50):
            bus.send("server", "client-0000", "ping", {"i": i})
        await asyncio.sleep(2)

    run(main())
    assert [env.body["i"] for _, env in c0.got] == list(range(50))
    assert {t for t, _ in c0.got} == {1.0}


def test_loss_rate_is_statistically_right():
    loss, n = 0.2, 4000
    bus, server, clients = make_bus(NetworkModel(loss=loss), n=4)

    async def main() -> None:
        for i in range(n // 8):
            bus.broadcast("server", [c.id for c in clients], "ping", {"i": i})  # vectorised path
            for c in clients:
                bus.send(c.id, "server", "ping", {"i": i})  # scalar path
        await asyncio.sleep(1)

    run(main())
    lost = bus.stats.dropped["lost"]
    sd = np.sqrt(n * loss * (1 - loss))
    assert abs(lost - n * loss) < 4 * sd
    # both code paths lose at the same rate
    lost_down = n // 2 - sum(len(c.got) for c in clients)
    assert abs(lost_down - n / 2 * loss) < 4 * np.sqrt(n / 2 * loss * (1 - loss))
    assert bus.stats.delivered == n - lost and balanced(bus)


def test_availability_drops_messages_to_and_from_offline_clients():
    bus, server, clients = make_bus(NetworkModel(availability=0.5), n=400)
    ids = [c.id for c in clients]
    result = {}

    async def main() -> None:
        online = bus.begin_round(1, [*ids, "server"])
        result["online"] = online
        bus.broadcast("server", ids, "ping", {"i": 1})
        for c in clients:
            bus.send(c.id, "server", "ping", {"i": 2})
        await asyncio.sleep(1)

    run(main())
    online = result["online"]
    assert "server" in online  # the server is always online
    n_on = len(online) - 1
    assert abs(n_on - 200) < 4 * np.sqrt(400 * 0.25)
    got = {c.id for c in clients if c.got}
    assert got == online - {"server"}
    assert {env.src for _, env in server.got} == online - {"server"}
    assert bus.stats.dropped["offline"] == 2 * (400 - n_on)
    assert balanced(bus)


def test_churn_follows_the_documented_model():
    churn, mean_away = 0.1, 4.0
    net = NetworkModel(churn=churn, churn_rounds=mean_away)
    ids = [f"client-{i:04d}" for i in range(2000)]
    rng, state = np.random.default_rng(3), Presence()
    away = []
    for r in range(1, 81):
        online = net.online(ids, r, rng, state=state)
        if r > 30:  # after burn-in: stationary fraction away = cR / (1 - c + cR)
            away.append(1 - len(online) / len(ids))
    expected = churn * mean_away / (1 - churn + churn * mean_away)
    assert np.mean(away) == pytest.approx(expected, abs=0.01)
    # away spells (rounds, counting the one it left in) are geometric with the configured mean
    rng = np.random.default_rng(4)
    st2 = Presence()
    spells = []
    for r in range(1, 200):
        before = dict(st2.away_until)
        net.online(ids[:200], r, rng, state=st2)
        spells += [u - r for a, u in st2.away_until.items() if before.get(a) != u]
    assert np.mean(spells) == pytest.approx(mean_away, rel=0.1)
    assert min(spells) >= 1


def test_presence_is_independent_of_traffic():
    """Variants of one seed share dropout: message draws never shift the presence stream."""

    def online_sets(traffic: int) -> list[set[str]]:
        bus, server, clients = make_bus(NetworkModel(availability=0.7, loss=0.3), seed=5, n=30)
        out = []

        async def main() -> None:
            for r in range(5):
                out.append(bus.begin_round(r, [c.id for c in clients]))
                for i in range(traffic):
                    bus.send("server", "client-0000", "ping", {"i": i})
                await asyncio.sleep(1)

        run(main())
        return out

    assert online_sets(0) == online_sets(17)


def test_tap_sees_the_exact_bytes_at_send_time_with_filters():
    bus, server, (c0, c1, c2) = make_bus(NetworkModel(latency=Latency.constant(0.5)))
    everything, to_c1, models = [], [], []
    bus.tap(lambda data, h: everything.append((asyncio.get_running_loop().time(), data, h)))
    bus.tap(lambda data, h: to_c1.append(h.dst), dst="client-0001")
    bus.tap(lambda data, h: models.append(h.kind), src=["server"], kinds="model")
    params = np.arange(4.0)

    async def main() -> None:
        bus.broadcast("server", [c0.id, c1.id, c2.id], "model", {"params": params}, round=3)
        bus.send("client-0001", "server", "ping", {"i": 7}, round=3)
        params[:] = -1  # mutating after send cannot change what was sent
        await asyncio.sleep(1)

    run(main())
    assert len(everything) == 4 and to_c1 == ["client-0001"] and models == ["model"] * 3
    for t, data, header in everything:
        assert t == 0.0 and header.body == {}  # the header only: content needs decoding
        env = decode(data, REG)
        assert (env.src, env.dst, env.kind, env.seq, env.round) == (
            header.src, header.dst, header.kind, header.seq, header.round,
        )  # fmt: skip
        assert data == encode(env)  # byte-exact
    delivered = {env.dst: env for _, env in (*c0.got, *c1.got, *c2.got)}
    for _, data, header in everything[:3]:
        assert data == encode(delivered[header.dst])
        assert np.array_equal(delivered[header.dst].body["params"], np.arange(4.0))
    assert not np.shares_memory(delivered["client-0000"].body["params"], params)


def test_broadcast_packs_the_body_once(monkeypatch):
    calls = []
    real = wire.pack_body
    monkeypatch.setattr(wire, "pack_body", lambda body: calls.append(1) or real(body))
    bus, server, clients = make_bus(n=50)

    async def main() -> None:
        bus.broadcast("server", [c.id for c in clients], "model", {"params": np.zeros(136)})
        await asyncio.sleep(1)

    run(main())
    assert len(calls) == 1 and all(len(c.got) == 1 for c in clients)
    seqs = {c.got[0][1].seq for c in clients}
    assert seqs == {1}  # sequence numbers count per link


def test_replayed_messages_are_dropped():
    bus, server, (c0, *_) = make_bus()
    captured = []
    bus.tap(lambda data, h: captured.append(data))

    async def main() -> None:
        bus.send("server", "client-0000", "ping", {"i": 1})
        bus.send("server", "client-0000", "ping", {"i": 2})
        await asyncio.sleep(1)
        bus.inject(captured[0], "client-0000")
        bus.inject(captured[1], "client-0000")

    run(main())
    assert [env.body["i"] for _, env in c0.got] == [1, 2]
    assert bus.stats.dropped["replayed"] == 2 and bus.stats.injected == 2
    assert balanced(bus)


def test_injected_bad_bytes_are_counted_per_reason_never_raised():
    bus, server, (c0, *_) = make_bus(max_bytes=2000)
    seen = []
    bus.add_drop_listener(lambda reason, detail, src, dst, kind: seen.append((reason, src, kind)))

    def env_bytes(**over) -> bytes:
        d = {"v": 1, "kind": "ping", "src": "eve-0", "dst": "client-0000", "seq": 1, "round": 0,
             "sent_at": 0.0, "body": {"i": 1}}  # fmt: skip
        d.update(over)
        return msgpack.packb(d)

    cases = [
        (b"\x00\xff garbage", "malformed"),
        (env_bytes(v=9), "bad_version"),
        (env_bytes(kind="nope"), "unknown_kind"),
        (env_bytes(body={"i": "x"}), "bad_schema"),
        (encode(Envelope("model", "eve-0", "client-0000", {"params": np.zeros(300)})),
         "oversized"),
        (env_bytes(dst="client-0001"), "misrouted"),
    ]  # fmt: skip

    async def main() -> None:
        with structlog.testing.capture_logs() as logs:
            for data, _ in cases:
                bus.inject(data, "client-0000")
            bus.inject(env_bytes(), "nobody")
            bus.inject(env_bytes(seq=2), "client-0000")  # a valid one gets through
        assert [e["reason"] for e in logs if e["event"] == "drop"] == [
            *(r for _, r in cases), "unknown_dst",
        ]  # fmt: skip
        assert all(e["log_level"] == "debug" for e in logs if e["event"] == "drop")

    run(main())
    assert [r for r, _, _ in seen] == [r for _, r in cases] + ["unknown_dst"]
    assert seen[3] == ("bad_schema", "eve-0", "ping")  # attributed once the header is readable
    assert {k: v for k, v in bus.stats.dropped.items()} == {r: 1 for _, r in cases} | {
        "unknown_dst": 1
    }
    assert [env.body for _, env in c0.got] == [{"i": 1}]
    assert balanced(bus)


def test_unknown_destinations_and_agents_leaving_in_flight():
    bus, server, (c0, c1, _) = make_bus(NetworkModel(latency=Latency.constant(1.0)))

    async def main() -> None:
        bus.send("server", "client-9999", "ping", {"i": 0})
        bus.send("server", "client-0001", "ping", {"i": 1})
        assert bus.in_flight == 1
        bus.unregister("client-0001")
        await asyncio.sleep(2)

    run(main())
    assert bus.stats.dropped == {"unknown_dst": 2}
    assert not c1.got and balanced(bus) and bus.in_flight == 0
    with pytest.raises(ValueError, match="already registered"):
        bus.register(Recorder("client-0000"))
    bus.register(c0)  # the same object again is fine


def test_stats_as_dict_is_plain_data():
    bus, server, (c0, *_) = make_bus(NetworkModel(loss=0.5), seed=1)

    async def main() -> None:
        for i in range(20):
            bus.send("server", "client-0000", "ping", {"i": i})
        await asyncio.sleep(1)

    run(main())
    d = bus.stats.as_dict()
    assert d["sent"] == 20 and d["delivered"] + d["dropped"]["lost"] == 20
    assert d["bytes"] == d["bytes_sent"] > d["bytes_delivered"] > 0
    assert (
        d["kinds"]["ping"]["sent"] == 20 and d["kinds"]["ping"]["dropped"] == d["dropped"]["lost"]
    )
    assert all(type(v) is int for v in d["kinds"]["ping"].values())


def simulate(seed: int) -> tuple[list, dict]:
    net = NetworkModel.from_dict(
        {
            "latency": {"kind": "lognormal", "median": 0.05, "sigma": 0.8},
            "links": {"client->server": {"kind": "uniform", "low": 0.01, "high": 0.5}},
            "bandwidth": 1e5,
            "loss": 0.1,
            "availability": 0.8,
            "churn": 0.05,
        }
    )
    bus, server, clients = make_bus(net, seed=seed, n=20)
    log: list = []
    for agent in (server, *clients):
        agent.deliver = lambda env, a=agent: log.append(
            (asyncio.get_running_loop().time(), a.id, env.src, env.seq, env.kind)
        )

    async def main() -> None:
        for r in range(1, 6):
            online = sorted(bus.begin_round(r, [c.id for c in clients]))
            bus.broadcast("server", online, "model", {"params": np.full(136, r / 10)}, r)
            for i, c in enumerate(clients):
                bus.send(c.id, "server", "ping", {"i": i}, r)
            await asyncio.sleep(2)

    run(main())
    return log, bus.stats.as_dict()


def test_same_seed_gives_identical_delivery_order_and_stats():
    a, b, c = simulate(11), simulate(11), simulate(12)
    assert a == b
    assert a[0] != c[0]
    assert len(a[0]) > 50 and a[1]["dropped"].keys() >= {"lost", "offline"}


def test_link_overrides_and_roles():
    net = NetworkModel.from_dict(
        {
            "latency": 1.0,
            "links": {
                "client->server": 2.0,
                "client-0003->*": 3.0,
                "*->server": 4.0,
                "server->eve": 5.0,
            },
        }
    )
    rng = np.random.default_rng(0)
    assert net.transit_time("client-0001", "server", 10, rng) == 2.0
    assert net.transit_time("client-0003", "server", 10, rng) == 3.0
    assert net.transit_time("eve-0", "server", 10, rng) == 4.0
    assert net.transit_time("server", "eve-2", 10, rng) == 5.0
    assert net.transit_time("server", "x-1", 10, rng, dst_role="eve") == 5.0
    assert net.transit_time("server", "client-0001", 10, rng) == 1.0
    assert role_of("client-0003") == "client" and role_of("server") == "server"


@pytest.mark.parametrize(
    "table, message",
    [
        ({"latency": {"kind": "gauss"}}, "network.latency.kind: expected one of constant"),
        ({"latency": {"kind": "uniform", "low": 2, "high": 1}}, "network.latency.high"),
        ({"latency": {"kind": "lognormal", "median": 0.1}}, "network.latency.sigma"),
        ({"latency": {"kind": "constant", "value": 1, "low": 0}}, "network.latency.low"),
        ({"latency": "fast"}, "network.latency: expected a number"),
        ({"loss": 1.0}, "network.loss: expected a number in [0.0, 1.0)"),
        ({"availability": -0.1}, "network.availability"),
        ({"churn": True}, "network.churn"),
        ({"bandwidth": 0}, "network.bandwidth: expected a number > 0"),
        ({"churn_rounds": 0.5}, "network.churn_rounds"),
        ({"links": {"client-server": 1.0}}, "network.links.client-server"),
        ({"links": {"a->b": {"kind": "uniform", "low": -1, "high": 1}}}, "network.links.a->b.low"),
        ({"latncy": 1.0}, "network.latncy: expected one of the network keys"),
    ],
)
def test_network_config_errors_name_the_key(table, message):
    with pytest.raises(ScenarioError) as info:
        NetworkModel.from_dict(table)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_network_defaults_are_a_perfect_network():
    net = NetworkModel.from_dict({})
    assert net == NetworkModel() and net.transit_time("a", "b", 10**6, None) == 0.0
    assert net.online(["client-0001", "server"], 1, None) == {"client-0001", "server"}


def test_untap_removes_a_bound_method_tap():
    """Agents untap ``self._on_tap`` before tapping again on a rejoin: each attribute access makes
    a new bound method, so untap must compare by equality, not identity."""
    bus, server, _ = make_bus(NetworkModel())

    class Listener:
        def __init__(self) -> None:
            self.seen = 0

        def on_tap(self, data: bytes, header) -> None:  # noqa: ANN001
            self.seen += 1

    ear = Listener()
    for _ in range(2):  # join, leave, rejoin
        bus.untap(ear.on_tap)
        bus.tap(ear.on_tap)

    async def main() -> None:
        bus.send("server", "client-0000", "ping", {"i": 1})
        await asyncio.sleep(1)

    run(main())
    assert ear.seen == 1

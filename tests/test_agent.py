"""Agent base: dispatch by kind, counted failures, leave / crash / rejoin."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import structlog

from foltr_async.runtime.agent import Agent, handles
from foltr_async.runtime.bus import MemoryBus
from foltr_async.runtime.clock import run
from foltr_async.runtime.network import Latency, NetworkModel
from foltr_async.runtime.schema import Int, SchemaRegistry, Str
from foltr_async.runtime.wire import Envelope

REG = SchemaRegistry()
for kind in ("ping", "pong", "boom", "orphan", "bye", "quit"):
    REG.register(kind, {"i": Int(), "note": Str()} if kind == "bye" else {"i": Int()})


def make_bus(latency: float = 0.1) -> MemoryBus:
    return MemoryBus(
        NetworkModel(latency=Latency.constant(latency)), np.random.default_rng(0), registry=REG
    )


class Echo(Agent):
    role = "client"

    def __init__(self, agent_id: str, bus) -> None:
        super().__init__(agent_id, bus)
        self.seen: list[tuple[str, int]] = []
        self.joins = 0
        self.left = 0

    async def on_join(self) -> None:
        self.joins += 1

    async def on_leave(self) -> None:
        self.left += 1
        self.send("server", "bye", {"i": 0, "note": f"{self.id} leaving"})

    @handles("ping")
    async def on_ping(self, env: Envelope) -> None:
        self.seen.append(("ping", env.body["i"]))
        await asyncio.sleep(0.5)  # handlers may take (virtual) time
        self.send(env.src, "pong", {"i": env.body["i"]}, env.round)

    @handles("boom")
    async def on_boom(self, env: Envelope) -> None:
        raise ValueError(f"bad input {env.body['i']}")

    @handles("quit")
    async def on_quit(self, env: Envelope) -> None:
        self.seen.append(("quit", env.body["i"]))
        await self.leave()  # leaving from inside its own handler


class Server(Agent):
    role = "server"

    def __init__(self, bus) -> None:
        super().__init__("server", bus)
        self.got: list[tuple[float, str, int]] = []

    @handles("pong", "bye")  # one method for several kinds; a plain function works too
    def on_reply(self, env: Envelope) -> None:
        self.got.append((asyncio.get_running_loop().time(), env.kind, env.src))


def test_handlers_are_found_once_per_class_and_dispatched_by_kind():
    assert Echo._handler_names == {"ping": "on_ping", "boom": "on_boom", "quit": "on_quit"}
    assert Server._handler_names == {"pong": "on_reply", "bye": "on_reply"}
    bus = make_bus()
    result = {}

    async def main() -> None:
        server, client = Server(bus), Echo("client-0001", bus)
        server.start()
        client.start()
        for i in range(3):
            server.send("client-0001", "ping", {"i": i}, round=1)
        await asyncio.sleep(5)
        result.update(server=server, client=client)

    run(main())
    server, client = result["server"], result["client"]
    assert client.seen == [("ping", 0), ("ping", 1), ("ping", 2)]
    # one message at a time: replies 0.5 s apart after the 0.1 s trip, back after another 0.1 s
    assert [round(t, 6) for t, _, _ in server.got] == [0.7, 1.2, 1.7]
    assert client.counters["handled"] == 3 and client.last_kind == "ping"
    assert client.joins == 1 and client.state == "joined"


def test_subclass_overrides_win_and_duplicate_handlers_are_an_error():
    class Louder(Echo):
        @handles("ping")
        async def shout(self, env: Envelope) -> None:
            self.seen.append(("shout", env.body["i"]))

    class Renamed(Echo):
        async def on_boom(self, env: Envelope) -> None:  # plain override of a handler method
            self.seen.append(("calm", env.body["i"]))

    assert Louder._handler_names["ping"] == "shout"
    bus = make_bus()

    async def main() -> tuple[list, list]:
        a, b = Louder("client-0001", bus), Renamed("client-0002", bus)
        a.start()
        b.start()
        bus.send("server", "client-0001", "ping", {"i": 1})
        bus.send("server", "client-0002", "boom", {"i": 2})
        await asyncio.sleep(1)
        return a.seen, b.seen

    assert run(main()) == ([("shout", 1)], [("calm", 2)])
    with pytest.raises(TypeError, match="handle 'x'"):

        class Twice(Agent):
            @handles("x")
            async def a(self, env): ...

            @handles("x")
            async def b(self, env): ...


def test_missing_handler_and_handler_errors_are_counted_not_fatal():
    bus = make_bus()
    drops = []
    bus.add_drop_listener(lambda reason, detail, src, dst, kind: drops.append((reason, dst, kind)))

    async def main() -> Echo:
        client = Echo("client-0001", bus)
        client.start()
        Server(bus).start()
        bus.send("server", "client-0001", "orphan", {"i": 1})
        bus.send("server", "client-0001", "boom", {"i": 2})
        bus.send("server", "client-0001", "ping", {"i": 3})  # the loop is still alive
        with structlog.testing.capture_logs() as logs:
            await asyncio.sleep(2)
        errors = [e for e in logs if e["event"] == "handler_error"]
        assert len(errors) == 1 and errors[0]["agent"] == "client-0001"
        assert "bad input 2" in errors[0]["error"] and errors[0]["log_level"] == "error"
        return client

    client = run(main())
    assert client.seen == [("ping", 3)]
    assert drops == [("no_handler", "client-0001", "orphan"), ("handler_error", "client-0001",
                                                                "boom")]  # fmt: skip
    assert client.counters["no_handler"] == 1 and client.counters["handler_error"] == 1
    assert bus.stats.dropped == {"no_handler": 1, "handler_error": 1}
    assert bus.stats.delivered == 4  # three to the client, one pong back


def test_leave_is_graceful_crash_is_abrupt_and_both_can_rejoin():
    bus = make_bus(latency=1.0)
    log: dict = {}

    async def main() -> None:
        server, a, b = Server(bus), Echo("client-0001", bus), Echo("client-0002", bus)
        for agent in (server, a, b):
            agent.start()
        await asyncio.sleep(0)  # let on_join run
        for i in range(3):
            server.send(a.id, "ping", {"i": i})
            server.send(b.id, "ping", {"i": i})
        await asyncio.sleep(1.2)  # all arrived; each agent is inside its first handler
        await a.leave()
        await b.crash()
        log["after_stop"] = (a.state, b.state, bus.is_registered(a.id), bus.is_registered(b.id))
        server.send(a.id, "ping", {"i": 9})  # nobody there now
        await asyncio.sleep(3)
        await a.rejoin()
        await b.rejoin()
        server.send(a.id, "ping", {"i": 10})
        server.send(b.id, "ping", {"i": 10})
        await asyncio.sleep(3)
        log.update(server=server, a=a, b=b)

    run(main())
    a, b, server = log["a"], log["b"], log["server"]
    assert log["after_stop"] == ("left", "crashed", False, False)
    assert a.seen == [("ping", 0), ("ping", 10)] and b.seen == [("ping", 0), ("ping", 10)]
    assert a.left == 1 and b.left == 0  # on_leave only on a graceful leave
    assert a.joins == 2 and b.joins == 2  # on_join again on rejoin
    assert ("bye", "client-0001") in [(k, s) for _, k, s in server.got]
    assert a.counters["not_running"] == 2 and b.counters["not_running"] == 2  # inboxes lost
    assert bus.stats.dropped["unknown_dst"] == 1
    assert a.state == b.state == "joined"


def test_leave_from_inside_a_handler_and_lifecycle_guards():
    bus = make_bus()

    async def main() -> Echo:
        client = Echo("client-0001", bus)
        client.start()
        with pytest.raises(RuntimeError, match="already joined"):
            client.start()
        with pytest.raises(RuntimeError, match="only left or crashed"):
            await client.rejoin()
        bus.send("server", client.id, "quit", {"i": 1})
        bus.send("server", client.id, "ping", {"i": 2})  # queued behind quit: lost with the inbox
        await asyncio.sleep(2)
        assert client._task is None and client.state == "left"
        client.deliver(Envelope("ping", "server", client.id, {"i": 3}))  # not running
        await client.leave()  # no-op
        await client.crash()  # no-op
        return client

    client = run(main())
    assert client.seen == [("quit", 1)]
    assert client.counters["not_running"] == 2
    assert bus.stats.dropped["not_running"] == 2
    assert bus.stats.dropped["unknown_dst"] == 1  # the goodbye to a server that is not there

"""Suites ``bus`` and ``zmq``: what moving a message costs. ``bus``: coordination per client
update on the memory bus with training stubbed out (echo clients speaking the FPDGD messages:
encode, schedule, deliver, decode, replay check, FedAvg), next to the floor of that round shape
in bare asyncio and msgpack. ``zmq``: FPDGD update envelopes from a sender process to this one
over loopback TCP (PUSH/PULL), decoded and validated."""

from __future__ import annotations

import time

import numpy as np

from foltr_async.benchmarks.measure import (
    N_FEATURES,
    Sizes,
    cpu_share,
    finish_child,
    now,
    progress,
    spawn_child,
)


def _echo_classes():
    """An echo client and a FedAvg-only strategy speaking the FPDGD messages (no training)."""
    from foltr_async.protocols.aggregation import fedavg
    from foltr_async.protocols.fpdgd import MODEL, UPDATE
    from foltr_async.runtime.agent import Agent, handles
    from foltr_async.runtime.engine import Strategy

    class EchoClient(Agent):
        role = "client"

        @handles(MODEL)
        async def on_model(self, env) -> None:
            self.send(
                env.src, UPDATE, {"params": env.body["params"], "n_interactions": 2}, env.round
            )

    class EchoStrategy(Strategy):
        broadcast_kind, reply_kind = MODEL, UPDATE

        def __init__(self, n_params: int) -> None:
            self.model = np.zeros(n_params)

        def configure_round(self, round: int) -> dict:
            return {"params": self.model}

        def aggregate(self, round: int, replies: list) -> dict:
            updates = np.stack([r.body["params"] for r in replies])
            weights = np.array([r.body["n_interactions"] for r in replies], dtype=np.float64)
            self.model = fedavg(updates, weights) + 1e-3  # a new model each round
            return {}

        def evaluate(self) -> dict[str, float]:
            return {}

    return EchoClient, EchoStrategy


def bench_bus(sz: Sizes, seed: int) -> dict[str, dict]:
    """Memory-bus cost per client update."""
    from foltr_async.plugins import load_plugins
    from foltr_async.rng import stream
    from foltr_async.runtime.bus import MemoryBus
    from foltr_async.runtime.clock import run
    from foltr_async.runtime.engine import RoundPlan, ServerAgent
    from foltr_async.runtime.network import NetworkModel

    load_plugins()
    echo_client, echo_strategy = _echo_classes()
    n, window = sz.bus_clients, sz.bus_window
    progress(f"bus: {n} echo clients, {window + 2} rounds of FPDGD messages ({N_FEATURES} float64)")
    marks: list[tuple[tuple[float, float], int, int]] = []

    async def main() -> None:
        bus = MemoryBus(NetworkModel(), stream(seed, "net"))
        ids = [f"client-{i:04d}" for i in range(n)]
        server = ServerAgent(
            bus,
            echo_strategy(N_FEATURES),
            RoundPlan(rounds=window + 2, eval_every=10**6),
            stream(seed, "server"),
            clients=lambda: ids,
            after_round=lambda rep: marks.append((now(), bus.stats.sent, bus.stats.bytes_sent)),
        )
        server.start()
        clients = [echo_client(i, bus) for i in ids]
        for c in clients:
            c.start()
        await server.run_rounds()
        for a in [*clients, server]:
            await a.leave()

    run(main())
    (t0, m0, b0), (t1, m1, b1) = marks[0], marks[window]
    span = t1[0] - t0[0]
    bus = {
        "us_per_update": span / (n * window) * 1e6,
        "cpu_share": cpu_share(t0, t1),
        "floor_cpu_us_per_update": _bare_floor(n, window) * 1e6,
        "msgs_per_s": (m1 - m0) / span,
        "bytes_per_s": (b1 - b0) / span,
        "bytes_per_msg": (b1 - b0) / max(1, m1 - m0),
        "on": {
            "clients": n,
            "timed_rounds": window,
            "params": N_FEATURES,
            "network": "default (no latency, loss or dropout)",
        },
    }
    return {"bus": bus}


def _bare_floor(n: int, rounds: int) -> float:
    """CPU seconds per client update of the same round shape with nothing but its essentials:
    ``n`` asyncio tasks, the model broadcast as one msgpack body each decodes, a future per
    client standing in for the compute pool, a msgpack reply each, and the server decoding the
    replies and averaging them. No header, schema or replay checks, bus bookkeeping, network
    model or handler dispatch: what any simulator of per-client asyncio agents exchanging bytes
    pays at least on this machine (the `bus` figure minus this is the simulator's own cost)."""
    import asyncio

    import msgpack

    def pack(o):
        return msgpack.ExtType(1, o.tobytes())

    def unpack(code: int, data: bytes):
        return np.frombuffer(data, np.float64)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        inbox: list = [None] * n
        pool: list = []
        replies: list[bytes] = []

        async def client(i: int) -> None:
            for r in range(rounds):
                f = inbox[i] = loop.create_future()
                msgpack.unpackb(await f, ext_hook=unpack)  # the model a client would train
                trained = loop.create_future()
                pool.append(trained)
                out = {"src": i, "round": r, "params": await trained, "n_interactions": 2}
                replies.append(msgpack.packb(out, default=pack))

        tasks = [asyncio.create_task(client(i)) for i in range(n)]
        await asyncio.sleep(0)
        model = np.zeros(N_FEATURES)
        t0 = time.process_time()
        for r in range(rounds):
            data = msgpack.packb({"round": r, "params": model}, default=pack)
            for f in inbox:
                f.set_result(data)
            while len(pool) < n:
                await asyncio.sleep(0)
            for f in pool:
                f.set_result(model)
            pool.clear()
            while len(replies) < n:
                await asyncio.sleep(0)
            got = [msgpack.unpackb(b, ext_hook=unpack) for b in replies]
            replies.clear()
            model = np.stack([g["params"] for g in got]).mean(axis=0) + 1e-3
        spent = time.process_time() - t0
        await asyncio.gather(*tasks)
        return spent / (n * rounds)

    return asyncio.run(main())


def _update_envelope(i: int, params: np.ndarray) -> bytes:
    from foltr_async.protocols.fpdgd import UPDATE
    from foltr_async.runtime.wire import WIRE_VERSION, Envelope, encode

    body = {"params": params, "n_interactions": 2}
    return encode(
        Envelope(UPDATE, f"client-{i % 1000:04d}", "server", body, 1, i + 1, float(i), WIRE_VERSION)
    )


def zmq_sender(spec: dict) -> dict:
    import zmq

    params = np.random.default_rng(spec["seed"]).standard_normal(spec["n_features"])
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(spec["endpoint"])
    t0 = time.perf_counter()
    for i in range(spec["n"]):
        push.send(_update_envelope(i, params), copy=False)
    sent_s = time.perf_counter() - t0
    push.close(linger=10_000)
    ctx.term()
    return {"sent_s": sent_s}


def bench_zmq(sz: Sizes, seed: int) -> dict[str, dict]:
    """Envelopes from a sender process to this one over loopback TCP, decoded and validated."""
    import zmq

    from foltr_async.plugins import load_plugins
    from foltr_async.runtime.wire import decode

    load_plugins()
    n = sz.zmq_messages
    progress(f"zmq: {n} FPDGD update envelopes, PUSH -> PULL over tcp://127.0.0.1")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 60_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    spec = {
        "task": "zmq_send",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "n": n,
        "n_features": N_FEATURES,
        "seed": seed,
    }
    proc = spawn_child(spec)
    try:
        nbytes = 0
        try:
            first = pull.recv()
            t0 = now()
            decode(first)
            for _ in range(n - 1):
                data = pull.recv()
                nbytes += len(data)
                decode(data)
            t1 = now()
            span = t1[0] - t0[0]
        except zmq.Again:
            raise RuntimeError("zmq: the sender stopped sending (60 s without a message)") from None
        finish_child(proc, spec)
    finally:
        if proc.poll() is None:
            proc.kill()
        pull.close(linger=0)
        ctx.term()
    return {
        "zmq": {
            "msgs_per_s": (n - 1) / span,
            "cpu_share": cpu_share(t0, t1),  # of the receiver (decoding every message)
            "bytes_per_s": nbytes / span,
            "bytes_per_msg": len(first),
            "on": {
                "messages": n,
                "pattern": "PUSH/PULL, tcp://127.0.0.1, 2 processes",
                "payload": f"fpdgd.update, {N_FEATURES} float64, encode + decode",
            },
        }
    }

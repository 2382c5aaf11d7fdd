"""Virtual time: simulated minutes cost no wall time, timers keep their order, deadlocks fail."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from foltr_async.runtime.clock import DeadlockError, VirtualTimeLoop, run


def test_ten_simulated_minutes_cost_no_wall_time():
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(600)
        return loop.time() - t0

    wall = time.perf_counter()
    assert run(main()) == 600.0
    assert time.perf_counter() - wall < 600  # a real clock takes the 600 s; load cannot make 600


def test_timers_fire_in_time_order_at_their_virtual_times():
    async def main() -> list[tuple[float, str]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[float, str]] = []
        for delay, name in [(3.0, "c"), (1.0, "a"), (2.5, "b"), (1.0, "a2"), (100.0, "d")]:
            loop.call_later(delay, lambda n=name: seen.append((loop.time(), n)))

        async def sleeper(d: float, name: str) -> None:
            await asyncio.sleep(d)
            seen.append((loop.time(), name))

        await asyncio.gather(sleeper(2.0, "s2"), sleeper(0.5, "s0"), asyncio.sleep(200))
        return seen

    assert run(main()) == [
        (0.5, "s0"), (1.0, "a"), (1.0, "a2"), (2.0, "s2"), (2.5, "b"), (3.0, "c"), (100.0, "d"),
    ]  # fmt: skip


def test_timeouts_and_wait_for_use_virtual_time():
    async def main() -> list:
        loop = asyncio.get_running_loop()
        out = []
        try:
            await asyncio.wait_for(asyncio.sleep(50), timeout=10)
        except TimeoutError:
            out.append(("wait_for", loop.time()))
        try:
            async with asyncio.timeout(5):
                await asyncio.Event().wait()  # would wait forever: the timeout is a timer
        except TimeoutError:
            out.append(("timeout", loop.time()))
        assert await asyncio.wait_for(asyncio.sleep(1, "done"), timeout=2) == "done"
        out.append(("end", loop.time()))
        return out

    assert run(main()) == [("wait_for", 10.0), ("timeout", 15.0), ("end", 16.0)]


def test_start_time_and_real_loop_option():
    async def now() -> float:
        return asyncio.get_running_loop().time()

    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start=1000.0)) as runner:
        assert runner.run(now()) == 1000.0
    before = time.monotonic()
    real = run(now(), virtual=False)
    assert before <= real <= time.monotonic()  # the real loop reads the monotonic clock


def test_deadlock_raises_a_clear_error_instead_of_hanging():
    async def waiter() -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        task = asyncio.create_task(waiter(), name="client-0007")
        await asyncio.sleep(3000)
        await task

    wall = time.perf_counter()
    with pytest.raises(DeadlockError, match=r"deadlock at t=3000\.0.*client-0007") as info:
        run(main())
    assert isinstance(info.value, RuntimeError)
    assert time.perf_counter() - wall < 3000  # a real clock takes the 3,000 s


def test_executor_work_is_waited_for_not_a_deadlock():
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        value = await asyncio.to_thread(lambda: (time.sleep(0.02), 42)[1])
        return value, loop.time() - t0

    value, elapsed = run(main())  # the runner also shuts the default executor down cleanly
    assert value == 42
    assert 0.01 <= elapsed < 60.0  # virtual time followed the real wait (loose: loaded CI)


def test_a_loop_interrupted_while_it_is_built_is_collected_without_a_traceback(monkeypatch):
    # Ctrl-C can land between two repeats, inside the next loop's constructor
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(VirtualTimeLoop, "_make_self_pipe", interrupted)
    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    with pytest.raises(KeyboardInterrupt):
        VirtualTimeLoop()
    gc.collect()
    assert unraisable == []

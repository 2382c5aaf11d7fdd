"""BatchPool: results at submit time + compute_time, jobs pending together run as one batch."""

import asyncio

import pytest

from foltr_async.runtime.clock import run
from foltr_async.runtime.compute import BatchPool


class Recorder:
    """A batch function that squares numbers and remembers every batch and when it ran."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, list[int]]] = []

    def __call__(self, jobs: list[int]) -> list[int]:
        self.batches.append((asyncio.get_running_loop().time(), list(jobs)))
        return [j * j for j in jobs]


async def submit_at(pool: BatchPool, when: float, job: int, out: dict, **kw) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(when - loop.time())
    result = await pool.submit(job, **kw)
    out[job] = (result, loop.time())


def test_jobs_of_one_instant_run_as_one_batch_in_submission_order():
    rec = Recorder()
    pool = BatchPool(rec)
    out: dict = {}

    async def main():
        await asyncio.gather(*(submit_at(pool, 5.0, j, out) for j in (3, 1, 2)))
        await submit_at(pool, 7.0, 4, out)

    run(main())
    assert rec.batches == [(5.0, [3, 1, 2]), (7.0, [4])]
    assert out == {3: (9, 5.0), 1: (1, 5.0), 2: (4, 5.0), 4: (16, 7.0)}
    assert (pool.batches, pool.jobs, pool.largest, pool.pending) == (2, 4, 3, 0)


def test_each_result_arrives_at_its_own_due_time_never_earlier():
    rec = Recorder()
    pool = BatchPool(rec, compute_time=1.0)
    out: dict = {}

    async def main():
        await asyncio.gather(
            submit_at(pool, 0.0, 1, out),
            submit_at(pool, 0.5, 2, out),  # pending when the first is due: same batch
            submit_at(pool, 1.25, 3, out),  # after the flush: the next batch
            submit_at(pool, 1.5, 4, out, compute_time=0.1),  # shorter job re-arms the timer
        )

    run(main())
    assert rec.batches == [(1.0, [1, 2]), (1.6, [3, 4])]
    assert out == {1: (1, 1.0), 2: (4, 1.5), 3: (9, 2.25), 4: (16, 1.6)}


def test_a_cancelled_job_is_discarded_before_the_flush_and_ignored_after_it():
    rec = Recorder()
    pool = BatchPool(rec, compute_time=2.0)
    out: dict = {}

    async def main():
        early = asyncio.ensure_future(submit_at(pool, 0.0, 1, out))
        late = asyncio.ensure_future(submit_at(pool, 1.0, 2, out))
        keep = asyncio.ensure_future(submit_at(pool, 1.0, 3, out))
        await asyncio.sleep(1.5)
        early.cancel()  # its agent crashed before the batch ran (due at 2.0)
        await asyncio.sleep(1.0)  # t = 2.5: the batch ran at 2.0 without job 1
        late.cancel()  # computed, due at 3.0, never delivered
        await keep
        return early, late

    early, late = run(main())
    assert rec.batches == [(2.0, [2, 3])]
    assert early.cancelled() and late.cancelled()
    assert out == {3: (9, 3.0)}
    assert pool.discarded == 1


def test_a_failing_batch_fails_every_job_in_it_and_the_pool_keeps_working():
    calls = []

    def flaky(jobs):
        calls.append(list(jobs))
        if len(calls) == 1:
            raise ZeroDivisionError("boom")
        return [-j for j in jobs]

    pool = BatchPool(flaky)

    async def main():
        first = await asyncio.gather(pool.submit(1), pool.submit(2), return_exceptions=True)
        return first, await pool.submit(3)

    first, second = run(main())
    assert [type(e) for e in first] == [ZeroDivisionError, ZeroDivisionError]
    assert second == -3


def test_wrong_result_count_and_bad_compute_times_are_errors():
    pool = BatchPool(lambda jobs: [0])

    async def main():
        return await asyncio.gather(pool.submit(1), pool.submit(2), return_exceptions=True)

    assert all("2 jobs" in str(e) for e in run(main()))
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="compute_time"):
            BatchPool(lambda jobs: jobs, compute_time=bad)
    with pytest.raises(ValueError, match="compute_time"):
        run(BatchPool(lambda jobs: jobs).submit(1, compute_time=-2.0))


def test_prepare_runs_the_set_up_once_and_is_optional():
    calls = []
    pool = BatchPool(lambda jobs: jobs, prepare=lambda: calls.append(1))
    pool.prepare()
    pool.prepare()
    assert calls == [1]
    BatchPool(lambda jobs: jobs).prepare()  # nothing to set up

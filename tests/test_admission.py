"""Admission: at most N requests at once, a bounded FIFO queue, 429 past its length or its
timeout, and no slot lost when a queued client goes away."""

from __future__ import annotations

import asyncio

import pytest

from disagg.admission import Admission
from disagg.errors import TooManyRequests


async def _hold(adm: Admission, release: asyncio.Event, order: list[int], i: int) -> None:
    async with adm.slot():
        order.append(i)
        await release.wait()


def test_queue_is_fifo_and_bounded() -> None:
    async def main() -> None:
        adm = Admission(max_concurrent=1, max_queued=2, queue_timeout_s=5)
        release, order = asyncio.Event(), []
        tasks = [asyncio.create_task(_hold(adm, release, order, i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert (adm.active, adm.queued) == (1, 2)
        with pytest.raises(TooManyRequests) as exc:
            async with adm.slot():
                pass
        assert exc.value.status == 429 and exc.value.reason == "queue_full"
        assert exc.value.headers() == {"Retry-After": "5"}
        release.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2] and (adm.active, adm.queued) == (0, 0)
        await asyncio.wait_for(adm.idle(), 1)

    asyncio.run(main())


def test_queue_timeout_is_429() -> None:
    async def main() -> None:
        adm = Admission(max_concurrent=1, max_queued=4, queue_timeout_s=0.05)
        release = asyncio.Event()
        holder = asyncio.create_task(_hold(adm, release, [], 0))
        await asyncio.sleep(0.01)
        with pytest.raises(TooManyRequests) as exc:
            async with adm.slot():
                pass
        assert exc.value.reason == "queue_timeout"
        release.set()
        await holder
        assert (adm.active, adm.queued) == (0, 0)

    asyncio.run(main())


def test_cancelled_waiters_lose_no_slot() -> None:
    async def main() -> None:
        adm = Admission(max_concurrent=2, max_queued=10, queue_timeout_s=5)
        release, order = asyncio.Event(), []
        tasks = [asyncio.create_task(_hold(adm, release, order, i)) for i in range(6)]
        await asyncio.sleep(0.01)
        tasks[3].cancel()
        tasks[4].cancel()
        await asyncio.sleep(0.01)
        assert (adm.active, adm.queued) == (2, 2)
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert sorted(order) == [0, 1, 2, 5]
        assert (adm.active, adm.queued) == (0, 0)

    asyncio.run(main())


def test_no_limit_still_counts_for_drain() -> None:
    async def main() -> None:
        adm = Admission()
        release = asyncio.Event()
        tasks = [asyncio.create_task(_hold(adm, release, [], i)) for i in range(50)]
        await asyncio.sleep(0.01)
        assert adm.active == 50 and adm.queued == 0
        idle = asyncio.create_task(adm.idle())
        await asyncio.sleep(0.01)
        assert not idle.done()
        release.set()
        await asyncio.gather(*tasks)
        await asyncio.wait_for(idle, 1)

    asyncio.run(main())

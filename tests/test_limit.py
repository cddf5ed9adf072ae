"""The predictor's adaptive concurrency limit (serving/gateway/limit.py): its verdicts, and the
gate's FIFO order, refusals and clean-up when a waiter leaves.  No timing thresholds: a sample
"over the target" is a wait many times the target long."""

from __future__ import annotations

import asyncio

import pytest

from sensai.serving.core.errors import Overloaded
from sensai.serving.gateway.limit import AdaptiveLimit


def test_a_slow_window_shrinks_the_limit_by_a_tenth_and_at_least_one():
    lim = AdaptiveLimit(32, 0.1)
    assert lim.judge(100, 6, pressed=True) == -4 and lim.limit == 28  # 6% over: too slow
    assert lim.judge(100, 5, pressed=False) == 0 and lim.limit == 28  # 5%: fine, not pressed
    small = AdaptiveLimit(5, 0.1)
    assert small.judge(10, 10, pressed=True) == -1 and small.limit == 4
    for _ in range(10):
        small.judge(10, 10, pressed=True)
    assert small.limit == 1 and small.decreases == 4  # never below one


def test_a_fast_window_grows_the_limit_by_one_only_when_it_was_full():
    lim = AdaptiveLimit(3, 0.1)
    lim.judge(10, 10, pressed=True)
    assert lim.limit == 2
    assert lim.judge(50, 0, pressed=False) == 0 and lim.limit == 2  # nobody waited: no reason
    assert lim.judge(50, 0, pressed=True) == 1 and lim.limit == 3
    assert lim.judge(50, 0, pressed=True) == 0 and lim.limit == 3  # at most `most`


def test_the_gate_is_fifo_refuses_beyond_its_queue_and_passes_places_on():
    lim = AdaptiveLimit(2, None)

    async def go():
        far = asyncio.get_running_loop().time() + 60
        order = []

        async def one(name):
            t0 = await lim.acquire(far)
            order.append(name)
            return t0

        held = [await lim.acquire(far), await lim.acquire(far)]
        waiters = [asyncio.ensure_future(one(n)) for n in ("a", "b")]
        await asyncio.sleep(0)
        assert lim.active == 2 and lim.waiting == 2 and lim.queue_full()
        with pytest.raises(Overloaded, match="2 requests are waiting") as refused:
            await lim.acquire(far)
        assert refused.value.reason == "queue_full"
        lim.release(held.pop())
        await asyncio.sleep(0)
        assert order == ["a"] and lim.active == 2 and lim.waiting == 1
        lim.release(held.pop())
        held += await asyncio.gather(*waiters)
        assert order == ["a", "b"] and lim.active == 2 and lim.waiting == 0
        for t0 in held:
            lim.release(t0)
        assert lim.active == 0 and lim.limit == 2  # no target: the limit never moves

    asyncio.run(go())


def test_a_waiter_that_leaves_takes_no_place_with_it():
    """One waiter's deadline passes, another is cancelled just as its place is granted: neither
    keeps a place, and the next request gets in."""
    lim = AdaptiveLimit(1, None)

    async def go():
        loop = asyncio.get_running_loop()
        t0 = await lim.acquire(loop.time() + 60)
        with pytest.raises(TimeoutError):
            await lim.acquire(loop.time() + 0.01)
        assert lim.waiting == 0 and lim.active == 1
        granted = asyncio.ensure_future(lim.acquire(loop.time() + 60))
        await asyncio.sleep(0)
        lim.release(t0)  # grants the waiter its place ...
        granted.cancel()  # ... which it gives up before it runs
        with pytest.raises(asyncio.CancelledError):
            await granted
        assert lim.active == 0 and lim.waiting == 0
        lim.release(await lim.acquire(loop.time() + 60))

    asyncio.run(go())


def test_slow_requests_shrink_the_limit_and_fast_pressed_ones_restore_it():
    """A target of 5 ms and requests that hold their place 50 ms: every window is too slow and
    the limit falls; a request that began waiting before a decrease does not judge the new
    limit.  Then instant requests with a queue: the limit climbs back to its ceiling."""
    lim = AdaptiveLimit(8, 0.005)

    async def worker(hold_s: float, stop: asyncio.Event):
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                t0 = await lim.acquire(loop.time() + 60)
            except Overloaded:
                await asyncio.sleep(0.001)
                continue
            await asyncio.sleep(hold_s)
            lim.release(t0)

    async def phase(hold_s: float, until) -> None:
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(worker(hold_s, stop)) for _ in range(16)]
        for _ in range(2000):
            await asyncio.sleep(0.005)
            if until():
                break
        stop.set()
        await asyncio.gather(*tasks)

    async def go():
        await phase(0.05, lambda: lim.limit == 1)
        assert lim.limit == 1 and lim.decreases >= 7 and lim.increases == 0
        await phase(0.0, lambda: lim.limit == 8)
        assert lim.limit == 8 and lim.increases >= 7

    asyncio.run(go())


def test_a_request_admitted_before_a_decrease_does_not_judge_the_new_limit():
    """Slow answers that began before the limit was cut would cut it again for the same
    overload: the next window holds two of them and one fast answer begun after the cut, and
    the limit stays."""
    lim = AdaptiveLimit(8, 0.1)

    async def go():
        loop = asyncio.get_running_loop()
        far = loop.time() + 60
        began = await lim.acquire(far)
        lim.release(began - 1.0)  # an answer that took a second: over the target
        assert lim.limit == 7 and lim.decreases == 1
        for _ in range(2):  # as slow, but begun before the cut
            await lim.acquire(far)
            lim.release(began - 1.0)
        await asyncio.sleep(0.15)  # the window is over ...
        lim.release(await lim.acquire(far))  # ... and a fast answer closes it
        assert lim.limit == 7 and lim.decreases == 1

    asyncio.run(go())

"""The predictor's gate (serving/gateway/limit.py): its limit's verdicts, its FIFO line, its
refusals at admission, the standing line it does not keep, and the clean-up when a request
leaves.  No timing thresholds: a sample "over the target" is many times the target long."""

from __future__ import annotations

import asyncio

import pytest

from sensai.serving.gateway.limit import STANDING_S, AdaptiveLimit


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


def place(lim: AdaptiveLimit, t0: float | None = None):
    """A place reserved now (for a request whose first byte came at ``t0``, default now)."""
    now = asyncio.get_running_loop().time()
    return lim.reserve(now if t0 is None else t0, now)


def test_the_gate_is_fifo_refuses_beyond_its_line_and_passes_places_on():
    """Two places and a line of two: the fifth request finds no room (refused at admission, a
    place never reserved), the waiting ones are let in first come first served."""
    lim = AdaptiveLimit(2, None)

    async def go():
        far = asyncio.get_running_loop().time() + 60
        order = []

        async def one(name, p):
            await lim.acquire(p, far)
            order.append(name)
            return p

        held = [place(lim), place(lim)]
        for p in held:
            await lim.acquire(p, far)
        waiters = [asyncio.ensure_future(one(n, place(lim))) for n in ("a", "b")]
        await asyncio.sleep(0)
        assert lim.active == 2 and lim.waiting == 2 and lim.reserved == 2
        assert place(lim) is None and lim.refusals == 1  # no room: refused at once
        lim.release(held.pop(), answered=True)
        await asyncio.sleep(0)
        assert order == ["a"] and lim.active == 2 and lim.waiting == 1
        lim.release(held.pop(), answered=True)
        held += await asyncio.gather(*waiters)
        assert order == ["a", "b"] and lim.active == 2 and lim.waiting == 0
        for p in held:
            lim.release(p, answered=True)
        assert lim.active == 0 and lim.reserved == 0 and lim.limit == 2  # no target: it stays

    asyncio.run(go())


def test_a_share_of_the_places_with_the_whole_line():
    """One of several gateway processes: two places of its own, a line of eight (the server's):
    ten requests admitted, the eleventh refused; once the line stands and overflows, only a
    free place admits."""
    lim = AdaptiveLimit(2, None, line=8)

    async def go():
        loop = asyncio.get_running_loop()
        far = loop.time() + 60
        places = [place(lim) for _ in range(10)]
        assert all(p is not None for p in places) and place(lim) is None
        for p in places[:2]:
            await lim.acquire(p, far)
        waiters = [asyncio.ensure_future(lim.acquire(p, far)) for p in places[2:]]
        await asyncio.sleep(STANDING_S * 1.5)
        assert lim.active == 2 and lim.waiting == 8
        assert place(lim) is None and lim.standing  # stood and overflowed
        lim.release(places[0], answered=True)  # a place frees up, taken by the line's first
        await asyncio.sleep(0)
        assert lim.active == 2 and place(lim) is None  # no room: the line must drain first
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for p in places[1:3]:
            lim.release(p, answered=True)
        assert lim.active == 0 and lim.waiting == 0
        assert place(lim) is not None  # a free place admits, standing or not

    asyncio.run(go())


def test_a_waiter_that_leaves_takes_no_place_with_it():
    """One waiter's deadline passes, another is cancelled just as its place is granted, a third
    request fails before it ever asks for its place: none keeps one, and the next gets in."""
    lim = AdaptiveLimit(1, None)

    async def go():
        loop = asyncio.get_running_loop()
        first = place(lim)
        await lim.acquire(first, loop.time() + 60)
        late = place(lim)
        with pytest.raises(TimeoutError):
            await lim.acquire(late, loop.time() + 0.01)
        assert lim.waiting == 0 and lim.active == 1 and lim.reserved == 0
        p = place(lim)
        granted = asyncio.ensure_future(lim.acquire(p, loop.time() + 60))
        await asyncio.sleep(0)
        lim.release(first, answered=True)  # grants the waiter its place ...
        granted.cancel()  # ... which it gives up before it runs
        with pytest.raises(asyncio.CancelledError):
            await granted
        assert lim.active == 0 and lim.waiting == 0 and lim.reserved == 0
        lim.cancel(place(lim))  # a request that failed before predicting
        lim.release(p, answered=True)  # a second release of the same place changes nothing
        assert lim.active == 0 and lim.reserved == 0
        last = place(lim)
        await lim.acquire(last, loop.time() + 60)
        assert lim.active == 1
        lim.release(last, answered=True)

    asyncio.run(go())


def test_a_standing_line_turns_the_surplus_away_and_ends_with_the_overload():
    """A line that forms and drains absorbs a burst, and one that never drains but is never
    overrun (a fixed crowd of clients) is kept; one that has not been empty for STANDING_S and
    overflowed is a standing one: from then on a request is let in only when a place is free at
    once, until nobody has been turned away for STANDING_S."""
    lim = AdaptiveLimit(2, None)

    async def go():
        loop = asyncio.get_running_loop()
        far = loop.time() + 60
        held = [place(lim), place(lim)]
        for p in held:
            await lim.acquire(p, far)
        queued = [place(lim), place(lim)]  # a burst: a line of two
        waiting = [asyncio.ensure_future(lim.acquire(p, far)) for p in queued]
        await asyncio.sleep(0)
        assert lim.waiting == 2 and not lim.standing
        await asyncio.sleep(STANDING_S * 1.5)  # the line never drained, nobody turned away
        assert not lim.room(loop.time()) and not lim.standing
        assert place(lim) is None  # overrun: one more than the line holds is turned away
        assert lim.standing
        lim.release(held.pop(), answered=True)  # a place frees: one of the line takes it
        await asyncio.sleep(0)
        assert lim.waiting == 1 and place(lim) is None  # no room while the line stands
        lim.release(held.pop(), answered=True)
        await asyncio.gather(*waiting)
        assert lim.waiting == 0 and lim.active == 2 and place(lim) is None  # full, no line
        lim.release(queued.pop(), answered=True)
        p = place(lim)  # a free place: let in, though standing
        assert p is not None and lim.standing
        await lim.acquire(p, far)
        await asyncio.sleep(STANDING_S * 1.5)  # nobody turned away meanwhile
        extra = place(lim)  # the overload is over: a line may form again
        assert extra is not None and not lim.standing
        for x in (p, queued.pop(), extra):
            lim.release(x, answered=True)
        assert lim.active == 0 and lim.reserved == 0

    asyncio.run(go())


def test_slow_requests_shrink_the_limit_and_fast_pressed_ones_restore_it():
    """A target of 5 ms and requests that hold their place 50 ms: every window is too slow and
    the limit falls; a request admitted before a decrease does not judge the new limit.  Then
    instant requests pressing for places: the limit climbs back to its ceiling."""
    lim = AdaptiveLimit(8, 0.005)

    async def worker(hold_s: float, stop: asyncio.Event):
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            p = place(lim)
            if p is None:
                await asyncio.sleep(0.001)
                continue
            await lim.acquire(p, loop.time() + 60)
            await asyncio.sleep(hold_s)
            lim.release(p, answered=True)

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
    """Slow answers admitted before the limit was cut would cut it again for the same
    overload: the next window holds two of them and one fast answer admitted after the cut, and
    the limit stays.  A sample counts from the request's first byte."""
    lim = AdaptiveLimit(8, 0.1)

    async def go():
        loop = asyncio.get_running_loop()
        far = loop.time() + 60
        old = [place(lim, loop.time() - 1.0) for _ in range(3)]  # first bytes a second ago
        for p in old:
            await lim.acquire(p, far)
        lim.release(old[0], answered=True)  # an answer that took a second: over the target
        assert lim.limit == 7 and lim.decreases == 1
        for p in old[1:]:  # as slow, but admitted before the cut
            lim.release(p, answered=True)
        await asyncio.sleep(0.15)  # the window is over ...
        fast = place(lim)
        await lim.acquire(fast, far)
        lim.release(fast, answered=True)  # ... and a fast answer closes it
        assert lim.limit == 7 and lim.decreases == 1

    asyncio.run(go())

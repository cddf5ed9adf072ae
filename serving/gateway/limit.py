"""The predictor's concurrency limit: how many requests it holds at once, and how many more may
wait for a place, adapted to what the workers finish within a latency target.

A fixed limit is right for one machine and one model only: too large, and under overload every
admitted request waits behind a long queue; too small, and the workers idle.  The limit here
moves between 1 and ``most`` by additive increase, multiplicative decrease (AIMD, as Clipper
adapts its batch size to a latency objective and TCP its window):

* each answered request's time in the gate - waiting for a place, then predicting - is one
  sample of the limit it was admitted under (a request that began waiting before the last
  decrease is not one: it would judge the old limit again; a failed request is not one
  either);
* every window (the target's length, at least ``MIN_WINDOW_S``) is judged once: more than one
  sample in 20 over the target shrinks the limit by a tenth (at least one); otherwise, if a
  request found the predictor full during the window, the limit grows by one;
* as many requests may wait as the limit lets in; one more is refused at once.

So under overload the admitted requests keep about the target's latency and the rest get a fast
refusal, and on a machine that finishes everything within the target the limit stays at
``most``, which bounds the batches a worker can form.  Everything runs on the event loop: plain
counters, no lock.
"""

from __future__ import annotations

import asyncio
import collections

from ..core.errors import Overloaded

MIN_WINDOW_S = 0.05
OVER_TARGET_SHARE = 0.05  # more samples than this share over the target: too slow
DECREASE = 0.9


class AdaptiveLimit:
    """A FIFO gate for the predictor whose limit adapts (see the module docstring).  ``most``:
    the largest limit (and the first); ``target_s``: the latency target of waiting plus
    predicting; ``None`` keeps the limit at ``most``."""

    def __init__(self, most: int, target_s: float | None):
        self.most = int(most)
        self.limit = self.most
        self.target_s = target_s
        self.window_s = max(MIN_WINDOW_S, target_s or 0.0)
        self.active = 0  # requests in the predictor
        self.decreases = 0
        self.increases = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._window_start: float | None = None
        self._decreased_at = -float("inf")
        self._samples = 0
        self._over = 0
        self._pressed = False  # a request found no free place this window

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def queue_full(self) -> bool:
        """A new request would be refused: as many wait as the limit lets in."""
        return len(self._waiters) >= self.limit

    def full_message(self) -> str:
        return (f"{len(self._waiters)} requests are waiting for a prediction slot already; "
                "the gateway is overloaded, retry shortly")

    async def acquire(self, deadline: float) -> float:
        """A place in the predictor, waited for until ``deadline`` (loop time) at most; returns
        the time the wait began, for :meth:`release`.  Raises :class:`Overloaded` when the
        queue is full and ``TimeoutError`` at the deadline."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return t0
        self._pressed = True
        if self.queue_full():
            raise Overloaded(self.full_message(), reason="queue_full")
        fut = loop.create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout_at(deadline):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(None)  # granted as the wait ended: pass the place on
            else:
                fut.cancel()
                self._waiters.remove(fut)
            raise
        return t0

    def release(self, t0: float | None) -> None:
        """Leave the predictor; ``t0`` (from :meth:`acquire`) makes the request a sample."""
        self.active -= 1
        if t0 is not None and self.target_s is not None:
            self._sample(asyncio.get_running_loop().time(), t0)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.active < self.limit:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.active += 1

    def _sample(self, now: float, t0: float) -> None:
        if t0 < self._decreased_at:
            return
        if self._window_start is None:
            self._window_start = t0
        self._samples += 1
        self._over += now - t0 > self.target_s
        if now - self._window_start >= self.window_s:
            if self.judge(self._samples, self._over, self._pressed) < 0:
                self._decreased_at = now
            self._window_start, self._samples, self._over, self._pressed = now, 0, 0, False

    def judge(self, samples: int, over: int, pressed: bool) -> int:
        """One window's verdict: ``over`` of ``samples`` exceeded the target; ``pressed``:
        some request found the predictor full.  Returns the limit's change."""
        before = self.limit
        if over > OVER_TARGET_SHARE * samples:
            if self.limit > 1:
                self.limit = max(1, min(self.limit - 1, int(self.limit * DECREASE)))
                self.decreases += 1
        elif pressed and self.limit < self.most:
            self.limit += 1
            self.increases += 1
            self._wake()
        return self.limit - before

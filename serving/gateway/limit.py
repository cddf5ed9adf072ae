"""The predictor's gate: how many requests it holds at once, how many more may wait, and when a
new one is turned away, adapted to what the workers finish within a latency target.

A request takes a place here when it is admitted - before its body is read - and keeps it until
it is answered, so an admitted request is never refused later.  Its place is *reserved* while
its body arrives and its image is decoded, *active* while the predictor holds it; between the two
it may wait in a FIFO line for an active place to free up.

**How many.**  At most ``limit`` requests are active; the limit moves between 1 and ``most`` by
additive increase, multiplicative decrease (AIMD, as Clipper adapts its batch size to a latency
objective and TCP its window):

* each answered request's time from its first byte to its answer is one sample of the limit it
  was admitted under (a request admitted before the last decrease is not one: it would judge the
  old limit again; a failed request is not one either);
* every window (the target's length, at least ``MIN_WINDOW_S``) is judged once: more than one
  sample in 20 over the target shrinks the limit by a tenth (at least one); otherwise, if a
  request found the predictor full during the window, the limit grows by one.

**How many may wait: no standing queue** (CoDel's idea, as in "Fail at Scale"'s controlled
delay).  A line that forms and drains absorbs a burst.  A line that never drains but is never
overrun holds a fixed crowd of clients, each sending again when answered: refusing them would
only bring them back at once.  A line that never drains *and* overflows means more arrive than
leave: it only adds its length to every answer.  So as many requests may wait as the limit lets
in until the line has not been empty for ``STANDING_S`` and someone was turned away meanwhile;
from then on a request is admitted only when a place is free at once (the line drains and stays
empty), until ``STANDING_S`` has passed without anyone turned away.  Under a sustained overload the admitted requests then never wait behind a line, and the
surplus is refused at admission, at the cost of a few bytes.  (A LIFO line would answer the
newest first but keep the oldest waiting; refusing at the door keeps every answer fresh.)

Everything runs on the event loop: plain counters, no lock.
"""

from __future__ import annotations

import asyncio
import collections

MIN_WINDOW_S = 0.05
OVER_TARGET_SHARE = 0.05  # more samples than this share over the target: too slow
DECREASE = 0.9
STANDING_S = 0.05  # a line not empty for this long, and overrun, is a standing one


class Place:
    """One admitted request's place at the gate: reserved at admission, active while the
    predictor holds it.  ``t0``: the request's first byte (loop time), where its sample starts."""

    __slots__ = ("t0", "active", "done", "epoch")

    def __init__(self, t0: float, epoch: int):
        self.t0 = t0
        self.active = False
        self.done = False
        self.epoch = epoch  # the limit's decreases when it was admitted


class AdaptiveLimit:
    """The gate (see the module docstring).  ``most``: the largest limit (and the first);
    ``target_s``: the latency target, from a request's first byte to its answer; ``None`` keeps
    the limit at ``most``.  ``line``: how many may wait for a place while no line stands
    (default: as many as the limit lets in; one of several gateway processes sharing their
    workers waits for its small share of places in a line as long as a lone gateway's)."""

    def __init__(self, most: int, target_s: float | None, line: int | None = None):
        self.most = int(most)
        self.limit = self.most
        self.line = None if line is None else max(1, int(line))
        self.target_s = target_s
        self.window_s = max(MIN_WINDOW_S, target_s or 0.0)
        self.active = 0  # requests in the predictor
        self.reserved = 0  # admitted, not in the predictor yet (reading, decoding, waiting)
        self.decreases = 0
        self.increases = 0
        self.refusals = 0
        self.standing = False
        self._line: collections.deque[tuple[Place, asyncio.Future]] = collections.deque()
        self._line_since = 0.0  # when the line last became non-empty
        self._refused_at = -float("inf")
        self._window_start: float | None = None
        self._samples = 0
        self._over = 0
        self._pressed = False  # a request found no free place this window

    @property
    def waiting(self) -> int:
        """Requests in the line for an active place."""
        return len(self._line)

    def room(self, now: float) -> bool:
        """Whether a request admitted now would get a place (nothing is taken)."""
        if self._standing(now):
            return self.active + self.reserved < self.limit
        return self.active + self.reserved < self.limit + (
            self.limit if self.line is None else self.line)

    def _standing(self, now: float) -> bool:
        if self.standing:
            if not self._line and now - self._refused_at >= STANDING_S:
                self.standing = False  # nobody turned away for a while: the overload is over
        elif (self._line and now - self._line_since >= STANDING_S
              and self._refused_at >= self._line_since):
            self.standing = True
        return self.standing

    def refused(self, now: float) -> None:
        """A request was turned away for want of a place (see :meth:`room`)."""
        self.refusals += 1
        self._refused_at = now
        self._pressed = True
        self._standing(now)

    def reserve(self, t0: float, now: float) -> Place | None:
        """A place for a request admitted now whose first byte came at ``t0``; None when there
        is no room (counted as a refusal)."""
        if not self.room(now):
            self.refused(now)
            return None
        self.reserved += 1
        if self.active + self.reserved > self.limit:
            self._pressed = True  # it will wait for an active place
        return Place(t0, self.decreases)

    async def acquire(self, place: Place, deadline: float) -> None:
        """Make ``place`` active: at once when a place is free and nobody waits ahead of it,
        else in FIFO order; ``TimeoutError`` when ``deadline`` (loop time) comes first (the
        place is then given up)."""
        if self.active < self.limit and not self._line:
            self.reserved -= 1
            self.active += 1
            place.active = True
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._line:
            self._line_since = loop.time()
        self._line.append((place, fut))
        try:
            async with asyncio.timeout_at(deadline):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(place, answered=False)  # granted as the wait ended: pass it on
            else:
                fut.cancel()
                self._line.remove((place, fut))
                self.cancel(place)
            raise

    def release(self, place: Place, *, answered: bool) -> None:
        """``place``'s request is done; an ``answered`` one is a sample of the limit."""
        if place.done:
            return
        place.done = True
        if not place.active:
            self.reserved -= 1
            self._wake()
            return
        self.active -= 1
        if answered and self.target_s is not None:
            self._sample(asyncio.get_running_loop().time(), place)
        self._wake()

    def cancel(self, place: Place) -> None:
        """Give up a place that never became active (its request failed before predicting)."""
        self.release(place, answered=False)

    def _wake(self) -> None:
        line = self._line
        while line and self.active < self.limit:
            place, fut = line.popleft()
            if not fut.done():
                fut.set_result(None)
                self.reserved -= 1
                self.active += 1
                place.active = True

    def _sample(self, now: float, place: Place) -> None:
        if place.epoch != self.decreases:
            return
        if self._window_start is None:
            self._window_start = place.t0
        self._samples += 1
        self._over += now - place.t0 > self.target_s
        if now - self._window_start >= self.window_s:
            self.judge(self._samples, self._over, self._pressed)
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

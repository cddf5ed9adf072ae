"""How much work the gateway takes on at once, so that no client - hostile or just too many -
can exhaust it or stall the others.

* every request (but health checks and metrics) takes a slot of ``max_requests`` on arrival;
  when none is free it gets a 503 at once, with ``Retry-After``;
* at most half of those slots may be waiting for the rest of a request body at a time (a body
  that comes with its headers never waits), and a body must arrive within ``body_timeout_s``
  (408), so clients trickling bodies cannot hold every slot;
* image decoding runs in threads, at most one per usable core (affinity and cgroup quota) at a
  time;
* at most ``max_predictions`` requests are in the predictor; the others wait for a place, but no
  longer than their request's deadline, which starts when the request arrives (503 when it runs
  out while waiting, 504 when the subnets are late);
* a request reaches the gateway's code only after waiting its turn on the event loop, a wait no
  counter sees.  The loop's lag is measured (a timer that should fire every 20 ms) and counts
  against each request's deadline; while it is over ``max_lag_s``, new requests are turned away
  at once (503), which costs far less than serving them and lets the loop catch up.

Everything here runs on the event loop, so plain counters need no lock.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from sensai.cores import usable_cores

from .errors import Overloaded, RequestTimeout


class Admission:
    def __init__(self, *, max_requests: int, max_predictions: int, body_timeout_s: float,
                 deadline_s: float, max_lag_s: float | None = None,
                 decode_slots: int | None = None):
        self.max_requests = max_requests
        self.max_receiving = max(1, max_requests // 2)
        self.body_timeout_s = body_timeout_s
        self.deadline_s = deadline_s
        self.requests = 0
        self.receiving = 0
        self.predicting = asyncio.Semaphore(max_predictions)
        self.decoding = asyncio.Semaphore(decode_slots or usable_cores())
        self.waiting = 0
        self.max_lag_s = max_lag_s if max_lag_s is not None else min(0.25, deadline_s / 4)
        self.lag = 0.0  # seconds a ready callback waits for the loop, smoothed
        self._monitor: asyncio.Task | None = None

    def admit(self) -> bool:
        if self.requests >= self.max_requests or self.lag > self.max_lag_s:
            return False
        self.requests += 1
        return True

    def start(self) -> None:
        """Start measuring the event loop's lag (call on the loop that serves requests)."""
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._measure_lag())

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            try:
                await self._monitor
            except asyncio.CancelledError:
                pass
            self._monitor = None

    async def _measure_lag(self, period: float = 0.02) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(period)
            late = max(0.0, loop.time() - t0 - period)
            # Smoothed: one hiccup (a busy machine's scheduler) is not an overload, a lag that
            # lasts a few periods is.
            self.lag = 0.5 * self.lag + 0.5 * late

    def release(self) -> None:
        self.requests -= 1

    def start_receiving(self) -> None:
        """A request's body did not come in one piece: it takes a receiving slot until it is
        complete (most bodies arrive with their headers and never take one)."""
        if self.receiving >= self.max_receiving:
            raise Overloaded(f"{self.receiving} requests are sending their bodies already; "
                             "retry shortly", reason="max_receiving")
        self.receiving += 1

    def done_receiving(self) -> None:
        self.receiving -= 1

    @asynccontextmanager
    async def body(self, deadline: float):
        """Reading one request body, within the body time limit."""
        loop = asyncio.get_running_loop()
        by_body = loop.time() + self.body_timeout_s
        until = min(deadline, by_body)
        try:
            async with asyncio.timeout_at(until):
                yield
        except TimeoutError:
            limit = (f"the body timeout of {self.body_timeout_s:g} s" if by_body <= deadline
                     else f"the request's deadline of {self.deadline_s:g} s")
            raise RequestTimeout(f"the request body did not arrive in time ({limit})") from None

    @asynccontextmanager
    async def slot(self, sem: asyncio.Semaphore, deadline: float, what: str):
        """A place in ``sem``, waited for until ``deadline`` at most."""
        if sem.locked():
            self.waiting += 1
            try:
                async with asyncio.timeout_at(deadline):
                    await sem.acquire()
            except TimeoutError:
                raise Overloaded(f"no {what} slot became free before the request's deadline; "
                                 "the gateway is overloaded, retry shortly",
                                 reason="no_slot_before_deadline") from None
            finally:
                self.waiting -= 1
        else:
            await sem.acquire()
        try:
            yield
        finally:
            sem.release()

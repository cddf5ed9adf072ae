"""How much work the gateway takes on at once, so that no client - hostile or just too many -
can exhaust it or stall the others.

* every request (but health checks and metrics) takes a slot of ``max_requests`` on arrival;
  when none is free it gets a 503 at once, with ``Retry-After``;
* at most half of those slots may be reading a request body at a time, and a body must arrive
  within ``body_timeout_s`` (408), so clients trickling bodies cannot hold every slot;
* image decoding runs in threads, at most one per core at a time;
* at most ``max_predictions`` requests are in the predictor; the others wait for a place, but no
  longer than their request's deadline, which starts when the request arrives (503 when it runs
  out while waiting, 504 when the subnets are late).

Everything here runs on the event loop, so plain counters need no lock.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager

from .errors import Overloaded, RequestTimeout


class Admission:
    def __init__(self, *, max_requests: int, max_predictions: int, body_timeout_s: float,
                 deadline_s: float, decode_slots: int | None = None):
        self.max_requests = max_requests
        self.max_receiving = max(1, max_requests // 2)
        self.body_timeout_s = body_timeout_s
        self.deadline_s = deadline_s
        self.requests = 0
        self.receiving = 0
        self.predicting = asyncio.Semaphore(max_predictions)
        self.decoding = asyncio.Semaphore(decode_slots or os.cpu_count() or 1)
        self.waiting = 0

    def admit(self) -> bool:
        if self.requests >= self.max_requests:
            return False
        self.requests += 1
        return True

    def release(self) -> None:
        self.requests -= 1

    @asynccontextmanager
    async def body(self, deadline: float):
        """Reading one request body: a receiving slot, and a time limit."""
        if self.receiving >= self.max_receiving:
            raise Overloaded(f"{self.receiving} requests are sending their bodies already; "
                             "retry shortly")
        self.receiving += 1
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + self.body_timeout_s)
        try:
            async with asyncio.timeout_at(until):
                yield
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive in time (limit "
                                 f"{self.body_timeout_s:g} s)") from None
        finally:
            self.receiving -= 1

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
                                 "the gateway is overloaded, retry shortly") from None
            finally:
                self.waiting -= 1
        else:
            await sem.acquire()
        try:
            yield
        finally:
            sem.release()

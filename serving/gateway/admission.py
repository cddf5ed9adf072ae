"""How much work the gateway takes on at once, so that no client - hostile or just too many -
can exhaust it or stall the others.

* every request (but health checks and metrics) takes a slot of ``max_requests`` on arrival;
  when none is free it gets a 503 at once, with ``Retry-After``;
* at most half of those slots may be waiting for the rest of a request body at a time (a body
  that comes with its headers never waits), and a body must arrive within ``body_timeout_s``
  (408), so clients trickling bodies cannot hold every slot;
* image decoding runs in threads, at most one per usable core (affinity and cgroup quota) at a
  time;
* at most a limit of requests are in the predictor and as many more wait for a place, no
  longer than their request's deadline, which starts when the request arrives (503 when it
  runs out while waiting, 504 when the subnets are late); a request that finds the queue full
  gets a 503 at once, so an admitted request waits about one service time, not its deadline.
  The limit adapts, up to ``max_predictions``, to keep waiting plus predicting within
  ``latency_target_s`` (:class:`~.limit.AdaptiveLimit`); while the queue is full, new requests
  are refused at admission, before their body is read and their image decoded (work on the
  event loop that a refusal would waste);
* a request reaches the gateway's code only after waiting its turn on the event loop, a wait no
  counter sees.  The loop's lag is measured (how late a periodic timer fires) and counts
  against each request's deadline; while it is over ``max_lag_s``, new requests are turned away
  at once (503), which costs far less than serving them and lets the loop catch up.

Everything here runs on the event loop, so plain counters need no lock.
"""

from __future__ import annotations

import asyncio

from sensai.cores import usable_cores

from ..core.errors import Overloaded, RequestTimeout
from ..core.settings import GatewaySettings
from . import heap
from .limit import AdaptiveLimit


class Admission:
    """The bounds of ``settings`` (``max_requests``, ``max_predictions``, ``latency_target_s``,
    ``body_timeout_s``, ``max_loop_lag_s``, ``deadline_s``) for one gateway's event loop;
    ``decode_slots``: decoding threads (default: one per usable core)."""

    def __init__(self, settings: GatewaySettings, *, decode_slots: int | None = None):
        s = settings
        self.max_requests = s.max_requests
        self.max_receiving = max(1, s.max_requests // 2)
        self.body_timeout_s = s.body_timeout_s
        self.deadline_s = s.deadline_s
        self.requests = 0
        self.receiving = 0
        target = s.latency_target_s if s.latency_target_s is not None else s.deadline_s / 4
        self.predictor = AdaptiveLimit(s.max_predictions, target)
        self.decoding = asyncio.Semaphore(decode_slots or usable_cores())
        self.decode_waiting = 0
        self.max_lag_s = (s.max_loop_lag_s if s.max_loop_lag_s is not None
                          else min(0.25, s.deadline_s / 4))
        self.lag = 0.0  # seconds a ready callback waits for the loop, smoothed
        self._monitor: asyncio.Task | None = None

    def full(self) -> bool:
        """Whether :meth:`admit` would say no now (nothing taken)."""
        return (self.requests >= self.max_requests or self.lag > self.max_lag_s
                or self.predict_queue_full())

    @property
    def waiting(self) -> int:
        """Requests waiting for a place in the predictor or a decoding (parsing) thread."""
        return self.predictor.waiting + self.decode_waiting

    def predict_queue_full(self) -> bool:
        """As many requests wait for the predictor as may: a new one would be refused there
        anyway, after its body was read and its image decoded; refused at admission instead."""
        return self.predictor.queue_full()

    def admit(self) -> bool:
        if self.full():
            return False
        self.requests += 1
        return True

    def refusal(self) -> tuple[str, str]:
        """Why :meth:`admit` just said no: (the metric's reason, the client's message)."""
        if self.requests >= self.max_requests:
            return "max_requests", (f"the gateway is at its limit of {self.max_requests} "
                                    "requests in flight; retry shortly")
        if self.predict_queue_full():
            return "queue_full", self.predictor.full_message()
        return "loop_lag", (f"the gateway is behind by {self.lag * 1e3:.0f} ms; retry shortly")

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
            t0, settled = loop.time(), heap.settled_s
            await asyncio.sleep(period)
            # The gateway's own collection after a model is built or let go stalls the loop
            # once; turning the next requests away would not shorten it.
            late = max(0.0, loop.time() - t0 - period - (heap.settled_s - settled))
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

    def body(self, deadline: float) -> "_Body":
        """``async with admission.body(deadline)``: reading one request body, within the body
        time limit."""
        return _Body(self, deadline)

    def slot(self, sem: asyncio.Semaphore, deadline: float, what: str) -> "_Slot":
        """``async with admission.slot(sem, deadline, what)``: a place in ``sem``, waited for
        until ``deadline`` at most."""
        return _Slot(self, sem, deadline, what)

    def prediction(self, deadline: float) -> "_Prediction":
        """``async with admission.prediction(deadline)``: a place in the predictor, waited for
        until ``deadline`` at most."""
        return _Prediction(self, deadline)


# Context managers as plain classes: every request enters two, and @asynccontextmanager's
# generator costs more than the work they guard.

class _Body:
    __slots__ = ("adm", "deadline", "by_body", "timeout")

    def __init__(self, adm: Admission, deadline: float):
        self.adm, self.deadline = adm, deadline

    async def __aenter__(self) -> None:
        self.by_body = asyncio.get_running_loop().time() + self.adm.body_timeout_s
        self.timeout = asyncio.timeout_at(min(self.deadline, self.by_body))
        await self.timeout.__aenter__()

    async def __aexit__(self, et, exc, tb) -> None:
        try:
            await self.timeout.__aexit__(et, exc, tb)
        except TimeoutError:
            adm = self.adm
            limit = (f"the body timeout of {adm.body_timeout_s:g} s"
                     if self.by_body <= self.deadline
                     else f"the request's deadline of {adm.deadline_s:g} s")
            raise RequestTimeout(f"the request body did not arrive in time ({limit})") from None


def _no_slot(what: str) -> Overloaded:
    return Overloaded(f"no {what} slot became free before the request's deadline; the gateway "
                      "is overloaded, retry shortly", reason="no_slot_before_deadline")


class _Slot:
    __slots__ = ("adm", "sem", "deadline", "what")

    def __init__(self, adm: Admission, sem: asyncio.Semaphore, deadline: float, what: str):
        self.adm, self.sem, self.deadline, self.what = adm, sem, deadline, what

    async def __aenter__(self) -> None:
        sem = self.sem
        if not sem.locked():
            await sem.acquire()
            return
        adm = self.adm
        adm.decode_waiting += 1
        try:
            async with asyncio.timeout_at(self.deadline):
                await sem.acquire()
        except TimeoutError:
            raise _no_slot(self.what) from None
        finally:
            adm.decode_waiting -= 1

    async def __aexit__(self, et, exc, tb) -> None:
        self.sem.release()


class _Prediction:
    __slots__ = ("adm", "deadline", "t0")

    def __init__(self, adm: Admission, deadline: float):
        self.adm, self.deadline = adm, deadline

    async def __aenter__(self) -> None:
        try:
            self.t0 = await self.adm.predictor.acquire(self.deadline)
        except TimeoutError:
            raise _no_slot("prediction") from None

    async def __aexit__(self, et, exc, tb) -> None:
        # Only an answer is a sample: a request failed by a hung or lost subnet says nothing
        # about how many requests the workers finish in time, and fewer would not help it.
        self.adm.predictor.release(self.t0 if et is None else None)

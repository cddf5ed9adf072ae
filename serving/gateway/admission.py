"""How much work the gateway takes on at once, so that no client - hostile or just too many -
can exhaust it or stall the others; and the one moment a request is let in or turned away.

A request's clock starts at its first byte (the HTTP protocol stamps it as it parses; gRPC when
the call reaches the servicer), less the event loop's lag, which estimates how long the bytes
waited for the loop before that.  Its deadline counts from there, so do the latency target's
samples, and so does admission: a request is admitted, or refused with a 503 and
``Retry-After``, once its head is parsed and before its body is read.  What is admitted is never
refused afterwards for want of room: it can only fail on its own (bad input 4xx, a slow body
408 or 503, its deadline 504).  A request is refused when

* ``max_requests`` requests (health checks and metrics excepted) are in flight already;
* it waited longer than the latency target before it could be admitted (the bytes sat in a
  socket buffer or a busy event loop's queue): its answer would come late anyway, and refusing
  it costs a few bytes;
* the event loop runs later than ``max_loop_lag_s`` (measured by how late a periodic timer
  fires): turning new requests away at once costs far less than serving them and lets it catch
  up;
* it is a prediction and the predictor's gate has no place for it: a place is reserved at
  admission and kept to the answer (:class:`~.limit.AdaptiveLimit`: the limit adapts to the
  latency target, and no standing line forms).

One bound holds a client to account later: at most half of ``max_requests`` may be waiting for
the rest of their body at a time (a body that comes with its head never waits), so clients
trickling bodies cannot hold every slot: a body that does not come whole while that many are
arriving gets a 503, and a body must arrive within ``client_timeout_s`` (408).

Image decoding runs in threads, at most one per usable core (affinity and cgroup quota) at a
time.  Everything here runs on the event loop, so plain counters need no lock.
"""

from __future__ import annotations

import asyncio

from sensai.cores import usable_cores

from ..core.errors import DeadlinePassed, Overloaded, RequestTimeout
from ..core.settings import GatewaySettings
from . import heap
from .limit import AdaptiveLimit, Place


class Ticket:
    """One admitted request: its slot among ``max_requests``, for a prediction its place at the
    predictor's gate, and a receiving slot while a body that did not come whole arrives.
    :meth:`release` gives back whatever it still holds (at the end of the request, whatever
    happened)."""

    __slots__ = ("adm", "first_byte", "place", "receiving", "released")

    def __init__(self, adm: "Admission", first_byte: float, place: Place | None):
        self.adm, self.first_byte, self.place = adm, first_byte, place
        self.receiving = False
        self.released = False

    def start_receiving(self) -> None:
        """The body did not come whole: it takes a receiving slot until it has (most bodies
        arrive with their head and never take one)."""
        adm = self.adm
        if adm.receiving >= adm.max_receiving:
            raise Overloaded(adm.messages["max_receiving"], reason="max_receiving")
        adm.receiving += 1
        self.receiving = True

    def body_done(self) -> None:
        """The body has arrived whole: its receiving slot, if it took one, is free."""
        if self.receiving:
            self.receiving = False
            self.adm.receiving -= 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.body_done()
        adm = self.adm
        adm.requests -= 1
        if self.place is not None:
            adm.predictor.release(self.place, answered=False)  # nothing if it was already


class Admission:
    """The bounds of ``settings`` (``max_requests``, ``max_predictions``, ``latency_target_s``,
    ``client_timeout_s``, ``max_loop_lag_s``, ``deadline_s``) for one gateway's event loop;
    ``decode_slots``: decoding threads (default: one per usable core); ``line``: how many
    requests may wait for the predictor (see :class:`~.limit.AdaptiveLimit`)."""

    def __init__(self, settings: GatewaySettings, *, decode_slots: int | None = None,
                 line: int | None = None):
        s = settings
        self.max_requests = s.max_requests
        self.max_receiving = max(1, s.max_requests // 2)
        self.client_timeout_s = s.client_timeout_s
        self.deadline_s = s.deadline_s
        self.requests = 0
        self.receiving = 0
        self.target_s = s.latency_target_s if s.latency_target_s is not None else s.deadline_s / 4
        self.predictor = AdaptiveLimit(s.max_predictions, self.target_s, line)
        self.decoding = asyncio.Semaphore(decode_slots or usable_cores())
        self.decode_waiting = 0
        self.max_lag_s = (s.max_loop_lag_s if s.max_loop_lag_s is not None
                          else min(0.25, s.deadline_s / 4))
        self.lag = 0.0  # seconds a ready callback waits for the loop, smoothed
        self._monitor: asyncio.Task | None = None
        # What a refused client is told, by the metric's reason: fixed per gateway, so each
        # answer is built once (:class:`~.wire.Refusals`).
        self.messages = {
            "max_requests": f"the gateway is at its limit of {self.max_requests} requests in "
                            "flight; retry shortly",
            "waited": f"the request waited more than the gateway's latency target of "
                      f"{self.target_s * 1e3:.0f} ms before it could be admitted; the gateway "
                      "is overloaded, retry shortly",
            "loop_lag": f"the gateway is behind by more than {self.max_lag_s * 1e3:.0f} ms; "
                        "retry shortly",
            "max_receiving": f"{self.max_receiving} requests are sending their bodies already; "
                             "retry shortly",
            "queue_full": "the predictor has no place for another request; the gateway is "
                          "overloaded, retry shortly",
        }

    @property
    def waiting(self) -> int:
        """Requests waiting for a place in the predictor or a decoding (parsing) thread."""
        return self.predictor.waiting + self.decode_waiting

    def clock(self, first_byte: float) -> float:
        """When a request whose first byte the loop saw at ``first_byte`` really began: the
        loop's lag earlier, the time its bytes waited for the loop."""
        return first_byte - self.lag

    def deadline(self, first_byte: float) -> float:
        return self.clock(first_byte) + self.deadline_s

    def refused(self, first_byte: float, prediction: bool, now: float) -> str | None:
        """Why a request whose first byte came at ``first_byte`` would be refused now (the
        metric's reason, a key of ``messages``), or None.  ``prediction``: it takes a place at
        the predictor."""
        if self.requests >= self.max_requests:
            return "max_requests"
        if now - self.clock(first_byte) > self.target_s:
            return "waited"
        if self.lag > self.max_lag_s:
            return "loop_lag"
        if prediction and not self.predictor.room(now):
            self.predictor.refused(now)
            return "queue_full"
        return None

    def admit(self, first_byte: float, prediction: bool) -> Ticket | str:
        """A :class:`Ticket` for the request, or why it is refused (see :meth:`refused`)."""
        now = asyncio.get_running_loop().time()
        reason = self.refused(first_byte, prediction, now)
        if reason is not None:
            return reason
        place = None
        if prediction:
            place = self.predictor.reserve(self.clock(first_byte), now)
            if place is None:  # cannot happen after refused() said yes, on one event loop
                return "queue_full"
        self.requests += 1
        return Ticket(self, first_byte, place)

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

    def body(self, deadline: float) -> "_Body":
        """``async with admission.body(deadline)``: reading one request body, within the body
        time limit."""
        return _Body(self, deadline)

    def slot(self, sem: asyncio.Semaphore, deadline: float, what: str) -> "_Slot":
        """``async with admission.slot(sem, deadline, what)``: a place in ``sem``, waited for
        until ``deadline`` at most."""
        return _Slot(self, sem, deadline, what)

    def prediction(self, ticket: Ticket, deadline: float) -> "_Prediction":
        """``async with admission.prediction(ticket, deadline)``: the ticket's place in the
        predictor, waited for until ``deadline`` at most."""
        return _Prediction(self, ticket, deadline)


# Context managers as plain classes: every request enters two, and @asynccontextmanager's
# generator costs more than the work they guard.

class _Body:
    __slots__ = ("adm", "deadline", "by_body", "timeout")

    def __init__(self, adm: Admission, deadline: float):
        self.adm, self.deadline = adm, deadline

    async def __aenter__(self) -> None:
        self.by_body = asyncio.get_running_loop().time() + self.adm.client_timeout_s
        self.timeout = asyncio.timeout_at(min(self.deadline, self.by_body))
        await self.timeout.__aenter__()

    async def __aexit__(self, et, exc, tb) -> None:
        try:
            await self.timeout.__aexit__(et, exc, tb)
        except TimeoutError:
            adm = self.adm
            limit = (f"the client timeout of {adm.client_timeout_s:g} s, "
                     "SENSAI_CLIENT_TIMEOUT_S"
                     if self.by_body <= self.deadline
                     else f"the request's deadline of {adm.deadline_s:g} s")
            raise RequestTimeout(f"the request body did not arrive in time ({limit})") from None


def _late(what: str) -> DeadlinePassed:
    return DeadlinePassed(f"the request's deadline passed while it waited for {what}")


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
            raise _late(f"a {self.what} thread") from None
        finally:
            adm.decode_waiting -= 1

    async def __aexit__(self, et, exc, tb) -> None:
        self.sem.release()


class _Prediction:
    __slots__ = ("adm", "ticket", "deadline")

    def __init__(self, adm: Admission, ticket: Ticket, deadline: float):
        self.adm, self.ticket, self.deadline = adm, ticket, deadline

    async def __aenter__(self) -> None:
        place = self.ticket.place
        if place is None:
            raise ValueError("a prediction's ticket holds a place at the predictor")
        try:
            await self.adm.predictor.acquire(place, self.deadline)
        except TimeoutError:
            raise _late("a place in the predictor") from None

    async def __aexit__(self, et, exc, tb) -> None:
        # Only an answer is a sample: a request failed by a hung or lost subnet says nothing
        # about how many requests the workers finish in time, and fewer would not help it.
        self.adm.predictor.release(self.ticket.place, answered=et is None)

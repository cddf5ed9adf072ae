"""What happens around every HTTP request of the gateway, before and after its route.

A pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would add a task and a copy per
request on the hot path), in pieces that each do one job:

* the request's id (the client's ``x-request-id`` when it is a sane token, else a fresh one) and
  its deadline, counted from its first byte (stamped by the HTTP protocol;
  :meth:`~.admission.Admission.clock`), for the routes; :class:`TaggedSend` puts the id on the
  response and remembers the response's status;
* admission (:meth:`~.admission.Admission.admit`): a request over the gateway's limits is
  answered 503 before any work, from a prebuilt answer (:class:`~.wire.Refusals`); health
  checks and metrics are never turned away.  The HTTP protocol refuses most of them earlier
  still (:class:`EarlyGate`); an admitted request's :class:`~.admission.Ticket` is in
  ``request.state.ticket`` for the routes, and given back when the request ends;
* the prediction routes dispatched at once (:class:`~.predict_routes.PredictRoutes`), every
  other request passed on to FastAPI;
* :class:`BodyLimit` - a body over ``max_body_bytes`` is refused by its declared length, or as it
  streams in, and a body still arriving holds one of the admission's receiving slots;
* :meth:`GatewayMiddleware.record` - the request's metrics once it is answered.
"""

from __future__ import annotations

import asyncio
import time

from ..core.errors import PayloadTooLarge
from .admission import Ticket
from .inference import Gateway
from .predict_routes import PredictRoutes
from .wire import Refusals, predicts, reply, request_id, ungated

LIMIT_HINT = "(set SENSAI_MAX_BODY_BYTES)"


class TaggedSend:
    """``send`` that adds ``x-request-id`` to the response's headers and keeps its status (500
    while none started: what an app that failed before answering is counted as)."""

    def __init__(self, send, rid: str):
        self.send = send
        self.header = (b"x-request-id", rid.encode())
        self.status = 500

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message = {**message, "headers": [*message.get("headers", ()), self.header]}
        await self.send(message)


class BodyLimit:
    """``receive`` that raises :class:`PayloadTooLarge` once more than ``limit`` bytes came in,
    and, given the request's ``ticket``, holds a receiving slot while the body is still arriving
    (so slow uploads are bounded apart from the requests being predicted)."""

    def __init__(self, receive, limit: int, ticket: Ticket | None):
        self.receive = receive
        self.limit = limit
        self.ticket = ticket
        self.received = 0

    async def __call__(self):
        message = await self.receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise PayloadTooLarge(f"request body is over the limit of {self.limit:,} bytes "
                                      f"{LIMIT_HINT}")
            ticket = self.ticket
            if ticket is not None:
                if message.get("more_body", False):
                    if not ticket.receiving:
                        ticket.start_receiving()
                elif ticket.receiving:
                    ticket.body_done()
        return message


class GatewayMiddleware:
    """``predictions``: the prediction routes, dispatched here past FastAPI's router (their
    one dispatch)."""

    def __init__(self, app, gateway: Gateway, predictions: PredictRoutes):
        self.app = app
        self.gw = gateway
        self.predictions = predictions
        self.refusals = Refusals(gateway.admission.messages)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        adm = self.gw.admission
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        # Stamped by the HTTP protocol at the request's first byte; a server without it (Serve's
        # proxy) starts the clock here.
        first = state.get("first_byte")
        if first is None:
            first = state["first_byte"] = asyncio.get_running_loop().time()
        state["request_id"] = rid = request_id(headers.get(b"x-request-id"))
        state["deadline"] = adm.deadline(first)
        send = TaggedSend(send, rid)
        path = scope.get("path", "")
        ticket = None
        if not ungated(path):
            ticket = adm.admit(first, predicts(path))
            if type(ticket) is str:
                await self.refuse(scope, send, ticket, rid)
                return
            state["ticket"] = ticket
        metrics = self.gw.metrics
        metrics.inflight.inc()
        try:
            await self.within_body_limit(scope, headers, receive, send, ticket)
        finally:
            if ticket is not None:
                ticket.release()
            metrics.inflight.dec()
            self.record(scope, send.status, time.perf_counter() - t0)

    async def refuse(self, scope, send: TaggedSend, reason: str, rid: str) -> None:
        """503 for a request the admission turned away (counted apart: it has no route)."""
        count_refusal(self.gw, reason, scope.get("method", ""))
        await self.refusals.send(send, reason, rid)

    async def within_body_limit(self, scope, headers: dict[bytes, bytes], receive,
                                send: TaggedSend, ticket: Ticket | None) -> None:
        """The app, on a body of at most ``max_body_bytes``: a larger declared length is
        answered 413 at once, a larger body that streams in ends as 413 when it passes the
        limit."""
        limit = self.gw.settings.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            scope["state"]["error_reason"] = "PayloadTooLarge"
            await reply(send, 413, f"request body is {int(length):,} bytes; the limit is "
                        f"{limit:,} {LIMIT_HINT}", scope["state"]["request_id"],
                        [(b"connection", b"close")])
            return
        receive = BodyLimit(receive, limit, ticket)
        route = self.predictions.match(scope)
        if route is not None:
            await self.predictions.dispatch(scope, receive, send, *route)
        else:
            await self.app(scope, receive, send)

    def record(self, scope, status: int, seconds: float) -> None:
        metrics = self.gw.metrics
        path = getattr(scope.get("route"), "path", None) or "unmatched"
        metrics.observe_request(path, scope.get("method", ""), str(status), seconds)
        if status >= 400:
            reason = scope["state"].get("error_reason", "http")
            metrics.child(metrics.errors, path, str(status), reason).inc()


def count_refusal(gw: Gateway, reason: str, method: str) -> None:
    """The metrics of a request the admission turned away, wherever it was answered."""
    metrics = gw.metrics
    metrics.child(metrics.rejected, reason).inc()
    metrics.child(metrics.requests, "unadmitted", method, "503").inc()


class EarlyGate:
    """For the HTTP protocol (:mod:`~sensai.serving.gateway.http_protocol`):
    ``gate(method, path, first_byte, now)`` -> the reason the admission would turn the
    request away at loop time ``now`` (counted as :meth:`GatewayMiddleware.refuse` counts it),
    or None; takes no slot (the middleware admits).  ``refusals``: the answers."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self.adm = gw.admission
        self.refusals = Refusals(gw.admission.messages)

    def __call__(self, method: str, path: str, first_byte: float, now: float) -> str | None:
        if ungated(path):
            return None
        reason = self.adm.refused(first_byte, predicts(path), now)
        if reason is not None:
            count_refusal(self.gw, reason, method)
        return reason

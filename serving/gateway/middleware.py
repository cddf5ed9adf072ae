"""What happens around every HTTP request of the gateway, before and after its route.

A pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would add a task and a copy per
request on the hot path), in pieces that each do one job:

* :func:`request_id` - the client's ``x-request-id`` when it is a sane token, else a fresh one;
  :class:`TaggedSend` puts it on the response and remembers the response's status;
* :meth:`GatewayMiddleware.start` - the request's id and whole-request deadline, for the routes;
* admission - a request over the gateway's limits is answered 503 before any work
  (:meth:`GatewayMiddleware.refuse`); health checks and metrics are never turned away;
* :class:`BodyLimit` - a body over ``max_body_bytes`` is refused by its declared length, or as it
  streams in, and a body still arriving holds one of the admission's receiving slots;
* :meth:`GatewayMiddleware.record` - the request's metrics once it is answered.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

from ..core.errors import PayloadTooLarge
from .admission import Admission
from .inference import Gateway
from .wire import reply, ungated

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
LIMIT_HINT = "(set SENSAI_MAX_BODY_BYTES)"


def request_id(headers: dict[bytes, bytes]) -> str:
    rid = headers.get(b"x-request-id", b"").decode("latin-1")
    return rid if REQUEST_ID.match(rid) else os.urandom(16).hex()


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
    and, given an ``admission``, holds a receiving slot while the body is still arriving (so
    slow uploads are bounded apart from the requests being predicted); :meth:`close` gives
    back a slot still held."""

    def __init__(self, receive, limit: int, admission: Admission | None):
        self.receive = receive
        self.limit = limit
        self.admission = admission
        self.received = 0
        self.receiving = False

    async def __call__(self):
        message = await self.receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise PayloadTooLarge(f"request body is over the limit of {self.limit:,} bytes "
                                      f"{LIMIT_HINT}")
            more = message.get("more_body", False)
            if more and not self.receiving and self.admission is not None:
                self.admission.start_receiving()
                self.receiving = True
            elif not more and self.receiving:
                self.close()
        return message

    def close(self) -> None:
        if self.receiving:
            self.admission.done_receiving()
            self.receiving = False


class GatewayMiddleware:
    def __init__(self, app, gateway: Gateway):
        self.app = app
        self.gw = gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        t0 = time.perf_counter()
        send = TaggedSend(send, self.start(scope, headers))
        gated = not ungated(scope.get("path", ""))
        if gated and not self.gw.admission.admit():
            await self.refuse(scope, send)
            return
        self.gw.metrics.inflight.inc()
        try:
            await self.within_body_limit(scope, headers, receive, send, gated)
        finally:
            if gated:
                self.gw.admission.release()
            self.gw.metrics.inflight.dec()
            self.record(scope, send.status, time.perf_counter() - t0)

    def start(self, scope, headers: dict[bytes, bytes]) -> str:
        """The request's id and deadline in its state (``request.state`` for the routes)."""
        state = scope.setdefault("state", {})
        state["request_id"] = rid = request_id(headers)
        # The deadline covers the whole request: body, decoding, waiting (also the wait for the
        # event loop before this line, estimated by its lag), the subnets.
        state["deadline"] = (asyncio.get_running_loop().time() + self.gw.settings.deadline_s
                             - self.gw.admission.lag)
        return rid

    async def refuse(self, scope, send: TaggedSend) -> None:
        """503 for a request the admission turned away (counted apart: it has no route)."""
        metrics = self.gw.metrics
        reason, why = self.gw.admission.refusal()
        metrics.rejected.labels(reason).inc()
        metrics.child(metrics.requests, "unadmitted", scope.get("method", ""), "503").inc()
        await reply(send, 503, why, scope["state"]["request_id"], [(b"retry-after", b"1")])

    async def within_body_limit(self, scope, headers: dict[bytes, bytes], receive,
                                send: TaggedSend, gated: bool) -> None:
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
        body = BodyLimit(receive, limit, self.gw.admission if gated else None)
        try:
            await self.app(scope, body, send)
        finally:
            body.close()

    def record(self, scope, status: int, seconds: float) -> None:
        metrics = self.gw.metrics
        path = getattr(scope.get("route"), "path", None) or "unmatched"
        metrics.observe_request(path, scope.get("method", ""), str(status), seconds)
        if status >= 400:
            reason = scope["state"].get("error_reason", "http")
            metrics.errors.labels(path, str(status), reason).inc()


def early_gate(gw: Gateway):
    """For the HTTP protocol (:mod:`~sensai.serving.gateway.http_protocol`):
    ``gate(method, url)`` -> why the admission would turn the request away now (counted as
    :meth:`GatewayMiddleware.refuse` counts it), or None; takes no slot."""
    adm, metrics = gw.admission, gw.metrics

    def gate(method: str, url: bytes) -> str | None:
        if not adm.full():
            return None
        if ungated(url.split(b"?", 1)[0].decode("latin-1")):
            return None
        reason, why = adm.refusal()
        metrics.rejected.labels(reason).inc()
        metrics.child(metrics.requests, "unadmitted", method, "503").inc()
        return why

    return gate

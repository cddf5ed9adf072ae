"""A prediction request's cycle on the HTTP protocol: the route's whole path is the gateway's own.

uvicorn hands every request to the app it serves: for the gateway, FastAPI's stack (uvicorn's
proxy-headers middleware, FastAPI's and Starlette's entry points, Starlette's error middleware,
FastAPI's telemetry and body-limit middlewares) before the gateway's middleware, which then
dispatches a prediction itself (:class:`~.predict_routes.PredictRoutes`); and uvicorn writes an
answer's head and its body in two system calls.  For the prediction routes, most of what the
gateway answers, the HTTP protocol (:class:`~.http_protocol.BoundedHttpProtocol`) starts a
:class:`LeanCycle` instead:

* its app is :class:`LeanRoutes`' ``app``: the gateway's middleware (admission, request id,
  deadline, body limit, metrics) inside Starlette's error middleware with the gateway's error
  translation, as in FastAPI's stack, and nothing else: none of the layers skipped has work to
  do for a prediction (the proxy headers name a client no prediction reads; the body limit is
  the gateway's own);
* its answer (the gateway's own: one body of a declared length) leaves in one write, head and
  body together.

Everything else - the request's body, ``100 Continue``, flow control, keep-alive, pipelined
requests, a client that goes away - is uvicorn's cycle unchanged (this is a subclass).  Other
routes, and every request where httptools is missing (uvicorn's h11 protocol), go through
FastAPI's stack as before, to the same middleware and endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

try:  # as in http_protocol: uvicorn[standard] brings httptools
    from uvicorn.protocols.http.httptools_impl import (HEADER_RE, HEADER_VALUE_RE, STATUS_LINE,
                                                       RequestResponseCycle)
except ImportError:  # pragma: no cover - depends on the installation
    RequestResponseCycle = None


@dataclass(frozen=True)
class LeanRoutes:
    """What the HTTP protocol needs to answer the prediction routes itself: ``matches(scope)``,
    whether a request (its scope, method and path set) is one; ``app``: the ASGI app that
    answers it."""

    matches: Callable[[dict], object]
    app: Callable


if RequestResponseCycle is None:  # pragma: no cover - depends on the installation
    LeanCycle = None
else:

    class LeanCycle(RequestResponseCycle):
        """uvicorn's request cycle, but the answer's head is held until its body and written
        with it.  Only an answer the gateway builds comes this way: a declared
        ``content-length`` and the whole body in one message; anything else is a bug, raised
        (uvicorn logs it and closes the connection)."""

        head: bytes | None = None

        async def send(self, message) -> None:
            head = self.head
            if head is None:
                if not self.response_started and message["type"] == "http.response.start":
                    self.head = self.head_of(message)
                else:  # after the answer: uvicorn's errors
                    await super().send(message)
                return
            if message["type"] != "http.response.body" or message.get("more_body", False):
                raise RuntimeError("a prediction route's answer is one body")
            self.head = None
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            body = message.get("body", b"")
            if len(body) != self.expected_content_length:
                raise RuntimeError("the answer's body does not have its content-length")
            self.transport.write(head + body)
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

        def head_of(self, message) -> bytes:
            """The status line and headers of the answer started by ``message`` (uvicorn's
            checks and connection rules; the length must be declared)."""
            self.response_started = True
            self.waiting_for_100_continue = False
            parts = [STATUS_LINE[message["status"]]]
            length = None
            close = False
            for name, value in (*self.default_headers, *message.get("headers", ())):
                if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                    raise RuntimeError("invalid HTTP header name or value")
                name = name.lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and b"close" in (
                        t.strip() for t in value.lower().split(b",")):
                    close = True
                parts += (name, b": ", value, b"\r\n")
            if length is None:
                raise RuntimeError("a prediction route's answer declares its content-length")
            self.expected_content_length = length
            if close:
                self.keep_alive = False
            elif not self.keep_alive:
                parts.append(b"connection: close\r\n")
            parts.append(b"\r\n")
            return b"".join(parts)

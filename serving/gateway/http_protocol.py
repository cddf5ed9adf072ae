"""What a connection may cost before its request is admitted.

Admission (:mod:`~sensai.serving.gateway.admission`) starts once a request's head is complete;
before that, only this bounds a client.  uvicorn's httptools protocol keeps a head however large and
however slowly it arrives, and accepts any number of connections, so a few hundred clients each
trickling a huge header could exhaust the host's memory.  :class:`BoundedHttpProtocol` is that
protocol with three bounds, as nginx, h11 and Envoy have them:

* a request head (request line and headers) over ``max_header_bytes`` -> 431, connection closed,
  counted as it arrives (so a trickled head never grows past the bound) and as parsed (a head
  that came in one read);
* a head not complete ``head_timeout_s`` after its first byte (or after the connection opened)
  -> 408, connection closed; an idle kept-alive connection is left to uvicorn's keep-alive timeout;
* a connection beyond ``max_connections`` open ones -> 503 with ``Retry-After``, closed at once;
* under overload, a request the gateway's admission would turn away -> 503 with
  ``Retry-After`` from here, its body read and dropped, the connection kept.

Each answer is the gateway's JSON error.  Without httptools, uvicorn's h11 protocol runs instead,
bounded by its own incomplete-event limit (set to ``max_header_bytes``; it answers 400).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ..core.settings import GatewaySettings
from .wire import error_body

try:  # uvicorn[standard] brings httptools; the h11 fallback below covers its absence
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - depends on the installation
    HttpToolsProtocol = None

log = logging.getLogger(__name__)

LINGER_S = 1.0  # how long a refused connection is drained before it is closed regardless
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


def error_response(status: int, message: str, extra: bytes = b"", *, close: bool = True) -> bytes:
    """A whole HTTP/1.1 response carrying the gateway's JSON error."""
    body = error_body(status, message, os.urandom(16).hex())
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%s%s\r\n" % (status, REASONS[status], len(body),
                             b"connection: close\r\n" if close else b"", extra)) + body


if HttpToolsProtocol is not None:

    class BoundedHttpProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the gateway settings' bounds on connections
        (``limits``: the settings, set on a subclass, see :func:`http_protocol`)."""

        limits: GatewaySettings  # set on the subclass http_protocol makes
        # Set there too: gate(method, url) -> why the gateway's admission would turn the request
        # away (counted by the gate), or None.
        gate: Callable[[str, bytes], str | None] | None = None
        # And count(reason): a connection refused before any request (its metric).
        count: Callable[[str], None] | None = None

        def connection_made(self, transport) -> None:
            full = len(self.connections) >= self.limits.max_connections
            super().connection_made(transport)
            self.head_bytes = self.parsed_bytes = 0
            self.awaiting_head = True
            self.refused = False
            self.shed: str | None = None
            self.head_timer = None
            if full:
                self.refuse(503, "max_connections",
                            f"the gateway has {self.limits.max_connections} connections "
                                 "open, its limit (SENSAI_MAX_CONNECTIONS); retry shortly",
                            b"retry-after: 1\r\n")
                return
            self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self.head_late)

        def connection_lost(self, exc) -> None:
            self.stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return  # read and dropped until the client closes (see refuse)
            if not self.awaiting_head:
                super().data_received(data)
                return
            if self.head_timer is None:  # the first bytes of a kept-alive connection's next head
                self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self.head_late)
            # Counted before parsing: when the head completes in this chunk, the count is reset
            # and the body bytes that came with it do not count.
            self.head_bytes += len(data)
            super().data_received(data)
            if (self.awaiting_head and self.head_bytes > self.limits.max_header_bytes
                    and not self.transport.is_closing()):
                self.refuse(431, "header_too_large", self.too_large())

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.parsed_bytes = 0
            self.shed = None

        def on_url(self, url: bytes) -> None:
            self.parsed_bytes += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.parsed_bytes += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.awaiting_head = False
            self.head_bytes = 0
            self.stop_head_timer()
            # A head that came whole in one read was never over the limit while incomplete:
            # its parsed size decides.
            if self.parsed_bytes > self.limits.max_header_bytes:
                # The parser's further callbacks for this request do nothing.
                self.refuse(431, "header_too_large", self.too_large())
                return
            # Under overload, a request the admission would turn away is answered here, without
            # the app's task, middleware and response objects: shedding costs least where it
            # happens first.  Not while an earlier request of this connection is unanswered
            # (answers keep their order).
            idle = (self.cycle is None or self.cycle.response_complete) and not self.pipeline
            if self.gate is not None and idle:
                self.shed = self.gate(self.parser.get_method().decode("ascii", "replace"),
                                      self.url)
                if self.shed is not None:
                    return  # answered once its body has been read (on_message_complete)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.refused and self.shed is None:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self.refused:
                return
            self.awaiting_head = True  # a next head may follow on this connection
            if self.shed is not None:
                keep = self.parser.should_keep_alive()
                self.transport.write(error_response(503, self.shed, b"retry-after: 1\r\n",
                                                    close=not keep))
                self.shed = None
                if keep:
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler)
                else:
                    self.transport.close()
                return
            super().on_message_complete()

        def too_large(self) -> str:
            return (f"the request head is over {self.limits.max_header_bytes:,} bytes "
                    "(SENSAI_MAX_HEADER_BYTES)")

        def head_late(self) -> None:
            self.head_timer = None
            if self.awaiting_head and not self.transport.is_closing():
                self.refuse(408, "head_timeout", f"the request head did not arrive within "
                                 f"{self.limits.head_timeout_s:g} s (SENSAI_HEAD_TIMEOUT_S)")

        def stop_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def refuse(self, status: int, reason: str, message: str, extra: bytes = b"") -> None:
            """Answer and end the connection.  Only its sending side is shut at once: closing
            a socket with unread data makes the kernel reset it, and the client would lose the
            answer; what still comes is read and dropped until the client closes, at most
            ``LINGER_S``."""
            log.debug("connection from %s refused: %d %s", self.client, status, message)
            if self.count is not None:
                self.count(reason)
            self.stop_head_timer()
            self.awaiting_head = False
            self.refused = True
            self.transport.write(error_response(status, message, extra))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def eof_received(self):
            if self.refused:
                self.transport.close()
                return None
            return super().eof_received()


def http_protocol(limits: GatewaySettings, gate=None, count=None):
    """What uvicorn's ``http`` option takes: the bounded protocol for the settings ``limits``
    (with ``gate`` and ``count``, see :class:`BoundedHttpProtocol`), or ``"h11"`` where
    httptools is not installed."""
    if HttpToolsProtocol is None:
        return "h11"
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,),
                {"limits": limits, "gate": staticmethod(gate) if gate else None,
                 "count": staticmethod(count) if count else None})

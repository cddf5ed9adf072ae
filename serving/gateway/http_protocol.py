"""What a connection may cost before its request is admitted, and where a request's clock
starts.

Admission (:mod:`~sensai.serving.gateway.admission`) starts once a request's head is complete;
before that, only this bounds a client.  uvicorn's httptools protocol keeps a head however
large and however slowly it arrives, and accepts any number of connections, so a few hundred
clients each trickling a huge header could exhaust the host's memory.
:class:`BoundedHttpProtocol` is that protocol with these bounds, as nginx, h11 and Envoy have
them:

* every request is stamped at its first byte (the parser's message begin): its deadline, its
  latency sample and its admission count from there (``scope["state"]["first_byte"]``);
* a request head (request line and headers) over ``max_header_bytes`` -> 431, connection closed,
  counted as it arrives (so a trickled head never grows past the bound) and as parsed (a head
  that came in one read);
* a head not complete ``client_timeout_s`` after its first byte (or after the connection opened)
  -> 408, connection closed; an idle kept-alive connection is left to uvicorn's keep-alive
  timeout;
* at ``max_connections`` open connections, a new one makes room: the connection that has waited
  longest without a complete request head is closed (with a 503), else the longest idle
  kept-alive one; only when every connection has a request in progress is the new one refused
  (503 with ``Retry-After``).  So connections that send nothing cannot lock real clients out;
* one client address holds at most ``max_connections_per_client`` of them (503 beyond);
* under overload, a request the gateway's admission would turn away -> 503 with ``Retry-After``
  from here, a prebuilt answer (:class:`~.wire.Refusals`), once its body has been read and
  dropped, the connection kept.

Each answer is the gateway's JSON error; a connection is never closed with an answer due on
it.  Without httptools, uvicorn's h11 protocol runs instead, bounded by its own
incomplete-event limit (set to ``max_header_bytes``; it answers 400).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import urllib.parse
from typing import Callable

from ..core.settings import GatewaySettings
from .lean_cycle import LeanCycle, LeanRoutes
from .wire import error_response, new_request_id, request_id

try:  # uvicorn[standard] brings httptools; the h11 fallback below covers its absence
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - depends on the installation
    HttpToolsProtocol = None

log = logging.getLogger(__name__)

LINGER_S = 1.0  # how long a refused connection is drained before it is closed regardless


if HttpToolsProtocol is not None:

    class BoundedHttpProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the gateway settings' bounds on connections
        (``limits``: the settings, set on a subclass, see :func:`http_protocol`)."""

        limits: GatewaySettings  # set on the subclass http_protocol makes
        # Set there too: the gateway's early gate (:class:`~.middleware.EarlyGate`): called as
        # gate(method, path, first_byte, now) -> why the admission would turn the request
        # away (counted by the gate), or None; its ``refusals`` are the answers.
        gate = None
        # And count(reason): a connection refused before any request (its metric).
        count: Callable[[str], None] | None = None
        # The prediction routes, answered on a lean cycle (:mod:`~.lean_cycle`); None: every
        # request goes to uvicorn's cycle and the app.
        lean: LeanRoutes | None = None
        # Connections per client address, and the connections' count, of this server.
        per_client: collections.Counter
        opened_count: itertools.count

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_bytes = self.parsed_bytes = 0
            self.awaiting_head = True
            self.refused = False
            self.shed: str | None = None
            self.head_timer = None
            self.first_byte = 0.0
            self.head_since = self.loop.time()  # waiting for a complete head since
            self.opened = next(self.opened_count)  # orders connections within one loop tick
            self.host = self.client[0] if self.client else None
            self.per_client[self.host] += 1
            limits = self.limits
            bound = limits.max_connections_per_client
            if bound is not None and self.per_client[self.host] > bound:
                self.refuse(503, "max_connections_per_client",
                            f"this client address has {bound} connections open, its limit "
                            "(SENSAI_MAX_CONNECTIONS_PER_CLIENT); retry shortly",
                            b"retry-after: 1\r\n")
                return
            if len(self.connections) > limits.max_connections and not self.make_room():
                self.refuse(503, "max_connections",
                            f"the gateway has {limits.max_connections} connections open, its "
                            "limit (SENSAI_MAX_CONNECTIONS), each with a request in progress; "
                            "retry shortly", b"retry-after: 1\r\n")
                return
            self.head_timer = self.loop.call_later(limits.client_timeout_s, self.head_late)

        def make_room(self) -> bool:
            """Close the connection that has waited longest without a complete request head,
            else the longest idle kept-alive one; False when every other one has a request in
            progress."""
            partial = idle = None
            for c in self.connections:
                if c is self or c.refused or not c.awaiting_head or c.pipeline:
                    continue
                if c.cycle is not None and c.cycle.response_complete and not c.head_bytes:
                    if idle is None or c.waited_longer(idle):
                        idle = c
                elif c.cycle is None or c.cycle.response_complete:
                    if partial is None or c.waited_longer(partial):
                        partial = c
            if partial is not None:
                partial.refuse(503, "evicted", "the gateway is at its limit of open "
                               "connections and this one sent no complete request: closed to "
                               "make room; retry shortly", b"retry-after: 1\r\n")
                return True
            if idle is not None:
                if self.count is not None:
                    self.count("evicted_idle")
                idle.transport.close()  # as its keep-alive timeout would
                return True
            return False

        def waited_longer(self, other) -> bool:
            """Whether this connection has waited for a complete head longer than ``other``."""
            return (self.head_since, self.opened) < (other.head_since, other.opened)

        def connection_lost(self, exc) -> None:
            self.stop_head_timer()
            self.per_client[self.host] -= 1
            if not self.per_client[self.host]:
                del self.per_client[self.host]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return  # read and dropped until the client closes (see refuse)
            if not self.awaiting_head:
                super().data_received(data)
                return
            if self.head_timer is None:  # the first bytes of a kept-alive connection's next head
                self.head_timer = self.loop.call_later(self.limits.client_timeout_s, self.head_late)
            # Counted before parsing: when the head completes in this chunk, the count is reset
            # and the body bytes that came with it do not count.
            self.head_bytes += len(data)
            super().data_received(data)
            if (self.awaiting_head and self.head_bytes > self.limits.max_header_bytes
                    and not self.transport.is_closing()):
                self.refuse(431, "header_too_large", self.too_large())

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.first_byte = self.loop.time()
            self.scope["state"]["first_byte"] = self.first_byte
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
                                      self.url.split(b"?", 1)[0].decode("latin-1"),
                                      self.first_byte, self.loop.time())
                if self.shed is not None:
                    return  # answered once its body has been read (on_message_complete)
            if self.lean is None or not self.start_lean():
                super().on_headers_complete()

        def start_lean(self) -> bool:
            """Start the request on a :class:`~.lean_cycle.LeanCycle` when it is a prediction
            (its scope completed as uvicorn completes it); False for any other request, left
            to uvicorn's cycle and the app."""
            parser = self.parser
            method = parser.get_method()
            if method != b"POST" or parser.should_upgrade() or self.limit_concurrency:
                return False
            scope = self.scope
            url = httptools.parse_url(self.url)
            path = url.path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            scope["method"] = "POST"
            version = parser.get_http_version()
            if version != "1.1":
                scope["http_version"] = version
            scope["path"] = self.root_path + path
            scope["raw_path"] = self.root_path.encode("ascii") + url.path
            scope["query_string"] = url.query or b""
            if not self.lean.matches(scope):
                return False
            existing = self.cycle
            self.cycle = LeanCycle(
                scope=scope, transport=self.transport, flow=self.flow, logger=self.logger,
                access_logger=self.access_logger, access_log=self.access_log,
                default_headers=self.server_state.default_headers,
                message_event=asyncio.Event(), expect_100_continue=self.expect_100_continue,
                keep_alive=version != "1.0" and parser.should_keep_alive(),
                on_response=self.on_response_complete)
            if existing is None or existing.response_complete:
                task = self.loop.create_task(self.cycle.run_asgi(self.lean.app))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)
            else:  # pipelined: uvicorn starts it once the answers before it are out
                self.flow.pause_reading()
                self.pipeline.appendleft((self.cycle, self.lean.app))
            return True

        def on_body(self, body: bytes) -> None:
            if not self.refused and self.shed is None:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self.refused:
                return
            self.awaiting_head = True  # a next head may follow on this connection
            self.head_since = self.loop.time()
            if self.shed is not None:
                keep = self.parser.should_keep_alive()
                self.transport.write(self.gate.refusals.response(
                    self.shed, request_id(dict(self.headers).get(b"x-request-id")),
                    close=not keep))
                self.shed = None
                if keep:
                    self._unset_keepalive_if_required()
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler)
                else:
                    self.transport.close()
                return
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self.head_since = self.loop.time()
            super().on_response_complete()

        def too_large(self) -> str:
            return (f"the request head is over {self.limits.max_header_bytes:,} bytes "
                    "(SENSAI_MAX_HEADER_BYTES)")

        def head_late(self) -> None:
            self.head_timer = None
            if self.awaiting_head and not self.transport.is_closing():
                self.refuse(408, "head_timeout", f"the request head did not arrive within "
                                 f"{self.limits.client_timeout_s:g} s (SENSAI_CLIENT_TIMEOUT_S)")

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
            self.transport.write(error_response(status, message, new_request_id(), extra))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # What uvicorn's parser cannot read it answers in plain text; the gateway, in JSON.
            self.refuse(400, "malformed_http", f"malformed HTTP request: {msg}")

        def eof_received(self):
            if self.refused:
                self.transport.close()
                return None
            return super().eof_received()


def http_protocol(limits: GatewaySettings, gate=None, count=None,
                  lean: LeanRoutes | None = None):
    """What uvicorn's ``http`` option takes: the bounded protocol for the settings ``limits``
    (with ``gate``, ``count`` and ``lean``, see :class:`BoundedHttpProtocol`), or ``"h11"``
    where httptools is not installed."""
    if HttpToolsProtocol is None:
        return "h11"
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,),
                {"limits": limits, "gate": gate, "lean": lean,
                 "count": staticmethod(count) if count else None,
                 "per_client": collections.Counter(), "opened_count": itertools.count()})

"""The gateway under uvicorn: in the foreground (``sensai serve``), in a background thread (the
benchmark, the demo, tests, notebooks), or on the event loop that already runs the app (the Ray
Serve ingress replica's own port)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading
import time
from typing import Awaitable, Mapping, TypeVar

import uvicorn

from sensai.errors import SensaiError

from ..core.settings import GatewaySettings, setting_name
from .http_protocol import http_protocol
from .middleware import EarlyGate

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_like_the_gateway(main: Awaitable[T]) -> T:
    """``asyncio.run(main)`` on the event loop uvicorn gives the gateway (its own choice for
    the gateway's config: uvloop when installed, whose thread hand-offs are cheaper): what calls
    a predictor in process (the benchmark) measures it as the gateway runs it."""
    with asyncio.Runner(loop_factory=uvicorn_config(None).get_loop_factory()) as runner:
        return runner.run(main)


DRAIN_MARGIN_S = 2.0  # beyond the deadline: the answer's write, the client's read


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                   graceful_s: float = 10.0, lifespan: str = "on") -> uvicorn.Config:
    """uvicorn's settings for ``app``; a gateway app's connections are bounded by its own
    settings before any request is admitted (:mod:`~sensai.serving.gateway.http_protocol`)."""
    state = getattr(app, "state", None)
    gateway = getattr(state, "gateway", None)
    limits = gateway.settings if gateway is not None else GatewaySettings()
    gate = EarlyGate(gateway) if gateway is not None else None
    count = gateway.metrics.rejected_connection if gateway is not None else None
    # access_log stays off: the prediction routes' lean cycle writes no access log.
    # A stop drains every request the gateway still owes an answer within its deadline: one
    # cut off before would get uvicorn's plain-text 500.
    drain_s = max(graceful_s, limits.deadline_s + DRAIN_MARGIN_S)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan=lifespan,
                          access_log=False, timeout_graceful_shutdown=drain_s,
                          http=http_protocol(limits, gate, count, getattr(state, "lean", None)),
                          backlog=limits.max_requests,
                          h11_max_incomplete_event_size=limits.max_header_bytes)


class StartupErrorSaid(logging.Filter):
    """Drops uvicorn's errors once the app's startup failed with an error of sensai's own
    (``app.state.startup_error``): its traceback and "startup failed", where ``sensai serve``
    says what is wrong in one line."""

    def __init__(self, app):
        super().__init__()
        self.state = getattr(app, "state", None)

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno < logging.ERROR
                or getattr(self.state, "startup_error", None) is None)


def run_uvicorn(app, *, host: str, port: int, log_level: str = "info",
                graceful_s: float = 10.0, sock: socket.socket | None = None) -> None:
    """Serve ``app`` in this thread until SIGINT/SIGTERM, then shut down gracefully (the app's
    shutdown closes the predictor) and return normally; ``sock``: ``host:port`` bound already
    (:func:`bind_port`), else uvicorn binds it."""
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                           graceful_s=graceful_s))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal against the
    # handlers installed before it; these make that a normal exit (status 0).
    stopped = []
    old = {s: signal.signal(s, lambda signum, frame: stopped.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    said = StartupErrorSaid(app)
    logging.getLogger("uvicorn.error").addFilter(said)
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        logging.getLogger("uvicorn.error").removeFilter(said)
        for s, h in old.items():
            signal.signal(s, h)
    if stopped:
        log.info("stopped by %s", signal.Signals(stopped[0]).name)


def listening_socket(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` for uvicorn (which listens on it), ``shared`` with other
    processes that bind it the same way (SO_REUSEPORT); OSError when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_port(host: str, port: int, *, field: str = "port",
              names: Mapping[str, str] | None = None, shared: bool = False) -> socket.socket:
    """:func:`listening_socket`, or a one-line :class:`SensaiError` naming the address, why it
    cannot be bound, and the setting at fault as its user gave it (``field``: the port's
    setting, port or grpc_port; a host that does not resolve or is not this machine's is
    ``host``'s fault; ``names``: see :func:`~sensai.serving.core.settings.setting_name`)."""
    try:
        return listening_socket(host, port, shared=shared)
    except OSError as e:
        host_fault = isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL
        name, value = (setting_name("host", names), host) if host_fault else \
            (setting_name(field, names), port)
        raise SensaiError(f"{name} {value}: cannot listen on {host}:{port} "
                          f"({e.strerror or e})") from None


class BackgroundServer:
    """``app`` under uvicorn on 127.0.0.1 in a daemon thread; the port is the kernel's choice
    (bound before uvicorn starts, so no other process can take it meanwhile)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", startup_timeout_s: float = 60.0):
        self.host = host
        self.sock = listening_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, host=host, port=self.port,
                                                    log_level=log_level, graceful_s=5.0))
        self.startup_timeout_s = startup_timeout_s
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="sensai-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                self.sock.close()
                raise SensaiError(f"the gateway failed to start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise SensaiError(f"the gateway did not start within {self.startup_timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedServer:
    """``app`` under uvicorn on the event loop that already runs it, whose lifespan someone else
    runs (the Ray Serve ingress replica: Serve runs the app and its lifespan, this serves it on
    the replica's own port too, past Serve's proxy).  The socket has SO_REUSEPORT, so several
    replicas on one node, or an old and a new one during a rolling update, share the port and
    the kernel spreads the connections over them."""

    def __init__(self, app, host: str, port: int):
        self.host, self.port = host, port
        self.server = uvicorn.Server(uvicorn_config(app, host=host, port=port, graceful_s=5.0,
                                                    lifespan="off"))
        # Signals belong to the process that embeds the server (uvicorn would take them when
        # the loop runs on the main thread).
        self.server.capture_signals = contextlib.nullcontext
        self.task: asyncio.Task | None = None

    @property
    def failed(self) -> str | None:
        """Why the server stopped serving on its own (None while it serves)."""
        if self.task is None or not self.task.done() or self.server.should_exit:
            return None
        e = None if self.task.cancelled() else self.task.exception()
        return f"the gateway's server on {self.host}:{self.port} stopped" + (f": {e}" if e else "")

    async def start(self, timeout_s: float = 30.0) -> "EmbeddedServer":
        sock = bind_port(self.host, self.port, shared=True)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self.task.done() or time.monotonic() > deadline:
                await self.stop()
                sock.close()
                raise SensaiError(f"the gateway's server on {self.host}:{self.port} did not "
                                  "start")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        """Stop accepting, let the requests in flight finish (a few seconds at most)."""
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.task

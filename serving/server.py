"""The gateway under uvicorn: in the foreground (``sensai serve``) or in a background thread
(the benchmark, the demo, tests, notebooks)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from typing import Awaitable, TypeVar

import uvicorn

from sensai.errors import SensaiError

from .connections import ConnectionLimits, http_protocol
from .middleware import early_gate
from .settings import GatewaySettings

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_like_the_gateway(main: Awaitable[T]) -> T:
    """``asyncio.run(main)`` on the event loop uvicorn gives the gateway (its own choice for
    the gateway's config: uvloop when installed, whose thread hand-offs are cheaper): what calls
    a predictor in process (the benchmark) measures it as the gateway runs it."""
    with asyncio.Runner(loop_factory=uvicorn_config(None).get_loop_factory()) as runner:
        return runner.run(main)


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                   graceful_s: float = 10.0) -> uvicorn.Config:
    """uvicorn's settings for ``app``; a gateway app's connections are bounded by its own
    settings before any request is admitted (:mod:`~sensai.serving.connections`)."""
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    limits = ConnectionLimits.of(gateway.settings if gateway is not None else GatewaySettings())
    gate = early_gate(gateway) if gateway is not None else None
    count = gateway.metrics.rejected_connection if gateway is not None else None
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          access_log=False, timeout_graceful_shutdown=graceful_s,
                          http=http_protocol(limits, gate, count),
                          h11_max_incomplete_event_size=limits.max_header_bytes)


def run_uvicorn(app, *, host: str, port: int, log_level: str = "info",
                graceful_s: float = 10.0) -> None:
    """Serve ``app`` in this thread until SIGINT/SIGTERM, then shut down gracefully (the app's
    shutdown closes the predictor) and return normally."""
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                           graceful_s=graceful_s))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal against the
    # handlers installed before it; these make that a normal exit (status 0).
    stopped = []
    old = {s: signal.signal(s, lambda signum, frame: stopped.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stopped:
        log.info("stopped by %s", signal.Signals(stopped[0]).name)


class BackgroundServer:
    """``app`` under uvicorn on 127.0.0.1 in a daemon thread; the port is the kernel's choice
    (bound before uvicorn starts, so no other process can take it meanwhile)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", startup_timeout_s: float = 60.0):
        self.host = host
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
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

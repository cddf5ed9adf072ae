"""The gateway serving on its own port from inside a host that already runs it (the Ray Serve
ingress replica's own port, :class:`~sensai.serving.gateway.server.EmbeddedServer`), with real
sockets on 127.0.0.1: two servers share a port and both answer; a port something else listens on is
refused in one line; the gateway's app serves predictions there, with the gateway's own limits, and
stops listening when its lifespan ends."""

from __future__ import annotations

import asyncio
import socket

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from sensai.errors import SensaiError
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.server import BackgroundServer, EmbeddedServer
from sensai.serving.launch.build import build_predictor
from tests.helpers import free_port, offline_scores, png, sample_images


def named(name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    async def who() -> str:
        return name

    return app


def test_two_servers_share_one_port_and_each_answers():
    """SO_REUSEPORT: a second server on the same port starts (a sibling replica, or the new
    replica of a rolling update), the kernel spreads new connections over both, and once one
    stops the other takes them all."""
    port = free_port()

    async def main():
        a = await EmbeddedServer(named("a"), "127.0.0.1", port).start()
        b = await EmbeddedServer(named("b"), "127.0.0.1", port).start()
        seen = []
        for _ in range(64):  # a new connection each time: the kernel picks the listener
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                seen.append((await c.get("/who")).json())
        await a.stop()
        assert a.failed is None  # stopped, not failed
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            after = {(await c.get("/who")).json() for _ in range(8)}
        await b.stop()
        return set(seen), after

    seen, after = asyncio.run(main())
    assert seen == {"a", "b"} and after == {"b"}
    with socket.socket() as s:  # nothing listens any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_port_another_server_holds_is_refused_in_one_line():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(SensaiError, match=f"cannot listen on 127.0.0.1:{port} \\(Address "):
            asyncio.run(EmbeddedServer(named("a"), "127.0.0.1", port).start())


def test_a_server_that_ends_on_its_own_says_why():
    """What the Serve ingress's health check reports: the server's task ended without being
    asked to."""
    port = free_port()

    async def main():
        server = await EmbeddedServer(named("a"), "127.0.0.1", port).start()
        assert server.failed is None
        server.task.cancel()
        await asyncio.sleep(0.1)
        return server.failed

    assert asyncio.run(main()) == f"the gateway's server on 127.0.0.1:{port} stopped"


def test_the_gateway_app_serves_on_its_own_port_with_its_limits(tiny_artifact, fmnist_test,
                                                                 fmnist_spec):
    """``create_app(..., own_port=True)`` run by another server (here a background uvicorn, in
    Serve the replica): its lifespan serves the same app on ``settings.port`` too - the same
    answers, the same connection limits (431 for a head over ``max_header_bytes``) - and closes
    that port when the lifespan ends."""
    _, images, _ = sample_images(fmnist_test, 4)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    port = free_port()
    settings = GatewaySettings(port=port, max_header_bytes=4096)
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    host = BackgroundServer(create_app(pred, settings, own_port=True)).start()
    try:
        own = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=own, timeout=60) as c:
            for i in range(len(images)):
                r = c.post("/v1/predict", params={"top_k": 10}, content=png(images[i]))
                assert r.status_code == 200, r.text
                got = {p["index"]: p["score"] for p in r.json()["predictions"]}
                np.testing.assert_allclose([got[k] for k in range(10)], expected[i], atol=2e-5)
            r = c.get("/v2/health/live", headers={"x-big": "a" * 8192})
            assert r.status_code == 431
        # One gateway behind both ports: the requests above are in the host's metrics.
        text = httpx.get(f"{host.url}/metrics", timeout=30).text
        counted = [line for line in text.splitlines() if line.startswith("sensai_requests_total")
                   and 'route="/v1/predict"' in line and 'status="200"' in line]
        assert counted and counted[0].endswith(" 4.0"), text
    finally:
        host.stop()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0

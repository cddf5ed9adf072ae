"""What a connection may cost before admission, with real sockets against a real gateway: the
head size limit (431), the head time limit (408), the connection cap (503), and the gateway's
memory while a hundred clients trickle huge headers."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor
from tests.helpers import png, sample_images, start_gateway

pytestmark = pytest.mark.slow

CLIENT_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def image(fmnist_test):
    _, u8, _ = sample_images(fmnist_test, 1)
    return png(u8[0])


@pytest.fixture(scope="module")
def gateway(tiny_artifact):
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, client_timeout_s=CLIENT_TIMEOUT_S, max_connections=300)
    yield server
    server.stop()


def connect(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(s: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of the one response the server sends before closing."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n" + extra + b"\r\n"


def test_a_head_over_the_limit_is_a_431_and_a_normal_one_passes(gateway, image):
    with connect(gateway) as s:
        s.sendall(get("/v2/health/live", b"x-big: " + b"a" * 20_000 + b"\r\n"))
        status, headers, body = read_response(s)
    assert status == 431 and headers["content-type"] == "application/json"
    assert body["status"] == 431 and "16,384 bytes" in body["error"] and body["request_id"]
    assert "SENSAI_MAX_HEADER_BYTES" in body["error"]
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'sensai_rejected_connections_total{reason="header_too_large"}' in text
    # 8 KB of headers (cookies, tokens) and a PNG body in the same packets are fine.
    r = httpx.post(f"{gateway.url}/v1/predict", content=image,
                   headers={"x-token": "t" * 8000}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("head", [
    b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
    b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
    b"BREW /v1/predict HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nx-bad: a\x01b\r\n\r\n"],
    ids=["negative-length", "two-lengths", "unknown-method", "control-character"])
def test_a_request_the_parser_cannot_read_is_a_json_400(gateway, head):
    with connect(gateway) as s:
        s.sendall(head)
        status, headers, body = read_response(s)
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["status"] == 400 and body["error"].startswith("malformed HTTP request: ")
    assert 'sensai_rejected_connections_total{reason="malformed_http"}' in httpx.get(
        f"{gateway.url}/metrics").text


def test_a_head_that_does_not_arrive_in_time_is_a_408(gateway):
    with connect(gateway) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: 127.0.0.1\r\n")  # never finished
        t0 = time.monotonic()
        status, _, body = read_response(s)
        waited = time.monotonic() - t0
    assert status == 408 and "SENSAI_CLIENT_TIMEOUT_S" in body["error"]
    assert CLIENT_TIMEOUT_S * 0.8 < waited < CLIENT_TIMEOUT_S + 5
    with connect(gateway) as s:  # a connection that never says anything
        status, _, _ = read_response(s)
    assert status == 408


def test_a_slow_but_timely_head_and_a_kept_alive_idle_connection_are_served(gateway):
    with connect(gateway) as s:
        for part in (b"GET /v2/health/live HTTP/1.1\r\n", b"host: 127.0.0.1\r\n", b"\r\n"):
            s.sendall(part)
            time.sleep(CLIENT_TIMEOUT_S / 5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        # Idle longer than the head timeout, shorter than uvicorn's keep-alive: still open.
        time.sleep(CLIENT_TIMEOUT_S * 1.5)
        s.sendall(get("/v2/health/live"))
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def test_a_hundred_huge_unfinished_heads_cost_little_memory(gateway, image):
    """100 connections each sending up to 2 MB of one header, 64 KB at a time, in turns, until
    the gateway answers: without a bound the gateway (in this process) would hold about 200 MB
    of them."""
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = rss_mb("VmRSS")
    socks = [connect(gateway) for _ in range(100)]
    for s in socks:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: 127.0.0.1\r\nx-huge: ")
    chunk = b"a" * 65536
    answered: set[socket.socket] = set()
    for _ in range(32):
        for s in socks:
            if s not in answered:
                s.sendall(chunk)
        readable, _, _ = select.select([s for s in socks if s not in answered], [], [], 0.01)
        answered.update(readable)
        if len(answered) == len(socks):
            break
    growth = rss_mb("VmHWM") - base
    statuses = []
    for s in socks:
        s.shutdown(socket.SHUT_WR)
        statuses.append(read_response(s)[0])
        s.close()
    assert statuses == [431] * len(socks)
    assert growth < 60, f"peak RSS grew {growth:.0f} MB while the heads arrived"
    r = httpx.post(f"{gateway.url}/v1/predict", content=image, timeout=30)
    assert r.status_code == 200, r.text


def test_silent_connections_make_room_and_busy_ones_get_a_fast_503(tiny_artifact, image):
    """Three connections that send nothing fill a cap of three: a new client is served at once,
    and the connection that waited longest without a request is closed, with a 503, to make
    room.  When every connection has a request in progress, a new one gets a fast 503."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_connections=3, client_timeout_s=30, deadline_s=20)
    try:
        silent = [connect(server) for _ in range(3)]
        time.sleep(0.2)  # the server has accepted them
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/predict", content=image, timeout=30)
        assert r.status_code == 200 and time.monotonic() - t0 < 2, r.text
        status, headers, body = read_response(silent[0])  # the oldest: closed to make room
        assert status == 503 and headers["retry-after"] == "1" and "make room" in body["error"]
        for s in silent:
            s.close()
        time.sleep(0.2)
        pred.pool.inject(0, delay="fixed:1500ms")
        busy = [threading.Thread(target=httpx.post, args=(f"{server.url}/v1/predict",),
                                 kwargs={"content": image, "timeout": 60}) for _ in range(3)]
        for t in busy:
            t.start()
        time.sleep(0.5)  # three requests in progress, one connection each
        with connect(server) as s:
            t0 = time.monotonic()
            s.sendall(get("/v2/health/live"))
            status, headers, body = read_response(s)
        assert status == 503 and headers["retry-after"] == "1"
        assert "SENSAI_MAX_CONNECTIONS" in body["error"] and time.monotonic() - t0 < 2
        for t in busy:
            t.join(30)
        pred.pool.inject(0, delay=None)
        text = httpx.get(f"{server.url}/metrics").text
        assert 'sensai_rejected_connections_total{reason="max_connections"} 1.0' in text
        assert 'sensai_rejected_connections_total{reason="evicted"} 1.0' in text
    finally:
        pred.pool.inject(0, delay=None)
        server.stop()


def test_a_client_address_holds_at_most_its_share_of_connections(tiny_artifact, image):
    """With max_connections_per_client 2, a third connection from the same address gets a 503
    at once, while the two it holds are served."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_connections_per_client=2, client_timeout_s=30)
    try:
        held = [connect(server) for _ in range(2)]
        time.sleep(0.2)
        with connect(server) as s:
            s.sendall(get("/v2/health/live"))
            status, headers, body = read_response(s)
        assert status == 503 and "SENSAI_MAX_CONNECTIONS_PER_CLIENT" in body["error"]
        for s in held:
            s.sendall(get("/v2/health/live"))
            assert read_one(s)[0] == 200
            s.close()
    finally:
        server.stop()


def read_one(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response off a kept-alive connection (by its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, "the connection closed"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_under_overload_the_protocol_sheds_at_once_and_keeps_the_connection(tiny_artifact,
                                                                             image):
    """One request slot, held by a slow request: the next upload is answered 503 by the
    protocol itself (no app), its body read and dropped, and the same connection then serves a
    health check; the refusal is counted."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_requests=1, deadline_s=20)
    try:
        pred.pool.inject(0, delay="fixed:1500ms")
        slow = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/predict",),
                                kwargs={"content": image, "timeout": 60})
        slow.start()
        time.sleep(0.5)  # it holds the one slot
        with connect(server) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /v1/predict HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: image/png\r\n"
                      b"content-length: %d\r\n\r\n" % len(image) + image)
            status, headers, body = read_one(s)
            took = time.monotonic() - t0
            s.sendall(get("/v2/health/live"))
            assert read_one(s)[0] == 200  # the connection was kept
        assert status == 503 and headers["retry-after"] == "1" and took < 0.5
        # Answered by the protocol itself: no app, hence none of uvicorn's own headers.
        assert "server" not in headers and json.loads(body)["status"] == 503
        assert headers["x-request-id"] == json.loads(body)["request_id"]
        assert "limit of 1 requests in flight" in json.loads(body)["error"]
        slow.join(30)
        pred.pool.inject(0, delay=None)
        text = httpx.get(f"{server.url}/metrics").text
        assert 'sensai_rejected_total{reason="max_requests"} 1.0' in text
        assert 'route="unadmitted",status="503"} 1.0' in text
    finally:
        pred.pool.inject(0, delay=None)
        server.stop()


def test_the_listen_backlog_is_sized_from_the_request_limit(gateway):
    """The kernel holds at most as many unaccepted connections as the gateway could admit
    requests (``ss`` shows a listening socket's backlog as its Send-Q)."""
    assert gateway.server.config.backlog == GatewaySettings().max_requests
    out = subprocess.run(["ss", "-ltnH", f"sport = :{gateway.port}"], capture_output=True,
                         text=True).stdout.split()
    if out:  # ss may be missing from a minimal image: the configuration is what was checked
        assert out[2] == str(GatewaySettings().max_requests), out
    from sensai.serving.gateway.app import create_app
    from sensai.serving.gateway.server import uvicorn_config

    app = create_app(gateway.server.config.app.state.gateway.models,
                     GatewaySettings(max_requests=50), close_predictor=False)
    assert uvicorn_config(app).backlog == 50

"""Overload, with real sockets on 127.0.0.1: a request's clock starts at its first byte, what is
admitted is never refused afterwards, and every request a client finishes sending gets a status
- a 200 within its deadline, or a fast 503 with Retry-After."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
import time

import httpx
import numpy as np
import pytest

from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor
from tests.helpers import (free_port, png, sample_images, server_process, start_gateway,
                           stop_server, wait_for_server)

ADMISSION_REASONS = {"max_requests", "waited", "loop_lag", "queue_full"}


@pytest.fixture(scope="module")
def image(fmnist_test):
    _, images, _ = sample_images(fmnist_test, 1)
    return png(images[0])


def upload(image: bytes, keep: bool) -> bytes:
    return (b"POST /v1/predict HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: image/png\r\n"
            b"content-length: %d\r\n%s\r\n" % (len(image), b"" if keep else
                                                b"connection: close\r\n")) + image


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers[b"content-length"]))
    return status, headers


async def flood(port: int, image: bytes, callers: int, seconds: float) -> list[tuple]:
    """``callers`` clients sending uploads one after another for ``seconds``, half on a new
    connection each time and half on one kept alive: (status or the error's name, retry-after,
    seconds from the request's first byte to its answer) per request."""
    end = time.monotonic() + seconds
    out: list[tuple] = []

    async def caller(keep: bool) -> None:
        reader = writer = None
        while time.monotonic() < end:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            try:
                writer.write(upload(image, keep))
                status, headers = await read_answer(reader)
                out.append((status, headers.get(b"retry-after"), time.monotonic() - t0))
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
                out.append((type(e).__name__, None, time.monotonic() - t0))
                status, headers = 0, {b"connection": b"close"}
            if not keep or headers.get(b"connection") == b"close":
                writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*(caller(i % 2 == 0) for i in range(callers)))
    return out


def metric(text: str, pattern: str) -> float:
    return sum(float(v) for v in re.findall(pattern + r" (\S+)", text))


@pytest.mark.slow
def test_a_flood_gets_200s_within_the_deadline_and_fast_503s_and_nothing_else(tiny_artifact,
                                                                             image, tmp_path):
    """``sensai serve`` in its own process, its predictor slowed (a worker 40 ms a request) to a
    few places, and 48 callers sending without pause for 3 s, on new and kept-alive
    connections: every request gets a 200 or a 503; no 200 comes later than the 1 s deadline
    after the request's first byte; the 503s come fast, with Retry-After; and no request was
    refused once admitted (every 503 is counted at admission)."""
    port = free_port()
    env = {"SENSAI_MAX_PREDICTIONS": "4", "SENSAI_DEADLINE_S": "1"}
    argv = [sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--port", str(port),
            "--inject-delay", "0=fixed:40ms", "--log-level", "warning"]
    with server_process(argv, env={**os.environ, **env}) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        answers = asyncio.run(flood(port, image, callers=48, seconds=3.0))
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert stop_server(proc) == 0
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 503}, sorted({s for s in statuses if s not in (200, 503)},
                                               key=str)
    ok = np.array([t for s, _, t in answers if s == 200])
    refused = np.array([t for s, _, t in answers if s == 503])
    assert len(ok) > 20 and len(refused) > 20, (len(ok), len(refused))
    # The deadline counts from the request's first byte: the gateway answers by then (writing
    # the answer and the client reading it take a few ms more).
    assert ok.max() <= 1.0 + 0.2, np.sort(ok)[-5:]
    assert all(ra == b"1" for s, ra, _ in answers if s == 503)
    assert np.percentile(refused, 99) < 0.5 and refused.max() < 2.0, np.sort(refused)[-5:]
    # Every 503 was decided at admission: none after (a route's own 503 would be an error).
    assert metric(text, r'sensai_request_errors_total\{[^}]*status="503"[^}]*\}') == 0
    reasons = set(re.findall(r'sensai_rejected_total\{reason="([a-z_]+)"\}', text))
    assert reasons and reasons <= ADMISSION_REASONS, reasons
    assert metric(text, r'sensai_rejected_total\{reason="[a-z_]+"\}') == len(refused)


def test_a_request_that_waited_past_the_target_is_refused_before_its_body(tiny_artifact,
                                                                          image):
    """A request's clock starts at its first byte: one whose head took longer than the latency
    target to arrive is refused when it could be admitted, before its body is read (the app
    never sees it, no subnet runs); one that came within it has that much less of its
    deadline."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, latency_target_s=0.4, deadline_s=1.0)
    try:
        runs = pred.pool.counters()["runs"]
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            head = upload(image, keep=False).partition(b"\r\n\r\n")[0]
            s.sendall(head[:10])  # the first bytes of the head ...
            time.sleep(0.6)  # ... the rest later than the target
            s.sendall(head[10:] + b"\r\n\r\n" + image)
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower()
        assert b"latency target of 400 ms" in answer
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert metric(text, r'sensai_rejected_total\{reason="waited"\}') == 1
        assert 'route="/v1/predict"' not in text  # the app never ran for it
        assert pred.pool.counters()["runs"] == runs  # nor did any subnet
        # Within the target, admitted: but the 0.25 s the head took count against its 1 s.
        pred.pool.inject(0, delay="fixed:900ms")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(head[:10])
            time.sleep(0.25)
            s.sendall(head[10:] + b"\r\n\r\n" + image)
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 504"), answer[:200]
    finally:
        pred.pool.inject(0, delay=None)
        server.stop()

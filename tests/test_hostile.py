"""One client must not be able to stall or exhaust the gateway.  Each case over real HTTP on
127.0.0.1 against the real gateway and subnets: the work a request may cause is bounded, the
answer is a JSON 4xx/503 at once, and everybody else is still served.

No timing thresholds: where "at once" matters, the order of events is asserted instead (a health
check sent during a heavy request finishes before it).
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import io
import json
import re
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from sensai.cores import usable_cores
from sensai.data import normalize
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway import heap
from sensai.serving.gateway.admission import Admission, Ticket
from sensai.serving.launch.build import build_predictor
from tests.helpers import png, sample_images, start_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def good(fmnist_test, fmnist_spec):
    _, u8, _ = sample_images(fmnist_test, 2)
    return {"png": png(u8[0]), "x": normalize(u8, fmnist_spec).numpy()}


@pytest.fixture(scope="module")
def gateway(tiny_artifact):
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_requests=64, max_predictions=8)
    yield server, pred
    server.stop()


@pytest.fixture(scope="module")
def client(gateway):
    with httpx.Client(base_url=gateway[0].url, timeout=60) as c:
        yield c


def assert_json_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["status"] == status and body["request_id"]
    for f in fragments:
        assert f.lower() in body["error"].lower(), body["error"]
    return body


def still_serving(client, good) -> None:
    r = client.post("/v1/predict", content=good["png"])
    assert r.status_code == 200, r.text


def health_during(url: str, image: bytes, n: int, *, settle_s: float,
                  path: str = "/v2/health/live"):
    """``n`` uploads of ``image`` in flight at once, and a health check (``path``) sent
    ``settle_s`` after them: (the health answer, the uploads' answers)."""
    async def race():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            uploads = [asyncio.ensure_future(c.post("/v1/predict", content=image))
                       for _ in range(n)]
            await asyncio.sleep(settle_s)
            health = await c.get(path)
            return health, await asyncio.gather(*uploads)

    return asyncio.run(race())


def v2(client, body: bytes, **headers):
    return client.post("/v2/models/sensai/infer", content=body, headers=headers)


# --------------------------------------------------------------------------------------------
# KServe v2 bodies that would cost minutes or end in a 500 without their bounds


def test_a_shape_with_100k_dimensions_is_refused_before_any_arithmetic(client, good):
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2] * 100_000,
                                   "data": []}]}).encode()
    assert_json_error(v2(client, body), 400, "dimensions")
    still_serving(client, good)


@pytest.mark.parametrize("dim", ["9" * 5000, str(2 ** 64), "-1"])
def test_a_huge_or_negative_dimension_is_a_400(client, good, dim):
    body = ('{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, %s], "data": []}]}'
            % dim).encode()
    err = assert_json_error(v2(client, body), 400)
    assert len(err["error"]) < 300  # the huge number is not echoed back
    still_serving(client, good)


def test_deeply_nested_json_is_a_400(client, good):
    body = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_json_error(v2(client, body), 400, "nested too deeply")
    still_serving(client, good)


def test_an_integer_of_thousands_of_digits_is_a_400(client, good):
    data = "[" + "7" * 5000 + "]"
    body = ('{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1], "data": %s}]}'
            % data).encode()
    assert_json_error(v2(client, body), 400, "digits")
    still_serving(client, good)


def test_a_finite_input_that_overflows_the_network_is_a_400_not_nan(client, good):
    x = np.full_like(good["x"][:1], 3e38)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()
    r = v2(client, body)
    assert "NaN" not in r.text
    assert_json_error(r, 400, "non-finite")
    r = client.post("/v2/models/sensai/infer", json={"inputs": [
        {"name": "input", "datatype": "FP32", "shape": list(x.shape),
         "data": x.ravel().tolist()}]}, params={})
    assert r.status_code == 400


def test_a_truncated_gzip_body_is_a_400(client, good):
    x = good["x"][:1]
    body = gzip.compress(json.dumps({"inputs": [
        {"name": "input", "datatype": "FP32", "shape": list(x.shape),
         "data": x.ravel().tolist()}]}).encode())
    assert v2(client, body, **{"content-encoding": "gzip"}).status_code == 200
    assert_json_error(v2(client, body[:-12], **{"content-encoding": "gzip"}), 400, "truncated")
    assert_json_error(v2(client, body + b"junk", **{"content-encoding": "gzip"}), 400,
                      "4 bytes after its gzip stream")
    still_serving(client, good)


# --------------------------------------------------------------------------------------------
# Images whose decoding would cost too much


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def test_a_16_bit_picture_over_the_limits_costs_nothing(client, good):
    """5000 x 5000 16-bit grey is ~50 KB on the wire and 50 MB decoded (670 MB before): over
    the default pixel limit for a 28x28 model, refused from the header."""
    big = png_bytes(Image.new("I;16", (5000, 5000), 1234))
    assert len(big) < 200_000
    assert_json_error(client.post("/v1/predict", content=big), 413, "pixels")
    still_serving(client, good)


def test_the_pixel_limit_refuses_a_legal_looking_rgba_picture_from_its_header(tiny_artifact, good):
    """Over max_image_pixels in RGBA (4 bytes a pixel decoded): 413 from the header, nothing
    decoded; the same size in grey under the limit is served."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_image_pixels=1_000_000)
    try:
        rgba = png_bytes(Image.new("RGBA", (1500, 1500), (10, 20, 30, 255)))
        grey = png_bytes(Image.new("L", (1000, 1000), 10))
        with httpx.Client(base_url=server.url, timeout=60) as c:
            body = assert_json_error(c.post("/v1/predict", content=rgba), 413, "pixels")
            assert "2,250,000" in body["error"] and "SENSAI_MAX_IMAGE_PIXELS" in body["error"]
            assert c.post("/v1/predict", content=grey).status_code == 200
    finally:
        server.stop()


def test_the_pixel_limit_bounds_the_decoded_memory():
    """No mode PIL holds a decoded picture in takes more than 4 bytes a pixel, and every mode
    the accepted formats decode to is one of them: the pixel limit (which follows the model's
    input size unless set) bounds a picture's decoded memory at 4 bytes a pixel."""
    from sensai.serving.gateway.imaging import MODE_BYTES, open_image

    assert max(MODE_BYTES.values()) <= 4
    for mode, fmt in (("1", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("RGB", "PNG"),
                      ("RGBA", "PNG"), ("I;16", "PNG"), ("I;16B", "PNG"), ("L", "JPEG"),
                      ("RGB", "JPEG"), ("CMYK", "JPEG"), ("P", "GIF"), ("RGB", "BMP"),
                      ("RGBA", "WEBP")):
        buf = io.BytesIO()
        Image.new(mode, (4, 4)).save(buf, format=fmt)
        with open_image(buf.getvalue(), max_pixels=16) as img:
            assert img.mode in MODE_BYTES, (mode, fmt, img.mode)
    s = GatewaySettings()
    assert s.image_pixels((1, 28, 28)) == 4_000_000  # at most 16 MB decoded
    assert s.image_pixels((3, 64, 64)) == 4096 * 64 * 64  # 16.8 Mpx, under the 25 Mpx cap
    assert GatewaySettings(max_image_pixels=10_000).image_pixels((1, 28, 28)) == 10_000


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_burst_of_large_legal_images_keeps_memory_bounded(client, good):
    """24 at once, each 1900x1900 RGBA (14 MB decoded): decoding is limited to one per core, so
    the peak memory grows by a few decodes' worth, not 24 (~1 GB here before)."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak mark (Linux)
    base = peak_rss_mb()
    img = png_bytes(Image.new("RGBA", (1900, 1900), (200, 100, 50, 255)))

    async def burst():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/predict", content=img) for _ in range(24)])

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1, statuses
    growth = peak_rss_mb() - base
    cores = usable_cores()
    assert growth < 150 * cores + 100, f"peak RSS grew by {growth:.0f} MB"
    still_serving(client, good)


def ztxt_thumbnail(chunks: int) -> bytes:
    """A 16x16 PNG carrying many compressed text chunks of 1 MB each."""
    base = png_bytes(Image.new("L", (16, 16), 7))
    text = zlib.compress(b"A" * (1 << 20), 9)
    chunk = b"Comment\x00\x00" + text
    extra = b"".join(struct.pack(">I", len(chunk)) + b"zTXt" + chunk +
                     struct.pack(">I", zlib.crc32(b"zTXt" + chunk)) for _ in range(chunks))
    return base[:33] + extra + base[33:]  # after the 8-byte signature and the IHDR chunk


def test_text_chunks_are_bounded_and_health_answers_meanwhile(client, good):
    """A thumbnail small enough to be decoded inline, carrying 60 zTXt chunks of 1 MiB of text
    each: their decompression is cut short at the first chunk (400), instead of 60 MiB of zlib
    on the event loop, and a health check sent meanwhile is answered first."""
    bomb = ztxt_thumbnail(60)
    assert len(bomb) < 64 * 1024  # the inline path

    health, answers = health_during(str(client.base_url), bomb, 8, settle_s=0.01)
    assert health.status_code == 200
    for r in answers:
        assert_json_error(r, 400, "text")
    still_serving(client, good)


def test_health_answers_while_a_large_json_tensor_is_parsed(client, good, monkeypatch):
    """The large body's parse is held until the health check has its answer: off the event
    loop the health check answers meanwhile; on it, the loop would be stuck in the parse and the
    health check would wait for it (the hold gives up after 20 s, so that case fails, not hangs).
    Ordered by events, not by sleeps, so a fast or slow machine gives the same verdict."""
    from sensai.serving.gateway import oip

    parsing, answered = threading.Event(), threading.Event()
    real = oip.decode_request

    def held(*args, **kwargs):
        parsing.set()
        answered.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(oip, "decode_request", held)
    x = np.random.default_rng(0).standard_normal((64, 1, 28, 28)).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()
    assert len(body) > 900_000  # parsed in a thread (over 64 KiB)

    async def race():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as c:
            heavy = asyncio.ensure_future(c.post("/v2/models/sensai/infer", content=body))
            assert await asyncio.to_thread(parsing.wait, 20), "the heavy request never parsed"
            health = await c.get("/v2/health/live")
            done_first = not heavy.done()
            answered.set()
            return health, done_first, await heavy

    health, health_first, heavy = asyncio.run(race())
    assert health.status_code == 200 and heavy.status_code == 200, heavy.text
    assert health_first, "the health check waited for the heavy request"
    np.testing.assert_allclose(
        np.asarray(heavy.json()["outputs"][0]["data"]).reshape(64, -1).sum(1), 1.0, atol=1e-4)


def test_a_compressed_tensor_is_parsed_off_the_event_loop(client, good, monkeypatch):
    """A few KB of gzip can expand to megabytes of JSON: the parse goes to a thread whatever the
    compressed size, while a small plain body is still parsed inline."""
    from sensai.serving.gateway import oip

    where = []
    real = oip.decode_request

    def spy(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            where.append("event loop")
        except RuntimeError:
            where.append("thread")
        return real(*args, **kwargs)

    monkeypatch.setattr(oip, "decode_request", spy)
    zeros = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [64, 1, 28, 28],
                         "data": [0.0] * (64 * 28 * 28)}]}
    body = json.dumps(zeros).encode()
    packed = gzip.compress(body)
    assert len(packed) < 16_000 < 200_000 < len(body)
    r = v2(client, packed, **{"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    x = good["x"][:1]
    small = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                    "data": x.ravel().tolist()}]}).encode()
    assert v2(client, small).status_code == 200
    assert where == ["thread", "event loop"]


# --------------------------------------------------------------------------------------------
# Admission: in-flight limit, queue with a deadline, slow bodies


def test_overload_is_turned_away_with_503_and_retry_after(tiny_artifact, good):
    """Four requests may be in flight, one at a time in the predictor and one waiting, each
    taking ~0.5 s: a burst of 16 gets 200s and fast JSON 503s with Retry-After - never a 504
    or a 500 - and health checks answer throughout; the refusals are counted by their reason
    (the predictor's queue full, or the requests in flight at their limit)."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_requests=4, max_predictions=1, deadline_s=20.0)
    try:
        pred.pool.inject(0, delay="fixed:500ms")

        # A model's readiness is a health check (KServe's probe): answered at the limit too.
        health, responses = health_during(server.url, good["png"], 16, settle_s=0.05,
                                          path="/v2/models/sensai/ready")
        assert health.status_code == 200, health.text
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 503}, statuses
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert r.headers["content-type"].startswith("application/json")
                assert r.json()["status"] == 503
        pred.pool.inject(0, delay=None)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.post("/v1/predict", content=good["png"]).status_code == 200
            text = c.get("/metrics").text
            assert ('sensai_rejected_total{reason="queue_full"}' in text
                    or 'sensai_rejected_total{reason="max_requests"}' in text), text
            assert 'sensai_requests_total{method="POST",route="unadmitted",status="503"}' in text
    finally:
        server.stop()


def test_the_predictor_limit_adapts_to_the_latency_target(tiny_artifact, good):
    """A latency target of 30 ms and a subnet taking 100 ms: under a closed loop of 8 the
    predictor's limit falls from 4 (its ceiling) to 1 and the surplus gets 503s, never a 504;
    every 200 is the answer the idle gateway gave.  Once the subnet is fast again the limit climbs
    back to its ceiling under the same load.  The limit is read off /metrics."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_predictions=4, latency_target_s=0.03, deadline_s=20.0)
    url = server.url

    def limit(metrics: str) -> float:
        return float(re.search(r"^sensai_predictor_limit ([0-9.]+)$", metrics, re.M).group(1))

    async def closed_loop(stop: asyncio.Event, statuses: list, indices: list):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def one():
                while not stop.is_set():
                    r = await c.post("/v1/predict", content=good["png"])
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        indices.append(r.json()["index"])
                    elif r.status_code == 503:
                        assert r.headers["retry-after"] == "1"
                        await asyncio.sleep(0.02)
            await asyncio.gather(*(one() for _ in range(8)))

    def under_load(until) -> tuple[list, list, bool]:
        statuses, indices = [], []

        async def go():
            stop = asyncio.Event()
            load = asyncio.ensure_future(closed_loop(stop, statuses, indices))
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                for _ in range(300):
                    await asyncio.sleep(0.1)
                    if until(limit((await c.get("/metrics")).text)):
                        break
                else:
                    stop.set()
                    await load
                    return False
            stop.set()
            await load
            return True

        return statuses, indices, asyncio.run(go())

    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.post("/v1/predict", content=good["png"]).status_code == 200
            assert limit(c.get("/metrics").text) == 4
            expected = c.post("/v1/predict", content=good["png"]).json()["index"]
            pred.pool.inject(0, delay="fixed:100ms")
            statuses, indices, fell = under_load(lambda lim: lim == 1)
            assert fell, "the limit did not fall"
            assert set(statuses) <= {200, 503} and 503 in statuses, statuses
            assert indices and set(indices) == {expected}
            pred.pool.inject(0, delay=None)
            statuses, _, rose = under_load(lambda lim: lim == 4)
            assert rose, "the limit did not climb back"
            assert set(statuses) <= {200, 503}, statuses
            text = c.get("/metrics").text
            assert 'sensai_rejected_total{reason="queue_full"}' in text
    finally:
        pred.pool.inject(0, delay=None)
        server.stop()


def test_the_deadline_covers_waiting_for_a_prediction_slot(tiny_artifact, good):
    """One prediction at a time, a subnet taking 1.5 s, deadline 1 s: the second request waits
    for the slot the first holds until its own deadline, and is then given only what is left
    of its deadline - counted from its arrival - not a fresh second."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, max_predictions=1, deadline_s=1.0)
    try:
        pred.pool.inject(0, delay="fixed:1500ms")

        async def two():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                first = asyncio.ensure_future(c.post("/v1/predict", content=good["png"]))
                await asyncio.sleep(0.2)
                second = await c.post("/v1/predict", content=good["png"])
                return await first, second

        first, second = asyncio.run(two())
        assert_json_error(first, 504, "deadline")
        err = assert_json_error(second, 504)["error"]
        given = float(re.search(r"within the ([0-9.e-]+) s deadline", err).group(1))
        assert given < 0.9, err
    finally:
        pred.pool.inject(0, delay=None)
        server.stop()


def read_response(s: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one HTTP/1.1 response read off a raw socket."""
    s.settimeout(30)
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(head.split()[1]), json.loads(rest[:length])


def test_slow_bodies_get_408_hold_at_most_half_the_slots_and_block_nobody(tiny_artifact, good):
    """Five slow-loris clients (headers, part of the body, then nothing) against 8 request
    slots: four may wait for their bodies (half the slots) and get a 408 when the body timeout
    runs out, the fifth gets a 503 at once, and a normal request is served meanwhile."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, client_timeout_s=1.0, max_requests=8)
    try:
        slow = []
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                      b"Content-Length: 5000\r\n\r\n" + good["png"][:100])
            slow.append(s)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/predict", content=good["png"])  # served meanwhile
            assert r.status_code == 200, r.text
        answers = [read_response(s) for s in slow]
        for s in slow:
            s.close()
        assert sorted(status for status, _ in answers) == [408] * 4 + [503], answers
        for status, body in answers:
            assert body["status"] == status
            if status == 408:
                assert "client timeout of 1 s" in body["error"], body
            else:
                assert "sending their bodies" in body["error"], body
    finally:
        server.stop()


def test_a_late_event_loop_sheds_new_requests_until_it_catches_up():
    """Requests wait on the event loop before any counter sees them; the loop's lag is measured
    and, while it is over the limit, new requests are turned away (and it counts against the
    deadline of those admitted)."""
    adm = Admission(GatewaySettings(max_requests=10, max_predictions=1, client_timeout_s=1,
                                    deadline_s=1, max_loop_lag_s=0.05))

    async def go():
        loop = asyncio.get_running_loop()
        adm.start()
        await asyncio.sleep(0.1)
        ticket = adm.admit(loop.time(), False)
        assert isinstance(ticket, Ticket)
        ticket.release()
        time.sleep(0.4)  # something held the loop
        await asyncio.sleep(0.025)  # the lag timer, overdue, runs first
        assert adm.lag > 0.05  # 0.2 s smoothed
        assert adm.admit(loop.time(), False) == "loop_lag"
        # What HTTP and gRPC tell the client, and its deadline: the lag counts against it.
        assert adm.messages["loop_lag"].startswith("the gateway is behind by")
        assert adm.deadline(loop.time()) < loop.time() + 1 - 0.05
        await asyncio.sleep(0.5)  # quiet again
        ticket = adm.admit(loop.time(), False)
        assert adm.lag < 0.05 and isinstance(ticket, Ticket)
        ticket.release()
        await adm.stop()

    asyncio.run(go())


def test_the_gateways_own_collection_is_not_taken_for_an_overload():
    """After a model is built or let go the gateway collects its heap once, on the event loop
    (sensai.serving.gateway.heap.settle); the loop is late by that much, but it is no overload: the
    requests right after it are admitted."""
    adm = Admission(GatewaySettings(max_requests=10, max_predictions=1, client_timeout_s=1,
                                    deadline_s=1, max_loop_lag_s=0.05))
    # A heap whose walk takes well over the 0.12 s asserted below, on a faster machine too.
    alive = [[i] for i in range(4_000_000)]

    async def go():
        adm.start()
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        heap.settle()
        took = time.perf_counter() - t0
        seen = []  # the lag as requests would see it, before and after the overdue timer
        for _ in range(20):
            await asyncio.sleep(0.005)
            seen.append(adm.lag)
        assert took > 0.12, took  # half of it, the smoothed lag, would be over the limit
        ticket = adm.admit(asyncio.get_running_loop().time(), False)
        assert max(seen) < 0.05 and isinstance(ticket, Ticket), seen
        ticket.release()
        await adm.stop()

    try:
        asyncio.run(go())
    finally:
        del alive
        gc.unfreeze()


def test_a_short_queue_turns_the_surplus_away_at_once():
    """As many requests may wait for the predictor as it holds (here one each): the next one is
    refused at admission, at once, before its body is read and its image decoded; what was
    admitted is served, and every slot is given back."""
    adm = Admission(GatewaySettings(max_requests=10, max_predictions=1, client_timeout_s=1,
                                    deadline_s=5))

    async def go():
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        served = []
        first = adm.admit(loop.time(), True)  # predictions
        second = adm.admit(loop.time(), True)
        assert isinstance(first, Ticket) and isinstance(second, Ticket)

        async def queued():
            async with adm.prediction(second, deadline):
                served.append(True)

        async with adm.prediction(first, deadline):
            waiter = asyncio.ensure_future(queued())
            await asyncio.sleep(0.01)
            assert adm.waiting == 1 and not served
            assert adm.admit(loop.time(), True) == "queue_full"
            assert "no place for another request" in adm.messages["queue_full"]
            other = adm.admit(loop.time(), False)  # a request that is no prediction
            assert isinstance(other, Ticket)
            other.release()
        await waiter
        assert served == [True] and adm.waiting == 0
        for ticket in (first, second):
            ticket.release()
        assert (adm.requests, adm.receiving, adm.predictor.active, adm.predictor.reserved) \
            == (0, 0, 0, 0)

    asyncio.run(go())


def test_a_control_routes_body_is_read_within_the_client_timeout(tiny_artifact):
    """Shared-memory registration and the repository API read a JSON body (one function,
    ``json_body``) as a prediction reads its own: one that never arrives is answered 408, not
    waited for; a client that leaves mid-body is no server error.  (The repository API of a
    gateway serving one artifact refuses before it reads: its body is read the same way.)"""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    server = start_gateway(pred, client_timeout_s=1.0)
    try:
        request = (b"POST /v2/systemsharedmemory/region/a/register HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"key\"")
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(request)
            status, body = read_response(s)
        assert status == 408 and "client timeout of 1 s" in body["error"], body
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(request)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.get("/v2/health/ready").status_code == 200

            def errors() -> list[str]:
                return [line for line in c.get("/metrics").text.splitlines()
                        if line.startswith("sensai_request_errors_total")]

            deadline = time.monotonic() + 10
            while not any("ClientDisconnect" in line for line in errors()):
                assert time.monotonic() < deadline, errors()
                time.sleep(0.1)
            assert not [line for line in errors() if "internal" in line], errors()
    finally:
        server.stop()

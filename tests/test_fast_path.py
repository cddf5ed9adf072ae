"""The one HTTP prediction path answers alike whichever way the server reaches it.

The gateway's middleware dispatches ``/v1/predict`` and ``.../infer`` itself, past FastAPI's
router.  Two gateways over one predictor: one under uvicorn's httptools protocol, which starts
a prediction on the lean cycle (past FastAPI's stack, head and body in one write), one under
uvicorn's h11 protocol (FastAPI's whole stack and uvicorn's own cycle, as where httptools is
missing or behind Serve's proxy); the same good and bad requests to each get the same status,
headers and body (timings apart), and count the same in the metrics.  Real uvicorn on
127.0.0.1, real subnets, real images.
"""

from __future__ import annotations

import gzip
import json
import re

import httpx
import numpy as np
import pytest

from sensai.data import normalize
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.server import BackgroundServer
from sensai.serving.launch.build import build_predictor
from tests.helpers import png, sample_images

MAX_BODY = 64 * 1024
VARYING = {"date", "content-length"}  # content-length varies with the timings in the body


@pytest.fixture(scope="module")
def pair(tiny_artifact):
    predictor = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
    servers = [BackgroundServer(create_app(
        predictor, GatewaySettings(max_body_bytes=MAX_BODY, max_request_rows=4),
        close_predictor=False)) for _ in range(2)]
    servers[1].server.config.http = "h11"  # read when the server starts
    for s in servers:
        s.start()
    assert [s.server.config.http_protocol_class.__name__ for s in servers] == [
        "BoundedHttpProtocol", "H11Protocol"]
    yield servers
    for s in servers:
        s.stop()
    predictor.shutdown()


def v2_binary(x: np.ndarray, outputs=None) -> tuple[bytes, dict]:
    header = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                          "parameters": {"binary_data_size": x.nbytes}}]}
    if outputs is not None:
        header["outputs"] = outputs
    head = json.dumps(header).encode()
    return head + x.astype("<f4").tobytes(), {"Inference-Header-Content-Length": str(len(head))}


def requests_to_compare(fmnist_test, spec) -> list[tuple[str, str, dict]]:
    """(method, path, httpx keyword arguments): good requests, then bad ones of every kind."""
    _, images, _ = sample_images(fmnist_test, 2)
    image = png(images[0])
    x = normalize(images[:2], spec).numpy()
    binary, binary_headers = v2_binary(x)
    ranked, ranked_headers = v2_binary(x[:1], [{"name": "scores",
                                                "parameters": {"classification": 3}}])
    as_json = json.dumps({"inputs": [{"name": "input", "datatype": "FP32",
                                      "shape": [1, *x.shape[1:]],
                                      "data": x[0].ravel().tolist()}]}).encode()
    wrong_shape, wrong_headers = v2_binary(x[:, :, :20])
    too_many, many_headers = v2_binary(np.zeros((5, *x.shape[1:]), np.float32))
    return [
        ("POST", "/v1/predict", {"content": image}),
        ("POST", "/v1/predict?top_k=3&allow_partial=true", {"content": image}),
        ("POST", "/v1/predict", {"files": {"image": ("a.png", image, "image/png")}}),
        ("POST", "/v1/predict?model=sensai&version=1", {"content": image}),
        ("POST", "/v2/models/sensai/infer", {"content": binary, "headers": binary_headers}),
        ("POST", "/v2/models/sensai/versions/1/infer",
         {"content": ranked, "headers": ranked_headers}),
        ("POST", "/v2/models/sensai/infer?version=1", {"content": as_json}),
        ("POST", "/v2/models/sensai/infer",
         {"content": gzip.compress(as_json), "headers": {"Content-Encoding": "gzip"}}),
        # bad ones
        ("POST", "/v1/predict", {"content": b""}),
        ("POST", "/v1/predict", {"content": b"not an image at all"}),
        ("POST", "/v1/predict", {"content": image[:60]}),
        ("POST", "/v1/predict", {"data": {"image": "x"}}),
        ("POST", "/v1/predict", {"files": {"other": ("a.png", image, "image/png")}}),
        ("POST", "/v1/predict?top_k=0", {"content": image}),
        ("POST", "/v1/predict?top_k=11", {"content": image}),
        ("POST", "/v1/predict?top_k=many", {"content": image}),
        ("POST", "/v1/predict?model=nope", {"content": image}),
        ("POST", "/v1/predict?version=7", {"content": image}),
        ("POST", "/v1/predict", {"content": b"\0" * (MAX_BODY + 1)}),
        ("GET", "/v1/predict", {}),
        ("PUT", "/v2/models/sensai/infer", {"content": as_json}),
        ("POST", "/v1/predict/", {"content": image}),
        ("POST", "/v2/models/nope/infer", {"content": binary, "headers": binary_headers}),
        ("POST", "/v2/models/sensai/versions/9/infer", {"content": as_json}),
        ("POST", "/v2/models//infer", {"content": as_json}),
        ("POST", "/v2/models/sensai/versions//infer", {"content": as_json}),
        ("POST", "/v2/models/sensai/infer", {"content": b"{not json"}),
        ("POST", "/v2/models/sensai/infer", {"content": wrong_shape, "headers": wrong_headers}),
        ("POST", "/v2/models/sensai/infer", {"content": too_many, "headers": many_headers}),
        ("POST", "/v2/models/sensai/infer", {"content": binary,
                                             "headers": {"Inference-Header-Content-Length":
                                                         "99999"}}),
        ("POST", "/v2/models/sensai/infer",
         {"content": as_json, "headers": {"Content-Encoding": "br"}}),
        ("POST", "/v2/models/sensai/infer",
         {"content": b"\x1f\x8b junk", "headers": {"Content-Encoding": "gzip"}}),
    ]


def comparable(response: httpx.Response) -> tuple:
    """Status, headers and body without what differs between two answers to one request:
    the timings (and so the length), the date, the server's own port."""
    port = f":{response.request.url.port}/"
    headers = {k: v.replace(port, ":PORT/") for k, v in response.headers.items()
               if k not in VARYING}
    body = response.content
    length = response.headers.get("inference-header-content-length")
    if length is not None:  # a binary v2 answer: its JSON header, then the tensors' bytes
        head, tail = json.loads(body[:int(length)]), body[int(length):]
        del headers["inference-header-content-length"]
        head["parameters"].pop("timings_ms")
        return response.status_code, headers, head, tail
    if response.headers.get("content-type", "").startswith("application/json"):
        parsed = json.loads(body)
        if isinstance(parsed, dict):
            parsed.pop("timings_ms", None)
            parsed.get("parameters", {}).pop("timings_ms", None)
        return response.status_code, headers, parsed
    return response.status_code, headers, body


def request_counts(metrics: str) -> dict[str, float]:
    """The requests and errors counters by label set (durations vary, so not those)."""
    pattern = re.compile(r"^(sensai_(?:requests|request_errors)_total\{.*\}) (\S+)$", re.M)
    return {k: float(v) for k, v in pattern.findall(metrics)}


def test_the_lean_cycle_answers_as_fastapis_stack(pair, fmnist_test, tiny_artifact):
    from sensai.artifact import load_artifact

    spec = load_artifact(tiny_artifact).spec
    fast, routed = pair
    with httpx.Client(base_url=fast.url, timeout=60) as a, \
            httpx.Client(base_url=routed.url, timeout=60) as b:
        for i, (method, path, kw) in enumerate(requests_to_compare(fmnist_test, spec)):
            headers = {**kw.pop("headers", {}), "x-request-id": f"same-{i}"}
            answers = [c.request(method, path, headers=headers, **kw) for c in (a, b)]
            assert comparable(answers[0]) == comparable(answers[1]), (method, path)
            assert answers[0].headers["x-request-id"] == f"same-{i}"
        statuses = {c.request("POST", "/v1/predict", content=b"").status_code for c in (a, b)}
        assert statuses == {400}
        counts = [request_counts(c.get("/metrics").text) for c in (a, b)]
    assert counts[0] == counts[1]
    # Both kinds of answer were compared, and the counters name the routes as FastAPI does.
    labels = [k for k in counts[0] if k.startswith("sensai_requests_total")]
    assert any('route="/v2/models/{model_name}/versions/{version}/infer"' in k
               and 'status="200"' in k for k in labels)
    assert any('route="/v1/predict"' in k and 'status="422"' in k for k in labels)
    assert any('route="/v1/predict"' in k and 'status="415"' in k for k in labels)
    assert any(k.startswith("sensai_request_errors_total") and 'reason="InputError"' in k
               for k in counts[0])


def test_predictions_do_not_pass_through_fastapis_router(pair, fmnist_test):
    """With the routes gone from FastAPI's router, the gateway's own dispatch still answers
    them, on either protocol (so it is the one that answered above), and every other route is
    FastAPI's."""
    _, images, _ = sample_images(fmnist_test, 1)
    for server in pair:
        router = server.server.config.app.router
        kept = list(router.routes)
        router.routes[:] = [r for r in kept if getattr(r, "path", "") not in
                            ("/v1/predict", "/v2/models/{model_name}/infer")]
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                assert c.post("/v1/predict", content=png(images[0])).status_code == 200
                assert c.get("/v2/health/live").json() == {"live": True}
                assert c.get("/v1/predict").status_code == 404  # FastAPI's: the route is gone
        finally:
            router.routes[:] = kept


def test_predictions_do_not_pass_through_fastapis_stack(pair, fmnist_test, monkeypatch):
    """The HTTP protocol answers the prediction routes on its lean cycle: FastAPI's app (and
    every middleware FastAPI puts around the gateway's) is never called for them; it is for
    every other route."""
    from fastapi import FastAPI

    fast, _ = pair
    _, images, _ = sample_images(fmnist_test, 1)
    called = []
    entered = FastAPI.__call__

    async def counted(self, scope, receive, send):
        called.append(scope.get("path"))
        await entered(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counted)
    with httpx.Client(base_url=fast.url, timeout=60) as c:
        assert c.post("/v1/predict", content=png(images[0])).status_code == 200
        assert c.post("/v1/predict?top_k=0", content=png(images[0])).status_code == 422
        assert c.post("/v2/models/sensai/infer", content=b"{not json").status_code == 400
        assert c.get("/v2/health/live").status_code == 200
    assert called == ["/v2/health/live"]


def read_answers(sock, count: int) -> list[tuple[int, dict, bytes]]:
    """``count`` HTTP/1.1 answers read off ``sock``, in order: (status, headers, body)."""
    data, answers = b"", []
    while len(answers) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:])
            length = int(headers["content-length"])
            if len(rest) >= length:
                answers.append((int(lines[0].split()[1]), headers, rest[:length]))
                data = rest[length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {len(answers)} answers"
        data += chunk
    return answers


@pytest.mark.parametrize("which", ["lean", "h11"])
def test_pipelined_requests_are_answered_in_order(pair, fmnist_test, which):
    """Requests sent back to back on one connection, before any answer (HTTP/1.1 pipelining),
    the predictions on the lean cycle and the others on FastAPI's (or all on FastAPI's stack
    under h11): every answer comes, in the order asked."""
    import socket

    fast = pair[0] if which == "lean" else pair[1]
    _, images, _ = sample_images(fmnist_test, 2)
    image = png(images[0])
    bad = b"not an image"

    def post(path: str, body: bytes, rid: str) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nhost: x\r\nx-request-id: {rid}\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    asked = (post("/v1/predict", image, "p1")
             + b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nx-request-id: h1\r\n\r\n"
             + post("/v1/predict?top_k=2", bad, "p2") + post("/v1/predict", image, "p3"))
    with socket.create_connection((fast.host, fast.port), timeout=60) as sock:
        sock.sendall(asked)
        answers = read_answers(sock, 4)
    assert [(status, headers["x-request-id"]) for status, headers, _ in answers] == [
        (200, "p1"), (200, "h1"), (415, "p2"), (200, "p3")]
    assert json.loads(answers[0][2])["label"] == json.loads(answers[3][2])["label"]
    assert json.loads(answers[1][2]) == {"live": True}


class Recorder:
    """A transport that keeps what is written to it."""

    def __init__(self):
        self.writes, self.closed = [], False

    def write(self, data):
        self.writes.append(bytes(data))

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def lean_cycle(transport: Recorder, keep_alive: bool, done: list):
    import asyncio
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl

    from sensai.serving.gateway.lean_cycle import LeanCycle

    log = logging.getLogger("test")
    return LeanCycle(scope={"type": "http", "method": "POST", "path": "/v1/predict"},
                     transport=transport, flow=FlowControl(transport), logger=log,
                     access_logger=log, access_log=False,
                     default_headers=[(b"server", b"uvicorn")], message_event=asyncio.Event(),
                     expect_100_continue=False, keep_alive=keep_alive,
                     on_response=lambda: done.append(True))


@pytest.mark.parametrize("keep_alive", [True, False])
def test_a_lean_answer_leaves_in_one_write(keep_alive):
    """The lean cycle writes an answer's head with its body, once, with uvicorn's connection
    rules; an answer without a declared length, or in pieces, is refused as the bug it is."""
    import asyncio

    async def answer(cycle, headers, bodies):
        await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
        for body, more in bodies:
            await cycle.send({"type": "http.response.body", "body": body, "more_body": more})

    transport, done = Recorder(), []
    cycle = lean_cycle(transport, keep_alive, done)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    asyncio.run(answer(cycle, headers, [(b"{}", False)]))
    assert transport.writes == [b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: "
                                b"application/json\r\ncontent-length: 2\r\n"
                                + (b"" if keep_alive else b"connection: close\r\n")
                                + b"\r\n{}"]
    assert cycle.response_complete and done == [True] and transport.closed is not keep_alive
    with pytest.raises(RuntimeError, match="after response already completed"):
        asyncio.run(cycle.send({"type": "http.response.body", "body": b""}))

    for headers, bodies, why in [
            ([(b"content-type", b"text/plain")], [(b"hi", False)], "declares"),
            ([(b"content-length", b"4")], [(b"hi", True), (b"hi", False)], "one body"),
            ([(b"content-length", b"4")], [(b"hi", False)], "content-length"),
            ([(b"x-id", b"a\r\nb")], [], "invalid")]:
        transport, done = Recorder(), []
        with pytest.raises(RuntimeError, match=why):
            asyncio.run(answer(lean_cycle(transport, True, done), headers, bodies))
        assert transport.writes == [] and done == []

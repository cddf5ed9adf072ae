"""Every kind of bad input gets a clear 4xx JSON answer, and the next good request still works.

Also: a subnet that fails gives 503 and one that misses the deadline 504, naming the subnet,
without hanging the gateway.  All against uvicorn on 127.0.0.1 with real subnets.
"""

from __future__ import annotations

import io
import json
import os
import struct
import time
import zlib
from dataclasses import replace

import httpx
import numpy as np
import pytest

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.export import export_onnx
from sensai.fsutil import sha256_file
from sensai.models import create_model
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.engine.plan import class_parallel_plan
from sensai.serving.engine.predictor import ClassParallelPredictor
from sensai.serving.launch.build import build_predictor
from sensai.serving.transports.threads import Threads
from sensai.serving.workers.runners import runner_specs
from tests.helpers import png, sample_images, start_gateway

MAX_BODY = 256 * 1024
MAX_PIXELS = 4_000_000


@pytest.fixture(scope="module")
def gateway(tiny_artifact):
    server = start_gateway(build_predictor(tiny_artifact, GatewaySettings(device="cpu")),
                           max_body_bytes=MAX_BODY, max_image_pixels=MAX_PIXELS, max_request_rows=8)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def good_png(fmnist_test):
    _, images, _ = sample_images(fmnist_test, 1)
    return png(images[0])


@pytest.fixture(scope="module")
def good_tensor(fmnist_test, fmnist_spec):
    _, images, _ = sample_images(fmnist_test, 2)
    return normalize(images, fmnist_spec).numpy()


def assert_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) >= {"error", "status", "request_id"}
    assert body["status"] == status
    for f in fragments:
        assert f.lower() in body["error"].lower(), body["error"]
    return body


def assert_still_serving(client, good_png):
    r = client.post("/v1/predict", content=good_png)
    assert r.status_code == 200, r.text
    assert len(r.json()["predictions"]) == 5


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_header_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width x height`` with almost no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def solid_png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height), 128).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# /v1/predict


def test_not_an_image(client, good_png):
    assert_error(client.post("/v1/predict", content=b"hello, I am text"), 415, "not a supported image")
    assert_still_serving(client, good_png)


def test_truncated_png(client, good_png):
    assert_error(client.post("/v1/predict", content=good_png[: len(good_png) // 2]), 400,
                 "truncated")
    assert_still_serving(client, good_png)


def test_truncated_jpeg(client, good_png, fmnist_test):
    from PIL import Image

    _, images, _ = sample_images(fmnist_test, 1)
    buf = io.BytesIO()
    Image.fromarray(images[0, 0].numpy(), "L").resize((200, 200)).save(buf, format="JPEG")
    data = buf.getvalue()
    assert_error(client.post("/v1/predict", content=data[: len(data) // 3]), 400, "truncated")
    assert_still_serving(client, good_png)


def test_zero_bytes(client, good_png):
    assert_error(client.post("/v1/predict", content=b""), 400, "empty")
    assert_error(client.post("/v1/predict", files={"image": ("e.png", b"", "image/png")}), 400,
                 "empty")
    assert_still_serving(client, good_png)


def test_an_encoded_image_is_refused_with_415(client, good_png):
    """An image travels as it is; only the v2 route's tensors take gzip or deflate."""
    import gzip

    for enc, body in (("br", good_png), ("gzip", gzip.compress(good_png))):
        r = client.post("/v1/predict", content=body, headers={"content-encoding": enc})
        assert_error(r, 415, f"Content-Encoding '{enc}'", "as they are")
    r = client.post("/v1/predict", content=good_png, headers={"content-encoding": "identity"})
    assert r.status_code == 200, r.text
    assert_still_serving(client, good_png)


def test_multipart_without_image_field(client, good_png):
    r = client.post("/v1/predict", files={"picture": ("x.png", good_png, "image/png")})
    assert_error(r, 400, "no 'image' field")
    r = client.post("/v1/predict", data={"a": "b"})
    assert_error(r, 415, "multipart")
    assert_still_serving(client, good_png)


def test_multipart_beyond_the_parsers_limits_is_a_400(client, good_png):
    """More form fields than the route reads, a second file: refused with the parser's reason,
    never a 500, whichever HTTP path parsed it."""
    fields = {f"f{i}": str(i) for i in range(10)}
    r = client.post("/v1/predict", data=fields, files={"image": ("x.png", good_png, "image/png")})
    assert_error(r, 400, "malformed multipart", "fields")
    files = [("image", ("x.png", good_png, "image/png")), ("other", ("y.png", good_png,
                                                                     "image/png"))]
    assert_error(client.post("/v1/predict", files=files), 400, "malformed multipart", "files")
    assert_still_serving(client, good_png)


def test_decompression_bomb_real_pixels(client, good_png):
    data = solid_png(3000, 3000)  # 9 M pixels in a few KB
    assert len(data) < MAX_BODY
    assert_error(client.post("/v1/predict", content=data), 413, "3000x3000", "limit")
    assert_still_serving(client, good_png)


def test_decompression_bomb_forged_header(client, good_png):
    # 4 G pixels claimed: refused from the header, nothing decoded (PIL's own bomb guard
    # or ours, both 413).
    assert_error(client.post("/v1/predict", content=huge_header_png(65535, 65535)), 413, "pixels")
    assert_error(client.post("/v1/predict", content=huge_header_png(3000, 3000)), 413, "pixels")
    assert_still_serving(client, good_png)


def test_body_over_the_limit(client, good_png):
    big = os.urandom(MAX_BODY + 1)
    assert_error(client.post("/v1/predict", content=big), 413, "limit")
    assert_still_serving(client, good_png)


def test_chunked_body_over_the_limit(client, good_png):
    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(8):
            yield os.urandom(MAX_BODY // 4)

    assert_error(client.post("/v1/predict", content=chunks()), 413, "limit")
    r = client.post("/v1/predict", files={"image": ("big.png", os.urandom(MAX_BODY), "image/png")})
    assert_error(r, 413, "limit")
    assert_still_serving(client, good_png)


def test_bad_top_k(client, good_png):
    assert_error(client.post("/v1/predict", params={"top_k": 0}, content=good_png), 422, "top_k")
    assert_error(client.post("/v1/predict", params={"top_k": 11}, content=good_png), 422, "top_k")
    assert_error(client.post("/v1/predict", params={"top_k": "x"}, content=good_png), 422, "top_k")
    assert_still_serving(client, good_png)


def test_unknown_route_and_method(client, good_png):
    assert_error(client.get("/v1/nothing"), 404, "not found")
    assert_error(client.get("/v1/predict"), 405, "method")
    assert_still_serving(client, good_png)


# --------------------------------------------------------------------------------------------
# KServe v2 infer


def _infer_json(client, body, model="sensai", **kw):
    return client.post(f"/v2/models/{model}/infer", content=json.dumps(body), **kw)


def _tensor(x, name="input", datatype="FP32"):
    return {"name": name, "datatype": datatype, "shape": list(x.shape), "data": x.ravel().tolist()}


def test_v2_good_request_works(client, good_tensor):
    r = _infer_json(client, {"inputs": [_tensor(good_tensor)]})
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["scores"]["shape"] == [2, 10] and len(out["scores"]["data"]) == 20


def test_v2_wrong_shape(client, good_tensor, good_png):
    x = good_tensor[:, :, :27, :]
    assert_error(_infer_json(client, {"inputs": [_tensor(x)]}), 400, "shape", "[batch, 1, 28, 28]")
    x = good_tensor[0]
    assert_error(_infer_json(client, {"inputs": [_tensor(x)]}), 400, "shape")
    assert_still_serving(client, good_png)


def test_v2_wrong_dtype(client, good_tensor, good_png):
    t = _tensor(good_tensor.astype(np.float64), datatype="FP64")
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "must be FP32", "FP64")
    t = _tensor(good_tensor, datatype="BYTES")
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "unsupported datatype")
    t = _tensor(good_tensor)
    t["data"] = ["a"] * len(t["data"])
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "FP32 numbers")
    assert_still_serving(client, good_png)


def test_v2_element_count_mismatch(client, good_tensor, good_png):
    t = _tensor(good_tensor)
    t["data"] = t["data"][:-1]
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "1568 elements", "1567")
    # So few values that the body could not hold the shape's: said as such.
    t["data"] = [0.0, 1.0]
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "is its data complete?")
    # Binary: the size does not match the shape.
    head = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 1, 28, 28],
                        "parameters": {"binary_data_size": 784 * 4}}]}
    js = json.dumps(head).encode()
    raw = good_tensor[0].tobytes()
    r = client.post("/v2/models/sensai/infer", content=js + raw,
                    headers={"Inference-Header-Content-Length": str(len(js))})
    assert_error(r, 400, "needs 6272 bytes", "binary_data_size is 3136")
    # Binary: sizes add up to less than the body.
    head["inputs"][0]["parameters"]["binary_data_size"] = good_tensor.nbytes
    js = json.dumps(head).encode()
    r = client.post("/v2/models/sensai/infer", content=js + good_tensor.tobytes() + b"xx",
                    headers={"Inference-Header-Content-Length": str(len(js))})
    assert_error(r, 400, "2 bytes of binary data")
    # Binary data without the header-length header.
    r = client.post("/v2/models/sensai/infer", content=js + good_tensor.tobytes())
    assert_error(r, 400, "not valid JSON", "Inference-Header-Content-Length")
    assert_still_serving(client, good_png)


def test_v2_nan_and_inf(client, good_tensor, good_png):
    x = good_tensor.copy()
    x[0, 0, 3, 3] = np.nan
    body = json.dumps({"inputs": [_tensor(x)]})  # Python writes NaN, which JSON clients do send
    assert "NaN" in body
    r = client.post("/v2/models/sensai/infer", content=body)
    assert_error(r, 400, "NaN or infinite")
    x = good_tensor.copy()
    x[1, 0, 0, 0] = np.inf
    head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    r = client.post("/v2/models/sensai/infer", content=head + x.tobytes(),
                    headers={"Inference-Header-Content-Length": str(len(head))})
    assert_error(r, 400, "NaN or infinite")
    assert_still_serving(client, good_png)


def test_v2_unknown_model_version_input_output(client, good_tensor, good_png):
    body = {"inputs": [_tensor(good_tensor)]}
    assert_error(_infer_json(client, body, model="resnet"), 404, "unknown model 'resnet'")
    r = client.post("/v2/models/sensai/versions/7/infer", content=json.dumps(body))
    assert_error(r, 404, "no version '7'")
    assert_error(client.get("/v2/models/resnet"), 404, "unknown model")
    assert_error(client.get("/v2/models/resnet/ready"), 404, "unknown model")
    assert_error(_infer_json(client, {"inputs": [_tensor(good_tensor, name="x")]}), 400,
                 "unknown input 'x'")
    assert_error(_infer_json(client, {**body, "outputs": [{"name": "logits"}]}), 400,
                 "unknown output 'logits'")
    assert_still_serving(client, good_png)


def test_v2_malformed_requests(client, good_tensor, good_png):
    assert_error(client.post("/v2/models/sensai/infer", content=b"{not json"), 400, "not valid JSON")
    assert_error(client.post("/v2/models/sensai/infer", content=b""), 400, "empty")
    assert_error(_infer_json(client, {"inputs": []}), 400, "non-empty list")
    assert_error(_infer_json(client, [1, 2]), 400, "JSON object")
    t = _tensor(good_tensor)
    t["shape"] = [2, 1, 28, "28"]
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "shape")
    big = np.zeros((9, 1, 28, 28), np.float32)  # max_request_rows is 8 here
    assert_error(_infer_json(client, {"inputs": [_tensor(big)]}), 400, "batch size", "8")
    r = client.post("/v2/models/sensai/infer", content=b"x" * 10,
                    headers={"content-encoding": "br"})
    assert_error(r, 415, "Content-Encoding")
    r = client.post("/v2/models/sensai/infer", content=b"not gzip",
                    headers={"content-encoding": "gzip"})
    assert_error(r, 400, "gzip")
    # A gzip bomb: 64 MB of zeros in ~64 KB, refused while decompressing.
    bomb = zlib.compressobj(wbits=31)
    data = bomb.compress(b"\0" * (64 << 20)) + bomb.flush()
    assert len(data) < MAX_BODY
    r = client.post("/v2/models/sensai/infer", content=data, headers={"content-encoding": "gzip"})
    assert_error(r, 413, "decompresses to more than")
    assert_still_serving(client, good_png)


# --------------------------------------------------------------------------------------------
# Subnets that fail or are too slow


@pytest.fixture(scope="module")
def faulty_gateway(tiny_artifact, tmp_path_factory):
    """Subnet 2 is an ONNX network for 3-channel images: ORT rejects our input at run time."""
    wrong = tmp_path_factory.mktemp("wrong") / "rgb.onnx"
    export_onnx(create_model("fmnist_cnn", 3, 3), (3, 28, 28), wrong)
    art = load_artifact(tiny_artifact)
    specs = runner_specs(art, device="cpu")
    specs[2] = replace(specs[2], onnx_path=str(wrong), onnx_sha256=sha256_file(wrong),
                       warmup=False)
    settings = GatewaySettings(device="cpu", deadline_s=10)
    plan = class_parallel_plan(art, settings, specs=specs)
    server = start_gateway(ClassParallelPredictor(art, plan, Threads()), deadline_s=10)
    yield server
    server.stop()


def test_failing_subnet_gives_503_naming_it(faulty_gateway, good_tensor):
    with httpx.Client(base_url=faulty_gateway.url, timeout=30) as c:
        for _ in range(2):  # and again: the gateway keeps answering
            r = _infer_json(c, {"inputs": [_tensor(good_tensor)]})
            body = assert_error(r, 503, "subnet_02", "worker_02")
            assert body["subnet"] == "subnet_02" and body["missing_classes"]
        text = c.get("/metrics").text
        assert 'sensai_subnet_errors_total{kind="failed",model="sensai",subnet="subnet_02",version="1"} 2.0' in text


def test_slow_subnet_gives_504_naming_it_and_no_hang(tiny_artifact, good_tensor):
    """Healthy subnets except a slow one: 504 at the deadline, then normal service."""
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu", deadline_s=1.5))
    server = start_gateway(pred)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            pred.pool.inject(3, delay="fixed:20s")
            t0 = time.monotonic()
            r = _infer_json(c, {"inputs": [_tensor(good_tensor)]})
            waited = time.monotonic() - t0
            pred.pool.inject(3, delay=None)
            body = assert_error(r, 504, "subnet_03", "deadline")
            assert body["subnet"] == "subnet_03"
            assert waited < 15  # answered at the deadline, not when the subnet finished
            # The late request is dropped by its worker, which serves the next one at once.
            r = _infer_json(c, {"inputs": [_tensor(good_tensor)]})
            assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_v2_fields_of_the_wrong_kind_are_refused_with_their_reason(client, good_tensor, good_png):
    """A datatype that is no string, a shape entry that is no integer, a true/false parameter
    sent as a string, data given twice: each a 400 naming it, never a 500 or a guess."""
    for datatype in (["FP32"], {"a": 1}, 32):
        t = _tensor(good_tensor, datatype=datatype)
        assert_error(_infer_json(client, {"inputs": [t]}), 400, "unsupported datatype")
    t = _tensor(good_tensor)
    t["shape"] = [2.0, 1, 28, 28]
    assert_error(_infer_json(client, {"inputs": [t]}), 400, "shape", "got 2.0")
    body = {"inputs": [_tensor(good_tensor)], "parameters": {"binary_data_output": "false"}}
    assert_error(_infer_json(client, body), 400, "binary_data_output", "true or false")
    body = {"inputs": [_tensor(good_tensor)],
            "outputs": [{"name": "scores", "parameters": {"binary_data": "false"}}]}
    assert_error(_infer_json(client, body), 400, "binary_data", "true or false")
    body["outputs"][0]["parameters"]["binary_data"] = False
    r = _infer_json(client, body)
    assert r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == 20, r.text
    # Data in the JSON and binary_data_size too: which one was meant is not guessed.
    t = _tensor(good_tensor)
    t["parameters"] = {"binary_data_size": good_tensor.nbytes}
    head = json.dumps({"inputs": [t]}).encode()
    r = client.post("/v2/models/sensai/infer", content=head + good_tensor.tobytes(),
                    headers={"Inference-Header-Content-Length": str(len(head))})
    assert_error(r, 400, "both in the JSON")
    t["parameters"] = {"binary_data_size": good_tensor.nbytes}
    del t["data"]
    head = json.dumps({"inputs": [t]}).encode()
    r = client.post("/v2/models/sensai/infer", content=head + good_tensor.tobytes(),
                    headers=[("Inference-Header-Content-Length", str(len(head))),
                             ("Inference-Header-Content-Length", "7")])
    assert_error(r, 400, "2 Inference-Header-Content-Length headers")
    assert_still_serving(client, good_png)


def test_an_image_sent_as_a_multipart_text_field_is_read_as_its_bytes(client, good_png):
    """``curl -F "image=<FILE"`` sends the image as a field without a filename, which the
    multipart parser hands over as text: its bytes are what is decoded, as for a file part."""
    as_file = client.post("/v1/predict", files={"image": ("x.png", good_png, "image/png")})
    boundary = "sensai-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\n".encode()
            + good_png + f"\r\n--{boundary}--\r\n".encode())
    as_text = client.post("/v1/predict", content=body,
                          headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert as_file.status_code == as_text.status_code == 200, as_text.text
    assert as_text.json()["predictions"] == as_file.json()["predictions"]

"""KServe v2 over gRPC (``serving/gateway/grpc_server.py``), called through the unchanged
``tritonclient.grpc`` client (and, for what that client refuses to send, the raw stub it ships).

Real servers on 127.0.0.1 (the gateway's app under uvicorn, its gRPC server on the same event
loop), the real ONNX subnets of ``tiny_artifact`` on thread workers, real Fashion-MNIST images:
answers must equal offline evaluation's; bad input gets the right status code and a message
saying what is wrong, and the server keeps serving.  No timing is asserted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.errors import SensaiError
from sensai.serving.core.faults import Faults
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.server import BackgroundServer
from sensai.serving.launch.build import build_predictor
from tests.helpers import (free_port, offline_scores, sample_images, server_process, stop_server,
                           wait_for_server, wait_until)
from tests.helpers import serve_with_grpc as serve

MAX_BODY = 256 * 1024  # a batch of 16 images is 50 KB; 100 are over the limit


@pytest.fixture(scope="module")
def gateway(tiny_artifact):
    # A busy test machine can hold this process's event loop up for a moment; the loop-lag
    # shed (tested in test_hostile.py) must not turn these calls into 503s meanwhile.
    server, target = serve(build_predictor(tiny_artifact, GatewaySettings(device="cpu")),
                           max_body_bytes=MAX_BODY, max_request_rows=16, max_loop_lag_s=5.0)
    yield server, target
    server.stop()


@pytest.fixture(scope="module")
def client(gateway):
    c = tc.InferenceServerClient(gateway[1])
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(gateway):
    with grpc.insecure_channel(gateway[1]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def batch(fmnist_test, fmnist_spec, tiny_artifact):
    _, images, _ = sample_images(fmnist_test, 5)
    return (normalize(images, fmnist_spec).numpy(),
            offline_scores(tiny_artifact, images, fmnist_spec))


def tensor(x: np.ndarray, name: str = "input", datatype: str = "FP32") -> tc.InferInput:
    inp = tc.InferInput(name, list(x.shape), datatype)
    return inp.set_data_from_numpy(x)


def failure(fn, *args, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn(*args, **kw)
    return e.value


def params(response) -> dict:
    return {k: getattr(v, v.WhichOneof("parameter_choice"))
            for k, v in response.parameters.items()}


def test_health_and_metadata(client, gateway):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("sensai") and client.is_model_ready("sensai", "1")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "sensai" and "statistics" in meta["extensions"]
    # The same answers as the HTTP API of the same server.
    assert meta["version"] == httpx.get(f"{gateway[0].url}/v2").json()["version"]
    meta = client.get_model_metadata("sensai", as_json=True)
    assert meta["name"] == "sensai" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32",
                               "shape": ["-1", "1", "28", "28"]}]
    assert {o["name"]: o["datatype"] for o in meta["outputs"]} == {"scores": "FP32",
                                                                   "class_index": "INT64"}
    for call in (lambda: client.get_model_metadata("nope"),
                 lambda: client.get_model_metadata("sensai", "2"),
                 lambda: client.is_model_ready("nope")):
        e = failure(call)
        assert e.status() == "StatusCode.NOT_FOUND" and "sensai" in e.message()


def test_the_model_config_gives_the_preprocessing_as_values(client, gateway, fmnist_test,
                                                            fmnist_spec):
    """gRPC's ModelMetadata has no field for parameters: Triton's model configuration carries
    them, and a client normalises its pixels with them into what the model expects."""
    config = client.get_model_config("sensai", as_json=True)["config"]
    assert config["name"] == "sensai" and config["platform"] == "sensai"
    assert int(config["max_batch_size"]) == 16  # the gateway's max_batch
    assert [(i["name"], i["data_type"], i["format"], [int(d) for d in i["dims"]])
            for i in config["input"]] == [("input", "TYPE_FP32", "FORMAT_NCHW", [1, 28, 28])]
    assert {o["name"]: o["data_type"] for o in config["output"]} == {
        "scores": "TYPE_FP32", "class_index": "TYPE_INT64"}
    p = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert p["input_layout"] == "NCHW" and "minus mean" in p["preprocessing"]
    assert json.loads(p["classes"])[9] == "Ankle boot"
    _, images, _ = sample_images(fmnist_test, 3)
    mean = np.asarray(json.loads(p["input_mean"]), dtype=np.float32)[:, None, None]
    std = np.asarray(json.loads(p["input_std"]), dtype=np.float32)[:, None, None]
    pixels = images.numpy().astype(np.float32)
    x = (pixels * np.float32(float(p["input_scale"])) - mean) / std
    np.testing.assert_allclose(x, normalize(images, fmnist_spec).numpy(), atol=1e-5)
    # The same configuration over HTTP (Triton's GET /v2/models/{m}/config), the version named.
    http = httpx.get(f"{gateway[0].url}/v2/models/sensai/versions/1/config")
    assert http.status_code == 200
    assert {k: v["string_value"] for k, v in http.json()["parameters"].items()} == p
    assert client.get_model_config("sensai", "1", as_json=True)["config"]["name"] == "sensai"
    for call in (lambda: client.get_model_config("nope"),
                 lambda: client.get_model_config("sensai", "2")):
        e = failure(call)
        assert e.status() == "StatusCode.NOT_FOUND" and "sensai" in e.message()
    missing = httpx.get(f"{gateway[0].url}/v2/models/nope/config")
    assert missing.status_code == 404 and "sensai" in missing.json()["error"]


def test_infer_equals_offline_evaluation(client, batch):
    x, expected = batch
    for i in range(len(x)):  # one image per request, as a live client sends them
        res = client.infer("sensai", [tensor(x[i:i + 1])], request_id=f"r{i}")
        np.testing.assert_allclose(res.as_numpy("scores"), expected[i:i + 1], atol=2e-5)
        assert res.as_numpy("class_index").tolist() == [int(expected[i].argmax())]
        response = res.get_response()
        assert response.id == f"r{i}" and response.model_name == "sensai"
        assert response.model_version == "1"
        timings = json.loads(params(response)["timings_ms"])
        assert {"subnet_00", "subnet_04", "merge", "total"} <= set(timings)
    # A batch, the version named, one output asked for.
    res = client.infer("sensai", [tensor(x)], model_version="1",
                       outputs=[tc.InferRequestedOutput("scores")])
    np.testing.assert_allclose(res.as_numpy("scores"), expected, atol=2e-5)
    assert res.as_numpy("class_index") is None


def test_typed_contents_are_accepted(stub, batch):
    """``contents.fp32_contents`` instead of raw bytes (what other v2 clients send)."""
    x, expected = batch
    req = pb.ModelInferRequest(model_name="sensai")
    t = req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    t.contents.fp32_contents.extend(x.ravel().tolist())
    res = stub.ModelInfer(req, timeout=30)
    names = [o.name for o in res.outputs]
    scores = np.frombuffer(res.raw_output_contents[names.index("scores")], "<f4")
    np.testing.assert_allclose(scores.reshape(expected.shape), expected, atol=2e-5)


def test_classification_extension(client, batch, fmnist_spec):
    x, expected = batch
    res = client.infer("sensai", [tensor(x)],
                       outputs=[tc.InferRequestedOutput("scores", class_count=3),
                                tc.InferRequestedOutput("class_index")])
    top = res.as_numpy("scores")
    assert top.shape == (5, 3)
    for row, want in zip(top, expected):
        score, index, label = row[0].decode().split(":", 2)
        assert int(index) == want.argmax() and label == fmnist_spec.classes[int(index)]
        assert float(score) == pytest.approx(want.max(), abs=1e-5)
    assert res.as_numpy("class_index").tolist() == expected.argmax(1).tolist()


def test_allow_partial_on_a_healthy_server_is_a_full_answer(client, batch):
    x, expected = batch
    res = client.infer("sensai", [tensor(x)], parameters={"allow_partial": True})
    np.testing.assert_allclose(res.as_numpy("scores"), expected, atol=2e-5)
    assert "degraded" not in params(res.get_response())
    e = failure(client.infer, "sensai", [tensor(x)], parameters={"allow_partial": "yes"})
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "allow_partial" in e.message()


@pytest.mark.parametrize("case, fragment", [
    ("shape", "must have shape [batch, 1, 28, 28], got [1, 1, 28, 27]"),
    ("dtype", "must be FP32"),
    ("name", "unknown input 'image'"),
    ("nan", "NaN"),
    ("batch", "batch size must be between 1 and 16"),
    ("output", "unknown output 'logits'"),
    ("model", "unknown model 'nope'"),
    ("version", "no version '7'"),
])
def test_bad_input_is_refused_with_the_right_code(client, batch, case, fragment):
    x = batch[0][:1]
    inputs, kw, model = [tensor(x)], {}, "sensai"
    if case == "shape":
        inputs = [tensor(np.zeros((1, 1, 28, 27), np.float32))]
    elif case == "dtype":
        inputs = [tensor(x.astype(np.float64), datatype="FP64")]
    elif case == "name":
        inputs = [tensor(x, name="image")]
    elif case == "nan":
        bad = x.copy()
        bad[0, 0, 3, 3] = np.nan
        inputs = [tensor(bad)]
    elif case == "batch":
        inputs = [tensor(np.repeat(x, 17, axis=0))]
    elif case == "output":
        kw["outputs"] = [tc.InferRequestedOutput("logits")]
    elif case == "model":
        model = "nope"
    else:
        kw["model_version"] = "7"
    e = failure(client.infer, model, inputs, **kw)
    want = "NOT_FOUND" if case in ("model", "version") else "INVALID_ARGUMENT"
    assert e.status() == f"StatusCode.{want}", e.message()
    assert fragment in e.message()
    assert client.infer("sensai", [tensor(x)]).as_numpy("scores").shape == (1, 10)


def test_hostile_messages_are_refused_and_the_server_keeps_serving(stub, client, batch):
    x = batch[0][:1]

    def send(shape, raw=None, *, typed=None, raw_count=1):
        req = pb.ModelInferRequest(model_name="sensai")
        t = req.inputs.add(name="input", datatype="FP32", shape=shape)
        if typed is not None:
            t.contents.fp32_contents.extend(typed)
        for _ in range(raw_count):
            req.raw_input_contents.append(raw if raw is not None else x.tobytes())
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=30)
        return e.value.code(), e.value.details()

    code, msg = send([2 ** 62, 1, 28, 28])  # 4.6e18 images claimed, one sent
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "from 0 to" in msg
    assert len(msg) < 300  # the huge number is not echoed back
    code, msg = send([1, -1, 28, 28])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "got -1" in msg
    code, msg = send([1] * 9)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 8" in msg
    code, msg = send([1, 1, 28, 28], raw_count=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents has 2" in msg
    code, msg = send([1, 1, 28, 28], typed=[0.0] * 10, raw_count=0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "784 elements" in msg
    code, msg = send([1, 1, 28, 28], b"\x00" * 5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents has 5" in msg
    # Over max_body_bytes: gRPC refuses the message before any of it is parsed.
    big = np.zeros((100, 1, 28, 28), np.float32)
    e = failure(client.infer, "sensai", [tensor(big)])
    assert e.status() == "StatusCode.RESOURCE_EXHAUSTED" and "larger than max" in e.message()
    # Out of float range: non-finite scores are the input's fault.
    e = failure(client.infer, "sensai", [tensor(np.full_like(x, 3e38))])
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "float range" in e.message()
    assert client.is_server_ready()
    np.testing.assert_allclose(client.infer("sensai", [tensor(x)]).as_numpy("scores"),
                               batch[1][:1], atol=2e-5)


def test_grpc_requests_are_in_the_gateway_metrics(client, gateway, batch):
    client.infer("sensai", [tensor(batch[0][:1])])
    text = httpx.get(f"{gateway[0].url}/metrics").text
    route = "/inference.GRPCInferenceService/ModelInfer"
    assert f'sensai_requests_total{{method="GRPC",route="{route}",status="200"}}' in text
    assert f'route="{route}",status="400"' in text  # the bad requests above
    assert 'sensai_subnet_seconds_count{model="sensai",subnet="subnet_00",version="1"}' in text


def test_dead_worker_is_unavailable_naming_its_classes(tiny_artifact, batch, fmnist_spec):
    x, expected = batch
    groups = load_artifact(tiny_artifact).groups
    lost = [fmnist_spec.classes[c] for c in groups[1]]
    # The restart delay keeps the outage open long enough to look at it.
    pred = build_predictor(tiny_artifact,
                           GatewaySettings(device="cpu", deadline_s=30, restart_delay_s=4.0))
    server, target = serve(pred, deadline_s=30)
    client = tc.InferenceServerClient(target)
    try:
        assert client.infer("sensai", [tensor(x)]).as_numpy("scores").shape == (5, 10)
        pred.pool.kill(1)
        wait_until(lambda: pred.pool.states()[1] != "up", 60, "the death to be noticed")
        e = failure(client.infer, "sensai", [tensor(x)])
        assert e.status() == "StatusCode.UNAVAILABLE"
        assert all(name in e.message() for name in lost), e.message()
        assert not client.is_server_ready() and not client.is_model_ready("sensai")

        res = client.infer("sensai", [tensor(x)], parameters={"allow_partial": True},
                           outputs=[tc.InferRequestedOutput("scores"),
                                    tc.InferRequestedOutput("class_index"),
                                    tc.InferRequestedOutput("scores", class_count=10)])
        p = params(res.get_response())
        covered = sorted(c for g in (0, 2, 3, 4) for c in groups[g])
        assert p["degraded"] is True and json.loads(p["missing_classes"]) == lost
        assert sorted(json.loads(p["covered_classes"])) == covered
        assert (res.as_numpy("scores")[:, groups[1]] == 0).all()
        assert set(res.as_numpy("class_index").tolist()) <= set(covered)
        assert pred.pool.wait_until_up(1, 120)
        np.testing.assert_allclose(client.infer("sensai", [tensor(x)]).as_numpy("scores"),
                                   expected, atol=2e-5)
    finally:
        client.close()
        server.stop()


def test_overload_is_unavailable_with_retry_after(tiny_artifact, batch):
    """Requests beyond max_requests are turned away at once; health checks never are."""
    pred = build_predictor(tiny_artifact,
                           GatewaySettings(device="cpu"),
                           faults=Faults.of(delays={0: "fixed:1500ms"}))
    app = create_app(pred, GatewaySettings(grpc_port=0, max_requests=1))
    server = BackgroundServer(app).start()
    gw, target = app.state.gateway, f"127.0.0.1:{app.state.grpc.port}"
    x = batch[0][:1]
    first = threading.Thread(target=lambda: tc.InferenceServerClient(target).infer(
        "sensai", [tensor(x)]), daemon=True)
    try:
        first.start()
        wait_until(lambda: gw.admission.requests == 1, 30, "the first request to be admitted")
        with grpc.insecure_channel(target) as channel:
            req = pb.ModelInferRequest(model_name="sensai")
            req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
            req.raw_input_contents.append(x.tobytes())
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "limit of 1 requests in flight" in e.value.details()
        assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
        assert tc.InferenceServerClient(target).is_server_live()
        first.join(60)
        # The client's deadline is the request's: the server lets go of it then, not at its own.
        e = failure(tc.InferenceServerClient(target).infer, "sensai", [tensor(x)],
                    client_timeout=0.3)
        assert e.status() == "StatusCode.DEADLINE_EXCEEDED"
        wait_until(lambda: gw.admission.requests == 0, 30, "the late request to be let go")
        text = httpx.get(f"{server.url}/metrics").text
        assert 'sensai_rejected_total{reason="max_requests"} 1.0' in text
        route = 'route="/inference.GRPCInferenceService/ModelInfer"'
        assert f'{route},status="504"' in text or f'{route},status="499"' in text
    finally:
        server.stop()


# uvicorn ends its thread with SystemExit when the app's startup fails.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_busy_grpc_port_stops_the_gateway_from_starting(tiny_artifact):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu"))
        app = create_app(pred, GatewaySettings(grpc_port=busy))
        with pytest.raises(SensaiError, match="failed to start"):
            BackgroundServer(app).start()
        assert f"cannot serve gRPC on 127.0.0.1:{busy}" in str(app.state.startup_error)
    assert not pred.is_ready()  # the lifespan closed the predictor it was given


def test_sensai_serve_refuses_a_busy_grpc_port_in_one_line(tiny_artifact):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                               "--port", str(free_port()), "--grpc-port", str(busy)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--grpc-port {busy}" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sensai_serve_grpc_port_serves_and_exits_on_sigterm(tiny_artifact, batch):
    port, grpc_port = free_port(), free_port()
    with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--port",
                         str(port), "--grpc-port", str(grpc_port), "--device", "cpu",
                         "--log-level", "warning"],
                        env={**os.environ, "SENSAI_DEADLINE_S": "20"}) as proc:
        wait_for_server(proc, f"http://127.0.0.1:{port}", timeout_s=120)
        client = tc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert client.is_server_ready()
        x, expected = batch
        np.testing.assert_allclose(client.infer("sensai", [tensor(x)]).as_numpy("scores"),
                                   expected, atol=2e-5)
        client.close()
        assert stop_server(proc) == 0

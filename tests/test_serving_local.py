"""The gateway with the local pool, served by uvicorn on 127.0.0.1, called over real HTTP.

Predictions over HTTP must equal offline evaluation's (torch subnets + merge_outputs) for the
same real Fashion-MNIST test images; tritonclient.http must be able to use the KServe v2 API.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from sensai.artifact import load_artifact
from sensai.data import normalize, pil_to_uint8
from sensai.pruning.decompose import evaluate_models
from sensai.serving.core.faults import Faults
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor
from tests.helpers import (free_port, offline_scores, png, sample_images, server_process,
                           start_gateway, stop_server, wait_for_server)


@pytest.fixture(scope="module")
def local_gateway(tiny_artifact):
    server = start_gateway(build_predictor(tiny_artifact, GatewaySettings(device="cpu")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(local_gateway):
    with httpx.Client(base_url=local_gateway.url, timeout=60) as c:
        yield c


def test_http_predictions_equal_offline_evaluation(client, tiny_artifact, fmnist_test, fmnist_spec):
    idx, images, labels = sample_images(fmnist_test)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    got = np.zeros_like(expected)
    for i in range(len(idx)):
        data = png(images[i])
        # Both ways of sending an image: raw body and multipart field 'image'.
        if i % 2:
            r = client.post("/v1/predict", params={"top_k": 10},
                            files={"image": ("x.png", data, "image/png")})
        else:
            r = client.post("/v1/predict", params={"top_k": 10}, content=data,
                            headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["predictions"]) == 10
        for p in body["predictions"]:
            got[i, p["index"]] = p["score"]
            assert p["label"] == fmnist_spec.classes[p["index"]]
        assert body["index"] == body["predictions"][0]["index"]
        assert r.headers["x-request-id"] == body["request_id"]
        t = body["timings_ms"]
        assert {"subnet_00", "subnet_04", "merge", "total", "decode", "request"} <= set(t)
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert (got.argmax(1) == expected.argmax(1)).all()
    # ...and the accuracy over these images is offline evaluation's.
    art = load_artifact(tiny_artifact)
    offline = evaluate_models(None, art.load_subnets(), art.groups, fmnist_test, fmnist_spec,
                              torch.device("cpu"), indices=idx, progress=None)
    assert float((got.argmax(1) == labels).mean()) == pytest.approx(offline["decomposed_top1"])


def test_any_size_and_colour_mode_is_converted_per_manifest(client, fmnist_test, fmnist_spec,
                                                            tiny_artifact):
    """A colour JPEG, a 16-bit PNG, an RGBA PNG, all bigger than 28x28: same path as offline."""
    from PIL import Image

    _, images, _ = sample_images(fmnist_test, 3)
    pics = []
    grey = Image.fromarray(images[0, 0].numpy(), "L").resize((112, 90))
    buf = io.BytesIO()
    grey.convert("RGB").save(buf, format="JPEG", quality=95)
    pics.append(buf.getvalue())
    arr16 = (np.asarray(Image.fromarray(images[1, 0].numpy(), "L").resize((56, 56)),
                        dtype=np.uint16) * 257)
    buf = io.BytesIO()
    Image.fromarray(arr16.astype(np.uint16)).save(buf, format="PNG")
    pics.append(buf.getvalue())
    rgba = Image.fromarray(images[2, 0].numpy(), "L").convert("RGBA").resize((64, 64))
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    pics.append(buf.getvalue())
    for data in pics:
        with Image.open(io.BytesIO(data)) as im:
            mode = im.mode
            if mode.startswith("I"):  # 16-bit grey scales down to 8 bits like the gateway does
                im = Image.fromarray((np.asarray(im, dtype=np.float64) / 257).round()
                                     .astype(np.uint8), "L")
            expected_u8 = pil_to_uint8(im, fmnist_spec).unsqueeze(0)
        expected = offline_scores(tiny_artifact, expected_u8, fmnist_spec)[0]
        r = client.post("/v1/predict", content=data, params={"top_k": 10})
        assert r.status_code == 200, (mode, r.text)
        got = {p["index"]: p["score"] for p in r.json()["predictions"]}
        np.testing.assert_allclose([got[i] for i in range(10)], expected, atol=2e-5)


def test_tritonclient_calls_the_gateway_v2_api(local_gateway, tiny_artifact, fmnist_test,
                                               fmnist_spec):
    import tritonclient.http as tc

    url = local_gateway.url.removeprefix("http://")
    client = tc.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("sensai")
        assert not client.is_model_ready("nope")
        assert client.get_server_metadata()["name"] == "sensai"
        meta = client.get_model_metadata("sensai")
        assert meta["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 1, 28, 28]}
        assert {o["name"] for o in meta["outputs"]} == {"scores", "class_index"}

        _, images, _ = sample_images(fmnist_test, 5)
        # A client normalises its pixels with the values the metadata gives.
        p = meta["parameters"]
        assert p["input_layout"] == "NCHW"
        mean = np.asarray(p["input_mean"], dtype=np.float32)[:, None, None]
        std = np.asarray(p["input_std"], dtype=np.float32)[:, None, None]
        pixels = images.numpy().astype(np.float32)  # uint8 [n, 1, 28, 28]
        x = ((pixels * np.float32(p["input_scale"]) - mean) / std).astype(np.float32)
        np.testing.assert_allclose(x, normalize(images, fmnist_spec).numpy(), atol=1e-5)
        # Triton's model configuration carries the same values, as strings.
        config = client.get_model_config("sensai")
        assert config["input"][0]["dims"] == [1, 28, 28]
        assert json.loads(config["parameters"]["input_mean"]["string_value"]) == p["input_mean"]
        expected = offline_scores(tiny_artifact, images, fmnist_spec)
        # Binary tensors both ways (tritonclient's default)...
        inp = tc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = client.infer("sensai", [inp], request_id="abc")
        np.testing.assert_allclose(res.as_numpy("scores"), expected, atol=2e-5)
        assert (res.as_numpy("class_index") == expected.argmax(1)).all()
        assert res.get_response()["id"] == "abc"
        # ...JSON both ways...
        inp = tc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        res = client.infer("sensai", [inp], model_version="1",
                           outputs=[tc.InferRequestedOutput("scores", binary_data=False)])
        np.testing.assert_allclose(res.as_numpy("scores"), expected, atol=2e-5)
        assert res.as_numpy("class_index") is None
        # ...classification extension...
        res = client.infer("sensai", [inp], outputs=[tc.InferRequestedOutput("scores", class_count=3)])
        top = res.as_numpy("scores")
        assert top.shape == (5, 3)
        score, index, label = top[0, 0].decode().split(":", 2)
        assert int(index) == expected[0].argmax() and label == fmnist_spec.classes[int(index)]
        # ...and a compressed request.
        inp = tc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = client.infer("sensai", [inp], request_compression_algorithm="gzip")
        np.testing.assert_allclose(res.as_numpy("scores"), expected, atol=2e-5)
    finally:
        client.close()


def test_metrics_and_model_info(client):
    r = client.post("/v1/predict", content=b"not an image")
    assert r.status_code == 415
    info = client.get("/v1/models").json()
    assert info["name"] == "sensai" and len(info["classes"]) == 10
    assert info["predictor"]["backend"] == "local"
    assert len(info["predictor"]["workers"]) == 5
    assert info["predictor"]["workers"][0]["runtime"] == "onnx"
    assert info["predictor"]["workers"][0]["transport"] == "threads"
    text = client.get("/metrics").text
    assert 'sensai_request_seconds_bucket{le="0.005",route="/v1/predict"}' in text
    assert 'sensai_subnet_seconds_count{model="sensai",subnet="subnet_00",version="1"}' in text
    assert 'sensai_request_errors_total{reason="InputError",route="/v1/predict",status="415"}' in text
    assert "sensai_inflight_requests" in text


def test_process_workers_give_the_same_scores(tiny_artifact, fmnist_test, fmnist_spec):
    _, images, _ = sample_images(fmnist_test, 4)
    x = normalize(images, fmnist_spec).numpy()
    pred = build_predictor(tiny_artifact, GatewaySettings(backend="processes", device="cpu"))

    async def run():
        try:
            return await pred.predict(x)
        finally:
            await pred.close()

    out = asyncio.run(run())
    np.testing.assert_allclose(out.scores, offline_scores(tiny_artifact, images, fmnist_spec),
                               atol=2e-5)
    workers = pred.describe()["workers"]
    # The device processes sensai serve's gateways reach, started for this predictor alone.
    assert pred.describe()["transport"] == {"kind": "processes", "device_processes": 5}
    assert all(w["transport"] == "devices" and w["device_process"] for w in workers)
    assert workers[0]["pid"] != os.getpid()


@pytest.mark.parametrize("slow_worker", [0, 4])
def test_one_image_answers_equal_offline_whichever_subnet_answers_last(
        slow_worker, tiny_artifact, fmnist_test, fmnist_spec):
    """One image per request: the subnets that answer first work out their share of the merge
    while the last still computes, and the answer combines the shares.  Whichever subnet comes
    last (held back by an injected delay), the scores are offline evaluation's."""
    _, images, _ = sample_images(fmnist_test, 4)
    xs = normalize(images, fmnist_spec).numpy()
    pred = build_predictor(tiny_artifact,
                           GatewaySettings(device="cpu"),
                           faults=Faults.of(delays={slow_worker: "fixed:30ms"}))

    async def run():
        try:
            return [await pred.predict(xs[i:i + 1]) for i in range(len(xs))]
        finally:
            await pred.close()

    outs = asyncio.run(run())
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    for i, out in enumerate(outs):
        assert out.scores.shape == (1, expected.shape[1]) and not out.degraded
        np.testing.assert_allclose(out.scores[0], expected[i], atol=2e-5)
        slowest = max(range(5), key=lambda g: out.timings_ms[f"subnet_{g:02d}"])
        assert slowest == slow_worker  # that subnet did answer last


def test_torch_runtime_gives_the_same_scores(tiny_artifact, fmnist_test, fmnist_spec):
    _, images, _ = sample_images(fmnist_test, 4)
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu", runtime="torch"))
    out = asyncio.run(pred.predict(normalize(images, fmnist_spec).numpy()))
    asyncio.run(pred.close())
    np.testing.assert_allclose(out.scores, offline_scores(tiny_artifact, images, fmnist_spec),
                               atol=1e-6)


def test_cli_predict_local_and_remote(tiny_artifact, local_gateway, fmnist_test, fmnist_spec,
                                      tmp_path, capsys):
    from sensai.cli import main

    _, images, _ = sample_images(fmnist_test, 1)
    path = tmp_path / "one.png"
    path.write_bytes(png(images[0]))
    expected = offline_scores(tiny_artifact, images, fmnist_spec)[0]
    best = fmnist_spec.classes[int(expected.argmax())]

    assert main(["predict", str(tiny_artifact), str(path), "--top-k", "3", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].split(None, 2)[2] == best

    assert main(["predict", str(tiny_artifact), str(path), "--url", local_gateway.url, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["label"] == best

    assert main(["predict", str(tiny_artifact), str(tmp_path / "missing.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # More classes than the model has: refused in process as over HTTP (a 422 there).
    for where in ([], ["--url", local_gateway.url]):
        assert main(["predict", str(tiny_artifact), str(path), "--top-k", "11", *where]) == 2
        assert "at most 10" in capsys.readouterr().err
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    assert main(["predict", str(tiny_artifact), str(bad), "--device", "cpu"]) == 2
    assert "image" in capsys.readouterr().err


def test_by_default_the_gateway_leaves_the_host_alone(tiny_artifact, fmnist_test, monkeypatch):
    """No host tuning unless asked: the local pool and its gateway, with every default, answer
    requests without opening /dev/cpu_dma_latency or changing any thread's affinity, and
    /v1/models says both tunings are off."""
    from sensai.serving.core.wakeup import DEVICE, current_limit_us

    for name in ("SENSAI_KEEP_CORES_AWAKE", "SENSAI_SPREAD_CORES"):
        monkeypatch.delenv(name, raising=False)
    opened, moved = [], []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(str(path)),
                                                            real_open(path, *a, **k))[1])
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: moved.append(a))
    limit_before = current_limit_us()
    server = start_gateway(build_predictor(tiny_artifact, GatewaySettings(workers=2)))
    try:
        _, images, _ = sample_images(fmnist_test, 2)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for _ in range(10):
                for img in images:
                    assert c.post("/v1/predict", content=png(img)).status_code == 200
            info = c.get("/v1/models").json()
            assert current_limit_us() == limit_before
    finally:
        server.stop()
    assert info["cores_awake"] == {"mode": "off", "held": False, "latency_us": None,
                                   "detail": "not asked: keep_cores_awake off"}
    assert info["predictor"]["transport"] == {"kind": "threads", "spread_cores": False,
                                              "spread_moves": None}
    assert DEVICE not in opened and moved == []


@pytest.mark.slow
def test_sensai_serve_starts_answers_and_stops_on_sigterm(tiny_artifact, fmnist_test):
    """`sensai serve` in its own process: ready, predicts, exits 0 on SIGTERM; asked to
    (--set keep_cores_awake=auto --set spread_cores=true), it keeps idle cores awake while it
    serves when it may and withdraws that when it stops, and spreads its worker threads."""
    from sensai.serving.core.wakeup import DEVICE, current_limit_us

    may_hold = os.access(DEVICE, os.R_OK | os.W_OK)
    limit_before = current_limit_us()
    port = free_port()
    env = {**os.environ, "SENSAI_DEADLINE_S": "20"}
    with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                         "--port", str(port), "--device", "cpu", "--log-level", "warning",
                         "--set", "keep_cores_awake=auto", "--set", "spread_cores=true"],
                        env=env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        _, images, _ = sample_images(fmnist_test, 1)
        r = httpx.post(f"{url}/v1/predict", content=png(images[0]), timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "sensai"
        # SENSAI_* environment variables reach the settings.
        info = httpx.get(f"{url}/v1/models").json()
        assert info["predictor"]["deadline_s"] == 20
        assert info["cores_awake"]["mode"] == "auto"
        assert info["cores_awake"]["held"] is may_hold
        assert info["predictor"]["transport"]["spread_cores"] is True
        if may_hold:
            assert current_limit_us() == 0
        assert stop_server(proc) == 0
        assert current_limit_us() == limit_before


def test_serve_rejects_a_bad_artifact_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sensai", "serve", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr

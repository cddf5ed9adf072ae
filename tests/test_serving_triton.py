"""Triton: the model-repository export, and a live tritonserver behind the gateway.

The live tests need a ``tritonserver`` binary.  The one inside the ``nvidia-pytriton`` wheel
works here (Python backend only, so the repository is exported with ``backend="python"``); the
tests skip, saying how to get one, when none is found (see serving.triton.TRITON_HINT).
"""

from __future__ import annotations

import hashlib

import httpx
import numpy as np
import pytest

from tests.test_serving_local import free_port, offline_scores, png, sample_images, start_gateway


def _config(path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_writes_a_valid_onnxruntime_repository(tiny_artifact, tmp_path):
    from tritonclient.grpc import model_config_pb2 as mc

    from sensai.manifest import load_manifest
    from sensai.serving.triton import export_triton_repo

    manifest = load_manifest(tiny_artifact)
    out = tmp_path / "repo"
    names = export_triton_repo(tiny_artifact, out, max_batch_size=16)
    assert names == [f"sensai_subnet_{i:02d}" for i in range(5)]
    assert sorted(p.name for p in out.iterdir()) == names
    for s, name in zip(manifest.subnets, names):
        cfg = _config(out / name / "config.pbtxt")  # parses as Triton's own ModelConfig
        assert cfg.name == name and cfg.backend == "onnxruntime" and cfg.max_batch_size == 16
        assert len(cfg.input) == 1 and len(cfg.output) == 1
        assert cfg.input[0].data_type == mc.TYPE_FP32 and list(cfg.input[0].dims) == [1, 28, 28]
        assert list(cfg.output[0].dims) == [s.num_outputs]
        assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_AUTO
        assert cfg.parameters["intra_op_thread_count"].string_value == "1"
        assert _sha(out / name / "1" / "model.onnx") == _sha(tiny_artifact / s.onnx)
        assert not (out / name / "1" / "model.py").exists()


def test_export_python_backend_and_gpu_pinning(tiny_artifact, tmp_path):
    from tritonclient.grpc import model_config_pb2 as mc

    from sensai.serving.triton import export_triton_repo

    out = tmp_path / "repo"
    names = export_triton_repo(tiny_artifact, out, backend="python", gpus=2, threads=2)
    for i, name in enumerate(names):
        cfg = _config(out / name / "config.pbtxt")
        assert cfg.backend == "python"
        assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
        assert list(cfg.instance_group[0].gpus) == [i % 2]
        assert cfg.parameters["intra_op_threads"].string_value == "2"
        compile((out / name / "1" / "model.py").read_text(), "model.py", "exec")


def test_export_refuses_to_clobber_and_cli(tiny_artifact, tmp_path, capsys):
    from sensai.cli import main
    from sensai.errors import SensaiError
    from sensai.serving.triton import export_triton_repo

    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SensaiError, match="not empty"):
        export_triton_repo(tiny_artifact, out)
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export-triton", str(tiny_artifact), "--out", str(out), "--overwrite",
                 "--max-batch", "0", "--instance-kind", "cpu"]) == 0
    assert "wrote 5 Triton models" in capsys.readouterr().out
    cfg = _config(out / "sensai_subnet_00" / "config.pbtxt")
    assert cfg.max_batch_size == 0 and list(cfg.input[0].dims) == [-1, 1, 28, 28]
    assert main(["export-triton", str(tmp_path / "nothing"), "--out", str(tmp_path / "r2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


# --------------------------------------------------------------------------------------------
# A real tritonserver


@pytest.fixture(scope="module")
def triton_server(tiny_artifact, tmp_path_factory):
    from sensai.serving.triton import TRITON_HINT, TritonServerProcess, export_triton_repo, find_tritonserver

    install = find_tritonserver()
    if install is None:
        pytest.skip(TRITON_HINT)
    backend = "onnxruntime" if "onnxruntime" in install.backends() else "python"
    repo = tmp_path_factory.mktemp("triton") / "models"
    export_triton_repo(tiny_artifact, repo, backend=backend)
    server = TritonServerProcess(repo, http_port=free_port(), grpc_port=free_port(),
                                 metrics_port=free_port(), install=install)
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_triton_models_compute_what_onnx_runtime_computes(triton_server, tiny_artifact,
                                                          fmnist_test, fmnist_spec):
    import tritonclient.http as tc

    from sensai.data import normalize
    from sensai.manifest import load_manifest
    from sensai.serving.runners import OrtRunner

    _, images, _ = sample_images(fmnist_test, 4)
    x = normalize(images, fmnist_spec).numpy()
    client = tc.InferenceServerClient(triton_server.url)
    try:
        for s in load_manifest(tiny_artifact).subnets:
            name = f"sensai_subnet_{s.index:02d}"
            meta = client.get_model_metadata(name)
            inp = tc.InferInput(meta["inputs"][0]["name"], list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer(name, [inp]).as_numpy(meta["outputs"][0]["name"])
            want = OrtRunner(tiny_artifact / s.onnx).run(x)
            np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        client.close()


@pytest.mark.slow
def test_gateway_with_triton_pool_equals_offline_and_fails_cleanly(triton_server, tiny_artifact,
                                                                   fmnist_test, fmnist_spec):
    import tritonclient.http as tc

    from sensai.data import normalize
    from sensai.serving.triton import triton_predictor

    _, images, _ = sample_images(fmnist_test, 8)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    predictor = triton_predictor(tiny_artifact, triton_server.url, deadline_s=10)
    gateway = start_gateway(predictor)
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            for i in range(len(images)):
                r = c.post("/v1/predict", content=png(images[i]), params={"top_k": 10})
                assert r.status_code == 200, r.text
                got = {p["index"]: p["score"] for p in r.json()["predictions"]}
                np.testing.assert_allclose([got[k] for k in range(10)], expected[i], atol=2e-5)
            assert c.get("/v1/models").json()["predictor"]["pool"]["kind"] == "triton"
            # KServe v2 through the gateway whose subnets are in Triton.
            client = tc.InferenceServerClient(gateway.url.removeprefix("http://"))
            inp = tc.InferInput("input", [8, 1, 28, 28], "FP32")
            inp.set_data_from_numpy(normalize(images, fmnist_spec).numpy())
            np.testing.assert_allclose(client.infer("sensai", [inp]).as_numpy("scores"), expected,
                                       atol=2e-5)
            client.close()
            # Triton goes away: 503 naming a subnet, quickly, and not ready any more.
            triton_server.stop()
            r = c.post("/v1/predict", content=png(images[0]))
            assert r.status_code == 503, r.text
            assert r.json()["subnet"].startswith("subnet_") and "triton" in r.json()["error"].lower()
            assert c.get("/v2/health/ready").status_code == 503
    finally:
        gateway.stop()

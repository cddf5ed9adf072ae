"""Triton: the model-repository export, and a live tritonserver behind the gateway.

The live tests need a ``tritonserver`` binary.  The one inside the ``nvidia-pytriton`` wheel
works here (Python backend only, so the repository is exported with ``backend="python"``); the
tests skip, saying how to get one, when none is found (see serving.tritonserver.TRITON_HINT).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as tc
from tritonclient.grpc import model_config_pb2 as mc

from sensai.artifact import load_artifact
from sensai.bench.machine import descendant_pids
from sensai.cli import main
from sensai.data import normalize
from sensai.errors import CheckpointError, SensaiError
from sensai.fsutil import write_json_atomic
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor, launch_triton
from sensai.serving.launch.triton_repo import export_triton_repo
from sensai.serving.launch.tritonserver import (WORKDIR_PREFIX, find_tritonserver,
                                                sweep_stale_workdirs)
from sensai.serving.workers.runners import OrtRunner
from tests.helpers import (free_port, offline_scores, png, process_name, running,
                           sample_images, server_process, start_gateway, wait_for_server,
                           wait_until)


def _config(path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_writes_a_valid_onnxruntime_repository(tiny_artifact, tmp_path):
    manifest = load_artifact(tiny_artifact).manifest
    out = tmp_path / "repo"
    names = export_triton_repo(tiny_artifact, out, max_batch_size=16)
    assert names == [f"sensai_subnet_{i:02d}" for i in range(5)]
    assert sorted(p.name for p in out.iterdir()) == names
    assert out.stat().st_mode & 0o777 == 0o755  # readable by a non-root tritonserver
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
    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SensaiError, match="not empty"):
        export_triton_repo(tiny_artifact, out)
    # --overwrite replaces a Triton repository, not a folder of other files, nor the artifact.
    assert main(["export-triton", str(tiny_artifact), "--out", str(out), "--overwrite"]) == 2
    assert "holds 'keep.txt', which is no model of one" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export-triton", str(tiny_artifact), "--out", str(tiny_artifact),
                 "--overwrite"]) == 2
    assert "holds the artifact itself" in capsys.readouterr().err
    (out / "keep.txt").unlink()
    for again in ([], ["--overwrite"]):  # an empty folder, then the repository replaced
        assert main(["export-triton", str(tiny_artifact), "--out", str(out), *again,
                     "--max-batch-size", "0", "--instance-kind", "cpu"]) == 0
        assert "wrote 5 Triton models" in capsys.readouterr().out
    cfg = _config(out / "sensai_subnet_00" / "config.pbtxt")
    assert cfg.max_batch_size == 0 and list(cfg.input[0].dims) == [-1, 1, 28, 28]
    assert main(["export-triton", str(tmp_path / "nothing"), "--out", str(tmp_path / "r2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()
    # An ordinary file where the repository (or a folder above it) would go: one line, and the
    # file is left as it was, --overwrite or not.
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out, overwrite in ((afile, []), (afile, ["--overwrite"]), (afile / "r", [])):
        assert main(["export-triton", str(tiny_artifact), "--out", str(out), *overwrite]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"cannot write to model repository {out}: " in err[0], err
        assert f"{'it' if out == afile else afile} is a file, not a directory" in err[0], err
    assert afile.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "afile", "repo"]
    for threads in ("0", "-3"):  # Triton would be given a thread count it cannot use
        assert main(["export-triton", str(tiny_artifact), "--out", str(tmp_path / "r3"),
                     "--threads", threads]) == 2
        assert f"--threads must be at least 1, got {threads}" in capsys.readouterr().err
    assert not (tmp_path / "r3").exists()


# --------------------------------------------------------------------------------------------
# A real tritonserver


@pytest.fixture(scope="module")
def triton_server(tiny_artifact):
    if find_tritonserver() is None:
        pytest.fail("no tritonserver: deploy/setup.sh unpacks one into .venv/triton")
    server = launch_triton(tiny_artifact)
    yield server
    server.stop()


@pytest.mark.slow
def test_triton_models_compute_what_onnx_runtime_computes(triton_server, tiny_artifact,
                                                          fmnist_test, fmnist_spec):
    _, images, _ = sample_images(fmnist_test, 4)
    x = normalize(images, fmnist_spec).numpy()
    client = tc.InferenceServerClient(triton_server.url)
    try:
        for s in load_artifact(tiny_artifact).manifest.subnets:
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
    _, images, _ = sample_images(fmnist_test, 8)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    predictor = build_predictor(tiny_artifact, GatewaySettings(
        backend="triton", triton_url=triton_server.url, deadline_s=10))
    gateway = start_gateway(predictor)
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            for i in range(len(images)):
                r = c.post("/v1/predict", content=png(images[i]), params={"top_k": 10})
                assert r.status_code == 200, r.text
                got = {p["index"]: p["score"] for p in r.json()["predictions"]}
                np.testing.assert_allclose([got[k] for k in range(10)], expected[i], atol=2e-5)
            info = c.get("/v1/models").json()["predictor"]
            assert info["backend"] == "triton" and info["transport"]["url"] == triton_server.url
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
            assert r.json()["missing_classes"]
            assert c.get("/v2/health/ready").status_code == 503
    finally:
        gateway.stop()


# --------------------------------------------------------------------------------------------
# The server never outlives the gateway, and leaves nothing behind


@pytest.mark.slow
def test_a_killed_gateway_takes_its_tritonserver_along(tiny_artifact):
    """`sensai serve --backend triton` is SIGKILLed: its tritonserver dies with it, and the next
    start removes the directory it left (exported repository, log)."""
    port = free_port()
    with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                         "--backend", "triton", "--port", str(port), "--log-level",
                         "warning"]) as proc:
        wait_for_server(proc, f"http://127.0.0.1:{port}", timeout_s=180)
        (server_pid,) = [p for p in descendant_pids(proc.pid)
                         if process_name(p) == "tritonserver"]
        mine = [d for d in Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*")
                if (d / "owner.pid").is_file() and (d / "owner.pid").read_text() == str(proc.pid)]
        assert len(mine) == 1 and (mine[0] / "models" / "sensai_subnet_00").is_dir()
        proc.kill()
        proc.wait()
        wait_until(lambda: not running(server_pid), 30, "tritonserver to die with its parent")
        assert mine[0] in sweep_stale_workdirs() and not mine[0].exists()


def test_an_interrupted_or_failed_start_leaves_nothing(tiny_artifact, monkeypatch):
    if find_tritonserver() is None:
        pytest.fail("no tritonserver: deploy/setup.sh unpacks one into .venv/triton")
    from sensai.serving.launch import child, tritonserver

    started = []
    real_popen = subprocess.Popen

    def popen(*a, **kw):
        started.append(real_popen(*a, **kw))
        return started[-1]

    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tritonserver.subprocess, "Popen", popen)
    monkeypatch.setattr(child.httpx, "get", interrupt)  # Ctrl-C while it starts
    before = set(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*"))
    with pytest.raises(KeyboardInterrupt):
        launch_triton(tiny_artifact)
    assert started and started[0].poll() is not None  # the server was stopped
    # Nothing new (the start may also have swept directories left by dead gateways).
    assert set(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*")) <= before


def test_export_checks_every_onnx_file(tiny_artifact, tmp_path):
    """A replaced ONNX file, an empty hash, or a path outside the artifact: refused, and no
    repository is written."""
    import shutil

    from sensai.manifest import MANIFEST

    def copy_with(edit) -> Path:
        art = tmp_path / f"art{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_artifact, art)
        m = load_artifact(art).manifest.model_dump(mode="json")
        edit(art, m)
        write_json_atomic(art / MANIFEST, m)
        return art

    replaced = copy_with(lambda art, m: (art / m["subnets"][1]["onnx"]).write_bytes(
        (art / m["subnets"][0]["onnx"]).read_bytes()))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        export_triton_repo(replaced, tmp_path / "r1")
    outside = copy_with(lambda art, m: m["subnets"][1].update(onnx="../elsewhere.onnx"))
    with pytest.raises(CheckpointError, match="outside the artifact"):
        export_triton_repo(outside, tmp_path / "r2")
    empty = copy_with(lambda art, m: m["subnets"][1].update(onnx_sha256=""))
    with pytest.raises(CheckpointError, match="malformed"):
        export_triton_repo(empty, tmp_path / "r3")
    assert not any((tmp_path / f"r{i}").exists() for i in (1, 2, 3))

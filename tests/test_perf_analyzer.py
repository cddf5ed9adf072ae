"""NVIDIA perf_analyzer against sensai: ``sensai perf-data`` writes its real-input-data file,
and ``sensai bench-load --sweep --perf-analyzer`` drives it (``sensai/bench/perf_analyzer.py``).

Real Fashion-MNIST, the real ONNX subnets of ``tiny_artifact`` behind the real gateway on
127.0.0.1 (HTTP and gRPC); perf_analyzer itself where it is on PATH or in the environment
(``deploy/setup.sh`` unpacks it there), the tests that run it skipped with the reason elsewhere.  No timing is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from sensai.bench.perf_analyzer import PerfAnalyzer, find, for_sweep, missing, read_csv
from sensai.cli import main
from sensai.data import normalize
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.server import BackgroundServer
from sensai.serving.launch.build import build_predictor
from tests.helpers import offline_scores

COUNT = 6
needs_perf_analyzer = pytest.mark.skipif(find() is None, reason=str(missing()))


@pytest.fixture(scope="module")
def data_file(tiny_artifact, tmp_path_factory):
    path = tmp_path_factory.mktemp("perf") / "perf-data.json"
    assert main(["perf-data", str(tiny_artifact), "--out", str(path), "--count", str(COUNT),
                 "--seed", "3"]) == 0
    return path


@pytest.fixture(scope="module")
def entries(data_file):
    return json.loads(data_file.read_text())["data"]


@pytest.fixture(scope="module")
def matched(entries, fmnist_test, fmnist_spec):
    """Each entry's index in the test split: the test image whose normalized pixels it holds,
    bit for bit (None: no test image has them)."""
    every = normalize(fmnist_test.images, fmnist_spec).numpy().reshape(len(fmnist_test), -1)
    found = []
    for e in entries:
        x = np.asarray(e["input"]["content"], dtype=np.float32)
        hits = np.flatnonzero((every == x).all(axis=1))
        found.append(int(hits[0]) if len(hits) else None)
    return found


@pytest.fixture(scope="module")
def gateway(tiny_artifact):
    """The gateway with HTTP and gRPC on free ports; its loop-lag shed relaxed, as in
    test_grpc.py, so a busy test machine does not turn perf_analyzer's requests into 503s."""
    app = create_app(build_predictor(tiny_artifact, GatewaySettings(device="cpu")),
                     GatewaySettings(grpc_port=0, max_loop_lag_s=5.0))
    server = BackgroundServer(app).start()
    yield server, f"127.0.0.1:{app.state.grpc.port}"
    server.stop()


def test_perf_data_holds_real_normalized_test_images(entries, matched, fmnist_test):
    assert len(entries) == COUNT
    for e in entries:
        assert set(e) == {"input"} and e["input"]["shape"] == [1, 28, 28]
        assert len(e["input"]["content"]) == 28 * 28
        assert all(math.isfinite(v) for v in e["input"]["content"])
    assert None not in matched and len(set(matched)) == COUNT


def test_a_trained_model_dir_gives_the_same_images(trained_model_dir, entries, tmp_path):
    path = tmp_path / "model.json"
    assert main(["perf-data", str(trained_model_dir), "--out", str(path), "--count",
                 str(COUNT), "--seed", "3"]) == 0
    assert json.loads(path.read_text())["data"] == entries


def test_its_entries_are_answered_with_the_offline_class(gateway, entries, matched,
                                                         tiny_artifact, fmnist_test, fmnist_spec):
    """One entry as one KServe v2 request, and all of them as one batch: 200, and the class
    offline evaluation gives those test images."""
    expected = offline_scores(tiny_artifact, fmnist_test.images[matched], fmnist_spec).argmax(1)
    url = f"{gateway[0].url}/v2/models/sensai/infer"

    def infer(batch):
        body = {"inputs": [{"name": "input", "datatype": "FP32",
                            "shape": [len(batch), *batch[0]["input"]["shape"]],
                            "data": [v for e in batch for v in e["input"]["content"]]}]}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        return out["class_index"]["data"]

    assert infer(entries[:1]) == [int(expected[0])]
    assert infer(entries) == [int(c) for c in expected]


@pytest.mark.parametrize("argv, says", [
    (["/no/such/dir"], "neither an artifact"),
    (["ARTIFACT", "--count", "0"], "--count must be at least 1"),
    (["ARTIFACT", "--count", "20000"], "--count must be an integer from 1 to 10000"),
    (["ARTIFACT", "--out-is-a-dir"], "is a directory"),
    (["ARTIFACT", "--out-under-a-file"], "cannot write to --out's folder {tmp}/afile: it is a "
                                         "file, not a directory"),
    (["ARTIFACT", "--data-dir", "/no/such/dir"], "does not exist"),
    (["ARTIFACT", "--seed", "-1"], "--seed must be an integer from 0 to 4294967295, got -1"),
    (["ARTIFACT", "--out-in-the-artifact"], "lies inside"),
])
def test_bad_arguments_give_one_line(argv, says, tiny_artifact, tmp_path, capsys):
    (tmp_path / "afile").touch()  # an ordinary file, where a folder is wanted
    says = says.format(tmp=tmp_path)
    argv = [str(tiny_artifact) if a == "ARTIFACT" else a for a in argv]
    out = str(tmp_path) if "--out-is-a-dir" in argv else str(tmp_path / "x.json")
    if "--out-under-a-file" in argv:
        out = str(tmp_path / "afile" / "x.json")
    if "--out-in-the-artifact" in argv:  # its own manifest, which perf-data would replace
        out = str(tiny_artifact / "manifest.json")
    argv = [a for a in argv if not a.startswith("--out-")]
    assert main(["perf-data", *argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sensai perf-data: error: ") and says in err
    assert err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # nothing written


def test_the_command_fails_in_one_line_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sensai", "perf-data", str(tmp_path / "none"),
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("sensai perf-data: error: ")


def test_bench_load_refuses_perf_analyzer_only_where_it_is_missing(tiny_artifact, tmp_path,
                                                                   monkeypatch, capsys, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no perf_analyzer there...
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # ...nor beside Python
    assert main(["bench-load", str(tiny_artifact), "--out", str(tmp_path / "o"), "--sweep",
                 "--perf-analyzer", "only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "perf_analyzer is neither on PATH nor beside" in err
    # "also": a warning, and the sweep goes on without it.
    assert for_sweep("also", [], tmp_path, 1.0) is None
    assert "perf_analyzer is neither on PATH nor beside" in caplog.text
    assert main(["bench-load", str(tiny_artifact), "--out", str(tmp_path / "o"),
                 "--perf-analyzer"]) == 2
    assert "add --sweep" in capsys.readouterr().err


@needs_perf_analyzer
def test_perf_analyzer_runs_against_the_gateway(gateway, data_file, tmp_path):
    """A short real run at 1 in flight over HTTP (through :class:`PerfAnalyzer`, as bench-load
    runs it) and over gRPC, its CSVs read; its default random input is refused, as it must."""
    server, grpc_target = gateway
    row = PerfAnalyzer(data_file, window_ms=200, out=tmp_path).level(server.url, "sensai", 1,
                                                                     "test")
    assert "error" not in row, row
    assert row["concurrency"] == 1 and row["throughput_infer_per_s"] > 0
    assert 0 < row["p50_us"] <= row["p90_us"] <= row["p99_us"]
    assert "server_queue_us" in row and "server_compute_infer_us" in row

    csv = tmp_path / "grpc.csv"
    proc = subprocess.run([find(), "-m", "sensai", "-i", "grpc", "-u", grpc_target,
                           "--input-data", str(data_file), "--concurrency-range", "1:1",
                           "--measurement-interval", "200", "--stability-percentage", "100",
                           "-f", str(csv)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (grpc,) = read_csv(csv)
    assert grpc["concurrency"] == 1 and grpc["throughput_infer_per_s"] > 0

    proc = subprocess.run([find(), "-m", "sensai", "-u", server.url.split("://")[1],
                           "--concurrency-range", "1:1", "--measurement-interval", "200"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "NaN or infinite" in proc.stdout + proc.stderr


@needs_perf_analyzer
def test_bench_load_sweep_reports_perf_analyzer_rows(tiny_artifact, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["bench-load", str(tiny_artifact), "--out", str(out), "--sweep", "--configs",
                 "class-parallel", "--levels", "1", "--set", "level_seconds=0.6",
                 "--set", "warmup_seconds=0", "--set", "overload_seconds=0", "--images", "10",
                 "--perf-analyzer", "only"]) == 0
    result = json.loads((out / "load.json").read_text())
    assert result["settings"]["perf_analyzer"]["mode"] == "only"
    (row,) = result["configs"]["class-parallel"]["perf_analyzer"]
    assert "error" not in row, row
    assert row["concurrency"] == 1 and row["throughput_infer_per_s"] > 0
    assert "perf_analyzer" in capsys.readouterr().out
    assert "## perf_analyzer" in (out / "load.md").read_text()
    assert len(json.loads((out / "perf-data.json").read_text())["data"]) == 10

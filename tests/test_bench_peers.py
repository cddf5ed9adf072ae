"""``sensai bench --peers`` and ``--backend`` with several pools: the original model served by a
real ``tritonserver`` and by plain Ray Serve, and the class-parallel subnets through the gateway
on the local, Ray and Triton pools, all timed in one run by the one harness.

Real components throughout (real images, ONNX Runtime, a real tritonserver, a real Ray instance
and Ray Serve, HTTP on 127.0.0.1, the client in its own process).  No speed is asserted: only
that every system answered every image as the offline model does, that every figure is there
and agrees with what can be recomputed from the raw latencies, and that nothing is left
running.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sensai.errors import SensaiError
from sensai.serving.launch.tritonserver import TRITON_HINT, WORKDIR_PREFIX, find_tritonserver
from tests.helpers import offline_scores

TITLE = "## sensai vs Triton vs Ray Serve"
SHORT = ["--images", "4", "--set", "warmup=1", "--set", "rounds=1", "--concurrency", "2",
         "--requests", "2"]


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return Path(tiny_artifact)


def _children() -> list[str]:
    """Command lines of this process's live children."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                out.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, ValueError):
            continue
    return out


def _my_triton_dirs() -> list[Path]:
    return [d for d in Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*")
            if (d / "owner.pid").is_file() and (d / "owner.pid").read_text() == str(os.getpid())]


def test_without_tritonserver_the_triton_peer_is_skipped_with_its_reason(artifact, tmp_path,
                                                                         monkeypatch, capsys):
    from sensai.bench import server
    from sensai.cli import main

    monkeypatch.setattr(server, "find_tritonserver", lambda: None)
    out = tmp_path / "out"
    assert main(["bench", str(artifact), "--out", str(out), "--strategies", "class-parallel",
                 "--transports", "http-v2", "--peers", "triton", *SHORT]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "bench.json").read_text())
    assert result["settings"]["peers"] == ["triton"] and "--peers triton" in result["command"]
    assert result["peers"] == {"triton": {"label": "Triton Inference Server",
                                          "skipped": TRITON_HINT}}
    assert "\n" not in TRITON_HINT
    c = result["comparison"]
    assert c["skipped"] == {"triton": TRITON_HINT} and c["transport"] == "http-v2"
    (row,) = c["rows"]  # sensai's own row is still measured
    assert row["key"] == "class-parallel" and 0 < row["p50_ms"] <= row["p99_ms"]
    assert row["triton_p50_over_p50"] is None
    md = (out / "bench.md").read_text()
    assert TITLE in md and f"- skipped triton: {TRITON_HINT}" in md
    assert f"skipped triton: {TRITON_HINT}" in printed and "sensai vs Triton vs Ray Serve" in printed


def test_peer_and_backend_arguments_are_checked(artifact, tmp_path, capsys):
    from sensai.bench.latency import run_bench
    from sensai.bench.options import BenchOptions
    from sensai.cli import main

    out = tmp_path / "out"
    # The peers speak the KServe v2 binary tensor only: one line, no traceback, nothing written.
    assert main(["bench", str(artifact), "--out", str(out), "--transports", "http", "--peers",
                 "ray-serve", *SHORT]) == 2
    err = capsys.readouterr().err
    assert "sensai bench: error:" in err and "http-v2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        main(["bench", str(artifact), "--out", str(out), "--peers", "kubernetes"])
    for kwargs, match in (({"peers": ("bogus",)}, "unknown peer"),
                          ({"backends": ("local", "local")}, "twice"),
                          ({"backends": ("local", "kubernetes")}, "unknown backend"),
                          ({"backends": ("local",), "ray_address": "127.0.0.1:1"},
                           "--backend ray"),
                          ({"peers": ("triton",), "runtime": "torch"}, "ONNX")):
        with pytest.raises(SensaiError, match=match):
            run_bench(artifact, out, BenchOptions(progress=False, **kwargs))
    assert not (out / "bench.json").exists()


@pytest.fixture(scope="module")
def all_systems(artifact, tmp_path_factory):
    """One run: single device and class parallel on the local, Ray and Triton pools through the
    gateway, the original model on Triton and on Ray Serve, over http-v2."""
    if find_tritonserver() is None:
        pytest.skip(TRITON_HINT)
    import ray

    from sensai.bench.latency import run_bench
    from sensai.bench.options import BenchOptions

    out = tmp_path_factory.mktemp("peers_out")
    result = run_bench(artifact, out, BenchOptions(
        strategies=("single", "class-parallel"), transports=("http-v2",),
        backends=("local", "ray", "triton"), peers=("triton", "ray-serve"), images=6, warmup=1,
        rounds=2, concurrency=2, requests=4, isolated_images=2, progress=False,
        command="test"))
    # Everything the run started is gone: tritonservers (and their directories), Ray, Serve.
    assert not ray.is_initialized()
    assert not [c for c in _children() if "tritonserver" in c or "raylet" in c]
    assert not _my_triton_dirs()
    return out, result


@pytest.mark.slow
def test_every_system_answers_like_the_offline_models(all_systems, artifact, fmnist_spec,
                                                      fmnist_test):
    from sensai.artifact import load_artifact
    from sensai.checkpoint import load_trained_model
    from sensai.data import normalize, stratified_subset

    _, result = all_systems
    idx = stratified_subset(fmnist_test.labels, 6, 0)
    images = torch.stack([fmnist_test[int(i)][0] for i in idx])
    model, _ = load_trained_model(load_artifact(artifact).manifest.source.model_dir)
    with torch.inference_mode():
        want_full = model.eval()(normalize(images, fmnist_spec)).argmax(1).tolist()
    want_cp = offline_scores(artifact, images, fmnist_spec).argmax(1).tolist()
    assert len(set(want_full)) > 1  # a server answering one class for all would fail

    systems = {**result["strategies"], **result["peers"]}
    assert set(systems) == {"single", "class-parallel", "class-parallel@ray",
                            "class-parallel@triton", "triton", "ray-serve"}
    assert [result["strategies"][k]["backend"] for k in ("class-parallel", "class-parallel@ray",
                                                         "class-parallel@triton")] == \
        ["local", "ray", "triton"]
    for key, info in systems.items():
        (rep,) = info["transports"].values()
        assert set(info["transports"]) == {"http-v2"}
        want = want_cp if key.startswith("class-parallel") else want_full
        assert rep["predictions"] == want, key
        n = result["settings"]["images"]  # 6 asked, at least one per class
        assert rep["images"] == n == len(idx) == len(rep["latencies_ms"]) == len(rep["floors_ms"])
        lat = rep["latency_ms"]
        assert all(np.isfinite(lat[k]) for k in ("p50", "p99", "min", "max"))
        assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"]
        assert rep["floor_ms"]["p50"] > 0 and rep["throughput"]["requests"] == 4
    # Ray Serve's replica reports its compute; Triton reports none per request.
    ray_serve = result["peers"]["ray-serve"]["transports"]["http-v2"]
    assert ray_serve["breakdown_ms"]["p50"]["compute"] > 0
    assert result["peers"]["triton"]["transports"]["http-v2"]["breakdown_ms"]["p50"][
        "compute"] is None
    assert result["peers"]["triton"]["triton_backend"] in ("python", "onnxruntime")


@pytest.mark.slow
def test_the_comparison_table_is_in_bench_json_and_bench_md(all_systems):
    out, result = all_systems
    on_disk = json.loads((out / "bench.json").read_text())
    c = on_disk["comparison"]
    assert c == result["comparison"] and c["skipped"] == {} and c["transport"] == "http-v2"
    assert [r["key"] for r in c["rows"]] == ["single", "class-parallel", "class-parallel@ray",
                                             "class-parallel@triton", "triton", "ray-serve"]
    alone = c["compute_alone_ms"]
    assert alone["original"] > 0 and alone["slowest_subnet"] > 0
    assert alone["slowest_subnet"] == \
        on_disk["strategies"]["class-parallel"]["isolated_compute_ms_p50_max"]
    systems = {**on_disk["strategies"], **on_disk["peers"]}
    triton_p50 = systems["triton"]["transports"]["http-v2"]["latency_ms"]["p50"]
    for r in c["rows"]:
        rep = systems[r["key"]]["transports"]["http-v2"]
        assert (r["p50_ms"], r["p99_ms"]) == (rep["latency_ms"]["p50"], rep["latency_ms"]["p99"])
        assert r["bare_p50_ms"] == rep["floor_ms"]["p50"] > 0
        want_compute = alone["slowest_subnet"] if "subnets" in r["serves"] else alone["original"]
        assert r["compute_ms"] == want_compute
        # Recomputed from the raw figures: p50 of (latency - bare), minus compute.
        above = np.median(np.subtract(rep["latencies_ms"], rep["floors_ms"]))
        assert r["overhead_ms"] == pytest.approx(above - want_compute, abs=2e-4)
        assert r["triton_p50_over_p50"] == pytest.approx(triton_p50 / r["p50_ms"], abs=2e-3)
        assert r["top1"] == rep["top1"]
    md = (out / "bench.md").read_text()
    section = md[md.index(TITLE):]
    for text in ("| system | serves | pool | p50 ms | p99 ms |", "| sensai gateway | original model",
                 "| sensai gateway | 5 class-parallel subnets | ray |",
                 "| sensai gateway | 5 class-parallel subnets | triton |",
                 "| Triton Inference Server | original model |", "| Ray Serve | original model |"):
        assert text in section, text
    assert "class parallel (sensAI, ray pool)" in md and "class parallel (sensAI, triton pool)" in md


@pytest.mark.slow
def test_the_ray_pool_target_is_checked_on_the_run(all_systems):
    """Every model's target: the Ray pool within 2x the local one's p50 over http-v2, valued
    from the run's own figures; the Triton targets are the flagship's and not reported here."""
    _, result = all_systems
    checks = {c["name"]: c for s in result["targets"]["sets"] for c in s["checks"]}
    ray = checks["ray_vs_local_pool"]
    p50 = {k: result["strategies"][k]["transports"]["http-v2"]["latency_ms"]["p50"]
           for k in ("class-parallel", "class-parallel@ray")}
    assert ray["transport"] == "http-v2" and ray["limit"] == 2.0
    assert ray["value"] == pytest.approx(p50["class-parallel@ray"] / p50["class-parallel"], abs=1e-4)
    assert ray["status"] == ("met" if ray["value"] <= 2.0 else "not met")
    assert "p50(class parallel (sensAI, ray pool)) <= 2 x p50(class parallel)" == ray["rule"]
    assert "class_parallel_vs_triton_original" not in checks


def test_the_flagship_targets_against_triton():
    from sensai.bench.targets import TARGET_SETS, evaluate_targets

    sets = [s for s in TARGET_SETS if s.name == "sensai against Triton serving the original"]

    def rep(p50):
        return {"transports": {"http-v2": {"latency_ms": {"p50": p50}}}}

    result = {"model": "vgg16_bn", "strategies": {"class-parallel": rep(4.0)},
              "peers": {"triton": {**rep(12.0), "label": "Triton Inference Server"}},
              "comparison": {"transport": "http-v2", "rows": [
                  {"key": "class-parallel", "overhead_ms": 0.9},
                  {"key": "triton", "overhead_ms": 1.2}]}}
    checks = {c["name"]: c for s in evaluate_targets(result, sets)["sets"] for c in s["checks"]}
    vs = checks["class_parallel_vs_triton_original"]
    assert (vs["value"], vs["status"]) == (pytest.approx(1 / 3, abs=1e-4), "met")
    assert vs["rule"] == "p50(class parallel) <= 0.4 x p50(Triton Inference Server)"
    over = checks["overhead_vs_triton_ms"]
    assert (over["value"], over["status"]) == (pytest.approx(-0.3), "met")
    result["comparison"]["rows"][0]["overhead_ms"] = 1.5
    result["strategies"]["class-parallel"] = rep(5.0)
    checks = {c["name"]: c for s in evaluate_targets(result, sets)["sets"] for c in s["checks"]}
    assert checks["overhead_vs_triton_ms"]["status"] == "not met"
    assert checks["class_parallel_vs_triton_original"]["status"] == "not met"
    del result["comparison"]
    checks = {c["name"]: c for s in evaluate_targets(result, sets)["sets"] for c in s["checks"]}
    assert checks["overhead_vs_triton_ms"]["status"] == "not measured"
    assert "--peers triton" in checks["overhead_vs_triton_ms"]["why_not_measured"]
    # A run without the Triton peer is not judged against it; nor another model's run.
    assert evaluate_targets({**result, "peers": {}}, sets)["sets"] == []
    assert evaluate_targets({**result, "model": "resnet20"}, sets)["sets"] == []

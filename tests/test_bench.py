"""``sensai bench`` on a tiny artifact: well-formed outputs, consistent figures, clear errors.

Real components throughout: real Fashion-MNIST images, ONNX Runtime workers, the gateway under
uvicorn on 127.0.0.1 and an HTTP client. No timing is asserted (the CPU is shared); only that
every figure is there and agrees with what can be recomputed independently.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sensai.errors import CheckpointError, SensaiError

STRATS = ("single", "model-parallel", "class-parallel", "data-parallel")


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return Path(tiny_artifact)


@pytest.fixture(scope="module")
def short_run(artifact, tmp_path_factory):
    from sensai.serving.bench import run_bench

    out = tmp_path_factory.mktemp("bench_out")
    result = run_bench(artifact, out, workers=3, replicas=2, images=20, warmup=2, concurrency=2,
                       requests=6, rounds=2, isolated_images=2, progress=False,
                       command="test")
    return out, result


def test_outputs_are_written_and_well_formed(short_run):
    from PIL import Image

    out, result = short_run
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["strategies"].keys() == result["strategies"].keys() == set(STRATS)
    with Image.open(out / "bench.png") as img:
        assert img.format == "PNG" and img.size[0] > 400 and img.size[1] > 200
    md = (out / "bench.md").read_text()
    for text in ("## Latency", "## Where the time goes", "## Per worker", "## Targets",
                 "single device", "model parallel", "class parallel", "data parallel",
                 on_disk["machine"]["cpu_model"] or "Machine"):
        assert text in md
    assert sorted(p.name for p in (out / "models").glob("*.onnx")) == [
        "full.onnx", "stage_00.onnx", "stage_01.onnx", "stage_02.onnx"]
    assert not list(out.glob(".*.tmp"))

    m = on_disk["machine"]
    assert m["logical_cores"] >= 1 and m["memory_gb"] > 0 and isinstance(m["gpus"], list)
    for pkg in ("torch", "onnxruntime", "numpy", "ray", "fastapi"):
        assert m["versions"][pkg]
    assert on_disk["settings"]["stages"] == 3 and on_disk["settings"]["replicas"] == 2


def test_latency_figures_are_complete_and_consistent(short_run):
    _, result = short_run
    n = result["settings"]["images"]
    assert 15 <= n <= 20
    for key in STRATS:
        s = result["strategies"][key]
        assert set(s["transports"]) == {"inprocess", "http"}
        for t, rep in s["transports"].items():
            lat = rep["latency_ms"]
            assert lat["n"] == n == len(rep["latencies_ms"]) == rep["images"]
            assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
            mean = rep["breakdown_ms"]["mean"]
            # The parts add up to the latency, and compute is a real, positive part of it.
            assert 0 < mean["compute"] < lat["mean"]
            assert mean["merge"] >= 0
            parts = mean["compute"] + mean["merge"] + mean["transport"]
            assert parts == pytest.approx(lat["mean"], abs=1e-3)
            assert rep["throughput"]["requests"] == 6 and rep["throughput"]["images_per_s"] > 0
            assert rep["throughput"]["concurrency"] == 2
    workers = {k: len(result["strategies"][k]["transports"]["inprocess"]["per_worker_compute_ms"])
               for k in STRATS}
    # Every stage, subnet and replica really ran (least-busy dispatch spreads over replicas).
    assert workers == {"single": 1, "model-parallel": 3, "class-parallel": 5, "data-parallel": 2}
    cp = result["strategies"]["class-parallel"]
    assert set(cp["isolated_compute_ms"]) == {f"subnet_{i:02d}" for i in range(5)}


def test_accuracy_matches_an_independent_evaluation(short_run, artifact, fmnist_spec, fmnist_test):
    from sensai.pruning.decompose import evaluate_models, load_subnets
    from sensai.checkpoint import load_trained_model
    from sensai.data import stratified_subset
    from sensai.training.trainer import predict_logits, top1

    _, result = short_run
    idx = stratified_subset(fmnist_test.labels, 20, 0)
    manifest, subnets = load_subnets(artifact, "cpu")
    model, _ = load_trained_model(manifest.source.model_dir)
    want_full = top1(predict_logits(model, fmnist_test, fmnist_spec, torch.device("cpu"),
                                    indices=idx), fmnist_test.labels[idx])
    want_cp = evaluate_models(None, subnets, manifest.groups, fmnist_test, fmnist_spec,
                              torch.device("cpu"), indices=idx, progress=None)["decomposed_top1"]
    for key in STRATS:
        want = want_cp if key == "class-parallel" else want_full
        for t in ("inprocess", "http"):  # PNG over HTTP is lossless: the same answers
            assert result["strategies"][key]["transports"][t]["top1"] == pytest.approx(want)


def test_params_flops_and_memory_per_worker(short_run, artifact):
    from sensai.checkpoint import load_trained_model
    from sensai.flops import count_flops
    from sensai.manifest import load_manifest
    from sensai.models import count_params

    _, result = short_run
    manifest = load_manifest(artifact)
    model, _ = load_trained_model(manifest.source.model_dir)
    params, flops = count_params(model), count_flops(model, manifest.dataset.input_shape)
    s = result["strategies"]
    assert [w["params"] for w in s["single"]["per_worker"]] == [params]
    assert [w["flops"] for w in s["data-parallel"]["per_worker"]] == [flops, flops]
    mp = s["model-parallel"]["per_worker"]
    assert sum(w["params"] for w in mp) == params and sum(w["flops"] for w in mp) == flops
    assert [w["params"] for w in s["class-parallel"]["per_worker"]] == [
        r.params for r in manifest.subnets]
    assert [w["flops"] for w in s["class-parallel"]["per_worker"]] == [
        r.flops for r in manifest.subnets]
    for key in STRATS:
        mem = s[key]["memory"]
        assert mem["process_peak_rss_mb"] > 0
        assert mem["rss_growth_mb"] is not None  # Linux: /proc/self/statm
        for w in s[key]["per_worker"]:
            assert w["weights_mb"] > 0 and w["activations_mb"] > 0 and "rss_load_mb" in w
            assert w["runtime"] == "onnx" and w["device"] == "cpu" and w["threads"] == 1


def test_targets_are_stated(short_run):
    _, result = short_run
    t = result["targets"]
    assert t["transport"] == "http" and t["statistic"] == "p50"
    names = [c["name"] for c in t["checks"]]
    assert names == ["class_parallel_vs_single", "class_parallel_vs_model_parallel",
                     "fanout_overhead_ms"]
    s = result["strategies"]
    p50 = {k: s[k]["transports"]["http"]["latency_ms"]["p50"] for k in STRATS}
    ratio = t["checks"][0]["value"]
    assert ratio == pytest.approx(p50["class-parallel"] / p50["single"], rel=1e-3)
    for c in t["checks"]:
        assert isinstance(c["met"], bool) and c["met"] == (c["value"] <= c["limit"])
    assert t["note"]  # a fmnist_cnn artifact: the VGG-16-bn targets are for orientation only


def test_model_parallel_predictor_answers_like_the_single_device(artifact, fmnist_spec,
                                                                 fmnist_test, tmp_path):
    """The pipeline's scores through ONNX stages on workers == the whole model on one worker."""
    import asyncio

    from sensai.checkpoint import load_trained_model
    from sensai.data import iterate_batches, normalize
    from sensai.export import export_onnx
    from sensai.manifest import load_manifest
    from sensai.stages import export_stage_onnx, split_model
    from sensai.serving.baselines import (ModelParallelPredictor, SingleDevicePredictor, build_workers,
                                   softmax_scores)
    from sensai.serving.pools import RunnerSpec

    manifest = load_manifest(artifact)
    model, _ = load_trained_model(manifest.source.model_dir)
    u8, _ = next(iterate_batches(fmnist_test, 8, indices=np.arange(8)))
    x = normalize(u8, fmnist_spec)
    export_onnx(model, fmnist_spec.input_shape, tmp_path / "full.onnx", check_batch=x)
    stages, _ = split_model(model, 4, x)
    specs, h = [], x
    for i, st in enumerate(stages):
        export_stage_onnx(st, h, tmp_path / f"s{i}.onnx")
        specs.append(RunnerSpec(name=f"stage_{i}", input_shape=tuple(h.shape[1:]),
                                onnx_path=str(tmp_path / f"s{i}.onnx"), runtime="onnx"))
        with torch.no_grad():
            h = st(h.clone())
    full = build_workers(["full"], [RunnerSpec(name="full", input_shape=fmnist_spec.input_shape,
                                               onnx_path=str(tmp_path / "full.onnx"),
                                               runtime="onnx")])
    mp = build_workers([s.name for s in specs], specs)
    single = SingleDevicePredictor(full[0], fmnist_spec)
    pipeline = ModelParallelPredictor(mp, fmnist_spec, name="mp")

    async def both():
        try:
            return await single.predict(x.numpy()), await pipeline.predict(x.numpy())
        finally:
            await single.close()
            await pipeline.close()

    a, b = asyncio.run(both())
    with torch.no_grad():
        want = softmax_scores(model(x.clone()).numpy())
    np.testing.assert_allclose(a.scores, want, atol=1e-5)
    np.testing.assert_allclose(b.scores, want, atol=1e-5)
    # Compute is clocked per stage, inside the workers, and adds up on the critical path.
    stage_ms = [b.timings_ms[f"compute.stage_{i}"] for i in range(4)]
    assert all(ms > 0 for ms in stage_ms)
    assert b.timings_ms["compute"] == pytest.approx(sum(stage_ms), abs=1e-3)
    assert b.timings_ms["compute"] <= b.timings_ms["total"]


def test_cli_in_process_only(artifact, tmp_path, capsys):
    from sensai.cli import main

    out = tmp_path / "cli"
    code = main(["bench", str(artifact), "--out", str(out), "--images", "8", "--warmup", "1",
                 "--rounds", "1", "--concurrency", "2", "--requests", "4", "--no-http",
                 "--strategies", "single", "class-parallel", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "class parallel (sensAI)" in printed and "bench.json" in printed
    result = json.loads((out / "bench.json").read_text())
    assert set(result["strategies"]) == {"single", "class-parallel"}
    assert result["command"].startswith(f"sensai bench {artifact} --out {out}")
    assert "--no-http" in result["command"]
    check = {c["name"]: c for c in result["targets"]["checks"]}
    # Over HTTP nothing was measured, so no target can be claimed either way.
    assert all(c["met"] is None and c["why_not_measured"] for c in check.values())
    assert (out / "bench.png").is_file() and (out / "bench.md").is_file()


@pytest.mark.parametrize("kwargs, match", [
    ({"images": 0}, "--images"),
    ({"concurrency": 0}, "--concurrency"),
    ({"strategies": ["single", "pipeline"]}, "unknown strategy"),
    ({"transports": []}, "transports"),
    ({"workers": 1000}, "at most"),
    ({"runtime": "tensorrt"}, "runtime"),
])
def test_bad_settings_fail_fast(artifact, tmp_path, kwargs, match):
    from sensai.serving.bench import run_bench

    with pytest.raises(SensaiError, match=match):
        run_bench(artifact, tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out" / "bench.json").exists()


def test_missing_original_model_is_a_clear_error(artifact, tmp_path):
    import shutil

    from sensai.manifest import load_manifest, save_manifest
    from sensai.serving.bench import run_bench

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    m = load_manifest(art)
    save_manifest(art, m.model_copy(update={"source": m.source.model_copy(
        update={"model_dir": str(tmp_path / "gone")})}))
    with pytest.raises(CheckpointError, match="original model"):
        run_bench(art, tmp_path / "out", progress=False)


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    from sensai.cli import main

    assert main(["bench", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "sensai bench: error:" in err and "Traceback" not in err


def test_http_client_process_reports_a_dead_gateway(fmnist_test):
    """The client lives in its own process; a failure there comes back as an error, not a hang."""
    import socket

    from sensai.data import encode_png
    from sensai.serving.http_client import HttpClientProcess

    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HttpClientProcess([encode_png(fmnist_test[0][0])])
    try:
        with pytest.raises(RuntimeError, match="ConnectError"):
            client.sequential(f"http://127.0.0.1:{port}", [0])
        with pytest.raises(RuntimeError, match="ConnectError"):
            client.concurrent(f"http://127.0.0.1:{port}", 2, 2)
    finally:
        client.close()
    assert not client._proc.is_alive()

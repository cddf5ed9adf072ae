"""``sensai bench`` and ``sensai bench-robust`` on a tiny artifact: well-formed outputs, consistent
figures, the artifact's accuracy beside the latencies, per-model targets, clear errors.

Real components throughout: real Fashion-MNIST images, ONNX Runtime on thread workers, the
predictor ``sensai serve`` builds, the gateway under uvicorn on 127.0.0.1 (and its gRPC server)
and an HTTP/gRPC client in its own process.  No timing is asserted (the CPU is shared); only
that every figure is there and agrees with what can be recomputed independently.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sensai.errors import CheckpointError, SensaiError
from sensai.serving.core.faults import Faults
from sensai.serving.core.settings import GatewaySettings

STRATS = ("single", "model-parallel", "class-parallel", "data-parallel")
TRANSPORTS = ("inprocess", "http", "http-v2", "grpc")
REMOTE = TRANSPORTS[1:]


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return Path(tiny_artifact)


@pytest.fixture(scope="module")
def short_run(artifact, tmp_path_factory):
    from sensai.bench.latency import run_bench
    from sensai.bench.options import BenchOptions

    out = tmp_path_factory.mktemp("bench_out")
    result = run_bench(artifact, out, BenchOptions(
        workers=3, replicas=2, images=20, warmup=2, concurrency=2, requests=6, rounds=2,
        isolated_images=2, progress=False, command="test"))
    return out, result


def test_outputs_are_written_and_well_formed(short_run):
    from PIL import Image

    out, result = short_run
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["kind"] == "sensai-bench" and on_disk["command"] == "test"
    assert on_disk["strategies"].keys() == result["strategies"].keys() == set(STRATS)
    # Host tuning is opt-in, and recorded either way.
    machine = on_disk["machine"]
    assert machine["spread_cores"] is False and "held" in machine["cores_awake"]
    with Image.open(out / "bench.png") as img:
        assert img.format == "PNG" and img.size[0] > 400 and img.size[1] > 200
    md = (out / "bench.md").read_text()
    for text in ("## Accuracy and size", "## Latency", "## Where the time goes", "## Per worker",
                 "## Targets", "single device", "model parallel", "class parallel",
                 "class parallel (sensAI): subnets side by side in",
                 "data parallel", "each subnet alone", "Model-parallel cut: 3 stages",
                 on_disk["machine"]["cpu_model"] or "Machine"):
        assert text in md
    assert sorted(p.name for p in (out / "models").glob("*.onnx")) == [
        "full.onnx", "stage_00.onnx", "stage_01.onnx", "stage_02.onnx"]
    assert not list(out.glob(".*.tmp"))

    m = on_disk["machine"]
    assert m["logical_cores"] >= 1 and m["memory_gb"] > 0 and isinstance(m["gpus"], list)
    assert m["load_average"] and m["load_average_end"]
    for pkg in ("torch", "onnxruntime", "numpy", "ray", "fastapi"):
        assert m["versions"][pkg]
    from sensai.bench.machine import cpu_idle

    assert m["cpu_idle"] == cpu_idle()  # this machine's, as sysfs says
    if m["cpu_idle"]:
        assert f"cpuidle driver {m['cpu_idle']['driver']}" in md

    # Host tuning is opt-in: by default the run leaves the host's idle policy alone.
    assert m["cores_awake"]["mode"] == "off" and m["cores_awake"]["held"] is False
    assert "idle cores not kept awake" in md
    st = on_disk["settings"]
    assert st["stages"] == 3 and st["replicas"] == 2 and st["class_parallel_backend"] == "local"
    assert on_disk["stage_plan"]["num_stages"] == 3


def test_latency_figures_are_complete_and_consistent(short_run):
    _, result = short_run
    n = result["settings"]["images"]
    assert 15 <= n <= 20
    for key in STRATS:
        s = result["strategies"][key]
        assert set(s["transports"]) == set(TRANSPORTS)
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
            # Critical path <= all the work: equal for one worker, the slowest subnet for G.
            assert rep["compute_sum_ms"]["mean"] >= mean["compute"] - 1e-3
    workers = {k: len(result["strategies"][k]["transports"]["inprocess"]["per_worker_compute_ms"])
               for k in STRATS}
    # Every stage, subnet and replica really ran (least-busy dispatch spreads over replicas).
    assert workers == {"single": 1, "model-parallel": 3, "class-parallel": 5, "data-parallel": 2}
    cp = result["strategies"]["class-parallel"]
    names = {f"subnet_{i:02d}" for i in range(5)}
    assert set(cp["transports"]["http"]["per_worker_compute_ms"]) == names
    assert set(cp["isolated_compute_ms"]) == names
    assert all(v["n"] == 2 for v in cp["isolated_compute_ms"].values())
    p50s = [v["p50"] for v in cp["isolated_compute_ms"].values()]
    assert cp["isolated_compute_ms_p50_max"] == pytest.approx(max(p50s), abs=1e-3)
    assert cp["isolated_compute_ms_p50_sum"] == pytest.approx(sum(p50s), abs=1e-3)
    cores = result["machine"]["usable_cores"]
    assert cp["core_bound_floor_ms"] == pytest.approx(max(max(p50s), sum(p50s) / cores),
                                                      abs=1e-3)
    # Whether the subnets computed at the same time, request by request, for class parallel
    # only (the baselines' timings have no subnet arrivals).
    for key in STRATS:
        for t, rep in result["strategies"][key]["transports"].items():
            if key != "class-parallel":
                assert rep["side_by_side"] is None, (key, t)
            else:
                assert rep["side_by_side"]["requests"] == n
                assert 0 <= rep["side_by_side"]["share"] <= 1


def test_side_by_side_tells_parallel_from_one_after_the_other():
    from sensai.bench.latency_report import side_by_side_lines
    from sensai.bench.stats import Samples, side_by_side

    # Arrivals (ms from the request's start) and compute: 0.1-0.6 and 0.15-0.65 overlap...
    parallel = {"subnet_00": 0.6, "compute.subnet_00": 0.5, "subnet_01": 0.65,
                "compute.subnet_01": 0.5, "compute": 0.5}
    # ...0.1-0.6 then 0.62-1.12 do not: the second subnet waited for the first one's core.
    serial = dict(parallel, subnet_01=1.12)
    assert side_by_side(parallel) is True and side_by_side(serial) is False
    assert side_by_side({"compute.stage_0": 1.0, "compute": 1.0}) is None  # no arrivals
    samples = Samples()
    for timings in (parallel, parallel, parallel, serial):
        samples.add(1.0, timings, True)
    rep = samples.report()
    assert rep["side_by_side"] == {"requests": 4, "share": 0.75}
    result = {"machine": {"usable_cores": 2}, "strategies": {"class-parallel": {
        "workers": 2, "transports": {"inprocess": rep}}}}
    assert side_by_side_lines(result) == [
        "class parallel (sensAI): subnets side by side in 75% of requests inprocess (the others "
        "computed one after the other: the kernel put two workers on one core)"]


@pytest.mark.parametrize("poll, noted", [("0\n", True), ("200000\n", False), (None, False)])
def test_idle_cores_that_halt_at_once_are_noted(tmp_path, poll, noted):
    from sensai.bench.latency_report import idle_lines, idle_text
    from sensai.bench.machine import cpu_idle

    assert cpu_idle(str(tmp_path)) is None  # no cpuidle in this sysfs: nothing to say
    base = tmp_path / "devices/system/cpu/cpuidle"
    base.mkdir(parents=True)
    (base / "current_driver").write_text("haltpoll\n")
    (base / "current_governor_ro").write_text("haltpoll\n")
    if poll is not None:
        params = tmp_path / "module/haltpoll/parameters"
        params.mkdir(parents=True)
        (params / "guest_halt_poll_ns").write_text(poll)
    idle = cpu_idle(str(tmp_path))
    assert idle == {"driver": "haltpoll", "governor": "haltpoll",
                    "guest_halt_poll_ns": None if poll is None else int(poll)}
    assert idle_text(idle).startswith("; idle cores: cpuidle driver haltpoll, governor haltpoll")
    lines = idle_lines({"machine": {"cpu_idle": idle}})
    assert bool(lines) is noted
    if noted:
        assert "halts at once" in lines[0] and "deploy/README.md" in lines[0]
    # Cores kept awake for the run: none of them halted, nothing to note.
    held = {"mode": "auto", "held": True, "latency_us": 0, "detail": "x"}
    assert idle_lines({"machine": {"cpu_idle": idle, "cores_awake": held}}) == []
    assert idle_text(idle, held).endswith("; idle cores kept awake for the run (wake-up latency "
                                          "0 us)")


def test_remote_transports_are_timed_against_their_floor(short_run):
    """http, http-v2 and grpc: each request paired with the same client's bare request to the
    same server just before it; p50(latency - bare - compute) per strategy and transport."""
    from sensai.bench.latency_report import render_table

    out, result = short_run
    n = result["settings"]["images"]
    assert result["settings"]["transports"] == list(TRANSPORTS)
    for key in STRATS:
        reps = result["strategies"][key]["transports"]
        assert reps["inprocess"]["floor_ms"] is None and "floors_ms" not in reps["inprocess"]
        assert reps["inprocess"]["breakdown_ms"]["p50"]["latency_minus_floor_minus_compute"] \
            is None
        for t in REMOTE:
            rep = reps[t]
            assert len(rep["floors_ms"]) == len(rep["latencies_ms"]) == rep["floor_ms"]["n"] == n
            assert 0 < rep["floor_ms"]["min"] <= rep["floor_ms"]["p50"] <= rep["floor_ms"]["max"]
            p50 = rep["breakdown_ms"]["p50"]
            # Every floor is > 0, so the median of the differences is below the other median.
            assert p50["latency_minus_floor_minus_compute"] < p50["latency_minus_compute"]
            assert rep["throughput"]["requests"] == 6
    md = (out / "bench.md").read_text()
    for heading in ("### in process (`inprocess`)", "### HTTP, PNG upload (`http`)",
                    "### HTTP, KServe v2 binary tensor (`http-v2`)", "### gRPC, KServe v2 (`grpc`)",
                    "`GET /v2/health/live`", "`ServerLive`", "p50(lat - bare - compute)",
                    "bare GET - slowest subnet's compute) <= 0.5 ms"):
        assert heading in md
    assert "grpc" in render_table(result) and "http-v2" in render_table(result)


def test_accuracy_matches_an_independent_evaluation(short_run, artifact, fmnist_spec, fmnist_test):
    from sensai.artifact import load_artifact
    from sensai.checkpoint import load_trained_model
    from sensai.data import stratified_subset
    from sensai.learning import predict_logits, top1
    from sensai.pruning.decompose import evaluate_models

    _, result = short_run
    idx = stratified_subset(fmnist_test.labels, 20, 0)
    art = load_artifact(artifact)
    subnets = art.load_subnets("cpu")
    model, _ = load_trained_model(art.manifest.source.model_dir)
    want_full = top1(predict_logits(model, fmnist_test, fmnist_spec, torch.device("cpu"),
                                    indices=idx), fmnist_test.labels[idx])
    want_cp = evaluate_models(None, subnets, art.groups, fmnist_test, fmnist_spec,
                              torch.device("cpu"), indices=idx, progress=None)["decomposed_top1"]
    for key in STRATS:
        want = want_cp if key == "class-parallel" else want_full
        for t in TRANSPORTS:  # PNG is lossless, tensors are sent as they are: the same answers
            assert result["strategies"][key]["transports"][t]["top1"] == pytest.approx(want)
    on_bench = result["accuracy"]["on_bench_images"]
    assert on_bench == {"images": 20, "original_top1": pytest.approx(want_full),
                        "decomposed_top1": pytest.approx(want_cp)}


def test_bench_json_carries_accuracy_and_latency(short_run, artifact, fmnist_spec, fmnist_test):
    """One file shows speed and accuracy: the artifact's top-1 (original, decomposed, delta),
    re-measured here on the test images it names, and its shrink."""
    from sensai.artifact import load_artifact
    from sensai.checkpoint import load_trained_model
    from sensai.data import stratified_subset
    from sensai.pruning.decompose import evaluate_models

    out, _ = short_run
    on_disk = json.loads((out / "bench.json").read_text())
    acc, shrink = on_disk["accuracy"], on_disk["shrink"]
    assert on_disk["strategies"]["class-parallel"]["transports"]["http"]["latency_ms"]["p50"] > 0
    # The fixture's decomposition evaluated on a stratified subset of 500 test images (seed 0).
    assert acc["split"] == "test" and acc["images"] == acc["limit"] == 500
    assert "500 images" in acc["measured_on"] and "fashion-mnist" in acc["measured_on"]
    art = load_artifact(artifact)
    model, _ = load_trained_model(art.manifest.source.model_dir)
    idx = stratified_subset(fmnist_test.labels, 500, 0)
    want = evaluate_models(model, art.load_subnets("cpu"), art.groups, fmnist_test, fmnist_spec,
                           torch.device("cpu"), indices=idx, progress=None)
    assert acc["original_top1"] == pytest.approx(want["original_top1"], abs=1e-5)
    assert acc["decomposed_top1"] == pytest.approx(want["decomposed_top1"], abs=1e-5)
    assert acc["delta_points"] == pytest.approx(
        100 * (want["decomposed_top1"] - want["original_top1"]), abs=1e-2)
    assert acc["original_top1_at_training"] == pytest.approx(art.manifest.source.test_top1)

    src = art.manifest.source
    assert shrink["original"] == {"params": src.params, "flops": src.flops}
    assert shrink["largest_subnet"]["params"] == max(s.params for s in art.manifest.subnets)
    assert shrink["largest_subnet"]["flops"] == max(s.flops for s in art.manifest.subnets)
    assert shrink["params_ratio"] == pytest.approx(
        src.params / shrink["largest_subnet"]["params"], rel=1e-3)
    assert shrink["params_ratio"] > 1 and shrink["flops_ratio"] > 1
    md = (out / "bench.md").read_text()
    assert f"{acc['original_top1']:.4f}" in md and f"{acc['decomposed_top1']:.4f}" in md
    assert "500 images" in md


def test_params_flops_and_memory_per_strategy(short_run, artifact):
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
    # Class parallel is the serving predictor: one thread worker per subnet (r = 0).
    cp = s["class-parallel"]
    assert cp["backend"] == "local"
    assert [w["worker"] for w in cp["per_worker"]] == [f"worker_{i:02d}" for i in range(5)]
    assert [w["classes"] for w in cp["per_worker"]] == manifest.groups
    for key in STRATS:
        mem = s[key]["memory"]
        assert mem["process_peak_rss_mb"] > 0
        assert mem["rss_growth_mb"] is not None  # Linux: /proc/self/statm
        assert mem["cuda"] == {}  # CPU only
        for w in s[key]["per_worker"]:
            assert w["weights_mb"] > 0 and w["activations_mb"] > 0
            assert w["runtime"] == "onnx" and w["device"] == "cpu" and w["threads"] == 1


def test_targets_are_stated(short_run):
    _, result = short_run
    t = result["targets"]
    assert t["model"] == "fmnist_cnn" and t["statistic"] == "p50"
    # Only the sets for every model apply to a fmnist_cnn artifact.
    unit = "the device as the unit: serving adds little to one call of every subnet"
    assert [s["name"] for s in t["sets"]] == [unit, "fan-out overhead",
                                              "overhead above each transport's floor"]
    # Issue 60: class parallel against one call of every subnet, measured in the same run.
    one = result["strategies"]["class-parallel"]["one_call"]
    assert one["subnets"] == 5 and one["device"] == "cpu" and one["ms"]["p50"] > 0
    cp = result["strategies"]["class-parallel"]["transports"]
    over = {c["name"]: c for c in t["sets"][0]["checks"]}
    gap = cp["http-v2"]["latency_ms"]["p50"] - one["ms"]["p50"]
    ratio = cp["inprocess"]["latency_ms"]["p50"] / one["ms"]["p50"]
    # A reference slower than the served request beyond the margin was disturbed (a busy
    # machine): not measured rather than met.
    for name, raw, low in (("over_one_call_http_v2_ms", gap, -0.35),
                           ("inprocess_vs_one_call", ratio, 1 / 1.1)):
        if raw < low:
            assert over[name]["met"] is None and "quiet machine" in over[name]["why_not_measured"]
            over.pop(name)
        else:
            assert over[name]["value"] == pytest.approx(raw, rel=1e-3, abs=1e-3)
    assert {c["limit"] for c in t["sets"][0]["checks"]} == {0.35, 1.1}
    assert "One call of every subnet (5 on one device" in (short_run[0] / "bench.md").read_text()
    (check,) = t["sets"][1]["checks"]
    assert check["name"] == "fanout_overhead_ms" and check["transport"] == "http"
    assert check["value"] == cp["http"]["breakdown_ms"]["p50"]["latency_minus_compute"]
    assert check["inprocess_value"] == cp["inprocess"]["breakdown_ms"]["p50"][
        "latency_minus_compute"]
    # Per transport, against the same client's bare request on the same server.
    per = {c["name"]: c for c in t["sets"][2]["checks"]}
    assert {n: (c["transport"], c["limit"]) for n, c in per.items()} == {
        "over_floor_http_v2_ms": ("http-v2", 0.5), "over_floor_png_upload_ms": ("http", 0.8),
        "fanout_overhead_inprocess_ms": ("inprocess", 0.15)}
    for name, key in (("over_floor_http_v2_ms", "http-v2"), ("over_floor_png_upload_ms", "http")):
        assert per[name]["value"] == cp[key]["breakdown_ms"]["p50"][
            "latency_minus_floor_minus_compute"]
        assert "bare GET" in per[name]["rule"] and per[name]["reference_transport"] == "inprocess"
    assert per["fanout_overhead_inprocess_ms"]["value"] == cp["inprocess"]["breakdown_ms"][
        "p50"]["latency_minus_compute"]
    checks = [*over.values(), check, *per.values()]
    for c in checks:
        assert isinstance(c["met"], bool) and c["met"] == (c["value"] <= c["limit"])
        assert c["status"] == ("met" if c["met"] else "not met")
    assert t["all_met"] == all(c["met"] for c in checks)


def test_a_disturbed_one_call_reference_is_not_read_as_met(short_run):
    from sensai.bench.targets import evaluate_targets

    _, result = short_run
    served = result["strategies"]["class-parallel"]["transports"]["http-v2"]["latency_ms"]["p50"]

    def judged(reference_ms: float) -> dict:
        r = copy.deepcopy(result)
        r["strategies"]["class-parallel"]["one_call"]["ms"]["p50"] = reference_ms
        sets = evaluate_targets(r)["sets"]
        return {c["name"]: c for s in sets for c in s["checks"]}["over_one_call_http_v2_ms"]

    # Slower than the served request beyond the margin: another process had its cores.
    slow = judged(served + 2.0)
    assert slow["met"] is None and slow["value"] is None and slow["status"] == "not measured"
    assert "rerun on a quiet machine" in slow["why_not_measured"]
    # Within the margin either way, the gap is the value.
    assert judged(served + 0.2)["value"] == pytest.approx(-0.2, abs=1e-3)
    near = judged(served - 0.1)
    assert near["value"] == pytest.approx(0.1, abs=1e-3) and near["met"] is True


def test_targets_of_another_model_are_not_reported(short_run):
    from sensai.bench.latency_report import render_markdown, render_table
    from sensai.bench.targets import (EVERY_MODEL, FANOUT_OVERHEAD, TARGET_SETS, Target,
                                      TargetSet, evaluate_targets, ratio)

    out, result = short_run
    md, table = (out / "bench.md").read_text(), render_table(result)
    vgg = [s for s in TARGET_SETS if s.models in (("vgg16_bn",), ("vgg11_bn",))]
    # Today's sets for VGG-16-bn (against the baselines, on a GPU, against Triton) and the demo
    # model.
    assert len(vgg) == 4
    for tset in vgg:
        for target in tset.targets:
            rule = target.measure.rule(target.limit)
            assert rule not in md and rule not in table
        assert tset.name not in md
    assert "x p50(single device)" not in md

    # The same figures from a VGG-16-bn artifact would be checked against its set.
    as_vgg = dict(copy.deepcopy(result), model="vgg16_bn")
    checks = {c["name"]: c for s in evaluate_targets(as_vgg)["sets"] for c in s["checks"]}
    assert set(checks) == {"class_parallel_vs_single", "class_parallel_vs_model_parallel",
                           "accuracy_loss_points", "fanout_overhead_ms", "over_floor_http_v2_ms",
                           "over_floor_png_upload_ms", "fanout_overhead_inprocess_ms",
                           "over_one_call_http_v2_ms", "inprocess_vs_one_call"}
    p50 = {k: result["strategies"][k]["transports"]["http"]["latency_ms"]["p50"] for k in STRATS}
    assert checks["class_parallel_vs_single"]["value"] == pytest.approx(
        p50["class-parallel"] / p50["single"], rel=1e-3)
    assert checks["class_parallel_vs_single"]["limit"] == 0.35
    # Accuracy is checked from the same bench.json: points lost against the original.
    loss = checks["accuracy_loss_points"]
    assert loss["value"] == pytest.approx(-result["accuracy"]["delta_points"], abs=1e-3)
    assert loss["limit"] == 0.5 and loss["met"] == (loss["value"] <= 0.5)

    # The demo model's set: its own limit, never VGG-16-bn's.
    as_demo = dict(copy.deepcopy(result), model="vgg11_bn")
    demo = {c["name"]: c for s in evaluate_targets(as_demo)["sets"] for c in s["checks"]}
    assert demo["class_parallel_vs_single"]["limit"] == 0.7
    assert "class_parallel_vs_model_parallel" not in demo and "accuracy_loss_points" in demo
    no_acc = dict(copy.deepcopy(as_demo), accuracy={"delta_points": None})
    (gone,) = [c for s in evaluate_targets(no_acc)["sets"] for c in s["checks"]
               if c["name"] == "accuracy_loss_points"]
    assert gone["met"] is None and "top-1" in gone["why_not_measured"]
    # What `sensai demo` prints: the demo model's own targets only.
    as_demo["targets"] = evaluate_targets(as_demo)
    printed = render_table(as_demo, model_targets_only=True)
    assert "<= 0.7 x p50(single device)" in printed and "points" in printed
    assert "bare GET" not in printed and "bare GET" in render_table(as_demo)

    # A table extended with another model's set: never reported for this one.
    table = (*TARGET_SETS,
             TargetSet("resnet20 only", models=("resnet20",), targets=(
                 Target("resnet_ratio", ratio("class-parallel", "data-parallel"), 0.123457),)),
             TargetSet("tight fan-out", models=EVERY_MODEL, targets=(
                 Target("tight", FANOUT_OVERHEAD, 0.001),)))
    mine = copy.deepcopy(result)
    mine["targets"] = evaluate_targets(mine, table)
    assert [s["name"] for s in mine["targets"]["sets"]] == [
        "the device as the unit: serving adds little to one call of every subnet",
        "fan-out overhead", "overhead above each transport's floor", "tight fan-out"]
    text = render_markdown(mine)
    assert "tight fan-out" in text and "resnet20 only" not in text
    # Six digits: a measured figure of three decimals may read 0.123.
    assert "0.123457" not in text
    assert mine["targets"]["all_met"] is False  # 1 us of overhead is never met

    # The GPU sets: only for runs on CUDA; the flagship's only on its dataset, the 224 one only
    # for inputs that large.  The graph floor comes from the run's replay times.
    on_gpu = dict(copy.deepcopy(result), model="vgg16_bn")
    assert not any("GPU" in s["name"] for s in evaluate_targets(on_gpu)["sets"])
    on_gpu["settings"]["device_resolved"] = "cuda:0"
    on_gpu["strategies"]["class-parallel"]["graph_replay_ms_max"] = 0.25
    sets = {s["name"]: s for s in evaluate_targets(on_gpu)["sets"]}
    flagship = {c["name"]: c for c in sets["on a GPU: the flagship decomposed there"]["checks"]}
    p50 = on_gpu["strategies"]["class-parallel"]["transports"]["inprocess"]["latency_ms"]["p50"]
    assert flagship["over_graph_replay_ms"]["value"] == pytest.approx(p50 - 0.25, abs=1e-3)
    assert flagship["largest_subnet_params"]["value"] == pytest.approx(
        1 / result["shrink"]["params_ratio"], abs=1e-3)
    assert "on a GPU at 224x224: compute, not launches" not in sets
    big = dict(copy.deepcopy(on_gpu), input_shape=[1, 224, 224], dataset="imagefolder")
    names = [s["name"] for s in evaluate_targets(big)["sets"]]
    assert "on a GPU at 224x224: compute, not launches" in names
    assert "on a GPU: the flagship decomposed there" not in names


def test_model_parallel_predictor_answers_like_the_single_device(artifact, fmnist_spec,
                                                                 fmnist_test, tmp_path):
    """The pipeline's scores through ONNX stages on thread workers == the whole model on one."""
    import asyncio

    from sensai.bench.baselines import ModelParallel, SingleDevice, WorkerSet, softmax_scores
    from sensai.bench.stages import export_stage_onnx, split_model
    from sensai.checkpoint import load_trained_model
    from sensai.data import iterate_batches, normalize
    from sensai.export import export_onnx
    from sensai.fsutil import sha256_file
    from sensai.manifest import load_manifest
    from sensai.serving.workers.runners import RunnerSpec

    def onnx_spec(name, shape, path):
        return RunnerSpec(name=name, input_shape=tuple(shape), onnx_path=str(path),
                          onnx_sha256=sha256_file(path), runtime="onnx")

    manifest = load_manifest(artifact)
    model, _ = load_trained_model(manifest.source.model_dir)
    u8, _ = next(iterate_batches(fmnist_test, 8, indices=np.arange(8)))
    x = normalize(u8, fmnist_spec)
    export_onnx(model, fmnist_spec.input_shape, tmp_path / "full.onnx", check_batch=x)
    stages, _ = split_model(model, 4, x)
    specs, h = [], x
    for i, st in enumerate(stages):
        export_stage_onnx(st, h, tmp_path / f"s{i}.onnx")
        specs.append(onnx_spec(f"stage_{i}", h.shape[1:], tmp_path / f"s{i}.onnx"))
        with torch.no_grad():
            h = st(h.clone())
    single = SingleDevice(WorkerSet(["full"], [onnx_spec("full", fmnist_spec.input_shape,
                                                         tmp_path / "full.onnx")]),
                          fmnist_spec, "single")
    pipeline = ModelParallel(WorkerSet([s.name for s in specs], specs), fmnist_spec, "mp")
    assert single.is_ready() and pipeline.is_ready()

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
    assert set(a.timings_ms) == {"compute.full", "compute", "compute_sum", "merge", "total"}
    assert not single.is_ready()  # closed


class _Slow(torch.nn.Module):
    """Answers its input after a pause: a worker that misses its deadline."""

    def __init__(self, pause_s: float):
        super().__init__()
        self.pause_s = pause_s

    def forward(self, x):
        import time

        time.sleep(self.pause_s)
        return x.flatten(1)


def test_baselines_keep_the_deadline_like_the_predictor(fmnist_spec):
    """A late worker is a 504 for the caller (the gateway's remaining deadline, or the
    predictor's own), and the next request is answered normally."""
    import asyncio

    from sensai.bench.baselines import SingleDevice, WorkerSet
    from sensai.serving.workers.runners import RunnerSpec
    from sensai.serving.core.errors import SubnetTimeout

    shape = (1, 2, 2)
    slow = SingleDevice(WorkerSet(["slow"], [RunnerSpec("slow", shape, module=_Slow(0.3))],
                                  GatewaySettings(deadline_s=5.0)), fmnist_spec, "single")
    x = np.zeros((1, *shape), dtype=np.float32)

    async def run():
        try:
            # The time it was given is what was left of the 0.05 s when it was asked: a hair
            # less on a busy machine.
            given = r"slow gave no answer within 0\.0(5|4\d*) s"
            with pytest.raises(SubnetTimeout, match=given) as e:
                await slow.predict(x, deadline=asyncio.get_running_loop().time() + 0.05)
            assert e.value.status == 504
            return await slow.predict(x)
        finally:
            await slow.close()

    pred = asyncio.run(run())
    # The late run of the first request was dropped; this one's answer is its own.
    np.testing.assert_allclose(pred.scores, np.full((1, 4), 0.25), atol=1e-6)
    assert pred.timings_ms["compute"] > 0


def test_cli_in_process_only(artifact, tmp_path, capsys):
    from sensai.cli import main

    out = tmp_path / "cli"
    code = main(["bench", str(artifact), "--out", str(out), "--images", "8",
                 "--set", "warmup=1", "--set", "rounds=1", "--concurrency", "2",
                 "--requests", "4", "--transports", "inprocess",
                 "--strategies", "single", "class-parallel"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "class parallel (sensAI)" in printed and "bench.json" in printed
    assert "accuracy (from the artifact" in printed
    result = json.loads((out / "bench.json").read_text())
    assert set(result["strategies"]) == {"single", "class-parallel"}
    assert all(set(s["transports"]) == {"inprocess"} for s in result["strategies"].values())
    # The command that reproduces the run: the arguments given, none of the defaults.
    assert result["command"].startswith(f"sensai bench {artifact} --out {out} ")
    for given in ("--images 8", "--set rounds=1", "--strategies single class-parallel",
                  "--transports inprocess"):
        assert given in result["command"]
    assert "threads" not in result["command"] and "seed" not in result["command"]
    checks = [c for s in result["targets"]["sets"] for c in s["checks"]]
    # Over HTTP nothing was measured, so no target there can be claimed either way.
    remote = [c for c in checks if c["transport"] != "inprocess"]
    assert remote and all(c["met"] is None and c["status"] == "not measured"
                          and c["why_not_measured"] for c in remote)
    local = {c["name"]: c for c in checks if c["transport"] == "inprocess"}
    assert set(local) == {"fanout_overhead_inprocess_ms", "inprocess_vs_one_call"}
    assert all(isinstance(c["met"], bool) for c in local.values())
    assert result["targets"]["all_met"] is None
    assert (out / "bench.png").is_file() and (out / "bench.md").is_file()
    assert not (out / "models").exists() or not list((out / "models").glob("stage_*.onnx"))


def test_cli_transports_flag(artifact, tmp_path):
    """--transports picks the ways of calling; the targets on the others are not measured."""
    from sensai.cli import main

    out = tmp_path / "cli"
    assert main(["bench", str(artifact), "--out", str(out), "--images", "4",
                 "--set", "warmup=1", "--set", "rounds=1", "--concurrency", "2", "--requests",
                 "2", "--strategies", "class-parallel", "--transports", "grpc", "http-v2"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["settings"]["transports"] == ["http-v2", "grpc"]  # canonical order
    rep = result["strategies"]["class-parallel"]["transports"]
    assert set(rep) == {"http-v2", "grpc"} and all(r["top1"] is not None for r in rep.values())
    assert "--transports grpc http-v2" in result["command"]
    checks = {c["name"]: c for s in result["targets"]["sets"] for c in s["checks"]}
    assert isinstance(checks["over_floor_http_v2_ms"]["met"], bool)
    assert checks["over_floor_png_upload_ms"]["status"] == "not measured"
    assert checks["fanout_overhead_inprocess_ms"]["status"] == "not measured"


@pytest.mark.parametrize("kwargs, match", [
    ({"images": 0}, "--images"),
    ({"concurrency": 0}, "--concurrency"),
    ({"strategies": ("single", "pipeline")}, "unknown strategy"),
    ({"transports": ()}, "transports"),
    ({"workers": 1000}, "at most"),
    ({"runtime": "tensorrt"}, "runtime"),
    ({"backends": ("kubernetes",)}, "backend"),
    ({"rounds": 0}, "--set rounds must be an integer >= 1"),
    ({"keep_cores_awake": "always"}, "always"),
])
def test_bad_settings_fail_fast(artifact, tmp_path, kwargs, match):
    from sensai.bench.latency import run_bench
    from sensai.bench.options import BenchOptions

    with pytest.raises(SensaiError, match=match):
        run_bench(artifact, tmp_path / "out", BenchOptions(progress=False, **kwargs))
    assert not (tmp_path / "out").exists()  # refused before the output directory is made


def test_missing_original_model_is_a_clear_error(artifact, tmp_path):
    import shutil

    from sensai.bench.latency import run_bench
    from sensai.bench.options import BenchOptions
    from sensai.manifest import load_manifest, save_manifest

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    m = load_manifest(art)
    save_manifest(art, m.model_copy(update={"source": m.source.model_copy(
        update={"model_dir": str(tmp_path / "gone")})}))
    with pytest.raises(CheckpointError, match="original model"):
        run_bench(art, tmp_path / "out", BenchOptions(progress=False))


def test_cli_reports_errors_in_one_line(artifact, tmp_path, capsys):
    from sensai.cli import main

    assert main(["bench", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "sensai bench: error:" in err and "Traceback" not in err
    afile = tmp_path / "afile"
    afile.touch()
    for argv, fragment in (
            (["--out", str(tmp_path / "o"), "--stages", "100"], "--stages 100: "),
            (["--out", str(afile)], f"output directory {afile}: it is a file, not a directory")):
        assert main(["bench", str(artifact), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("sensai bench: error: ") and fragment in err[0]
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # no output directory made


def test_in_process_runs_on_the_event_loop_the_gateway_gets():
    """The in-process transport times the predictor on the loop uvicorn would serve it on
    (``loop="auto"``), not on asyncio's default one, which hands off between threads slower."""
    import asyncio

    import uvicorn

    from sensai.serving.gateway.server import run_like_the_gateway

    async def loop_type():
        return type(asyncio.get_running_loop())

    gateway_loop = uvicorn.Config(None, loop="auto").get_loop_factory()()
    try:
        assert run_like_the_gateway(loop_type()) is type(gateway_loop)
    finally:
        gateway_loop.close()
    assert type(gateway_loop).__module__.startswith("uvloop")  # declared: uvicorn[standard]


def test_http_client_process_reports_a_dead_gateway(fmnist_test):
    """The client lives in its own process; a failure there comes back as an error, not a hang."""
    import socket

    from sensai.bench.client import HttpClientProcess
    from sensai.data import encode_png

    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HttpClientProcess([encode_png(fmnist_test[0][0])], [bytes(4 * 784)], [1, 1, 28, 28])
    try:
        with pytest.raises(RuntimeError, match="ConnectionRefused"):
            client.timed("http", f"http://127.0.0.1:{port}", "sensai", [0])
        with pytest.raises(RuntimeError, match="ConnectionRefused"):
            client.concurrent(f"http://127.0.0.1:{port}", 2, 2)
        with pytest.raises(RuntimeError, match="ConnectionRefused"):
            client.timed("http-v2", f"http://127.0.0.1:{port}", "sensai", [0])
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            client.timed("grpc", f"127.0.0.1:{port}", "sensai", [0])
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            client.concurrent(f"127.0.0.1:{port}", 2, 2, "grpc", "sensai")
    finally:
        client.close()
    assert not client.process.is_alive()


def test_the_load_client_reads_answers_without_a_length_on_a_kept_connection():
    """Ray Serve's proxy sends its own errors (a backpressure 503) with no Content-Length, so
    uvicorn frames them in chunks: the load generator reads them as answers and keeps the
    connection, instead of waiting for the connection to close until its timeout."""
    import asyncio

    from sensai.bench.client import load_phase, raw_requests
    from sensai.serving.gateway.server import BackgroundServer

    seen = []  # the connection (client address) of each POST

    async def app(scope, receive, send):  # POSTs: 503 without a length, then 200 with one
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":
            seen.append(scope["client"])
        status, body = (503, b"Request dropped due to backpressure") if len(seen) % 2 else \
            (200, b'{"index": 1}')
        headers = [(b"retry-after", b"1")] if status == 503 else \
            [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:]})

    server = BackgroundServer(app).start()
    try:
        requests = raw_requests(server.url, [("/v1/predict", {}, b"x" * 100)])
        out = asyncio.run(load_phase(requests, server.url, count=6, concurrency=1, timeout_s=5))
    finally:
        server.stop()
    assert out["failures"] == {} and out["status"] == [503, 200] * 3
    assert max(out["ms"]) < 2000  # none waited for its connection to close
    assert len(seen) == 6 and len(set(seen)) == 1  # one connection, kept for all six


def test_the_one_closed_loop_shares_its_budget_counts_refusals_parks_and_stops():
    """The closed loop every client runs (HTTP load phases, gRPC and in-process concurrency):
    the callers share one request budget; a refusal is counted in ``shed``; a Retry-After parks
    only the caller that got it, no answer pauses its caller instead of spinning, and the loop
    ends at its end time or when ``stop()`` says so."""
    import asyncio
    import time

    from sensai.bench.client import callers_loop, closed_loop

    async def even_answered(j):
        await asyncio.sleep(0)
        return j % 2 == 0

    r = asyncio.run(closed_loop(10, 3, even_answered))
    assert r["shed"] == 5 and len(r["latencies"]) == 5 and r["seconds"] > 0
    sent = []

    async def one(caller, start):
        sent.append(caller)
        await asyncio.sleep(0.01)
        return {"gone": (0, 0.0), "parked": (503, 10.0)}.get(caller, (200, 0.0))

    t0 = time.monotonic()
    asyncio.run(callers_loop(["gone", "parked", "ok"], one, until=t0 + 0.5))
    assert time.monotonic() - t0 < 5  # parked until the end, not for the whole Retry-After
    assert sent.count("parked") == 1 and sent.count("gone") <= 10 < sent.count("ok")
    sent.clear()
    asyncio.run(callers_loop(["a", "b"], one, stop=lambda: len(sent) >= 6))
    assert 6 <= len(sent) <= 7


def test_timed_requests_read_both_answers_on_one_connection_and_report_a_failure():
    """The latency bench's HTTP path: a JSON answer and a KServe v2 binary one are read with the
    server's timings (its v2 header's parameters, {} when absent); each request follows the bare
    request on the same kept connection; an answer other than 200 names the server, its status
    and body."""
    import struct

    from sensai.bench.client import HttpClientProcess
    from sensai.serving.gateway.server import BackgroundServer

    seen = []  # (method, path, connection) of each request

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append((scope["method"], scope["path"], scope["client"]))
        while (await receive()).get("more_body"):
            pass
        status, headers, body = 200, [], b""
        if scope["path"] == "/v1/predict":
            body = b'{"index": 3, "timings_ms": {"total": 1.5}}'
        elif scope["path"] == "/v2/models/m/infer":
            # The third v2 answer (the tenth request) reports no timings.
            timings = {"timings_ms": json.dumps({"total": 2.5})} if len(seen) < 10 else {}
            head = json.dumps({"outputs": [{"name": "class_index", "datatype": "INT64",
                                            "shape": [1, 1],
                                            "parameters": {"binary_data_size": 8}}],
                               "parameters": timings}).encode()
            body = head + struct.pack("<q", 7)
            headers = [(b"inference-header-content-length", str(len(head)).encode())]
        elif scope["path"] == "/v2/models/json/infer":  # JSON alone, as the Ray Serve peer's
            body = json.dumps({"outputs": [{"name": "class_index", "datatype": "INT64",
                                            "shape": [1], "data": [5]}]}).encode()
        elif scope["path"] != "/v2/health/live":
            status, body = 500, b"boom " * 100
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    server = BackgroundServer(app).start()
    client = HttpClientProcess([b"png"] * 2, [bytes(16)] * 2, [1, 4])
    try:
        png = client.timed("http", server.url, "m", [0, 1])
        assert [a[1:3] for a in png] == [(3, {"total": 1.5})] * 2
        assert all(a[0] > 0 and a[3] > 0 for a in png)
        v2 = client.timed("http-v2", server.url, "m", [0, 1, 0])
        assert [a[1:3] for a in v2] == [(7, {"total": 2.5})] * 2 + [(7, {})]
        assert [a[1:3] for a in client.timed("http-v2", server.url, "json", [1])] == [(5, {})]
        with pytest.raises(RuntimeError, match=f"server at {server.url} answered 500: "
                                               f"boom boom") as e:
            client.timed("http-v2", server.url, "other", [0])
        assert len(str(e.value)) < 300
    finally:
        client.close()
        server.stop()
    assert [s[:2] for s in seen[:4]] == [("GET", "/v2/health/live"), ("POST", "/v1/predict")] * 2
    assert len({s[2] for s in seen}) == 1  # one kept connection for all of them


def test_throughput_counts_the_requests_a_shedding_gateway_turns_away(tiny_artifact,
                                                                          fmnist_test):
    """A gateway that admits one request at a time, under 4 concurrent clients: the throughput
    run finishes, counts the 503s (gRPC UNAVAILABLE) apart from the answers, and says so."""
    from sensai.bench.client import HttpClientProcess
    from sensai.bench.latency_report import shed_lines
    from sensai.data import encode_png
    from sensai.serving.gateway.app import create_app
    from sensai.serving.gateway.server import BackgroundServer
    from sensai.serving.launch.build import build_predictor

    pred = build_predictor(tiny_artifact,
                           GatewaySettings(device="cpu"),
                           faults=Faults.of(delays={0: "fixed:30ms"}))
    app = create_app(pred, GatewaySettings(max_requests=1, grpc_port=0))
    server = BackgroundServer(app).start()
    x = fmnist_test[0][0]
    client = HttpClientProcess([encode_png(x)], [np.zeros((1, 1, 28, 28), np.float32).tobytes()],
                               [1, 1, 28, 28])
    grpc_target = f"127.0.0.1:{app.state.grpc.port}"
    try:
        for args in ((server.url, 24, 4), (server.url, 24, 4, "http-v2", "sensai"),
                     (grpc_target, 24, 4, "grpc", "sensai")):
            r = client.concurrent(*args)
            assert r["shed"] > 0 and len(r["latencies"]) > 0, args
            assert r["shed"] + len(r["latencies"]) == 24, args
    finally:
        client.close()
        server.stop()
    rep = {"requests": 24, "answered": 20, "shed": 4, "concurrency": 4}
    result = {"strategies": {"class-parallel": {"transports": {"http": {"throughput": rep}}}}}
    assert shed_lines(result) == [
        "throughput of class parallel (sensAI) over http: 4 of 24 requests turned away by the "
        "server's admission at concurrency 4; img/s counts the 20 answered"]


def test_throughput_stops_on_a_503_that_is_not_the_admission(tiny_artifact, fmnist_test):
    """A 503 without Retry-After (gRPC UNAVAILABLE without the trailer) is the server failing -
    here every copy of a subnet is down - not load being shed: the run stops with its reason
    instead of counting it as turned away."""
    from sensai.bench.client import HttpClientProcess
    from sensai.data import encode_png
    from sensai.serving.core.settings import GatewaySettings
    from sensai.serving.gateway.app import create_app
    from sensai.serving.gateway.server import BackgroundServer
    from sensai.serving.launch.build import build_predictor

    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu", restart_delay_s=300))
    app = create_app(pred, GatewaySettings(grpc_port=0))
    server = BackgroundServer(app).start()
    client = HttpClientProcess([encode_png(fmnist_test[0][0])],
                               [np.zeros((1, 1, 28, 28), np.float32).tobytes()], [1, 1, 28, 28])
    try:
        pred.pool.kill(0)
        assert pred.pool.states()[0] != "up"
        for args in ((server.url, 8, 2), (server.url, 8, 2, "http-v2", "sensai"),
                     (f"127.0.0.1:{app.state.grpc.port}", 8, 2, "grpc", "sensai")):
            with pytest.raises(RuntimeError, match="no live copy of classes"):
                client.concurrent(*args)
    finally:
        client.close()
        server.stop()


# --------------------------------------------------------------------------------------------
# sensai bench-robust


def test_bench_robust_rejects_bad_arguments(artifact, tmp_path, capsys):
    from sensai.cli import main

    for argv, fragment in ((["--set", "straggler=7"], "worker index 0..4"),
                           (["--set", "delay=soon"], "bad delay"),
                           (["--redundancy", "5"], "r+1 = 6"),
                           (["--set", "kill_at=1.5"], "--set kill_at must be in [0, 1)"),
                           (["--images", "1"], "--images")):
        assert main(["bench-robust", str(artifact), "--out", str(tmp_path / "o"), *argv]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything was started or written


def test_bench_robust_reports_straggler_and_failure(artifact, tmp_path):
    """r = 0 is the default serving path (worker threads): a killed worker's classes fail
    during the outage; r = 1 answers everything, the straggler's group by its copy."""
    from sensai.bench.options import RobustOptions
    from sensai.bench.robust import run_robust_bench

    out = tmp_path / "robust"
    res = run_robust_bench(artifact, out, RobustOptions(
        redundancies=(0, 1), images=20, warmup=2, rounds=2, delay="fixed:100ms", straggler=2,
        victim=1, kill_at=0.25, restart_delay_s=1.0, progress=False, command="test"))
    for f in ("robust.json", "robust.md", "robust.png"):
        assert (out / f).stat().st_size > 0
    on_disk = json.loads((out / "robust.json").read_text())
    assert on_disk["kind"] == "sensai-bench-robust" and on_disk["settings"]["backend"] == "local"
    threads = {"kind": "threads", "spread_cores": False, "spread_moves": None}  # opt-in, off
    assert on_disk["worker_transport"] == {"r=0": threads, "r=1": threads}
    assert on_disk["placement"]["r=0"] == [[g] for g in range(5)]
    assert on_disk["placement"]["r=1"][2] == [2, 3]  # worker 2: its own group, then a copy
    r0, r1 = res["configs"]["r=0"]["scenarios"], res["configs"]["r=1"]["scenarios"]
    for per in (r0, r1):
        assert set(per) == {"none", "straggler", "failure"}
        assert all(s["wrong"] == 0 for s in per.values())
        assert per["none"]["errors"] == 0 and per["straggler"]["errors"] == 0
        assert per["failure"]["restarted"] and per["failure"]["rejoined"]
        assert per["failure"]["after_rejoin"]["errors"] == 0
        assert per["failure"]["after_rejoin"]["victim_subnet_runs"] >= 1  # it serves again
        assert per["failure"]["killed_pid"] is None  # a thread has no pid of its own
        assert per["none"]["latency_ms"]["n"] == 20
    # r = 0: the dead worker's classes cannot be answered during the outage.
    assert r0["failure"]["errors"] >= 1 and r0["failure"]["errors_during_outage"] >= 1
    assert all(e.startswith("503") for e in r0["failure"]["error_examples"])
    assert r0["straggler"]["straggler_answered_share"] == 1.0
    # r = 1: every request answered, the straggler's group mostly by its copy.
    assert r1["failure"]["errors"] == 0
    assert r1["failure"]["answered"] == r1["failure"]["requests"] == 20
    assert r1["straggler"]["straggler_answered_share"] <= 0.5
    # Work per request relative to r = 0 without faults (G subnet runs).
    assert r0["none"]["subnet_runs_per_request"] == 5.0
    assert r0["none"]["compute_overhead_runs"] == 1.0
    assert 5.0 <= r1["none"]["subnet_runs_per_request"] <= 10.0
    assert r1["none"]["compute_overhead_runs"] == pytest.approx(
        r1["none"]["subnet_runs_per_request"] / 5.0, abs=1e-3)
    md = (out / "robust.md").read_text()
    assert "| r=1 | failure |" in md and "worker threads" in md


def test_the_memory_probe_reports_each_cuda_devices_growth(monkeypatch):
    """The GPU figures of a strategy's load, on a stand-in for torch.cuda's counters: torch's
    peak over its allocation at the start (the peak reset first), the device's memory in use
    over its own at the start, per CUDA device asked for, none for the CPU."""
    import torch

    from sensai.bench.machine import MemoryProbe

    state = {"cuda:0": {"alloc": 100e6, "peak": 900e6, "used": 1000e6},
             "cuda:1": {"alloc": 0.0, "peak": 0.0, "used": 500e6}}
    total = 80e9
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda dev: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats",
                        lambda dev: state[str(dev)].update(peak=state[str(dev)]["alloc"]))
    monkeypatch.setattr(cuda, "memory_allocated", lambda dev: int(state[str(dev)]["alloc"]))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda dev: int(state[str(dev)]["peak"]))
    monkeypatch.setattr(cuda, "mem_get_info",
                        lambda dev: (int(total - state[str(dev)]["used"]), int(total)))
    with MemoryProbe(["cpu", "cuda:0", "cuda:1", "cuda:0"]) as probe:
        assert state["cuda:0"]["peak"] == 100e6  # reset when the probe started
        state["cuda:0"].update(alloc=300e6, peak=450e6, used=1600e6)
        state["cuda:1"].update(used=520e6)
    assert probe.figures["cuda"] == {
        "cuda:0": {"torch_peak_mb": 350.0, "device_used_mb": 600.0},
        "cuda:1": {"torch_peak_mb": 0.0, "device_used_mb": 20.0}}
    with MemoryProbe(["cpu"]) as probe:
        pass
    assert probe.figures["cuda"] == {} and probe.figures["rss_growth_mb"] is not None


def test_a_refusal_by_admission_is_told_from_a_failure():
    """What the clients take for a refusal (the timed one sends it again after the wait asked
    for, at most a second; a polite load client parks its connection that long): the gateway
    admission's refusals, HTTP 503 with Retry-After and gRPC UNAVAILABLE with a retry-after
    trailer; anything else is a failure."""
    import grpc

    from sensai.bench.client import turned_away

    assert turned_away((503, {b"retry-after": b"1"}, b"")) == 1.0
    assert turned_away((503, {b"retry-after": b"0.2"}, b"")) == 0.2
    assert turned_away((503, {b"retry-after": b"3"}, b"")) == 3.0  # honoured as asked
    assert turned_away((503, {b"retry-after": b"soon"}, b"")) == 1.0
    assert turned_away((503, {}, b"")) is None and turned_away((500, {}, b"")) is None
    assert turned_away((200, {b"retry-after": b"1"}, b"")) is None

    class Refused(grpc.RpcError):
        def __init__(self, code, trailer):
            self._code, self._trailer = code, trailer

        def code(self):
            return self._code

        def trailing_metadata(self):
            return self._trailer

    assert turned_away(Refused(grpc.StatusCode.UNAVAILABLE, (("retry-after", "1"),))) == 1.0
    assert turned_away(Refused(grpc.StatusCode.UNAVAILABLE, ())) is None
    assert turned_away(Refused(grpc.StatusCode.INTERNAL, (("retry-after", "1"),))) is None
    assert turned_away(ValueError("x")) is None

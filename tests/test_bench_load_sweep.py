"""``sensai bench-load --sweep`` on a tiny artifact: a real (tiny) sweep of two configurations -
each a real ``sensai serve`` process on 127.0.0.1, driven by real client processes - and the
original model as a one-group artifact the same gateway serves.

Only the shape of the outputs is checked, and that every answer agrees with offline evaluation -
never a timing or a target's verdict (the CPU is shared): the targets must be reported.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

LEVEL_KEYS = {"concurrency", "seconds", "requests", "status_counts", "ok", "errors", "wrong",
              "throughput_rps", "latency_ok_ms", "client_cpu_s", "client_cores",
              "client_cpu_share", "machine_busy_cores"}
SWEEP_TARGETS = ["batching_c1_p50_ratio", "c16_vs_noop_route", "p99_c16_over_p50_c1",
                 "flagship_vs_triton", "overload_goodput_share", "overload_admitted_p99",
                 "overload_refused_p99", "overload_within_deadline", "c1_over_one_call_ms",
                 "gpu_vs_original_rps"]


@pytest.fixture(scope="module")
def sweep_run(tiny_artifact, tmp_path_factory):
    from sensai.bench.load_run import run_load
    from sensai.bench.options import LoadOptions, LoadPlan

    out = tmp_path_factory.mktemp("sweep_out")
    options = LoadOptions(deadline_s=2.0, images=12, progress=False, command="test",
                          env={"SENSAI_MAX_REQUESTS": "32"})
    plan = LoadPlan(sweep=True, configs=("class-parallel", "class-parallel-unbatched"),
                    levels=(1, 16), level_seconds=1.0, warmup_seconds=0.5, overload_seconds=1.0)
    result = run_load(tiny_artifact, out, options, plan)
    return out, result


def test_the_sweep_writes_every_configuration_level_and_phase(sweep_run):
    from PIL import Image

    out, result = sweep_run
    on_disk = json.loads((out / "load.json").read_text())
    assert on_disk["kind"] == "sensai-bench-load-sweep" and on_disk["command"] == "test"
    st = on_disk["settings"]
    assert st["levels"] == [1, 16] and st["level_s"] == 1.0 and st["transport"] == "http"
    assert list(on_disk["configs"]) == ["class-parallel", "class-parallel-unbatched"]
    for key, c in on_disk["configs"].items():
        assert c["transport"] == "http"
        assert [r["concurrency"] for r in c["levels"]] == [1, 16]
        for r in [*c["levels"], c["noop"]]:
            assert LEVEL_KEYS <= set(r), key
            assert r["throughput_rps"] > 0 and r["ok"] == r["requests"] > 0
            assert r["errors"] == 0 and r["wrong"] == 0 and set(r["status_counts"]) == {"200"}
            assert 0 < r["client_cpu_share"] <= 1 and r["client_cpu_s"] > 0
            lat = r["latency_ok_ms"]
            assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
        assert c["noop"]["concurrency"] == 16
        # The gateway's own count of its full collections per level (none run un-asked for
        # in a second on a frozen heap, but the count is there).
        for r in c["levels"]:
            g = r["server"]["gc_full"]
            assert g["collections"] >= 0 and g["paused_ms"] >= 0
        # The gateway's own threads, and its busiest (one thread: at most one core).
        for r in [*c["levels"], c["noop"], c["overload"]]:
            g = r["gateway_cpu"]
            assert 0 < g["busiest_thread_cores"] <= g["process_cores"], g
            assert g["busiest_thread_cores"] <= 1.05, g
        o = c["overload"]
        assert o["goodput_rps"] == o["throughput_rps"] > 0 and o["wrong"] == 0
        assert o["rejected_503"] == o["status_counts"].get("503", 0)
        assert set(o["status_counts"]) <= {"200", "503"}
        assert o["offered_rate_rps"] > 0 and o["latency_ok_ms"]["p99"] is not None
        assert c["server"]["exit_code"] == 0 and (out / f"gateway-{key}.log").is_file()

    with Image.open(out / "load.png") as img:
        assert img.format == "PNG" and img.size[0] > 600
    md = (out / "load.md").read_text()
    for text in ("## Targets", "## Closed loops", "## Overload", "## Batching in the workers",
                 "| class-parallel | http | 16 |",
                 "| class-parallel-unbatched | GET /v2/health/live | 16 |", "load.png",
                 "full GCs (ms paused)", "server cores (busiest thread)"):
        assert text in md, text


def test_each_configuration_runs_with_its_own_batching(sweep_run):
    """The gateways' own counters (GET /v1/models): batches of up to 8 rows by default, of one
    row where the configuration turns batching off."""
    _, result = sweep_run
    on, off = (result["configs"][k]["batching"] for k in ("class-parallel",
                                                           "class-parallel-unbatched"))
    assert on and off and len(on) == len(off) == len(result["groups"])
    assert all(w["max_rows"] == 8 and w["held"] == 0 for w in on)
    assert all(w["max_rows"] == 1 and w["largest"] == 1 for w in off)
    assert all(w["requests"] > 0 for w in on + off)


def test_the_targets_are_reported(sweep_run):
    out, result = sweep_run
    checks = result["targets"]["checks"]
    assert [c["name"] for c in checks] == SWEEP_TARGETS
    by = {c["name"]: c for c in checks}
    for name in ("batching_c1_p50_ratio", "c16_vs_noop_route", "p99_c16_over_p50_c1",
                 "overload_goodput_share", "overload_admitted_p99", "overload_within_deadline"):
        assert by[name]["value"] > 0 and by[name]["status"] in ("met", "not met"), name
    # The polite clients' parked connections are counted, and the run says it honoured them.
    over = result["configs"]["class-parallel"]["overload"]
    assert over["retry_after_honoured"] is True and result["settings"]["overload_retry_after"]
    assert by["flagship_vs_triton"]["status"] == "not measured"  # no triton in this sweep
    assert by["flagship_vs_triton"]["why_not_measured"]
    assert by["c16_vs_noop_route"]["conditions_met"] is False  # not the demo artifact
    c = result["configs"]["class-parallel"]
    assert by["c16_vs_noop_route"]["value"] == pytest.approx(
        c["levels"][1]["throughput_rps"] / c["noop"]["throughput_rps"], abs=1e-3)
    # Beside it, what the cores allow at the CPU per answer measured: never less than what was
    # answered (the busy cores are at most the usable ones), and in the report.
    ceiling = by["c16_vs_noop_route"]["ceiling"]
    assert ceiling >= 0.95 * by["c16_vs_noop_route"]["value"] > 0
    assert "(the cores at this CPU per answer: at most " in (out / "load.md").read_text()
    # Issue 60: one image served against one call of every subnet, measured before the servers.
    one = result["one_call"]
    assert one["subnets"] == 5 and one["device"] == "cpu" and one["ms"]["p50"] > 0
    gap = c["levels"][0]["latency_ok_ms"]["p50"] - one["ms"]["p50"]
    if gap < -0.35:  # a disturbed reference (a busy machine): not measured rather than met
        assert by["c1_over_one_call_ms"]["status"] == "not measured"
    else:
        assert by["c1_over_one_call_ms"]["value"] == pytest.approx(gap, abs=1e-3)
        assert by["c1_over_one_call_ms"]["status"] in ("met", "not met")
    assert "One call of every subnet, in process" in (out / "load.md").read_text()
    # The GPU's answers/s target is not claimed on a CPU, and no single was swept.
    assert by["gpu_vs_original_rps"]["conditions_met"] is False
    assert by["gpu_vs_original_rps"]["status"] == "not measured"


def test_the_cores_ceiling_counts_the_server_and_the_clients_cpu_per_answer():
    from sensai.bench.targets import cores_ceiling

    row = {"throughput_rps": 1000.0, "client_cores": 0.1,  # 0.1 ms of the clients' per answer
           "server_cpu": {"gateway_ms_per_answer": 0.3, "workers_ms_per_answer": 0.1}}
    assert cores_ceiling(row, 2) == pytest.approx(2 / 0.5e-3)  # both on the same 2 cores
    # The clients on 1 core of their own: the server's 3 cores are the narrower side.
    assert cores_ceiling(row, 4, client_cores=1) == pytest.approx(3 / 0.4e-3)
    assert cores_ceiling({**row, "client_cores": 0.5}, 4, client_cores=1) == pytest.approx(
        1 / 0.5e-3)
    assert cores_ceiling({**row, "server_cpu": {}}, 2) is None  # not measured: no ceiling
    assert cores_ceiling(None, 2) is None


def test_the_original_as_a_one_group_artifact_scores_as_the_original(tiny_artifact, tmp_path):
    """The single configuration's model: merged like any artifact, its scores are the
    original's softmax, and its plain ONNX file (for Triton) gives the original's logits."""
    import onnxruntime as ort
    import torch

    from sensai.artifact import load_artifact
    from sensai.bench.harness import load_test_images
    from sensai.bench.load_single import original_as_artifact
    from sensai.bench.harness import offline_reference
    from sensai.bench.strategies import load_original

    artifact = load_artifact(tiny_artifact)
    view, full = original_as_artifact(artifact, tmp_path / "original")
    assert view.groups == [list(range(artifact.manifest.num_classes))]
    assert view.subnets[0].num_outputs == artifact.manifest.num_classes + 1
    xs = load_test_images(artifact.spec, 16, 0, png=False).xs
    x = np.concatenate(xs)
    model, _ = load_original(artifact)
    with torch.no_grad():
        want = torch.softmax(model(torch.from_numpy(x)), dim=1).numpy()
    np.testing.assert_allclose(offline_reference(view, xs), want, atol=1e-5)
    logits = ort.InferenceSession(str(full)).run(None, {"input": x})[0]
    assert (logits.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("argv, fragment", [
    (["--levels", "0"], "--levels must be an integer from 1 to 1000"),
    (["--set", "level_seconds=0"], "--set level_seconds must be a number > 0"),
    (["--set", "overload_seconds=-1"], "--set overload_seconds must be a number >= 0"),
])
def test_bad_sweep_arguments_are_refused_in_one_line(tiny_artifact, tmp_path, capsys, argv,
                                                     fragment):
    from sensai.cli import main

    out = tmp_path / "o"
    assert main(["bench-load", str(tiny_artifact), "--out", str(out), "--sweep", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("sensai bench-load: error:")
    assert not out.exists()


def test_pinned_clients_and_a_server_of_two_gateway_processes(tiny_artifact_g2, tmp_path):
    """``--set client_cores=1``: the clients on the last core, the gateway - two gateway processes
    over device processes - on the rest; the server's CPU per answer is split between the
    gateways and the device processes, and every answer agrees with offline evaluation."""
    from sensai.bench.load_run import run_load
    from sensai.bench.options import LoadOptions, LoadPlan

    options = LoadOptions(deadline_s=5.0, images=8, progress=False, command="test",
                          client_cores=1, env={"SENSAI_GATEWAY_REPLICAS": "2"})
    plan = LoadPlan(sweep=True, configs=("class-parallel",), levels=(4,), level_seconds=1.0,
                    warmup_seconds=0.5, overload_seconds=0.0)
    result = run_load(tiny_artifact_g2, tmp_path, options, plan)
    c = result["configs"]["class-parallel"]
    assert result["settings"]["clients_on_cores"] == [max(os.sched_getaffinity(0))]
    assert result["settings"]["gateway"]["gateway_processes"] == 2
    assert c["server"]["command"].startswith("SENSAI_GATEWAY_REPLICAS=2 taskset --cpu-list ")
    level = c["levels"][0]
    assert level["wrong"] == 0 and level["ok"] == level["requests"] > 0
    split = level["server_cpu"]
    assert split["workers_processes"] == 2 and split["gateway_processes"] >= 3  # + the parent
    assert split["gateway_ms_per_answer"] > 0 and split["workers_ms_per_answer"] > 0
    # Each part's busiest thread: one of its threads, so more than none and at most the part.
    for part in ("gateway", "workers"):
        assert 0 < split[f"{part}_busiest_thread_cores"] <= split[f"{part}_cores"] + 0.01
    md = (tmp_path / "load.md").read_text()
    assert "busiest thread: gateways (workers)" in md
    cores = f"{split['gateway_busiest_thread_cores']:.2f} ({split['workers_busiest_thread_cores']:.2f})"
    assert cores in md


def test_the_gateway_count_recorded_is_the_one_the_pinned_server_chooses(monkeypatch):
    """On 16 cores with 4 for the clients the server, pinned to the other 12, starts 6 gateway
    processes (half its cores), not the 8 the bench's own 16 cores would give; unpinned it is
    the bench's count; a count set is the count."""
    from sensai.bench import machine
    from sensai.bench.load_run import server_gateways
    from sensai.serving.core import settings as settings_module
    from sensai.serving.core.settings import GatewaySettings

    sixteen = set(range(16))
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: sixteen)
    monkeypatch.setattr(settings_module.os, "sched_getaffinity", lambda pid: sixteen)
    gs = GatewaySettings(backend="processes")
    assert server_gateways(gs, 4) == 6
    assert server_gateways(gs, 0) == 8
    assert server_gateways(gs.model_copy(update={"gateway_replicas": 3}), 4) == 3


def test_client_cores_that_leave_the_server_none_are_refused_in_one_line(tiny_artifact, capsys):
    from sensai.cli import main

    n = len(os.sched_getaffinity(0))
    assert main(["bench-load", str(tiny_artifact), "--out", "unused", "--sweep",
                 "--set", f"client_cores={n}"]) == 2
    err = capsys.readouterr().err
    assert f"--set client_cores={n}: must be between 1 and {n - 1}" in err
    assert len(err.strip().splitlines()) == 1


def test_the_simulated_gpu_sweep_checks_every_answer_and_reports_each_subnets_batches(
        tiny_artifact_g2, tmp_path, capsys):
    """``sensai bench-load --runtime sim`` from the command line: two gateway processes over one
    device process holding both subnets (as on one GPU), every answer checked against the
    simulation's own offline (none wrong), each level's rows per batch of each subnet and the
    device process's CPU per answer reported, its batches launched while the device computes
    the last; Triton, which runs no simulation, is skipped with its reason."""
    from sensai.cli import main

    out = tmp_path / "sim"
    assert main(["bench-load", str(tiny_artifact_g2), "--out", str(out), "--sweep",
                 "--env", "SENSAI_RUNTIME=sim:5", "--configs", "class-parallel", "triton",
                 "--levels", "1", "8", "--set", "level_seconds=1", "--set", "warmup_seconds=0.5",
                 "--set", "overload_seconds=0", "--images", "8",
                 "--env", "SENSAI_GATEWAY_REPLICAS=2"]) == 0
    assert "rows per batch (each subnet)" in capsys.readouterr().out
    result = json.loads((out / "load.json").read_text())
    g = result["settings"]["gateway"]
    assert g["runtime"] == "sim" and g["sim_launch_ms"] == 5.0
    assert "simulates" in result["configs"]["triton"]["skipped"]
    c = result["configs"]["class-parallel"]
    for level in c["levels"]:
        assert level["wrong"] == 0 and level["ok"] == level["requests"] > 0
        assert len(level["batching"]) == 2  # one per subnet, both in the one device process
        assert level["server_cpu"]["workers_processes"] == 1
        assert level["server_cpu"]["workers_ms_per_answer"] > 0
    one, eight = c["levels"]
    assert all(w["rows_per_batch"] == 1.0 for w in one["batching"])
    assert all(w["rows"] == w["requests"] > 0 for w in eight["batching"])
    assert all(w["max_rows"] == 128 for w in c["batching"])  # a GPU's batches
    assert "Rows per batch" in (out / "load.md").read_text()

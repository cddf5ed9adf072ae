"""deploy/gpu-check.sh, run as a person would run it, in its CPU mode (--tiny): every step on
real data, so the script the GPU machine runs cannot rot; and its closing table (deploy/gpu_check.py
report) on what a GPU run leaves, whole or cut short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FMNIST = os.environ.get("SENSAI_FMNIST_DIR", "/usr/share/datasets/fashion-mnist")


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_in_cpu_mode(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([str(REPO / "deploy" / "gpu-check.sh"), str(out), "--tiny"],
                          capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "SENSAI_GPU_CHECK_DEADLINE_S": "900"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed steps: none" in proc.stdout
    table = (out / "gpu-check.md").read_text()
    # The flagship (trained, decomposed) and the latency-only artifact, three strategies each.
    for run in ("fmnist_torch", "32_torch"):
        bench = json.loads((out / run / "bench.json").read_text())
        assert set(bench["strategies"]) == {"single", "model-parallel", "class-parallel"}
        assert bench["settings"]["device_resolved"] == "cpu"
        assert bench["accuracy"]["decomposed_top1"] is not None
        for s in bench["strategies"].values():
            assert s["transports"]["inprocess"]["latency_ms"]["p50"] > 0
            assert "http-v2" in s["transports"]
        assert f"| {run} |" in table
    flagship = json.loads((out / "fmnist_torch" / "bench.json").read_text())
    assert "http" in flagship["strategies"]["class-parallel"]["transports"]
    assert json.loads((out / "gpu-check.json").read_text())["runs"]
    # Each step is timed in the log; the GPU tests are not run on a CPU.
    log = (out / "gpu-check.log").read_text()
    for step in ("train:", "decompose:", "decompose-x20-g2:", "decompose-x20-g10:",
                 "load-sweep:", "load-sweep-n1:", "train-224:", "decompose-224:", "report:"):
        assert f"{step} done in" in log
    # The offline work: the training, and each decomposition beside the original's accuracy,
    # the 20x ones at G=2 and G=10 at least 20x smaller.
    offline = {r["model"]: r for r in json.loads((out / "gpu-check.json").read_text())["offline"]}
    assert offline["fmnist_cnn"]["work"] == "train 1 epochs"
    assert float(offline["fmnist_cnn"]["images/s"].replace(",", "")) > 0
    for name, groups in (("fmnist_cnn_g2", 2), ("fmnist_cnn_g2_x20", 2), ("fmnist_cnn_g10_x20", 10)):
        row = offline[name]
        assert row["work"].startswith(f"decompose G={groups}, shrink")
        assert 0 < float(row["top-1"]) <= 1 and 0 < float(row["original top-1"]) <= 1
        assert float(row["images/s"].replace(",", "")) > 0
    assert offline["fmnist_cnn_g10_x20"]["work"] == "decompose G=10, shrink 20"
    assert float(offline["fmnist_cnn_g10_x20"]["largest subnet (params, MACs)"].split("x")[0]) >= 20
    assert "## Offline: training and decomposition" in table and "| fmnist_cnn_g10_x20 |" in table
    assert "cores: " in log
    # The load sweeps, with the automatic count of gateway processes and with one: both
    # configurations at every level, answered right, in the table.
    for folder in ("load", "load-n1"):
        sweep = json.loads((out / folder / "load.json").read_text())
        assert set(sweep["configs"]) == {"class-parallel", "single"}
        for config in sweep["configs"].values():
            levels = config["levels"]
            assert [lv["concurrency"] for lv in levels] == [1, 2]
            assert all(lv["ok"] > 0 and lv["wrong"] == 0 for lv in levels)
    n1 = json.loads((out / "load-n1" / "load.json").read_text())["settings"]
    assert n1["gateway_env"]["SENSAI_GATEWAY_REPLICAS"] == "1"
    assert n1["gateway"]["gateway_processes"] == 1
    assert "### Closed loops" in table
    assert "gateway processes: auto" in table and "gateway processes: 1" in table
    assert [s["load_json"] is not None for s in json.loads(
        (out / "gpu-check.json").read_text())["sweeps"]] == [True, True]
    assert "gpu-tests" not in log


def test_gpu_check_refuses_without_arguments():
    proc = subprocess.run([str(REPO / "deploy" / "gpu-check.sh")], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0 and "usage: deploy/gpu-check.sh OUT" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- The table alone, on the files a GPU run leaves (written here as gpu-check.sh writes them).


def report(check: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "deploy" / "gpu_check.py"), "report",
                           str(check)], capture_output=True, text=True, timeout=120, cwd=check)


def log_lines(*lines: str) -> str:
    return "".join(f"[gpu-check {10 * i}s] {line}\n" for i, line in enumerate(lines))


def sweep_result(processes: int, replicas: str | None) -> dict:
    """What bench-load --sweep writes to load.json, as far as the table reads it."""
    def level(concurrency, rps, p99):
        return {"concurrency": concurrency, "throughput_rps": rps, "ok": 10, "wrong": 0,
                "latency_ok_ms": {"p50": p99 / 2, "p90": p99 * 0.9, "p99": p99},
                "client_cores": 0.5, "machine_busy_cores": 3.25}

    configs = {key: {"label": key, "transport": "http-v2",
                     "levels": [level(1, 100.0 * k, 2.0), level(16, 900.0 * k, 30.0),
                                level(64, 800.0 * k, 90.0)],
                     "overload": {"goodput_rps": 700.0 * k}}
               for key, k in (("class-parallel", 2), ("single", 1))}
    return {"kind": "sensai-bench-load-sweep", "configs": configs,
            "settings": {"gateway": {"gateway_processes": processes},
                         "gateway_env": {"SENSAI_GATEWAY_REPLICAS": replicas} if replicas else {}}}


def test_report_is_written_when_every_input_is_missing(tmp_path):
    # Nothing at all: still the table, each part a row saying it did not run.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = report(empty)
    assert proc.returncode == 0, proc.stderr
    table = (empty / "gpu-check.md").read_text()
    assert "not run: no bench.json" in table
    assert "| gateway processes: auto | - | not run: no load.json" in table
    assert "| gateway processes: 1 | - | not run: no load.json" in table
    assert "Cores: " in table
    assert {m["part"] for m in json.loads((empty / "gpu-check.json").read_text())["missing"]} \
        == {"bench", "load", "load-n1"}

    # The H200 run whose decomposition took 285 s: every later step past the deadline.
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "load").mkdir()  # gpu-check.sh makes the folder before the step skips
    (cut / "gpu-check.log").write_text(log_lines(
        "train: done in 120 s", "decompose: done in 285 s", "cores: 16 usable (nproc), 16 in all",
        *[f"{step}: SKIPPED (past the 480 s deadline)"
          for step in ("load-sweep", "load-sweep-n1", "bench-fmnist-cuda-graph", "gpu-tests",
                       "imagefolder", "train-224", "decompose-224", "bench-224-cuda-graph",
                       "bench-fmnist-torch", "bench-224-torch")],
        "report: .venv/bin/python deploy/gpu_check.py report OUT"))
    proc = report(cut)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    table = (cut / "gpu-check.md").read_text()
    for run in ("fmnist_cuda-graph", "224_cuda-graph", "fmnist_torch", "224_torch"):
        assert f"| {run} | skipped (past the 480 s deadline) |" in table
    assert "| gateway processes: auto | - | skipped (past the 480 s deadline) |" in table
    assert "| gateway processes: 1 | - | skipped (past the 480 s deadline) |" in table
    assert "Cores: 16 usable (nproc), 16 in all" in table
    assert "- gpu-tests: skipped (past the 480 s deadline)" in table
    assert "- decompose:" not in table  # it finished
    summary = json.loads((cut / "gpu-check.json").read_text())
    assert summary["runs"] == [] and summary["load_json"] is None
    assert summary["cores"] == {"usable": 16, "all": 16, "source": "gpu-check.log"}
    assert summary["steps"]["load-sweep-n1"].startswith("SKIPPED")


def test_report_with_both_sweeps(tmp_path):
    check = tmp_path / "check"
    for folder, processes, replicas, util in (("load", 8, None, "10\n30\n[N/A]\n50\n"),
                                              ("load-n1", 1, "1", "5\n15\n")):
        d = check / folder
        d.mkdir(parents=True)
        (d / "load.json").write_text(json.dumps(sweep_result(processes, replicas)))
        (d / "load.md").write_text(f"# sensai bench-load --sweep: vgg16_bn on fashion-mnist\n\n"
                                   f"## Closed loops\n\n{folder} levels\n")
        (d / "gpu-util.csv").write_text(util)
    (check / "gpu-check.log").write_text(log_lines(
        "cores: 16 usable (nproc), 32 in all", "load-sweep: done in 80 s",
        "load-sweep-n1: FAILED after 3 s (see gpu-check.log)"))
    proc = report(check)
    assert proc.returncode == 0, proc.stderr
    table = (check / "gpu-check.md").read_text()
    # One row per sweep and configuration: the best closed loop (16 in flight), the overload
    # and the GPU's mean (max) busy share over the sweep.
    assert ("| gateway processes: auto | 8 | class-parallel | 1800.0 | 16 | 15.00 | 30.00 | "
            "1400.0 | 0.50 | 3.25 | 30 % (50 %) |") in table
    assert "| gateway processes: auto | 8 | single | 900.0 | 16 |" in table
    assert ("| gateway processes: 1 | 1 | class-parallel | 1800.0 | 16 | 15.00 | 30.00 | 1400.0 "
            "| 0.50 | 3.25 | 10 % (15 %) |") in table
    assert "Cores: 16 usable (nproc), 32 in all" in table
    # Each sweep's own report, one level down under the check's title, named.
    assert "## gateway processes: auto: sensai bench-load --sweep: vgg16_bn" in table
    assert "## gateway processes: 1: sensai bench-load --sweep: vgg16_bn" in table
    assert table.count("### Closed loops") == 2
    assert table.index("load levels") < table.index("load-n1 levels")
    # The bench steps left nothing (and said nothing): one row says so.
    assert "not run: no bench.json" in table
    # A step the log says failed is named, even where its files are there.
    assert "- load-sweep-n1: failed after 3 s (see gpu-check.log)" in table
    summary = json.loads((check / "gpu-check.json").read_text())
    assert summary["load_json"] == str(check / "load" / "load.json")
    auto, one = summary["sweeps"]
    assert (auto["gateway_processes"], one["gateway_processes"]) == (8, 1)
    assert (auto["gpu_util"]["mean_pct"], auto["gpu_util"]["samples"]) == (30.0, 3)
    assert one["gpu_util"]["max_pct"] == 15.0

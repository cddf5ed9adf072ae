"""deploy/gpu-check.sh, run as a person would run it, in its CPU mode (--tiny): every step on
real data, so the script the GPU machine runs cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
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
    for step in ("train:", "decompose:", "load-sweep:", "train-224:", "decompose-224:",
                 "report:"):
        assert f"{step} done in" in log
    # The load sweep: both configurations at every level, answered right, in the table.
    sweep = json.loads((out / "load" / "load.json").read_text())
    assert set(sweep["configs"]) == {"class-parallel", "single"}
    for config in sweep["configs"].values():
        levels = config["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        assert all(lv["ok"] > 0 and lv["wrong"] == 0 for lv in levels)
    assert "### Closed loops" in table
    assert "gpu-tests" not in log


def test_gpu_check_refuses_without_arguments():
    proc = subprocess.run([str(REPO / "deploy" / "gpu-check.sh")], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0 and "usage: deploy/gpu-check.sh OUT" in proc.stderr
    assert "Traceback" not in proc.stderr

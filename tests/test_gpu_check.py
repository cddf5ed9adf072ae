"""deploy/gpu-check.sh, run as a person would run it, in its CPU mode (--tiny): every step on
real data, so the script the GPU machine runs cannot rot; and its closing table (deploy/gpu_check.py
report) on what a GPU run leaves, whole or cut short."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FMNIST = os.environ.get("SENSAI_FMNIST_DIR", "/usr/share/datasets/fashion-mnist")
LEVEL_HEADER = ("| sweep | configuration | gpu_wait | in flight | answers/s | p50 ms | p99 ms | "
                "rows per batch (each subnet) | device processes CPU ms/answer | "
                "gateways CPU ms/answer | busiest thread: device processes / gateways (cores) | "
                "GPU busy (mean) |")


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
    steps = ("train", "train-eager", "decompose", "decompose-eager", "load-sweep", "load-sweep-sleep", "load-sweep-n1",
             "decompose-x20-g2", "decompose-x20-g10", "bench-fmnist-torch", "imagefolder",
             "train-224", "decompose-224", "bench-32-torch", "report")
    for step in steps:
        assert f"{step}: done in" in log
    # In this order (the most wanted first), each under its own cap: ten times the GPU's
    # here, cut to what is left before the steps' end (the 900 s deadline less 25 s for the
    # report and a cut step's grace); the report's is its own.
    started = [(name, int(t), int(cap)) for t, name, cap in re.findall(
        r"^\[gpu-check (\d+)s\] (\S+) \(cap (\d+) s\): ", log, re.M)]
    assert [name for name, _, _ in started] == list(steps)
    # The script reads the clock for a step's cap a moment before the line that logs it: the
    # logged second may be one later.
    for name, t, cap in started[:-1]:
        assert 0 < cap <= 875 - t + 1
    t, cap = started[0][1:]
    assert min(10 * 90, 875 - t) <= cap <= min(10 * 90, 875 - t + 1)
    # The 20x decompositions' caps come from the speed the first decomposition was measured
    # at (ten times, as every cap here), not the fixed default.
    sys.path.insert(0, str(REPO / "deploy"))
    from gpu_check import decompose_cap

    for name, t, cap in started:
        if name.startswith("decompose-x20-g"):
            groups = int(name.rsplit("g", 1)[1])
            measured = decompose_cap(out / "models" / "fmnist_cnn_g2" / "manifest.json", groups, 256)
            assert measured is not None
            assert min(10 * measured, 875 - t) <= cap <= min(10 * measured, 875 - t + 1)
    assert started[-1][2] == 120
    # The offline work: the training, and each decomposition beside the original's accuracy,
    # the 20x ones at G=2 and G=10 at least 20x smaller.
    # Each with how its steps ran (the CPU captures nothing: eager, capture on or off)
    # and its wall as gpu-check.sh timed it beside the seconds inside.
    offline = {r["model"]: r for r in json.loads((out / "gpu-check.json").read_text())["offline"]}
    for name in ("fmnist_cnn", "fmnist_cnn_eager"):
        assert offline[name]["work"] == "train 1 epochs" and offline[name]["steps"] == "eager"
        assert float(offline[name]["images/s"].replace(",", "")) > 0
        assert re.fullmatch(r"wall \d+, loop [\d.]+ \(setup [\d.]+, evaluate [\d.]+, save [\d.]+\)",
                            offline[name]["seconds"]), offline[name]["seconds"]
    for name, groups in (("fmnist_cnn_g2", 2), ("fmnist_cnn_g2_eager", 2),
                         ("fmnist_cnn_g2_x20", 2), ("fmnist_cnn_g10_x20", 10)):
        row = offline[name]
        assert row["work"].startswith(f"decompose G={groups}, shrink")
        assert row["steps"] == "eager" and row["seconds"].startswith("wall ")
        assert 0 < float(row["top-1"]) <= 1 and 0 < float(row["original top-1"]) <= 1
        assert float(row["images/s"].replace(",", "")) > 0
    retrained = {name: int(re.search(r", ([\d,]+) images retrained", offline[name]["work"])[1]
                           .replace(",", "")) for name in ("fmnist_cnn_g2", "fmnist_cnn_g2_eager")}
    assert 0 < retrained["fmnist_cnn_g2_eager"] < retrained["fmnist_cnn_g2"] // 3  # its fifth
    assert offline["fmnist_cnn_g10_x20"]["work"] == "decompose G=10, shrink 20, 2,560 images retrained"
    assert float(offline["fmnist_cnn_g10_x20"]["largest subnet (params, MACs)"].split("x")[0]) >= 20
    assert "## Offline: training and decomposition" in table and "| fmnist_cnn_g10_x20 |" in table
    assert "cores: " in log
    # The load sweeps: the automatic count of gateway processes waiting for the device by
    # spinning (the artifact and the original), the same sleeping, and one gateway process:
    # every configuration at every level, answered right, in the table.
    sweeps = {folder: json.loads((out / folder / "load.json").read_text())
              for folder in ("load", "load-sleep", "load-n1")}
    for folder, configs in (("load", {"class-parallel", "single"}),
                            ("load-sleep", {"class-parallel"}), ("load-n1", {"class-parallel"})):
        assert set(sweeps[folder]["configs"]) == configs
        for config in sweeps[folder]["configs"].values():
            levels = config["levels"]
            assert [lv["concurrency"] for lv in levels] == [1, 2]
            assert all(lv["ok"] > 0 and lv["wrong"] == 0 for lv in levels)
    assert sweeps["load"]["settings"]["gateway"]["gpu_wait"] == "spin"
    sleep = sweeps["load-sleep"]["settings"]
    assert sleep["gateway_env"]["SENSAI_GPU_WAIT"] == "sleep"
    assert sleep["gateway"]["gpu_wait"] == "sleep"
    n1 = sweeps["load-n1"]["settings"]
    assert n1["backend"] == "processes" and n1["gateway_env"]["SENSAI_GATEWAY_REPLICAS"] == "1"
    assert n1["gateway"]["gateway_processes"] == 1
    assert "### Closed loops" in table
    for label in ("gateway processes: auto", "gateway processes: auto, GPU wait: sleep",
                  "gateway processes: 1"):
        assert f"| {label} |" in table
    summary = json.loads((out / "gpu-check.json").read_text())
    assert [s["load_json"] is not None for s in summary["sweeps"]] == [True, True, True]
    # A row per level of every sweep and configuration, as load.json has it; no GPU here, so
    # no busy share.
    assert LEVEL_HEADER in table
    rows = summary["levels"]
    assert [(r["sweep"], r["configuration"], r["in_flight"]) for r in rows] == [
        (folder, key, c) for folder in ("load", "load-sleep", "load-n1")
        for key in sweeps[folder]["configs"] for c in (1, 2)]
    for r in rows:
        level = sweeps[r["sweep"]]["configs"][r["configuration"]]["levels"][r["in_flight"] - 1]
        assert r["answers_per_s"] == level["throughput_rps"] > 0
        assert r["p99_ms"] == level["latency_ok_ms"]["p99"]
        assert r["gpu_wait"] == ("sleep" if r["sweep"] == "load-sleep" else "spin")
        assert r["gpu_busy_mean_pct"] is None
        if r["configuration"] == "class-parallel":  # each of the two subnets' batches
            assert [w["rows_per_batch"] >= 1 for w in r["rows_per_batch"]] == [True, True]
        cells = [r["sweep"], r["configuration"], r["gpu_wait"], str(r["in_flight"]),
                 f"{r['answers_per_s']:.1f}"]
        assert "| " + " | ".join(cells) + " |" in table
        assert re.search(re.escape("| " + " | ".join(cells) + " |") + r".* - \|\n", table)
    assert "gpu-tests" not in log


@pytest.mark.slow
def test_gpu_check_cuts_a_step_at_its_cap_and_still_reports_by_the_deadline(tmp_path):
    # Caps at 2% of the GPU's: training is cut a second in, what needs its model fails or is
    # cut in turn, a step that would start past the deadline is skipped, and the table still
    # comes by it.
    out = tmp_path / "check"
    # The table is due at 90 s: steps end by 65 s (15 s for the report, 10 s of grace between
    # a cut step's TERM and its KILL) and none starts after 35 s (30 s before that).
    deadline, start_by = 90, 35
    proc = subprocess.run([str(REPO / "deploy" / "gpu-check.sh"), str(out), "--tiny"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "SENSAI_GPU_CHECK_DEADLINE_S": str(deadline),
                               "SENSAI_GPU_CHECK_CAP_PCT": "2"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "gpu-check.log").read_text()
    assert re.search(r"\] train \(cap 1 s\): ", log)
    assert re.search(r"\] train: FAILED after \d+ s \(cut at its 1 s cap; see ", log)
    outcomes = dict(re.findall(r"^\[gpu-check \d+s\] (\S+): (done|SKIPPED|FAILED)", log, re.M))
    assert outcomes.pop("report") == "done"
    assert outcomes and "done" not in outcomes.values()
    for name, outcome in outcomes.items():
        if outcome == "SKIPPED":
            assert f"{name}: SKIPPED (past the {start_by} s deadline for a step to start; the " \
                   f"table is due at {deadline} s)" in log
    total = int(re.search(r"\] total (\d+) s; failed steps: ", proc.stdout).group(1))
    assert total <= deadline
    table = (out / "gpu-check.md").read_text()
    assert re.search(r"- train: failed after \d+ s \(cut at its 1 s cap; see ", table)
    # The per-level table says, for each sweep, what the log says of it.
    per_level = table.split("### Each level")[1]
    for folder, step in (("load", "load-sweep"), ("load-sleep", "load-sweep-sleep"),
                         ("load-n1", "load-sweep-n1")):
        assert f"| {folder} | {outcomes[step].lower()} " in per_level


def test_a_decompositions_cap_follows_the_speed_measured_before(tmp_path):
    sys.path.insert(0, str(REPO / "deploy"))
    from gpu_check import decompose_cap

    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({
        "stages": {"grouping": {"seconds": 5}, "retrain": {"seconds": 100}, "evaluate": {"seconds": 15}},
        "retrain": {"subnets": {"0": {"samples": 100_000}, "1": {"samples": 100_000}}}}))
    # 0.5 ms per image: 10 subnets of the default 60,000 images take 300 s, plus 20 s of the
    # other stages, 1.5x, plus 30 s.
    assert decompose_cap(manifest, 10, None) == int(1.5 * 320 + 30)
    assert decompose_cap(manifest, 2, 1000) == int(1.5 * (20 + 1) + 30)
    manifest.write_text("{}")
    assert decompose_cap(manifest, 2, None) is None
    assert decompose_cap(tmp_path / "absent.json", 2, None) is None


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


def sweep_result(processes: int, replicas: str | None, gpu_wait: str = "spin",
                 configs: tuple[str, ...] = ("class-parallel", "single")) -> dict:
    """What bench-load --sweep writes to load.json, as far as the table reads it: at 1 in
    flight only what an older bench-load recorded, at 16 the device processes' batches, the
    server's CPU and the GPU's busy share, at 64 the subnets inside the gateways, no GPU."""
    def level(concurrency, rps, p99):
        return {"concurrency": concurrency, "throughput_rps": rps, "ok": 10, "wrong": 0,
                "latency_ok_ms": {"p50": p99 / 2, "p90": p99 * 0.9, "p99": p99},
                "client_cores": 0.5, "machine_busy_cores": 3.25}

    def configuration(k):
        one, sixteen, sixty_four = level(1, 100.0 * k, 2.0), level(16, 900.0 * k, 30.0), \
            level(64, 800.0 * k, 90.0)
        sixteen.update(
            server_cpu={"gateway_processes": 9, "gateway_ms_per_answer": 0.8 / k,
                        "workers_processes": 1, "workers_ms_per_answer": 0.25 / k,
                        "gateway_busiest_thread_cores": 0.61,
                        "workers_busiest_thread_cores": 0.47 * k},
            batching=[{"name": f"subnet-{i}", "batches": 100, "requests": 1700, "rows": rows,
                       "rows_per_batch": rows / 100} for i, rows in enumerate((1720, 1690))],
            gpu_busy={"samples": 10, "mean_pct": 41.6 * k, "max_pct": 60.0})
        sixty_four.update(server_cpu={"gateway_processes": 9, "gateway_ms_per_answer": 0.7,
                                      "workers_processes": 0, "workers_ms_per_answer": 0.0,
                                      "gateway_busiest_thread_cores": 0.98,
                                      "workers_busiest_thread_cores": None},
                          batching=None)
        return {"label": key, "transport": "http-v2", "levels": [one, sixteen, sixty_four],
                "overload": {"goodput_rps": 700.0 * k}}

    result = {"kind": "sensai-bench-load-sweep", "configs": {},
              "settings": {"gateway": {"gateway_processes": processes, "gpu_wait": gpu_wait},
                           "gateway_env": {"SENSAI_GATEWAY_REPLICAS": replicas} if replicas
                           else {}}}
    for key, k in (("class-parallel", 2), ("single", 1)):
        if key in configs:
            result["configs"][key] = configuration(k)
    return result


def test_report_is_written_when_every_input_is_missing(tmp_path):
    # Nothing at all: still the table, each part a row saying it did not run.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = report(empty)
    assert proc.returncode == 0, proc.stderr
    table = (empty / "gpu-check.md").read_text()
    assert "not run: no bench.json" in table
    for label in ("gateway processes: auto", "gateway processes: auto, GPU wait: sleep",
                  "gateway processes: 1"):
        assert f"| {label} | - | not run: no load.json" in table
    # The per-level table still comes: a line per sweep saying why it has no levels.
    assert LEVEL_HEADER in table
    for folder, step in (("load", "load-sweep"), ("load-sleep", "load-sweep-sleep"),
                         ("load-n1", "load-sweep-n1")):
        assert f"| {folder} | not run: no load.json, and gpu-check.log has no word of {step} |" \
            in table
    assert "Cores: " in table
    summary = json.loads((empty / "gpu-check.json").read_text())
    assert {m["part"] for m in summary["missing"]} == {"bench", "load", "load-sleep", "load-n1"}
    assert [r["sweep"] for r in summary["levels"]] == ["load", "load-sleep", "load-n1"]
    assert all(r["why"].startswith("not run: no load.json") for r in summary["levels"])

    # The H200 run whose decomposition took 285 s: every later step past the deadline.
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "load").mkdir()  # gpu-check.sh makes the folder before the step skips
    (cut / "gpu-check.log").write_text(log_lines(
        "train: done in 120 s", "decompose: done in 285 s", "cores: 16 usable (nproc), 16 in all",
        *[f"{step}: SKIPPED (past the 480 s deadline)"
          for step in ("load-sweep", "load-sweep-sleep", "load-sweep-n1", "decompose-x20-g2",
                       "decompose-x20-g10", "bench-fmnist-cuda-graph", "gpu-tests",
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
    assert "| load-sleep | skipped (past the 480 s deadline) | - |" in table
    assert "Cores: 16 usable (nproc), 16 in all" in table
    assert "- gpu-tests: skipped (past the 480 s deadline)" in table
    assert "- decompose:" not in table  # it finished
    summary = json.loads((cut / "gpu-check.json").read_text())
    assert summary["runs"] == [] and summary["load_json"] is None
    assert summary["cores"] == {"usable": 16, "all": 16, "source": "gpu-check.log"}
    assert summary["steps"]["load-sweep-n1"].startswith("SKIPPED")
    assert summary["levels"][1] == {"sweep": "load-sleep",
                                    "why": "skipped (past the 480 s deadline)"}

    # A load.json of an odd shape (no settings, a level that is not one): the rest of the sweep
    # is still a row per level, the rest a "-" or a line.
    odd = tmp_path / "odd"
    (odd / "load").mkdir(parents=True)
    (odd / "load" / "load.json").write_text(json.dumps(
        {"settings": None, "configs": {"class-parallel": {"levels": [None, {"concurrency": 1}]},
                                       "triton": {"skipped": "no tritonserver here"}}}))
    proc = report(odd)
    assert proc.returncode == 0, proc.stderr
    table = (odd / "gpu-check.md").read_text()
    assert "| load | class-parallel: unreadable level: AttributeError: " in table
    assert "| load | class-parallel | - | 1 | - | - | - | - | - | - | - / - | - |" in table
    assert "| load | triton: not run, no tritonserver here | - |" in table
    assert "| gateway processes: auto | - | unreadable load.json: AttributeError: " in table


def test_report_with_every_sweep(tmp_path):
    check = tmp_path / "check"
    for folder, processes, replicas, gpu_wait, configs, util in (
            ("load", 8, None, "spin", ("class-parallel", "single"), "10\n30\n[N/A]\n50\n"),
            ("load-sleep", 8, None, "sleep", ("class-parallel",), "20\n40\n"),
            ("load-n1", 1, "1", "spin", ("class-parallel",), "5\n15\n")):
        d = check / folder
        d.mkdir(parents=True)
        (d / "load.json").write_text(json.dumps(sweep_result(processes, replicas, gpu_wait,
                                                             configs)))
        (d / "load.md").write_text(f"# sensai bench-load --sweep: vgg16_bn on fashion-mnist\n\n"
                                   f"## Closed loops\n\n{folder} levels\n")
        (d / "gpu-util.csv").write_text(util)
    (check / "gpu-check.log").write_text(log_lines(
        "cores: 16 usable (nproc), 32 in all", "load-sweep: done in 80 s",
        "load-sweep-sleep: done in 40 s",
        "load-sweep-n1: FAILED after 3 s (cut at its 3 s cap; see gpu-check.log)"))
    proc = report(check)
    assert proc.returncode == 0, proc.stderr
    table = (check / "gpu-check.md").read_text()
    # One row per sweep and configuration: the best closed loop (16 in flight), the overload
    # and the GPU's mean (max) busy share over the sweep.
    assert ("| gateway processes: auto | 8 | class-parallel | 1800.0 | 16 | 15.00 | 30.00 | "
            "1400.0 | 0.50 | 3.25 | 30 % (50 %) |") in table
    assert "| gateway processes: auto | 8 | single | 900.0 | 16 |" in table
    assert ("| gateway processes: auto, GPU wait: sleep | 8 | class-parallel | 1800.0 | 16 | "
            "15.00 | 30.00 | 1400.0 | 0.50 | 3.25 | 30 % (40 %) |") in table
    assert ("| gateway processes: 1 | 1 | class-parallel | 1800.0 | 16 | 15.00 | 30.00 | 1400.0 "
            "| 0.50 | 3.25 | 10 % (15 %) |") in table
    assert "Cores: 16 usable (nproc), 32 in all" in table
    # A row per level of every sweep and configuration: where load.json has the batches, the
    # server's CPU and the GPU's busy share (16 in flight), each subnet's rows per batch, the
    # device processes' and gateways' CPU per answer, their busiest threads and the share; where
    # it has not (1 in flight), a "-"; where the subnets ran inside the gateways (64), no device
    # processes.
    assert LEVEL_HEADER in table
    per_level = table.split("### Each level")[1]
    assert ("| load | class-parallel | spin | 16 | 1800.0 | 15.00 | 30.00 | 17.2 / 16.9 | 0.125 | "
            "0.400 | 0.94 / 0.61 | 83 % |") in per_level
    assert ("| load | class-parallel | spin | 1 | 200.0 | 1.00 | 2.00 | - | - | - | - / - | - |"
            in per_level)
    assert ("| load | class-parallel | spin | 64 | 1600.0 | 45.00 | 90.00 | - | "
            "- (in the gateways) | 0.700 | - / 0.98 | - |") in per_level
    assert ("| load | single | spin | 16 | 900.0 | 15.00 | 30.00 | 17.2 / 16.9 | 0.250 | 0.800 | "
            "0.47 / 0.61 | 42 % |") in per_level
    assert "| load-sleep | class-parallel | sleep | 16 | 1800.0 |" in per_level
    assert "| load-n1 | class-parallel | spin | 64 | 1600.0 |" in per_level
    assert per_level.index("| load |") < per_level.index("| load-sleep |") \
        < per_level.index("| load-n1 |")
    # Each sweep's own report, one level down under the check's title, named.
    assert "## gateway processes: auto: sensai bench-load --sweep: vgg16_bn" in table
    assert "## gateway processes: auto, GPU wait: sleep: sensai bench-load --sweep" in table
    assert "## gateway processes: 1: sensai bench-load --sweep: vgg16_bn" in table
    assert table.count("### Closed loops") == 3
    assert table.index("load levels") < table.index("load-sleep levels") \
        < table.index("load-n1 levels")
    # The bench steps left nothing (and said nothing): one row says so.
    assert "not run: no bench.json" in table
    # A step the log says was cut is named, even where its files are there.
    assert "- load-sweep-n1: failed after 3 s (cut at its 3 s cap; see gpu-check.log)" in table
    summary = json.loads((check / "gpu-check.json").read_text())
    assert summary["load_json"] == str(check / "load" / "load.json")
    auto, sleep, one = summary["sweeps"]
    assert (auto["gateway_processes"], sleep["gateway_processes"], one["gateway_processes"]) \
        == (8, 8, 1)
    assert auto["gpu_util"] == {"samples": 3, "mean_pct": 30.0, "max_pct": 50.0,
                                "csv": str(check / "load" / "gpu-util.csv")}
    assert sleep["gpu_util"]["samples"] == 2 and one["gpu_util"]["max_pct"] == 15.0
    # The same rows as data.
    levels = summary["levels"]
    assert [(r["sweep"], r["configuration"], r["in_flight"]) for r in levels] == [
        (folder, key, c) for folder, keys in (("load", ("class-parallel", "single")),
                                              ("load-sleep", ("class-parallel",)),
                                              ("load-n1", ("class-parallel",)))
        for key in keys for c in (1, 16, 64)]
    at16 = levels[1]
    assert at16["gpu_wait"] == "spin" and at16["answers_per_s"] == 1800.0
    assert (at16["p50_ms"], at16["p99_ms"]) == (15.0, 30.0)
    assert [w["rows_per_batch"] for w in at16["rows_per_batch"]] == [17.2, 16.9]
    assert at16["rows_per_batch"][0] == {"subnet": "subnet-0", "rows_per_batch": 17.2,
                                         "batches": 100, "requests": 1700, "rows": 1720}
    assert (at16["device_cpu_ms_per_answer"], at16["gateway_cpu_ms_per_answer"]) == (0.125, 0.4)
    assert (at16["gpu_busy_mean_pct"], at16["gpu_busy_samples"]) == (83.2, 10)
    at1, at64 = levels[0], levels[2]
    assert at1["rows_per_batch"] is None and at1["gpu_busy_mean_pct"] is None
    assert at1["device_cpu_ms_per_answer"] is None and at1["gateway_cpu_ms_per_answer"] is None
    assert at64["device_processes"] == 0 and at64["device_cpu_ms_per_answer"] is None
    assert {r["gpu_wait"] for r in levels if r["sweep"] == "load-sleep"} == {"sleep"}

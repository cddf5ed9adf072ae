"""deploy/gpu-check.sh's Python steps: the 224x224 image folder, and the closing table.

    python deploy/gpu_check.py imagefolder FMNIST_DIR OUT_DIR --per-class 30
    python deploy/gpu_check.py cap MANIFEST --groups G [--samples-per-subnet N]
    python deploy/gpu_check.py report CHECK_DIR

``cap`` prints the seconds to give a decomposition into G subnets, from the speed a finished one
(MANIFEST) was measured at: its stages other than retraining, and its retraining's seconds per
image times the images G subnets retrain on, with room to spare.

``report`` reads every ``bench.json`` under CHECK_DIR (one per artifact and runtime), prints one
table (p50/p99 per strategy and transport, each subnet's CUDA-graph replay, the accuracy and the
targets), then the load sweeps of gpu-check.sh's step 3 (CHECK_DIR/load: the automatic count of
gateway processes, the GPU waited for by spinning; CHECK_DIR/load-sleep: the same, waited for by
sleeping; CHECK_DIR/load-n1: one gateway process): one row per sweep and configuration (its best
closed-loop level, its overload, the GPU's mean busy share over the whole step from its
gpu-util.csv, nvidia-smi's, and the machine's cores), then one row per closed-loop level of every
sweep and configuration (answers/s, p50/p99, each subnet's rows per batch, the device processes'
and the gateways' CPU per answer, the GPU's busy share over that level), appends each sweep's own
report (load.md) and writes it all to CHECK_DIR/gpu-check.md and CHECK_DIR/gpu-check.json (the
per-level rows as data under ``levels``), with a last table of the offline work (every training
and decomposition under CHECK_DIR/models: seconds, images/s, accuracy).  Whatever is missing (a
step skipped past the deadline, cut at its cap or failed, as gpu-check.log says; a figure an
older bench-load did not record) is a row, a line or a "-" of the table, never an error: the
table always comes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sensai.bench.load_measures import gpu_busy
from sensai.bench.names import label
from sensai.bench.render import Col, Table, fmt, md_table
from sensai.bench.targets import all_checks
from sensai.data import encode_png, load_split, resolve_dataset, stratified_subset
from sensai.fsutil import write_json_atomic, write_text_atomic


def imagefolder(fmnist_dir: str, out: Path, per_class: int) -> None:
    """Fashion-MNIST images as an image folder (train/ and test/), for a model trained at
    another input size (``--image-size``): a latency artifact, not an accuracy claim."""
    spec = resolve_dataset("fashion-mnist", fmnist_dir)
    for split, n in (("train", per_class), ("test", max(2, per_class // 3))):
        data = load_split(spec, split)
        labels = [int(v) for v in data.labels]
        for i in stratified_subset(data.labels, n * spec.num_classes, seed=0):
            d = out / split / f"{labels[i]:02d}_{spec.classes[labels[i]].replace('/', '-')}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:05d}.png").write_bytes(encode_png(data.images[i]))


def rows_of(path: Path, run: dict) -> list[list[str]]:
    rows = []
    st = run["settings"]
    for key, s in run["strategies"].items():
        replay = s.get("graph_replay_ms_max")
        for transport, t in s["transports"].items():
            lat = t["latency_ms"]
            rows.append([path.parent.name, run["model"], "x".join(map(str, run["input_shape"][1:])),
                         "+".join(st.get("runtime_resolved") or [st["runtime"]]), label(key),
                         transport, fmt(lat["p50"], 3), fmt(lat["p99"], 3),
                         fmt(replay, 4) if replay is not None else "-",
                         fmt(t.get("top1"), 4)])
        one = s.get("one_call")
        if one:  # the compute alone that class parallel's rows are judged against
            rows.append([path.parent.name, run["model"],
                         "x".join(map(str, run["input_shape"][1:])), str(one.get("runtime")),
                         f"one call of every subnet ({one.get('kind')})", "inprocess, alone",
                         fmt(one["ms"]["p50"], 3), fmt(one["ms"]["p99"], 3),
                         fmt(one.get("graph_replay_ms"), 4), "-"])
    return rows


# The sweeps of step 3, in the order they run: folder, step name (in gpu-check.log), label.
SWEEPS = (("load", "load-sweep", "gateway processes: auto"),
          ("load-sleep", "load-sweep-sleep", "gateway processes: auto, GPU wait: sleep"),
          ("load-n1", "load-sweep-n1", "gateway processes: 1"))
BENCH_HEADER = ["run", "model", "input", "runtime", "strategy", "transport", "p50 ms", "p99 ms",
                "graph replay ms (slowest worker)", "top-1 (bench images)"]
SWEEP_HEADER = ["sweep", "gateway processes", "configuration", "best 200/s", "at in flight",
                "p50 ms", "p99 ms", "overload goodput 200/s", "client cores",
                "machine busy cores", "GPU busy (mean, max)"]
OFFLINE_HEADER = ["model", "work", "steps", "seconds", "images/s", "top-1", "original top-1",
                  "points", "largest subnet (params, MACs)"]
CAP_SPARE, CAP_EXTRA_S = 1.5, 30  # a cap from a measured speed: this much slower, and more
WALL_FILE = "wall_s"  # an offline step's wall seconds, written by gpu-check.sh into its folder
STEP_LINE = re.compile(r"^\[gpu-check \d+s\] (\S+): (SKIPPED .*|FAILED .*|done in .*)$")
CORES_LINE = re.compile(r"^\[gpu-check \d+s\] cores: (\d+) usable \(nproc\), (\d+) in all")


def read_log(check: Path) -> tuple[dict[str, str], dict | None]:
    """gpu-check.log's last word on each step (``done in 12 s``, ``SKIPPED (past ...)``,
    ``FAILED after ...``) and the cores it recorded; nothing where there is no log."""
    steps, cores = {}, None
    try:
        lines = (check / "gpu-check.log").read_text(errors="replace").splitlines()
    except OSError:
        return steps, cores
    for line in lines:
        if m := STEP_LINE.match(line):
            steps[m.group(1)] = m.group(2)
        elif m := CORES_LINE.match(line):
            cores = {"usable": int(m.group(1)), "all": int(m.group(2)), "source": "gpu-check.log"}
    return steps, cores


def machine_cores(logged: dict | None) -> dict:
    """The cores gpu-check.sh recorded (nproc), else this process's."""
    if logged:
        return logged
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"usable": usable, "all": os.cpu_count(), "source": "this process"}


def why_missing(step: str, steps: dict[str, str], what: str) -> str:
    """Why ``what`` is not there, as the log tells it."""
    status = steps.get(step)
    if status is None:
        return f"not run: no {what}, and gpu-check.log has no word of {step}"
    if status.startswith("SKIPPED"):
        return f"skipped {status[len('SKIPPED '):]}"
    if status.startswith("FAILED"):
        return f"failed {status[len('FAILED '):]}"
    return f"{step} {status} but wrote no {what}"


def gpu_util(path: Path) -> dict | None:
    """nvidia-smi's utilization.gpu samples in ``path`` (gpu-check.sh's, over a whole step):
    how many, their mean and maximum, and the file; None where the file is absent (no
    nvidia-smi)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return {**gpu_busy(text), "csv": str(path)}


def util_text(util: dict | None) -> str:
    if util is None:
        return "-"
    if not util["samples"]:
        return "- (no samples)"
    return f"{util['mean_pct']:.0f} % ({util['max_pct']:.0f} %)"


def sweep_rows(label_: str, result: dict, util: dict | None) -> list[list[str]]:
    """One row per configuration of a sweep: its best closed-loop level and its overload."""
    processes = str(((result.get("settings") or {}).get("gateway") or {})
                    .get("gateway_processes", "-"))
    rows = []
    for key, c in (result.get("configs") or {}).items():
        if "levels" not in c:
            rows.append([label_, processes, f"{key}: not run, {c.get('skipped', 'no levels')}",
                         *["-"] * 7, util_text(util)])
            continue
        best = max(c["levels"], key=lambda r: r.get("throughput_rps") or 0.0, default=None)
        o = c.get("overload") or {}
        lat = (best or {}).get("latency_ok_ms") or {}
        rows.append([label_, processes, key,
                     fmt(best and best.get("throughput_rps"), 1),
                     fmt(best and best.get("concurrency")), fmt(lat.get("p50")),
                     fmt(lat.get("p99")),
                     fmt(o.get("goodput_rps"), 1) if "goodput_rps" in o else
                     ("- (" + o["skipped"] + ")" if "skipped" in o else "-"),
                     fmt(best and best.get("client_cores")),
                     fmt(best and best.get("machine_busy_cores")), util_text(util)])
    return rows


def level_data(folder: str, gpu_wait, key: str, r: dict) -> dict:
    """One closed-loop level of a sweep's configuration, as gpu-check.json records it: None
    where load.json has no such figure (an older bench-load, no nvidia-smi, no batching)."""
    lat = r.get("latency_ok_ms") or {}
    cpu = r.get("server_cpu") or {}
    busy = r.get("gpu_busy") or {}
    batching = r.get("batching") or []
    return {"sweep": folder, "configuration": key, "gpu_wait": gpu_wait,
            "in_flight": r.get("concurrency"), "answers_per_s": r.get("throughput_rps"),
            "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
            "rows_per_batch": [{"subnet": w.get("name"), "rows_per_batch": w.get("rows_per_batch"),
                                "batches": w.get("batches"), "requests": w.get("requests"),
                                "rows": w.get("rows")}
                               for w in batching if isinstance(w, dict)] or None,
            "device_processes": cpu.get("workers_processes"),
            # Where the subnets run inside the gateways, there are no device processes to count.
            "device_cpu_ms_per_answer": (cpu.get("workers_ms_per_answer")
                                         if cpu.get("workers_processes") else None),
            "gateway_cpu_ms_per_answer": cpu.get("gateway_ms_per_answer"),
            "device_busiest_thread_cores": (cpu.get("workers_busiest_thread_cores")
                                            if cpu.get("workers_processes") else None),
            "gateway_busiest_thread_cores": cpu.get("gateway_busiest_thread_cores"),
            "gpu_busy_mean_pct": busy.get("mean_pct"), "gpu_busy_samples": busy.get("samples")}


def device_cpu(d: dict) -> float | str | None:
    """A level's device processes' CPU per answer; where the subnets ran inside the gateways,
    there were none."""
    if d.get("device_cpu_ms_per_answer") is not None:
        return d["device_cpu_ms_per_answer"]
    return "- (in the gateways)" if d.get("device_processes") == 0 else None


# A level's row of gpu-check.md, from its level_data.
LEVELS = Table(
    Col("sweep", "sweep"), Col("configuration", "configuration"), Col("gpu_wait", "gpu_wait"),
    Col("in flight", "in_flight"), Col("answers/s", "answers_per_s", 1), Col("p50 ms", "p50_ms"),
    Col("p99 ms", "p99_ms"),
    Col("rows per batch (each subnet)", lambda d: " / ".join(
        fmt(w["rows_per_batch"], 1) for w in d["rows_per_batch"]) if d.get("rows_per_batch")
        else None),
    Col("device processes CPU ms/answer", device_cpu, 3),
    Col("gateways CPU ms/answer", "gateway_cpu_ms_per_answer", 3),
    Col("busiest thread: device processes / gateways (cores)",
        lambda d: f"{fmt(d.get('device_busiest_thread_cores'))} / "
                  f"{fmt(d.get('gateway_busiest_thread_cores'))}"),
    Col("GPU busy (mean)", lambda d: None if d.get("gpu_busy_mean_pct") is None
        else f"{d['gpu_busy_mean_pct']:.0f} %"))


def level_rows(folder: str, result: dict) -> tuple[list[list[str]], list[dict]]:
    """A row per closed-loop level of every configuration of a sweep (a configuration that did
    not run, or a level load.json cannot tell, is a row saying so), and the same as data."""
    gpu_wait = ((result.get("settings") or {}).get("gateway") or {}).get("gpu_wait")
    cells, data = [], []
    for key, c in (result.get("configs") or {}).items():
        if not isinstance(c, dict) or not isinstance(c.get("levels"), list):
            why = (c.get("skipped") if isinstance(c, dict) else None) or "no levels"
            cells.append([folder, f"{key}: not run, {why}", fmt(gpu_wait)])
            data.append({"sweep": folder, "configuration": key, "gpu_wait": gpu_wait,
                         "why": f"not run, {why}"})
            continue
        for r in c["levels"]:
            try:
                d = level_data(folder, gpu_wait, key, r)
                (row,) = LEVELS.rows([d])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                why = f"unreadable level: {type(e).__name__}: {e}"
                cells.append([folder, f"{key}: {why}", fmt(gpu_wait)])
                data.append({"sweep": folder, "configuration": key, "gpu_wait": gpu_wait,
                             "why": why})
                continue
            cells.append(row)
            data.append(d)
    return cells, data


def demoted(md: str, title_prefix: str) -> str:
    """A sweep's load.md one heading level down, so that it sits under the check's own title,
    its title prefixed with which sweep it is."""
    out, titled = [], False
    for line in md.splitlines(keepends=True):
        if line.startswith("#"):
            if not titled and line.startswith("# "):
                line = f"# {title_prefix}: {line[2:]}"
                titled = True
            line = "#" + line
        out.append(line)
    return "".join(out)


def wall_text(folder: Path) -> str:
    """"wall N, " from the WALL_FILE gpu-check.sh leaves in an offline step's folder, else ""."""
    try:
        return f"wall {int((folder / WALL_FILE).read_text().strip())}, "
    except (OSError, ValueError):
        return ""


def offline_rows(models: Path) -> list[list[str]]:
    """One row per training (its model.json) and per decomposition (its manifest.json) under
    ``models``: how its steps ran (captured or eager), its seconds (the command's wall where
    gpu-check.sh timed it; inside the loop; outside it by phase), images per second and
    accuracy, a decomposition's beside its original's."""
    rows = []
    for path in sorted(models.glob("*/model.json")):
        name = path.parent.name
        try:
            rec = json.loads(path.read_text())
            t = rec.get("train") or {}
            history = t.get("history") or []
            per_epoch = t.get("images_per_epoch")
            images = per_epoch * len(history) if per_epoch else None
            phases = ", ".join(f"{k} {fmt(v, 1)}" for k, v in (t.get("phases") or {}).items())
            wall = wall_text(path.parent)
            rows.append([name, f"train {t.get('completed_epochs')} epochs", t.get("step") or "-",
                         f"{wall}loop {fmt(t.get('seconds'), 1)}" + (f" ({phases})" if phases
                                                                      else ""),
                         fmt(images / t["seconds"], 0) if images and t.get("seconds") else "-",
                         fmt(rec.get("test_top1"), 4), "-", "-", "-"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            rows.append([name, f"unreadable model.json: {type(e).__name__}", "-", "-", "-",
                         "-", "-", "-", "-"])
    for path in sorted(models.glob("*/manifest.json")):
        name = path.parent.name
        try:
            m = json.loads(path.read_text())
            stages = m.get("stages") or {}
            seconds = sum(v.get("seconds", 0) for v in stages.values())
            subnet_runs = ((m.get("retrain") or {}).get("subnets") or {}).values()
            retrained = sum(int(v.get("samples", 0)) for v in subnet_runs)
            modes = sorted({str(v.get("step")) for v in subnet_runs if v.get("step")})
            retrain_s = (stages.get("retrain") or {}).get("seconds")
            others = ", ".join(f"{k} {fmt(v.get('seconds'), 1)}" for k, v in stages.items()
                               if k != "retrain" and (v.get("seconds") or 0) >= 0.5)
            ev, src = m.get("evaluation") or {}, m.get("source") or {}
            subnets = m.get("subnets") or []
            shrink = (min(src["params"] / s_["params"] for s_ in subnets),
                      min(src["flops"] / s_["flops"] for s_ in subnets)) if subnets else None
            pruning = m.get("pruning") or {}
            wall = wall_text(path.parent)
            rows.append([name,
                         f"decompose G={len(m.get('groups') or [])}, {pruning.get('kind')} "
                         f"{fmt(pruning.get('shrink'), 0)}, {retrained:,} images retrained",
                         " / ".join(modes) or "-",
                         f"{wall}stages {fmt(seconds, 1)}: retrain {fmt(retrain_s, 1)}"
                         + (f" ({others})" if others else ""),
                         fmt(retrained / retrain_s, 0) if retrained and retrain_s else "-",
                         fmt(ev.get("decomposed_top1"), 4), fmt(ev.get("original_top1"), 4),
                         fmt(ev.get("delta_points"), 2),
                         f"{shrink[0]:.1f}x, {shrink[1]:.1f}x fewer" if shrink else "-"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
            rows.append([name, f"unreadable manifest.json: {type(e).__name__}", "-", "-", "-",
                         "-", "-", "-", "-"])
    return rows


def decompose_cap(manifest: Path, groups: int, samples_per_subnet: int | None) -> int | None:
    """Seconds to give a decomposition into ``groups`` subnets, from the finished one at
    ``manifest``: its other stages as they took, its retraining's seconds per image times the
    images ``groups`` subnets retrain on (``samples_per_subnet`` each, default the
    decomposition's own rule), times :data:`CAP_SPARE`, plus :data:`CAP_EXTRA_S`; None when
    the manifest has no retraining speed to go by."""
    from sensai.pruning.decompose import DecomposeConfig

    try:
        m = json.loads(manifest.read_text())
        stages = m["stages"]
        retrain_s = float(stages["retrain"]["seconds"])
        retrained = sum(int(v["samples"]) for v in m["retrain"]["subnets"].values())
        other_s = sum(float(v.get("seconds", 0)) for k, v in stages.items() if k != "retrain")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if retrained <= 0 or retrain_s <= 0:
        return None
    per_subnet = DecomposeConfig(samples_per_subnet=samples_per_subnet).samples_for(groups)
    expected = other_s + retrain_s / retrained * per_subnet * groups
    return int(CAP_SPARE * expected + CAP_EXTRA_S)


@dataclass
class BenchPart:
    """The bench runs' part of the report: gpu-check.md's table rows and the notes under them,
    gpu-check.json's summary of each run, and what is missing."""

    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: list[dict] = field(default_factory=list)
    missing: list[dict] = field(default_factory=list)


@dataclass
class LoadPart:
    """The load sweeps' part of the report: gpu-check.md's sweep and level tables and each
    sweep's own load.md, gpu-check.json's sweeps and levels, and what is missing."""

    sweep_table: list[list[str]] = field(default_factory=list)
    sweeps: list[dict] = field(default_factory=list)
    appendix: list[str] = field(default_factory=list)
    level_table: list[list[str]] = field(default_factory=list)
    levels: list[dict] = field(default_factory=list)
    missing: list[dict] = field(default_factory=list)


def report(check: Path) -> int:
    if not check.is_dir():
        print(f"no folder {check}", file=sys.stderr)
        return 2
    steps, logged_cores = read_log(check)
    cores = machine_cores(logged_cores)
    bench = bench_part(check, steps)
    load = LoadPart()
    for folder, step, label_ in SWEEPS:
        add_sweep(load, check, folder, step, label_, steps)
    offline = offline_rows(check / "models")
    text = report_text(check, bench, load, offline, cores, steps)
    write_text_atomic(check / "gpu-check.md", text)
    write_json_atomic(check / "gpu-check.json",
                      {"runs": bench.summary, "load_json": load.sweeps[0]["load_json"],
                       "sweeps": load.sweeps, "levels": load.levels,
                       "cores": cores, "steps": steps, "missing": bench.missing + load.missing,
                       "offline": [dict(zip(OFFLINE_HEADER, r)) for r in offline]})
    print(text)
    return 0


def bench_part(check: Path, steps: dict[str, str]) -> BenchPart:
    """Every bench.json under ``check``, and a row for each bench step that left none."""
    part = BenchPart()
    runs = sorted(check.glob("*/bench.json"))
    for path in runs:
        add_bench_run(part, path)
    # The bench steps that left no bench.json (bench-fmnist-torch writes fmnist_torch/).
    have = {p.parent.name for p in runs}
    for step in (s for s in steps if s.startswith("bench-")):
        run_dir = step[len("bench-"):].replace("-", "_", 1)
        if run_dir not in have:
            why = why_missing(step, steps, "bench.json")
            part.rows.append([run_dir, why, *["-"] * (len(BENCH_HEADER) - 2)])
            part.missing.append({"part": run_dir, "step": step, "why": why})
    if not part.rows:
        part.rows.append(["-", f"not run: no bench.json under {check}, and gpu-check.log has no "
                          "word of a bench step",
                          *["-"] * (len(BENCH_HEADER) - 2)])
        part.missing.append({"part": "bench", "why": "no bench.json"})
    return part


def add_bench_run(part: BenchPart, path: Path) -> None:
    """One bench.json: its rows, a note of its card, accuracy and targets, its summary."""
    try:
        run = json.loads(path.read_text())
        run_rows = rows_of(path, run)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        part.rows.append([path.parent.name, f"unreadable bench.json: {type(e).__name__}: {e}",
                          *["-"] * (len(BENCH_HEADER) - 2)])
        part.missing.append({"part": path.parent.name, "why": f"unreadable bench.json: {e}"})
        return
    part.rows += run_rows
    acc, shrink = run.get("accuracy") or {}, run.get("shrink") or {}
    gpus = (run.get("machine") or {}).get("gpus") or []
    card = gpus[0]["name"] if gpus and isinstance(gpus[0], dict) else (gpus or ["cpu"])[0]
    part.notes.append(f"- {path.parent.name}: {card}; original top-1 "
                      f"{fmt(acc.get('original_top1'), 4)}, decomposed "
                      f"{fmt(acc.get('decomposed_top1'), 4)}; largest subnet "
                      f"{fmt(shrink.get('params_ratio'), 1)}x fewer params; command: "
                      f"`{run.get('command')}`")
    try:
        checks = all_checks(run.get("targets") or {})
    except (KeyError, TypeError, ValueError, AttributeError):
        checks = []
    for c in checks:
        part.notes.append(f"  - target {c['name']}: {c['rule']} ({c.get('transport')}): "
                          f"{fmt(c['value'], 4)} -> {c['status'].upper()}")
    part.summary.append({"run": path.parent.name, "bench_json": str(path), "card": card,
                         "accuracy": acc, "shrink": shrink, "targets": run.get("targets")})


def add_sweep(part: LoadPart, check: Path, folder: str, step: str, label_: str,
              steps: dict[str, str]) -> None:
    """One sweep of step 3 (its folder under ``check``): its rows, or why it has none."""
    d = check / folder
    util = gpu_util(d / "gpu-util.csv")
    entry = {"label": label_, "dir": str(d), "step": step, "gpu_util": util,
             "load_json": None, "status": steps.get(step)}
    result = None
    try:
        result = json.loads((d / "load.json").read_text())
    except (OSError, ValueError) as e:
        if (d / "load.json").is_file():
            entry["why"] = f"unreadable load.json: {e}"
    if isinstance(result, dict):
        entry["load_json"] = str(d / "load.json")
        entry["gateway_processes"] = (((result.get("settings") or {}).get("gateway") or {})
                                      .get("gateway_processes"))
        add_sweep_rows(part, folder, label_, result, util)
    else:
        why = entry.get("why") or why_missing(step, steps, "load.json")
        entry["why"] = why
        part.sweep_table.append([label_, "-", why, *["-"] * 7, util_text(util)])
        part.level_table.append([folder, why])
        part.levels.append({"sweep": folder, "why": why})
        part.missing.append({"part": folder, "step": step, "why": why})
    if (d / "load.md").is_file():
        part.appendix.append(demoted((d / "load.md").read_text(errors="replace"), label_))
    part.sweeps.append(entry)


def add_sweep_rows(part: LoadPart, folder: str, label_: str, result: dict,
                   util: dict | None) -> None:
    """A sweep's rows of the sweep table and of the level table (a row saying why where its
    load.json cannot tell)."""
    try:
        part.sweep_table += sweep_rows(label_, result, util)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        part.sweep_table.append([label_, "-", f"unreadable load.json: {type(e).__name__}: {e}",
                                 *["-"] * 7, util_text(util)])
    try:
        cells, data = level_rows(folder, result)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        why = f"unreadable load.json: {type(e).__name__}: {e}"
        cells, data = [[folder, why]], [{"sweep": folder, "why": why}]
    if not cells:
        cells, data = [[folder, "load.json has no configurations"]], \
            [{"sweep": folder, "why": "load.json has no configurations"}]
    part.level_table += cells
    part.levels += data


def report_text(check: Path, bench: BenchPart, load: LoadPart, offline: list[list[str]],
                cores: dict, steps: dict[str, str]) -> str:
    """gpu-check.md: the bench table, the sweeps, the offline work, the steps that did not
    finish, then each sweep's own report."""
    failed = [f"- {name}: {why_missing(name, steps, 'output')}" for name, status in steps.items()
              if not status.startswith("done")]
    text = ("# gpu-check\n\n" + md_table(BENCH_HEADER, bench.rows) + "\n\n"
            + "".join(n + "\n" for n in bench.notes)
            + "\n## Under load\n\n"
            f"Cores: {fmt(cores['usable'])} usable (nproc), {fmt(cores['all'])} in all "
            f"(from {cores['source']}).  Each sweep: `sensai bench-load --sweep` of the "
            "decomposed artifact (class-parallel), in the first beside the original behind the "
            "same gateway (single); best closed-loop level by 200/s; GPU busy: nvidia-smi's "
            "utilization.gpu every 0.5 s over the whole step (the gateways' start-ups included; - "
            "where nvidia-smi is not there or the step did not start).\n\n"
            + md_table(SWEEP_HEADER, load.sweep_table) + "\n"
            + "\n### Each level\n\n"
            "Sweep: its folder under the check (load: gateway processes auto; load-sleep: the "
            "same, the GPU waited for by sleeping; load-n1: one gateway process).  Rows per batch: "
            "each subnet's (device process's) rows over its batches during the level; CPU "
            "ms/answer: the device processes' and the gateways' CPU time over the level per "
            "answer; busiest thread: the busiest single thread of the device processes and of "
            "the gateways over the level, in cores (near 1.00: that process is the wall); GPU "
            "busy: nvidia-smi's utilization.gpu over the level, sampled every 0.2 s "
            "(- where a figure was not recorded).\n\n"
            + LEVELS.md(load.level_table) + "\n"
            + "\n## Offline: training and decomposition\n\n"
            + (md_table(OFFLINE_HEADER, offline) if offline else
               f"No model.json or manifest.json under {check / 'models'}.") + "\n"
            + ("\nSteps skipped or failed:\n\n" + "\n".join(failed) + "\n" if failed else ""))
    for part in load.appendix:
        text += "\n" + part
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("imagefolder")
    f.add_argument("fmnist_dir")
    f.add_argument("out", type=Path)
    f.add_argument("--per-class", type=int, default=30)
    c = sub.add_parser("cap")
    c.add_argument("manifest", type=Path)
    c.add_argument("--groups", type=int, nargs="+", required=True,
                   help="one cap per line for each of these numbers of groups")
    c.add_argument("--samples-per-subnet", type=int, default=None)
    c.add_argument("--default", type=int, required=True,
                   help="the cap to print when the manifest gives no speed to go by")
    r = sub.add_parser("report")
    r.add_argument("check", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "imagefolder":
        imagefolder(args.fmnist_dir, args.out, args.per_class)
        return 0
    if args.cmd == "cap":
        for groups in args.groups:
            cap = decompose_cap(args.manifest, groups, args.samples_per_subnet)
            print(cap if cap is not None else args.default)
        return 0
    return report(args.check)


if __name__ == "__main__":
    sys.exit(main())

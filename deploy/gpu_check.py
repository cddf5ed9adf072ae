"""deploy/gpu-check.sh's Python steps: the 224x224 image folder, and the closing table.

    python deploy/gpu_check.py imagefolder FMNIST_DIR OUT_DIR --per-class 30
    python deploy/gpu_check.py report CHECK_DIR

``report`` reads every ``bench.json`` under CHECK_DIR (one per artifact and runtime), prints one
table (p50/p99 per strategy and transport, each subnet's CUDA-graph replay, the accuracy and the
targets), appends the load sweep's own report (CHECK_DIR/load/load.md) and writes it all to
CHECK_DIR/gpu-check.md and CHECK_DIR/gpu-check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sensai.bench.names import label
from sensai.bench.render import fmt, md_table
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
    return rows


def report(check: Path) -> int:
    runs = sorted(check.glob("*/bench.json"))
    sweep = check / "load" / "load.md"
    if not runs and not sweep.is_file():
        print(f"no bench.json or load/load.md under {check}", file=sys.stderr)
        return 1
    rows, notes, summary = [], [], []
    for path in runs:
        run = json.loads(path.read_text())
        rows += rows_of(path, run)
        acc, shrink = run.get("accuracy", {}), run.get("shrink", {})
        gpus = run["machine"].get("gpus") or []
        card = gpus[0]["name"] if gpus and isinstance(gpus[0], dict) else (gpus or ["cpu"])[0]
        notes.append(f"- {path.parent.name}: {card}; original top-1 "
                     f"{fmt(acc.get('original_top1'), 4)}, decomposed "
                     f"{fmt(acc.get('decomposed_top1'), 4)}; largest subnet "
                     f"{fmt(shrink.get('params_ratio'), 1)}x fewer params; command: "
                     f"`{run.get('command')}`")
        for c in all_checks(run.get("targets", {})):
            notes.append(f"  - target {c['name']}: {c['rule']} ({c.get('transport')}): "
                         f"{fmt(c['value'], 4)} -> {c['status'].upper()}")
        summary.append({"run": path.parent.name, "bench_json": str(path), "card": card,
                        "accuracy": acc, "shrink": shrink, "targets": run.get("targets")})
    table = md_table(["run", "model", "input", "runtime", "strategy", "transport", "p50 ms",
                      "p99 ms", "graph replay ms (slowest worker)", "top-1 (bench images)"],
                     rows)
    text = "# gpu-check\n\n" + table + "\n\n" + "\n".join(notes) + "\n"
    if sweep.is_file():
        # One level down, so the sweep's sections sit under the check's own title.
        text += "\n" + "".join("#" + line if line.startswith("#") else line
                               for line in sweep.read_text().splitlines(keepends=True))
    write_text_atomic(check / "gpu-check.md", text)
    write_json_atomic(check / "gpu-check.json",
                      {"runs": summary, "load_json": str(sweep.with_suffix(".json"))
                       if sweep.is_file() else None})
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("imagefolder")
    f.add_argument("fmnist_dir")
    f.add_argument("out", type=Path)
    f.add_argument("--per-class", type=int, default=30)
    r = sub.add_parser("report")
    r.add_argument("check", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "imagefolder":
        imagefolder(args.fmnist_dir, args.out, args.per_class)
        return 0
    return report(args.check)


if __name__ == "__main__":
    sys.exit(main())

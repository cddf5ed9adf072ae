"""The human-readable side of an artifact: ``report.json``, ``report.md`` and ``report.png``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from sensai.fsutil import atomic_path, write_json_atomic, write_text_atomic
from sensai.manifest import DecompositionManifest

log = logging.getLogger(__name__)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def build_report(manifest: DecompositionManifest, stage_seconds: dict[str, float]) -> dict[str, Any]:
    src = manifest.source
    ev = manifest.evaluation
    subnets = []
    for s in manifest.subnets:
        subnets.append({
            "index": s.index, "classes": s.classes,
            "class_names": [manifest.dataset.classes[c] for c in s.classes],
            "head": s.head, "params": s.params, "flops": s.flops,
            "params_reduction": round(src.params / max(1, s.params), 2),
            "flops_reduction": round(src.flops / max(1, s.flops), 2),
            "widths": s.widths, "accuracy": s.accuracy,
        })
    total_params = sum(s.params for s in manifest.subnets)
    total_flops = sum(s.flops for s in manifest.subnets)
    return {
        "model": manifest.model, "dataset": manifest.dataset.name,
        "groups": manifest.groups, "n_groups": len(manifest.groups),
        "original": {"params": src.params, "flops": src.flops,
                     "test_top1": ev.get("original_top1"), "recorded_test_top1": src.test_top1},
        "decomposed": {"test_top1": ev.get("decomposed_top1"), "delta_points": ev.get("delta_points"),
                       "total_params": total_params, "total_flops": total_flops,
                       "min_params_reduction": min(x["params_reduction"] for x in subnets),
                       "min_flops_reduction": min(x["flops_reduction"] for x in subnets)},
        "evaluation_images": ev.get("images"),
        "per_group": ev.get("per_group", []),
        "subnets": subnets,
        "policy": manifest.pruning, "retrain": {k: v for k, v in manifest.retrain.items()
                                                if k != "subnets"},
        "grouping": manifest.grouping,
        "stage_seconds": stage_seconds,
        "total_seconds": round(sum(stage_seconds.values()), 2),
    }


def render_markdown(rep: dict[str, Any]) -> str:
    o, d = rep["original"], rep["decomposed"]
    pol = rep["policy"]
    pol_desc = {
        "keep": f"keep the {pol.get('keep_fraction')} most active channels per layer",
        "threshold": f"APoZ >= {pol.get('theta1')} unless mean |a| >= {pol.get('theta2')}",
        "params": f"prune to {pol.get('params_fraction')} of the parameters",
        "shrink": f"at least {pol.get('shrink')}x fewer parameters and MACs per subnet "
                  f"({pol.get('allocation')} allocation"
                  + (", residual paths pruned too)" if pol.get("prune_residual") else ")"),
    }.get(pol.get("kind"), str(pol.get("kind")))
    if (pol.get("steps") or 1) > 1:
        pol_desc += f", reached in {pol['steps']} prune -> retrain steps"
    lines = [
        f"# sensAI decomposition of {rep['model']} on {rep['dataset']}",
        "",
        f"{rep['n_groups']} subnets; pruning policy: {pol_desc} "
        f"(zero threshold {pol.get('zero_threshold')}); retraining: "
        f"{rep['retrain'].get('epochs')} epoch(s) of {rep['retrain'].get('samples')} balanced "
        f"images per subnet, lr {rep['retrain'].get('lr')}.",
        "",
        "| | original | decomposed |",
        "|---|---:|---:|",
        f"| test top-1 ({rep['evaluation_images']} images) | {_pct(o['test_top1'])} | "
        f"{_pct(d['test_top1'])} |",
        f"| params | {o['params']:,} | {d['total_params']:,} total, smallest reduction "
        f"{d['min_params_reduction']}x per subnet |",
        f"| FLOPs (MACs, batch 1) | {o['flops']:,} | {d['total_flops']:,} total, smallest "
        f"reduction {d['min_flops_reduction']}x per subnet |",
        "",
    ]
    if d.get("delta_points") is not None:
        lines += [f"Decomposed minus original: {d['delta_points']:+.2f} points.", ""]
    lines += ["## Subnets", "",
              "| subnet | classes | params | x smaller | FLOPs | x fewer | top-1 on its classes "
              "(orig -> merged) | own task |",
              "|---:|---|---:|---:|---:|---:|---|---:|"]
    per_group = {g["group"]: g for g in rep["per_group"]}
    for s in rep["subnets"]:
        g = per_group.get(s["index"], {})
        lines.append(
            f"| {s['index']} | {', '.join(s['class_names'])} | {s['params']:,} | "
            f"{s['params_reduction']} | {s['flops']:,} | {s['flops_reduction']} | "
            f"{_pct(g.get('original_top1'))} -> {_pct(g.get('decomposed_top1'))} | "
            f"{_pct(g.get('subnet_balanced'))} |")
    lines += ["", "\"own task\": the subnet's balanced accuracy at telling its classes apart from "
              "the rest (mean recall over its k+1 targets).", "", "## Wall time per stage", "",
              "| stage | seconds |", "|---|---:|"]
    for k, v in rep["stage_seconds"].items():
        lines.append(f"| {k} | {v:.1f} |")
    lines += [f"| total | {rep['total_seconds']:.1f} |", "",
              "![params and accuracy per subnet](report.png)", ""]
    return "\n".join(lines)


def plot_report(rep: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    subs = rep["subnets"]
    x = np.arange(len(subs))
    labels = [f"{s['index']}" for s in subs]
    fig = Figure(figsize=(max(7.0, 0.6 * len(subs) + 4), 6.5))
    ax1, ax2 = fig.subplots(2, 1)
    params = [s["params"] for s in subs]
    bars = ax1.bar(x, params, color="tab:blue", label="subnet params")
    ax1.axhline(rep["original"]["params"], color="tab:red", ls="--", label="original model")
    for b, s in zip(bars, subs):
        ax1.annotate(f"{s['params_reduction']:.1f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                     ha="center", va="bottom", fontsize=8)
    ax1.set_ylim(0, rep["original"]["params"] * 1.15)
    ax1.set_ylabel("parameters")
    ax1.set_xticks(x, labels)
    ax1.set_title(f"{rep['model']}: {rep['n_groups']} subnets, each "
                  f">= {rep['decomposed']['min_params_reduction']}x smaller")
    ax1.legend(loc="center right", fontsize=8)
    pg = {g["group"]: g for g in rep["per_group"]}
    orig = [100 * (pg.get(s["index"], {}).get("original_top1") or 0) for s in subs]
    dec = [100 * (pg.get(s["index"], {}).get("decomposed_top1") or 0) for s in subs]
    w = 0.38
    ax2.bar(x - w / 2, orig, w, label="original", color="tab:gray")
    ax2.bar(x + w / 2, dec, w, label="decomposed (merged)", color="tab:green")
    ax2.set_ylim(max(0.0, min(orig + dec) - 10), 100)
    ax2.set_ylabel("test top-1 on the group's classes (%)")
    ax2.set_xlabel("subnet")
    ax2.set_xticks(x, labels)
    o, d = rep["original"]["test_top1"], rep["decomposed"]["test_top1"]
    if o is not None and d is not None:
        ax2.set_title(f"overall top-1: original {100 * o:.2f}%, decomposed {100 * d:.2f}%")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def write_report(artifact_dir: str | Path, manifest: DecompositionManifest,
                 stage_seconds: dict[str, float]) -> dict[str, Any]:
    root = Path(artifact_dir)
    rep = build_report(manifest, stage_seconds)
    write_json_atomic(root / "report.json", rep)
    write_text_atomic(root / "report.md", render_markdown(rep))
    try:
        plot_report(rep, root / "report.png")
    except Exception as e:  # the numbers are in report.json either way
        log.warning("could not draw %s: %s", root / "report.png", e)
    return rep

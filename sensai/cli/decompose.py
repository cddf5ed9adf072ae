"""``sensai decompose`` and ``sensai evaluate``."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from sensai.training.options import TrainOptions

from .knobs import add_set_flag, dataclass_knobs
from .options_args import add_flag
from .train import add_device_arg

STEPS = {f.name: f.metadata for f in fields(TrainOptions)}  # retraining steps run as training's


@dataclass(frozen=True)
class RunOptions:
    """How a decomposition runs, not what it makes (none is among the artifact's settings): the
    ``--set`` keys beside :class:`sensai.pruning.decompose.DecomposeConfig`'s."""

    retrain_jobs: int | None = field(default=None, metadata={
        "help": "subnets retrained at once (none: on GPUs all of them, sharing the GPUs; on CPUs "
                "one per core)"})
    compile: bool = field(default=False, metadata=STEPS["compile"])
    capture: bool = field(default=True, metadata=STEPS["capture"])
    eval_limit: int | None = field(default=None, metadata={
        "help": "evaluate on a stratified subset of about this many test images, at least "
                "one of each class (none: all)"})


def register(sub) -> None:
    sub.add_parser(
        "decompose", help="split a trained model into pruned per-group subnets",
        description="Group the classes, prune one subnet per group by class-specific APoZ, "
                    "retrain each (in parallel on Ray, else in process), export ONNX and "
                    "evaluate. Every stage is saved under --out; re-running the same command "
                    "resumes.",
        arguments=add_decompose_args)

    p = sub.add_parser("evaluate", help="original vs decomposed accuracy of an artifact")
    p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")
    p.add_argument("--limit", type=int, default=None,
                   help=RunOptions.__dataclass_fields__["eval_limit"].metadata["help"])
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--trust-model-code", action="store_true",
                   help="the model is a package.module:factory: import it (that runs its code)")
    add_device_arg(p)
    p.set_defaults(func=cmd_evaluate)


def add_decompose_args(p: argparse.ArgumentParser) -> None:
    """``sensai decompose``'s arguments, described by :class:`DecomposeConfig` (a module that
    imports torch: added only when the command is used)."""
    from sensai.pruning.decompose import DecomposeConfig

    config = {k.name: k for k in dataclass_knobs(DecomposeConfig)}
    p.add_argument("--model-dir", required=True, help="directory written by 'sensai train' or "
                   "'sensai import' (model.json + model.safetensors)")
    p.add_argument("--groups", "-G", type=int, required=True,
                   help="number of subnets G (1..N; G = N gives one binary subnet per class)")
    p.add_argument("--out", required=True, help="artifact directory")
    p.add_argument("--data-dir", default=None,
                   help="where the model's dataset is (default: as recorded in model.json)")
    method = p.add_argument_group(
        "method", "Recorded in the artifact: re-running into it with other values is refused "
                  "unless --force.")
    hints = typing.get_type_hints(DecomposeConfig)
    flags = config_flags(DecomposeConfig)
    for f in flags:
        add_flag(method, f, hints[f.name])
    add_set_flag(method, [k for name, k in config.items() if name not in {f.name for f in flags}]
                 + dataclass_knobs(RunOptions),
                 "the method's other knobs, and how it runs (retrain_jobs, compile, capture, "
                 "eval_limit: not recorded)")
    where = p.add_argument_group("where the subnets are retrained")
    where.add_argument("--no-ray", action="store_true",
                       help="retrain the subnets in this process: on a GPU retrain_jobs at once, "
                            "on the CPU one after another (what a machine without Ray does)")
    where.add_argument("--ray-address", default=None,
                       help="Ray cluster to retrain on, e.g. 10.0.0.5:6379 (default: "
                            "RAY_ADDRESS, else a local instance)")
    p.add_argument("--force", action="store_true",
                   help="start over, replacing what an earlier decomposition wrote in --out")
    p.add_argument("--trust-model-code", action="store_true",
                   help="the model is a package.module:factory: import it (that runs its code)")
    add_device_arg(p)
    p.set_defaults(func=cmd_decompose)


def config_flags(config_class) -> list[dataclasses.Field]:
    """The decisions among the config's fields (``metadata["flag"]``), each a flag; the rest
    are --set keys."""
    return [f for f in dataclasses.fields(config_class) if "flag" in f.metadata]


def cmd_decompose(args) -> int:
    from sensai.pruning.decompose import DecomposeConfig, decompose

    knobs = dict(args.knobs)
    run = RunOptions(**{f.name: knobs.pop(f.name) for f in fields(RunOptions) if f.name in knobs})
    config = DecomposeConfig(**{f.name: getattr(args, f.name)
                                for f in config_flags(DecomposeConfig)}, **knobs)
    manifest = decompose(args.model_dir, args.out, groups=args.groups, config=config,
                         device=args.device, data_dir=args.data_dir, workers=run.retrain_jobs,
                         compile_=run.compile, capture=run.capture,
                         use_ray=not args.no_ray, force=args.force, eval_limit=run.eval_limit,
                         ray_address=args.ray_address, trust_code=args.trust_model_code)
    ev = manifest.evaluation
    worst = min(manifest.source.params / max(1, s.params) for s in manifest.subnets)
    orig = ev.get("original_top1")
    print(f"decomposed {manifest.model} into {len(manifest.subnets)} subnets (each >= "
          f"{worst:.1f}x fewer params): test top-1 original "
          f"{orig:.4f} -> decomposed {ev['decomposed_top1']:.4f} on {ev['images']} images -> "
          f"{Path(args.out) / 'report.md'}")
    return 0


def cmd_evaluate(args) -> int:
    import json

    from sensai.pruning.decompose import evaluate_artifact

    res = evaluate_artifact(args.artifact, device=args.device, limit=args.limit,
                            data_dir=args.data_dir, trust_code=args.trust_model_code)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    orig = res.get("original_top1")
    orig_s = (f"{orig:.4f}" if orig is not None else
              f"{res.get('original_top1_recorded')} (recorded; {res.get('note')})")
    print(f"test images: {res['images']}")
    print(f"original   top-1: {orig_s}")
    print(f"decomposed top-1: {res['decomposed_top1']:.4f}"
          + (f"  ({res['delta_points']:+.2f} points)" if "delta_points" in res else ""))

    def top1(x) -> str:  # a group with no test image has none
        return "n/a" if x is None else f"{x:.4f}"

    for g in res["per_group"]:
        print(f"  subnet {g['group']:2d} [{', '.join(g['class_names'])}]: "
              f"{top1(g['original_top1'])} -> {top1(g['decomposed_top1'])} "
              f"({g['images']} images)")
    return 0

"""``sensai decompose`` and ``sensai evaluate``."""

from __future__ import annotations

import argparse
from pathlib import Path

from .train import add_device_arg


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
                   help="evaluate on a stratified subset of this many test images (default: all)")
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--trust-model-code", action="store_true",
                   help="the model is a package.module:factory: import it (that runs its code)")
    add_device_arg(p)
    p.set_defaults(func=cmd_evaluate)


def add_decompose_args(p: argparse.ArgumentParser) -> None:
    """``sensai decompose``'s arguments, whose defaults are :class:`DecomposeConfig`'s (a module
    that imports torch: added only when the command is used)."""
    from sensai.pruning.decompose import DecomposeConfig

    d = DecomposeConfig()
    p.add_argument("--model-dir", required=True, help="directory written by 'sensai train' or "
                   "'sensai import' (model.json + model.safetensors)")
    p.add_argument("--groups", "-G", type=int, required=True,
                   help="number of subnets G (1..N; G = N gives one binary subnet per class)")
    p.add_argument("--out", required=True, help="artifact directory")
    p.add_argument("--data-dir", default=None,
                   help="where the model's dataset is (default: as recorded in model.json)")
    add_pruning_args(p.add_argument_group("pruning"), d)
    add_grouping_args(p.add_argument_group("grouping"), d)
    retraining = p.add_argument_group("retraining")
    add_retraining_args(retraining, d)
    add_retraining_run_args(retraining)
    p.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    p.add_argument("--opset", type=int, default=d.opset, help="ONNX opset (default: %(default)s)")
    p.add_argument("--eval-limit", type=int, default=None,
                   help="evaluate on a stratified subset of this many test images (default: all)")
    p.add_argument("--force", action="store_true",
                   help="start over, replacing what an earlier decomposition wrote in --out")
    p.add_argument("--trust-model-code", action="store_true",
                   help="the model is a package.module:factory: import it (that runs its code)")
    add_device_arg(p)
    p.set_defaults(func=cmd_decompose)


def add_pruning_args(g, d) -> None:
    """How much of each subnet is kept, and by which rule (defaults: ``d``'s, a
    :class:`DecomposeConfig`)."""
    g.add_argument("--policy", default=d.policy,
                   help="keep: the --keep-fraction most active channels per layer; threshold: "
                        "prune APoZ >= --theta1 unless mean |a| >= --theta2 (sensAI's rule); "
                        "params: prune to --params-fraction of the parameters; "
                        "shrink: at least --shrink times fewer parameters and MACs "
                        "(default: %(default)s)")
    g.add_argument("--keep-fraction", type=float, default=d.keep_fraction,
                   help="channels kept per layer by --policy keep (default: %(default)s)")
    g.add_argument("--theta1", type=float, default=d.theta1, help="(default: %(default)s)")
    g.add_argument("--theta2", type=float, default=d.theta2, help="(default: %(default)s)")
    g.add_argument("--params-fraction", type=float, default=d.params_fraction,
                   help="most parameters a subnet may keep, as a fraction of the original's, "
                        "for --policy params (default: %(default)s, i.e. >= 4x smaller)")
    g.add_argument("--shrink", type=float, default=d.shrink,
                   help="for --policy shrink: every subnet has at most 1/SHRINK of the original's "
                        "parameters and of its MACs (default: %(default)s)")
    g.add_argument("--allocation", default=d.allocation,
                   help="how --policy params/shrink share the budget over the layers: uniform = "
                        "the same keep fraction everywhere (default: %(default)s)")
    g.add_argument("--prune-steps", type=int, default=d.prune_steps,
                   help="reach the --shrink / --params-fraction budget in this many prune -> "
                        "retrain steps, each removing the same ratio and re-ranking channels on "
                        "the retrained subnet; the retraining images are split over the steps "
                        "(default: %(default)s, one shot)")
    g.add_argument("--prune-residual", action=argparse.BooleanOptionalAction,
                   default=d.prune_residual,
                   help="also prune residual-path channels, as coupled groups across the "
                        "additions (sensAI prunes only inside blocks; default: off)")
    g.add_argument("--min-channels", type=int, default=d.min_channels,
                   help="never keep fewer channels in a layer (default: %(default)s)")
    g.add_argument("--channel-multiple", type=int, default=d.channel_multiple,
                   help="a pruned layer keeping at least this many channels keeps a multiple of "
                        "it, the widths GPU tensor cores and CPU vector units work in "
                        "(default: %(default)s; 1 = any width)")
    g.add_argument("--zero-threshold", type=float, default=d.zero_threshold,
                   help="|activation| counted as zero for APoZ (default: %(default)s)")
    g.add_argument("--stats-per-class", type=int, default=d.stats_per_class,
                   help="training images per class the activation statistics are taken on "
                        "(default: %(default)s)")


def add_grouping_args(g, d) -> None:
    """How the classes are grouped into subnets."""
    g.add_argument("--tsne", action=argparse.BooleanOptionalAction, default=d.use_tsne,
                   help="cluster class centroids in a 2-D t-SNE embedding of the features instead "
                        "of the raw features (default: off)")
    g.add_argument("--features-per-class", type=int, default=d.features_per_class,
                   help="training images per class for the grouping features (default: %(default)s)")


def add_retraining_args(g, d) -> None:
    """What each subnet is retrained on, and how it learns."""
    g.add_argument("--retrain-epochs", type=int, default=d.retrain_epochs,
                   help="epochs per subnet, 0 = no retraining (default: %(default)s)")
    g.add_argument("--samples-per-subnet", type=int, default=d.samples_per_subnet,
                   help="balanced images per subnet and epoch - the cost bound (default: "
                        "600000 / G, at least 20000)")
    g.add_argument("--negative-share", type=float, default=d.negative_share,
                   help="fraction of each subnet's samples that are other classes' images "
                        "(default: one (k+1)-th; the loss still weighs each class like all "
                        "negatives)")
    g.add_argument("--distill", type=float, default=d.distill,
                   help="weight in [0, 1] of the original model's soft targets in the retraining "
                        "loss (default: %(default)s)")
    g.add_argument("--distill-temperature", type=float, default=d.distill_temperature,
                   help="temperature T > 0 of the distillation term: teacher and subnet outputs "
                        "are divided by T (and the term scaled by T^2); larger T weighs the "
                        "teacher's ranking of unlikely classes more (default: %(default)s)")
    g.add_argument("--hard-negatives", type=float, default=d.hard_negatives,
                   help="share in [0, 1] of the negatives drawn by how strongly the original model "
                        "mistakes them for the subnet's classes (default: %(default)s)")
    g.add_argument("--optimizer", default=d.optimizer,
                   help="sgd (Nesterov momentum) or adam (AdamW) (default: %(default)s)")
    g.add_argument("--lr", type=float, default=d.lr, help="(default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="(default: %(default)s)")


def add_retraining_run_args(g) -> None:
    """Where and how the retraining runs (not among the artifact's recorded settings)."""
    g.add_argument("--retrain-jobs", type=int, default=None, metavar="N",
                   help="subnets retrained at once (default: on GPUs all of them, sharing "
                        "the GPUs; on CPUs one per core)")
    g.add_argument("--compile", action="store_true",
                   help="run each retraining step through torch.compile (fewer, fused kernels; "
                        "each subnet compiles for tens of seconds first)")
    g.add_argument("--capture", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, replay each full batch's step from a CUDA graph captured after a few "
                        "eager steps (one launch per step); eager where capture fails, after one "
                        "warning line (default: on; the CPU runs eagerly)")
    g.add_argument("--no-ray", action="store_true",
                   help="retrain the subnets in this process: on a GPU --retrain-jobs at once, on "
                        "the CPU one after another (what a machine without Ray does)")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to retrain on, e.g. 10.0.0.5:6379 (default: RAY_ADDRESS, "
                        "else a local instance)")


def cmd_decompose(args) -> int:
    from sensai.pruning.decompose import DecomposeConfig, decompose

    config = DecomposeConfig(
        policy=args.policy, keep_fraction=args.keep_fraction, theta1=args.theta1,
        theta2=args.theta2, params_fraction=args.params_fraction, shrink=args.shrink,
        allocation=args.allocation, prune_steps=args.prune_steps,
        prune_residual=args.prune_residual,
        min_channels=args.min_channels, channel_multiple=args.channel_multiple,
        zero_threshold=args.zero_threshold, stats_per_class=args.stats_per_class,
        use_tsne=args.tsne, features_per_class=args.features_per_class,
        retrain_epochs=args.retrain_epochs, samples_per_subnet=args.samples_per_subnet,
        negative_share=args.negative_share, distill=args.distill,
        distill_temperature=args.distill_temperature,
        hard_negatives=args.hard_negatives, optimizer=args.optimizer,
        lr=args.lr, batch_size=args.batch_size, seed=args.seed, opset=args.opset)
    manifest = decompose(args.model_dir, args.out, groups=args.groups, config=config,
                         device=args.device, data_dir=args.data_dir, workers=args.retrain_jobs,
                         compile_=args.compile, capture=args.capture,
                         use_ray=not args.no_ray, force=args.force, eval_limit=args.eval_limit,
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
    for g in res["per_group"]:
        o = g["original_top1"]
        print(f"  subnet {g['group']:2d} [{', '.join(g['class_names'])}]: "
              f"{'n/a' if o is None else f'{o:.4f}'} -> {g['decomposed_top1']:.4f} "
              f"({g['images']} images)")
    return 0

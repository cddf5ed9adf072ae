"""``sensai demo``: the whole job on the embedded default, end to end.

Train the demo model (``vgg11_bn`` by default) on Fashion-MNIST, decompose it into class-parallel
subnets, serve them behind the HTTP gateway on 127.0.0.1, send real test images over HTTP and print
the answers, then measure single-image latency against the single-device and model-parallel
baselines.  Every step resumes from what an earlier run left in ``--out``.

The original is trained with one warm-up and cosine schedule over ``DEMO_EPOCHS``: the fewest
epochs that leave it a trained model to compare the subnets against (one epoch leaves it short
of what the subnets reach, which flatters them) while the whole demo keeps to its time budget on a
small CPU machine.  So short a schedule needs a longer warm-up than ``sensai train``'s default
(``DEMO_WARMUP``): reaching the peak rate within a few dozen steps sets the loss back early.  The
demo prints the accuracy after every epoch, so a reader sees how far from its plateau the model
still is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from sensai.models import DEMO_MODEL
from sensai.training.options import TrainOptions

from .knobs import Knob, add_set_flag, dataclass_knobs

DEMO_SAMPLES_PER_SUBNET = 100_000
DEMO_EPOCHS = 2
DEMO_WARMUP = 0.15
# Every epoch measured: the convergence line reads each one's top-1.
DEMO_TRAINING = TrainOptions(lr_warmup=DEMO_WARMUP, eval_every=1)
BENCH_IMAGES = Knob("bench_images", int, 100, "test images the latency benchmark measures on")

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("demo", help="train, decompose, serve, predict and benchmark the default "
                       "model on Fashion-MNIST, end to end",
                       description="Train, decompose, serve, predict and benchmark the default "
                                   "model on Fashion-MNIST, end to end, in --out; a second run "
                                   "goes on from the steps already done.")
    p.add_argument("--out", default="runs/demo", help="working directory (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="Fashion-MNIST directory (default: /usr/share/datasets/fashion-mnist)")
    p.add_argument("--model", default=DEMO_MODEL,
                   help="registry model to train and decompose (default: %(default)s: its "
                        "compute per image is what class parallelism divides; a tiny model "
                        "shows no gain over HTTP)")
    p.add_argument("--epochs", type=int, default=DEMO_EPOCHS,
                   help="training epochs, one warm-up and cosine schedule over all (default: "
                        "%(default)s)")
    p.add_argument("--groups", "-G", type=int, default=2,
                   help="subnets (default: %(default)s, one per core of a 2-core machine; "
                        "10 gives one binary subnet per class)")
    p.add_argument("--images", type=int, default=8,
                   help="test images sent over HTTP (default: %(default)s)")
    p.add_argument("--no-bench", action="store_true", help="skip the latency benchmark")
    p.add_argument("--samples-per-subnet", type=int, default=DEMO_SAMPLES_PER_SUBNET,
                   help="retraining images per subnet (default: %(default)s, sized for the "
                        "demo's time budget on a 2-core machine; `sensai decompose` uses 600k "
                        "over all subnets); fewer is faster and less accurate")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    add_set_flag(p, demo_knobs(), "how the model is trained (as `sensai train --set`, the demo's "
                 "own defaults) and how many images the benchmark measures on")
    p.set_defaults(func=cmd_demo)


def demo_knobs() -> list[Knob]:
    """``sensai train``'s knobs at the demo's defaults, and the benchmark's image count."""
    return [replace(k, default=getattr(DEMO_TRAINING, k.name))
            for k in dataclass_knobs(TrainOptions)] + [BENCH_IMAGES]


def demo_training(args) -> TrainOptions:
    """The training options: the demo's, with what ``--set`` changed."""
    return replace(DEMO_TRAINING, **{k: v for k, v in args.knobs.items()
                                     if k != BENCH_IMAGES.name})


def bench_images(args) -> int:
    return args.knobs.get(BENCH_IMAGES.name, BENCH_IMAGES.default)


# A last epoch that still adds this much (points of top-1) says the model has not levelled off.
STILL_LEARNING_POINTS = 0.3


def training_progress(record) -> str:
    """One line on how far from converged the model is: its test top-1 after every epoch and
    what the last epoch added."""
    train = record.train
    if train is None or not train.history:
        return "  imported weights: no training history to judge convergence by"
    accs = [h["test_top1"] for h in train.history if "test_top1" in h]
    line = (f"  {train.completed_epochs} epochs, warm-up {train.warmup:.0%} then one cosine "
            f"decay; test top-1 by epoch: "
            f"{' -> '.join(f'{a:.4f}' for a in accs)}")
    if len(accs) < 2 and train.completed_epochs > 1:
        return line + " (measured after the last epoch only, so no trend: --set eval_every=1 " \
                      "measures every epoch)"
    if len(accs) < 2:
        return line + f" (one epoch shows no trend; --epochs {DEMO_EPOCHS} or more trains longer)"
    gain = 100 * (accs[-1] - accs[-2])
    verdict = ("not converged" if gain >= STILL_LEARNING_POINTS else "levelling off")
    return line + (f" (last epoch {gain:+.2f} points: {verdict}; --epochs "
                   f"{2 * train.completed_epochs} trains longer)")


def _step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def check_demo_args(args):
    """The dataset, training and decomposition settings, once every argument is checked (before
    any long work)."""
    from sensai.data import resolve_dataset
    from sensai.errors import SensaiError
    from sensai.fsutil import check_out_dir
    from sensai.models import list_models
    from sensai.pruning.decompose import DecomposeConfig

    check_out_dir(args.out, "working directory")
    if args.model not in list_models():
        raise SensaiError(f"--model {args.model!r} is not a registry model; choose one of: "
                          f"{', '.join(list_models())}")
    spec = resolve_dataset("fashion-mnist", args.data_dir)  # fail fast when the data is missing
    if not 1 <= args.groups <= spec.num_classes:
        raise SensaiError(f"--groups must be between 1 and {spec.num_classes}, got {args.groups}")
    if args.images < 1 or args.epochs < 1:
        raise SensaiError("--images and --epochs must be at least 1")
    training = demo_training(args).validate()
    if training.train_limit is not None and training.train_limit < spec.num_classes:
        raise SensaiError(f"train_limit must be at least {spec.num_classes} (one image a class)")
    if bench_images(args) < 1:
        raise SensaiError("bench_images must be at least 1")
    return spec, training, DecomposeConfig(samples_per_subnet=args.samples_per_subnet).validate()


def train_demo_model(args, spec, training: TrainOptions, model_dir: Path, device):
    """The demo model, trained here unless ``model_dir`` holds one trained with these settings."""
    from sensai.data import load_split
    from sensai.errors import CheckpointError, SensaiError
    from sensai.manifest import load_model_record
    from sensai.training.trainer import train

    try:
        record = load_model_record(model_dir)
        done = record.train
        if (done is None or (done.epochs, done.lr, done.warmup, done.batch_size, done.train_limit)
                != (args.epochs, training.lr, training.lr_warmup, training.batch_size,
                    training.train_limit)):
            raise SensaiError("different run")
        print(f"already trained: {model_dir}")
    except SensaiError:
        kwargs = dict(model_name=args.model, spec=spec, train_set=load_split(spec, "train"),
                      test_set=load_split(spec, "test"), out_dir=model_dir, epochs=args.epochs,
                      options=training, device=device)
        try:
            record = train(**kwargs)  # resumes an interrupted demo's training
        except CheckpointError as e:
            print(f"{e}; the demo trains again")  # an unfinished run with other settings
            record = train(**kwargs, resume=False)
    print(f"{record.model}: {record.params:,} params, test top-1 {record.test_top1:.4f}")
    print(training_progress(record))
    return record


def decompose_demo_model(args, spec, model_dir: Path, art: Path, config, record) -> None:
    from sensai.pruning.decompose import decompose
    from sensai.pruning.errors import SettingsMismatch

    try:
        manifest = decompose(model_dir, art, groups=args.groups, config=config,
                             device=args.device, data_dir=args.data_dir)
    except SettingsMismatch as e:
        # The demo owns this directory: an artifact from an older sensai's defaults (or another
        # model) is replaced, where `sensai decompose` would ask for --force.
        print(f"{e}; the demo decomposes again")
        manifest = decompose(model_dir, art, groups=args.groups, config=config,
                             device=args.device, data_dir=args.data_dir, force=True)
    ev = manifest.evaluation
    print(f"groups: {[[spec.classes[c] for c in g] for g in manifest.groups]}")
    for s in manifest.subnets:
        print(f"  subnet {s.index}: {s.params:,} params ({manifest.source.params / s.params:.1f}x "
              f"smaller), {s.flops / 1e6:.2f} M MACs ({manifest.source.flops / s.flops:.1f}x fewer)")
    if ev.get("original_top1") is not None:
        epochs = record.train.completed_epochs if record.train else None
        print(f"test top-1: original {ev['original_top1']:.4f}"
              f"{f' ({epochs} epochs)' if epochs else ''}, decomposed "
              f"{ev['decomposed_top1']:.4f}  (report: {art / 'report.md'})")


def serve_and_predict(args, spec, art: Path) -> None:
    """Steps 3 and 4: the subnets behind the HTTP gateway, and real test images sent to it."""
    from sensai.serving.core.settings import GatewaySettings
    from sensai.serving.gateway.app import create_app
    from sensai.serving.gateway.server import BackgroundServer
    from sensai.serving.launch.build import build_predictor

    _step("3/5 serve the subnets behind the HTTP gateway (local backend, ONNX Runtime)")
    settings = GatewaySettings(device=args.device)
    predictor = build_predictor(art, settings)
    server = BackgroundServer(create_app(predictor, settings, close_predictor=False)).start()
    try:
        print(f"gateway listening on {server.url} (POST /v1/predict, /v2/models/sensai/infer, /metrics)")
        _step(f"4/5 predict {args.images} real test images over HTTP")
        predict_over_http(server.url, spec, args.images)
    finally:
        server.stop()
        import asyncio

        asyncio.run(predictor.close())


def predict_over_http(url: str, spec, images: int) -> None:
    import httpx
    import numpy as np

    from sensai.data import encode_png, load_split

    test = load_split(spec, "test")
    idx = np.random.default_rng(0).choice(len(test), size=min(images, len(test)), replace=False)
    right = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in idx:
            x, y = test[int(i)]
            r = client.post("/v1/predict", files={"image": ("img.png", encode_png(x), "image/png")},
                            params={"top_k": 1})
            r.raise_for_status()
            body = r.json()
            best = body["predictions"][0]
            right += int(best["index"] == y)
            timing = body.get("timings_ms", {})
            print(f"  test image {int(i):>5}: predicted {best['label']:<12} ({best['score']:.2f})"
                  f"  truth {spec.classes[y]:<12} {'ok' if best['index'] == y else 'WRONG'}"
                  f"  total {timing.get('total', float('nan')):.2f} ms")
    print(f"{right}/{len(idx)} right")


def bench_demo(args, out: Path, art: Path) -> None:
    import torch

    from sensai.bench.latency import run_bench
    from sensai.bench.latency_report import render_table
    from sensai.bench.options import BenchOptions

    from . import build_parser
    from .options_args import command_line, options_from

    torch.set_num_threads(1)
    bench_dir = out / f"bench_{args.model}_g{args.groups}"
    # In process (the subnets' own gain) and over HTTP (what a caller sees); the other remote
    # transports are `sensai bench`'s.  Parsed as `sensai bench` parses it, so bench.json
    # records the command that reproduces it.
    bench = build_parser().parse_args(
        ["bench", str(art), "--out", str(bench_dir), "--images", str(bench_images(args)),
         "-c", "4", "--device", args.device, "--transports", "inprocess", "http",
         "--set", "rounds=5", *(["--data-dir", args.data_dir] if args.data_dir else [])])
    result = run_bench(art, bench_dir,
                       options_from(BenchOptions, bench, command=command_line(bench)))
    # The demo model's own targets; the gateway-overhead targets every model shares are in
    # bench.md with their explanation.
    print(render_table(result, model_targets_only=True))
    print(f"\nfull results: {bench_dir / 'bench.md'} (plot: bench.png)")


def cmd_demo(args) -> int:
    from sensai.models import select_device

    out = Path(args.out)
    spec, training, config = check_demo_args(args)
    model_dir, art = out / args.model, out / f"{args.model}_g{args.groups}"
    device = select_device(args.device)
    t_start = time.perf_counter()

    _step(f"1/5 train {args.model} on Fashion-MNIST ({args.epochs} epochs, {device})")
    record = train_demo_model(args, spec, training, model_dir, device)
    _step(f"2/5 decompose into {args.groups} class-parallel subnets")
    decompose_demo_model(args, spec, model_dir, art, config, record)
    serve_and_predict(args, spec, art)
    if args.no_bench:
        return 0
    _step("5/5 single-image latency: single device vs model parallel vs class parallel")
    bench_demo(args, out, art)
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s")
    return 0

"""``sensai models``, ``sensai train`` and ``sensai import``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sensai.bounds import check_seed
from sensai.errors import SensaiError
from sensai.fsutil import check_out_dir
from sensai.spec import DATASET_NAMES
from sensai.training.options import TrainOptions

from .knobs import add_set_flag, dataclass_knobs


def add_data_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--dataset", choices=DATASET_NAMES, default="fashion-mnist" if required else None,
                   help="dataset (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="where the dataset's files are (default for fashion-mnist: "
                        "/usr/share/datasets/fashion-mnist)")
    p.add_argument("--image-size", type=int, default=None,
                   help="imagefolder only: resize images to this square size, 8 to 2048 "
                        "(default: the training images' median side, at most 224)")


def resolved_dataset(args):
    """``--dataset``'s spec, ``--image-size`` checked first (one line)."""
    from sensai.data import resolve_dataset

    size = args.image_size
    if size is not None and args.dataset != "imagefolder":
        raise SensaiError(f"--image-size is for --dataset imagefolder; {args.dataset}'s images "
                          "have a size of their own")
    if size is not None and not 8 <= size <= 2048:
        raise SensaiError(f"--image-size must be from 8 to 2048, got {size}")
    return resolve_dataset(args.dataset, args.data_dir, size)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N (default: auto)")


def register(sub) -> None:
    p = sub.add_parser("models", help="list the model registry")
    p.add_argument("--json", action="store_true", help="print the registry as JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("train", help="train a registry model on a dataset",
                       description="Train a registry model, one warm-up and cosine schedule over "
                                   "all epochs; resumes an unfinished run in --out.  How it "
                                   "trains (learning rate, batch size, ...) is --set KEY=VALUE.")
    p.add_argument("--model", default=None, help="registry name or package.module:factory "
                   "(default: fmnist_cnn)")
    add_data_args(p)
    p.add_argument("--epochs", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    add_device_arg(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-resume", action="store_true", help="ignore an unfinished run in --out")
    add_set_flag(p, dataclass_knobs(TrainOptions), "how it trains")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("import", help="adopt your own trained weights for a registry model",
                       description="Write a trained model directory (model.safetensors and "
                                   "model.json, as `sensai train` writes) from weights you "
                                   "trained yourself, loaded as tensors only, then measure "
                                   "their test accuracy.")
    p.add_argument("--model", required=True, help="registry name or package.module:factory")
    p.add_argument("--weights", required=True, help=".safetensors, or a .pt/.pth state dict")
    add_data_args(p)
    add_device_arg(p)
    p.add_argument("--no-eval", action="store_true", help="skip measuring test accuracy")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_import)


def check_fresh_model_dir(out: str, verb: str) -> None:
    """``--out`` writable and holding no model yet: a trained model or an artifact there is
    someone's work (artifacts record its weights' hash), not to be replaced unasked.  An
    unfinished run (no model.json yet) is what ``sensai train`` resumes."""
    check_out_dir(out)
    for name, what in (("model.json", "a trained model"), ("manifest.json", "an artifact")):
        if (Path(out) / name).exists():
            raise SensaiError(f"--out {out} holds {what} ({name}): sensai {verb} into a new "
                              "folder; choose another --out, or remove this one first")


def cmd_models(args) -> int:
    from sensai.models import describe_models

    models = describe_models()
    if args.json:
        print(json.dumps(models, indent=2))
    else:
        width = max(map(len, models))
        for name, desc in models.items():
            print(f"{name:<{width}}  {desc}")
    return 0


def cmd_train(args) -> int:
    from sensai.data import load_split
    from sensai.models import DEFAULT_MODEL, create_model, select_device
    from sensai.training.trainer import check_epochs, train

    check_seed(args.seed)
    check_epochs(args.epochs)
    options = TrainOptions(**args.knobs).validate()
    check_fresh_model_dir(args.out, "trains")  # before any data is read
    model_name = args.model or DEFAULT_MODEL
    spec = resolved_dataset(args)
    # The operator typed the name: consent to import a factory.  Fail fast on a bad name.
    create_model(model_name, spec.num_classes, spec.in_channels, trust_code=True)
    device = select_device(args.device)
    record = train(model_name=model_name, spec=spec, train_set=load_split(spec, "train"),
                   test_set=load_split(spec, "test"), out_dir=args.out, epochs=args.epochs,
                   options=options, seed=args.seed, device=device,
                   resume=not args.no_resume)
    print(f"trained {record.model} on {spec.name} ({record.params:,} params) in "
          f"{record.train.seconds:.0f} s on {device}: test top-1 {record.test_top1:.4f} -> "
          f"{Path(args.out) / 'model.json'}")
    return 0


def cmd_import(args) -> int:
    from sensai.checkpoint import import_weights, load_trained_model
    from sensai.data import load_split
    from sensai.learning import predict_logits, top1
    from sensai.manifest import save_model_record
    from sensai.models import select_device

    check_fresh_model_dir(args.out, "imports")
    spec = resolved_dataset(args)
    record = import_weights(args.out, args.model, spec, args.weights)
    if not args.no_eval:
        model, record = load_trained_model(args.out, trust_code=True)
        test = load_split(spec, "test")
        acc = top1(predict_logits(model, test, spec, select_device(args.device), progress="evaluate"),
                   test.labels)
        record = record.model_copy(update={"test_top1": acc})
        save_model_record(args.out, record)
    acc = f"{record.test_top1:.4f}" if record.test_top1 is not None else "not measured"
    print(f"imported {record.model} ({record.params:,} params), test top-1 {acc} -> "
          f"{Path(args.out) / 'model.json'}")
    return 0

"""``sensai perf-data``: NVIDIA perf_analyzer's ``--input-data`` file of real test images, so
Triton's own client measures ``sensai serve`` from its first command (its default random bits
are refused as NaN or infinite, rightly)."""

from __future__ import annotations

from pathlib import Path

from sensai.bounds import check_seed
from sensai.errors import SensaiError
from sensai.fsutil import check_out_dir, overlap


def register(sub) -> None:
    p = sub.add_parser(
        "perf-data", arguments=perf_data_args,
        help="write perf_analyzer's --input-data JSON of real, normalized test images",
        description="Write NVIDIA perf_analyzer's real-input-data JSON ({\"data\": [{\"input\": "
                    "{\"content\": [...], \"shape\": [C, H, W]}}, ...]}) of --count test images "
                    "of the artifact's (or trained model's) dataset, normalized exactly as "
                    "'sensai serve' normalizes an upload; then: perf_analyzer -m sensai -u "
                    "127.0.0.1:8000 --input-data FILE.json (add -i grpc -u 127.0.0.1:8001 for "
                    "gRPC, -b N for batches of N images).")
    p.set_defaults(func=cmd_perf_data)


def perf_data_args(p) -> None:
    from sensai.bench.perf_analyzer import DEFAULT_COUNT

    p.add_argument("source", metavar="ART_OR_MODEL_DIR",
                   help="artifact directory ('sensai decompose') or trained model directory "
                        "('sensai train'): its dataset")
    p.add_argument("--out", required=True, metavar="FILE.json", help="the JSON file to write")
    p.add_argument("--count", type=int, default=DEFAULT_COUNT,
                   help="test images, one request each, sent in turn (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which test images (default: 0)")
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")


def cmd_perf_data(args) -> int:
    from sensai.bench.perf_analyzer import dataset_of, pick_test_images, write_perf_data

    # Before the dataset is read: a mistyped flag should not cost a load of the test split.
    if args.count < 1:
        raise SensaiError(f"--count must be at least 1, got {args.count}")
    check_seed(args.seed)
    if Path(args.out).is_dir():
        raise SensaiError(f"--out {args.out} is a directory; give the JSON file to write")
    if overlap(args.out, args.source):
        raise SensaiError(f"--out {args.out} lies inside {args.source}, whose files it would "
                          "replace: write it elsewhere")
    check_out_dir(Path(args.out).parent, "--out's folder")
    spec = dataset_of(args.source, args.data_dir)
    xs = pick_test_images(spec, args.count, args.seed)
    path = write_perf_data(args.out, xs)
    print(f"wrote {path}: {len(xs)} {spec.name} test images, input shape "
          f"{list(spec.input_shape)} (FP32, normalized); e.g. perf_analyzer -m sensai -u "
          f"127.0.0.1:8000 --input-data {path}")
    return 0

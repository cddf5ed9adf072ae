"""``sensai bench``: class parallel vs single device, model parallel and data parallel."""

from __future__ import annotations

import shlex
from pathlib import Path


def register(sub) -> None:
    from sensai.commands import add_device_arg

    from .bench import STRATEGIES

    p = sub.add_parser(
        "bench", help="latency benchmark: class parallel vs single device / model parallel",
        description="Measure single-image latency (p50/p90/p99/mean at concurrency 1), throughput, "
                    "params/MACs and memory per worker, and top-1, of the original model on one "
                    "worker, the original model cut into K pipeline stages on K workers, the G "
                    "subnets on G workers (sensAI) and R data-parallel replicas - on the same real "
                    "test images, in process and over HTTP through the gateway. Writes bench.json, "
                    "bench.md and bench.png to --out.")
    p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--workers", "-K", type=int, default=None,
                   help="model-parallel stages, one worker each (default: G, as many as subnets)")
    p.add_argument("--replicas", type=int, default=None,
                   help="data-parallel replicas (default: the number of stages)")
    p.add_argument("--images", type=int, default=200,
                   help="real test images timed one at a time (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed requests per strategy and transport first (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=10,
                   help="the images are timed in this many rounds, strategies taking turns, so "
                        "load changes hit them alike (default: %(default)s)")
    p.add_argument("--concurrency", "-c", type=int, default=8,
                   help="requests in flight for the throughput run (default: %(default)s)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in the throughput run (default: max(images, 4 x concurrency))")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                   metavar="STRATEGY",
                   help=f"which to run, of {', '.join(STRATEGIES)} (default: all)")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP runs")
    p.add_argument("--no-inprocess", action="store_true", help="skip the in-process runs")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of every worker's runner (default: %(default)s)")
    p.add_argument("--runtime", choices=("auto", "onnx", "torch"), default="auto",
                   help="auto: ONNX Runtime on CPUs, torch on GPUs (default: %(default)s)")
    add_device_arg(p)
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")
    p.add_argument("--seed", type=int, default=0, help="which test images (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    import logging

    from sensai.errors import SensaiError

    from .bench import render_table, run_bench

    transports = [t for t, off in (("inprocess", args.no_inprocess), ("http", args.no_http))
                  if not off]
    if not transports:
        raise SensaiError("--no-http and --no-inprocess leave nothing to measure")
    command = _command_line(args)
    # httpx logs every request at INFO: thousands of lines over the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run_bench(
        args.artifact, args.out, workers=args.workers, replicas=args.replicas, images=args.images,
        warmup=args.warmup, concurrency=args.concurrency, requests=args.requests,
        rounds=args.rounds, strategies=args.strategies, transports=transports, device=args.device,
        runtime=args.runtime, threads=args.threads, data_dir=args.data_dir, seed=args.seed,
        command=command, progress=not args.no_progress)
    print(render_table(result))
    out = Path(args.out)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


def _command_line(args) -> str:
    """The command that reproduces this run (every option that differs from its default)."""
    from .bench import STRATEGIES

    parts = ["sensai", "bench", args.artifact, "--out", args.out]
    options = (("--workers", args.workers, None), ("--replicas", args.replicas, None),
               ("--images", args.images, 200), ("--warmup", args.warmup, 20),
               ("--rounds", args.rounds, 10), ("--concurrency", args.concurrency, 8),
               ("--requests", args.requests, None), ("--threads", args.threads, 1),
               ("--runtime", args.runtime, "auto"), ("--device", args.device, "auto"),
               ("--data-dir", args.data_dir, None), ("--seed", args.seed, 0))
    for flag, value, default in options:
        if value != default:
            parts += [flag, str(value)]
    if list(args.strategies) != list(STRATEGIES):
        parts += ["--strategies", *args.strategies]
    for flag in ("no_http", "no_inprocess"):
        if getattr(args, flag):
            parts.append("--" + flag.replace("_", "-"))
    return shlex.join(parts)

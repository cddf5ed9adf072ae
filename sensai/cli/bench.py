"""``sensai bench``: class parallel vs single device, model parallel and data parallel."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from sensai.errors import SensaiError
from sensai.serving.bench.names import BACKENDS, SCENARIOS, STRATEGIES

from .train import add_device_arg


def register(sub) -> None:
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
    p.add_argument("--backend", choices=BACKENDS, default="local",
                   help="where class parallel's workers run, as for 'sensai serve' (default: "
                        "%(default)s = worker threads; the baselines always run on threads)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of every worker's runner (default: %(default)s)")
    p.add_argument("--runtime", choices=("auto", "onnx", "torch"), default="auto",
                   help="auto: ONNX Runtime on CPUs, torch on GPUs (default: %(default)s)")
    add_device_arg(p)
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")
    p.add_argument("--seed", type=int, default=0, help="which test images (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    register_robust(sub)


def cmd_bench(args) -> int:
    # torch, onnxruntime, uvicorn: only when the command runs.
    from sensai.serving.bench.latency import run_bench
    from sensai.serving.bench.latency_report import render_table

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
        rounds=args.rounds, strategies=args.strategies, transports=transports,
        backend=args.backend, device=args.device,
        runtime=args.runtime, threads=args.threads, data_dir=args.data_dir, seed=args.seed,
        command=command, progress=not args.no_progress)
    print(render_table(result))
    out = Path(args.out)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


def _command_line(args) -> str:
    """The command that reproduces this run (every option that differs from its default)."""
    parts = ["sensai", "bench", args.artifact, "--out", args.out]
    options = (("--workers", args.workers, None), ("--replicas", args.replicas, None),
               ("--images", args.images, 200), ("--warmup", args.warmup, 20),
               ("--rounds", args.rounds, 10), ("--concurrency", args.concurrency, 8),
               ("--requests", args.requests, None), ("--backend", args.backend, "local"),
               ("--threads", args.threads, 1),
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


# --------------------------------------------------------------------------------------------
# sensai bench-robust (issue 6: redundancy against stragglers and dead workers)


def register_robust(sub) -> None:
    p = sub.add_parser(
        "bench-robust", help="redundant class parallelism: stragglers and a killed worker",
        description="Serve the artifact as 'sensai serve --redundancy r' does (cyclic placement "
                    "on W = G workers; r = 0 is the default serving path 'sensai bench' "
                    "measures) and measure latency p50/p99, errors, wrong answers and the "
                    "compute overhead of the copies, without faults, with one worker delayed "
                    "(a delay distribution) and with one worker ended mid-run. Writes "
                    "robust.json, robust.md and robust.png to --out.")
    p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--redundancy", "-r", type=int, nargs="+", default=[0, 1], metavar="R",
                   help="redundancies to compare (default: 0 1)")
    p.add_argument("--hedge-ms", type=float, nargs="+", default=[0.0], metavar="MS",
                   help="for r >= 1, also one configuration per hedge delay (default: 0)")
    p.add_argument("--backend", choices=BACKENDS, default="local",
                   help="where the workers run: local (threads, the default serving path), "
                        "processes or ray (default: %(default)s)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                   metavar="SCENARIO", help=f"of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--images", type=int, default=200,
                   help="real test images per scenario (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5,
                   help="none/straggler runs interleave the configurations in this many rounds "
                        "(default: %(default)s)")
    p.add_argument("--delay", default="exp:50ms",
                   help="straggler's delay before each request: fixed:50ms, exp:20ms (mean), "
                        "uniform:10ms-80ms, optionally @p for a fraction (default: %(default)s)")
    p.add_argument("--straggler", type=int, default=0, help="worker to delay (default: 0)")
    p.add_argument("--victim", type=int, default=1, help="worker to kill (default: 1)")
    p.add_argument("--kill-at", type=float, default=0.3,
                   help="kill during this fraction of the run (default: %(default)s)")
    p.add_argument("--interval-ms", type=float, default=10.0,
                   help="failure scenario: one request every this many ms (default: 10)")
    p.add_argument("--restart-delay", type=float, default=0.0,
                   help="seconds before the dead worker is restarted (default: 0)")
    p.add_argument("--vote", action="store_true", help="vote mode (2r+1 copies, majority)")
    p.add_argument("--deadline", type=float, default=5.0, help="per-request deadline (s)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per subnet (1)")
    p.add_argument("--runtime", choices=("auto", "onnx", "torch"), default="auto")
    p.add_argument("--device", default="cpu", help="cpu (default), auto, cuda:N")
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")
    p.add_argument("--seed", type=int, default=0, help="which test images (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_robust)


def cmd_bench_robust(args) -> int:
    from sensai.serving.bench.robust import run_robust_bench
    from sensai.serving.bench.robust_report import render_table

    result = run_robust_bench(
        args.artifact, args.out, redundancies=args.redundancy, hedges_ms=args.hedge_ms,
        scenarios=args.scenarios, backend=args.backend, images=args.images, warmup=args.warmup,
        rounds=args.rounds, delay=args.delay, straggler=args.straggler, victim=args.victim, kill_at=args.kill_at,
        interval_ms=args.interval_ms, vote=args.vote, deadline_s=args.deadline,
        restart_delay_s=args.restart_delay,
        device=args.device, runtime=args.runtime, threads=args.threads, data_dir=args.data_dir,
        seed=args.seed, command=shlex.join(["sensai", "bench-robust", *_argv_tail(args)]),
        progress=not args.no_progress)
    print(render_table(result))
    out = Path(args.out)
    print(f"\nwrote {out / 'robust.json'}, {out / 'robust.md'}, {out / 'robust.png'}")
    return 0


def _argv_tail(args) -> list[str]:
    parts = [args.artifact, "--out", args.out, "--redundancy", *map(str, args.redundancy)]
    for flag, value, default in (("--backend", args.backend, "local"),
                                 ("--images", args.images, 200), ("--warmup", args.warmup, 20),
                                 ("--rounds", args.rounds, 5), ("--delay", args.delay, "exp:50ms"),
                                 ("--straggler", args.straggler, 0), ("--victim", args.victim, 1),
                                 ("--kill-at", args.kill_at, 0.3),
                                 ("--interval-ms", args.interval_ms, 10.0),
                                 ("--restart-delay", args.restart_delay, 0.0),
                                 ("--deadline", args.deadline, 5.0),
                                 ("--threads", args.threads, 1),
                                 ("--runtime", args.runtime, "auto"),
                                 ("--device", args.device, "cpu"),
                                 ("--data-dir", args.data_dir, None), ("--seed", args.seed, 0)):
        if value != default:
            parts += [flag, str(value)]
    if args.hedge_ms != [0.0]:
        parts += ["--hedge-ms", *(f"{h:g}" for h in args.hedge_ms)]
    if list(args.scenarios) != ["none", "straggler", "failure"]:
        parts += ["--scenarios", *args.scenarios]
    if args.vote:
        parts.append("--vote")
    return parts

"""``sensai bench``: class parallel vs single device, model parallel and data parallel."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from sensai.errors import SensaiError
from sensai.serving.core.settings import BACKENDS as SERVE_BACKENDS
from sensai.serving.core.settings import MODEL_RUNTIMES
from sensai.serving.core.wakeup import MODES

from .train import add_device_arg


def register(sub) -> None:
    """The benchmark's commands; each one's arguments are added when it is used, so the other
    commands (``sensai serve`` among them) never import the benchmark."""
    _parser(
        sub, "bench", cmd_bench, arguments=bench_args,
        help="latency benchmark: class parallel vs single device / model parallel",
        description="Measure single-image latency (p50/p90/p99/mean at concurrency 1), throughput, "
                    "params/MACs and memory per worker, and top-1, of the original model on one "
                    "worker, the original model cut into K pipeline stages on K workers, the G "
                    "subnets on G workers (sensAI) and R data-parallel replicas - on the same real "
                    "test images, in process and through the gateway over HTTP (PNG upload, KServe "
                    "v2 binary tensor) and gRPC (KServe v2), each remote request paired with the "
                    "same client's bare request to the same server. Writes bench.json, bench.md "
                    "and bench.png to --out.")
    register_robust(sub)
    register_load(sub)
    register_swap(sub)


def bench_args(p) -> None:
    from sensai.bench.names import (BENCH_BACKENDS, PEER_TRANSPORT, PEERS, STRATEGIES,
                                    TRANSPORTS, WARMUP)

    p.add_argument("--stages", "-K", dest="workers", type=int, default=None,
                   help="model-parallel stages, one worker each (default: G, as many as subnets)")
    p.add_argument("--replicas", type=int, default=None,
                   help="data-parallel replicas (default: the number of stages)")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help="untimed requests per strategy and transport first, while the workers' "
                        "placement on the cores settles (default: %(default)s)")
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
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
                   metavar="TRANSPORT",
                   help=f"how to call each strategy, of {', '.join(TRANSPORTS)}: in process, "
                        "PNG upload to /v1/predict, KServe v2 binary tensor over HTTP, KServe v2 "
                        "over gRPC (default: all)")
    p.add_argument("--backend", nargs="+", choices=BENCH_BACKENDS, default=["local"],
                   metavar="BACKEND",
                   help="where class parallel's workers run, as for 'sensai serve', of "
                        f"{', '.join(BENCH_BACKENDS)} (triton: a tritonserver the run starts; "
                        "ray-serve and processes: 'sensai serve --backend B' the run starts, "
                        "timed over http and http-v2 on its own port); "
                        "several: class parallel on each, in the same run (default: local = "
                        "worker threads; the baselines always run on threads)")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=[], metavar="PEER",
                   help=f"also serve the original model with {' and '.join(PEERS)} (Triton "
                        "Inference Server, plain Ray Serve), started and stopped by the run, "
                        f"and time them over {PEER_TRANSPORT} beside the strategies: bench.md's "
                        "'sensai vs Triton vs Ray Serve' table; a peer that cannot run here is "
                        "skipped with its reason (default: none)")
    _worker_args(p)
    p.add_argument("--keep-cores-awake", choices=MODES, default="off",
                   help="as for 'sensai serve', held for the whole run so every strategy and "
                        "peer is timed alike (default: %(default)s)")
    p.add_argument("--spread-cores", action="store_true",
                   help="as for 'sensai serve': class parallel's local worker threads are moved "
                        "apart when two share a core (default: off)")
    images_args(p, "real test images timed one at a time")


def _parser(sub, name: str, func, *, arguments, help: str, description: str) -> None:
    """A benchmark command's parser: the artifact and the output directory first, then what
    ``arguments(parser)`` adds when the command is used."""

    def add(p) -> None:
        p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")
        p.add_argument("--out", required=True, help="output directory")
        arguments(p)

    p = sub.add_parser(name, help=help, description=description, arguments=add)
    p.set_defaults(func=func, parser=p)


def images_args(p, images: str) -> None:
    """The test images, and how the run reports its progress."""
    p.add_argument("--images", type=int, default=200, help=f"{images} (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="where the dataset is (default: as recorded)")
    p.add_argument("--seed", type=int, default=0, help="which test images (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _worker_args(p) -> None:
    """Where and how the workers run, as for 'sensai serve'."""
    p.add_argument("--ray-address", default=None,
                   help="with --backend ray (or ray-serve): the Ray cluster to run the workers on "
                        "(default: RAY_ADDRESS, else a local instance); each worker's node is "
                        "reported")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of every worker's runner (default: %(default)s)")
    p.add_argument("--runtime", choices=MODEL_RUNTIMES, default="auto",
                   help="auto: ONNX Runtime on CPUs, CUDA graphs on GPUs (torch eager where a "
                        "network cannot be captured); torch: eager (default: %(default)s)")
    add_device_arg(p)


def cmd_bench(args) -> int:
    # torch, onnxruntime, uvicorn: only when the command runs.
    from sensai.bench.latency import run_bench
    from sensai.bench.latency_report import render_table
    from sensai.serving.launch.build import check_backend_installed

    transports = list(dict.fromkeys(args.transports))
    for backend in args.backend:  # before the baselines are built, not after
        check_backend_installed(backend)
    # httpx logs every request at INFO: thousands of lines over the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run_bench(
        args.artifact, args.out, workers=args.workers, replicas=args.replicas, images=args.images,
        warmup=args.warmup, concurrency=args.concurrency, requests=args.requests,
        rounds=args.rounds, strategies=args.strategies, transports=transports,
        backend=args.backend, ray_address=args.ray_address, peers=args.peers,
        device=args.device,
        runtime=args.runtime, threads=args.threads, data_dir=args.data_dir, seed=args.seed,
        keep_awake=args.keep_cores_awake, spread_cores=args.spread_cores,
        command=command_line(args), progress=not args.no_progress)
    print(render_table(result))
    out = Path(args.out)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


def command_line(args) -> str:
    """The command that reproduces this run: the command's parser, and every argument given
    that differs from its default."""
    parser = args.parser
    parts = parser.prog.split()
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings:  # a positional argument
            parts += [str(v) for v in (value if isinstance(value, list) else [value])]
            continue
        if action.dest == "help" or value == action.default or value is None:
            continue
        flag = next(f for f in action.option_strings if f.startswith("--"))
        if value is True:
            parts.append(flag)
        elif isinstance(value, list) and action.nargs is None:  # a repeatable option
            parts += [x for item in value for x in (flag, str(item))]
        else:
            parts += [flag, *(_arg(v) for v in (value if isinstance(value, list) else [value]))]
    return shlex.join(parts)


def _arg(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------------------------
# sensai bench-robust: redundancy against stragglers and dead workers


def register_robust(sub) -> None:
    _parser(
        sub, "bench-robust", cmd_bench_robust, arguments=robust_args,
        help="redundant class parallelism: stragglers and a killed worker",
        description="Serve the artifact as 'sensai serve --redundancy r' does (cyclic placement "
                    "on W = G workers; r = 0 is the default serving path 'sensai bench' "
                    "measures) and measure latency p50/p99, errors, wrong answers and the "
                    "compute overhead of the copies, without faults, with one worker delayed "
                    "(a delay distribution) and with one worker ended mid-run. Writes "
                    "robust.json, robust.md and robust.png to --out.")


def robust_args(p) -> None:
    from sensai.bench.names import DEFAULT_SCENARIOS, ROBUST_BACKENDS, SCENARIOS, WARMUP

    p.add_argument("--redundancy", "-r", type=int, nargs="+", default=[0, 1], metavar="R",
                   help="redundancies to compare (default: 0 1)")
    p.add_argument("--hedge-ms", type=float, nargs="+", default=[0.0], metavar="MS",
                   help="for r >= 1, also one configuration per hedge delay (default: 0)")
    p.add_argument("--backend", choices=ROBUST_BACKENDS, default="local",
                   help="where the workers run: local (threads, the default serving path), "
                        "processes, ray, or ray-serve (each configuration the Ray Serve "
                        "application the run starts in turn, called over HTTP with "
                        "requests always in flight; scenarios none and failure) "
                        "(default: %(default)s)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=None,
                   metavar="SCENARIO",
                   help=f"of {', '.join(SCENARIOS)} (default: {' '.join(DEFAULT_SCENARIOS)}, "
                        "those the backend takes; node-loss kills the victim's node (its raylet "
                        "and the processes it started): --backend ray on a cluster of this "
                        "machine's nodes, one configuration)")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help="untimed requests per configuration (default: %(default)s)")
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
    p.add_argument("--deadline", type=float, default=None,
                   help="per-request deadline in seconds (default: the gateway's, 5, or "
                        "$SENSAI_DEADLINE_S)")
    _worker_args(p)
    images_args(p, "real test images per scenario")


def cmd_bench_robust(args) -> int:
    from sensai.bench.robust import run_robust_bench
    from sensai.bench.robust_report import render_table

    result = run_robust_bench(
        args.artifact, args.out, redundancies=args.redundancy, hedges_ms=args.hedge_ms,
        scenarios=args.scenarios, backend=args.backend, ray_address=args.ray_address,
        images=args.images, warmup=args.warmup,
        rounds=args.rounds, delay=args.delay, straggler=args.straggler, victim=args.victim,
        kill_at=args.kill_at,
        interval_ms=args.interval_ms, vote=args.vote, deadline_s=args.deadline,
        restart_delay_s=args.restart_delay,
        device=args.device, runtime=args.runtime, threads=args.threads, data_dir=args.data_dir,
        seed=args.seed, command=command_line(args),
        progress=not args.no_progress)
    print(render_table(result))
    out = Path(args.out)
    print(f"\nwrote {out / 'robust.json'}, {out / 'robust.md'}, {out / 'robust.png'}")
    return 0


# --------------------------------------------------------------------------------------------
# sensai bench-load: soak and overload of the gateway


def register_load(sub) -> None:
    _parser(
        sub, "bench-load", cmd_bench_load, arguments=load_args,
        help="soak and overload the HTTP gateway: memory, errors, 503s, health",
        description="Start 'sensai serve ART' as a process of its own on 127.0.0.1, warm it up, "
                    "then drive it with PNG uploads to /v1/predict from separate client "
                    "processes: a soak at a fixed concurrency (throughput, p50/p99, status "
                    "codes, the gateway's RSS over time and its growth after warm-up), then an "
                    "open-loop overload at several times the soak's throughput (status codes, "
                    "p50/p99 of the admitted and of the rejected requests, health afterwards). "
                    "Writes load.json, load.md, load.png and gateway.log to --out; stops the "
                    "gateway in every case.")


def load_args(p) -> None:
    from sensai.bench.names import SWEEP_OVERLOAD_S, SWEEP_WARMUP_S

    p.add_argument("--backend", choices=SERVE_BACKENDS, default=None,
                   help="the gateway's backend, as for 'sensai serve' (default: local, or "
                        "$SENSAI_BACKEND)")
    gateway_client_args(p)
    p.add_argument("--concurrency", "-c", type=int, default=16,
                   help="soak (and warm-up): requests always in flight (default: %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="warm-up at the soak's concurrency, not counted (default: 30; with "
                        f"--sweep {SWEEP_WARMUP_S:g} per configuration, at 16 in flight)")
    p.add_argument("--soak-seconds", type=float, default=600.0,
                   help="soak duration (default: %(default)s)")
    p.add_argument("--overload-seconds", type=float, default=None,
                   help="overload duration (default: 60; with --sweep "
                        f"{SWEEP_OVERLOAD_S:g} per configuration, 0 to skip it)")
    p.add_argument("--overload-factor", type=float, default=4.0,
                   help="overload arrival rate in multiples of the soak's throughput (with "
                        "--sweep: of the best closed-loop throughput) (default: %(default)s)")
    p.add_argument("--overload-rate", type=float, default=None, metavar="REQ_PER_S",
                   help="overload arrival rate in requests/s (overrides --overload-factor)")
    p.add_argument("--overload-connections", type=int, default=None,
                   help="connections the overload may use (default: the gateway's "
                        "max_requests + --concurrency; with --ignore-retry-after, enough for "
                        "every request to wait its deadline)")
    p.add_argument("--ignore-retry-after", action="store_true",
                   help="the overload's clients send again at once after a 503 (default: a "
                        "client that gets a 503 with Retry-After waits that long before it "
                        "sends again on that connection, as polite clients do; the rate it "
                        "then offers is reported beside the rate asked)")
    p.add_argument("--burst-seconds", type=float, default=20.0,
                   help="after the overload, uploads of one large legal image (as large as "
                        "the gateway's pixel and decoded-bytes limits allow) for this long, to "
                        "report the gateway's peak memory; 0: skip (default: %(default)s)")
    p.add_argument("--burst-concurrency", type=int, default=32,
                   help="large uploads in flight during the burst (default: %(default)s)")
    p.add_argument("--sample-seconds", type=float, default=5.0,
                   help="RSS sampling period, and the bins of the timelines (default: "
                        "%(default)s)")
    load_sweep_args(p)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the gateway's settings from a deployment file 'sensai plan' wrote "
                        "(measured for this artifact), under the flags given")
    images_args(p, "real test images, sent in turn")


def load_sweep_args(p) -> None:
    """bench-load --sweep's own options."""
    from sensai.bench.names import (SWEEP_CONFIGS, SWEEP_DEFAULT_CONFIGS, SWEEP_LEVELS,
                                    SWEEP_TRANSPORTS)

    sweep = p.add_argument_group(
        "sweep", "--sweep: instead of the soak, a throughput-latency sweep of several "
                 "configurations, each started in turn: closed loops at each of --levels in "
                 "flight, the server's bare GET /v2/health/live at 16 in flight, then an "
                 "overload; the same client processes for all (their own CPU reported per "
                 "level). load.png: p99 latency against throughput, one line per configuration.")
    sweep.add_argument("--sweep", action="store_true", help="run the sweep")
    sweep.add_argument("--configs", nargs="+", choices=SWEEP_CONFIGS,
                       default=list(SWEEP_DEFAULT_CONFIGS), metavar="CONFIG",
                       help=f"of {', '.join(SWEEP_CONFIGS)}: the artifact with batching, without "
                            "(SENSAI_BATCH_MAX_ROWS=1), the original model behind the same "
                            "gateway, the original on Triton with its dynamic batcher "
                            "(skipped with the reason where it cannot run) (default: "
                            f"{' '.join(SWEEP_DEFAULT_CONFIGS)})")
    sweep.add_argument("--levels", type=int, nargs="+", default=list(SWEEP_LEVELS),
                       metavar="N", help="requests in flight of each closed loop (default: "
                                         f"{' '.join(map(str, SWEEP_LEVELS))})")
    sweep.add_argument("--level-seconds", type=float, default=5.0,
                       help="seconds of each closed loop (default: %(default)s)")
    sweep.add_argument("--transport", choices=SWEEP_TRANSPORTS, default=None,
                       help="http: PNG uploads to /v1/predict; http-v2: KServe v2 binary "
                            "tensors; one for every configuration (default: http-v2 when "
                            "triton runs, which takes only tensors, else http)")
    sweep.add_argument("--perf-analyzer", nargs="?", const="also", choices=("also", "only"),
                       default=None,
                       help="also (the default when given alone) or only: drive every "
                            "configuration with NVIDIA's perf_analyzer (where it is on PATH) at "
                            "each of --levels, KServe v2 over HTTP with --input-data of the same "
                            "test images (perf-data.json in --out), three --level-seconds/3 "
                            "windows a level; its CSV's rows (p50/p90/p99, infer/s, the server's "
                            "queue and compute) beside bench-load's own, labelled perf_analyzer. "
                            "Not on PATH: also: a warning and the rest runs; only: refused")


def gateway_client_args(p) -> None:
    """How a command that starts 'sensai serve' and loads it (bench-load, plan) sets the
    gateway up and drives it."""
    p.add_argument("--env", action="append", default=[], metavar="SENSAI_NAME=VALUE",
                   help="a gateway setting for the gateway's environment, e.g. "
                        "SENSAI_REDUNDANCY=1, SENSAI_DEADLINE_S=2, SENSAI_RUNTIME=sim "
                        "(repeatable; every setting of deploy/README.md's table; sensai plan: "
                        "every candidate keeps it, and the deployment file holds it)")
    p.add_argument("--clients", type=int, default=2,
                   help="client processes sharing the load (default: %(default)s)")
    p.add_argument("--client-cores", type=int, default=0, metavar="K",
                   help="the client processes on the last K usable cores, the gateway and "
                        "every process it starts on the others (taskset); 0: both anywhere "
                        "(default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=180.0,
                   help="seconds the gateway may take to become ready (default: %(default)s)")


def config_settings(path: str | None, artifact: str) -> dict:
    """A deployment file's settings as the gateway's environment variables (its backend and
    deadline as their own keys), after checking it was measured with ``artifact``."""
    if path is None:
        return {}
    from sensai.artifact import load_artifact
    from sensai.serving.core.settings import read_config

    from .serve import check_config_artifact

    settings, measured = read_config(path)
    check_config_artifact(path, measured, load_artifact(artifact))
    return {k if k in ("backend", "deadline_s") else f"SENSAI_{k.upper()}": str(v).lower()
            if isinstance(v, bool) else str(v) for k, v in settings.items()}


def env_number(name: str, value: str | None, kind):
    """A setting the load's own arithmetic reads too (its deadline, its limits), as a number,
    or one line naming it."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise SensaiError(f"--env {name}={value}: not a number") from None


def cmd_bench_load(args) -> int:
    from sensai.bench.load import LoadOptions, parse_env

    config = config_settings(args.config, args.artifact)
    backend, deadline = config.pop("backend", None), config.pop("deadline_s", None)
    env = config | parse_env(args.env)
    deadline = env.pop("SENSAI_DEADLINE_S", deadline)
    options = LoadOptions(
        backend=args.backend or backend,
        deadline_s=env_number("SENSAI_DEADLINE_S", deadline, float),
        max_requests=env_number("SENSAI_MAX_REQUESTS", env.pop("SENSAI_MAX_REQUESTS", None), int),
        max_predictions=env_number("SENSAI_MAX_PREDICTIONS",
                                   env.pop("SENSAI_MAX_PREDICTIONS", None), int),
        env=env,
        startup_timeout_s=args.startup_timeout, clients=args.clients,
        client_cores=args.client_cores, overload_factor=args.overload_factor,
        retry_after=not args.ignore_retry_after,
        images=args.images, data_dir=args.data_dir,
        seed=args.seed, command=command_line(args), progress=not args.no_progress)
    out = Path(args.out)
    if args.perf_analyzer and not args.sweep:
        raise SensaiError("--perf-analyzer runs at the sweep's --levels: add --sweep")
    if args.sweep:
        from sensai.bench.load_sweep import run_load_sweep
        from sensai.bench.load_sweep_report import render_table
        from sensai.bench.names import SWEEP_OVERLOAD_S, SWEEP_WARMUP_S

        result = run_load_sweep(
            args.artifact, out, options, configs=args.configs, levels=args.levels,
            level_s=args.level_seconds,
            warmup_s=SWEEP_WARMUP_S if args.warmup_seconds is None else args.warmup_seconds,
            overload_s=(SWEEP_OVERLOAD_S if args.overload_seconds is None
                        else args.overload_seconds), transport=args.transport,
            perf_analyzer=args.perf_analyzer)
        logs = f"server output: {out}/gateway-*.log"
    else:
        from sensai.bench.load import run_load_bench
        from sensai.bench.load_report import render_table

        result = run_load_bench(
            args.artifact, out, options, concurrency=args.concurrency,
            warmup_s=30.0 if args.warmup_seconds is None else args.warmup_seconds,
            soak_s=args.soak_seconds,
            overload_s=60.0 if args.overload_seconds is None else args.overload_seconds,
            overload_rate=args.overload_rate, overload_connections=args.overload_connections,
            burst_s=args.burst_seconds, burst_concurrency=args.burst_concurrency,
            sample_s=args.sample_seconds)
        logs = f"gateway output: {out / 'gateway.log'}"
    print(render_table(result))
    print(f"\nwrote {out / 'load.json'}, {out / 'load.md'}, {out / 'load.png'} ({logs})")
    return 0


# --------------------------------------------------------------------------------------------
# sensai bench-swap: new versions swapped in under load


def register_swap(sub) -> None:
    p = sub.add_parser(
        "bench-swap", arguments=swap_args,
        help="swap versions of a model in and out under a steady load",
        description="Write ARTIFACT_A as version 1 of a model repository in --out, start "
                    "'sensai serve REPO --model-control explicit' as a process of its own on "
                    "127.0.0.1, and drive it with a closed loop of PNG uploads to /v1/predict "
                    "from a client process for the whole run.  After a warm-up and a steady "
                    "period, each swap writes the next version (ARTIFACT_B, ARTIFACT_A, ... in "
                    "turn) into the repository and calls POST /v2/repository/models/NAME/load, "
                    "then waits.  Reports per swap: errors, answers by version, latency p99 "
                    "during the swap against the steady state, the time from the load request "
                    "to the first answer by the new version, and the gateway's RSS before and "
                    "after.  Writes swap.json, swap.md, swap.png and gateway.log to --out; "
                    "stops the gateway in every case.")
    p.set_defaults(func=cmd_bench_swap, parser=p)


def swap_args(p) -> None:
    p.add_argument("artifact", metavar="ARTIFACT_A",
                   help="artifact directory written by 'sensai decompose': version 1, and every "
                        "even swap")
    p.add_argument("artifact_b", metavar="ARTIFACT_B",
                   help="another artifact of the same model and dataset (e.g. another number "
                        "of groups): every odd swap")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default=None,
                   help="the model's name in the repository (default: ARTIFACT_A's model)")
    p.add_argument("--swaps", type=int, default=5, help="versions swapped in (default: "
                                                         "%(default)s)")
    p.add_argument("--concurrency", "-c", type=int, default=8,
                   help="requests always in flight (default: %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=5.0,
                   help="load before the steady state, not counted (default: %(default)s)")
    p.add_argument("--steady-seconds", type=float, default=10.0,
                   help="steady state before the first swap: the latency to compare with "
                        "(default: %(default)s)")
    p.add_argument("--after-seconds", type=float, default=10.0,
                   help="wait after each swap's load call returned (default: %(default)s)")
    p.add_argument("--backend", choices=SERVE_BACKENDS, default=None,
                   help="the gateway's backend, as for 'sensai serve' (default: local, or "
                        "$SENSAI_BACKEND)")
    p.add_argument("--sample-seconds", type=float, default=0.5,
                   help="RSS sampling period (default: %(default)s)")
    p.add_argument("--load-timeout", type=float, default=600.0,
                   help="seconds a load call may take (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=180.0,
                   help="seconds the gateway may take to become ready (default: %(default)s)")
    p.add_argument("--keep-repo", action="store_true",
                   help="keep the model repository written in --out (default: removed at the "
                        "end)")
    images_args(p, "real test images, sent in turn")


def cmd_bench_swap(args) -> int:
    from sensai.bench.swap import run_swap_bench
    from sensai.bench.swap_report import render_table

    result = run_swap_bench(
        args.artifact, args.artifact_b, args.out, model=args.model, swaps=args.swaps,
        concurrency=args.concurrency, warmup_s=args.warmup_seconds,
        steady_s=args.steady_seconds, after_s=args.after_seconds, backend=args.backend,
        sample_s=args.sample_seconds, load_timeout_s=args.load_timeout, images=args.images,
        data_dir=args.data_dir, seed=args.seed, startup_timeout_s=args.startup_timeout,
        keep_repo=args.keep_repo, command=command_line(args),
        progress=not args.no_progress)
    print(render_table(result))
    out = Path(args.out)
    print(f"\nwrote {out / 'swap.json'}, {out / 'swap.md'}, {out / 'swap.png'} "
          f"(gateway output: {out / 'gateway.log'})")
    return 0

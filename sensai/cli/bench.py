"""``sensai bench``, ``bench-robust``, ``bench-load`` and ``bench-swap``: each command's flags
and ``--set`` keys are made from the options dataclasses its run function takes
(:mod:`sensai.bench.options`, by :mod:`.options_args`)."""

from __future__ import annotations

import logging
from pathlib import Path

from sensai.errors import SensaiError

from .options_args import add_bench_options, command_line, options_from

PHASES = "the run's phases and scenario details"


def register(sub) -> None:
    """The benchmark's commands; each one's arguments are added when it is used, so the other
    commands (``sensai serve`` among them) never import the benchmark."""
    add_command(
        sub, "bench", cmd_bench, bench_args,
        help="latency benchmark: class parallel vs single device / model parallel",
        description="Measure single-image latency (p50/p90/p99/mean at concurrency 1), throughput, "
                    "params/MACs and memory per worker, and top-1, of the original model on one "
                    "worker, the original model cut into K pipeline stages on K workers, the G "
                    "subnets on G workers (sensAI) and R data-parallel replicas - on the same real "
                    "test images, in process and through the gateway over HTTP (PNG upload, KServe "
                    "v2 binary tensor) and gRPC (KServe v2), each remote request paired with the "
                    "same client's bare request to the same server. Writes bench.json, bench.md "
                    "and bench.png to --out, beside models/ (the baselines' ONNX files, "
                    "exported again by every run) and a log per server it started.")
    add_command(
        sub, "bench-robust", cmd_bench_robust, robust_args,
        help="redundant class parallelism: stragglers and a killed worker",
        description="Serve the artifact as 'sensai serve --redundancy r' does (cyclic placement "
                    "on W = G workers; r = 0 is the default serving path 'sensai bench' "
                    "measures) and measure latency p50/p99, errors, wrong answers and the "
                    "compute overhead of the copies, without faults, with one worker delayed "
                    "(a delay distribution) and with one worker ended mid-run. Writes "
                    "robust.json, robust.md and robust.png to --out.")
    add_command(
        sub, "bench-load", cmd_bench_load, load_args,
        help="soak and overload the HTTP gateway: memory, errors, 503s, health",
        description="Start 'sensai serve ART' as a process of its own on 127.0.0.1, warm it up, "
                    "then drive it with PNG uploads to /v1/predict from separate client "
                    "processes: a soak at a fixed concurrency (throughput, p50/p99, status "
                    "codes, the gateway's RSS over time and its growth after warm-up), then an "
                    "open-loop overload at several times the soak's throughput (status codes, "
                    "p50/p99 of the admitted and of the rejected requests, health afterwards). "
                    "Writes load.json, load.md, load.png and gateway.log to --out (--sweep: a "
                    "log per configuration, and original/, the original model as a one-group "
                    "artifact and its ONNX file, where a configuration serves it); stops the "
                    "gateway in every case.")
    add_command(
        sub, "bench-swap", cmd_bench_swap, swap_args,
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


def add_command(sub, name: str, func, arguments, *, help: str, description: str) -> None:
    """A command whose ``arguments(parser)`` are added when it is parsed or its help shown."""
    p = sub.add_parser(name, help=help, description=description, arguments=arguments)
    p.set_defaults(func=func, parser=p)


def artifact_arg(p) -> None:
    p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")


def bench_args(p) -> None:
    from sensai.bench.options import BenchOptions

    artifact_arg(p)
    add_bench_options(p, [BenchOptions], what=PHASES)


def robust_args(p) -> None:
    from sensai.bench.options import RobustOptions

    artifact_arg(p)
    add_bench_options(p, [RobustOptions], what=PHASES)


def load_args(p) -> None:
    from sensai.bench.options import LoadOptions, LoadPlan

    artifact_arg(p)
    add_bench_options(p, [LoadPlan, LoadOptions], what=PHASES)
    env_arg(p)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the gateway's settings from a deployment file 'sensai plan' wrote "
                        "(measured for this artifact), under the flags given")


def swap_args(p) -> None:
    from sensai.bench.options import SwapOptions

    p.add_argument("artifact", metavar="ARTIFACT_A",
                   help="artifact directory written by 'sensai decompose': version 1, and every "
                        "even swap")
    p.add_argument("artifact_b", metavar="ARTIFACT_B",
                   help="another artifact of the same model and dataset (e.g. another number "
                        "of groups): every odd swap")
    add_bench_options(p, [SwapOptions], what=PHASES)


def env_arg(p) -> None:
    """The gateway settings of a command that starts 'sensai serve' and loads it (bench-load,
    plan)."""
    p.add_argument("--env", action="append", default=[], metavar="SENSAI_NAME=VALUE",
                   help="a gateway setting for the gateway's environment, e.g. "
                        "SENSAI_REDUNDANCY=1, SENSAI_DEADLINE_S=2, SENSAI_RUNTIME=sim "
                        "(repeatable; every setting of deploy/README.md's table; sensai plan: "
                        "every candidate keeps it, and the deployment file holds it)")


def cmd_bench(args) -> int:
    # torch, onnxruntime, uvicorn: only when the command runs.
    from sensai.bench.latency import run_bench
    from sensai.bench.latency_report import render_table
    from sensai.bench.options import BenchOptions
    from sensai.serving.launch.build import check_backend_installed

    options = options_from(BenchOptions, args, command=command_line(args))
    for backend in options.backends:  # before the baselines are built, not after
        check_backend_installed(backend)
    # httpx logs every request at INFO: thousands of lines over the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run_bench(args.artifact, args.out, options)
    return reported(render_table(result), args.out, "bench")


def reported(table: str, out: str | Path, name: str, also: str = "") -> int:
    """Print a bench's table and the files it wrote (``also``: more of them, in brackets)."""
    out = Path(out)
    print(table)
    print(f"\nwrote {out / f'{name}.json'}, {out / f'{name}.md'}, {out / f'{name}.png'}"
          + (f" ({also})" if also else ""))
    return 0


def cmd_bench_robust(args) -> int:
    from sensai.bench.options import RobustOptions
    from sensai.bench.robust import run_robust_bench
    from sensai.bench.robust_report import render_table

    result = run_robust_bench(args.artifact, args.out,
                              options_from(RobustOptions, args, command=command_line(args)))
    return reported(render_table(result), args.out, "robust")


def config_settings(path: str | None, artifact: str) -> dict:
    """A deployment file's settings as the gateway's environment variables (its backend and
    deadline as their own keys), after checking it was measured with ``artifact``."""
    if path is None:
        return {}
    from sensai.artifact import load_artifact
    from sensai.serving.core.settings import environment, read_config

    from .serve import check_config_artifact

    settings, measured = read_config(path)
    check_config_artifact(path, measured, load_artifact(artifact))
    own = ("backend", "deadline_s")
    return ({k: str(v) for k, v in settings.items() if k in own}
            | environment({k: v for k, v in settings.items() if k not in own}))


def load_options(args, config: dict[str, str] | None = None):
    """bench-load's and plan's :class:`~sensai.bench.options.LoadOptions`: the flags and
    ``--set`` keys, and the gateway's environment from ``--env`` over a deployment file's
    ``config`` (its backend under ``--backend``)."""
    from sensai.bench.load import parse_env
    from sensai.bench.options import LoadOptions

    config = dict(config or {})
    backend, deadline = config.pop("backend", None), config.pop("deadline_s", None)
    env = config | parse_env(args.env)
    deadline = env.pop("SENSAI_DEADLINE_S", deadline)
    try:  # the load's own arithmetic reads the deadline too, as a number
        deadline = None if deadline is None else float(deadline)
    except ValueError:
        raise SensaiError(f"--env SENSAI_DEADLINE_S={deadline}: not a number") from None
    return options_from(LoadOptions, args, backend=getattr(args, "backend", None) or backend,
                        deadline_s=deadline, env=env, command=command_line(args))


def cmd_bench_load(args) -> int:
    from sensai.bench.load_report import render_table
    from sensai.bench.load_run import run_load
    from sensai.bench.options import LoadPlan

    options = load_options(args, config_settings(args.config, args.artifact))
    plan = options_from(LoadPlan, args)
    out = Path(args.out)
    result = run_load(args.artifact, out, options, plan)
    return reported(render_table(result), out, "load",
                    f"server output: {out}/gateway-*.log" if plan.sweep else
                    f"gateway output: {out / 'gateway.log'}")


def cmd_bench_swap(args) -> int:
    from sensai.bench.options import SwapOptions
    from sensai.bench.swap import run_swap_bench
    from sensai.bench.swap_report import render_table

    result = run_swap_bench(args.artifact, args.artifact_b, args.out,
                            options_from(SwapOptions, args, command=command_line(args)))
    return reported(render_table(result), args.out, "swap",
                    f"gateway output: {Path(args.out) / 'gateway.log'}")

"""``sensai plan``: choose the deployment by measurement, under a latency budget."""

from __future__ import annotations

import sys
from pathlib import Path

from .bench import command_line, gateway_client_args, images_args


def register(sub) -> None:
    p = sub.add_parser(
        "plan", arguments=plan_args,
        help="choose how to serve by measuring candidate deployments under your constraints",
        description="Measure candidate deployments on this host - each given model (a trained "
                    "model directory is served as the original, one group; each artifact as "
                    "decomposed) with the settings that move latency and throughput (devices "
                    "the groups are placed on, backend, gateway processes, batch size) - each "
                    "served by 'sensai serve ART --config FILE' in a process of its own and "
                    "driven by bench-load's client processes, every answer checked. The quick "
                    "search measures each model's defaults, climbs one setting at a time from "
                    "the best and confirms the top few with longer runs; --search full measures "
                    "every combination. Writes plan.json (every measured point), plan.md, "
                    "plan.png and deployment.json (for 'sensai serve ART --config') to --out; "
                    "when nothing meets the constraints it says so in one line, writes "
                    "closest.json and exits 1.")
    p.set_defaults(func=cmd_plan, parser=p)


def plan_args(p) -> None:
    from sensai.bench.names import SWEEP_TRANSPORTS
    from sensai.bench.plan import PLAN_LEVEL_S, PLAN_LEVELS, PLAN_WARMUP_S, SEARCHES
    from sensai.bench.plan_judge import OBJECTIVES

    p.add_argument("models", nargs="+", metavar="MODEL_DIR_OR_ART",
                   help="trained model directories ('sensai train', 'sensai import') and "
                        "artifacts ('sensai decompose') of one model")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--latency-budget-ms", type=float, default=None, metavar="MS",
                   help="the p99 latency a deployment must keep, one image in flight and at "
                        "the throughput it is credited with (default: none)")
    p.add_argument("--min-throughput", type=float, default=None, metavar="ANSWERS_PER_S",
                   help="answers/s a deployment must serve within the budget (default: none)")
    p.add_argument("--max-memory-mb", type=float, default=None, metavar="MB",
                   help="the most the gateway's process tree may hold resident (default: none)")
    p.add_argument("--objective", choices=OBJECTIVES, default="latency",
                   help="latency: the lowest one-image p50; throughput: the most answers/s "
                        "within the budget (default: %(default)s)")
    p.add_argument("--search", choices=SEARCHES, default="quick",
                   help="quick: defaults, climb, confirm (minutes); full: every combination, "
                        "then confirm (default: %(default)s)")
    p.add_argument("--levels", type=int, nargs="+", default=list(PLAN_LEVELS), metavar="N",
                   help="requests in flight of each closed loop, the first the one-image "
                        f"latency (default: {' '.join(map(str, PLAN_LEVELS))})")
    p.add_argument("--level-seconds", type=float, default=PLAN_LEVEL_S,
                   help="seconds of each level while searching; confirming runs three times "
                        "as long (default: %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=PLAN_WARMUP_S,
                   help="warm-up of each deployment, not counted (default: %(default)s)")
    p.add_argument("--transport", choices=SWEEP_TRANSPORTS, default="http-v2",
                   help="http: PNG uploads; http-v2: KServe v2 binary tensors (default: "
                        "%(default)s)")
    gateway_client_args(p)  # --env: kept by every candidate, written into the file
    images_args(p, "real test images, sent in turn")


def cmd_plan(args) -> int:
    from sensai.bench.load import LoadOptions, parse_env
    from sensai.bench.plan import run_plan
    from sensai.bench.plan_judge import Constraints
    from sensai.bench.plan_report import render_table

    constraints = Constraints(latency_budget_ms=args.latency_budget_ms,
                              min_throughput=args.min_throughput,
                              max_memory_mb=args.max_memory_mb, objective=args.objective)
    options = LoadOptions(env=parse_env(args.env), startup_timeout_s=args.startup_timeout,
                          clients=args.clients, client_cores=args.client_cores,
                          images=args.images, data_dir=args.data_dir, seed=args.seed,
                          command=command_line(args), progress=not args.no_progress)
    out = Path(args.out)
    result = run_plan(args.models, out, constraints, options, search=args.search,
                      levels=args.levels, level_s=args.level_seconds,
                      warmup_s=args.warmup_seconds, transport=args.transport)
    print(render_table(result))
    chosen = next(m for m in result["measured"] if m["n"] == result["chosen"])
    print(f"\nwrote {out / 'plan.json'}, {out / 'plan.md'}, {out / 'plan.png'}, "
          f"{result['deployment']}")
    if not result["meets"]:
        print(f"sensai plan: {result['why']}", file=sys.stderr)
        return 1
    print(f"serve it: sensai serve {chosen['artifact']} --config {result['deployment']}")
    return 0

"""``sensai plan``: choose the deployment by measurement, under a latency budget."""

from __future__ import annotations

import sys
from pathlib import Path

from .bench import PHASES, env_arg, load_options, reported
from .options_args import add_bench_options, options_from


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
    from sensai.bench.options import LoadOptions, PlanOptions
    from sensai.bench.plan_judge import Constraints

    p.add_argument("models", nargs="+", metavar="MODEL_DIR_OR_ART",
                   help="trained model directories ('sensai train', 'sensai import') and "
                        "artifacts ('sensai decompose') of one model")
    # The backend is planned; there is no overload to offer.
    add_bench_options(p, [Constraints, PlanOptions, LoadOptions], what=PHASES,
                      exclude=("backend", "overload_factor", "retry_after"))
    env_arg(p)  # kept by every candidate, written into the file


def cmd_plan(args) -> int:
    from sensai.bench.options import PlanOptions
    from sensai.bench.plan import run_plan
    from sensai.bench.plan_judge import Constraints
    from sensai.bench.plan_report import render_table

    out = Path(args.out)
    result = run_plan(args.models, out, options_from(Constraints, args), load_options(args),
                      options_from(PlanOptions, args))
    chosen = next(m for m in result["measured"] if m["n"] == result["chosen"])
    reported(render_table(result), out, "plan", str(result["deployment"]))
    if not result["meets"]:
        print(f"sensai plan: {result['why']}", file=sys.stderr)
        return 1
    print(f"serve it: sensai serve {chosen['artifact']} --config {result['deployment']}")
    return 0

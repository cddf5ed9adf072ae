"""``sensai bench-load --sweep``'s report: the terminal tables, ``load.md`` and ``load.png``
(p99 latency against throughput, one line per configuration)."""

from __future__ import annotations

from pathlib import Path

from .load_report import TARGET_HEADER, latency_target, retry_after_text, target_rows
from .render import (SHARED_CORES, fmt, machine_line, md_table, pyplot, save_p99_plot, server_cores,
                     status_codes, text_table)

LEVEL_HEADER = ["configuration", "transport", "in flight", "200/s", "p50 ms", "p90 ms", "p99 ms",
                "errors", "status codes", "wrong", "client CPU (cores)", "client share",
                "machine busy cores", "server cores (busiest thread)", "full GCs (ms paused)",
                "server CPU ms/answer: gateways (workers)", "gateways' CPU / the no-op's",
                "busiest thread: gateways (workers)", "rows per batch (each subnet)", "GPU busy"]
OVERLOAD_HEADER = ["configuration", "asked/s", "offered/s", "goodput (200/s)",
                   "of best closed loop", "p50 ms (200)", "p99 ms (200)", "503s", "p50 ms (503)",
                   "p99 ms (503)", "other", "client cores", "machine busy cores",
                   "server cores (busiest thread)"]
SKIPPED_HEADER = ["configuration", "not run, because"]
PERF_HEADER = ["configuration", "in flight", "infer/s", "p50 ms", "p90 ms", "p99 ms",
               "server queue ms", "server compute ms (input, infer, output)", "error"]
BATCHING_HEADER = ["configuration", "worker", "max rows", "delay us", "requests", "batches",
                   "rows per batch", "largest", "held back"]
COLORS = {"class-parallel": "#4C72B0", "class-parallel-unbatched": "#8172B2",
          "single": "#55A868", "triton": "#C44E52"}


def _row(label: str, transport: str, flight: str, r: dict, noop: dict | None = None
         ) -> list[str]:
    lat = r["latency_ok_ms"]
    share = r.get("client_cpu_share")
    return [label, transport, flight, fmt(r["throughput_rps"], 1), fmt(lat["p50"]), fmt(lat["p90"]),
            fmt(lat["p99"]), str(r["errors"]), status_codes(r["status_counts"]), str(r["wrong"]),
            fmt(r.get("client_cores")), "-" if share is None else f"{share * 100:.0f} %",
            fmt(r.get("machine_busy_cores")), server_cores(r), full_gcs(r), cpu_per_answer(r),
            over_noop(r, noop), busiest_threads(r), rows_per_batch(r), gpu_busy(r)]


def over_noop(r: dict, noop: dict | None) -> str:
    """The gateway processes' CPU per answer over a level against the same server's bare route
    (``noop``): how far a prediction is from the least an answer costs them."""
    mine = (r.get("server_cpu") or {}).get("gateway_ms_per_answer")
    floor = ((noop or {}).get("server_cpu") or {}).get("gateway_ms_per_answer")
    return f"{mine / floor:.1f}x" if mine and floor else "-"


def rows_per_batch(r: dict) -> str:
    """Each worker's (subnet's) rows per batch over a level."""
    per = [w.get("rows_per_batch") for w in r.get("batching") or []]
    return " / ".join(fmt(v) for v in per) if per else "-"


def gpu_busy(r: dict) -> str:
    """The GPU's mean busy share over a level (nvidia-smi), where there is one."""
    g = r.get("gpu_busy")
    return "-" if not g or g.get("mean_pct") is None else f"{g['mean_pct']:.0f} %"


def cpu_per_answer(r: dict) -> str:
    """The server's CPU per answer over a level: its gateway processes' (and its parent's),
    and its subnet workers' where they are processes of their own."""
    c = r.get("server_cpu")
    if not c or c.get("gateway_ms_per_answer") is None:
        return "-"
    workers = c.get("workers_ms_per_answer") if c.get("workers_processes") else None
    return fmt(c["gateway_ms_per_answer"], 3) + (
        f" ({fmt(workers, 3)})" if workers is not None else " (in the gateway)")


def busiest_threads(r: dict) -> str:
    """The busiest thread of the gateway processes (and of the workers' processes, where they
    are processes of their own) over a level, in cores."""
    c = r.get("server_cpu")
    if not c or c.get("gateway_busiest_thread_cores") is None:
        return "-"
    workers = c.get("workers_busiest_thread_cores") if c.get("workers_processes") else None
    return fmt(c["gateway_busiest_thread_cores"]) + (
        f" ({fmt(workers)})" if workers is not None else "")


def full_gcs(r: dict) -> str:
    """The gateway's full collections during a level, as its /metrics counted them."""
    g = (r.get("server") or {}).get("gc_full")
    return "-" if g is None else f"{g['collections']} ({g['paused_ms']:.0f})"


def level_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, c in result["configs"].items():
        if "levels" not in c:
            continue
        rows += [_row(key, c["transport"], str(r["concurrency"]), r, c["noop"])
                 for r in c["levels"]]
        rows.append(_row(key, "GET /v2/health/live", str(c["noop"]["concurrency"]), c["noop"],
                         c["noop"]))
    return rows


def overload_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, c in result["configs"].items():
        o = c.get("overload")
        if not o:
            continue
        if "skipped" in o:
            rows.append([key, o["skipped"], *["-"] * (len(OVERLOAD_HEADER) - 2)])
            continue
        ok, rej = o["latency_ok_ms"], o["latency_rejected_ms"]
        share = o.get("goodput_of_best_closed")
        rows.append([key, fmt(o["target_rate_rps"], 1), fmt(o["offered_rate_rps"], 1),
                     fmt(o["goodput_rps"], 1),
                     "-" if share is None else f"{share * 100:.0f} %", fmt(ok["p50"]),
                     fmt(ok["p99"]), str(o["rejected_503"]), fmt(rej["p50"]), fmt(rej["p99"]),
                     str(o["not_200_or_503"]), fmt(o.get("client_cores")),
                     fmt(o.get("machine_busy_cores")), server_cores(o)])
    return rows


def batching_rows(result: dict) -> list[list[str]]:
    """Each gateway worker's batching over the whole configuration (its own counters)."""
    rows = []
    for key, c in result["configs"].items():
        for w in c.get("batching") or []:
            per = w["requests"] / w["batches"] if w.get("batches") else None
            rows.append([key, str(w["name"]), str(w["max_rows"]), fmt(w["delay_us"], 0),
                         str(w["requests"]), str(w["batches"]), fmt(per), str(w["largest"]),
                         str(w["held"])])
    return rows


def _ms(us) -> str:
    return fmt(us / 1e3 if isinstance(us, (int, float)) else None)


def perf_rows(result: dict) -> list[list[str]]:
    """perf_analyzer's rows (``--perf-analyzer``): its own client's figures, and the server's
    breakdown where the server reports statistics."""
    rows = []
    for key, c in result["configs"].items():
        for r in c.get("perf_analyzer") or []:
            compute = [r.get(f"server_compute_{k}_us") for k in ("input", "infer", "output")]
            rows.append([key, str(r["concurrency"]), fmt(r.get("throughput_infer_per_s"), 1),
                         _ms(r.get("p50_us")), _ms(r.get("p90_us")), _ms(r.get("p99_us")),
                         _ms(r.get("server_queue_us")),
                         ", ".join(_ms(v) for v in compute) if any(compute) else "-",
                         r.get("error", "")])
    return rows


def perf_note(result: dict) -> str:
    """What the perf_analyzer table is, or why it is missing."""
    pa = result["settings"].get("perf_analyzer") or {}
    if pa.get("skipped"):
        return f"perf_analyzer was asked for ({pa['mode']}) but did not run: {pa['skipped']}."
    where = ("in place of bench-load's own client" if pa.get("mode") == "only" else
             "right after bench-load's own client's levels on the same server")
    return (f"NVIDIA perf_analyzer's own figures (its CSV, `-f`), its client {where}: KServe "
            "v2 binary tensors over HTTP, "
            f"`--input-data {pa.get('input_data')}` (the same test images), three "
            f"{pa.get('window_ms')} ms time windows per level (`--stability-percentage 100`); "
            "each row's exact command is in load.json.  Server columns: what the server's "
            "statistics say (0 or - where it keeps none).")


def skipped_rows(result: dict) -> list[list[str]]:
    return [[key, c["skipped"]] for key, c in result["configs"].items() if "skipped" in c]


def render_table(result: dict) -> str:
    # Without bench-load's own client (--perf-analyzer only) there are no closed loops of its.
    parts = [text_table(LEVEL_HEADER, level_rows(result))] if level_rows(result) else []
    if overload_rows(result):
        parts.append(text_table(OVERLOAD_HEADER, overload_rows(result)))
    if skipped_rows(result):
        parts.append(text_table(SKIPPED_HEADER, skipped_rows(result)))
    if perf_rows(result):
        parts.append("perf_analyzer:\n" + text_table(PERF_HEADER, perf_rows(result)))
    elif (result["settings"].get("perf_analyzer") or {}).get("skipped"):
        parts.append(perf_note(result))
    parts.append(text_table(TARGET_HEADER, target_rows(result)))
    return "\n\n".join(parts)


def render_markdown(result: dict) -> str:
    return "\n".join([*_intro(result), *_measures(result), *one_call_text(result),
                      *_tables(result), *_optional_sections(result),
                      "![p99 latency against throughput](load.png)", "", SHARED_CORES, ""])


def _intro(result: dict) -> list[str]:
    """The title, the command, the configurations and the traffic."""
    st = result["settings"]
    g = st["gateway"]
    return [
        f"# sensai bench-load --sweep: {result['model']} on {result['dataset']}",
        "",
        f"Command: `{result.get('command') or 'run_load_sweep(...)'}`",
        "",
        f"Configurations: {', '.join(st['configs'])}.  Each gateway configuration is `sensai "
        f"serve` in its own process on 127.0.0.1 (backend {st['backend']}, deadline "
        f"{g['deadline_s']:g} s, max_requests {g['max_requests']}, max_predictions "
        f"{g['max_predictions']}, latency target {latency_target(g)}, batch_max_rows "
        f"{g['batch_max_rows']}, batch_delay_us {g['batch_delay_us']:g}; "
        "class-parallel-unbatched adds SENSAI_BATCH_MAX_ROWS=1; single "
        "serves the original model as one group on one worker, with the same settings); triton "
        "is Triton Inference Server serving the original's ONNX with its dynamic batcher.",
        "",
        f"Traffic: {st['images']} real test images over `{st['transport']}` "
        + ("(PNG uploads to `/v1/predict`; Triton, which takes only tensors, over `http-v2`: "
           "see each row's transport)" if st["transport"] == "http" else
           "(KServe v2 binary tensors)")
        + f" from {st['clients']} client process(es), the same for every configuration; every "
        "200 answer is compared with offline evaluation's top-1 of the model served (`wrong`).  "
        f"Warm-up {st['warmup_s']:g} s at {st['warmup_concurrency']} in flight, then closed "
        f"loops at {', '.join(map(str, st['levels']))} in flight, {st['level_s']:g} s each, the "
        f"server's bare `GET /v2/health/live` at {st['noop_concurrency']} in flight, then "
        f"{st['overload_s']:g} s of open-loop overload at {st['overload_factor']:g} x the best "
        "closed-loop throughput (requests sent when due whatever the answers, latency from when "
        "each was due; " + retry_after_text(st) + ").",
        "",
    ]


def _measures(result: dict) -> list[str]:
    """The machine, and what each measure of the tables is."""
    g = result["settings"]["gateway"]
    return [
        machine_line(result) + "  Client CPU: the client processes' own CPU time "
        "over the level's wall time (cores), and as a share of the usable cores; machine busy "
        "cores: the whole machine's (server, client and anything else); server cores: the "
        "serving process's own threads, and in brackets its busiest thread's (the event loop "
        "under load: near 1.00, one core is its ceiling).  The configurations "
        "run one after another, so what else ran on the machine may differ between them (that "
        "column shows it).  Full GCs: the collector's full collections in the gateway's process "
        "during the level and the time they stopped it (its `/metrics`).  Server CPU per "
        "answer: the CPU time of every process of `sensai serve` over the level per 200 "
        "answered, split into its subnet workers' processes (device processes with several "
        "gateway processes, in brackets) and the rest (the gateway processes, and the parent "
        "that watches them); \"in the gateway\": the workers are threads of the gateway's "
        "process, so its figure holds the subnets' compute; beside it, the gateways' figure "
        "over the bare route's (GET /v2/health/live at the same server).  Busiest thread: the "
        "busiest single thread of the gateway processes (and of the workers' processes), in "
        "cores: one near 1.00 is a ceiling that more processes of the other kind cannot "
        "lift.  Rows per batch: each subnet's "
        "image rows over its batches during the level (from the workers' counters before and "
        "after it; a device process's as its gateway processes last heard them).  GPU busy: "
        "nvidia-smi's utilization over the level, sampled every 0.2 s (where there is one).  "
        "What the cores allow (beside the 16-in-flight share of the bare route): the usable "
        "cores over the server's and the clients' CPU per answer at that level, every core "
        "busy (each side on its own cores with --client-cores; the GPU's time not in it)."
        + (f"  The sim runtime: a simulated GPU, {g['sim_launch_ms']:g} ms per launch whatever "
           "its rows; answers checked against the simulation's own offline."
           if g.get("runtime") == "sim" else ""),
        "",
    ]


def _tables(result: dict) -> list[str]:
    """The targets and the closed loops, which every sweep has."""
    return ["## Targets", "", md_table(TARGET_HEADER, target_rows(result)), "",
            "## Closed loops", "", md_table(LEVEL_HEADER, level_rows(result)), ""]


def _optional_sections(result: dict) -> list[str]:
    """The overload, perf_analyzer, the workers' batching and the configurations not run,
    each where the sweep has it."""
    lines = []
    if overload_rows(result):
        lines += ["## Overload", "", md_table(OVERLOAD_HEADER, overload_rows(result)), "",
                  "other: answers neither 200 nor 503 (or no answer).", ""]
    if result["settings"].get("perf_analyzer"):
        lines += ["## perf_analyzer", "", perf_note(result), ""]
        if perf_rows(result):
            lines += [md_table(PERF_HEADER, perf_rows(result)), ""]
    if batching_rows(result):
        lines += ["## Batching in the workers", "",
                  md_table(BATCHING_HEADER, batching_rows(result)), "",
                  "From each gateway's `GET /v1/models` at the end of its configuration (the "
                  "warm-up, levels, bare route and overload together); a request alone counts as "
                  "a batch of one; held back: requests that waited for company.", ""]
    if skipped_rows(result):
        lines += ["## Not run", "", md_table(SKIPPED_HEADER, skipped_rows(result)), ""]
    return lines


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    for key, c in result["configs"].items():
        pts = [(r["throughput_rps"], r["latency_ok_ms"]["p99"], r["concurrency"])
               for r in c.get("levels", []) if r["latency_ok_ms"]["p99"] is not None]
        color = COLORS.get(key, "#8C8C8C")
        pa = [(r["throughput_infer_per_s"], r["p99_us"] / 1e3)
              for r in c.get("perf_analyzer") or [] if "error" not in r]
        if pa:
            ax.plot([p[0] for p in pa], [p[1] for p in pa], marker=".", ls="--", color=color,
                    label=f"{c['label']} (perf_analyzer)")
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                label=c["label"])
        for x, y, n in pts:
            ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=color)
        o = c.get("overload") or {}
        if o.get("goodput_rps") and o["latency_ok_ms"]["p99"] is not None:
            ax.plot([o["goodput_rps"]], [o["latency_ok_ms"]["p99"]], marker="X", ms=9, ls="",
                    color=color)
    ax.plot([], [], marker="X", ls="", color="black", label="overload (goodput, admitted p99)")
    save_p99_plot(fig, ax, f"{result['model']}: p99 latency against throughput (closed loops, "
                           f"labelled by requests in flight; {result['settings']['transport']})",
                  path)


def one_call_text(result: dict) -> list[str]:
    """The one-call reference measured before the servers started (:mod:`.one_call`)."""
    one = result.get("one_call")
    if not one:
        return []
    cores = f", {one['cores']} core(s)" if one.get("cores") else ""
    return [f"One call of every subnet, in process (the compute alone, nothing else running; "
            f"{one['subnets']} subnets on one device: {one['kind']}, {one['runtime']} on "
            f"{one['device']}{cores}): p50 {fmt(one['ms']['p50'], 3)} ms, p99 "
            f"{fmt(one['ms']['p99'], 3)} ms.  A served image at 1 in flight is measured against "
            "it (target c1_over_one_call_ms).", ""]

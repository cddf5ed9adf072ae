"""``sensai bench-load --sweep``'s report: the terminal tables, ``load.md`` and ``load.png``
(p99 latency against throughput, one line per configuration)."""

from __future__ import annotations

from pathlib import Path

from .load_report import ADMITTED_AND_TURNED_AWAY, TARGETS, retry_after_text
from .render import (SERVER_CORES, SERVER_CORES_NOTE, SHARED_CORES, STATUS_CODES, Col, Table, draw,
                     fmt, gateway_settings, heading, machine_line, markdown, mark, one_call_device,
                     p99_line, p99_panel, pct, quantiles, terminal, with_p99)

COLORS = {"class-parallel": "#4C72B0", "class-parallel-unbatched": "#8172B2",
          "single": "#55A868", "triton": "#C44E52"}


def over_noop(r: dict) -> str:
    """The gateway processes' CPU per answer over a level against the same server's bare route
    (``noop``): how far a prediction is from the least an answer costs them."""
    mine = (r.get("server_cpu") or {}).get("gateway_ms_per_answer")
    floor = ((r["noop"] or {}).get("server_cpu") or {}).get("gateway_ms_per_answer")
    return f"{mine / floor:.1f}x" if mine and floor else "-"


def rows_per_batch(r: dict) -> str:
    """Each worker's (subnet's) rows per batch over a level."""
    per = [w.get("rows_per_batch") for w in r.get("batching") or []]
    return " / ".join(fmt(v) for v in per) if per else "-"


def gateways_workers(r: dict, what: str, nd: int = 2, inside: str = "") -> str:
    """A server figure over a level (``what``: ``ms_per_answer``, CPU per answer;
    ``busiest_thread_cores``) of its gateway processes, and in brackets of its subnet workers'
    processes where they are processes of their own (else ``inside``)."""
    c = r.get("server_cpu")
    if not c or c.get(f"gateway_{what}") is None:
        return "-"
    workers = c.get(f"workers_{what}") if c.get("workers_processes") else None
    return fmt(c[f"gateway_{what}"], nd) + (f" ({fmt(workers, nd)})" if workers is not None
                                            else inside)


def gpu_busy(r: dict) -> str:
    """The GPU's mean busy share over a level (nvidia-smi), where there is one."""
    g = r.get("gpu_busy")
    return "-" if not g or g.get("mean_pct") is None else f"{g['mean_pct']:.0f} %"


def full_gcs(r: dict) -> str:
    """The gateway's full collections during a level, as its /metrics counted them."""
    g = (r.get("server") or {}).get("gc_full")
    return "-" if g is None else f"{g['collections']} ({g['paused_ms']:.0f})"


LEVELS = Table(
    Col("configuration", "configuration"), Col("transport", "transport"),
    Col("in flight", "concurrency"), Col("200/s", "throughput_rps", 1),
    *quantiles("latency_ok_ms", "p50", "p90", "p99"), Col("errors", "errors"), STATUS_CODES,
    Col("wrong", "wrong"),
    Col("client CPU (cores)", "client_cores"),
    Col("client share", lambda r: pct(r.get("client_cpu_share"))),
    Col("machine busy cores", "machine_busy_cores"), SERVER_CORES,
    Col("full GCs (ms paused)", full_gcs),
    Col("server CPU ms/answer: gateways (workers)",
        lambda r: gateways_workers(r, "ms_per_answer", 3, " (in the gateway)")),
    Col("gateways' CPU / the no-op's", over_noop),
    Col("busiest thread: gateways (workers)",
        lambda r: gateways_workers(r, "busiest_thread_cores")),
    Col("rows per batch (each subnet)", rows_per_batch),
    Col("GPU busy", gpu_busy))
OVERLOAD = Table(
    Col("configuration", "configuration"), Col("asked/s", "target_rate_rps", 1),
    Col("offered/s", "offered_rate_rps", 1), Col("goodput (200/s)", "goodput_rps", 1),
    Col("of best closed loop", lambda o: pct(o.get("goodput_of_best_closed"))),
    *ADMITTED_AND_TURNED_AWAY[:2], Col("503s", "rejected_503"), *ADMITTED_AND_TURNED_AWAY[2:],
    Col("other", "not_200_or_503"), Col("client cores", "client_cores"),
    Col("machine busy cores", "machine_busy_cores"), SERVER_CORES)
SKIPPED = Table(Col("configuration", "configuration"), Col("not run, because", "skipped"))


def _ms(us) -> float | None:
    """perf_analyzer's microseconds in ms."""
    return us / 1e3 if isinstance(us, (int, float)) else None


def _compute(r: dict) -> str:
    us = [r.get(f"server_compute_{k}_us") for k in ("input", "infer", "output")]
    return ", ".join(fmt(_ms(v)) for v in us) if any(us) else "-"


PERF = Table(
    Col("configuration", "configuration"), Col("in flight", "concurrency"),
    Col("infer/s", "throughput_infer_per_s", 1), Col("p50 ms", lambda r: _ms(r.get("p50_us"))),
    Col("p90 ms", lambda r: _ms(r.get("p90_us"))), Col("p99 ms", lambda r: _ms(r.get("p99_us"))),
    Col("server queue ms", lambda r: _ms(r.get("server_queue_us"))),
    Col("server compute ms (input, infer, output)", _compute),
    Col("error", lambda r: r.get("error", "")))
BATCHING = Table(
    Col("configuration", "configuration"), Col("worker", "name"), Col("max rows", "max_rows"),
    Col("delay us", "delay_us", 0), Col("requests", "requests"), Col("batches", "batches"),
    Col("rows per batch", lambda w: w["requests"] / w["batches"] if w.get("batches") else None),
    Col("largest", "largest"), Col("held back", "held"))


def each(result: dict, what: str) -> list[dict]:
    """Every configuration's rows of ``what`` (``perf_analyzer``, ``batching``), named."""
    return [x | {"configuration": key} for key, c in result["configs"].items()
            for x in c.get(what) or []]


def levels(result: dict) -> list[dict]:
    """Every configuration's closed loops, then its bare route's, beside the bare route."""
    return [r | {"configuration": key, "transport": t, "noop": c["noop"]}
            for key, c in result["configs"].items() if "levels" in c
            for r, t in [*((r, c["transport"]) for r in c["levels"]),
                         (c["noop"], "GET /v2/health/live")]]


def overloads(result: dict) -> list:
    return [[key, o["skipped"]] if "skipped" in o else o | {"configuration": key}
            for key, c in result["configs"].items() if (o := c.get("overload"))]


def skipped(result: dict) -> list[dict]:
    return [c | {"configuration": key} for key, c in result["configs"].items() if "skipped" in c]


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


def render_table(result: dict) -> str:
    # Without bench-load's own client (--perf-analyzer only) there are no closed loops of its.
    perf = each(result, "perf_analyzer")
    return terminal(
        levels(result) and LEVELS.text(levels(result)),
        overloads(result) and OVERLOAD.text(overloads(result)),
        skipped(result) and SKIPPED.text(skipped(result)),
        "perf_analyzer:\n" + PERF.text(perf) if perf else
        (result["settings"].get("perf_analyzer") or {}).get("skipped") and perf_note(result),
        TARGETS.text(result["targets"]["checks"]))


def render_markdown(result: dict) -> str:
    perf, batching = each(result, "perf_analyzer"), each(result, "batching")
    return markdown(
        heading(result, "bench-load --sweep", "run_load_sweep(...)"), _intro(result),
        _measures(result), one_call_text(result),
        "## Targets", TARGETS.md(result["targets"]["checks"]),
        "## Closed loops", LEVELS.md(levels(result)),
        overloads(result) and ["## Overload", OVERLOAD.md(overloads(result)),
                               "other: answers neither 200 nor 503 (or no answer)."],
        result["settings"].get("perf_analyzer") and [
            "## perf_analyzer", perf_note(result), perf and PERF.md(perf)],
        batching and [
            "## Batching in the workers", BATCHING.md(batching),
            "From each gateway's `GET /v1/models` at the end of its configuration (the warm-up, "
            "levels, bare route and overload together); a request alone counts as a batch of "
            "one; held back: requests that waited for company."],
        skipped(result) and ["## Not run", SKIPPED.md(skipped(result))],
        "![p99 latency against throughput](load.png)", SHARED_CORES)


def _intro(result: dict) -> list[str]:
    """The configurations and the traffic."""
    st = result["settings"]
    g = st["gateway"]
    return [
        f"Configurations: {', '.join(st['configs'])}.  Each gateway configuration is `sensai "
        f"serve` in its own process on 127.0.0.1 (backend {st['backend']}, "
        f"{gateway_settings(g)}, batch_max_rows {g['batch_max_rows']}, "
        f"batch_delay_us {g['batch_delay_us']:g}; "
        "class-parallel-unbatched adds SENSAI_BATCH_MAX_ROWS=1; single "
        "serves the original model as one group on one worker, with the same settings); triton "
        "is Triton Inference Server serving the original's ONNX with its dynamic batcher.",
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
        "each was due; " + retry_after_text(st) + ")."]


def _measures(result: dict) -> str:
    """The machine, and what each measure of the tables is."""
    g = result["settings"]["gateway"]
    # Results from before the launch time was recorded name none.
    launch = (f"{g['sim_launch_ms']:g} ms" if g.get("sim_launch_ms") is not None
              else "a fixed time (not recorded)")
    return (
        machine_line(result) + "  Client CPU: the client processes' own CPU time "
        "over the level's wall time (cores), and as a share of the usable cores; machine busy "
        f"cores: the whole machine's (server, client and anything else); server cores: "
        f"{SERVER_CORES_NOTE}.  The configurations run one after another, so what else ran on "
        "the machine may differ between them (that "
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
        "busy (each side on its own cores with --set client_cores=N; the GPU's time not in it)."
        + (f"  The sim runtime: a simulated GPU, {launch} per launch whatever its rows; "
           "answers checked against the simulation's own offline."
           if g.get("runtime") == "sim" else ""))


def plot(result: dict, path: Path) -> None:
    marks = []
    for key, c in result["configs"].items():
        color = COLORS.get(key, "#8C8C8C")
        pa = [(r["throughput_infer_per_s"], r["p99_us"] / 1e3)
              for r in c.get("perf_analyzer") or [] if "error" not in r]
        if pa:
            marks.append(mark("plot", *zip(*pa), marker=".", ls="--", color=color,
                              label=f"{c['label']} (perf_analyzer)"))
        pts = with_p99(c.get("levels", []))
        if not pts:
            continue
        marks.append(p99_line(pts, color=color, label=c["label"]))
        marks += [mark("annotate", str(r["concurrency"]),
                       (r["throughput_rps"], r["latency_ok_ms"]["p99"]), textcoords="offset points",
                       xytext=(4, 4), fontsize=7, color=color) for r in pts]
        o = c.get("overload") or {}
        if o.get("goodput_rps") and o["latency_ok_ms"]["p99"] is not None:
            marks.append(mark("plot", [o["goodput_rps"]], [o["latency_ok_ms"]["p99"]],
                              marker="X", ms=9, ls="", color=color))
    marks.append(mark("plot", [], [], marker="X", ls="", color="black",
                      label="overload (goodput, admitted p99)"))
    draw(path, [p99_panel(f"{result['model']}: p99 latency against throughput (closed loops, "
                          f"labelled by requests in flight; {result['settings']['transport']})",
                          marks)], (9, 6))


def one_call_text(result: dict) -> str | None:
    """The one-call reference measured before the servers started (:mod:`.one_call`)."""
    one = result.get("one_call")
    if not one:
        return None
    return (f"One call of every subnet, in process (the compute alone, nothing else running; "
            f"{one['subnets']} subnets on one device: {one_call_device(one)}): "
            f"p50 {fmt(one['ms']['p50'], 3)} ms, p99 "
            f"{fmt(one['ms']['p99'], 3)} ms.  A served image at 1 in flight is measured against "
            "it (target c1_over_one_call_ms).")

"""``sensai bench-load``'s report, of both kinds of load.json: the soak's (its phases, the
gateway's memory over time, the health after the overload, the burst; ``load.png``: memory,
answers and latency over time) and the sweep's (every configuration's closed loops, bare route,
overload, perf_analyzer and batching; ``load.png``: p99 latency against throughput, one line per
configuration).  The terminal table, ``load.md`` and ``load.png`` of either."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sensai.serving.core.settings import CPU_BATCH_ROWS, GPU_BATCH_ROWS

from .render import (SERVER_CORES, SERVER_CORES_NOTE, SHARED_CORES, STATUS_CODES, Col, Panel,
                     Table, draw, fmt, gateway_settings, gateway_text, heading, machine_line,
                     markdown, mark, one_call_device, p50_p99, p99_line, p99_panel, pct,
                     quantiles, rss_line, status_codes, terminal, with_p99)

SWEEP_KIND = "sensai-bench-load-sweep"


def render_table(result: dict) -> str:
    sweep = result["kind"] == SWEEP_KIND
    return terminal(*(sweep_tables if sweep else soak_tables)(result),
                    targets_heading(result).removeprefix("## "),
                    TARGETS.text(result["targets"]["checks"]))


def targets_heading(result: dict) -> str:
    """The targets' heading, naming the configuration a sweep's targets judge."""
    config = result["targets"].get("config")
    return "## Targets" + (f" (judged on the {config} configuration)" if config else "")


def render_markdown(result: dict) -> str:
    """The run's heading and intro, its targets, then each kind's sections."""
    sweep = result["kind"] == SWEEP_KIND
    return markdown(
        heading(result, "bench-load --sweep" if sweep else "bench-load", "run_load(...)"),
        (sweep_intro if sweep else soak_intro)(result),
        targets_heading(result), TARGETS.md(result["targets"]["checks"]),
        (sweep_sections if sweep else soak_sections)(result), SHARED_CORES)


def plot(result: dict, path: Path) -> None:
    (sweep_plot if result["kind"] == SWEEP_KIND else soak_plot)(result, path)


def overload_text(st: dict, of: str) -> str:
    """The overload, as both kinds' intro says it: its length, its rate (``of``: the
    throughput it multiplies), how requests were sent and how the clients took a 503's
    Retry-After (older runs: at once)."""
    asked = f" (asked: {st['overload_rate_rps']:g}/s)" if st.get("overload_rate_rps") else ""
    polite = st.get("overload_retry_after") == "honoured"
    retry = ("a client that got a 503 with Retry-After waited that long before sending again "
             "on that connection, as polite clients do; asked: the rate due, offered: the rate "
             "sent" if polite else
             "a client sent again at once after a 503, whatever its Retry-After")
    return (f"then {st['overload_s']:g} s of open-loop overload at {st['overload_factor']:g} x "
            f"{of}{asked} (requests sent when due whatever the answers, latency counted from "
            f"when each was {'sent' if polite else 'due'}; {retry})")


# --------------------------------------------------------------------------------------------
# The soak


PHASES = (("warmup", "warm-up"), ("soak", "soak"), ("overload", "overload"))
STATUS_COLORS = {"200": "#55A868", "503": "#DD8452", "0": "#8C8C8C"}
PHASE_COLORS = {"warm-up": "#DDDDDD", "soak": "#DCEBF5", "overload": "#F8E0D0",
                "burst of large images": "#E8DDF2"}


def _load(rep: dict) -> str:
    if rep["phase"] != "overload":
        return f"closed loop, {rep['in_flight']} in flight"
    return (f"open loop, {fmt(rep['target_rate_rps'], 1)}/s asked, "
            f"{fmt(rep['offered_rate_rps'], 1)}/s offered, {rep['connections_opened']} "
            f"connections opened (of {rep['connections_allowed']} allowed)")


# The latencies of the answers 200 and of the 503s (turned away at admission).
ADMITTED_AND_TURNED_AWAY = (*quantiles("latency_ok_ms", "p50", "p99", suffix=" (200)"),
                            *quantiles("latency_rejected_ms", "p50", "p99", suffix=" (503)"))
PHASE = Table(
    Col("phase", "label"), Col("load", _load), Col("seconds", "seconds", 1),
    Col("requests", "requests"), Col("200/s", "throughput_rps", 1), STATUS_CODES,
    Col("wrong", "wrong"), *ADMITTED_AND_TURNED_AWAY, SERVER_CORES)
SERVER = Table(
    Col("phase", "label"), Col("status codes (sensai_requests_total)",
                               lambda r: status_codes(r["status_counts"])),
    Col("turned away (sensai_rejected_total)",
        lambda r: ", ".join(f"{k}: {v}" for k, v in r["rejected"].items()) or "-"),
    Col("/v1/predict p50 ms <=", "predict_latency_ms_at_most.p50"),
    Col("/v1/predict p99 ms <=", "predict_latency_ms_at_most.p99"))
RSS = Table(
    Col("process", "label"), Col("samples", "samples"), Col("after warm-up MB", "baseline_mb", 1),
    Col("last-window mean MB", "last_window_mean_mb", 1), Col("growth MB", "growth_mb"),
    Col("growth %", "growth_pct"), Col("max MB", "max_mb", 1),
    Col("slope MB/min", "slope_mb_per_min", 3))


def phases(result: dict) -> list:
    """Each phase that ran, labelled (one that was skipped: a row saying why)."""
    return [[label, rep["skipped"]] if "skipped" in rep else rep | {
        "phase": key, "label": label, "in_flight": result["settings"]["concurrency"]}
        for key, label in PHASES if (rep := result["phases"].get(key))]


def server_rows(result: dict) -> list[dict]:
    return [server | {"label": label} for key, label in PHASES
            if (server := (result["phases"].get(key) or {}).get("server"))]


def _sampled(result: dict) -> str:
    """Which process's memory the RSS figures are, when it is not ``sensai serve``'s own."""
    gw, sampled = result["gateway"], result["rss"].get("sampled") or {}
    if gw.get("serving_pid") in (None, gw["pid"]):
        return ""
    return f"; the RSS figures are pid {gw['serving_pid']}'s, {sampled.get('process')}"


def rss_rows(result: dict) -> list[dict]:
    rss = (result["phases"].get("soak") or {}).get("rss") or {}
    # The descendants' row only when the gateway had child processes (not the local backend).
    children = any(s["processes"] > 1 for s in result["rss"]["samples"])
    elsewhere = bool(_sampled(result))
    labels = {"gateway": "serving process" if elsewhere else "gateway process",
              "with_descendants": "sensai serve with its descendant processes" if elsewhere
              else "with its descendant processes"}
    return [rss[k] | {"label": label} for k, label in labels.items()
            if rss.get(k) and (k == "gateway" or children)]


def _value(c: dict) -> str:
    v = c["value"]
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    text = f"{fmt(v)} {c['unit']}".strip()
    if c.get("ceiling") is not None:
        text += f" (the cores at this CPU per answer: at most {fmt(c['ceiling'])} {c['unit']})"
    return text


def _status(c: dict) -> str:
    status = c["status"] if c["conditions_met"] or c["met"] is None else \
        f"{c['status']} (indicative: needs {c['conditions']})"
    if c["met"] is None and c.get("why_not_measured"):
        status += f" ({c['why_not_measured']})"
    return status


TARGETS = Table(
    Col("target", "rule"), Col("value", _value),
    Col("limit", lambda c: "yes" if c["limit"] is True else f"{fmt(c['limit'])} {c['unit']}"
        .strip()),
    Col("status", _status))


def soak_tables(result: dict) -> list:
    return [PHASE.text(phases(result)), rss_rows(result) and RSS.text(rss_rows(result)),
            result.get("burst") and "burst: " + burst_text(result["burst"]).replace("**", "")]


def _health_text(h: dict | None) -> str:
    if not h:
        return "Not checked (no overload phase)."
    text = (f"`/v2/health/ready` answered {h['ready_status']}; {h['correct']} of "
            f"{h['predictions']} sequential predictions agreed with offline evaluation: "
            f"**{'healthy' if h['healthy'] else 'not healthy'}** right after the overload.")
    if h.get("error"):
        text += f" Error: {h['error']}."
    if not h["healthy"]:
        text += (f" Healthy again after {h['recovered_after_s']} s." if h.get("recovered_after_s")
                 else " Not healthy again within the 30 s given.")
    return text


def burst_text(b: dict | None) -> str:
    """The burst phase in a sentence or two: what it sent, what came back, the peak memory."""
    if not b:
        return "Not run (`--set burst_seconds=0`, or no overload phase)."
    im, lat = b["image"], b["latency_ok_ms"]
    took = (f"{fmt(b['seconds'], 1)} s ({b['duration_s']:g} s asked)" if b.get("seconds")
            else f"{b['duration_s']:g} s")
    text = (f"{b['requests']} uploads in {took} of one {im['width']}x"
            f"{im['height']} {im['mode']} PNG ({im['png_bytes']:,} bytes on the wire, "
            f"{im['decoded_bytes'] / 1e6:.1f} MB decoded: as large as the gateway's limits "
            f"allow), {b['concurrency']} always in flight; status codes {b['status_counts']}, "
            f"p50/p99 of the 200s {p50_p99(lat)} ms, wrong answers "
            f"{b['wrong']}.  ")
    if b.get("peak_growth_mb") is None:
        return text + "The gateway's peak RSS could not be read (`/proc/PID/clear_refs`)."
    return text + (f"The gateway's peak RSS (`VmHWM`, reset before the burst) was "
                   f"**{fmt(b['peak_rss_mb'])} MB**, {fmt(b['peak_growth_mb'])} MB above its RSS "
                   f"before it; decoding all {b['concurrency']} at once would take "
                   f"{fmt(b['all_at_once_mb'])} MB more (decoding runs one per usable core).")


def _timeout(g: dict) -> str:
    """The gateway's client timeout (a body timeout in runs before the two were one)."""
    if "client_timeout_s" in g:
        return f"client timeout {g['client_timeout_s']:g} s"
    return f"body timeout {g['body_timeout_s']:g} s"


def soak_intro(result: dict) -> list[str]:
    """The gateway, the traffic and the machine."""
    st = result["settings"]
    g = st["gateway"]
    return [
        gateway_text(result["gateway"], _sampled(result)) + f".  Backend {st['backend']}, "
        f"{len(result['groups'])} subnets, {gateway_settings(g)}, {_timeout(g)}.",
        f"Traffic: {st['images']} real test images as PNG uploads to `/v1/predict`, from "
        f"{st['clients']} client process(es); every 200 answer is compared with offline "
        f"evaluation's top-1 (`wrong`; offline top-1 on these images {result['offline_top1']}).  "
        f"Warm-up {st['warmup_s']:g} s and soak {st['soak_s']:g} s in a closed loop at "
        f"concurrency {st['concurrency']}; " + overload_text(st, "the soak's throughput")
        + f".  The gateway's RSS (`VmRSS`) is sampled every {st['sample_s']:g} s.",
        machine_line(result) + "  The clients share the machine with the gateway."]


def soak_sections(result: dict) -> list:
    over = result["phases"].get("overload") or {}
    lag = over.get("send_lag_ms")
    counted = ("not in the latencies, which count from the send"
               if result["settings"].get("overload_retry_after") == "honoured"
               else "included in the latencies")
    return [
        "## Phases", PHASE.md(phases(result)),
        "200/s: answers 200 per second of the phase.  Status codes: as the client saw them "
        "(no answer: the connection failed or timed out).  503 are the gateway turning work "
        "away at admission, before the body is read (`rejected` in the JSON gives the reasons); "
        f"504 a deadline that passed.  Server cores: {SERVER_CORES_NOTE}.",
        lag and f"Overload: the client sent its requests p50 {p50_p99(lag, ' ms / p99 ')} ms "
                f"after they were due ({counted}); it offered "
                f"{fmt(over['offered_rate_rps'], 1)} of the {fmt(over['target_rate_rps'], 1)} "
                "requests/s asked.",
        server_rows(result) and [
            "As the gateway counted them (its `/metrics`, before and after each phase; latency "
            "from when its middleware saw a request, as the bucket of its histogram it falls "
            "in):", SERVER.md(server_rows(result)),
            "Client latencies well above the gateway's own are time before the gateway's "
            "middleware saw the request (the listen backlog, the event loop's queue), where no "
            "deadline runs yet."],
        "## Gateway memory during the soak",
        [RSS.md(rss_rows(result)),
         "after warm-up: the soak's first sample; last-window mean: the mean of the samples in "
         "the soak's last minute (or all of a shorter soak); growth: the difference; slope: "
         "least squares over the soak's samples.  MB = 10^6 bytes."]
        if rss_rows(result) else "No samples.",
        "## Health after the overload", _health_text(result.get("health_after")),
        "## A burst of large legal images", burst_text(result.get("burst"))]


def _shade_phases(result: dict, legend: bool = False) -> list[tuple]:
    spans = []
    for key, label in (*PHASES, ("burst", "burst of large images")):
        rep = result.get("burst") if key == "burst" else result["phases"].get(key)
        if rep and "start_s" in rep:
            spans.append(mark("axvspan", rep["start_s"], rep["start_s"] + rep["seconds"],
                              color=PHASE_COLORS[label], alpha=0.6, lw=0,
                              label=label if legend else None))
    return spans


def _memory(result: dict) -> Panel:
    samples = result["rss"]["samples"]
    marks, t = _shade_phases(result, legend=True) + rss_line(samples), [s["t"] for s in samples]
    if any(s["tree_rss_mb"] != s["rss_mb"] for s in samples):
        marks.append(mark("plot", t, [s["tree_rss_mb"] for s in samples], marker=".",
                          color="#8172B2", label="with its descendants"))
    growth = ((result["phases"].get("soak") or {}).get("rss") or {}).get("gateway")
    if growth:
        marks += [mark("axhline", growth["baseline_mb"], color="#4C72B0", ls=":", lw=1),
                  mark("axhline", growth["baseline_mb"] * 1.05, color="#C44E52", ls=":", lw=1,
                       label="+5 % of the first soak sample")]
    return Panel(marks, f"gateway RSS (soak growth {fmt(growth['growth_mb'])} MB, "
                        f"{fmt(growth['growth_pct'])} %)" if growth else "",
                 ylabel="RSS (MB)", legend={"fontsize": 7, "loc": "lower right"})


def _answers(result: dict, bins: list[dict]) -> Panel:
    codes = sorted({c for b in bins for c in b["status_counts"]}, key=lambda c: (c != "200", c))
    marks = [*_shade_phases(result), mark("stack", [b["t"] for b in bins], [
        (np.array([b["status_counts"].get(c, 0) / b["seconds"] for b in bins]),
         {"color": STATUS_COLORS.get(c, "#C44E52"), "label": "no answer" if c == "0" else c})
        for c in codes], width=[b["seconds"] for b in bins], align="edge", alpha=0.85)]
    timed = [k for k, _ in PHASES if result["phases"].get(k, {}).get("timeline")]
    for i, key in enumerate(timed):
        tl = result["phases"][key]["timeline"]
        rates = [b["sent"] / b["seconds"] for b in tl]
        marks.append(mark("step", [b["t"] for b in tl] + [tl[-1]["t"] + tl[-1]["seconds"]],
                          rates + rates[-1:], where="post", color="black", lw=1,
                          label=None if i else "sent"))
    return Panel(marks, "answers by status code (when they came back), and requests sent",
                 ylabel="per second", legend={"fontsize": 7, "loc": "upper left"} if codes
                 else None)


def soak_plot(result: dict, path: Path) -> None:
    bins = [b for key, _ in PHASES for b in (result["phases"].get(key) or {}).get("timeline", [])]
    mid = [b["t"] + b["seconds"] / 2 for b in bins]
    latency = [*_shade_phases(result), *(
        mark("plot", mid, [np.nan if b[key] is None else b[key] for b in bins], style,
             marker=".", color="#55A868", label=key.split("_")[0] + " (200)")
        for key, style in (("p50_ok_ms", "-"), ("p99_ok_ms", "--"))),
        mark("axhline", result["settings"]["gateway"]["deadline_s"] * 1e3, color="#C44E52",
             ls=":", lw=1, label="deadline")]
    draw(path, [_memory(result), _answers(result, bins), Panel(
        latency, "latency of the admitted requests (client side, by when they came back)",
        "seconds since the gateway was ready", "latency (ms, log)",
        yscale="log" if bins else "linear", legend={"fontsize": 7, "loc": "upper left"})],
        (11, 9.5), 3, 1, sharex=True)


# --------------------------------------------------------------------------------------------
# The sweep


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


def overloads(result: dict) -> list[dict]:
    return [o | {"configuration": key} for key, c in result["configs"].items()
            if (o := c.get("overload")) and "skipped" not in o]


def no_overload(result: dict) -> str | None:
    """Which configurations skipped their overload, and why (a sentence, not a row of -)."""
    why = {key: o["skipped"] for key, c in result["configs"].items()
           if (o := c.get("overload")) and "skipped" in o}
    return why and "No overload for " + "; ".join(
        f"{', '.join(k for k in why if why[k] == reason)}: {reason}"
        for reason in dict.fromkeys(why.values())) + "."


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


def sweep_tables(result: dict) -> list:
    # Without bench-load's own client (--perf-analyzer only) there are no closed loops of its.
    perf = each(result, "perf_analyzer")
    return [levels(result) and LEVELS.text(levels(result)),
            overloads(result) and OVERLOAD.text(overloads(result)), no_overload(result),
            skipped(result) and SKIPPED.text(skipped(result)),
            "perf_analyzer:\n" + PERF.text(perf) if perf else
            (result["settings"].get("perf_analyzer") or {}).get("skipped") and perf_note(result)]


def sweep_sections(result: dict) -> list:
    perf, batching = each(result, "perf_analyzer"), each(result, "batching")
    return [
        "## Closed loops", LEVELS.md(levels(result)),
        overloads(result) and ["## Overload", OVERLOAD.md(overloads(result)),
                               "other: answers neither 200 nor 503 (or no answer)."],
        no_overload(result),
        result["settings"].get("perf_analyzer") and [
            "## perf_analyzer", perf_note(result), perf and PERF.md(perf)],
        batching and [
            "## Batching in the workers", BATCHING.md(batching),
            "From each gateway's `GET /v1/models` at the end of its configuration (the warm-up, "
            "levels, bare route and overload together); a request alone counts as a batch of "
            "one; held back: requests that waited for company."],
        skipped(result) and ["## Not run", SKIPPED.md(skipped(result))],
        "![p99 latency against throughput](load.png)"]


# What batch_max_rows unset means (the settings' default).
BATCH_ROWS_DEFAULT = f"{CPU_BATCH_ROWS} on CPUs, {GPU_BATCH_ROWS} on GPUs and the sim runtime"


def sweep_intro(result: dict) -> list[str]:
    """The configurations and the traffic."""
    st = result["settings"]
    g = st["gateway"]
    return [
        f"Configurations: {', '.join(st['configs'])}.  Each gateway configuration is `sensai "
        f"serve` in its own process on 127.0.0.1 (backend {st['backend']}, "
        f"{gateway_settings(g)}, batch_max_rows {g['batch_max_rows'] or BATCH_ROWS_DEFAULT}, "
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
        f"server's bare `GET /v2/health/live` at {st['noop_concurrency']} in flight, "
        + overload_text(st, "the best closed-loop throughput") + ".",
        _measures(result), one_call_text(result)]


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


def sweep_plot(result: dict, path: Path) -> None:
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

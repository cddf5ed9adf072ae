"""``sensai bench-load``'s report: the terminal table, ``load.md`` and ``load.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .render import (SHARED_CORES, fmt, machine_line, md_table, pyplot, save_figure, server_cores,
                     status_codes, text_table)

PHASES = (("warmup", "warm-up"), ("soak", "soak"), ("overload", "overload"))
PHASE_HEADER = ["phase", "load", "seconds", "requests", "200/s", "status codes", "wrong",
                "p50 ms (200)", "p99 ms (200)", "p50 ms (503)", "p99 ms (503)",
                "server cores (busiest thread)"]
RSS_HEADER = ["process", "samples", "after warm-up MB", "last-window mean MB", "growth MB",
              "growth %", "max MB", "slope MB/min"]
TARGET_HEADER = ["target", "value", "limit", "status"]
SERVER_HEADER = ["phase", "status codes (sensai_requests_total)",
                 "turned away (sensai_rejected_total)", "/v1/predict p50 ms <=",
                 "/v1/predict p99 ms <="]
STATUS_COLORS = {"200": "#55A868", "503": "#DD8452", "0": "#8C8C8C"}
PHASE_COLORS = {"warm-up": "#DDDDDD", "soak": "#DCEBF5", "overload": "#F8E0D0",
                "burst of large images": "#E8DDF2"}


def latency_target(gateway: dict) -> str:
    """The gateway's latency target as its settings record it (absent in older runs)."""
    t = gateway.get("latency_target_s")
    return f"{t:g} s" if t is not None else "a quarter of the deadline"


def retry_after_text(st: dict) -> str:
    """How the overload's clients took a 503's Retry-After (older runs: at once)."""
    if st.get("overload_retry_after") == "honoured":
        return ("a client that got a 503 with Retry-After waited that long before sending again "
                "on that connection, as polite clients do, and latency counts from when a "
                "request was sent; asked: the rate due, offered: the rate sent")
    return "a client sent again at once after a 503, whatever its Retry-After"


def _load(key: str, rep: dict, st: dict) -> str:
    if key != "overload":
        return f"closed loop, {st['concurrency']} in flight"
    return (f"open loop, {fmt(rep['target_rate_rps'], 1)}/s asked, "
            f"{fmt(rep['offered_rate_rps'], 1)}/s offered, {rep['connections_opened']} "
            f"connections opened (of {rep['connections_allowed']} allowed)")


def phase_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, label in PHASES:
        rep = result["phases"].get(key)
        if not rep:
            continue
        if "skipped" in rep:
            rows.append([label, rep["skipped"], *["-"] * (len(PHASE_HEADER) - 2)])
            continue
        ok, rej = rep["latency_ok_ms"], rep["latency_rejected_ms"]
        rows.append([label, _load(key, rep, result["settings"]), fmt(rep["seconds"], 1),
                     str(rep["requests"]), fmt(rep["throughput_rps"], 1),
                     status_codes(rep["status_counts"]), str(rep["wrong"]), fmt(ok["p50"]),
                     fmt(ok["p99"]), fmt(rej["p50"]), fmt(rej["p99"]), server_cores(rep)])
    return rows


def server_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, label in PHASES:
        server = (result["phases"].get(key) or {}).get("server")
        if server:
            q = server["predict_latency_ms_at_most"]
            rejected = ", ".join(f"{k}: {v}" for k, v in server["rejected"].items()) or "-"
            rows.append([label, status_codes(server["status_counts"]), rejected, fmt(q["p50"]),
                         fmt(q["p99"])])
    return rows


def _sampled(result: dict) -> str:
    """Which process's memory the RSS figures are, when it is not ``sensai serve``'s own."""
    gw, sampled = result["gateway"], result["rss"].get("sampled") or {}
    if gw.get("serving_pid") in (None, gw["pid"]):
        return ""
    return f"; the RSS figures are pid {gw['serving_pid']}'s, {sampled.get('process')}"


def rss_rows(result: dict) -> list[list[str]]:
    rss = (result["phases"].get("soak") or {}).get("rss") or {}
    # The descendants' row only when the gateway had child processes (not the local backend).
    children = any(s["processes"] > 1 for s in result["rss"]["samples"])
    rows = []
    elsewhere = bool(_sampled(result))
    for key, label in (("gateway", "serving process" if elsewhere else "gateway process"),
                       ("with_descendants", "sensai serve with its descendant processes"
                        if elsewhere else "with its descendant processes")):
        g = rss.get(key)
        if g is None or (key == "with_descendants" and not children):
            continue
        rows.append([label, str(g["samples"]), fmt(g["baseline_mb"], 1),
                     fmt(g["last_window_mean_mb"], 1), fmt(g["growth_mb"], 2),
                     fmt(g["growth_pct"], 2), fmt(g["max_mb"], 1), fmt(g["slope_mb_per_min"], 3)])
    return rows


def _value(c: dict) -> str:
    v = c["value"]
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    text = f"{fmt(v)} {c['unit']}".strip()
    if c.get("ceiling") is not None:
        text += f" (the cores at this CPU per answer: at most {fmt(c['ceiling'])} {c['unit']})"
    return text


def target_rows(result: dict) -> list[list[str]]:
    rows = []
    for c in result["targets"]["checks"]:
        limit = c["limit"]
        limit = "yes" if limit is True else f"{fmt(limit)} {c['unit']}".strip()
        status = c["status"] if c["conditions_met"] or c["met"] is None else \
            f"{c['status']} (indicative: needs {c['conditions']})"
        if c["met"] is None and c.get("why_not_measured"):
            status += f" ({c['why_not_measured']})"
        rows.append([c["rule"], _value(c), limit, status])
    return rows


def render_table(result: dict) -> str:
    parts = [text_table(PHASE_HEADER, phase_rows(result))]
    if rss_rows(result):
        parts.append(text_table(RSS_HEADER, rss_rows(result)))
    parts.append(text_table(TARGET_HEADER, target_rows(result)))
    if result.get("burst"):
        parts.append("burst: " + burst_text(result["burst"]).replace("**", ""))
    return "\n\n".join(parts)


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
        return "Not run (`--burst-seconds 0`, or no overload phase)."
    im, lat = b["image"], b["latency_ok_ms"]
    text = (f"{b['requests']} uploads in {b['duration_s']:g} s of one {im['width']}x"
            f"{im['height']} {im['mode']} PNG ({im['png_bytes']:,} bytes on the wire, "
            f"{im['decoded_bytes'] / 1e6:.1f} MB decoded: as large as the gateway's limits "
            f"allow), {b['concurrency']} always in flight; status codes {b['status_counts']}, "
            f"p50/p99 of the 200s {fmt(lat['p50'])}/{fmt(lat['p99'])} ms, wrong answers "
            f"{b['wrong']}.  ")
    if b.get("peak_growth_mb") is None:
        return text + "The gateway's peak RSS could not be read (`/proc/PID/clear_refs`)."
    return text + (f"The gateway's peak RSS (`VmHWM`, reset before the burst) was "
                   f"**{fmt(b['peak_rss_mb'])} MB**, {fmt(b['peak_growth_mb'])} MB above its RSS "
                   f"before it; decoding all {b['concurrency']} at once would take "
                   f"{fmt(b['all_at_once_mb'])} MB more (decoding runs one per usable core).")


def render_markdown(result: dict) -> str:
    st, gw = result["settings"], result["gateway"]
    g = st["gateway"]
    over = result["phases"].get("overload") or {}
    lines = [
        f"# sensai bench-load: {result['model']} on {result['dataset']}",
        "",
        f"Command: `{result.get('command') or 'run_load_bench(...)'}`",
        "",
        f"Gateway: `{gw['command']}` (pid {gw['pid']}, its own process{_sampled(result)}; "
        f"ready in "
        f"{gw['startup_s']} s; exit status {gw['exit_code']} after SIGTERM at the end; log "
        f"`{Path(gw['log']).name}`).  Backend {st['backend']}, {len(result['groups'])} subnets, "
        f"deadline {g['deadline_s']:g} s, max_requests {g['max_requests']}, max_predictions "
        f"{g['max_predictions']}, latency target {latency_target(g)}, body timeout "
        f"{g['body_timeout_s']:g} s.",
        "",
        f"Traffic: {st['images']} real test images as PNG uploads to `/v1/predict`, from "
        f"{st['clients']} client process(es); every 200 answer is compared with offline "
        f"evaluation's top-1 (`wrong`; offline top-1 on these images {result['offline_top1']}).  "
        f"Warm-up {st['warmup_s']:g} s and soak {st['soak_s']:g} s in a closed loop at "
        f"concurrency {st['concurrency']}; then overload {st['overload_s']:g} s in an open loop "
        f"at {st['overload_factor']:g} x the soak's throughput"
        + (f" (asked: {st['overload_rate_rps']:g}/s)" if st.get("overload_rate_rps") else "")
        + ", requests evenly spaced and sent whatever the answers, latency counted from when "
        f"each was due ({retry_after_text(st)}).  The gateway's RSS (`VmRSS`) is sampled every "
        f"{st['sample_s']:g} s.",
        "",
        machine_line(result) + "  The clients share the machine with the gateway.",
        "",
        "## Targets",
        "",
        md_table(TARGET_HEADER, target_rows(result)),
        "",
        "## Phases",
        "",
        md_table(PHASE_HEADER, phase_rows(result)),
        "",
        "200/s: answers 200 per second of the phase.  Status codes: as the client saw them "
        "(no answer: the connection failed or timed out).  503 are the gateway turning work "
        "away at admission, before the body is read (`rejected` in the JSON gives the reasons); "
        "504 a deadline that passed.  Server cores: the serving process's own threads, and in "
        "brackets its busiest thread's (the event loop under load: near 1.00, one core is its "
        "ceiling).",
        "",
    ]
    if over.get("send_lag_ms"):
        lag = over["send_lag_ms"]
        lines += [f"Overload: the client sent its requests p50 {fmt(lag['p50'])} ms / p99 "
                  f"{fmt(lag['p99'])} ms after they were due (included in the latencies); it "
                  f"offered {fmt(over['offered_rate_rps'], 1)} of the "
                  f"{fmt(over['target_rate_rps'], 1)} requests/s asked.", ""]
    rows = server_rows(result)
    if rows:
        lines += ["As the gateway counted them (its `/metrics`, before and after each phase; "
                  "latency from when its middleware saw a request, as the bucket of its "
                  "histogram it falls in):", "", md_table(SERVER_HEADER, rows), "",
                  "Client latencies well above the gateway's own are time before the gateway's "
                  "middleware saw the request (the listen backlog, the event loop's queue), "
                  "where no deadline runs yet.", ""]
    lines += ["## Gateway memory during the soak", ""]
    rows = rss_rows(result)
    if rows:
        lines += [md_table(RSS_HEADER, rows), "",
                  "after warm-up: the soak's first sample; last-window mean: the mean of the "
                  "samples in the soak's last minute (or all of a shorter soak); growth: the "
                  "difference; slope: least squares over the soak's samples.  MB = 10^6 bytes.",
                  ""]
    else:
        lines += ["No samples.", ""]
    lines += ["## Health after the overload", "", _health_text(result.get("health_after")), "",
              "## A burst of large legal images", "", burst_text(result.get("burst")), "",
              SHARED_CORES, ""]
    return "\n".join(lines)


def _shade_phases(ax, result: dict, legend: bool = False) -> None:
    for key, label in (*PHASES, ("burst", "burst of large images")):
        rep = result.get("burst") if key == "burst" else result["phases"].get(key)
        if rep and "start_s" in rep:
            ax.axvspan(rep["start_s"], rep["start_s"] + rep["seconds"],
                       color=PHASE_COLORS[label], alpha=0.6, lw=0,
                       label=label if legend else None)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(11, 9.5), sharex=True)
    samples = result["rss"]["samples"]
    ax = axes[0]
    _shade_phases(ax, result, legend=True)
    if samples:
        t = [s["t"] for s in samples]
        ax.plot(t, [s["rss_mb"] for s in samples], marker=".", color="#4C72B0",
                label="gateway process")
        if any(s["tree_rss_mb"] != s["rss_mb"] for s in samples):
            ax.plot(t, [s["tree_rss_mb"] for s in samples], marker=".", color="#8172B2",
                    label="with its descendants")
    growth = ((result["phases"].get("soak") or {}).get("rss") or {}).get("gateway")
    if growth:
        ax.axhline(growth["baseline_mb"], color="#4C72B0", ls=":", lw=1)
        ax.axhline(growth["baseline_mb"] * 1.05, color="#C44E52", ls=":", lw=1,
                   label="+5 % of the first soak sample")
        ax.set_title(f"gateway RSS (soak growth {fmt(growth['growth_mb'])} MB, "
                     f"{fmt(growth['growth_pct'])} %)")
    ax.set_ylabel("RSS (MB)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[1]
    _shade_phases(ax, result)
    bins = [b for key, _ in PHASES for b in (result["phases"].get(key) or {}).get("timeline", [])]
    codes = sorted({c for b in bins for c in b["status_counts"]}, key=lambda c: (c != "200", c))
    bottom = np.zeros(len(bins))
    for c in codes:
        rate = np.array([b["status_counts"].get(c, 0) / b["seconds"] for b in bins])
        ax.bar([b["t"] for b in bins], rate, width=[b["seconds"] for b in bins], bottom=bottom,
               align="edge", color=STATUS_COLORS.get(c, "#C44E52"), alpha=0.85,
               label="no answer" if c == "0" else c)
        bottom += rate
    for i, key in enumerate(k for k, _ in PHASES if result["phases"].get(k, {}).get("timeline")):
        tl = result["phases"][key]["timeline"]
        rates = [b["sent"] / b["seconds"] for b in tl]
        ax.step([b["t"] for b in tl] + [tl[-1]["t"] + tl[-1]["seconds"]], rates + rates[-1:],
                where="post", color="black", lw=1, label=None if i else "sent")
    ax.set_ylabel("per second")
    ax.set_title("answers by status code (when they came back), and requests sent")
    if codes:
        ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)

    ax = axes[2]
    _shade_phases(ax, result)
    mid = [b["t"] + b["seconds"] / 2 for b in bins]
    for key, style in (("p50_ok_ms", "-"), ("p99_ok_ms", "--")):
        ax.plot(mid, [np.nan if b[key] is None else b[key] for b in bins], style, marker=".",
                color="#55A868", label=key.split("_")[0] + " (200)")
    deadline_ms = result["settings"]["gateway"]["deadline_s"] * 1e3
    ax.axhline(deadline_ms, color="#C44E52", ls=":", lw=1, label="deadline")
    if bins:
        ax.set_yscale("log")
    ax.set_ylabel("latency (ms, log)")
    ax.set_xlabel("seconds since the gateway was ready")
    ax.set_title("latency of the admitted requests (client side, by when they came back)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


"""``sensai bench-load``'s report: the terminal table, ``load.md`` and ``load.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .render import (SERVER_CORES, SERVER_CORES_NOTE, SHARED_CORES, STATUS_CODES, Col, Panel,
                     Table, draw, fmt, gateway_settings, gateway_text, heading, machine_line,
                     markdown, mark, p50_p99, quantiles, rss_line,
                     status_codes, terminal)

PHASES = (("warmup", "warm-up"), ("soak", "soak"), ("overload", "overload"))
STATUS_COLORS = {"200": "#55A868", "503": "#DD8452", "0": "#8C8C8C"}
PHASE_COLORS = {"warm-up": "#DDDDDD", "soak": "#DCEBF5", "overload": "#F8E0D0",
                "burst of large images": "#E8DDF2"}


def retry_after_text(st: dict) -> str:
    """How the overload's clients took a 503's Retry-After (older runs: at once)."""
    if st.get("overload_retry_after") == "honoured":
        return ("a client that got a 503 with Retry-After waited that long before sending again "
                "on that connection, as polite clients do, and latency counts from when a "
                "request was sent; asked: the rate due, offered: the rate sent")
    return "a client sent again at once after a 503, whatever its Retry-After"


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


def render_table(result: dict) -> str:
    return terminal(
        PHASE.text(phases(result)), rss_rows(result) and RSS.text(rss_rows(result)),
        TARGETS.text(result["targets"]["checks"]),
        result.get("burst") and "burst: " + burst_text(result["burst"]).replace("**", ""))


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
    text = (f"{b['requests']} uploads in {b['duration_s']:g} s of one {im['width']}x"
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


def _intro(result: dict) -> list[str]:
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
        f"concurrency {st['concurrency']}; then overload {st['overload_s']:g} s in an open loop "
        f"at {st['overload_factor']:g} x the soak's throughput"
        + (f" (asked: {st['overload_rate_rps']:g}/s)" if st.get("overload_rate_rps") else "")
        + ", requests evenly spaced and sent whatever the answers, latency counted from when "
        f"each was due ({retry_after_text(st)}).  The gateway's RSS (`VmRSS`) is sampled every "
        f"{st['sample_s']:g} s.",
        machine_line(result) + "  The clients share the machine with the gateway."]


def render_markdown(result: dict) -> str:
    over = result["phases"].get("overload") or {}
    lag = over.get("send_lag_ms")
    return markdown(
        heading(result, "bench-load", "run_load_bench(...)"), _intro(result),
        "## Targets", TARGETS.md(result["targets"]["checks"]),
        "## Phases", PHASE.md(phases(result)),
        "200/s: answers 200 per second of the phase.  Status codes: as the client saw them "
        "(no answer: the connection failed or timed out).  503 are the gateway turning work "
        "away at admission, before the body is read (`rejected` in the JSON gives the reasons); "
        f"504 a deadline that passed.  Server cores: {SERVER_CORES_NOTE}.",
        lag and f"Overload: the client sent its requests p50 {p50_p99(lag, ' ms / p99 ')} ms "
                "after they were due (included in the latencies); it "
                f"offered {fmt(over['offered_rate_rps'], 1)} of the "
                f"{fmt(over['target_rate_rps'], 1)} requests/s asked.",
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
        "## A burst of large legal images", burst_text(result.get("burst")), SHARED_CORES)


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


def plot(result: dict, path: Path) -> None:
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

"""``sensai bench-swap``'s report of its figures (:mod:`.swap_figures`): the terminal table,
``swap.md`` and ``swap.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .render import (SHARED_CORES, Col, Panel, Table, draw, fmt, gateway_text, heading,
                     machine_line, markdown, mark, rss_line)
from .swap_figures import WINDOW_TAIL_S, version_order

VERSION_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B2", "#937860", "#DA8BC3",
                  "#8C8C8C", "#CCB974", "#64B5CD", "#C44E52")


def _versions(counts: dict[str, int]) -> str:
    return ", ".join(f"v{v}: {n}" for v, n in counts.items()) or "-"


TABLE = Table(
    Col("swap", "swap"), Col("version", lambda s: f"{s['from_version']} -> {s['version']} "
                                                  f"({s['artifact_name']})"),
    Col("load s", lambda s: s["load_s"] if s["load_status"] == 200 else
        f"refused ({s['load_status']})"),
    Col("first answer by new s", "first_answer_by_new_s"),
    Col("answers by version", lambda s: _versions(s["answers_by_version"])),
    Col("errors", "errors"), Col("misattributed", "misattributed"),
    Col("p99 ms (window)", "latency_ok_ms.p99"), Col("p99 ms (steady)", "steady_p99"),
    Col("RSS before MB", "rss_before_mb", 1), Col("RSS after MB", "rss_after_mb", 1))


def swaps(result: dict) -> list[dict]:
    steady = result["figures"]["run"]["steady"]["latency_ok_ms"]["p99"]
    return [s | {"steady_p99": steady} for s in result["figures"]["swaps"]]


def summary_line(result: dict) -> str:
    run = result["figures"]["run"]
    wrong = sum(run["wrong_by_version"].values())
    return (f"whole run: {run['requests']} requests, {run['errors']} errors (status codes "
            f"{run['status_counts']}), {run['misattributed']} misattributed, {wrong} answers "
            f"unlike offline evaluation of the version they name; answers by version "
            f"{_versions(run['answers_by_version'])}")


def render_table(result: dict) -> str:
    return TABLE.text(swaps(result)) + "\n\n" + summary_line(result)


def render_markdown(result: dict) -> str:
    st = result["settings"]
    steady = result["figures"]["run"]["steady"]
    rss = [s for s in result["figures"]["swaps"] if s["rss_before_mb"] is not None]
    return markdown(
        heading(result, "bench-swap", "run_swap_bench(...)"),
        gateway_text(result["gateway"]) + f", serving model `{st['model']}` from a repository "
        f"whose version 1 is `{st['artifacts'][0]}`.  Each swap writes the next version (in turn "
        f"`{st['artifacts'][1]}`, `{st['artifacts'][0]}`, ...) into the repository and calls "
        f"`POST /v2/repository/models/{st['model']}/load`, which returns once the new version "
        f"is ready and the old one drained and unloaded; then waits {st['after_s']:g} s.",
        f"Traffic: {st['images']} real test images as PNG uploads to `/v1/predict`, a closed "
        f"loop at concurrency {st['concurrency']} from a client process of its own, for the "
        f"whole run: {st['warmup_s']:g} s warm-up, {st['steady_s']:g} s steady state, then "
        f"the swaps ({st['swaps']}).  Every answer names the version that produced it; its "
        "top-1 is compared with offline evaluation of that version's artifact.  The gateway's "
        f"RSS (`VmRSS`) is sampled every {st['sample_s']:g} s, just before each swap and at the "
        "end of each swap's wait.",
        machine_line(result) + "  The client shares the machine with the gateway.",
        "## Swaps", TABLE.md(swaps(result)),
        "load s: from the load request to its return.  first answer by new s: from the load "
        "request to the first answer by the new version.  answers by version: during the "
        f"swap's window (the load request to {WINDOW_TAIL_S:g} s after its return; the requests "
        "in flight at any moment of it).  errors: answers other than 200 and requests with no "
        "answer in the window.  misattributed: answers naming a version that was not served "
        "while they were in flight.  p99: of the window's 200 answers, against the steady "
        f"state's ({steady['requests']} requests).  RSS: the gateway process, just before "
        "the swap and at the end of its wait (after the old version was unloaded).  "
        "MB = 10^6 bytes.",
        "## The whole run", summary_line(result).replace("whole run: ", "") + ".",
        f"Gateway RSS before the first swap {fmt(rss[0]['rss_before_mb'], 1)} MB, after the "
        f"last {fmt(rss[-1]['rss_after_mb'], 1)} MB." if rss else None,
        SHARED_CORES)


def _windows(result: dict) -> list[tuple]:
    return [mark("axvspan", *s["window_s"], color="#EEEEEE", lw=0)
            for s in result["figures"]["swaps"]]


def plot(result: dict, path: Path) -> None:
    req = result["requests"]
    t, ms = np.asarray(req["t"], dtype=float), np.asarray(req["ms"], dtype=float)
    status, version = np.asarray(req["status"]), np.asarray(req["version"], dtype=object)
    answered, bad = t + ms / 1e3, status != 200
    marks = _windows(result)
    for s in result["figures"]["swaps"]:
        marks += [mark("axvline", s["sent_s"], color="black", lw=0.8, ls=":"),
                  mark("axvline", s["returned_s"], color="black", lw=0.8, ls="--"),
                  mark("annotate", f" swap {s['swap']}", (s["sent_s"], 1.0),
                       xycoords=("data", "axes fraction"), fontsize=7, va="top")]
    for k, v in enumerate(sorted(set(version[~bad]), key=version_order)):
        sel = ~bad & (version == v)
        marks.append(mark("scatter", answered[sel], ms[sel], s=3, rasterized=True,
                          color=VERSION_COLORS[k % len(VERSION_COLORS)],
                          label=f"version {v or '(none)'}"))
    if bad.any():
        marks.append(mark("scatter", answered[bad], ms[bad], s=18, marker="x", color="#C44E52",
                          label="error (not 200, or no answer)"))
    draw(path, [
        Panel(marks, "each request's latency by when it was answered, one colour per version "
                     "that answered\n(grey: swap windows; dotted: load request; dashed: its "
                     "return)", ylabel="latency (ms, log)", yscale="log" if len(ms) else "linear",
              legend={"fontsize": 7, "loc": "upper left", "markerscale": 3}, title_size=10),
        Panel(rss_line(result["rss"]["samples"]) + _windows(result),
              xlabel="seconds since the gateway was ready",
              ylabel="RSS (MB)")],
        (11, 7.5), 2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})

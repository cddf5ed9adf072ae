"""``sensai bench-swap``'s figures and report: per-request records and the swaps' times turned
into per-swap figures (:func:`swap_figures`), then rendered: the terminal table, ``swap.md`` and
``swap.png``.

Every time is in seconds since the gateway was ready.  A request is *sent* at ``t`` and
*answered* at ``t + ms / 1000``; an error is any answer but 200, or none (status 0).  A swap's
*window* runs from its load request to one second after the load call returned (it returns
once the new version is ready and the old one drained and unloaded); the requests of a window
are those in flight at any moment of it.  The steady state is the requests sent after the
warm-up and answered before the first load request.  A version's *lifetime* runs from its load
request (the first version: from the start) to the return of the load call that replaced it;
an answer is *misattributed* when the version it names was not alive at some moment between
the request's send and its answer (a version that answered before it was asked for, or after it
was unloaded).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .load_measures import code_counts
from .render import (SHARED_CORES, Col, Panel, Table, draw, fmt, gateway_text, heading,
                     machine_line, markdown, mark, rss_line)
from .stats import summarize

WINDOW_TAIL_S = 1.0  # a swap's window ends this long after its load call returned


def lifetimes(first_version: str, swaps: Sequence[dict[str, Any]]
              ) -> dict[str, tuple[float, float]]:
    """Each version's lifetime (start, end) in seconds: a load call that failed replaced
    nothing, and its version was never alive."""
    alive = {first_version: (-math.inf, math.inf)}
    serving = first_version
    for s in swaps:
        if s["load_status"] != 200:
            continue
        alive[serving] = (alive[serving][0], s["returned_s"])
        serving = s["version"]
        alive[serving] = (s["sent_s"], math.inf)
    return alive


def misattributed(req: dict[str, np.ndarray], alive: dict[str, tuple[float, float]],
                  sel: np.ndarray | None = None) -> int:
    """200 answers (of those ``sel`` selects) naming a version not alive at any moment between
    their send and their answer."""
    ok = req["status"] == 200 if sel is None else sel & (req["status"] == 200)
    answered = req["t"] + req["ms"] / 1e3
    bad = 0
    for v in set(req["version"][ok]):
        start, end = alive.get(v, (math.inf, -math.inf))
        mine = ok & (req["version"] == v)
        bad += int((mine & ((answered < start) | (req["t"] > end))).sum())
    return bad


def version_order(version: str) -> tuple[int, str]:
    """Versions in number order, any other name after them."""
    return (int(version), "") if version.isdigit() else (1 << 30, version)


def _rss(samples: Sequence[dict], phase: str) -> dict[str, Any] | None:
    """The last RSS sample taken in ``phase``."""
    mine = [s for s in samples if s["phase"] == phase]
    return mine[-1] if mine else None


def wrong_answers(req: dict[str, np.ndarray], expected: dict[str, Sequence[int]],
                  sel: np.ndarray | None = None) -> dict[str, int]:
    """Per version, the 200 answers whose top-1 is not offline evaluation's of that version's
    artifact on the same image (versions without a reference are left out)."""
    ok = req["status"] == 200 if sel is None else sel & (req["status"] == 200)
    out = {}
    for v, ref in expected.items():
        mine = ok & (req["version"] == v)
        if mine.any():
            out[v] = int((np.asarray(ref)[req["image"][mine]] != req["index"][mine]).sum())
    return out


def _counts(req: dict[str, np.ndarray], sel: np.ndarray, alive: dict[str, tuple[float, float]],
            expected: dict[str, Sequence[int]]) -> dict[str, Any]:
    """Of the requests ``sel`` selects: how many, the errors, the status codes, the 200 answers
    by version, the misattributed and the wrong ones."""
    ok = sel & (req["status"] == 200)
    by_version = Counter(req["version"][ok])
    return {"requests": int(sel.sum()), "errors": int((sel & ~ok).sum()),
            "status_counts": code_counts(req["status"][sel]),
            "answers_by_version": {v or "(none)": n for v, n in
                                   sorted(by_version.items(), key=lambda kv: version_order(kv[0]))},
            "misattributed": misattributed(req, alive, ok),
            "wrong_by_version": wrong_answers(req, expected, ok)}


def swap_figures(req: dict[str, np.ndarray], *, first_version: str,
                 swaps: Sequence[dict[str, Any]], steady_start_s: float,
                 rss_samples: Sequence[dict], expected: dict[str, Sequence[int]] | None = None,
                 failures: dict[str, int] | None = None) -> dict[str, Any]:
    """The run's figures: the whole run, the steady state, and per swap (``swaps``: each
    with ``swap``, ``version``, ``from_version``, ``sent_s``, ``returned_s``, ``load_status``;
    kept, with the figures added)."""
    answered = req["t"] + req["ms"] / 1e3
    ok = req["status"] == 200
    alive, expected = lifetimes(first_version, swaps), expected or {}
    first_sent = swaps[0]["sent_s"] if swaps else math.inf
    steady = (req["t"] >= steady_start_s) & (answered < first_sent)
    steady_p99 = summarize(req["ms"][steady & ok].tolist())["p99"]
    run = _counts(req, np.ones(len(req["t"]), dtype=bool), alive, expected) | {
        "failures": dict(failures or {}),
        "lifetimes_s": {v: [None if math.isinf(a) else round(a, 3),
                            None if math.isinf(b) else round(b, 3)]
                        for v, (a, b) in sorted(alive.items(),
                                                key=lambda kv: version_order(kv[0]))},
        "steady": {"window_s": [round(steady_start_s, 3),
                                None if math.isinf(first_sent) else round(first_sent, 3)],
                   "requests": int(steady.sum()), "errors": int((steady & ~ok).sum()),
                   "latency_ok_ms": summarize(req["ms"][steady & ok].tolist())}}
    per_swap = []
    for s in swaps:
        start, end = s["sent_s"], s["returned_s"] + WINDOW_TAIL_S
        sel = (req["t"] <= end) & (answered >= start)
        lat = summarize(req["ms"][sel & ok].tolist())
        new = ok & (req["version"] == s["version"]) & (answered >= start)
        old = ok & (req["version"] == s["from_version"]) & (answered >= start)
        before, after = (_rss(rss_samples, f"before swap {s['swap']}"),
                         _rss(rss_samples, f"after swap {s['swap']}"))
        per_swap.append(s | _counts(req, sel, alive, expected) | {
            "load_s": round(s["returned_s"] - s["sent_s"], 3),
            "window_s": [round(start, 3), round(end, 3)], "latency_ok_ms": lat,
            "p99_over_steady": (round(lat["p99"] / steady_p99, 3)
                                if lat["p99"] is not None and steady_p99 else None),
            "first_answer_by_new_s": (round(float(answered[new].min()) - start, 3)
                                      if new.any() else None),
            "last_answer_by_old_s": (round(float(answered[old].max()) - start, 3)
                                     if old.any() else None),
            "rss_before_mb": before and before["rss_mb"],
            "rss_after_mb": after and after["rss_mb"],
            "tree_rss_before_mb": before and before["tree_rss_mb"],
            "tree_rss_after_mb": after and after["tree_rss_mb"],
        })
    return {"run": run, "swaps": per_swap}


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

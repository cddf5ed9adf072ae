"""``sensai bench-swap``'s figures: per-request records and the swaps' times turned into
per-swap figures (:func:`swap_figures`), which :mod:`.swap_report` renders.

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
from typing import Any, Sequence

import numpy as np

from .stats import summarize

WINDOW_TAIL_S = 1.0  # a swap's window ends this long after its load call returned


def columns(outs: Sequence[dict[str, Any]], t0: float) -> dict[str, np.ndarray]:
    """The clients' records (:func:`.client.load_phase` with ``answers``) merged into arrays:
    ``t`` (s since ``t0``), ``ms``, ``status``, ``version`` (str, "" where no answer named
    one), ``image`` and ``index`` (-1 where there was no 200 answer)."""
    def cat(key: str, dtype) -> np.ndarray:
        return np.concatenate([np.asarray(o[key], dtype=dtype) for o in outs]) if outs \
            else np.zeros(0, dtype=dtype)

    return {"t": cat("t", np.float64) - t0, "ms": cat("ms", np.float64),
            "status": cat("status", np.int64),
            "version": np.asarray([v or "" for o in outs for v in o["version"]], dtype=object),
            "image": cat("image", np.int64),
            "index": np.asarray([-1 if i is None else i for o in outs for i in o["index"]],
                                dtype=np.int64)}


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


def _by_version(req: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, int]:
    counts = Counter(req["version"][sel & (req["status"] == 200)])
    return {v or "(none)": n
            for v, n in sorted(counts.items(), key=lambda kv: version_order(kv[0]))}


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


def swap_figures(req: dict[str, np.ndarray], *, first_version: str,
                 swaps: Sequence[dict[str, Any]], steady_start_s: float,
                 rss_samples: Sequence[dict], expected: dict[str, Sequence[int]] | None = None,
                 failures: dict[str, int] | None = None) -> dict[str, Any]:
    """The run's figures: the whole run, the steady state, and per swap (``swaps``: each
    with ``swap``, ``version``, ``from_version``, ``sent_s``, ``returned_s``, ``load_status``;
    kept, with the figures added)."""
    answered = req["t"] + req["ms"] / 1e3
    ok = req["status"] == 200
    alive = lifetimes(first_version, swaps)
    everything = np.ones(len(req["t"]), dtype=bool)
    first_sent = swaps[0]["sent_s"] if swaps else math.inf
    steady = (req["t"] >= steady_start_s) & (answered < first_sent)
    steady_p99 = summarize(req["ms"][steady & ok].tolist())["p99"]
    codes = Counter(int(s) for s in req["status"])
    run = {"requests": int(len(req["t"])), "errors": int((~ok).sum()),
           "status_counts": {str(k): v for k, v in sorted(codes.items())},
           "failures": dict(failures or {}),
           "answers_by_version": _by_version(req, everything),
           "misattributed": misattributed(req, alive),
           "wrong_by_version": wrong_answers(req, expected or {}),
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
        per_swap.append(s | {
            "load_s": round(s["returned_s"] - s["sent_s"], 3),
            "window_s": [round(start, 3), round(end, 3)],
            "requests": int(sel.sum()), "errors": int((sel & ~ok).sum()),
            "status_counts": {str(k): v for k, v in
                              sorted(Counter(int(x) for x in req["status"][sel]).items())},
            "answers_by_version": _by_version(req, sel),
            "misattributed": misattributed(req, alive, sel),
            "wrong_by_version": wrong_answers(req, expected or {}, sel),
            "latency_ok_ms": lat,
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

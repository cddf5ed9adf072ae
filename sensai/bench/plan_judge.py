"""What ``sensai plan`` asks of a deployment and how it ranks the measured ones.

A measured deployment is the levels of :class:`~.load_run.Sweep` (closed loops at a few
requests in flight).  It meets the constraints when no answer failed or was wrong, its one-image
p99 (the first level) is within the latency budget, some level within the budget answers at
least the minimum throughput, and its process tree stayed under the memory cap.  Among those
that meet them the objective decides; the others are ranked by how far they miss (the largest
relative excess over any constraint), so the closest can be recommended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from sensai.errors import SensaiError

from .options import flag

OBJECTIVES = ("latency", "throughput")
OBJECTIVE_TEXT = {"latency": "the lowest one-image p50", "throughput": "the most answers/s "
                  "within the latency budget"}


def rps_within(levels: Sequence[dict[str, Any]], p99_ms: float | None) -> float:
    """The highest closed-loop throughput of the levels whose p99 is within ``p99_ms`` (None:
    any measured p99), 0 when none is."""
    return max((r["throughput_rps"] or 0.0 for r in levels
                if (r.get("latency_ok_ms") or {}).get("p99") is not None
                and (p99_ms is None or r["latency_ok_ms"]["p99"] <= p99_ms)), default=0.0)


@dataclass(frozen=True)
class Constraints:
    """The user's constraints (None: not constrained) and objective."""

    latency_budget_ms: float | None = flag(
        metavar="MS", help="the p99 latency a deployment must keep, one image in flight and at "
                           "the throughput it is credited with (default: none)")
    min_throughput: float | None = flag(
        metavar="ANSWERS_PER_S",
        help="answers/s a deployment must serve within the budget (default: none)")
    max_memory_mb: float | None = flag(
        metavar="MB", help="the most the gateway's process tree may hold resident (default: none)")
    objective: str = flag(default="latency", choices=OBJECTIVES,
                          help="latency: the lowest one-image p50; throughput: the most "
                               "answers/s within the budget")

    def check(self) -> None:
        for name, value in (("--latency-budget-ms", self.latency_budget_ms),
                            ("--min-throughput", self.min_throughput),
                            ("--max-memory-mb", self.max_memory_mb)):
            if value is not None and not (isinstance(value, (int, float))
                                          and math.isfinite(value) and value > 0):
                raise SensaiError(f"{name} must be a positive number, got {value!r}")
        if self.objective not in OBJECTIVES:
            raise SensaiError(f"--objective {self.objective!r}: choose one of "
                              f"{', '.join(OBJECTIVES)}")

    @property
    def given(self) -> str | None:
        """The constraints in words; None when none was given."""
        parts = [f"p99 <= {self.latency_budget_ms:g} ms" if self.latency_budget_ms else None,
                 f">= {self.min_throughput:g} answers/s" if self.min_throughput else None,
                 f"<= {self.max_memory_mb:g} MB" if self.max_memory_mb else None]
        return ", ".join(p for p in parts if p) or None

    def describe(self) -> str:
        return self.given or "no constraint"

    def summarize(self, levels: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The figures a deployment is judged on, from its levels (ascending in flight)."""
        first = levels[0] if levels else {}
        lat = first.get("latency_ok_ms") or {}
        rss = [r["server_tree_rss_mb"] for r in levels if r.get("server_tree_rss_mb")]
        return {"p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
                "one_image_in_flight": first.get("concurrency"),
                "rps_within_budget": round(rps_within(levels, self.latency_budget_ms), 1),
                "best_rps": round(rps_within(levels, None), 1),
                "rss_mb": max(rss) if rss else None,
                "errors": sum(r.get("errors", 0) for r in levels),
                "wrong": sum(r.get("wrong", 0) for r in levels)}

    def judge(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Whether ``summary`` meets the constraints, by how much it misses (0 when it meets
        them; the largest relative excess), and why not, in words."""
        misses: list[tuple[float, str]] = []
        if summary.get("error"):
            misses.append((math.inf, summary["error"]))
        elif summary["errors"] or summary["wrong"] or summary["p99_ms"] is None:
            misses.append((math.inf, f"{summary['errors']} failed and {summary['wrong']} "
                                     "wrong answers"))
        else:
            p99, rps, rss = summary["p99_ms"], summary["rps_within_budget"], summary["rss_mb"]
            if self.latency_budget_ms and p99 > self.latency_budget_ms:
                misses.append((p99 / self.latency_budget_ms - 1,
                               f"one-image p99 {p99:.2f} ms over the {self.latency_budget_ms:g} "
                               "ms budget"))
            if self.min_throughput and rps < self.min_throughput:
                # Nothing within the budget: how far the throughput misses is measured without
                # it, so the closest of many over the budget is still ranked by both.
                got = rps or summary["best_rps"]
                short = self.min_throughput / got - 1 if got else math.inf
                if short > 0:
                    misses.append((short, f"{got:g} answers/s" + (" within the budget" if rps
                                                                   else "") +
                                   f", under {self.min_throughput:g}"))
            if self.max_memory_mb and rss is not None and rss > self.max_memory_mb:
                misses.append((rss / self.max_memory_mb - 1,
                               f"{rss:g} MB over the {self.max_memory_mb:g} MB cap"))
        excess = max((m[0] for m in misses), default=0.0)
        return {"meets": not misses, "excess": None if math.isinf(excess) else round(excess, 4),
                "why_not": [m[1] for m in misses]}

    def sort_key(self, measured: dict[str, Any]) -> tuple:
        """Those that meet the constraints first, best objective first; then the closest."""
        verdict, s = measured["verdict"], measured["summary"]
        if not verdict["meets"]:
            excess = verdict["excess"]
            return (1, math.inf if excess is None else excess, 0.0)
        if self.objective == "latency":
            return (0, s["p50_ms"], -s["rps_within_budget"])
        return (0, -s["rps_within_budget"], s["p50_ms"])

    def within_noise(self, base: dict[str, Any], better: dict[str, Any], noise: float) -> bool:
        """Whether ``better`` beats ``base`` on the objective by less than ``noise`` (a share),
        both meeting the constraints."""
        if not (base["verdict"]["meets"] and better["verdict"]["meets"]):
            return False
        a, b = base["summary"], better["summary"]
        if self.objective == "latency":
            return b["p50_ms"] >= a["p50_ms"] * (1 - noise)
        return b["rps_within_budget"] <= a["rps_within_budget"] * (1 + noise)

    def objective_value(self, measured: dict[str, Any]) -> str:
        s = measured["summary"]
        if s.get("error") or s["p50_ms"] is None:
            return "none (it did not answer)"
        if self.objective == "latency":
            return f"one-image p50 {s['p50_ms']:.2f} ms"
        return f"{s['rps_within_budget']:g} answers/s within the budget"

"""``sensai bench-robust``'s per-request records of one configuration in one scenario, and how
they are summed up: one implementation for the in-process predictors and the Ray Serve
application called over HTTP."""

from __future__ import annotations

from typing import Any

from .stats import summarize

AFTER_REJOIN = 20  # requests after the victim rejoined, to check it serves again


class Records:
    """Per-request records of one configuration in one scenario."""

    def __init__(self) -> None:
        self.latency: list[float] = []
        self.errors: list[str] = []
        self.wrong = 0
        self.degraded = 0
        self.answered_by: list[dict[str, str]] = []
        self.runs = 0
        self.compute_ms: float | None = 0.0
        self.skipped = 0
        self.requests = 0

    def add_work(self, before: dict, after: dict) -> None:
        """The work the workers did between two readings of their counters; a reading without
        ``compute_ms`` (a server that does not report it) leaves the compute time unknown."""
        self.runs += after["runs"] - before["runs"]
        self.skipped += after["skipped"] - before["skipped"]
        if self.compute_ms is not None and after.get("compute_ms") is not None:
            self.compute_ms += after["compute_ms"] - before["compute_ms"]
        else:
            self.compute_ms = None

    def report(self, extra: dict | None = None) -> dict[str, Any]:
        per = max(1, self.requests)
        out = {"requests": self.requests, "answered": len(self.latency),
               "errors": len(self.errors), "wrong": self.wrong, "degraded": self.degraded,
               "latency_ms": summarize(self.latency),
               "subnet_runs_per_request": round(self.runs / per, 3),
               "compute_ms_per_request": (None if self.compute_ms is None
                                          else round(self.compute_ms / per, 4)),
               "copies_skipped_per_request": round(self.skipped / per, 3),
               "error_examples": sorted(set(self.errors))[:3],
               "latencies_ms": [round(v, 4) for v in self.latency]}
        out.update(extra or {})
        return out

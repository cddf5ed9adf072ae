"""``sensai bench-robust``'s per-request records of one configuration in one scenario, the
victim's outage, and how they are summed up: one implementation for the in-process predictors
and the Ray Serve application called over HTTP."""

from __future__ import annotations

import time
from typing import Any, Callable

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
        # Each request's start (monotonic seconds), length (ms), error (None: answered), and
        # whether its answer was wrong: what :meth:`window` picks from.
        self.spans: list[tuple[float, float, str | None, bool]] = []

    def add(self, start: float, ms: float, error: str | None = None, wrong: bool = False
            ) -> None:
        """One request, started at ``start`` (monotonic seconds) and over ``ms`` later:
        answered (``wrong``: unlike offline evaluation) or failed with ``error``."""
        self.requests += 1
        self.spans.append((start, ms, error, wrong))
        if error is None:
            self.latency.append(ms)
            self.wrong += wrong
        else:
            self.errors.append(error)

    def window(self, keep: Callable[[float, float], bool]) -> Records:
        """The requests that ``keep(start, end)`` (monotonic seconds), as records of their
        own."""
        out = Records()
        for start, ms, error, wrong in self.spans:
            if keep(start, start + ms / 1e3):
                out.add(start, ms, error, wrong)
        return out

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


class Outage:
    """The victim's outage as its watcher saw it, in monotonic seconds (``events``): ``kill``;
    ``down``, first seen down; ``up``, first seen up again after that; ``served``, where it can
    be seen, first seen serving again.  The outage lasts from the kill until it served again
    (else until it was up)."""

    def __init__(self) -> None:
        self.events: dict[str, float] = {}

    def killed(self) -> None:
        self.events["kill"] = time.monotonic()

    def see(self, *, down: bool, up: bool) -> None:
        """One look at the victim after the kill: whether it is down, whether up again."""
        if "kill" not in self.events:
            return
        if down:
            self.events.setdefault("down", time.monotonic())
        if up and "down" in self.events:
            self.events.setdefault("up", time.monotonic())

    def since_kill(self, event: str) -> float | None:
        return round(self.events[event] - self.events["kill"], 3) if event in self.events else None

    def end(self) -> float:
        return self.events.get("served", self.events.get("up", float("inf")))

    def during(self, start: float, end: float) -> bool:
        """Whether a request from ``start`` to ``end`` overlapped the outage."""
        return end >= self.events["kill"] and start < self.end()

    def after(self, start: float, end: float) -> bool:
        """Whether a request was sent once the outage was over."""
        return start >= self.end()


def outage_report(run: Records, outage: Outage, after: Records, victim_runs: int,
                  **figures) -> dict[str, Any]:
    """A failure scenario's report: ``run``'s with ``figures`` (the victim, ...), the outage's
    times from the kill, the errors and latency of the requests that overlapped it, and those of
    ``after``, the requests once it was over (``victim_runs``: the victim's subnet runs for
    them)."""
    during = run.window(outage.during)
    return run.report({
        **figures, "down_s": outage.since_kill("down"), "outage_s": outage.since_kill("up"),
        "errors_during_outage": len(during.errors),
        "latency_during_outage_ms": summarize(during.latency),
        "after_rejoin": {"requests": after.requests, "errors": len(after.errors),
                         "wrong": after.wrong, "victim_subnet_runs": victim_runs,
                         "latency_ms": summarize(after.latency)}})

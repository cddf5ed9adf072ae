"""Statistics of the benchmark's samples: percentiles, and one request's latency split in parts.

Every request of a strategy reports the same ``timings_ms`` keys (:mod:`.baselines` and the
class-parallel predictor alike): ``total`` (inside the predictor), ``compute`` (the critical path:
the one run, the sum of the stages, the slowest subnet), ``compute_sum`` (work done by all
workers), ``merge`` (outputs -> class scores) and ``compute.<worker>`` per worker.  The rest of a
request's latency is ``transport``: inside the predictor (``dispatch``: hand-offs, fan-out and
gather) and outside it (``http``: the request, image decoding, the JSON answer).  Over a remote
transport each request also has its *floor*: the same client's bare request to the same server
just before it (``floor_ms``), and ``latency_minus_floor_minus_compute`` is, request by request,
what the gateway and the fan-out add on top of the transport's own cost and the critical path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

STATS = ("p50", "p90", "p99", "mean", "min", "max")


def rounded(v: float | None, nd: int = 4) -> float | None:
    """``v`` rounded, or None when it is missing or not finite (JSON has no NaN)."""
    return round(float(v), nd) if v is not None and math.isfinite(float(v)) else None


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99, mean, min, max and count of the finite values (None for each when empty)."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if not len(a):
        return {k: None for k in STATS} | {"n": 0}
    p50, p90, p99 = (round(float(v), 4) for v in np.percentile(a, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": round(float(a.mean()), 4),
            "min": round(float(a.min()), 4), "max": round(float(a.max()), 4), "n": int(len(a))}


def _nan_stat(fn, a: np.ndarray) -> float | None:
    return rounded(fn(a)) if np.isfinite(a).any() else None


def subnet_computes(timings: dict[str, float]) -> dict[str, float]:
    """Each runner's own compute in a prediction's timings (``compute.<name>``), by name."""
    return {k[len("compute."):]: float(v) for k, v in timings.items()
            if k.startswith("compute.")}


def side_by_side(timings: dict[str, float]) -> bool | None:
    """Whether a request's subnets computed at the same time: each subnet's compute, ending
    when its output arrived (``<subnet>``, ms from the request's start) and lasting
    ``compute.<subnet>``, overlaps all the others' for at least half the shortest one.  None
    with fewer than two subnets (other strategies: the timings have no arrivals)."""
    spans = [(timings[name] - ms, timings[name], ms)
             for name, ms in subnet_computes(timings).items() if name in timings]
    if len(spans) < 2:
        return None
    overlap = min(end for _, end, _ in spans) - max(start for start, _, _ in spans)
    return overlap >= 0.5 * min(ms for _, _, ms in spans)


@dataclass
class Samples:
    """Per-request figures of one strategy over one transport at concurrency 1."""

    latency: list[float] = field(default_factory=list)  # client side, ms
    total: list[float] = field(default_factory=list)  # inside the predictor
    compute: list[float] = field(default_factory=list)  # critical path
    compute_sum: list[float] = field(default_factory=list)
    merge: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)  # the bare request's ms (remote only)
    per_worker: dict[str, list[float]] = field(default_factory=dict)
    together: list[bool] = field(default_factory=list)  # class parallel: side_by_side()
    correct: int = 0
    answered: int = 0

    def add(self, latency_ms: float, timings: dict[str, float], correct: bool,
            floor_ms: float | None = None) -> None:
        self.latency.append(latency_ms)
        if floor_ms is not None:
            self.floor.append(float(floor_ms))
        self.total.append(float(timings.get("total", float("nan"))))
        self.compute.append(float(timings.get("compute", float("nan"))))
        self.compute_sum.append(float(timings.get("compute_sum", float("nan"))))
        self.merge.append(float(timings.get("merge", 0.0)))
        for name, ms in subnet_computes(timings).items():
            self.per_worker.setdefault(name, []).append(ms)
        together = side_by_side(timings)
        if together is not None:
            self.together.append(together)
        self.correct += bool(correct)
        self.answered += 1

    def report(self) -> dict[str, Any]:
        lat, total = np.asarray(self.latency), np.asarray(self.total)
        comp, merge = np.asarray(self.compute), np.asarray(self.merge)
        parts = {"compute": comp, "merge": merge, "transport": lat - comp - merge,
                 "dispatch": total - comp - merge, "http": lat - total}
        mean = {k: _nan_stat(np.nanmean, v) for k, v in parts.items()}
        p50 = {k: _nan_stat(np.nanmedian, v) for k, v in parts.items()}
        p50["latency_minus_compute"] = _nan_stat(np.nanmedian, lat - comp)
        remote = len(self.floor) == len(self.latency) > 0
        p50["latency_minus_floor_minus_compute"] = (
            _nan_stat(np.nanmedian, lat - np.asarray(self.floor) - comp) if remote else None)
        return {
            "latency_ms": summarize(self.latency),
            "floor_ms": summarize(self.floor) if remote else None,
            # Means add up to the mean latency; medians of parts do not add up.
            "breakdown_ms": {"mean": mean, "p50": p50},
            "compute_sum_ms": summarize(self.compute_sum),
            "per_worker_compute_ms": {k: summarize(v) for k, v in sorted(self.per_worker.items())},
            # Requests whose subnets all computed at the same time (class parallel), or None.
            "side_by_side": ({"requests": len(self.together), "share": round(
                sum(self.together) / len(self.together), 4)} if self.together else None),
            "top1": round(self.correct / self.answered, 5) if self.answered else None,
            "images": self.answered,
        }

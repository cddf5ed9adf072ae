"""The benchmark's targets: a small declarative table, each target set naming the model(s) it
applies to.

A :class:`TargetSet` holds :class:`Target`\\ s (a measure, a limit) checked on one transport
(HTTP: end to end, what a caller sees) at p50.  :func:`evaluate_targets` reports only the sets
that apply to the artifact's model, each target as met / not met / not measured (and why), with
the value and, for reference, the same measure in process.  Sets for other models are left out
of the result entirely.  To add a target, add a row to :data:`TARGET_SETS`; a new kind of
measure is a small class with ``rule``, ``value`` and ``needs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .names import LABELS

EVERY_MODEL = ("*",)


def _rep(strategies: dict, key: str, transport: str) -> dict | None:
    return strategies.get(key, {}).get("transports", {}).get(transport)


@dataclass(frozen=True)
class Ratio:
    """p50 latency of ``strategy`` over p50 latency of ``baseline``."""

    strategy: str
    baseline: str
    unit = "x"

    def rule(self, limit: float) -> str:
        return (f"p50({LABELS[self.strategy].replace(' (sensAI)', '')}) <= {limit:g} x "
                f"p50({LABELS[self.baseline]})")

    def value(self, strategies: dict, transport: str) -> float | None:
        a, b = _rep(strategies, self.strategy, transport), _rep(strategies, self.baseline,
                                                                transport)
        if a is None or b is None or not a["latency_ms"]["p50"] or not b["latency_ms"]["p50"]:
            return None
        return round(a["latency_ms"]["p50"] / b["latency_ms"]["p50"], 4)

    def needs(self, transport: str) -> str:
        return f"needs {self.strategy} and {self.baseline} measured over {transport}"


@dataclass(frozen=True)
class FanoutOverhead:
    """p50 of (class-parallel latency - the slowest subnet's compute), ms: what fan-out, merge
    and (over HTTP) the request cost on top of the floor."""

    unit = "ms"

    def rule(self, limit: float) -> str:
        return f"p50(class-parallel latency - slowest subnet's compute) <= {limit:g} ms"

    def value(self, strategies: dict, transport: str) -> float | None:
        rep = _rep(strategies, "class-parallel", transport)
        return None if rep is None else rep["breakdown_ms"]["p50"]["latency_minus_compute"]

    def needs(self, transport: str) -> str:
        return f"needs class-parallel measured over {transport}"


@dataclass(frozen=True)
class Target:
    name: str
    measure: Ratio | FanoutOverhead
    limit: float


@dataclass(frozen=True)
class TargetSet:
    name: str
    models: tuple[str, ...]  # registry names, or EVERY_MODEL
    targets: tuple[Target, ...]
    transport: str = "http"
    origin: str = ""

    def applies_to(self, model: str) -> bool:
        return self.models == EVERY_MODEL or model in self.models


TARGET_SETS: tuple[TargetSet, ...] = (
    TargetSet("class parallel against the baselines", models=("vgg16_bn",), origin="issue 5",
              targets=(
                  Target("class_parallel_vs_single", Ratio("class-parallel", "single"), 0.35),
                  Target("class_parallel_vs_model_parallel",
                         Ratio("class-parallel", "model-parallel"), 0.35))),
    TargetSet("fan-out overhead", models=EVERY_MODEL, origin="issue 5", targets=(
        Target("fanout_overhead_ms", FanoutOverhead(), 1.5),)),
)

STATUS = {True: "met", False: "not met", None: "not measured"}


def _check(target: Target, transport: str, strategies: dict) -> dict[str, Any]:
    m = target.measure
    value = m.value(strategies, transport)
    met = None if value is None else value <= target.limit
    other = "inprocess" if transport == "http" else "http"
    return {"name": target.name, "rule": m.rule(target.limit), "transport": transport,
            "value": value, "limit": target.limit, "unit": m.unit, "met": met,
            "status": STATUS[met], f"{other}_value": m.value(strategies, other),
            "why_not_measured": None if value is not None else m.needs(transport)}


def evaluate_targets(result: dict, sets: Sequence[TargetSet] = TARGET_SETS) -> dict[str, Any]:
    """The target sets that apply to ``result["model"]``, each target checked at p50."""
    model = result.get("model")
    strategies = result.get("strategies", {})
    applicable = [s for s in sets if s.applies_to(model)]
    out_sets = [{"name": s.name, "models": "every model" if s.models == EVERY_MODEL
                 else list(s.models), "origin": s.origin, "transport": s.transport,
                 "checks": [_check(t, s.transport, strategies) for t in s.targets]}
                for s in applicable]
    checks = [c for s in out_sets for c in s["checks"]]
    return {"model": model, "statistic": "p50", "sets": out_sets,
            "all_met": (all(c["met"] for c in checks)
                        if checks and all(c["met"] is not None for c in checks) else None)}


def all_checks(targets: dict) -> list[dict]:
    return [c for s in targets.get("sets", []) for c in s["checks"]]

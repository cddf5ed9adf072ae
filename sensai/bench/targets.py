"""The benchmarks' targets, each reported as met / not met / not measured with its value (never
asserted).  ``sensai bench``'s are a small declarative table, each target set naming the model(s)
it applies to; ``sensai bench-load``'s (:func:`evaluate_load_targets`) are fixed.

A :class:`TargetSet` holds :class:`Target`\\ s (a measure, a limit) checked at p50 on the set's
transport (HTTP: end to end, what a caller sees), or on the target's own.  :func:`evaluate_targets`
reports only the sets that apply to the artifact's model, each target as met / not met / not
measured (and why), with the value and, for reference, the same measure on another transport (in
process, or HTTP for an in-process target).  Sets for other models are left out of the result
entirely, and so are sets comparing strategies or peers the run did not have.  To add a target,
add a row to :data:`TARGET_SETS`; a new kind of measure is a small class with ``rule``,
``value`` and ``needs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from sensai.models import DEMO_MODEL

from .load_measures import LAST_WINDOW_S
from .names import PEER_LABELS, label

EVERY_MODEL = ("*",)


def _rep(result: dict, key: str, transport: str) -> dict | None:
    """A strategy's report over ``transport``, or a peer's (``--peers``: the keys differ)."""
    found = result.get("strategies", {}).get(key) or result.get("peers", {}).get(key) or {}
    return found.get("transports", {}).get(transport)


def _name(key: str) -> str:
    return PEER_LABELS[key] if key in PEER_LABELS else label(key).replace(" (sensAI)", "")


@dataclass(frozen=True)
class Ratio:
    """p50 latency of ``strategy`` over p50 latency of ``baseline``."""

    strategy: str
    baseline: str
    unit = "x"

    def rule(self, limit: float) -> str:
        return f"p50({_name(self.strategy)}) <= {limit:g} x p50({_name(self.baseline)})"

    def value(self, result: dict, transport: str) -> float | None:
        a, b = _rep(result, self.strategy, transport), _rep(result, self.baseline, transport)
        if a is None or b is None or not a["latency_ms"]["p50"] or not b["latency_ms"]["p50"]:
            return None
        return round(a["latency_ms"]["p50"] / b["latency_ms"]["p50"], 4)

    def needs(self, transport: str) -> str:
        return f"needs {self.strategy} and {self.baseline} measured over {transport}"


@dataclass(frozen=True)
class Latency:
    """p50 latency of ``strategy``, ms."""

    strategy: str
    unit = "ms"

    def rule(self, limit: float) -> str:
        return f"p50({_name(self.strategy)}) <= {limit:g} ms"

    def value(self, result: dict, transport: str) -> float | None:
        rep = _rep(result, self.strategy, transport)
        return None if rep is None else rep["latency_ms"]["p50"]

    def needs(self, transport: str) -> str:
        return f"needs {self.strategy} measured over {transport}"


@dataclass(frozen=True)
class FanoutOverhead:
    """p50 of (class-parallel latency - the slowest subnet's compute), ms: what fan-out, merge
    and (over HTTP) the request cost on top of the floor."""

    unit = "ms"

    def rule(self, limit: float) -> str:
        return f"p50(class-parallel latency - slowest subnet's compute) <= {limit:g} ms"

    def value(self, result: dict, transport: str) -> float | None:
        rep = _rep(result, "class-parallel", transport)
        return None if rep is None else rep["breakdown_ms"]["p50"]["latency_minus_compute"]

    def needs(self, transport: str) -> str:
        return f"needs class-parallel measured over {transport}"


@dataclass(frozen=True)
class OverFloor:
    """p50 of (class-parallel latency - the same client's bare request to the same server just
    before it - the slowest subnet's compute), request by request, ms: what the gateway's request
    path and the fan-out add on top of the transport's own floor.  In process there is no
    request, so the floor is 0."""

    bare: str = "bare GET"
    unit = "ms"

    def rule(self, limit: float) -> str:
        return (f"p50(class-parallel latency - {self.bare} - slowest subnet's compute) "
                f"<= {limit:g} ms")

    def value(self, result: dict, transport: str) -> float | None:
        rep = _rep(result, "class-parallel", transport)
        if rep is None:
            return None
        key = ("latency_minus_compute" if transport == "inprocess"
               else "latency_minus_floor_minus_compute")
        return rep["breakdown_ms"]["p50"].get(key)

    def needs(self, transport: str) -> str:
        return f"needs class-parallel measured over {transport}"


@dataclass(frozen=True)
class AccuracyLoss:
    """Points of test top-1 the decomposed model loses against its original (negative: it
    gains), from the artifact's own evaluation: the same for every transport, since every
    transport merges the same scores with the same rule."""

    unit = "points"

    def rule(self, limit: float) -> str:
        return f"top-1(original) - top-1(decomposed) <= {limit:g} points"

    def value(self, result: dict, transport: str) -> float | None:
        delta = result.get("accuracy", {}).get("delta_points")
        return None if delta is None else round(-float(delta), 3)

    def needs(self, transport: str) -> str:
        return "needs the original's and the decomposed top-1 in the artifact's manifest"


@dataclass(frozen=True)
class OverheadAgainstPeer:
    """sensai's class-parallel overhead over compute minus ``peer``'s over its own, ms, from
    bench.json's ``comparison`` (``--peers``): each is latency - the same client's bare request
    - the compute of the same model(s) run alone, so <= 0 means the gateway adds no more than
    the peer does."""

    peer: str = "triton"
    unit = "ms"

    def rule(self, limit: float) -> str:
        return (f"overhead(class parallel) - overhead({PEER_LABELS[self.peer]}) <= {limit:g} ms "
                "(latency - bare request - compute alone)")

    def value(self, result: dict, transport: str) -> float | None:
        c = result.get("comparison") or {}
        if c.get("transport") != transport:
            return None
        rows = {r["key"]: r.get("overhead_ms") for r in c.get("rows", [])}
        ours, theirs = rows.get("class-parallel"), rows.get(self.peer)
        return None if ours is None or theirs is None else round(ours - theirs, 4)

    def needs(self, transport: str) -> str:
        return f"needs --peers {self.peer} (measured over {transport})"


@dataclass(frozen=True)
class OverGraphReplay:
    """p50 of class-parallel latency minus the slowest subnet's CUDA-graph replay time (the
    GPU's own time for one image, measured alone), ms: everything the host adds on top."""

    unit = "ms"

    def rule(self, limit: float) -> str:
        return f"p50(class-parallel latency) - slowest subnet's graph replay <= {limit:g} ms"

    def value(self, result: dict, transport: str) -> float | None:
        rep = _rep(result, "class-parallel", transport)
        floor = result.get("strategies", {}).get("class-parallel", {}).get("graph_replay_ms_max")
        if rep is None or floor is None or not rep["latency_ms"]["p50"]:
            return None
        return round(rep["latency_ms"]["p50"] - floor, 4)

    def needs(self, transport: str) -> str:
        return f"needs class-parallel on CUDA graphs, measured over {transport}"


@dataclass(frozen=True)
class AddedOver:
    """p50 of class parallel over ``transport`` minus its p50 in process, ms: what the gateway
    and the wire add."""

    unit = "ms"

    def rule(self, limit: float) -> str:
        return f"p50(class parallel) - p50(class parallel in process) <= {limit:g} ms"

    def value(self, result: dict, transport: str) -> float | None:
        a, b = _rep(result, "class-parallel", transport), _rep(result, "class-parallel",
                                                                "inprocess")
        if a is None or b is None or not a["latency_ms"]["p50"] or not b["latency_ms"]["p50"]:
            return None
        return round(a["latency_ms"]["p50"] - b["latency_ms"]["p50"], 4)

    def needs(self, transport: str) -> str:
        return f"needs class-parallel measured in process and over {transport}"


@dataclass(frozen=True)
class OverOneCall:
    """p50 of class parallel minus p50 of the one-call reference (every subnet in one device
    call, in process, nothing else running: :mod:`.one_call`), ms - or, with ``ratio``, the
    one over the other: what serving adds to the device's compute."""

    ratio: bool = False

    @property
    def unit(self) -> str:
        return "x" if self.ratio else "ms"

    def rule(self, limit: float) -> str:
        if self.ratio:
            return f"p50(class parallel) <= {limit:g} x p50(one call of every subnet)"
        return f"p50(class parallel) - p50(one call of every subnet) <= {limit:g} ms"

    def value(self, result: dict, transport: str) -> float | None:
        rep = _rep(result, "class-parallel", transport)
        ref = ((result.get("strategies", {}).get("class-parallel", {}).get("one_call") or {})
               .get("ms") or {}).get("p50")
        if rep is None or not ref or not rep["latency_ms"]["p50"]:
            return None
        mine = rep["latency_ms"]["p50"]
        return round(mine / ref if self.ratio else mine - ref, 4)

    def needs(self, transport: str) -> str:
        return f"needs class-parallel measured over {transport} and its one-call reference"


@dataclass(frozen=True)
class ShrinkFactor:
    """How many times fewer parameters the largest subnet has than the original (reported as
    its inverse, so that lower is better like every other measure)."""

    unit = "of the original's params"

    def rule(self, limit: float) -> str:
        return f"largest subnet's params <= {limit:g} x the original's"

    def value(self, result: dict, transport: str) -> float | None:
        ratio = result.get("shrink", {}).get("params_ratio")
        return None if not ratio else round(1.0 / ratio, 4)

    def needs(self, transport: str) -> str:
        return "needs the parameter counts in the artifact's manifest"


@dataclass(frozen=True)
class Target:
    name: str
    measure: (Ratio | Latency | FanoutOverhead | OverFloor | AccuracyLoss | OverheadAgainstPeer
              | OverGraphReplay | AddedOver | OverOneCall | ShrinkFactor)
    limit: float
    transport: str | None = None  # None: the set's


@dataclass(frozen=True)
class TargetSet:
    name: str
    models: tuple[str, ...]  # registry names, or EVERY_MODEL
    targets: tuple[Target, ...]
    transport: str = "http"
    origin: str = ""
    # Strategies or peers the set compares: a run that did not ask for them (no --backend ray,
    # no --peers) is not judged by it.
    requires: tuple[str, ...] = ()
    gpu: bool = False  # stated for runs on a CUDA device
    datasets: tuple[str, ...] = ()  # stated for these datasets only (empty: any)
    min_image_side: int = 0  # stated for inputs at least this large (compute, not launches)

    def applies_to(self, result: dict) -> bool:
        ran = {*result.get("strategies", {}), *result.get("peers", {})}
        st = result.get("settings", {})
        on_gpu = str(st.get("device_resolved", "")).startswith("cuda")
        side = min(result.get("input_shape", [0, 0, 0])[1:] or [0])
        return ((self.models == EVERY_MODEL or result.get("model") in self.models)
                and all(key in ran for key in self.requires)
                and (on_gpu or not self.gpu) and side >= self.min_image_side
                and (not self.datasets or result.get("dataset") in self.datasets))


TARGET_SETS: tuple[TargetSet, ...] = (
    TargetSet("class parallel against the baselines, at the original's accuracy",
              models=("vgg16_bn",), origin="sensAI's claim",
              targets=(
                  Target("class_parallel_vs_single", Ratio("class-parallel", "single"), 0.35),
                  Target("class_parallel_vs_model_parallel",
                         Ratio("class-parallel", "model-parallel"), 0.35),
                  Target("accuracy_loss_points", AccuracyLoss(), 0.5))),
    TargetSet("on a GPU: the flagship decomposed there", models=("vgg16_bn",), gpu=True,
              datasets=("fashion-mnist",),
              origin="sensAI on its own hardware", transport="inprocess", targets=(
                  Target("accuracy_loss_points", AccuracyLoss(), 0.5),
                  Target("largest_subnet_params", ShrinkFactor(), 0.1),
                  Target("over_graph_replay_ms", OverGraphReplay(), 0.05),
                  Target("http_v2_added_ms", AddedOver(), 0.3, transport="http-v2"))),
    TargetSet("on a GPU at 224x224: compute, not launches", models=EVERY_MODEL, gpu=True,
              min_image_side=224, origin="sensAI on its own hardware", transport="inprocess",
              targets=(Target("class_parallel_vs_single", Ratio("class-parallel", "single"),
                              0.4),)),
    TargetSet("the demo shows the gain", models=(DEMO_MODEL,), origin="the demo",
              targets=(
                  Target("class_parallel_vs_single", Ratio("class-parallel", "single"), 0.7),
                  Target("accuracy_loss_points", AccuracyLoss(), 0.5))),
    TargetSet("the device as the unit: serving adds little to one call of every subnet",
              models=EVERY_MODEL, origin="a device runs its subnets in one call",
              transport="http-v2", targets=(
                  Target("over_one_call_http_v2_ms", OverOneCall(), 0.35),
                  Target("inprocess_vs_one_call", OverOneCall(ratio=True), 1.1,
                         transport="inprocess"))),
    TargetSet("the device as the unit on a GPU", models=EVERY_MODEL, gpu=True,
              origin="a device runs its subnets in one call", transport="inprocess",
              targets=(
                  Target("class_parallel_vs_single", Ratio("class-parallel", "single"), 0.8),
                  Target("http_v2_p50_ms", Latency("class-parallel"), 1.0,
                         transport="http-v2"))),
    TargetSet("fan-out overhead", models=EVERY_MODEL, origin="the gateway's cost", targets=(
        Target("fanout_overhead_ms", FanoutOverhead(), 1.5),)),
    TargetSet("overhead above each transport's floor", models=EVERY_MODEL,
              origin="the gateway's cost per transport", transport="http-v2", targets=(
                  Target("over_floor_http_v2_ms", OverFloor(), 0.5),
                  Target("over_floor_png_upload_ms", OverFloor(), 0.8, transport="http"),
                  Target("fanout_overhead_inprocess_ms", FanoutOverhead(), 0.15,
                         transport="inprocess"))),
    TargetSet("the Ray pool against the local one", models=EVERY_MODEL,
              origin="the Ray pool's cost", transport="http-v2", requires=("class-parallel@ray",),
              targets=(Target("ray_vs_local_pool", Ratio("class-parallel@ray", "class-parallel"),
                              2.0),)),
    TargetSet("the Ray Serve application against the local pool", models=EVERY_MODEL,
              origin="the Serve application's cost", transport="http-v2",
              requires=("class-parallel@ray-serve",),
              targets=(Target("ray_serve_vs_local_pool",
                              Ratio("class-parallel@ray-serve", "class-parallel"), 2.0),)),
    TargetSet("sensai against Triton serving the original", models=("vgg16_bn",),
              origin="what a user would pick instead", transport="http-v2",
              requires=("triton",), targets=(
                  Target("class_parallel_vs_triton_original", Ratio("class-parallel", "triton"),
                         0.4),
                  Target("overhead_vs_triton_ms", OverheadAgainstPeer("triton"), 0.0))),
)

STATUS = {True: "met", False: "not met", None: "not measured"}


def verdict(name: str, rule: str, value, limit, unit: str, met: bool | None,
            **extra) -> dict[str, Any]:
    """One target's row: its rule, value and limit, and whether it was met."""
    return {"name": name, "rule": rule, "value": value, "limit": limit, "unit": unit,
            "met": met, "status": STATUS[met], **extra}


def all_met(checks: Sequence[dict]) -> bool | None:
    """True or False when every check was measured, else None."""
    met = [c["met"] for c in checks]
    return all(met) if met and all(m is not None for m in met) else None


def reference_transport(transport: str) -> str:
    return "http" if transport == "inprocess" else "inprocess"


def _check(target: Target, transport: str, result: dict) -> dict[str, Any]:
    m = target.measure
    transport = target.transport or transport
    value = m.value(result, transport)
    met = None if value is None else value <= target.limit
    other = reference_transport(transport)
    return verdict(target.name, m.rule(target.limit), value, target.limit, m.unit, met,
                   transport=transport, reference_transport=other,
                   **{f"{other}_value": m.value(result, other)},
                   why_not_measured=None if value is not None else m.needs(transport))


def evaluate_targets(result: dict, sets: Sequence[TargetSet] = TARGET_SETS) -> dict[str, Any]:
    """The target sets that apply to ``result["model"]``, each target checked at p50."""
    model = result.get("model")
    applicable = [s for s in sets if s.applies_to(result)]
    out_sets = [{"name": s.name, "models": "every model" if s.models == EVERY_MODEL
                 else list(s.models), "origin": s.origin, "transport": s.transport,
                 "checks": [_check(t, s.transport, result) for t in s.targets]}
                for s in applicable]
    return {"model": model, "statistic": "p50", "sets": out_sets,
            "all_met": all_met([c for s in out_sets for c in s["checks"]])}


def all_checks(targets: dict) -> list[dict]:
    return [c for s in targets.get("sets", []) for c in s["checks"]]


# ``sensai bench-load``'s targets are stated for a soak of this long at this concurrency.
SOAK_TARGET_S = 600.0
SOAK_TARGET_CONCURRENCY = 16
RSS_GROWTH_LIMIT_PCT = 5.0
# A gateway that runs its subnets with ONNX Runtime on the CPU needs neither torch nor Ray in its
# process; this bound shows that it loads neither.
LEAN_GATEWAY_RSS_MB = 400.0


def lean_gateway_check(result: dict, growth: dict | None, soak_run: dict) -> list[dict]:
    """The resident-set bound of a local-backend gateway on ONNX Runtime on the CPU (no check
    for the other backends and runtimes, which load what they need)."""
    st = result["settings"]
    on_cpu = st["gateway"]["device"] == "cpu" or (st["gateway"]["device"] == "auto"
                                                   and not result["machine"].get("gpus"))
    if st["backend"] != "local" or st["gateway"]["runtime"] not in ("auto", "onnx") \
            or not on_cpu:
        return []
    rss = growth["baseline_mb"] if growth else None
    return [verdict("lean_gateway_rss", f"soak: a local ONNX gateway's RSS after warm-up <= "
                    f"{LEAN_GATEWAY_RSS_MB:g} MB", rss, LEAN_GATEWAY_RSS_MB, "MB",
                    None if rss is None else rss <= LEAN_GATEWAY_RSS_MB, **soak_run)]


def evaluate_load_targets(result: dict[str, Any]) -> dict[str, Any]:
    """``sensai bench-load``'s targets, and whether the run was the one each is stated for
    (otherwise its verdict is only indicative)."""
    st, phases = result["settings"], result["phases"]
    soak, over = phases.get("soak"), phases.get("overload", {})
    growth = (soak or {}).get("rss", {}).get("gateway")
    soak_run = {"conditions_met": st["soak_s"] >= SOAK_TARGET_S
                and st["concurrency"] == SOAK_TARGET_CONCURRENCY,
                "conditions": f"a soak of >= {SOAK_TARGET_S / 60:g} minutes at concurrency "
                              f"{SOAK_TARGET_CONCURRENCY} (this run: {st['soak_s']:g} s at "
                              f"concurrency {st['concurrency']})"}
    measured = over.get("requests") is not None
    offered, asked = over.get("offered_rate_rps"), over.get("target_rate_rps")
    polite = bool(over.get("retry_after_honoured"))
    over_run = {"conditions_met": bool(measured and offered and asked
                                       and (polite or offered >= 0.9 * asked)),
                "conditions": "the client offered >= 90 % of the rate asked, or honoured "
                              f"Retry-After (this run: {offered if offered is not None else '-'}"
                              f" of {asked or '-'} requests/s, Retry-After "
                              f"{'honoured' if polite else 'ignored'})"}
    deadline_ms = st["gateway"]["deadline_s"] * 1e3
    p99 = over.get("latency_ok_ms", {}).get("p99") if measured else None
    healthy = (result.get("health_after") or {}).get("healthy") if measured else None
    bad = over.get("not_200_or_503") if measured else None
    checks = [
        verdict("soak_errors", "soak: 0 errors (answers other than 200, requests without an "
                "answer)", soak["errors"] if soak else None, 0, "requests",
                soak["errors"] == 0 if soak else None, **soak_run),
        verdict("soak_rss_growth", f"soak: gateway RSS growth after warm-up < "
                f"{RSS_GROWTH_LIMIT_PCT:g} % (mean of the last {LAST_WINDOW_S:g} s vs the first "
                "sample after warm-up)", growth["growth_pct"] if growth else None,
                RSS_GROWTH_LIMIT_PCT, "%",
                growth["growth_pct"] < RSS_GROWTH_LIMIT_PCT if growth else None, **soak_run),
        *lean_gateway_check(result, growth, soak_run),
        verdict("overload_only_200_503", "overload: only 200 or 503 answers", bad, 0, "requests",
                None if bad is None else bad == 0, **over_run),
        verdict("overload_admitted_p99", "overload: p99 of the admitted (200) requests within "
                "the deadline", p99, deadline_ms, "ms", None if p99 is None else p99 <= deadline_ms,
                **over_run),
        verdict("healthy_after_overload", "overload: healthy afterwards (/v2/health/ready 200 "
                "and correct predictions)", healthy, True, "", healthy, **over_run),
    ]
    return {"checks": checks, "all_met": all_met(checks),
            "conditions_met": all(c["conditions_met"] for c in checks)}


# ``sensai bench-load --sweep``'s targets: ratios within one run, so the machine's speed cancels.
FLAGSHIP_MODEL = "vgg16_bn"
SWEEP_CONFIG = "class-parallel"  # the configuration the targets judge
BATCHING_C1_RATIO = 1.05  # p50 at 1 in flight with batching <= this x without
NOOP_SHARE_16 = 0.30  # throughput at 16 in flight >= this x the bare route's at 16
P99_16_OVER_P50_1 = 9.0
FLAGSHIP_P99_MS = 50.0
FLAGSHIP_VS_TRITON = 1.5
OVERLOAD_GOODPUT_SHARE = 0.90  # of the best closed-loop throughput
OVERLOAD_P99_OVER_P99_16 = 3.0
OVERLOAD_503_P99_MS = 50.0


def _level(config: dict | None, concurrency: int) -> dict | None:
    if not config or "levels" not in config:
        return None
    return next((r for r in config["levels"] if r["concurrency"] == concurrency), None)


def _ok(row: dict | None, key: str) -> float | None:
    """``latency_ok_ms[key]``, or ``throughput_rps`` for ``key`` "rps", of a level's row."""
    if row is None:
        return None
    return row["throughput_rps"] if key == "rps" else row["latency_ok_ms"][key]


def best_rps_within(config: dict | None, p99_ms: float) -> float | None:
    """The highest closed-loop throughput of a configuration at a p99 within ``p99_ms``
    (0 when no level kept it), None when it did not run."""
    if not config or "levels" not in config:
        return None
    return max((r["throughput_rps"] or 0.0 for r in config["levels"]
                if r["latency_ok_ms"]["p99"] is not None and r["latency_ok_ms"]["p99"] <= p99_ms),
               default=0.0)


def _ratio(a: float | None, b: float | None, nd: int = 4) -> float | None:
    return None if a is None or not b else round(a / b, nd)


def cores_ceiling(row: dict | None, usable_cores: int | None,
                  client_cores: int | None = None) -> float | None:
    """The answers per second a level's CPU per answer lets the machine's cores give, every one
    of them busy: the server's processes (gateways and workers) and the clients each need
    their CPU per answer; with the clients on ``client_cores`` cores of their own
    (``--set client_cores``), each side has only its own.  Whether a throughput short of a target
    is short of cores (the work per answer) or of packing (cores left idle); the GPU's own time
    is not in it.  None where the level did not measure its CPU."""
    cpu = (row or {}).get("server_cpu") or {}
    rps, clients = (row or {}).get("throughput_rps"), (row or {}).get("client_cores")
    if not rps or not usable_cores or clients is None or "gateway_ms_per_answer" not in cpu:
        return None
    server_ms = cpu["gateway_ms_per_answer"] + (cpu.get("workers_ms_per_answer") or 0.0)
    client_ms = clients / rps * 1e3
    if client_cores:
        sides = [(usable_cores - client_cores, server_ms), (client_cores, client_ms)]
        return min(cores * 1e3 / ms if ms > 0 else float("inf") for cores, ms in sides)
    return usable_cores * 1e3 / (server_ms + client_ms) if server_ms + client_ms > 0 else None


ONE_CALL_MARGIN_MS = 0.35  # what serving may add to one image's device call


def evaluate_sweep_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The sweep's targets for the class-parallel configuration with batching, each reported as
    met / not met / not measured with the condition it is stated for."""
    cfg = result["configs"]
    ours = cfg.get(SWEEP_CONFIG)
    unbatched, triton = cfg.get("class-parallel-unbatched"), cfg.get("triton")
    model = result.get("model")
    any_model = {"conditions_met": True, "conditions": "any artifact"}
    demo = {"conditions_met": model == DEMO_MODEL,
            "conditions": f"the demo artifact ({DEMO_MODEL}; this run: {model})"}
    flagship = {"conditions_met": model == FLAGSHIP_MODEL,
                "conditions": f"the flagship ({FLAGSHIP_MODEL}; this run: {model})"}

    def check(name: str, rule: str, value, limit, unit: str, at_least: bool, cond: dict,
              why: str) -> dict[str, Any]:
        met = None if value is None else (value >= limit if at_least else value <= limit)
        return verdict(name, rule, value, limit, unit, met, config=SWEEP_CONFIG,
                       why_not_measured=None if value is not None else why, **cond)

    c1 = _ok(_level(ours, 1), "p50")
    c1_unbatched = _ok(_level(unbatched, 1), "p50")
    rps16, p99_16 = _ok(_level(ours, 16), "rps"), _ok(_level(ours, 16), "p99")
    noop16 = (ours or {}).get("noop", {}).get("throughput_rps")
    pinned = (result.get("settings") or {}).get("clients_on_cores")
    ceiling16 = cores_ceiling(_level(ours, 16), (result.get("machine") or {}).get("usable_cores"),
                              len(pinned) if pinned else None)
    over = (ours or {}).get("overload") or {}
    closed_best = max((r["throughput_rps"] or 0.0 for r in (ours or {}).get("levels", [])),
                      default=None)
    over_p99 = (over.get("latency_ok_ms") or {}).get("p99")
    over_max = (over.get("latency_ok_ms") or {}).get("max")
    refused_p99 = (over.get("latency_rejected_ms") or {}).get("p99")
    deadline_ms = result["settings"]["gateway"]["deadline_s"] * 1e3
    ours_50 = best_rps_within(ours, FLAGSHIP_P99_MS)
    # Like with like: Triton's figure counts only over the transport class parallel had.
    triton_50 = (best_rps_within(triton, FLAGSHIP_P99_MS)
                 if (triton or {}).get("transport") == (ours or {}).get("transport") else None)
    noop_share = check("c16_vs_noop_route", f"16 in flight: throughput >= {NOOP_SHARE_16:g} x "
                       "the gateway's GET /v2/health/live at 16 in flight", _ratio(rps16, noop16),
                       NOOP_SHARE_16, "x", True, demo, "needs the level 16 and the bare route")
    noop_share["ceiling"] = _ratio(ceiling16, noop16)  # what the cores allow at that CPU
    checks = [
        check("batching_c1_p50_ratio", f"1 in flight: p50 with batching <= "
              f"{BATCHING_C1_RATIO:g} x p50 without (same run)", _ratio(c1, c1_unbatched),
              BATCHING_C1_RATIO, "x", False, any_model,
              "needs class-parallel and class-parallel-unbatched at 1 in flight"),
        noop_share,
        check("p99_c16_over_p50_c1", f"p99 at 16 in flight <= {P99_16_OVER_P50_1:g} x p50 at 1",
              _ratio(p99_16, c1, 3), P99_16_OVER_P50_1, "x", False, demo,
              "needs the levels 1 and 16"),
        check("flagship_vs_triton", f"highest throughput at p99 <= {FLAGSHIP_P99_MS:g} ms >= "
              f"{FLAGSHIP_VS_TRITON:g} x Triton's (dynamic batcher, the original)",
              _ratio(ours_50, triton_50, 3), FLAGSHIP_VS_TRITON, "x", True, flagship,
              "needs triton to have run over the same transport, and a level within the p99 "
              "bound on each"),
        check("overload_goodput_share", f"overload: goodput >= {OVERLOAD_GOODPUT_SHARE:g} x the "
              "best closed-loop throughput", _ratio(over.get("goodput_rps"), closed_best),
              OVERLOAD_GOODPUT_SHARE, "x", True, any_model, "needs the overload phase"),
        check("overload_admitted_p99", f"overload: p99 of the admitted (200) requests <= "
              f"{OVERLOAD_P99_OVER_P99_16:g} x the p99 at 16 in flight",
              _ratio(over_p99, p99_16, 3), OVERLOAD_P99_OVER_P99_16, "x", False, any_model,
              "needs the overload phase and the level 16"),
        check("overload_refused_p99", f"overload: p99 of the refused (503) requests <= "
              f"{OVERLOAD_503_P99_MS:g} ms", refused_p99, OVERLOAD_503_P99_MS, "ms", False,
              any_model, "needs an overload phase with 503s"),
        check("overload_within_deadline", "overload: no admitted (200) request answered later "
              "than the deadline after it was due", over_max, deadline_ms, "ms", False,
              any_model, "needs the overload phase"),
        *device_unit_checks(result, check),
    ]
    return {"config": SWEEP_CONFIG, "checks": checks, "all_met": all_met(checks),
            "conditions_met": all(c["conditions_met"] for c in checks)}


def device_unit_checks(result: dict[str, Any], check) -> list[dict[str, Any]]:
    """The sweep's targets of the device as the unit: one image (1 in flight)
    within a margin of the one-call reference; on a GPU, the class-parallel answers/s against
    the original's behind the same gateway (at least as many at 28x28, twice at 224x224)."""
    cfg = result["configs"]
    ours, single = cfg.get(SWEEP_CONFIG), cfg.get("single")
    ref = ((result.get("one_call") or {}).get("ms") or {}).get("p50")
    c1 = _ok(_level(ours, 1), "p50")
    side = min((result.get("input_shape") or [0, 0, 0])[1:] or [0])
    on_gpu = str((result.get("one_call") or {}).get("device", "")).startswith("cuda")
    want = 2.0 if side >= 224 else 1.0

    def best(config: dict | None) -> float | None:
        if not config or "levels" not in config:
            return None
        return max((r["throughput_rps"] or 0.0 for r in config["levels"]), default=None)

    return [
        check("c1_over_one_call_ms", f"1 in flight: p50 - p50(one call of every subnet, in "
              f"process) <= {ONE_CALL_MARGIN_MS:g} ms",
              None if c1 is None or not ref else round(c1 - ref, 4), ONE_CALL_MARGIN_MS, "ms",
              False, {"conditions_met": True, "conditions": "any artifact"},
              "needs the level 1 and the one-call reference"),
        check("gpu_vs_original_rps", f"on a GPU: best answers/s >= {want:g} x the original's "
              "behind the same gateway", _ratio(best(ours), best(single), 3), want, "x", True,
              {"conditions_met": on_gpu, "conditions": f"a GPU (this run: "
                                                       f"{(result.get('one_call') or {}).get('device')})"},
              "needs class-parallel and single swept"),
    ]

"""The benchmarks' targets, each reported as met / not met / not measured with its value (never
asserted): one table per benchmark, every row a :class:`Target`, all judged by one function.

A target is a :class:`Measure` (the rule in words, its unit, how its value is read from the
result, and what a result lacks when it is missing), a limit and a comparison, and for
``sensai bench-load`` (with or without ``--sweep``) the run it is stated for (otherwise its
verdict is only indicative).  ``sensai bench``'s targets come in :class:`TargetSet`\\ s, each
naming the model(s) it applies to and checked at p50 on the set's transport (HTTP: end to end,
what a caller sees) or on the target's own, with, for reference, the same measure on another
transport (in process, or HTTP for an in-process target).  Sets for other models are left out of
the result entirely, and so are sets comparing strategies or peers the run did not have.  To add
a target, add a row to a table; a new measure is a :class:`Measure` over the readers below.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sensai.models import DEMO_MODEL

from .load_measures import LAST_WINDOW_S
from .names import PEER_LABELS, label
from .plan_judge import rps_within
from .render import dig

# A figure of a result, read over a transport (ignored by the figures no transport has).
Reader = Callable[[dict, str], Any]
EVERY_MODEL = ("*",)
STATUS = {True: "met", False: "not met", None: "not measured"}
COMPARE = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, "==": operator.eq}


@dataclass(frozen=True)
class Measure:
    wording: str  # the rule, with {limit} where it states the limit
    unit: str
    value: Reader
    needs: str | None = None  # why it was not measured ({transport}); None: not reported

    def rule(self, limit) -> str:
        return self.wording.format(limit=format(limit, "g"))


@dataclass(frozen=True)
class Target:
    name: str
    measure: Measure
    limit: float | Reader  # a reader: the run's own (its deadline)
    transport: str | None = None  # sensai bench: None, the set's
    compare: str = "<="
    when: Callable[[dict], dict] | None = None  # the run it is stated for, and whether it was
    only_if: Callable[[dict], bool] | None = None  # left out of the result where False
    also: tuple[tuple[str, Reader], ...] = ()  # further figures reported beside the value


# Readers.  A p50 latency of 0 is no measurement (nothing was timed); other figures may be 0.

def _at(*path: str) -> Reader:
    """The figure at ``path`` (:func:`~.render.dig`; no path: the result itself), whatever the
    transport."""
    dotted = ".".join(path)
    return lambda result, over="": dig(result, dotted) if path else result


def _rep(result: dict, key: str, transport: str) -> dict | None:
    """A strategy's report over ``transport``, or a peer's (``--peers``: the keys differ)."""
    found = result.get("strategies", {}).get(key) or result.get("peers", {}).get(key) or {}
    return found.get("transports", {}).get(transport)


def _field(key: str, *path: str, transport: str | None = None) -> Reader:
    """A figure of ``key``'s report over the target's transport (or ``transport``)."""
    return lambda result, over: _at(*path)(_rep(result, key, transport or over) or {})


def _nonzero(read: Reader) -> Reader:
    return lambda result, over: read(result, over) or None


def _p50(key: str, transport: str | None = None) -> Reader:
    return _nonzero(_field(key, "latency_ms", "p50", transport=transport))


def _quotient(a: Reader, b: Reader, digits: int = 4) -> Reader:
    def read(result: dict, over: str) -> float | None:
        x, y = a(result, over), b(result, over)
        return None if x is None or not y else round(x / y, digits)
    return read


def _difference(a: Reader, b: Reader, digits: int = 4) -> Reader:
    def read(result: dict, over: str) -> float | None:
        x, y = a(result, over), b(result, over)
        return None if x is None or y is None else round(x - y, digits)
    return read


def _over_floor(result: dict, over: str) -> float | None:
    """In process there is no request, so the floor is 0."""
    key = ("latency_minus_compute" if over == "inprocess"
           else "latency_minus_floor_minus_compute")
    return _field("class-parallel", "breakdown_ms", "p50", key)(result, over)


def _accuracy_loss(result: dict, over: str) -> float | None:
    """The same for every transport: every transport merges the same scores with one rule."""
    delta = _at("accuracy", "delta_points")(result)
    return None if delta is None else round(-float(delta), 3)


def _overhead(key: str) -> Reader:
    """bench.json's ``comparison`` (``--peers``): latency - the same client's bare request - the
    compute of the same model(s) run alone, ms."""
    def read(result: dict, over: str) -> float | None:
        c = result.get("comparison") or {}
        rows = {r["key"]: r.get("overhead_ms") for r in c.get("rows", [])}
        return rows.get(key) if c.get("transport") == over else None
    return read


def _name(key: str) -> str:
    return PEER_LABELS[key] if key in PEER_LABELS else label(key).replace(" (sensAI)", "")


# ``sensai bench``'s measures.

def ratio(strategy: str, baseline: str) -> Measure:
    return Measure(f"p50({_name(strategy)}) <= {{limit}} x p50({_name(baseline)})", "x",
                   _quotient(_p50(strategy), _p50(baseline)),
                   f"needs {strategy} and {baseline} measured over {{transport}}")


def latency(strategy: str) -> Measure:
    return Measure(f"p50({_name(strategy)}) <= {{limit}} ms", "ms",
                   _field(strategy, "latency_ms", "p50"),
                   f"needs {strategy} measured over {{transport}}")


def against_peer(peer: str) -> Measure:
    """<= 0: the gateway adds no more than the peer does."""
    return Measure(f"overhead(class parallel) - overhead({PEER_LABELS[peer]}) <= {{limit}} ms "
                   "(latency - bare request - compute alone)", "ms",
                   _difference(_overhead("class-parallel"), _overhead(peer)),
                   f"needs --peers {peer} (measured over {{transport}})")


_NEEDS_CLASS_PARALLEL = "needs class-parallel measured over {transport}"
# What fan-out, merge and (over HTTP) the request cost on top of the slowest subnet's compute.
FANOUT_OVERHEAD = Measure(
    "p50(class-parallel latency - slowest subnet's compute) <= {limit} ms", "ms",
    _field("class-parallel", "breakdown_ms", "p50", "latency_minus_compute"),
    _NEEDS_CLASS_PARALLEL)
# Request by request, less the same client's bare request to the same server just before it:
# what the gateway's request path and the fan-out add on top of the transport's own floor.
OVER_FLOOR = Measure(
    "p50(class-parallel latency - bare GET - slowest subnet's compute) <= {limit} ms", "ms",
    _over_floor, _NEEDS_CLASS_PARALLEL)
ACCURACY_LOSS = Measure(  # negative: it gains
    "top-1(original) - top-1(decomposed) <= {limit} points", "points", _accuracy_loss,
    "needs the original's and the decomposed top-1 in the artifact's manifest")
# The largest subnet's parameters over the original's (lower is better like every other
# measure).
SHRINK = Measure(
    "largest subnet's params <= {limit} x the original's", "of the original's params",
    _quotient(lambda result, over: 1.0, _at("shrink", "params_ratio")),
    "needs the parameter counts in the artifact's manifest")
# The slowest subnet's CUDA-graph replay is the GPU's own time for one image: everything the
# host adds is on top of it.
OVER_GRAPH_REPLAY = Measure(
    "p50(class-parallel latency) - slowest subnet's graph replay <= {limit} ms", "ms",
    _difference(_p50("class-parallel"),
                _at("strategies", "class-parallel", "graph_replay_ms_max")),
    "needs class-parallel on CUDA graphs, measured over {transport}")
ADDED_OVER_INPROCESS = Measure(  # what the gateway and the wire add
    "p50(class parallel) - p50(class parallel in process) <= {limit} ms", "ms",
    _difference(_p50("class-parallel"), _p50("class-parallel", "inprocess")),
    "needs class-parallel measured in process and over {transport}")
# The one-call reference runs every subnet in one device call, in process, nothing else running
# (:mod:`.one_call`): what serving adds to the device's compute.
_ONE_CALL = _nonzero(_at("strategies", "class-parallel", "one_call", "ms", "p50"))
ONE_CALL_MARGIN_MS, ONE_CALL_RATIO_LIMIT = 0.35, 1.1
# A served request computes what the one call does and more, so a reference slower than it by
# more than the target's own margin was disturbed (another process on its cores): such a
# value would read "met" for the wrong reason, and is reported as not measured.
_DISTURBED = ("; a one-call reference slower than class parallel beyond the target's margin "
              "the other way was disturbed: rerun on a quiet machine")


def _unless_below(read: Reader, low: float) -> Reader:
    def checked(result: dict, over: str = "") -> float | None:
        value = read(result, over)
        return None if value is None or value < low else value
    return checked


_ONE_CALL_NEEDS = ("needs class-parallel measured over {transport} and its one-call reference"
                   + _DISTURBED)
OVER_ONE_CALL = Measure(
    "p50(class parallel) - p50(one call of every subnet) <= {limit} ms", "ms",
    _unless_below(_difference(_p50("class-parallel"), _ONE_CALL), -ONE_CALL_MARGIN_MS),
    _ONE_CALL_NEEDS)
ONE_CALL_RATIO = Measure(
    "p50(class parallel) <= {limit} x p50(one call of every subnet)", "x",
    _unless_below(_quotient(_p50("class-parallel"), _ONE_CALL), 1 / ONE_CALL_RATIO_LIMIT),
    _ONE_CALL_NEEDS)


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


_VS_SINGLE = ratio("class-parallel", "single")
TARGET_SETS: tuple[TargetSet, ...] = (
    TargetSet("class parallel against the baselines, at the original's accuracy",
              models=("vgg16_bn",), origin="sensAI's claim", targets=(
                  Target("class_parallel_vs_single", _VS_SINGLE, 0.35),
                  Target("class_parallel_vs_model_parallel",
                         ratio("class-parallel", "model-parallel"), 0.35),
                  Target("accuracy_loss_points", ACCURACY_LOSS, 0.5))),
    TargetSet("on a GPU: the flagship decomposed there", models=("vgg16_bn",), gpu=True,
              datasets=("fashion-mnist",),
              origin="sensAI on its own hardware", transport="inprocess", targets=(
                  Target("accuracy_loss_points", ACCURACY_LOSS, 0.5),
                  Target("largest_subnet_params", SHRINK, 0.1),
                  Target("over_graph_replay_ms", OVER_GRAPH_REPLAY, 0.05),
                  Target("http_v2_added_ms", ADDED_OVER_INPROCESS, 0.3, transport="http-v2"))),
    TargetSet("on a GPU at 224x224: compute, not launches", models=EVERY_MODEL, gpu=True,
              min_image_side=224, origin="sensAI on its own hardware", transport="inprocess",
              targets=(Target("class_parallel_vs_single", _VS_SINGLE, 0.4),)),
    TargetSet("the demo shows the gain", models=(DEMO_MODEL,), origin="the demo", targets=(
        Target("class_parallel_vs_single", _VS_SINGLE, 0.7),
        Target("accuracy_loss_points", ACCURACY_LOSS, 0.5))),
    TargetSet("the device as the unit: serving adds little to one call of every subnet",
              models=EVERY_MODEL, origin="a device runs its subnets in one call",
              transport="http-v2", targets=(
                  Target("over_one_call_http_v2_ms", OVER_ONE_CALL, ONE_CALL_MARGIN_MS),
                  Target("inprocess_vs_one_call", ONE_CALL_RATIO, ONE_CALL_RATIO_LIMIT,
                         transport="inprocess"))),
    TargetSet("the device as the unit on a GPU", models=EVERY_MODEL, gpu=True,
              origin="a device runs its subnets in one call", transport="inprocess", targets=(
                  Target("class_parallel_vs_single", _VS_SINGLE, 0.8),
                  Target("http_v2_p50_ms", latency("class-parallel"), 1.0,
                         transport="http-v2"))),
    TargetSet("fan-out overhead", models=EVERY_MODEL, origin="the gateway's cost", targets=(
        Target("fanout_overhead_ms", FANOUT_OVERHEAD, 1.5),)),
    TargetSet("overhead above each transport's floor", models=EVERY_MODEL,
              origin="the gateway's cost per transport", transport="http-v2", targets=(
                  Target("over_floor_http_v2_ms", OVER_FLOOR, 0.5),
                  Target("over_floor_png_upload_ms", OVER_FLOOR, 0.8, transport="http"),
                  Target("fanout_overhead_inprocess_ms", FANOUT_OVERHEAD, 0.15,
                         transport="inprocess"))),
    TargetSet("the Ray pool against the local one", models=EVERY_MODEL,
              origin="the Ray pool's cost", transport="http-v2", requires=("class-parallel@ray",),
              targets=(Target("ray_vs_local_pool", ratio("class-parallel@ray", "class-parallel"),
                              2.0),)),
    TargetSet("the Ray Serve application against the local pool", models=EVERY_MODEL,
              origin="the Serve application's cost", transport="http-v2",
              requires=("class-parallel@ray-serve",),
              targets=(Target("ray_serve_vs_local_pool",
                              ratio("class-parallel@ray-serve", "class-parallel"), 2.0),)),
    TargetSet("sensai against Triton serving the original", models=("vgg16_bn",),
              origin="what a user would pick instead", transport="http-v2",
              requires=("triton",), targets=(
                  Target("class_parallel_vs_triton_original", ratio("class-parallel", "triton"),
                         0.4),
                  Target("overhead_vs_triton_ms", against_peer("triton"), 0.0))),
)


def verdict(name: str, rule: str, value, limit, unit: str, met: bool | None,
            **extra) -> dict[str, Any]:
    """One target's row: its rule, value and limit, and whether it was met."""
    return {"name": name, "rule": rule, "value": value, "limit": limit, "unit": unit,
            "met": met, "status": STATUS[met], **extra}


def all_met(checks: Sequence[dict]) -> bool | None:
    """True or False when every check was measured, else None."""
    met = [c["met"] for c in checks]
    return all(met) if met and all(m is not None for m in met) else None


def all_checks(targets: dict) -> list[dict]:
    return [c for s in targets.get("sets", []) for c in s["checks"]]


def reference_transport(transport: str) -> str:
    return "http" if transport == "inprocess" else "inprocess"


def judge(target: Target, result: dict, over: str = "", **context) -> dict[str, Any]:
    """``target``'s row for ``result``: its verdict, then ``context`` (what it was judged on),
    why it was not measured, the run it is stated for and the further figures."""
    m = target.measure
    value = m.value(result, over)
    limit = target.limit(result, over) if callable(target.limit) else target.limit
    met = None if value is None else COMPARE[target.compare](value, limit)
    row = verdict(target.name, m.rule(limit), value, limit, m.unit, met, **context)
    if m.needs is not None:
        row["why_not_measured"] = None if value is not None else m.needs.format(transport=over)
    row.update(target.when(result) if target.when else {})
    row.update({key: read(result, over) for key, read in target.also})
    return row


def judge_all(targets: Sequence[Target], result: dict, **context) -> list[dict[str, Any]]:
    """The rows of the targets that apply to ``result``."""
    return [judge(t, result, **context) for t in targets
            if t.only_if is None or t.only_if(result)]


def _bench_row(target: Target, transport: str, result: dict) -> dict[str, Any]:
    transport = target.transport or transport
    other = reference_transport(transport)
    return judge(target, result, transport, transport=transport, reference_transport=other,
                 **{f"{other}_value": target.measure.value(result, other)})


def evaluate_targets(result: dict, sets: Sequence[TargetSet] = TARGET_SETS) -> dict[str, Any]:
    """The target sets that apply to ``result["model"]``, each target checked at p50."""
    out_sets = [{"name": s.name, "models": "every model" if s.models == EVERY_MODEL
                 else list(s.models), "origin": s.origin, "transport": s.transport,
                 "checks": [_bench_row(t, s.transport, result) for t in s.targets]}
                for s in sets if s.applies_to(result)]
    return {"model": result.get("model"), "statistic": "p50", "sets": out_sets,
            "all_met": all_met([c for s in out_sets for c in s["checks"]])}


# ``sensai bench-load``'s targets are stated for a soak of this long at this concurrency.
SOAK_TARGET_S = 600.0
SOAK_TARGET_CONCURRENCY = 16
_GROWTH, _OVER = ("phases", "soak", "rss", "gateway"), ("phases", "overload")


def _soak_run(result: dict) -> dict[str, Any]:
    st = result["settings"]
    return {"conditions_met": st["soak_s"] >= SOAK_TARGET_S
            and st["concurrency"] == SOAK_TARGET_CONCURRENCY,
            "conditions": f"a soak of >= {SOAK_TARGET_S / 60:g} minutes at concurrency "
                          f"{SOAK_TARGET_CONCURRENCY} (this run: {st['soak_s']:g} s at "
                          f"concurrency {st['concurrency']})"}


def _overload_run(result: dict) -> dict[str, Any]:
    over = _at(*_OVER)(result) or {}
    offered, asked = over.get("offered_rate_rps"), over.get("target_rate_rps")
    polite = bool(over.get("retry_after_honoured"))
    return {"conditions_met": bool(over.get("requests") is not None and offered and asked
                                   and (polite or offered >= 0.9 * asked)),
            "conditions": "the client offered >= 90 % of the rate asked, or honoured "
                          f"Retry-After (this run: {offered if offered is not None else '-'}"
                          f" of {asked or '-'} requests/s, Retry-After "
                          f"{'honoured' if polite else 'ignored'})"}


def _lean_gateway(result: dict) -> bool:
    """A local-backend gateway on ONNX Runtime on the CPU (the other backends and runtimes load
    what they need)."""
    st = result["settings"]
    on_cpu = st["gateway"]["device"] == "cpu" or (st["gateway"]["device"] == "auto"
                                                   and not result["machine"].get("gpus"))
    return st["backend"] == "local" and st["gateway"]["runtime"] in ("auto", "onnx") and on_cpu


def _overloaded(read: Reader) -> Reader:
    """A figure of the overload phase, where it sent requests."""
    def measured(result: dict, over: str = "") -> Any:
        sent = _at(*_OVER, "requests")(result) is not None
        return read(result, over) if sent else None
    return measured


def _deadline_ms(result: dict, over: str = "") -> float:
    return result["settings"]["gateway"]["deadline_s"] * 1e3


LOAD_TARGETS = (
    Target("soak_errors", Measure("soak: 0 errors (answers other than 200, requests without an "
                                  "answer)", "requests", _at("phases", "soak", "errors")),
           0, compare="==", when=_soak_run),
    Target("soak_rss_growth", Measure(
        f"soak: gateway RSS growth after warm-up < {{limit}} % (mean of the last "
        f"{LAST_WINDOW_S:g} s vs the first sample after warm-up)", "%",
        _at(*_GROWTH, "growth_pct")), 5.0, compare="<", when=_soak_run),
    # A gateway that runs its subnets with ONNX Runtime on the CPU needs neither torch nor Ray
    # in its process; this bound shows that it loads neither.
    Target("lean_gateway_rss", Measure(
        "soak: a local ONNX gateway's RSS after warm-up <= {limit} MB", "MB",
        _at(*_GROWTH, "baseline_mb")), 400.0, when=_soak_run, only_if=_lean_gateway),
    Target("overload_only_200_503", Measure("overload: only 200 or 503 answers", "requests",
                                            _overloaded(_at(*_OVER, "not_200_or_503"))),
           0, compare="==", when=_overload_run),
    Target("overload_admitted_p99", Measure(
        "overload: p99 of the admitted (200) requests within the deadline", "ms",
        _overloaded(_at(*_OVER, "latency_ok_ms", "p99"))), _deadline_ms, when=_overload_run),
    Target("healthy_after_overload", Measure(
        "overload: healthy afterwards (/v2/health/ready 200 and correct predictions)", "",
        _overloaded(_at("health_after", "healthy"))), True, compare="==", when=_overload_run),
)


def evaluate_load_targets(result: dict[str, Any]) -> dict[str, Any]:
    """``sensai bench-load``'s targets, and whether the run was the one each is stated for
    (otherwise its verdict is only indicative)."""
    return _conditional(judge_all(LOAD_TARGETS, result))


def _conditional(checks: list[dict]) -> dict[str, Any]:
    return {"checks": checks, "all_met": all_met(checks),
            "conditions_met": all(c["conditions_met"] for c in checks)}


# ``sensai bench-load --sweep``'s targets: ratios within one run, so the machine's speed cancels.
FLAGSHIP_MODEL = "vgg16_bn"
SWEEP_CONFIG = "class-parallel"  # the configuration the targets judge
FLAGSHIP_P99_MS = 50.0  # the latency bound its throughput against Triton's is taken within


def best_rps_within(config: dict | None, p99_ms: float | None) -> float | None:
    """The highest closed-loop throughput of a configuration at a p99 within ``p99_ms`` (None:
    any; 0 when no level kept it), None when it did not run."""
    return rps_within(config["levels"], p99_ms) if config and "levels" in config else None


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


def _level(config: str, concurrency: int, *path: str) -> Reader:
    """A figure of a configuration's closed loop at ``concurrency`` in flight (its row: no
    ``path``)."""
    def read(result: dict, over: str = "") -> Any:
        rows = _at("configs", config, "levels")(result) or []
        row = next((r for r in rows if r["concurrency"] == concurrency), None)
        return None if row is None else _at(*path)(row)
    return read


def _best_rps(config: str) -> Reader:
    """A configuration's highest closed-loop throughput (None when it did not run)."""
    return lambda result, over="": best_rps_within(_at("configs", config)(result), None)


def _within_flagship_p99(config: str) -> Reader:
    """Like with like: Triton's figure counts only over the transport class parallel had."""
    def read(result: dict, over: str = "") -> float | None:
        alike = (_at("configs", config, "transport")(result)
                 == _at("configs", SWEEP_CONFIG, "transport")(result))
        return best_rps_within(_at("configs", config)(result), FLAGSHIP_P99_MS) if alike else None
    return read


def _ceiling_16(result: dict, over: str = "") -> float | None:
    """What the cores allow at the CPU per answer of the level 16."""
    pinned = _at("settings", "clients_on_cores")(result)
    return cores_ceiling(_level(SWEEP_CONFIG, 16)(result), _at("machine", "usable_cores")(result),
                         len(pinned) if pinned else None)


def _any_artifact(result: dict) -> dict[str, Any]:
    return {"conditions_met": True, "conditions": "any artifact"}


def _artifact(what: str, model: str) -> Callable[[dict], dict]:
    return lambda result: {"conditions_met": result.get("model") == model,
                           "conditions": f"{what} ({model}; this run: {result.get('model')})"}


def _on_gpu(result: dict) -> dict[str, Any]:
    device = _at("one_call", "device")(result)
    return {"conditions_met": str(device or "").startswith("cuda"),
            "conditions": f"a GPU (this run: {device})"}


def _gpu_gain(result: dict, over: str = "") -> float:
    """At 224x224 the compute outweighs the launches: twice the original's answers/s."""
    side = min((result.get("input_shape") or [0, 0, 0])[1:] or [0])
    return 2.0 if side >= 224 else 1.0


_C1 = _level(SWEEP_CONFIG, 1, "latency_ok_ms", "p50")
_P99_16 = _level(SWEEP_CONFIG, 16, "latency_ok_ms", "p99")
_NOOP_16 = _at("configs", SWEEP_CONFIG, "noop", "throughput_rps")
_OVERLOAD = ("configs", SWEEP_CONFIG, "overload")
SWEEP_TARGETS = (
    Target("batching_c1_p50_ratio", Measure(
        "1 in flight: p50 with batching <= {limit} x p50 without (same run)", "x",
        _quotient(_C1, _level("class-parallel-unbatched", 1, "latency_ok_ms", "p50")),
        "needs class-parallel and class-parallel-unbatched at 1 in flight"),
        1.05, when=_any_artifact),
    Target("c16_vs_noop_route", Measure(
        "16 in flight: throughput >= {limit} x the gateway's GET /v2/health/live at 16 in flight",
        "x", _quotient(_level(SWEEP_CONFIG, 16, "throughput_rps"), _NOOP_16),
        "needs the level 16 and the bare route"), 0.3, compare=">=",
        when=_artifact("the demo artifact", DEMO_MODEL),
        also=(("ceiling", _quotient(_ceiling_16, _NOOP_16)),)),
    Target("p99_c16_over_p50_c1", Measure(
        "p99 at 16 in flight <= {limit} x p50 at 1", "x", _quotient(_P99_16, _C1, 3),
        "needs the levels 1 and 16"), 9.0, when=_artifact("the demo artifact", DEMO_MODEL)),
    Target("flagship_vs_triton", Measure(
        f"highest throughput at p99 <= {FLAGSHIP_P99_MS:g} ms >= {{limit}} x Triton's (dynamic "
        "batcher, the original)", "x",
        _quotient(_within_flagship_p99(SWEEP_CONFIG), _within_flagship_p99("triton"), 3),
        "needs triton to have run over the same transport, and a level within the p99 bound on "
        "each"), 1.5, compare=">=", when=_artifact("the flagship", FLAGSHIP_MODEL)),
    Target("overload_goodput_share", Measure(
        "overload: goodput >= {limit} x the best closed-loop throughput", "x",
        _quotient(_at(*_OVERLOAD, "goodput_rps"), _best_rps(SWEEP_CONFIG)),
        "needs the overload phase"), 0.9, compare=">=", when=_any_artifact),
    Target("overload_admitted_p99", Measure(
        "overload: p99 of the admitted (200) requests <= {limit} x the p99 at 16 in flight", "x",
        _quotient(_at(*_OVERLOAD, "latency_ok_ms", "p99"), _P99_16, 3),
        "needs the overload phase and the level 16"), 3.0, when=_any_artifact),
    Target("overload_refused_p99", Measure(
        "overload: p99 of the refused (503) requests <= {limit} ms", "ms",
        _at(*_OVERLOAD, "latency_rejected_ms", "p99"), "needs an overload phase with 503s"), 50.0,
        when=_any_artifact),
    Target("overload_within_deadline", Measure(
        "overload: no admitted (200) request answered later than the deadline after it was due",
        "ms", _at(*_OVERLOAD, "latency_ok_ms", "max"), "needs the overload phase"),
        _deadline_ms, when=_any_artifact),
)
# The device as the unit: one image (1 in flight) within a margin of the one-call reference; on
# a GPU, the class-parallel answers/s against the original's behind the same gateway.
DEVICE_UNIT_TARGETS = (
    Target("c1_over_one_call_ms", Measure(
        "1 in flight: p50 - p50(one call of every subnet, in process) <= {limit} ms", "ms",
        _unless_below(_difference(_C1, _nonzero(_at("one_call", "ms", "p50"))),
                      -ONE_CALL_MARGIN_MS),
        "needs the level 1 and the one-call reference" + _DISTURBED), ONE_CALL_MARGIN_MS,
        when=_any_artifact),
    Target("gpu_vs_original_rps", Measure(
        "on a GPU: best answers/s >= {limit} x the original's behind the same gateway", "x",
        _quotient(_best_rps(SWEEP_CONFIG), _best_rps("single"), 3),
        "needs class-parallel and single swept"), _gpu_gain, compare=">=", when=_on_gpu),
)


def device_unit_checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    return judge_all(DEVICE_UNIT_TARGETS, result, config=SWEEP_CONFIG)


def evaluate_sweep_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The sweep's targets for the class-parallel configuration with batching, each reported as
    met / not met / not measured with the condition it is stated for."""
    return {"config": SWEEP_CONFIG, **_conditional(
        [*judge_all(SWEEP_TARGETS, result, config=SWEEP_CONFIG), *device_unit_checks(result)])}

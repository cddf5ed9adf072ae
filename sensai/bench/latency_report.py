"""``sensai bench``'s report: the terminal table, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .comparison import TITLE
from .names import BARE_REQUESTS, TRANSPORT_LABELS, TRANSPORTS, label
from .render import (SHARED_CORES, Col, Panel, Table, draw, fmt, heading, human, markdown, mark,
                     md_table, one_call_device, quantiles)
from .targets import all_checks

STATUS_MD = {"met": "met", "not met": "NOT met", "not measured": "not measured"}
PALETTE = {"inprocess": "#4C72B0", "http": "#DD8452", "http-v2": "#C9A227", "grpc": "#2A9D8F"}


def _over(r: dict) -> float | None:
    b = r["breakdown_ms"]["p50"]
    # In process there is no request: the floor is 0.
    return b.get("latency_minus_floor_minus_compute") if r.get("floor_ms") else b.get(
        "latency_minus_compute")


LATENCY = Table(
    Col("strategy", "strategy"), Col("transport", "transport"), Col("workers", "workers"),
    *quantiles("latency_ms", "p50", "p90", "p99", "mean"),
    Col("img/s", "throughput.images_per_s", 1), Col("compute p50", "breakdown_ms.p50.compute"),
    Col("transport p50", "breakdown_ms.p50.transport"),
    Col("merge p50", "breakdown_ms.p50.merge", 3), Col("bare p50", "floor_ms.p50"),
    Col("p50(lat - bare - compute)", _over), Col("top-1", "top1", 4))
WHERE = Table(
    Col("strategy", "strategy"), Col("transport", "transport"), Col("latency", "latency_ms.mean"),
    Col("compute (critical path)", "breakdown_ms.mean.compute"),
    Col("dispatch (in predictor)", "breakdown_ms.mean.dispatch"),
    Col("request + decode (outside)", "breakdown_ms.mean.http"),
    Col("bare request (timed apart)", "floor_ms.mean"), Col("merge", "breakdown_ms.mean.merge", 3),
    Col("work done (all workers)", "compute_sum_ms.mean"))
WORKERS = Table(
    Col("strategy", "strategy"), Col("workers", "workers"),
    Col("params/worker (max)", lambda s: human(s["params_max_per_worker"])),
    Col("MACs/worker (max)", lambda s: human(s["flops_max_per_worker"])),
    Col("MACs total", lambda s: human(s["flops_total"])),
    Col("weights+act. MB/worker (max)", lambda s: max(
        (w["weights_mb"] + w["activations_mb"] for w in s["per_worker"]), default=None)),
    Col("RSS growth MB", "memory.rss_growth_mb"),
    Col("peak RSS growth MB", "memory.peak_rss_growth_mb"),
    Col("CUDA MB (torch peak / device)", lambda s: ", ".join(
        f"{d}: {v['torch_peak_mb']} / {v['device_used_mb']}"
        for d, v in s["memory"]["cuda"].items()) or "-"))


def _reference(c: dict) -> str:
    other = c.get("reference_transport") or ("inprocess" if c["transport"] == "http" else "http")
    return f"{fmt(c.get(other + '_value'), 3)} ({other})"


COMPARISON = Table(
    Col("system", "system"), Col("serves", "serves"), Col("pool", "pool"),
    Col("p50 ms", "p50_ms"), Col("p99 ms", "p99_ms"), Col("bare p50", "bare_p50_ms"),
    Col("compute ms (alone)", "compute_ms"), Col("overhead p50 ms", "overhead_ms"),
    Col("Triton p50 / p50", "triton_p50_over_p50"), Col("top-1", "top1", 4))
TARGETS = Table(
    Col("target set", "set"), Col("target", "rule"),
    Col("value", lambda c: f"{fmt(c['value'], 3)} ({c['transport']})"),
    Col("other transport (reference)", _reference),
    Col("status", lambda c: STATUS_MD[c["status"]]))


def _name(r: dict) -> str:
    """A strategy and transport in a plot's labels."""
    return label(r["key"]).replace(" (sensAI)", "").replace("sensAI, ", "") + "\n" + r["transport"]


def measured_transports(result: dict) -> list[str]:
    strategies = result.get("strategies", {}).values()
    return [t for t in TRANSPORTS if any(t in s.get("transports", {}) for s in strategies)]


def runs(result: dict, only: str | None = None) -> list[dict]:
    """One row per strategy and transport (``only``: that transport's rows)."""
    return [t | {"key": key, "strategy": label(key), "transport": tr, "workers": s.get("workers")}
            for key, s in result.get("strategies", {}).items()
            for tr, t in s.get("transports", {}).items() if only in (None, tr)]


def strategies(result: dict) -> list[dict]:
    return [s | {"strategy": label(key)} for key, s in result.get("strategies", {}).items()]


def accuracy_line(result: dict) -> str:
    a, s = result["accuracy"], result["shrink"]
    delta = f"{a['delta_points']:+.2f} points" if a["delta_points"] is not None else "-"
    return (f"accuracy (from the artifact, {a['measured_on']}): original top-1 "
            f"{fmt(a['original_top1'], 4)}, decomposed {fmt(a['decomposed_top1'], 4)} ({delta}); "
            f"largest subnet {fmt(s['params_ratio'])}x fewer params, "
            f"{fmt(s['flops_ratio'])}x fewer MACs than the original")


def render_table(result: dict, *, model_targets_only: bool = False) -> str:
    """The console summary; ``model_targets_only``: only the target sets named for the
    artifact's model (not those every model shares, which bench.md still reports)."""
    parts = [LATENCY.text(runs(result)), "", WORKERS.text(strategies(result)), "",
             accuracy_line(result), *untimed_lines(result), *side_by_side_lines(result),
             *shed_lines(result), *idle_lines(result)]
    if c := result.get("comparison"):
        parts += ["", f"{TITLE} ({c['transport']}):", COMPARISON.text(c["rows"]),
                  *_skipped(c), ""]
    targets = result.get("targets", {})
    if model_targets_only:
        targets = {**targets, "sets": [s for s in targets.get("sets", [])
                                       if s["models"] != "every model"]}
    for c in all_checks(targets):
        why = f" ({c['why_not_measured']})" if c["why_not_measured"] else ""
        parts.append(f"target {c['rule']} ({c['transport']}): {fmt(c['value'], 3)} -> "
                     f"{c['status'].upper()}{why}")
    return "\n".join(parts)


def _accuracy_section(result: dict) -> list[str]:
    a, s, m = result["accuracy"], result["shrink"], result["accuracy"].get("on_bench_images", {})
    delta = f"{a['delta_points']:+.2f}" if a["delta_points"] is not None else "-"
    rows = [["original model", fmt(a["original_top1"], 4), human(s["original"]["params"]),
             human(s["original"]["flops"]), fmt(m.get("original_top1"), 4)],
            [f"decomposed ({s['subnets']} subnets, merged)", fmt(a["decomposed_top1"], 4),
             f"{human(s['largest_subnet']['params'])} (largest subnet; "
             f"{human(s['params_all_subnets'])} in all)",
             f"{human(s['largest_subnet']['flops'])} (largest subnet; "
             f"{human(s['flops_all_subnets'])} in all)",
             fmt(m.get("decomposed_top1"), 4)]]
    trained = a.get("original_top1_at_training")
    return ["## Accuracy and size",
            md_table(["model", "top-1 (artifact)", "params", "MACs / image",
                      f"top-1 on the {m.get('images', '-')} bench images"], rows),
            f"Top-1 difference: {delta} points, measured by `sensai decompose` on "
            f"{a['measured_on']}."
            + (f" The original's top-1 recorded at training (whole test split): "
               f"{fmt(trained, 4)}." if trained is not None else "")
            + "\n" + f"The largest subnet has {fmt(s['params_ratio'])}x fewer parameters and "
            f"{fmt(s['flops_ratio'])}x fewer MACs than the original. The last column is this "
            "run's own answers on its images (PNG over HTTP is lossless: the same answers "
            "as in process)."]


def untimed_lines(result: dict) -> list[str]:
    """A line per strategy a transport of the run could not time, and why."""
    return [f"{label(key)} not timed {'in process' if t == 'inprocess' else 'over ' + t}: {why}"
            for key, s in result.get("strategies", {}).items()
            for t, why in (s.get("untimed_transports") or {}).items()]


def shed_lines(result: dict) -> list[str]:
    """A line per throughput run the server partly turned away (its admission shedding load:
    503, gRPC UNAVAILABLE); img/s counts only the answers."""
    return [f"throughput of {r['strategy']} over {r['transport']}: {thr['shed']} of "
            f"{thr['requests']} requests turned away by the server's admission at concurrency "
            f"{thr['concurrency']}; img/s counts the {thr['answered']} answered"
            for r in runs(result) if (thr := r.get("throughput") or {}).get("shed")]


def side_by_side_lines(result: dict) -> list[str]:
    """A line per class-parallel strategy: in what share of its requests, per transport, the
    subnets computed at the same time; the others ran one after the other on one core."""
    cores = result.get("machine", {}).get("usable_cores")
    out = []
    for key, s in result.get("strategies", {}).items():
        shares = [(t, rep["side_by_side"]["share"]) for t, rep in s.get("transports", {}).items()
                  if rep.get("side_by_side")]
        why = ("more subnets than cores" if cores and s["workers"] > cores
               else "the kernel put two workers on one core")
        if shares:
            out.append(f"{label(key)}: subnets side by side in "
                       + ", ".join(f"{share:.0%} of requests {t}" for t, share in shares)
                       + f" (the others computed one after the other: {why})")
    return out


def _summary_lines(result: dict) -> list[str]:
    """One sentence per transport comparing the strategies' p50 latency and throughput."""
    out = []
    for t in measured_transports(result):
        rep = {r["key"]: r for r in runs(result, t)}
        p50 = {k: r["latency_ms"]["p50"] for k, r in rep.items()}
        cp, single, mp, dp = (p50.get(k) for k in ("class-parallel", "single", "model-parallel",
                                                    "data-parallel"))
        parts = []
        if cp and single:
            parts.append(f"class parallel p50 is {cp / single:.2f}x the single device's")
        if cp and mp:
            parts.append(f"{cp / mp:.2f}x model parallel's")
        if dp and single:
            thr = [rep[k]["throughput"]["images_per_s"] for k in ("data-parallel", "single")]
            parts.append(f"data parallel p50 is {dp / single:.2f}x the single device's (one image "
                         f"is not cut up) for {thr[0] / thr[1]:.2f}x its throughput")
        if parts:
            title = "In process" if t == "inprocess" else TRANSPORT_LABELS[t]
            out.append(f"{title}: " + "; ".join(parts) + ".")
    return out


def _backends(settings: dict) -> list[str]:
    return settings.get("class_parallel_backends") or [settings["class_parallel_backend"]]


def _bare(t: str) -> str:
    """What a remote transport's floor is."""
    return (f"bare: the same client's `{BARE_REQUESTS[t]}` to the same server, timed just "
            "before each request")


def _latency_tables(result: dict) -> list[str]:
    """One table per transport, the strategies as rows."""
    out = []
    for t in measured_transports(result):
        floor = ("no request: the floor is 0, the last-but-one column is p50(latency - compute)"
                 if t == "inprocess" else f"{_bare(t)}; the last-but-one column is the p50, "
                 "request by request, of latency - bare - compute")
        out += [f"### {TRANSPORT_LABELS[t]} (`{t}`)",
                LATENCY.without("transport").md(runs(result, t)), f"{floor}."]
    return out


def _targets_section(result: dict) -> list[str]:
    t = result.get("targets", {})
    if not t.get("sets"):
        return ["## Targets (p50)", f"No target set applies to {result['model']}."]
    return ["## Targets (p50)", TARGETS.md(c | {"set": s["name"]} for s in t["sets"]
                                           for c in s["checks"]),
            "Only the target sets that apply to this artifact's model are listed."]


def idle_text(idle: dict | None, awake: dict | None = None) -> str:
    text = ""
    if idle:
        poll = idle.get("guest_halt_poll_ns")
        text = (f"; idle cores: cpuidle driver {idle['driver']}, governor {idle.get('governor')}"
                + (f", guest_halt_poll_ns {poll}" if poll is not None else ""))
    if awake:
        text += ("; idle cores kept awake for the run (wake-up latency "
                 f"{awake.get('latency_us')} us)" if awake.get("held")
                 else f"; idle cores not kept awake ({awake.get('detail')})")
    return text


def idle_lines(result: dict) -> list[str]:
    """A note when this machine's idle cores halted at once during the run, which every
    class-parallel request pays for in wake-ups: what its overhead must be read against."""
    machine = result.get("machine", {})
    idle = machine.get("cpu_idle") or {}
    if (machine.get("cores_awake") or {}).get("held") or idle.get("driver") != "haltpoll" \
            or idle.get("guest_halt_poll_ns") != 0:
        return []
    return ["Note: an idle core of this virtual machine halts at once (guest_halt_poll_ns 0; the "
            "kernel's default is 200000), so every wake-up of a sleeping worker or of the event "
            "loop goes through the hypervisor, and class parallel pays two or more of them per "
            "request. --set keep_cores_awake=on (as root) keeps idle cores polling for the "
            "run; see deploy/README.md, 'Latency'."]


def render_markdown(result: dict) -> str:
    return markdown(_intro(result), _accuracy_section(result), _latency_section(result),
                    _where_the_time_goes(result), _per_worker_section(result),
                    _targets_section(result), _closing_notes(result))


def _intro(result: dict) -> list[str]:
    """The title, the command, what was measured and how, and the machine."""
    m, st, v = result["machine"], result["settings"], result["machine"]["versions"]
    gpu = ", ".join(f"{x['name']} ({x['memory_gb']} GB)" for x in m["gpus"]) or "none"
    return [
        *heading(result, "bench", "run_bench(...)"),
        f"Artifact `{result['artifact']}`, {st['subnets']} subnets (groups {result['groups']}); "
        f"{st['images']} real test images at batch 1 and concurrency 1 in {st['rounds']} "
        f"interleaved rounds after {st['warmup']} warm-up requests per strategy and transport; "
        f"throughput: {st['throughput_requests']} requests at concurrency {st['concurrency']}. "
        f"Every worker: runtime {', '.join(st.get('runtime_resolved') or [st['runtime']])} "
        f"(--runtime {st['runtime']}) on {st['device_resolved']}, {st['threads_per_worker']} "
        f"thread(s). Class parallel: the predictor `sensai serve` builds (backend "
        f"{', '.join(_backends(st))}); the baselines run on worker threads."
        + _baseline_sizes(result),
        f"Machine: {m['cpu_model']}, {m['logical_cores']} logical cores "
        f"({m['usable_cores']} usable), {m['memory_gb']} GB; GPU: {gpu}; load average "
        f"{m.get('load_average')} at the start, {m.get('load_average_end')} at the end"
        f"{idle_text(m.get('cpu_idle'), m.get('cores_awake'))}. "
        f"torch {v.get('torch')}, onnxruntime {v.get('onnxruntime')}, numpy {v.get('numpy')}, "
        f"ray {v.get('ray')}, fastapi {v.get('fastapi')}, uvicorn {v.get('uvicorn')}, "
        f"python {v.get('python')}."]


def _baseline_sizes(result: dict) -> str:
    """The stages and replicas of the baselines that ran."""
    st, ran = result["settings"], result.get("strategies", {})
    sizes = [f"model parallel: {st['stages']} stages" if "model-parallel" in ran else None,
             f"data parallel: {st['replicas']} replicas" if "data-parallel" in ran else None]
    return "".join(f" {s[0].upper()}{s[1:]}." for s in sizes if s)


def _latency_section(result: dict) -> list[str]:
    """The latency tables, the notes on them, and what their columns mean."""
    return [
        "## Latency (ms, one image per request)", _latency_tables(result),
        [x + "." for x in untimed_lines(result) + side_by_side_lines(result)
         + shed_lines(result)],
        _summary_lines(result), _comparison_section(result.get("comparison")),
        "compute: the runners' own time measured inside the workers - the one run (single, "
        "data parallel), the sum of the stages (model parallel), the slowest subnet (class "
        "parallel: the floor). transport: latency - compute - merge (hand-offs to the workers, "
        "fan-out and gather; over HTTP/gRPC also the request, decoding and the answer). merge: "
        "outputs -> class scores (softmax, or merge_outputs for the subnets). http: the PNG "
        "upload to /v1/predict (JSON answer); http-v2: the KServe v2 binary tensor (binary "
        "answer); grpc: KServe v2 ModelInfer with raw tensor contents."]


def _skipped(c: dict) -> list[str]:
    return [f"skipped {key}: {why}" for key, why in c["skipped"].items()]


def _comparison_section(c: dict | None) -> list[str]:
    """The systems of ``sensai bench --peers`` (:mod:`.comparison`) in one table."""
    if not c:
        return []
    t = c["transport"]
    return [
        f"## {TITLE}", f"{TRANSPORT_LABELS[t]} (`{t}`): the same client process, images and "
        "interleaved rounds for every system.", COMPARISON.md(c["rows"]),
        f"{_bare(t)}. compute (alone): the same ONNX model(s) run alone on one worker in this "
        "process after the servers stopped - the original model, or the slowest subnet. "
        "overhead: the p50, request by request, of latency - bare, minus that compute: what the "
        "serving system adds. Triton p50 / p50: how many times faster than the Triton-served "
        "original model.", "\n".join(f"- {s}" for s in _skipped(c))]


def _where_the_time_goes(result: dict) -> list[str]:
    """The mean latency in parts, then class parallel's references: each subnet alone, one
    call of every subnet, the CUDA-graph replays."""
    cp = result["strategies"].get("class-parallel")
    replays = {key: replay for key in ("class-parallel", "single")
               if (replay := (result["strategies"].get(key) or {}).get("graph_replay_ms"))}
    return [
        "## Where the time goes (mean ms; the parts add up to the mean latency)",
        WHERE.md(runs(result)), _alone_line(result, cp), one_call_line(cp),
        [f"{label(key)}, CUDA-graph replay per image (the GPU's own time, CUDA events, each "
         "worker alone): " + ", ".join(f"{k} {fmt(v, 4)} ms" for k, v in replay.items()) + "."
         for key, replay in replays.items()]]


def _alone_line(result: dict, cp: dict | None) -> str | None:
    """Class parallel's subnets each timed alone, and the least the usable cores allow."""
    if not cp or not cp.get("isolated_compute_ms"):
        return None
    floor = cp.get("core_bound_floor_ms")
    return ("Class parallel, each subnet alone (no neighbour competing for the cores): p50 "
            f"compute of the slowest {fmt(cp['isolated_compute_ms_p50_max'])} ms, sum over "
            f"subnets {fmt(cp['isolated_compute_ms_p50_sum'])} ms"
            + (f"; with {result['machine']['usable_cores']} usable core(s) the subnets of one "
               f"image cannot all be done in less than {fmt(floor)} ms (the core-bound floor)"
               if floor is not None else "") + ".")


def _per_worker_section(result: dict) -> list[str]:
    """Each strategy's size and memory per worker, model parallel's cut, class parallel's
    nodes where they are several."""
    remote = [b for b in _backends(result["settings"]) if b != "local"]
    elsewhere = (" (with --backend " + ", ".join(remote) + ", class parallel's workers live in "
                 "other processes, which these figures do not see)" if remote else "")
    p = result.get("stage_plan")
    nodes = [w.get("node") for w in result["strategies"].get("class-parallel", {})
             .get("per_worker", [])]
    return [
        "## Per worker", WORKERS.md(strategies(result)),
        "MACs: multiply-accumulates of convolutions and linear layers per image "
        "(sensai.flops). weights+act.: float32 weights plus the largest set of activations "
        "alive at once (a lower bound of the runtime's working memory). Memory is per "
        "strategy, measured while it was loaded and warmed up: the workers are threads of "
        "this process, so the figures are the growth of its RSS and of its peak RSS (the "
        f"peak is reset before each strategy){elsewhere}.",
        p and f"Model-parallel cut: {p['num_stages']} stages after "
              f"{', '.join(p['boundaries']) or '-'} (MACs per stage "
              f"{', '.join(human(x) for x in p['stage_macs'])}; at most "
              f"{p['max_stages']} stages possible).",
        "Class parallel's workers' nodes (Ray node id, first 8 characters): "
        + ", ".join(f"{i}: {n[:8] if n else '-'}" for i, n in enumerate(nodes)) + "."
        if len({n for n in nodes if n}) > 1 else None]


def _closing_notes(result: dict) -> list[str]:
    """What the figures must be read against: workers waiting for a core, idle cores that
    halt at once, a machine shared with other work."""
    m, st = result["machine"], result["settings"]
    busiest = max((s["workers"] for s in result["strategies"].values()), default=0)
    cores = m.get("usable_cores")
    return [
        f"Note: up to {busiest} workers x {st['threads_per_worker']} thread(s) shared "
        f"{cores} usable cores, so the workers of one request waited for a core; that wait "
        "counts as transport (dispatch), and a worker's compute time includes time its thread "
        "was preempted. The 'each subnet alone' figures above show the compute without that "
        "competition." if cores and not m["gpus"] and busiest * st["threads_per_worker"] > cores
        else None,
        idle_lines(result), SHARED_CORES]


def plot(result: dict, path: Path) -> None:
    """Latency distribution per strategy and transport, and the mean latency split in parts
    (over a remote transport, the request's part split at its floor, the bare request)."""
    order = runs(result)  # by strategy, then transport (measured in the canonical order)
    timed = [r for r in order if r.get("latencies_ms")]
    means = [r["breakdown_ms"]["mean"] for r in order]
    outside = [max(0.0, b["http"] or 0) for b in means]
    bare = [min(o, (r.get("floor_ms") or {}).get("mean") or 0.0) for o, r in zip(outside, order)]
    parts = (([b["compute"] or 0 for b in means], "compute (critical path)", "#55A868"),
             ([max(0.0, b["dispatch"] or 0) for b in means], "dispatch / fan-out", "#C44E52"),
             ([b["merge"] or 0 for b in means], "merge", "#8172B2"),
             (bare, "bare request (the transport's floor)", "#BBBBBB"),
             ([o - f for o, f in zip(outside, bare)], "request + decode beyond the floor",
              "#937860"))
    at = np.arange(len(order))
    draw(path, [
        Panel([mark("box", [r["latencies_ms"] for r in timed], [_name(r) for r in timed],
                    [PALETTE[r["transport"]] for r in timed])],
              f"{result['model']}: latency at concurrency 1",
              "latency per image (ms), whiskers: the farthest samples within p1-p99",
              grid={"axis": "x", "alpha": 0.3}),
        Panel([mark("stack", at, [(v, {"label": part, "color": c}) for v, part, c in parts],
                    horizontal=True)],
              "where the time goes", "mean ms per image", legend={"fontsize": 8, "loc": "best",
                                                             "framealpha": 0.6},
              grid={"axis": "x", "alpha": 0.3}, yticks=(at, [_name(r) for r in order]))],
        (13, max(4.8, 1.5 + 0.38 * len(order))), 1, 2)


def signed(v: float) -> str:
    """``+1.2`` or ``-1.2`` (a reference slower than what it judges shows as such)."""
    return ("+" if v >= 0 else "-") + fmt(abs(v))


def one_call_line(cp: dict | None) -> str | None:
    """The one-call reference (:mod:`.one_call`) beside class parallel: its latency, and how
    far class parallel's own p50 is from it on each transport."""
    one = (cp or {}).get("one_call")
    if not one or not one["ms"]["p50"]:
        return None
    ref = one["ms"]["p50"]
    gaps = [f"{t} {signed(rep['latency_ms']['p50'] - ref)} ms"
            for t, rep in cp.get("transports", {}).items() if rep["latency_ms"]["p50"]]
    replay = (f"; its one CUDA graph replays in {fmt(one['graph_replay_ms'], 4)} ms"
              if one.get("graph_replay_ms") else "")
    return (f"One call of every subnet ({one['subnets']} on one device: {one_call_device(one)}; "
            "in process, nothing else running): "
            f"p50 {fmt(ref)} ms, p99 {fmt(one['ms']['p99'])} ms{replay}. Class parallel's p50 "
            "over it: " + (", ".join(gaps) or "-") + ".")

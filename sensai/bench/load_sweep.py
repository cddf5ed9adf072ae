"""``sensai bench-load --sweep``: a throughput-latency sweep of several serving configurations.

For each configuration a server starts on 127.0.0.1 (:mod:`.server`) - ``sensai serve`` in its
own process, or Triton - and the same client
processes (:mod:`.client`) drive it with :class:`~.load.LoadRun`, bench-load's own harness: a
warm-up, closed loops at each concurrency level, the server's bare ``GET /v2/health/live`` at
:data:`NOOP_CONCURRENCY` in flight (the floor a predict request cannot go below), then an
open-loop overload at a multiple of the best closed-loop throughput.  Every 200 answer is
checked against offline evaluation's top-1 of the model that configuration serves.  The client
processes' own CPU and the machine's busy cores are recorded per level: on a small machine the
client competes with the server.  Targets: :func:`~.targets.evaluate_sweep_targets`.  Outputs:
``load.json``, ``load.md``, ``load.png`` and one log per server.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sensai.artifact import load_artifact
from sensai.errors import CheckpointError, SensaiError

from .client import HttpClientProcess
from .harness import envelope, finish, inputs, load_test_images
from .load import (LoadRun, check_options, client_processes, gateway_settings,
                   offline_top1, request_timeout, seconds_bar, sensai_serve)
from .load_single import original_as_artifact
from .machine import split_cores, tree_rss
from .load_sweep_report import plot, render_markdown
from .names import SWEEP_CONFIGS, SWEEP_TRANSPORTS
from .perf_analyzer import PerfAnalyzer, for_sweep, missing, sweep_settings
from .one_call import one_call_reference
from .options import LoadOptions, LoadPlan
from .server import Server, served, start_peer, unavailable
from .targets import evaluate_sweep_targets

CONFIGS = SWEEP_CONFIGS
CONFIG_LABELS = {"class-parallel": "class parallel (sensAI), batching",
                 "class-parallel-unbatched": "class parallel (sensAI), no batching",
                 "single": "single device (the original), batching",
                 "triton": "Triton, the original, dynamic batcher"}
# Gateway settings that make a configuration (added to the run's own).
CONFIG_ENV = {"class-parallel-unbatched": {"SENSAI_BATCH_MAX_ROWS": "1"}}
PERF_ANALYZER_MODES = ("also", "only")  # beside bench-load's own client, or instead of it
NOOP_CONCURRENCY = 16
WARMUP_CONCURRENCY = 16


def check_sweep_settings(options: LoadOptions, *, configs: Sequence[str],
                         levels: Sequence[int], level_s: float, warmup_s: float,
                         overload_s: float, transport: str | None,
                         perf_analyzer: str | None = None) -> None:
    # The values are LoadPlan's or PlanOptions' (sensai plan), declared with the same bounds.
    plan = LoadPlan(sweep=True, levels=tuple(levels), level_seconds=level_s,
                    warmup_seconds=warmup_s, overload_seconds=overload_s)
    check_options(
        options, plan,
        choices=(("configuration", configs, CONFIGS),
                 *((("--perf-analyzer mode", [perf_analyzer], PERF_ANALYZER_MODES),)
                   if perf_analyzer is not None else ())))
    if perf_analyzer == "only" and missing():
        raise SensaiError(f"--perf-analyzer only: {missing()}")
    if not levels:
        raise SensaiError("--levels needs at least one concurrency")
    if transport is not None and transport not in SWEEP_TRANSPORTS:
        raise SensaiError(f"unknown transport {transport!r}; choose one of "
                          f"{', '.join(SWEEP_TRANSPORTS)}")


def sweep_transport(configs: Sequence[str], transport: str | None, triton_runs: bool) -> str:
    """One transport for every configuration, so they compare like with like: Triton takes only
    tensors, so KServe v2 binary tensors when it runs; else PNG uploads (what a camera sends)."""
    if transport is not None:
        return transport
    return "http-v2" if "triton" in configs and triton_runs else "http"


def level_row(rep: dict[str, Any], usable_cores: int | None) -> dict[str, Any]:
    """A closed-loop phase as one row of the sweep (no timeline)."""
    row = {k: v for k, v in rep.items() if k != "timeline"}
    cores = rep.get("client_cores")
    row["client_cpu_share"] = (round(cores / usable_cores, 4)
                               if cores is not None and usable_cores else None)
    return row


def overload_row(rep: dict[str, Any], best_rps: float) -> dict[str, Any]:
    row = {k: v for k, v in rep.items() if k != "timeline"}
    row.update(goodput_rps=rep["throughput_rps"],
               rejected_503=rep["status_counts"].get("503", 0),
               goodput_of_best_closed=(round(rep["throughput_rps"] / best_rps, 4)
                                       if best_rps and rep["throughput_rps"] is not None
                                       else None))
    return row


COUNTERS = ("batches", "requests", "rows", "largest", "held", "mixed")
ASKS_PER_GATEWAY = 16


def batching_counters(url: str, gateways: int = 1) -> list[dict] | None:
    """Each worker's batching counters, from the gateway's ``GET /v1/models`` (None when its
    workers do not batch, as the Ray Serve application's replicas may not).  With several
    gateway processes each knows a device process's counters as of its own last request there,
    so it asks on connections of its own (the kernel spreads them) until every one of the
    ``gateways`` processes has answered (at most ``ASKS_PER_GATEWAY`` times each), and keeps
    the largest figure of each: a stale process's figures alone would count rows from before."""
    best: dict[str, dict] = {}
    heard: set = set()
    for _ in range(ASKS_PER_GATEWAY * max(1, gateways)):
        body = served(url)
        heard.add(body.get("pid"))
        for w in (body.get("predictor") or {}).get("workers") or []:
            if not (isinstance(w, dict) and w.get("batching")):
                continue
            seen = best.setdefault(w.get("name"), {"name": w.get("name"), **w["batching"]})
            for k in COUNTERS:
                seen[k] = max(seen.get(k) or 0, w["batching"].get(k) or 0)
        if len(heard) >= gateways:
            break
    return list(best.values()) or None


def rows_per_batch(before: list[dict] | None, after: list[dict] | None) -> list[dict] | None:
    """Each worker's (subnet's) batches over a level: rows, requests and batches, and rows per
    batch (from its counters before and after)."""
    if not after:
        return None
    was = {w["name"]: w for w in before or []}
    out = []
    for w in after:
        b = was.get(w["name"], {})
        d = {k: (w.get(k) or 0) - (b.get(k) or 0) for k in ("batches", "requests", "rows")}
        d["rows_per_batch"] = round(d["rows"] / d["batches"], 2) if d["batches"] > 0 else None
        out.append({"name": w["name"], **d})
    return out


def server_core_count(client_cores: int) -> int:
    """The cores the server may run on: those ``client_cores`` leaves it (see
    :func:`~sensai.bench.machine.split_cores`), else every core this process may use."""
    server_cores = split_cores(client_cores)[0]
    return len(server_cores) if server_cores else len(os.sched_getaffinity(0))


def server_gateways(gs, client_cores: int) -> int:
    """The gateway processes the server starts: it counts the cores it may run on, not this
    process's."""
    return gs.gateway_processes(server_core_count(client_cores))


def sweep_clients(options: LoadOptions, imgs, spec):
    """The client processes (:func:`~.load.client_processes`), holding the test images as PNGs
    and as tensors."""
    tensors = [x.astype(np.float32).tobytes() for x in imgs.xs]
    return client_processes(options.clients, imgs.pngs, tensors, [1, *spec.input_shape],
                            cores=split_cores(options.client_cores)[1])


class Sweep:
    """One configuration after another on the same client processes."""

    def __init__(self, options: LoadOptions, *, out: Path, procs: list[HttpClientProcess],
                 levels: Sequence[int], level_s: float, warmup_s: float, overload_s: float,
                 gs, transport: str, usable_cores: int | None, bar,
                 perf: PerfAnalyzer | None = None, own_client: bool = True,
                 bare_route: bool = True):
        self.options, self.out, self.procs, self.levels = options, out, procs, list(levels)
        self.level_s, self.warmup_s, self.overload_s = level_s, warmup_s, overload_s
        self.overload_factor, self.progress = options.overload_factor, options.progress
        self.gs, self.timeout_s, self.transport = gs, request_timeout(gs), transport
        self.usable_cores, self.bar = usable_cores, bar
        self.perf, self.own_client = perf, own_client
        self.bare_route = bare_route  # off: no GET /v2/health/live phase (sensai plan)

    def use(self, gs) -> None:
        """The settings of the server measured next (its request timeout, its gateway count
        for the batching counters)."""
        self.gs, self.timeout_s = gs, request_timeout(gs)

    def measure(self, key: str, server: Server, expected: list[int], transport: str,
                label: str | None = None) -> dict[str, Any]:
        """Warm-up, the closed-loop levels, the bare route, the overload, on one server; a
        gateway's process tree's memory after each level."""
        rep: dict[str, Any] = {"label": label or CONFIG_LABELS[key], "transport": transport}
        model, gateway = server.model, server.gateway
        if not self.own_client:
            return self.perf_analyzer(rep | {"transport": "http-v2"}, key, server.url, model)
        request = {"transport": transport, "model": model}
        run = LoadRun(server, self.procs, expected=expected, concurrency=WARMUP_CONCURRENCY,
                      timeout_s=self.timeout_s, sample_s=self.level_s, bar=self.bar,
                      progress=self.progress, request=request)
        if self.warmup_s > 0:
            run.closed(f"{key}: warm-up", self.warmup_s)
        gateways = server_gateways(self.gs, self.options.client_cores)
        rep["levels"] = []
        for c in self.levels:
            before = batching_counters(server.url, gateways) if gateway else None
            row = level_row(run.closed(f"{key}: {c} in flight", self.level_s, c),
                            self.usable_cores)
            if gateway:
                row["batching"] = rows_per_batch(before, batching_counters(server.url, gateways))
                row["server_tree_rss_mb"] = round(tree_rss(server.pid)[0] / 1e6, 1)
            rep["levels"].append(row)
        # Right after bench-load's own levels, before the overload leaves the server shedding.
        self.perf_analyzer(rep, key, server.url, model)
        if not self.bare_route:
            return rep
        rep["noop"] = level_row(run.closed(f"{key}: GET /v2/health/live", self.level_s,
                                           NOOP_CONCURRENCY, bare=True), self.usable_cores)
        best = max((r["throughput_rps"] or 0.0 for r in rep["levels"]), default=0.0)
        if self.overload_s > 0 and best > 0:
            rep["overload"] = overload_row(run.overload(
                self.overload_s, self.overload_factor * best, self.gs, self.options.retry_after),
                best)
        else:
            rep["overload"] = {"skipped": "--set overload_seconds=0" if self.overload_s <= 0 else
                               "no closed loop answered, so there is no rate to multiply"}
        if gateway:
            rep["batching"] = batching_counters(server.url, gateways)
        return rep

    def perf_analyzer(self, rep: dict[str, Any], key: str, url: str, model: str
                      ) -> dict[str, Any]:
        """perf_analyzer at each level (when asked), its rows in ``rep["perf_analyzer"]``."""
        if self.perf is None:
            return rep
        rows = []
        for c in self.levels:
            self.bar.set_description(f"{key}: perf_analyzer, {c} in flight")
            rows.append(self.perf.level(url, model, c, key))
            if self.progress:
                r = rows[-1]
                self.bar.write(f"{key}: perf_analyzer at {c} in flight: " + (
                    r["error"] if "error" in r else
                    f"{r['throughput_infer_per_s']:g} infer/s, p50/p99 "
                    f"{r['p50_us'] / 1e3:.2f}/{r['p99_us'] / 1e3:.2f} ms"))
        rep["perf_analyzer"] = rows
        return rep

    def serve(self, key: str, kind: str, source: Path, expected: list[int], *,
              label: str | None = None, threads: int = 1, env: dict[str, str] | None = None,
              args: Sequence[str] = ()) -> dict[str, Any]:
        """The configuration ``key``: a server of ``kind`` serving ``source`` (``sensai``:
        with ``env`` and ``args``, its log in ``gateway-KEY.log``; a peer: with ``threads``)
        started, measured, stopped; a peer that cannot run here is skipped with its reason."""
        self.bar.set_description(f"{key}: starting {kind}")
        if kind == "sensai":
            server: Server | str = sensai_serve(
                self.options, source, env or {}, self.out / f"gateway-{key}.log",
                model=self.gs.model_name, args=args)
        else:
            server = start_peer(kind, source, threads=threads)
            if isinstance(server, str):
                return {"label": CONFIG_LABELS[key], "skipped": server}
        with server:
            # A peer takes tensors only (the run's transport is http-v2 unless asked otherwise).
            rep = self.measure(key, server, expected, label=label,
                               transport=self.transport if server.gateway else "http-v2")
        rep["server"] = (server.record() | {"sampled": server.sampled()} if server.gateway
                         else server.info)
        return rep


def run_load_sweep(artifact_dir: str | Path, out_dir: str | Path, options: LoadOptions,
                   plan: LoadPlan) -> dict[str, Any]:
    """The sweep of ``plan.configs`` (of :data:`CONFIGS`) at ``plan.levels`` in flight,
    ``plan.level_seconds`` each (the warm-up and overload seconds the sweep's where None);
    writes load.json, load.md, load.png (and a log per server) to ``out_dir`` and returns what
    load.json holds.  ``plan.transport``: ``http`` (PNG uploads) or ``http-v2`` (KServe v2
    binary tensors) for every configuration (default: :func:`sweep_transport`).  ``options``:
    what the sweep shares with bench-load's soak, the gateway's settings among them; a
    configuration that cannot run here is recorded with its reason.  ``plan.perf_analyzer``:
    ``also`` (beside bench-load's own client) or ``only`` (instead of it) drive every
    configuration with NVIDIA's perf_analyzer at each level (:class:`.PerfAnalyzer`; ``also``
    where it is not on PATH: a warning, and the sweep runs without it)."""
    plan = replace(plan, sweep=True, configs=tuple(dict.fromkeys(plan.configs)),
                   levels=tuple(sorted(set(plan.levels)))).resolved()
    check_sweep_settings(options, configs=plan.configs, levels=plan.levels,
                         level_s=plan.level_seconds, warmup_s=plan.warmup_seconds,
                         overload_s=plan.overload_seconds, transport=plan.transport,
                         perf_analyzer=plan.perf_analyzer)
    gs, gateway_env = gateway_settings(options)
    artifact = load_artifact(artifact_dir)
    spec, out = inputs(artifact, options.data_dir, out_dir)
    t_start = time.perf_counter()
    imgs = load_test_images(spec, options.images, options.seed, png=True)
    original, full_onnx, results = prepare_original(artifact, plan.configs,
                                                    out / "original", imgs, gs)
    plan = replace(plan, transport=sweep_transport(plan.configs, plan.transport,
                                                   "triton" not in results))
    expected = offline_top1(artifact, imgs.xs, gs)
    expected_original = offline_top1(original, imgs.xs, gs) if original is not None else None
    perf = for_sweep(plan.perf_analyzer, imgs.xs, out, plan.level_seconds)
    result = envelope("sensai-bench-load-sweep", command=options.command, artifact=artifact,
                      spec=spec, settings=run_settings(plan, options, gs, gateway_env,
                                                       images=len(imgs), perf=perf))
    result["offline_top1"] = round(float(np.mean(np.asarray(expected) == imgs.labels)), 5)
    bar = seconds_bar(options, "bench-load --sweep")
    if any(key.startswith("class-parallel") for key in plan.configs):
        # Before any server starts: the device's compute alone, nothing competing for it.
        bar.set_description("one call of every subnet, in process")
        result["one_call"] = one_call_reference(
            artifact, imgs.xs, device=gs.device, runtime=gs.runtime_kind,
            threads=gs.threads_per_worker, sim_launch_ms=gs.sim_launch_ms)
    try:
        with sweep_clients(options, imgs, spec) as procs:
            sweep = Sweep(options, out=out, procs=procs, levels=plan.levels,
                          level_s=plan.level_seconds, warmup_s=plan.warmup_seconds,
                          overload_s=plan.overload_seconds, gs=gs, transport=plan.transport,
                          usable_cores=result["machine"].get("usable_cores"), bar=bar,
                          perf=perf, own_client=plan.perf_analyzer != "only")
            for key in (k for k in plan.configs if k not in results):
                if key == "triton":
                    results[key] = sweep.serve(key, key, full_onnx, expected_original,
                                               threads=gs.threads_per_worker)
                else:
                    single = key == "single"
                    results[key] = sweep.serve(
                        key, "sensai", original.root if single else artifact.root,
                        expected_original if single else expected,
                        env=gateway_env | CONFIG_ENV.get(key, {}))
    finally:
        bar.close()
    result["configs"] = {key: results[key] for key in plan.configs}
    result["targets"] = evaluate_sweep_targets(result)
    finish(out, "load", result, t_start, render_markdown, plot)
    return result


def prepare_original(artifact, configs: Sequence[str], original_dir: Path, imgs, gs
                     ) -> tuple[Any, Path | None, dict[str, Any]]:
    """The original model as a one-group artifact and its ONNX file, where ``single`` or
    ``triton`` serves it (else None), and the reports of the configurations that cannot run
    here, each with its reason."""
    results: dict[str, Any] = {}
    original = full_onnx = None
    if {"single", "triton"} & set(configs):
        try:
            original, full_onnx = original_as_artifact(artifact, original_dir,
                                                       check_batch=imgs.batch(8))
        except CheckpointError as e:
            for key in {"single", "triton"} & set(configs):
                results[key] = {"label": CONFIG_LABELS[key],
                                "skipped": f"needs the original model: {e}"}
    if "triton" in configs and "triton" not in results and gs.runtime_kind == "sim":
        results["triton"] = {"label": CONFIG_LABELS["triton"],
                             "skipped": "the sim runtime simulates sensai's own workers only"}
    if "triton" in configs and "triton" not in results:
        reason = unavailable("triton")
        if reason:
            results["triton"] = {"label": CONFIG_LABELS["triton"],
                                 "skipped": " ".join(reason.split())}
    return original, full_onnx, results


def run_settings(plan: LoadPlan, options: LoadOptions, gs, gateway_env: dict[str, str], *,
                 images: int, perf: PerfAnalyzer | None) -> dict[str, Any]:
    """load.json's ``settings``."""
    return {
        "backend": gs.backend, "configs": list(plan.configs), "levels": list(plan.levels),
        "level_s": plan.level_seconds, "warmup_s": plan.warmup_seconds,
        "warmup_concurrency": WARMUP_CONCURRENCY, "overload_s": plan.overload_seconds,
        "overload_factor": options.overload_factor,
        "overload_retry_after": "honoured" if options.retry_after else "ignored",
        "noop_concurrency": NOOP_CONCURRENCY,
        "clients": options.clients, "images": images, "seed": options.seed,
        "clients_on_cores": split_cores(options.client_cores)[1],
        "transport": plan.transport, "request_timeout_s": request_timeout(gs),
        "gateway": {"deadline_s": gs.deadline_s, "max_requests": gs.max_requests,
                    "max_predictions": gs.max_predictions,
                    "latency_target_s": gs.latency_target_s, "batch_max_rows": gs.batch_max_rows,
                    "batch_delay_us": gs.batch_delay_us,
                    "threads_per_worker": gs.threads_per_worker, "runtime": gs.runtime_kind,
                    "sim_launch_ms": gs.sim_launch_ms if gs.runtime_kind == "sim" else None,
                    "gpu_wait": gs.gpu_wait,
                    "device": gs.device,
                    "gateway_processes": server_gateways(gs, options.client_cores)},
        "gateway_env": gateway_env, "config_env": CONFIG_ENV,
        "perf_analyzer": sweep_settings(plan.perf_analyzer, perf),
    }

"""``sensai bench-load``'s one run: the soak, and with ``--sweep`` a throughput-latency sweep of
several serving configurations; both put each server through the same phases
(:meth:`Sweep.measure`), configured by :class:`~.options.LoadPlan`.

For each configuration a server starts on 127.0.0.1 (:mod:`.server`) - ``sensai serve`` in its
own process, or Triton - and the same client processes (:mod:`.client`) drive it with
:class:`~.load.LoadRun`: a warm-up, closed loops (the soak: one, at ``--concurrency`` for
``soak_seconds``; the sweep: one at each of ``--levels``, then the server's bare
``GET /v2/health/live`` at :data:`NOOP_CONCURRENCY` in flight, the floor a predict request
cannot go below), then an open-loop overload at a multiple of the best closed-loop throughput
(requests leave when due whatever the answers, latency counts from when a request was due, a
new connection is opened whenever all are busy, so the client does not limit the requests in
flight).  The soak is the sweep of one configuration, the artifact, at one level: its RSS
sampled throughout (its growth is the soak's last minute against its first sample), then the
health after the overload and a burst of the largest legal image for the peak memory.
Every 200 answer is checked against offline evaluation's top-1 of the model served; the client
processes' own CPU and the machine's busy cores are recorded per level (on a small machine the
client competes with the server).  Targets: :func:`~.targets.evaluate_load_targets` (the soak),
:func:`~.targets.evaluate_sweep_targets` (the sweep).  Outputs: ``load.json``, ``load.md``,
``load.png`` and the servers' logs (the soak: ``gateway.log``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sensai.artifact import load_artifact
from sensai.bounds import option_name
from sensai.errors import CheckpointError, SensaiError

from .client import HttpClientProcess
from .harness import check_settings, envelope, finish, inputs, load_test_images
from .load import (LoadRun, burst_image, check_open_files, client_processes, gateway_settings,
                   offline_top1, request_timeout, seconds_bar, sensai_serve)
from .load_measures import rss_growth
from .load_report import plot, render_markdown
from .load_single import original_as_artifact
from .machine import split_cores, tree_rss
from .names import SWEEP_CONFIGS, SWEEP_TRANSPORTS
from .one_call import one_call_reference
from .options import LoadOptions, LoadPlan
from .perf_analyzer import PerfAnalyzer, for_sweep, missing, sweep_settings
from .plan_judge import rps_within
from .server import Server, served, start_peer, unavailable
from .targets import evaluate_load_targets, evaluate_sweep_targets

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
KINDS = {False: "sensai-bench-load", True: "sensai-bench-load-sweep"}
SOAK_PHASES = ("warmup", "soak", "overload")  # the soak's load.json ``phases``


# --------------------------------------------------------------------------------------------
# Arguments


def check_load_settings(options: LoadOptions, plan: LoadPlan) -> None:
    """``options`` and the resolved ``plan`` (a sweep's, or ``sensai plan``'s, or the soak's),
    in one line each, before anything is loaded."""
    check_settings(options)
    check_settings(plan, choices=(("configuration", plan.configs, CONFIGS), *(
        (("--perf-analyzer mode", [plan.perf_analyzer], PERF_ANALYZER_MODES),)
        if plan.perf_analyzer is not None else ())))
    split_cores(options.client_cores)  # one line now when it cannot be done
    if not Path("/proc/self/status").is_file():
        raise SensaiError("bench-load reads the gateway's memory and the machine's CPU from "
                          "/proc: Linux only")
    if plan.perf_analyzer and not plan.sweep:
        raise SensaiError("--perf-analyzer runs at the sweep's --levels: add --sweep")
    if plan.perf_analyzer == "only" and missing():
        raise SensaiError(f"--perf-analyzer only: {missing()}")
    if not plan.levels:
        raise SensaiError("--levels needs at least one concurrency")
    if plan.transport is not None and plan.transport not in SWEEP_TRANSPORTS:
        raise SensaiError(f"unknown transport {plan.transport!r}; choose one of "
                          f"{', '.join(SWEEP_TRANSPORTS)}")
    clients, connections = options.clients, plan.overload_connections
    if not plan.sweep and plan.overload_seconds == 0:  # only the sweep skips its overload
        raise SensaiError("--set overload_seconds must be a number > 0, got 0 (0 skips the "
                          "overload with --sweep only)")
    if connections is not None and connections < clients:  # each client holds one or more
        raise SensaiError(f"--set overload_connections must be an integer >= --set clients "
                          f"({clients}), got {connections}")
    if connections is not None:
        check_open_files(connections)
    if not plan.sweep and clients > plan.concurrency:
        raise SensaiError(f"--set clients={clients} must not exceed --concurrency "
                          f"({plan.concurrency}): every client process keeps at least one "
                          "request in flight")


# What only one kind of run reads: given to the other kind, refused rather than ignored.
SWEEP_ONLY = ("configs", "levels", "transport", "level_seconds")
SOAK_ONLY = ("concurrency", "soak_seconds", "burst_seconds", "burst_concurrency",
             "sample_seconds")


def check_kind(plan: LoadPlan) -> None:
    """One line if ``plan`` sets what its kind of run (the soak, or the sweep) does not read."""
    default = LoadPlan()
    fields = {f.name: f for f in dataclasses.fields(LoadPlan)}
    ignored = [option_name(fields[name]) for name in (SOAK_ONLY if plan.sweep else SWEEP_ONLY)
               if getattr(plan, name) != getattr(default, name)]
    if ignored:
        raise SensaiError(f"{', '.join(ignored)}: " + (
            "the soak's only, not read by --sweep" if plan.sweep else
            "--sweep's only (the soak measures the artifact at --concurrency): add --sweep"))


def canonical(plan: LoadPlan) -> LoadPlan:
    """The plan resolved (:meth:`~.options.LoadPlan.resolved`), each configuration and level
    once, in order; the soak's one configuration the artifact's, its transport PNG uploads."""
    if not plan.sweep:
        plan = replace(plan, configs=("class-parallel",), transport="http")
    return replace(plan, configs=tuple(dict.fromkeys(plan.configs)),
                   levels=tuple(sorted(set(plan.levels)))).resolved()


def sweep_transport(configs: Sequence[str], transport: str | None, triton_runs: bool) -> str:
    """One transport for every configuration, so they compare like with like: Triton takes only
    tensors, so KServe v2 binary tensors when it runs; else PNG uploads (what a camera sends)."""
    if transport is not None:
        return transport
    return "http-v2" if "triton" in configs and triton_runs else "http"


# --------------------------------------------------------------------------------------------
# What a level records


def level_row(rep: dict[str, Any], usable_cores: int | None, timeline: bool = False
              ) -> dict[str, Any]:
    """A closed-loop phase as one row, with the clients' share of the usable cores (its
    timeline only where ``timeline``: the soak's plot draws it)."""
    row = {k: v for k, v in rep.items() if timeline or k != "timeline"}
    cores = rep.get("client_cores")
    row["client_cpu_share"] = (round(cores / usable_cores, 4)
                               if cores is not None and usable_cores else None)
    return row


def overload_row(rep: dict[str, Any], best_rps: float, timeline: bool = False
                 ) -> dict[str, Any]:
    """The overload phase with its goodput, against the best closed loop's throughput (its
    timeline only where ``timeline``)."""
    row = {k: v for k, v in rep.items() if timeline or k != "timeline"}
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


def sweep_clients(options: LoadOptions, imgs, spec, tensors: bool = True):
    """The client processes (:func:`~.load.client_processes`), holding the test images as PNGs
    and (``tensors``) as tensors."""
    more = ([x.astype(np.float32).tobytes() for x in imgs.xs], [1, *spec.input_shape]) \
        if tensors else ()
    return client_processes(options.clients, imgs.pngs, *more,
                            cores=split_cores(options.client_cores)[1])


# --------------------------------------------------------------------------------------------
# The phases


class Sweep:
    """One configuration after another on the same client processes, each put through the
    phases ``plan`` configures (:meth:`measure`); ``after``: what the soak measures right after
    its overload, on the run (the health, the burst)."""

    def __init__(self, options: LoadOptions, plan: LoadPlan, *, out: Path,
                 procs: list[HttpClientProcess], gs, usable_cores: int | None, bar,
                 perf: PerfAnalyzer | None = None,
                 after: Callable[[LoadRun], dict[str, Any]] | None = None):
        self.options, self.plan, self.out, self.procs = options, plan, out, procs
        self.progress, self.usable_cores, self.bar = options.progress, usable_cores, bar
        self.perf, self.after = perf, after
        self.use(gs)

    def use(self, gs) -> None:
        """The settings of the server measured next (its request timeout, its gateway count
        for the batching counters)."""
        self.gs, self.timeout_s = gs, request_timeout(gs)

    def measure(self, key: str, run: LoadRun, transport: str, label: str | None = None
                ) -> dict[str, Any]:
        """On one server: the warm-up, the closed loops (a gateway's process tree's memory
        after each), perf_analyzer's levels, the bare route, the overload, then ``after``."""
        plan, server = self.plan, run.server
        rep: dict[str, Any] = {"label": label or CONFIG_LABELS.get(key), "transport": transport}
        if plan.perf_analyzer == "only":
            return self.perf_analyzer(rep | {"transport": "http-v2"}, key, server)
        name = (lambda what: f"{key}: {what}") if key else (lambda what: what)
        soak = not plan.sweep  # the soak keeps its warm-up and timelines, for its plot
        run.sampler.sample("startup")
        if plan.warmup_seconds > 0:
            warmup = run.closed(name("warm-up"), plan.warmup_seconds)
            rep |= {"warmup": warmup} if soak else {}
        gateways = server_gateways(self.gs, self.options.client_cores)
        rep["levels"] = []
        for c in [plan.concurrency] if soak else plan.levels:
            before = batching_counters(server.url, gateways) if server.gateway else None
            row = level_row(run.closed(name("soak" if soak else f"{c} in flight"),
                                       plan.soak_seconds if soak else plan.level_seconds, c),
                            self.usable_cores, timeline=soak)
            if server.gateway:
                row["batching"] = rows_per_batch(before, batching_counters(server.url, gateways))
                row["server_tree_rss_mb"] = round(tree_rss(server.pid)[0] / 1e6, 1)
            rep["levels"].append(row)
        # Right after bench-load's own levels, before the overload leaves the server shedding.
        self.perf_analyzer(rep, key, server)
        if not soak and plan.bare_route:
            rep["noop"] = level_row(run.closed(name("GET /v2/health/live"), plan.level_seconds,
                                               NOOP_CONCURRENCY, bare=True), self.usable_cores)
        best = rps_within(rep["levels"], None)
        rate = plan.overload_rate or self.options.overload_factor * best
        if plan.overload_seconds > 0 and rate > 0:
            rep["overload"] = overload_row(run.overload(
                plan.overload_seconds, rate, self.gs, self.options.retry_after,
                plan.overload_connections), best, timeline=soak)
            rep |= self.after(run) if self.after else {}
        else:
            rep["overload"] = {"skipped": "--set overload_seconds=0" if plan.overload_seconds <= 0
                               else "no closed loop answered, so there is no rate to multiply; "
                                    "give --set overload_rate=R"}
        if server.gateway:
            rep["batching"] = batching_counters(server.url, gateways)
        run.sampler.sample("after")
        return rep

    def perf_analyzer(self, rep: dict[str, Any], key: str, server: Server) -> dict[str, Any]:
        """perf_analyzer at each level (when asked), its rows in ``rep["perf_analyzer"]``."""
        if self.perf is None:
            return rep
        rows = []
        for c in self.plan.levels:
            self.bar.set_description(f"{key}: perf_analyzer, {c} in flight")
            rows.append(self.perf.level(server.url, server.model, c, key))
            if self.progress:
                r = rows[-1]
                self.bar.write(f"{key}: perf_analyzer at {c} in flight: " + (
                    r["error"] if "error" in r else
                    f"{r['throughput_infer_per_s']:g} infer/s, p50/p99 "
                    f"{r['p50_us'] / 1e3:.2f}/{r['p99_us'] / 1e3:.2f} ms"))
        rep["perf_analyzer"] = rows
        return rep

    def serve(self, key: str, kind: str, source: Path, expected: list[int], *,
              label: str | None = None, env: dict[str, str] | None = None,
              args: Sequence[str] = ()) -> dict[str, Any]:
        """The configuration ``key`` (the soak's: none): a server of ``kind`` serving ``source``
        (``sensai``: with ``env`` and ``args``, its log in ``gateway-KEY.log``, the soak's in
        ``gateway.log``; a peer: with the gateway's threads per worker) started, measured,
        stopped; a peer that cannot run here is skipped with its reason."""
        plan = self.plan
        self.bar.set_description(f"{key}: starting {kind}" if key else "starting the gateway")
        if kind == "sensai":
            server: Server | str = sensai_serve(
                self.options, source, env or {},
                self.out / (f"gateway-{key}.log" if key else "gateway.log"),
                model=self.gs.model_name, args=args)
        else:
            server = start_peer(kind, source, threads=self.gs.threads_per_worker)
            if isinstance(server, str):
                return {"label": CONFIG_LABELS[key], "skipped": server}
        # A peer takes tensors only (the run's transport is http-v2 unless asked otherwise).
        transport = plan.transport if server.gateway else "http-v2"
        with server:
            run = LoadRun(server, self.procs, expected=expected,
                          concurrency=plan.concurrency if not plan.sweep else WARMUP_CONCURRENCY,
                          timeout_s=self.timeout_s, bar=self.bar, progress=self.progress,
                          sample_s=plan.level_seconds if plan.sweep else plan.sample_seconds,
                          request={"transport": transport, "model": server.model})
            if server.gateway:
                run.say(f"{key or 'gateway'}: pid {server.serving_pid} ready at {server.url} in "
                        f"{server.startup_s} s; its output: {server.log_path}")
            rep = self.measure(key, run, transport, label)
        if not server.gateway:
            rep["server"] = server.info
        elif plan.sweep:
            rep["server"] = server.record() | {"sampled": server.sampled()}
        else:  # the soak: the gateway's process, and its memory over the run
            rep |= server.report(run.sampler.samples)
        return rep


def soak_after(options: LoadOptions, plan: LoadPlan, artifact, spec, gs
               ) -> Callable[[LoadRun], dict[str, Any]]:
    """What the soak measures right after its overload: the health, then the burst of
    ``artifact``'s largest legal image (its client process joins the run's)."""
    def after(run: LoadRun) -> dict[str, Any]:
        out: dict[str, Any] = {"health_after": run.health()}
        if plan.burst_seconds > 0:
            png, image = burst_image(artifact, spec, gs)
            run.procs.append(HttpClientProcess([png], cores=split_cores(options.client_cores)[1]))
            out["burst"] = run.burst(run.procs[-1], image, plan.burst_concurrency,
                                     plan.burst_seconds)
        return out
    return after


def soak_result(rep: dict[str, Any]) -> dict[str, Any]:
    """The soak's one configuration as load.json holds it: its ``phases`` (the soak's with
    the RSS growth over it), the gateway, its memory, the health after and the burst."""
    phases = {"warmup": rep.get("warmup"), "soak": rep["levels"][0],
              "overload": rep["overload"]}
    samples = rep["rss"]["samples"]
    phases["soak"]["rss"] = {"gateway": rss_growth(samples, "soak", "rss_mb"),
                             "with_descendants": rss_growth(samples, "soak", "tree_rss_mb")}
    return {k: rep[k] for k in ("gateway", "rss", "health_after", "burst") if k in rep} | {
        "phases": {k: phases[k] for k in SOAK_PHASES if phases[k] is not None}}


def run_load(artifact_dir: str | Path, out_dir: str | Path, options: LoadOptions,
             plan: LoadPlan) -> dict[str, Any]:
    """The soak (``plan.sweep`` false) or the sweep of ``plan.configs`` (of :data:`CONFIGS`) at
    ``plan.levels`` in flight, ``plan.level_seconds`` each, of the artifact in ``artifact_dir``
    over HTTP; writes load.json, load.md, load.png (and the servers' logs) to ``out_dir`` and
    returns what load.json holds.  ``options``: what the soak and the sweep share, the
    gateway's settings among them; ``plan``: the phases (the warm-up and overload seconds the
    soak's or the sweep's where None; ``plan.overload_connections``, default
    ``max_requests`` plus the arrivals of one deadline within the open-file limit, caps the
    overload's connections).  ``plan.transport``: ``http`` (PNG uploads) or ``http-v2``
    (KServe v2 binary tensors) for every configuration (default: :func:`sweep_transport`); a
    configuration that cannot run here is recorded with its reason.  ``plan.perf_analyzer``:
    ``also`` (beside bench-load's own client) or ``only`` (instead of it) drive every
    configuration with NVIDIA's perf_analyzer at each level (:class:`.PerfAnalyzer`; ``also``
    where it is not on PATH: a warning, and the sweep runs without it)."""
    check_kind(plan)
    plan = canonical(plan)
    check_load_settings(options, plan)
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
    result = envelope(KINDS[bool(plan.sweep)], command=options.command, artifact=artifact,
                      spec=spec, settings=run_settings(plan, options, gs, gateway_env,
                                                       images=len(imgs), perf=perf))
    result["offline_top1"] = round(float(np.mean(np.asarray(expected) == imgs.labels)), 5)
    bar = seconds_bar(options, "bench-load --sweep" if plan.sweep else "bench-load")
    if plan.sweep and any(key.startswith("class-parallel") for key in plan.configs):
        # Before any server starts: the device's compute alone, nothing competing for it.
        bar.set_description("one call of every subnet, in process")
        result["one_call"] = one_call_reference(
            artifact, imgs.xs, device=gs.device, runtime=gs.runtime_kind,
            threads=gs.threads_per_worker, sim_launch_ms=gs.sim_launch_ms)
    try:
        with sweep_clients(options, imgs, spec, tensors=plan.sweep) as procs:
            sweep = Sweep(options, plan, out=out, procs=procs, gs=gs, bar=bar, perf=perf,
                          usable_cores=result["machine"].get("usable_cores"),
                          after=None if plan.sweep else soak_after(options, plan, artifact,
                                                                   spec, gs))
            # The soak's one configuration: the artifact, named by none.
            for key in (k for k in (plan.configs if plan.sweep else [""]) if k not in results):
                own = key != "single"
                results[key] = (sweep.serve(key, key, full_onnx, expected_original)
                                if key == "triton" else sweep.serve(
                    key, "sensai", artifact.root if own else original.root,
                    expected if own else expected_original,
                    env=gateway_env | CONFIG_ENV.get(key, {})))
    finally:
        bar.close()
    if plan.sweep:
        result["configs"] = {key: results[key] for key in plan.configs}
    else:
        result |= soak_result(results[""])
    result["targets"] = (evaluate_sweep_targets if plan.sweep else evaluate_load_targets)(result)
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
    """load.json's ``settings``: what the soak and the sweep share, then each one's own."""
    shared = {
        "backend": gs.backend, "warmup_s": plan.warmup_seconds,
        "overload_s": plan.overload_seconds, "overload_factor": options.overload_factor,
        "overload_rate_rps": plan.overload_rate,
        "overload_connections": plan.overload_connections,
        "overload_retry_after": "honoured" if options.retry_after else "ignored",
        "clients": options.clients, "images": images, "seed": options.seed,
        "clients_on_cores": split_cores(options.client_cores)[1],
        "transport": plan.transport, "request_timeout_s": request_timeout(gs),
        "gateway": {"deadline_s": gs.deadline_s, "max_requests": gs.max_requests,
                    "max_predictions": gs.max_predictions,
                    "latency_target_s": gs.latency_target_s,
                    "client_timeout_s": gs.client_timeout_s, "batch_max_rows": gs.batch_max_rows,
                    "batch_delay_us": gs.batch_delay_us, "redundancy": gs.redundancy,
                    "vote": gs.vote, "threads_per_worker": gs.threads_per_worker,
                    "runtime": gs.runtime_kind,
                    "sim_launch_ms": gs.sim_launch_ms if gs.runtime_kind == "sim" else None,
                    "gpu_wait": gs.gpu_wait, "device": gs.device,
                    "hang_timeout_s": gs.hang_timeout(),
                    "gateway_processes": server_gateways(gs, options.client_cores)},
        "gateway_env": gateway_env}
    if not plan.sweep:
        return shared | {
            "concurrency": plan.concurrency, "soak_s": plan.soak_seconds,
            "burst_s": plan.burst_seconds, "burst_concurrency": plan.burst_concurrency,
            "sample_s": plan.sample_seconds, "batch": 1,
            "upload": "PNG as the raw body of POST /v1/predict"}
    return shared | {
        "configs": list(plan.configs), "levels": list(plan.levels),
        "level_s": plan.level_seconds, "warmup_concurrency": WARMUP_CONCURRENCY,
        "noop_concurrency": NOOP_CONCURRENCY, "config_env": CONFIG_ENV,
        "perf_analyzer": sweep_settings(plan.perf_analyzer, perf)}

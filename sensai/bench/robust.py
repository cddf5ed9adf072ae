"""``sensai bench-robust``: latency, errors and compute cost of redundant class parallelism.

Every configuration (redundancy ``r``, for ``r >= 1`` optionally a hedge delay) is the predictor
``sensai serve ART -r r [--set hedge_ms=h]`` builds; ``r = 0`` is the default serving path,
so the cost of redundancy is measured against it.  The same test images are sent one at a time,
in process, under the scenarios of :data:`.names.SCENARIOS`: ``none``; ``straggler`` (one worker
sleeps before every request, ``--set delay``); ``failure`` (one worker is ended while a request is
in flight, then restarted; requests are paced so the error count measures the outage, not how
fast errors come back); ``node-loss`` (the victim's Ray node's raylet and everything it started are
killed, as losing the machine would; one configuration, the node does not come back).  ``none``
and ``straggler`` interleave the configurations in rounds; an outage is a wall-clock event, one
configuration at a time.  Every answer is compared with the offline one (``wrong``); ``errors``
counts 503/504 answers.  With ``--backend ray-serve`` every configuration is instead the Ray
Serve application, ``sensai serve`` in a process of its own started in turn and called over
HTTP (:mod:`.robust_serve`; scenarios ``none`` and ``failure``; its log ``serve-KEY.log``).
Outputs: ``robust.json``, ``robust.md``, ``robust.png``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.raycluster import alive_nodes, local_raylet_pid
from sensai.serving.core.errors import ServingError
from sensai.serving.core.faults import parse_delay
from sensai.serving.core.placement import check_redundancy
from sensai.serving.core.settings import MODEL_RUNTIMES, GatewaySettings, load_settings
from sensai.serving.engine.predictor import ClassParallelPredictor
from sensai.serving.gateway.server import run_like_the_gateway
from sensai.serving.launch.build import build_predictor

from .harness import (check_settings, envelope, finish, inputs, interleaved, load_test_images,
                      offline_reference, progress_bar, quiet_gc)
from .machine import descendant_pids
from .names import DEFAULT_SCENARIOS, OUTAGES, ROBUST_BACKENDS, SCENARIOS
from .options import RobustOptions
from .robust_records import AFTER_REJOIN, Outage, Records, outage_report
from .robust_report import plot, render_markdown
from .robust_serve import IN_FLIGHT, TRANSPORT, measure_on_serve

log = logging.getLogger(__name__)

# How bench-robust names the settings each configuration is given, for its one-line refusals.
FLAGS = {"deadline_s": "--set deadline_s", "restart_delay_s": "--set restart_delay_s",
         "hedge_ms": "--hedge-ms", "threads_per_worker": "--set threads"}
# The scenarios a backend cannot be put through, and why: refused rather than ignored.
REFUSED_SCENARIOS = {
    "straggler": {"ray-serve": "the Serve application takes no injected delay"},
    "node-loss": {b: "it kills a Ray node: use --backend ray" for b in ROBUST_BACKENDS
                  if b != "ray"}}


def config_key(r: int, hedge_ms: float) -> str:
    return f"r={r}" + (f", hedge {hedge_ms:g} ms" if hedge_ms else "")


def check_robust_settings(options: RobustOptions, redundancies, scenarios, groups: int) -> None:
    if not redundancies:
        raise SensaiError("give at least one --redundancy")
    check_settings(options, choices=(("scenario", scenarios, SCENARIOS),
                                     ("backend", [options.backend], ROBUST_BACKENDS),
                                     ("runtime", [options.runtime], MODEL_RUNTIMES)))
    for r in redundancies:
        check_redundancy(groups, None, r, options.vote)
    parse_delay(options.delay)
    for name, v in (("--set straggler", options.straggler), ("--set victim", options.victim)):
        if v >= groups:
            raise SensaiError(f"{name} must be a worker index 0..{groups - 1}, got {v!r}")
    if options.ray_address and options.backend not in ("ray", "ray-serve"):
        raise SensaiError("--ray-address is for --backend ray and ray-serve")
    for s in scenarios:
        if why := REFUSED_SCENARIOS.get(s, {}).get(options.backend):
            raise SensaiError(f"the {s} scenario does not apply to --backend {options.backend} "
                              f"({why})")


async def one_request(pred: ClassParallelPredictor, x: np.ndarray, ref: np.ndarray, run: Records, *,
                      kill=None) -> None:
    start = time.monotonic()
    task = asyncio.ensure_future(pred.predict(x))
    if kill is not None:
        await asyncio.sleep(0)  # the request is dispatched to every worker...
        kill()  # ...and one of them dies while it is in flight
    try:
        p = await task
    except ServingError as e:
        run.add(start, (time.monotonic() - start) * 1e3, error=f"{e.status}: {e}")
        return
    ms = (time.monotonic() - start) * 1e3
    run.answered_by.append(dict(p.answered_by))
    run.degraded += bool(p.degraded)
    run.add(start, ms, wrong=int(p.scores[0].argmax()) != int(ref.argmax())
            or not np.allclose(p.scores[0], ref, atol=1e-5))


async def settle(pred: ClassParallelPredictor, timeout: float = 5.0) -> None:
    """Let copies still being computed for the last request finish, so counters are complete."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(w.pending for w in pred.workers):
        await asyncio.sleep(0.005)


def _straggler_figures(pred: ClassParallelPredictor, run: Records, straggler: int,
                       delay: str) -> dict[str, Any]:
    """How often the delayed worker's own groups were still answered by it."""
    own = [f"subnet_{g:02d}" for g in pred.placement.workers[straggler]
           if pred.hosts[g][0] == straggler]
    name = pred.workers[straggler].name
    total = sum(1 for a in run.answered_by for s in own if s in a)
    by_it = sum(1 for a in run.answered_by for s in own if a.get(s) == name)
    return {"straggler": name, "straggler_delay": delay, "straggler_groups": own,
            "straggler_answered_share": round(by_it / total, 4) if total else None}


def config_settings(options: RobustOptions, r: int, hedge_ms: float) -> GatewaySettings:
    """The settings of the configuration (``r``, ``hedge_ms``), for the predictor built in this
    process or the Serve application, checked as ``sensai serve`` checks its flags."""
    return load_settings(
        {"backend": options.backend, "redundancy": r, "hedge_ms": hedge_ms,
         "vote": options.vote, "deadline_s": options.deadline_s,
         "restart_delay_s": options.restart_delay_s, "device": options.device,
         "runtime": options.runtime, "threads_per_worker": options.threads,
         "ray_address": options.ray_address}, FLAGS)


async def _measure(preds: dict[str, ClassParallelPredictor], scenarios, xs, refs,
                   options: RobustOptions, *, bar) -> dict[str, dict[str, dict]]:
    n = len(xs)
    straggler, delay = options.straggler, options.delay
    results: dict[str, dict[str, dict]] = {k: {} for k in preds}
    for key, pred in preds.items():
        bar.set_description(f"warm-up {key}")
        for j in range(options.warmup):
            await pred.predict(xs[j % n])
            bar.update(1)
    for scenario in [s for s in SCENARIOS if s in scenarios and s not in OUTAGES]:
        runs = {k: Records() for k in preds}

        async def run_chunk(key: str, chunk) -> None:
            pred = preds[key]
            bar.set_description(f"{scenario}: {key}")
            await settle(pred)
            before = pred.pool.counters()
            for j in chunk:
                await one_request(pred, xs[j], refs[j], runs[key])
                bar.update(1)
            await settle(pred)
            runs[key].add_work(before, pred.pool.counters())

        if scenario == "straggler":
            for pred in preds.values():
                pred.pool.inject(straggler, delay=delay)
        try:
            await interleaved(list(preds), n, options.rounds, run_chunk)
        finally:
            if scenario == "straggler":
                for pred in preds.values():
                    pred.pool.inject(straggler, delay=None)
        for key, pred in preds.items():
            extra = (_straggler_figures(pred, runs[key], straggler, delay)
                     if scenario == "straggler" else None)
            results[key][scenario] = runs[key].report(extra)
    for scenario in [s for s in OUTAGES if s in scenarios]:
        for key, pred in preds.items():
            bar.set_description(f"{scenario}: {key}")
            results[key][scenario] = await measure_outage(pred, xs, refs, options, bar,
                                                          node=scenario == "node-loss")
    return results


def victim_raylet(pred: ClassParallelPredictor, victim: int) -> tuple[str, int]:
    """The node of worker ``victim`` and the pid of its raylet, if it may be killed: a worker
    node (never the head) whose raylet runs on this machine."""
    node = pred.workers[victim].handle.node
    head = {n["id"] for n in alive_nodes() if n["head"]}
    if node is None or node in head:
        raise SensaiError(f"the node-loss scenario needs worker {victim} on a worker node, but it "
                          f"runs on {'the head node' if node else 'no known node'}; choose "
                          "another victim (--set victim=N) or a cluster with worker nodes")
    pid = local_raylet_pid(node)
    if pid is None:
        raise SensaiError(f"the raylet of node {node} (worker {victim}) does not run on this "
                          "machine: the node-loss scenario needs a cluster of local nodes")
    return node, pid


class OutageClock(Outage):
    """The victim's outage: ``kill`` ends it (``node``: its node's raylet, so every worker
    there), ``watch`` times it until the victim is up again."""

    def __init__(self, pred: ClassParallelPredictor, victim: int, node: bool):
        super().__init__()
        self.pred, self.victim, self.node = pred, victim, node
        self.stop = asyncio.Event()
        self.node_id = self.raylet = self.pid = None
        self.victims = [victim]  # every worker lost with it
        if node:
            self.node_id, self.raylet = victim_raylet(pred, victim)
            self.victims = [w.index for w in pred.workers if w.handle.node == self.node_id]

    async def watch(self) -> None:
        # Poll the worker's state to time the outage: ended -> restarted -> up again.
        while not self.stop.is_set():
            up = self.pred.pool.states()[self.victim] == "up"
            self.see(down=not up, up=up)
            await asyncio.sleep(0.002)

    def kill(self) -> None:
        self.killed()
        if self.node:
            # What losing the machine does: the raylet and every process it started (the
            # node's workers, which would otherwise go on answering direct actor calls until
            # the cluster declares the node dead).
            for pid in [*descendant_pids(self.raylet), self.raylet]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.pid = self.raylet
        else:
            self.pid = self.pred.pool.kill(self.victim)

    async def rejoin(self, timeout_s: float) -> bool:
        """Whether every worker that was lost (a node takes several) is up within
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return await asyncio.to_thread(lambda: all(
            self.pred.pool.wait_until_up(v, max(0.0, deadline - time.monotonic()))
            for v in self.victims))


async def measure_outage(pred: ClassParallelPredictor, xs, refs, options: RobustOptions,
                         bar, *, node: bool = False) -> dict:
    """Every image in turn, a request every ``interval_ms`` (paced arrivals: a request that
    fails fast must not let the next ones rush in, or the error count would measure how quickly
    errors come back, not the outage); the victim worker is killed (``node``: its node's
    raylet, so every worker there) while request ``kill_at`` x images is in flight, and the
    outage timed until it is up again."""
    run = Records()
    kill_index = int(options.kill_at * len(xs))
    wk = pred.workers[options.victim]
    clock = OutageClock(pred, options.victim, node)
    restarts0 = wk.restarts
    await settle(pred)
    before = pred.pool.counters()
    watcher = asyncio.ensure_future(clock.watch())
    try:
        next_start = time.monotonic()
        for j in range(len(xs)):
            if (wait := next_start - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            next_start = time.monotonic() + options.interval_ms / 1e3
            await one_request(pred, xs[j], refs[j], run,
                              kill=clock.kill if j == kill_index else None)
            bar.update(1)
        await settle(pred)
        run.add_work(before, pred.pool.counters())
        # Wait for the rejoin of every worker that was lost, then check the victim serves
        # again.
        rejoined = await clock.rejoin(options.rejoin_timeout_s)
        await asyncio.sleep(0.01)
    finally:
        clock.stop.set()
        await watcher
    after, rejoin_runs = await after_rejoin(pred, xs, refs, options.victim)
    extra = {"node": clock.node_id,
             "workers_on_node": [pred.workers[v].name for v in clock.victims],
             "nodes_after": [w.get("node") for w in pred.describe()["workers"]]} if node else {}
    return outage_report(run, clock, after, rejoin_runs, **extra, victim=wk.name,
                         killed_pid=clock.pid, kill_at_request=kill_index,
                         restarted=wk.restarts > restarts0, rejoined=bool(rejoined))


async def after_rejoin(pred: ClassParallelPredictor, xs, refs, victim: int
                       ) -> tuple[Records, int]:
    """:data:`AFTER_REJOIN` requests once the victim is back: their records, and how many
    subnet runs the victim made for them."""
    after = Records()
    runs0 = pred.pool.counters()["per_worker_runs"][victim]
    for j in range(min(len(xs), AFTER_REJOIN)):
        await one_request(pred, xs[j], refs[j], after)
    await settle(pred)
    return after, pred.pool.counters()["per_worker_runs"][victim] - runs0


def _relative_costs(measured: dict[str, dict[str, dict]]) -> None:
    """Compute overheads relative to r = 0 without faults (one full answer's work), where it
    ran, and p99 relative to the same configuration without faults."""
    base = measured.get(config_key(0, 0.0), {}).get("none")
    for per in measured.values():
        none = per.get("none")
        for scen, rep in per.items():
            if base and base["subnet_runs_per_request"]:
                rep["compute_overhead_runs"] = round(
                    rep["subnet_runs_per_request"] / base["subnet_runs_per_request"], 3)
                rep["compute_overhead_time"] = (round(
                    rep["compute_ms_per_request"] / base["compute_ms_per_request"], 3)
                    if base["compute_ms_per_request"] else None)
            if scen != "none" and none and none["latency_ms"]["p99"] and rep["latency_ms"]["p99"]:
                rep["p99_vs_no_fault"] = round(rep["latency_ms"]["p99"]
                                               / none["latency_ms"]["p99"], 3)


def run_robust_bench(artifact_dir: str | Path, out_dir: str | Path,
                     options: RobustOptions) -> dict[str, Any]:
    """Run the robust benchmark on the artifact in ``artifact_dir``; write robust.json,
    robust.md and robust.png to ``out_dir``; return what robust.json holds.  ``options``:
    ``sensai bench-robust``'s: ``redundancies`` x ``hedges_ms`` (hedges for r >= 1) are the
    configurations, each on W = G workers of ``backend``; ``straggler``/``victim`` are worker
    indices; the victim is ended at request ``kill_at`` x ``images``; ``scenarios`` (None:
    :data:`.names.DEFAULT_SCENARIOS`, those the backend takes); ``deadline_s`` (None: the
    gateway settings')."""
    if options.deadline_s is None:
        options = replace(options, deadline_s=load_settings({}).deadline_s)
    artifact = load_artifact(artifact_dir)
    scenarios, configs = robust_configs(artifact, options)
    spec, out = inputs(artifact, options.data_dir, out_dir)
    t_start = time.perf_counter()

    imgs = load_test_images(spec, options.images, options.seed, png=False)
    refs = offline_reference(artifact, imgs.xs, runtime=options.runtime,
                             threads=options.threads)
    result = envelope("sensai-bench-robust", command=options.command, artifact=artifact,
                      spec=spec, settings=robust_settings(configs, scenarios, options,
                                                          images=len(imgs.xs),
                                                          workers=len(artifact.groups)))
    result["offline_top1"] = round(float((refs.argmax(1) == imgs.labels).mean()), 5)
    measured, described = measure_configs(artifact, configs, scenarios, imgs.xs, refs,
                                          options=options, log_dir=out)
    add_reports(result, measured, described, configs)
    finish(out, "robust", result, t_start, render_markdown, plot)
    return result


def robust_configs(artifact, options: RobustOptions
                   ) -> tuple[list[str], dict[str, GatewaySettings]]:
    """The scenarios (None: the backend's defaults) in canonical order, and the configurations
    (redundancy, hedge) by key with their settings, each checked before anything is loaded."""
    scenarios = options.scenarios
    if scenarios is None:  # the backend's defaults
        scenarios = [s for s in DEFAULT_SCENARIOS
                     if options.backend not in REFUSED_SCENARIOS.get(s, {})]
    scenarios = [s for s in SCENARIOS if s in set(scenarios)] or list(scenarios)
    redundancies = sorted({int(r) for r in options.redundancies})
    hedges = sorted({float(h) for h in options.hedges_ms}) or [0.0]
    check_robust_settings(options, redundancies, scenarios, len(artifact.groups))
    configs = [(r, 0.0) for r in redundancies if r == 0] + [
        (r, h) for r in redundancies if r > 0 for h in hedges]
    if "node-loss" in scenarios and len(configs) > 1:
        raise SensaiError("the node-loss scenario loses a node for good: run one configuration "
                          "(one --redundancy, one --hedge-ms) at a time")
    return scenarios, {config_key(r, h): config_settings(options, r, h) for r, h in configs}


def robust_settings(configs, scenarios, options: RobustOptions, *, images: int,
                    workers: int) -> dict[str, Any]:
    """robust.json's ``settings`` (the Serve application's requests: always :data:`IN_FLIGHT`
    of them, over HTTP, neither paced nor in rounds)."""
    served = options.backend == "ray-serve"
    return {"configs": list(configs), "scenarios": scenarios,
            "backend": options.backend, "ray_address": options.ray_address, "images": images,
            "warmup": options.warmup, "rounds": None if served else options.rounds,
            "workers": workers, "vote": options.vote, "delay": options.delay,
            "straggler_worker": options.straggler, "victim_worker": options.victim,
            "kill_at": options.kill_at,
            "failure_interval_ms": None if served else options.interval_ms,
            "deadline_s": options.deadline_s, "restart_delay_s": options.restart_delay_s,
            "device": options.device, "runtime": options.runtime,
            "threads_per_worker": options.threads, "seed": options.seed, "batch": 1,
            "concurrency": IN_FLIGHT if served else 1,
            "transport": TRANSPORT if served else "inprocess"}


def measure_configs(artifact, configs: dict[str, GatewaySettings], scenarios, xs, refs, *,
                    options: RobustOptions, log_dir: Path
                    ) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every configuration under every scenario, on the Ray Serve application (``sensai serve``
    with the configuration's settings, its log in ``log_dir``) or as a predictor built in this
    process (every one built, then measured: :func:`_measure`): the scenarios' reports and each
    configuration's description (a predictor's ``describe()``)."""
    bar = progress_bar(options.progress, "bench-robust")
    preds: dict[str, ClassParallelPredictor] = {}
    try:
        bar.total = len(configs) * (options.warmup + len(xs) * len(scenarios))
        bar.refresh()
        if options.backend == "ray-serve":
            return measure_on_serve(
                artifact, configs, scenarios, xs, refs, warmup=options.warmup,
                victim=options.victim, kill_at=options.kill_at,
                rejoin_timeout_s=options.rejoin_timeout_s, log_dir=log_dir, bar=bar)
        for key, settings in configs.items():
            bar.set_description(f"start {key}")
            preds[key] = build_predictor(artifact.root, settings, seed=options.seed)
        described = {k: p.describe() for k, p in preds.items()}
        with quiet_gc():
            return run_like_the_gateway(_measure(preds, scenarios, xs, refs, options,
                                                 bar=bar)), described
    finally:
        for p in preds.values():
            p.shutdown()
        bar.close()


def add_reports(result: dict[str, Any], measured: dict[str, dict], described: dict[str, dict],
                configs: dict[str, GatewaySettings]) -> None:
    """Each configuration's placement, worker transport and nodes, and its scenarios' reports
    with their costs against r = 0 without faults (where it ran)."""
    result["placement"] = {k: d["placement"] for k, d in described.items()}
    result["worker_transport"] = {k: d["transport"] for k, d in described.items()}
    result["worker_nodes"] = {k: [w.get("node") for w in d["workers"]]
                              for k, d in described.items()}
    workers = [w for d in described.values() for w in d["workers"]]
    for what in ("runtime", "device"):  # what "auto" became
        result["settings"][f"{what}_resolved"] = sorted({str(w[what]) for w in workers
                                                         if w.get(what)})
    if result["settings"]["backend"] == "ray-serve":
        result["serve"] = {k: {"url": d["url"], "startup_s": d["startup_s"],
                               "gateway": d["gateway"]} for k, d in described.items()}
    _relative_costs(measured)
    result["configs"] = {k: {"redundancy": s.redundancy, "hedge_ms": s.hedge_ms,
                             "subnets_hosted_per_worker": s.redundancy * (2 if s.vote else 1) + 1,
                             "scenarios": measured[k]}
                         for k, s in configs.items()}

"""``sensai bench``: single-image latency of class parallelism against the usual alternatives.

One run measures, on the same real test images, the same runtime and the same thread/device
budget per worker, the strategies of :mod:`.strategies` (single device, model parallel, class
parallel, data parallel), each in process (the predictor called directly) and end to end over
each remote transport - ``http`` (PNG upload to ``/v1/predict``), ``http-v2`` (KServe v2 binary
tensor) and ``grpc`` (KServe v2 over gRPC) - against its own gateway on 127.0.0.1, from a client
in its own process, warm-up excluded.  Latency is taken at concurrency 1 in interleaved rounds,
throughput afterwards at a chosen concurrency.  Each request's latency is split into compute,
merge and transport (:mod:`.stats`); over a remote transport the same client also times the bare
request to the same server just before each request (``GET /v2/health/live``, gRPC
``ServerLive``), the floor that transport puts under any request.  Class parallel's subnets are
also timed one at a time, each alone on a worker ("each subnet alone"), to separate their own
compute from competition for the cores.

Outputs in ``out_dir``: ``bench.json`` (every figure, raw latencies, the artifact's accuracy and
shrink, the targets that apply to its model, settings, machine), ``bench.md``, ``bench.png`` and
``models/`` (ONNX files of the full model and of the stages).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.models import select_device

from ..runners import RUNTIMES, runner_specs
from ..settings import GatewaySettings
from .accuracy import accuracy, shrink
from .baselines import WorkerSet
from .client import HttpClientProcess
from .harness import (InProcessDriver, RemoteDriver, TestImages, check_dataset, check_int,
                      check_out_dir, envelope, finish, interleaved, load_test_images,
                      progress_bar, quiet_gc, throughput, warm_up, write_outputs)
from .latency_report import plot, render_markdown
from .names import BACKENDS, STRATEGIES, TRANSPORTS
from .stats import Samples, summarize
from .strategies import (Recipe, Strategy, build, load_original, prepare_baselines,
                         prepare_class_parallel, stage_count)
from .targets import evaluate_targets

log = logging.getLogger(__name__)


def check_settings(*, workers, replicas, images, warmup, concurrency, requests, threads, rounds,
                   isolated_images, strategies: Sequence[str], transports: Sequence[str],
                   runtime: str, backend: str, ray_address: str | None = None) -> None:
    """Every setting checked before anything is loaded."""
    for name, v, low in (("--workers", workers, 1), ("--replicas", replicas, 1),
                         ("--images", images, 1), ("--warmup", warmup, 0),
                         ("--concurrency", concurrency, 1), ("--requests", requests, 1),
                         ("--threads", threads, 1), ("--rounds", rounds, 1),
                         ("isolated_images", isolated_images, 0)):
        check_int(name, v, low)
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise SensaiError(f"unknown strategy {', '.join(bad) or '(none)'}; choose from "
                          f"{', '.join(STRATEGIES)}")
    if not transports or any(t not in TRANSPORTS for t in transports):
        raise SensaiError(f"transports must be some of {', '.join(TRANSPORTS)}")
    if runtime not in RUNTIMES:
        raise SensaiError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if backend not in BACKENDS:
        raise SensaiError(f"unknown backend {backend!r} for the benchmark; choose one of "
                          f"{', '.join(BACKENDS)}")
    if ray_address and backend != "ray":
        raise SensaiError("--ray-address is for --backend ray")


def run_bench(
    artifact_dir: str | Path,
    out_dir: str | Path,
    *,
    workers: int | None = None,
    replicas: int | None = None,
    images: int = 200,
    warmup: int = 20,
    concurrency: int = 8,
    requests: int | None = None,
    rounds: int = 10,
    strategies: Sequence[str] = STRATEGIES,
    transports: Sequence[str] = TRANSPORTS,
    backend: str = "local",
    ray_address: str | None = None,
    device: str = "auto",
    runtime: str = "auto",
    threads: int = 1,
    data_dir: str | None = None,
    seed: int = 0,
    isolated_images: int = 20,
    command: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Benchmark the artifact in ``artifact_dir``; write bench.json, bench.md, bench.png to
    ``out_dir``; return what bench.json holds.

    ``workers``: K, the model-parallel stages (default: G, the number of subnets, so both
    parallel strategies use as many workers).  ``replicas``: data-parallel replicas (default K).
    ``images``: real test images (stratified) timed at concurrency 1 in ``rounds`` interleaved
    rounds, after ``warmup`` untimed requests per strategy and transport.  ``concurrency`` and
    ``requests`` (default: max(images, 4 x concurrency)): the throughput run.  ``backend``: where
    class parallel's workers run, as for ``sensai serve`` (the baselines always run on worker
    threads); ``ray_address``: the Ray cluster of ``backend="ray"`` (each worker's node is
    reported).  ``threads``: intra-op threads of every worker's runner.  ``device``/``runtime``: as
    for ``sensai serve`` (auto: ONNX Runtime on CPUs, torch on GPUs), the same for every strategy.
    ``isolated_images``: images on which each subnet is also timed alone.  ``transports``: any
    of ``inprocess``, ``http``, ``http-v2``, ``grpc``.  The HTTP/gRPC client is a spawned
    process, so a script calling this needs the usual ``if __name__ == "__main__":`` guard (the
    ``sensai`` command has it).
    """
    check_settings(workers=workers, replicas=replicas, images=images, warmup=warmup,
                   concurrency=concurrency, requests=requests, threads=threads, rounds=rounds,
                   isolated_images=isolated_images, strategies=list(strategies or []),
                   transports=list(transports or []), runtime=runtime, backend=backend,
                   ray_address=ray_address)
    strategies = [s for s in STRATEGIES if s in set(strategies)]  # canonical order
    transports = [t for t in TRANSPORTS if t in set(transports)]
    t_start = time.perf_counter()
    artifact = load_artifact(artifact_dir)
    resolved_device = str(select_device(device))
    needs_original = any(s != "class-parallel" for s in strategies)
    model, record = load_original(artifact) if needs_original else (None, None)
    spec = artifact.spec.with_data_dir(data_dir)
    check_dataset(spec)
    out = Path(out_dir)
    check_out_dir(out)
    g = len(artifact.subnets)
    k = workers or g
    if "model-parallel" in strategies:
        k = stage_count(model, spec.input_shape, k, explicit=workers is not None)
    r = replicas or k
    if "class-parallel" in strategies:
        # Fails now, not after the baselines are ready, when a subnet's file is missing.
        runner_specs(artifact, device=device, runtime=runtime, threads=threads)
    n_requests = requests or max(images, 4 * concurrency)

    imgs = load_test_images(spec, images, seed, png="http" in transports)
    n = len(imgs)
    log.info("benchmarking %s (G=%d) on %d %s test images", artifact.manifest.model, g, n,
             spec.name)
    settings = {"strategies": strategies, "transports": transports, "images": n,
                "warmup": warmup, "rounds": rounds, "concurrency": concurrency,
                "throughput_requests": n_requests, "stages": k, "replicas": r, "subnets": g,
                "class_parallel_backend": backend, "ray_address": ray_address,
                "threads_per_worker": threads,
                "device": device, "device_resolved": resolved_device, "runtime": runtime,
                "seed": seed, "batch": 1, "isolated_images": isolated_images}
    result = envelope("sensai-bench", command=command, artifact=artifact, spec=spec,
                      settings=settings)
    result["accuracy"] = accuracy(artifact.manifest)
    result["shrink"] = shrink(artifact.manifest)
    result["strategies"] = {}
    gateway = GatewaySettings()  # the gateway's defaults (and SENSAI_* variables), as serve
    bar = progress_bar(progress)
    try:
        recipes: dict[str, Recipe] = {}
        if needs_original:
            recipes, plan = prepare_baselines(
                model, record, artifact, imgs, out / "models", stages=k, replicas=r,
                strategies=strategies, device=device, runtime=runtime, threads=threads,
                status=bar.set_description)
            if plan is not None:
                result["stage_plan"] = plan
                settings["stages"] = plan["num_stages"]
        if "class-parallel" in strategies:
            recipes["class-parallel"] = prepare_class_parallel(
                artifact, imgs, device=device, runtime=runtime, threads=threads)
        built: list[Strategy] = []
        try:
            for key in strategies:
                bar.set_description(f"load {key}")
                s = build(recipes[key], artifact, backend=backend, device=device,
                          runtime=runtime, threads=threads, settings=gateway,
                          ray_address=ray_address)
                built.append(s)
                result["strategies"][key] = s.info
            settings["runtime_resolved"] = sorted(
                {str(w.get("runtime")) for s in built for w in s.info["per_worker"]})
            per_transport = (warmup + n + n_requests) * len(built)
            bar.total = per_transport * len(transports) + (
                min(isolated_images, n) * g if "class-parallel" in strategies else 0)
            bar.refresh()
            with quiet_gc():
                asyncio.run(_measure(built, imgs, transports, warmup=warmup, rounds=rounds,
                                     concurrency=concurrency, n_requests=n_requests,
                                     gateway=gateway, bar=bar))
        finally:
            for s in built:
                _close(s)
        if "class-parallel" in strategies and isolated_images:
            # After the strategies are closed: each subnet alone, nothing else running.
            cp = result["strategies"]["class-parallel"]
            cp.update(isolated_compute(recipes["class-parallel"], imgs, isolated_images,
                                       cores=result["machine"].get("usable_cores") or 1,
                                       threads=threads, bar=bar))
    finally:
        bar.close()

    result["accuracy"]["on_bench_images"] = _measured_top1(result, n)
    result["targets"] = evaluate_targets(result)
    finish(result, t_start)
    write_outputs(out, "bench", result, render_markdown(result), plot)
    log.info("benchmark done in %.0f s -> %s", result["seconds"], out)
    return result


def _close(s: Strategy) -> None:
    try:
        asyncio.run(s.predictor.close())
    except Exception as e:  # closing is best effort; the measurements are already taken
        log.warning("closing %s: %s", s.key, e)


async def _measure(built: list[Strategy], imgs: TestImages, transports: Sequence[str], *,
                   warmup: int, rounds: int, concurrency: int, n_requests: int,
                   gateway: GatewaySettings, bar) -> None:
    n = len(imgs)
    for transport in transports:
        drivers: dict[str, Any] = {}
        client = None
        try:
            if transport != "inprocess":
                client = HttpClientProcess(imgs.pngs, [x.tobytes() for x in imgs.xs],
                                           list(imgs.xs[0].shape))
            for s in built:
                drivers[s.key] = (
                    InProcessDriver(s.predictor, imgs) if transport == "inprocess"
                    else await RemoteDriver.start(transport, s.predictor, client, gateway))
            for s in built:
                bar.set_description(f"{transport}: warm-up {s.key}")
                await warm_up(drivers[s.key], n, warmup)
                bar.update(warmup)
            samples = {s.key: Samples() for s in built}

            async def run_chunk(key: str, chunk) -> None:
                bar.set_description(f"{transport}: latency {key}")
                timed = await drivers[key].sequential(chunk)
                for j, (ms, pred, timings, floor) in zip(chunk, timed):
                    samples[key].add(ms, timings, pred == int(imgs.labels[j]), floor)
                bar.update(len(chunk))

            await interleaved([s.key for s in built], n, rounds, run_chunk)
            for s in built:
                bar.set_description(f"{transport}: throughput {s.key} (c={concurrency})")
                thr = await throughput(drivers[s.key], n_requests, concurrency)
                bar.update(n_requests)
                rep = samples[s.key].report()
                rep["throughput"] = thr
                rep["latencies_ms"] = [round(v, 4) for v in samples[s.key].latency]
                if samples[s.key].floor:  # request by request, beside latencies_ms
                    rep["floors_ms"] = [round(v, 4) for v in samples[s.key].floor]
                s.info["transports"][transport] = rep
        finally:
            for d in drivers.values():
                await d.close()
            if client is not None:
                await asyncio.to_thread(client.close)


def isolated_compute(recipe: Recipe, imgs: TestImages, count: int, *, cores: int, threads: int,
                     bar) -> dict[str, Any]:
    """Each subnet alone on a thread worker, one after the other, on the first ``count``
    images: its compute without neighbours competing for the cores."""
    bar.set_description("class-parallel: subnets one at a time")
    workers = WorkerSet(recipe.names, recipe.specs)

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {name: [] for name in recipe.names}
        for j in range(min(count, len(imgs))):
            for i, name in enumerate(recipe.names):
                times[name].append((await workers.run(i, imgs.xs[j]))[1])
            bar.update(len(recipe.names))
        return times

    try:
        times = asyncio.run(run())
    finally:
        workers.close()
    per = {k: summarize(v) for k, v in times.items()}
    p50s = [v["p50"] for v in per.values() if v["p50"] is not None]
    out: dict[str, Any] = {"isolated_compute_ms": per,
                           "isolated_compute_ms_p50_sum": round(sum(p50s), 4) if p50s else None,
                           "isolated_compute_ms_p50_max": round(max(p50s), 4) if p50s else None}
    if p50s and all(str(s.device) == "cpu" for s in recipe.specs):
        # G single-thread subnets on fewer cores cannot all finish before this, however cheap
        # the fan-out: the core-bound floor, next to the slowest subnet's own compute.
        out["core_bound_floor_ms"] = round(max(max(p50s), sum(p50s) * threads / cores), 4)
    return out


def _measured_top1(result: dict, n: int) -> dict[str, Any]:
    """Top-1 on this run's images: the original (any baseline) and the decomposed model."""
    def top1(keys: Sequence[str]) -> float | None:
        for key in keys:
            for rep in result["strategies"].get(key, {}).get("transports", {}).values():
                return rep["top1"]
        return None

    return {"images": n, "original_top1": top1(["single", "model-parallel", "data-parallel"]),
            "decomposed_top1": top1(["class-parallel"])}

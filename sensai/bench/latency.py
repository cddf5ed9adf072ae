"""``sensai bench``: single-image latency of class parallelism against the usual alternatives.

The strategies of :mod:`.strategies` run on the same real test images, runtime and threads per
worker, each in process and over each remote transport (``http``: PNG upload, ``http-v2``:
KServe v2 binary tensor, ``grpc``) against its own gateway on 127.0.0.1, from a client in its own
process.  Latency is taken at concurrency 1 in interleaved rounds (a change in the machine's load
hits every strategy alike), throughput afterwards.  Over a remote transport the client times the
bare request to the same server just before each request: the floor under any request.  The
subnets are also timed each alone, to separate their compute from competition for the cores.
``peers`` (:mod:`.server`) are timed over ``http-v2`` in the same rounds and compared in
:mod:`.comparison`.  Outputs: ``bench.json``, ``bench.md``, ``bench.png`` and ``models/``.
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
from sensai.serving.core.settings import MODEL_RUNTIMES, GatewaySettings
from sensai.serving.core.wakeup import check_mode, keep_cores_awake
from sensai.serving.gateway.server import run_like_the_gateway
from sensai.serving.launch.tritonserver import TRITON_HINT, find_tritonserver
from sensai.serving.workers.runners import resolve_runtime

from .accuracy import accuracy, shrink
from .baselines import WorkerSet
from .client import HttpClientProcess
from .comparison import comparison
from .harness import (InProcessDriver, RemoteDriver, TestImages, check_settings, envelope, finish,
                      inputs, interleaved, load_test_images, progress_bar, quiet_gc, throughput,
                      warm_up)
from .latency_report import plot, render_markdown
from .names import (BENCH_BACKENDS, PEER_LABELS, PEER_TRANSPORT, PEERS, STRATEGIES,
                    TRANSPORTS, UNTIMED_TRANSPORTS, strategy_key)
from .one_call import one_call_reference
from .options import BenchOptions
from .server import Server, start_peer
from .stats import Samples, summarize
from .strategies import (Recipe, Strategy, build, load_original, prepare_baselines,
                         prepare_class_parallel, stage_count)
from .targets import evaluate_targets

log = logging.getLogger(__name__)


def check_bench_settings(opts: BenchOptions) -> None:
    """Every option of ``sensai bench`` checked before anything is loaded."""
    backends = list(opts.backends)
    check_settings(
        opts, choices=(("strategy", opts.strategies, STRATEGIES),
                 ("transports", opts.transports, TRANSPORTS),
                 ("runtime", [opts.runtime], MODEL_RUNTIMES),
                 ("backend", backends, BENCH_BACKENDS), ("peer", opts.peers or [PEERS[0]], PEERS)))
    if opts.keep_cores_awake is not None:
        check_mode(opts.keep_cores_awake)
    if len(set(backends)) < len(backends):
        raise SensaiError(f"--backend names a backend twice: {' '.join(backends)}")
    if opts.ray_address and not {"ray", "ray-serve"} & set(backends):
        raise SensaiError("--ray-address is for --backend ray and ray-serve")
    pools = backends if "class-parallel" in opts.strategies else []  # what runs on them
    for pool, untimed in UNTIMED_TRANSPORTS.items():
        if pool in pools and not set(opts.transports) - set(untimed):
            raise SensaiError(f"--backend {pool} is timed over "
                              f"{' and '.join(t for t in TRANSPORTS if t not in untimed)} only: "
                              "add one to --transports")
    if "triton" in pools and find_tritonserver() is None:
        raise SensaiError(f"--backend triton: {TRITON_HINT}")
    if opts.peers and PEER_TRANSPORT not in opts.transports:
        raise SensaiError(f"the peers (--peers) are measured over {PEER_TRANSPORT} (the KServe "
                          "v2 binary tensor over HTTP, the one request they all take): add "
                          f"{PEER_TRANSPORT} to --transports")


def resolved_device(opts: BenchOptions) -> str:
    """The device ``--device`` names on this machine (auto: CUDA when present, else the CPU)."""
    return str(select_device(opts.device))


def run_bench(artifact_dir: str | Path, out_dir: str | Path,
              options: BenchOptions) -> dict[str, Any]:
    """Benchmark the artifact in ``artifact_dir``; write bench.json, bench.md, bench.png to
    ``out_dir``; return what bench.json holds.  ``options``: ``sensai bench``'s (``workers``: K,
    default G; ``replicas``: default K; ``backends``: each a class-parallel strategy;
    ``peers``: the original model on other systems; ``keep_cores_awake`` and
    ``spread_cores``: as for ``sensai serve``, held for the whole run and recorded in
    ``machine``; ``isolated_images``: images on which each subnet is also timed alone)."""
    check_bench_settings(options)
    opts = options.canonical()
    t_start = time.perf_counter()
    artifact = load_artifact(artifact_dir)
    model, record = original_model(artifact, opts)
    # Every setting checked before --out is made: a refused run leaves nothing behind.
    k, r = stages_and_replicas(artifact, opts, model, artifact.spec.input_shape)
    spec, out = inputs(artifact, opts.data_dir, out_dir)
    imgs = load_test_images(spec, opts.images, opts.seed, png="http" in opts.transports)
    log.info("benchmarking %s (G=%d) on %d %s test images", artifact.manifest.model,
             len(artifact.subnets), len(imgs), spec.name)
    result = new_result(opts, artifact, spec, images=len(imgs), stages=k, replicas=r)
    gateway, awake = hold_cores(opts, result)
    bar = progress_bar(opts.progress)
    try:
        recipes = prepare_recipes(artifact, opts, model, record, imgs, out / "models",
                                  stages=k, replicas=r, result=result, bar=bar)
        time_together(artifact, opts, recipes, imgs, result, gateway=gateway, log_dir=out,
                      bar=bar)
        time_alone(artifact, opts, recipes, imgs, result, bar)
    finally:
        bar.close()
        awake.release()
    result["accuracy"]["on_bench_images"] = _measured_top1(result, len(imgs))
    result["targets"] = evaluate_targets(result)
    finish(out, "bench", result, t_start, render_markdown, plot)
    log.info("benchmark done in %.0f s -> %s", result["seconds"], out)
    return result


def original_model(artifact, opts: BenchOptions):
    """The original model and its record where a baseline or a peer needs them, else (None,
    None)."""
    if opts.peers and resolve_runtime(opts.runtime, resolved_device(opts)) != "onnx":
        raise SensaiError("the peers (--peers) serve the original model's ONNX file: use "
                          "--runtime onnx (or auto on a CPU)")
    return load_original(artifact) if opts.needs_original else (None, None)


def stages_and_replicas(artifact, opts: BenchOptions, model, input_shape) -> tuple[int, int]:
    """K, model parallel's stages (``--stages``, default G, as the model allows), and data
    parallel's replicas (default K)."""
    k = opts.workers or len(artifact.subnets)
    if "model-parallel" in opts.strategies:
        k = stage_count(model, input_shape, k, explicit=opts.workers is not None)
    return k, opts.replicas or k


def new_result(opts: BenchOptions, artifact, spec, *, images: int, stages: int,
               replicas: int) -> dict[str, Any]:
    """What bench.json opens with: the envelope and its settings, the artifact's accuracy and
    shrink, no strategy yet."""
    settings = {"strategies": list(opts.strategies), "transports": list(opts.transports),
                "images": images, "warmup": opts.warmup, "rounds": opts.rounds,
                "concurrency": opts.concurrency, "throughput_requests": opts.n_requests,
                "stages": stages, "replicas": replicas, "subnets": len(artifact.subnets),
                "class_parallel_backend": opts.backends[0],
                "class_parallel_backends": list(opts.backends), "peers": list(opts.peers),
                "ray_address": opts.ray_address, "threads_per_worker": opts.threads,
                "device": opts.device, "device_resolved": resolved_device(opts),
                "runtime": opts.runtime, "seed": opts.seed, "batch": 1,
                "isolated_images": opts.isolated_images}
    result = envelope("sensai-bench", command=opts.command, artifact=artifact, spec=spec,
                      settings=settings)
    result["accuracy"] = accuracy(artifact.manifest)
    result["shrink"] = shrink(artifact.manifest)
    result["strategies"] = {}
    return result


def hold_cores(opts: BenchOptions, result: dict[str, Any]):
    """The gateway settings the served strategies take, and the idle cores kept awake as they
    say for the whole run (release it at the end); both recorded in ``machine``."""
    # The gateway's defaults (and SENSAI_* variables), as serve.
    keep = opts.keep_cores_awake
    gateway = GatewaySettings(**({} if keep is None else {"keep_cores_awake": keep}))
    awake = keep_cores_awake(gateway.keep_cores_awake)
    result["machine"]["cores_awake"] = awake.describe()
    result["machine"]["spread_cores"] = opts.spread_cores
    return gateway, awake


def prepare_recipes(artifact, opts: BenchOptions, model, record, imgs: TestImages,
                    models_dir: Path, *, stages: int, replicas: int, result: dict[str, Any],
                    bar) -> dict[str, Recipe]:
    """Each strategy's recipe: class parallel's from the artifact (first: it fails at once, not
    after the baselines are ready, when a subnet's file is missing), the baselines' from the
    original model (and the single device's where the peers need it)."""
    recipes: dict[str, Recipe] = {}
    if "class-parallel" in opts.strategies:
        recipes["class-parallel"] = prepare_class_parallel(artifact, imgs, opts)
    if opts.needs_original:
        # The peers serve the single device's ONNX file.
        baselines, plan = prepare_baselines(
            model, record, artifact, imgs, models_dir, opts, stages=stages, replicas=replicas,
            strategies=[*opts.strategies, "single"] if opts.peers else opts.strategies,
            status=bar.set_description)
        if plan is not None:
            result["stage_plan"] = plan
            result["settings"]["stages"] = plan["num_stages"]
        recipes.update(baselines)
    return recipes


def time_together(artifact, opts: BenchOptions, recipes: dict[str, Recipe], imgs: TestImages,
                  result: dict[str, Any], *, gateway: GatewaySettings, log_dir: Path,
                  bar) -> None:
    """Every strategy built (class parallel once per backend) and every peer started, then all
    timed in the same rounds (:func:`_measure`); each stopped after, whatever happens."""
    built: list[Strategy] = []
    peers: list[Server] = []
    try:
        for key in opts.strategies:
            pools = opts.backends if key == "class-parallel" else ["local"]
            for i, pool in enumerate(pools):
                name = strategy_key(pool, i == 0) if key == "class-parallel" else key
                bar.set_description(f"load {name}")
                s = build(recipes[key], artifact, opts, backend=pool, settings=gateway, key=name,
                          log_dir=log_dir)
                built.append(s)
                result["strategies"][name] = s.info
        result["settings"]["runtime_resolved"] = sorted(
            {str(w.get("runtime")) for s in built for w in s.info["per_worker"]})
        if opts.peers:
            result["peers"] = {}  # each filled in as it is measured
        for key in opts.peers:
            bar.set_description(f"start {key}")
            peer = start_peer(key, Path(recipes["single"].specs[0].onnx_path),
                              threads=opts.threads)
            if isinstance(peer, str):
                result["peers"][key] = {"label": PEER_LABELS[key], "skipped": peer}
            else:
                peers.append(peer)
                result["peers"][key] = peer.info
        n = len(imgs)
        timed = (opts.warmup + n + opts.n_requests) * sum(
            len(timed_over(t, built, peers)) for t in opts.transports)
        alone = min(opts.isolated_images, n) * (
            (len(artifact.subnets) if "class-parallel" in opts.strategies else 0)
            + (1 if opts.peers else 0))
        bar.total = timed + alone
        bar.refresh()
        with quiet_gc():
            run_like_the_gateway(_measure(
                built, peers, imgs, opts.transports, warmup=opts.warmup,
                rounds=opts.rounds, concurrency=opts.concurrency, n_requests=opts.n_requests,
                gateway=gateway, bar=bar))
    finally:
        for p in reversed(peers):
            p.stop()
        for s in built:
            _close(s)


def time_alone(artifact, opts: BenchOptions, recipes: dict[str, Recipe], imgs: TestImages,
               result: dict[str, Any], bar) -> None:
    """After the strategies and peers are stopped: each model alone, nothing else running."""
    cores = result["machine"].get("usable_cores") or 1
    reports = result["strategies"]

    def alone(key: str) -> dict[str, Any]:
        return isolated_compute(recipes[key], imgs, opts.isolated_images, cores=cores,
                                threads=opts.threads, bar=bar)

    if "class-parallel" in reports:
        reports["class-parallel"].update(alone("class-parallel"))
        bar.set_description("class-parallel: one call of every subnet")
        reports["class-parallel"]["one_call"] = one_call_reference(
            artifact, imgs.xs, device=resolved_device(opts), runtime=opts.runtime,
            threads=opts.threads, cores=cores)
    # On CUDA graphs: the GPU's own time per image, the floor class parallel aims for.
    for key in ("class-parallel", "single"):
        if key in reports:
            reports[key].update(graph_replay(recipes[key], bar))
    if opts.peers:
        result["comparison"] = comparison(result, original_compute_ms=alone("single").get(
            "isolated_compute_ms_p50_max"))


def _close(s: Strategy) -> None:
    try:
        if s.predictor is not None:
            asyncio.run(s.predictor.close())
    except Exception as e:  # closing is best effort; the measurements are already taken
        log.warning("closing %s: %s", s.key, e)
    finally:
        if s.stop is not None:
            s.stop()


def timed_over(transport: str, built: Sequence[Strategy],
               peers: Sequence[Server]) -> dict[str, Strategy | Server]:
    """What the run times over ``transport``, by key: every strategy that can be timed over it,
    and over PEER_TRANSPORT every peer."""
    return ({s.key: s for s in built if transport not in s.info.get("untimed_transports", {})}
            | {p.kind: p for p in (peers if transport == PEER_TRANSPORT else ())})


async def _driver(transport: str, x: Strategy | Server, imgs: TestImages, client,
                  gateway: GatewaySettings):
    """How ``x`` is called over ``transport``: a server of its own (a peer; class parallel as
    ``sensai serve``) at its address, left running; a predictor directly in process, else
    through a gateway of its own that the driver starts and stops."""
    server = x if isinstance(x, Server) else x.server
    if server is not None:
        return RemoteDriver(transport, None, client, server.url, server.model)
    if transport == "inprocess":
        return InProcessDriver(x.predictor, imgs)
    return await RemoteDriver.start(transport, x.predictor, client, gateway)


async def _measure(built: list[Strategy], peers: Sequence[Server], imgs: TestImages,
                   transports: Sequence[str], *, warmup: int, rounds: int, concurrency: int,
                   n_requests: int, gateway: GatewaySettings, bar) -> None:
    """Every strategy over every transport, and over PEER_TRANSPORT every peer with them, in
    the same interleaved rounds; each one's report goes into its ``info["transports"]``."""
    n = len(imgs)
    for transport in transports:
        drivers: dict[str, Any] = {}
        targets = timed_over(transport, built, peers)
        client = None
        try:
            if transport != "inprocess":
                client = HttpClientProcess(imgs.pngs, [x.tobytes() for x in imgs.xs],
                                           list(imgs.xs[0].shape))
            for key, x in targets.items():
                drivers[key] = await _driver(transport, x, imgs, client, gateway)
            for key in drivers:
                bar.set_description(f"{transport}: warm-up {key}")
                await warm_up(drivers[key], n, warmup)
                bar.update(warmup)
            samples = {key: Samples() for key in drivers}
            predictions: dict[str, list[int]] = {key: [] for key in drivers}

            async def run_chunk(key: str, chunk) -> None:
                bar.set_description(f"{transport}: latency {key}")
                timed = await drivers[key].sequential(chunk)
                for j, (ms, pred, timings, floor) in zip(chunk, timed):
                    samples[key].add(ms, timings, pred == int(imgs.labels[j]), floor)
                    predictions[key].append(int(pred))
                bar.update(len(chunk))

            await interleaved(list(drivers), n, rounds, run_chunk)
            for key in drivers:
                bar.set_description(f"{transport}: throughput {key} (c={concurrency})")
                thr = await throughput(drivers[key], n_requests, concurrency)
                bar.update(n_requests)
                rep = samples[key].report()
                rep["throughput"] = thr
                rep["latencies_ms"] = [round(v, 4) for v in samples[key].latency]
                if samples[key].floor:  # request by request, beside latencies_ms
                    rep["floors_ms"] = [round(v, 4) for v in samples[key].floor]
                rep["predictions"] = predictions[key]  # image by image, in the run's order
                targets[key].info["transports"][transport] = rep
        finally:
            for d in drivers.values():
                await d.close()
            if client is not None:
                await asyncio.to_thread(client.close)


def isolated_compute(recipe: Recipe, imgs: TestImages, count: int, *, cores: int, threads: int,
                     bar) -> dict[str, Any]:
    """Each of the recipe's workers (a subnet; the original model) alone on a thread worker, one
    after the other, on the first ``count`` images: its compute without neighbours competing
    for the cores (none: nothing to report)."""
    if not count:
        return {}
    bar.set_description(f"{recipe.key}: each worker alone")
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


def graph_replay(recipe: Recipe, bar, repeats: int = 200) -> dict[str, Any]:
    """Each worker on CUDA graphs rebuilt alone and its replay timed by CUDA events (nothing
    for workers on other runtimes)."""
    per: dict[str, float] = {}
    for name, spec in zip(recipe.names, recipe.specs):
        if spec.resolved_runtime() != "cuda-graph":
            continue
        bar.set_description(f"{recipe.key}: graph replay of {name}")
        runner = spec.build()
        if hasattr(runner, "replay_ms"):  # not when the capture fell back to eager
            per[name] = round(runner.replay_ms(repeats), 4)
        del runner
    if not per:
        return {}
    return {"graph_replay_ms": per, "graph_replay_ms_max": max(per.values())}


def _measured_top1(result: dict, n: int) -> dict[str, Any]:
    """Top-1 on this run's images: the original (any baseline) and the decomposed model."""
    def top1(keys: Sequence[str]) -> float | None:
        for key in keys:
            for rep in result["strategies"].get(key, {}).get("transports", {}).values():
                return rep["top1"]
        return None

    return {"images": n, "original_top1": top1(["single", "model-parallel", "data-parallel"]),
            "decomposed_top1": top1(["class-parallel"])}

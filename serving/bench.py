"""``sensai bench``: single-image latency of class parallelism against the usual alternatives.

One run measures, on the same real test images, the same runtime and the same thread/device budget
per worker (:mod:`serving.baselines` has the predictors, :mod:`serving.pools` the workers):

1. ``single`` - the original model on one worker;
2. ``model-parallel`` - the original model cut into K contiguous stages (:mod:`sensai.stages`) on K
   workers, the activation passed stage to stage through the same worker hand-off as (3);
3. ``class-parallel`` - sensAI: the G subnets on G workers, fan-out, then
   :func:`sensai.merge.merge_outputs`;
4. ``data-parallel`` - R replicas of the full model: more images per second, never a shorter
   latency for one image.

Each strategy is measured in process (the predictor called directly) and end to end over HTTP
(the gateway of :mod:`serving.app` under uvicorn on 127.0.0.1, PNG bytes in, JSON out, sent by a
client in its own process so that its work does not share this process's GIL), warm-up
excluded. The latency runs at concurrency 1 are interleaved: the images are split into rounds and
every strategy serves a round in turn, so a change in the machine's load (shared CPUs) hits all
strategies alike. Throughput is measured afterwards, strategy by strategy, at a chosen concurrency.

Each request's latency is split into ``compute`` (the runners' own time, clocked inside the worker
threads; for model parallelism the sum of the stages, for class parallelism the slowest subnet -
the floor no fan-out can beat), ``merge`` (outputs -> class scores) and ``transport`` (the rest:
executor hand-offs and the fan-out/gather inside the predictor - ``dispatch`` - plus HTTP, image
decoding and JSON outside it - ``http``).

Memory: all workers are threads of this process (as in the gateway's local pool), so the figures
are the growth of this process's resident set while each worker is loaded and warmed up, the
growth of its peak resident set while each strategy is built (Linux: the peak is reset before each
strategy), the weights and an activation estimate per worker, and on GPUs the growth of torch's
peak allocation and of the device's memory in use, per device (:class:`CudaMemory`). Worker
processes would give each worker its own RSS, but also pickling on every hop, i.e. another
transport than the gateway's.

Outputs in ``out_dir``: ``bench.json`` (every figure, the settings, the machine), ``bench.md``,
``bench.png`` (latency distributions and where the time goes), ``models/`` (the ONNX files of the
full model and of the stages).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import platform
import resource
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sensai.errors import CheckpointError, SensaiError

log = logging.getLogger(__name__)

STRATEGIES = ("single", "model-parallel", "class-parallel", "data-parallel")
TRANSPORTS = ("inprocess", "http")
LABELS = {"single": "single device", "model-parallel": "model parallel",
          "class-parallel": "class parallel (sensAI)", "data-parallel": "data parallel"}
# Targets of issue 5, end to end over HTTP, p50 (defined on a VGG-16-bn artifact).
TARGET_VS_SINGLE = 0.7
TARGET_VS_MODEL_PARALLEL = 0.5
TARGET_FANOUT_MS = 1.5
TARGET_MODEL = "vgg16_bn"


# --------------------------------------------------------------------------------------------
# Machine and memory


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def machine_description() -> dict[str, Any]:
    """CPU model and cores, memory, GPUs, library versions, load - to read the figures against."""
    from importlib.metadata import PackageNotFoundError, version

    cpu_model, physical = None, set()
    phys_id = None
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and cpu_model is None:
            cpu_model = value
        elif key == "physical id":
            phys_id = value
        elif key == "core id":
            physical.add((phys_id, value))
    cpu_model = cpu_model or platform.processor() or platform.machine() or None
    mem_total = None
    meminfo = _read("/proc/meminfo")
    if meminfo:
        for line in meminfo.splitlines():
            if line.startswith("MemTotal:"):
                mem_total = round(int(line.split()[1]) / 1024 ** 2, 1)
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    gpus: list[dict] = []
    cuda = None
    try:
        import torch

        if torch.cuda.is_available():
            cuda = torch.version.cuda
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append({"index": i, "name": p.name,
                             "memory_gb": round(p.total_memory / 1024 ** 3, 1)})
    except Exception as e:  # a broken CUDA install should not stop a CPU benchmark
        log.warning("cannot query GPUs: %s", e)
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "onnxruntime", "numpy", "ray", "fastapi", "uvicorn", "httpx",
                "onnx", "sensai"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    try:
        import onnxruntime as ort

        providers = ort.get_available_providers()
    except Exception:
        providers = []
    return {
        "cpu_model": cpu_model,
        "logical_cores": os.cpu_count(),
        "physical_cores": len(physical) or None,
        "usable_cores": affinity,
        "memory_gb": mem_total,
        "gpus": gpus,
        "cuda": cuda,
        "onnxruntime_providers": providers,
        "os": f"{platform.system()} {platform.release()}",
        "load_average": _load_average(),
        "versions": versions,
    }


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def rss_bytes() -> int | None:
    """Current resident set of this process (Linux), else None."""
    statm = _read("/proc/self/statm")
    if statm:
        return int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


def peak_rss_bytes() -> int:
    """Peak resident set (since the last :func:`reset_peak_rss`, or since the process started)."""
    status = _read("/proc/self/status")
    if status:
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class CudaMemory:
    """GPU memory a strategy takes while it loads and warms up, per CUDA device it uses.

    ``torch_peak_mb``: growth of torch's peak allocation (torch runners) over the baseline at
    :meth:`start`; ``device_used_mb``: growth of the memory in use on the whole device
    (``cudaMemGetInfo``), which also sees ONNX Runtime's CUDA allocations. Measured while the
    strategy is built, when the other strategies are idle, so they are the strategy's own.
    No-op without CUDA devices.
    """

    def __init__(self, devices: Sequence[str]):
        self.devices = sorted({str(d) for d in devices if str(d).startswith("cuda")})
        self._before: dict[str, tuple[int, int]] = {}

    def start(self) -> None:
        if not self.devices:
            return
        import torch

        for d in self.devices:
            dev = torch.device(d)
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            free, total = torch.cuda.mem_get_info(dev)
            self._before[d] = (torch.cuda.memory_allocated(dev), total - free)

    def growth_mb(self) -> dict[str, dict[str, float]]:
        if not self.devices:
            return {}
        import torch

        out = {}
        for d in self.devices:
            dev = torch.device(d)
            torch.cuda.synchronize(dev)
            alloc0, used0 = self._before.get(d, (0, 0))
            free, total = torch.cuda.mem_get_info(dev)
            peak = torch.cuda.max_memory_allocated(dev)
            out[d] = {"torch_peak_mb": round((peak - alloc0) / 1e6, 2),
                      "device_used_mb": round(((total - free) - used0) / 1e6, 2)}
        return out


# --------------------------------------------------------------------------------------------
# Statistics


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if not len(a):
        return {k: None for k in ("p50", "p90", "p99", "mean", "min", "max")} | {"n": 0}
    p50, p90, p99 = (round(float(v), 4) for v in np.percentile(a, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": round(float(a.mean()), 4),
            "min": round(float(a.min()), 4), "max": round(float(a.max()), 4), "n": int(len(a))}


@dataclass
class Samples:
    """Per-request figures of one strategy over one transport at concurrency 1."""

    latency: list[float] = field(default_factory=list)  # client-side, ms
    total: list[float] = field(default_factory=list)  # inside the predictor
    compute: list[float] = field(default_factory=list)  # critical path
    compute_sum: list[float] = field(default_factory=list)
    merge: list[float] = field(default_factory=list)
    per_worker: dict[str, list[float]] = field(default_factory=dict)
    correct: int = 0
    answered: int = 0

    def add(self, latency_ms: float, timings: dict[str, float], correct: bool) -> None:
        self.latency.append(latency_ms)
        self.total.append(float(timings.get("total", float("nan"))))
        self.compute.append(float(timings.get("compute", float("nan"))))
        self.compute_sum.append(float(timings.get("compute_sum", float("nan"))))
        self.merge.append(float(timings.get("merge", 0.0)))
        for k, v in timings.items():
            if k.startswith("compute."):
                self.per_worker.setdefault(k[len("compute."):], []).append(float(v))
        self.correct += bool(correct)
        self.answered += 1

    def report(self) -> dict[str, Any]:
        lat = np.asarray(self.latency)
        total = np.asarray(self.total)
        comp = np.asarray(self.compute)
        merge = np.asarray(self.merge)
        transport = lat - comp - merge
        return {
            "latency_ms": summarize(lat),
            "breakdown_ms": {
                # Means add up to the mean latency; medians of parts do not add up.
                "mean": {"compute": _r(np.nanmean(comp)), "merge": _r(np.nanmean(merge)),
                         "transport": _r(np.nanmean(transport)),
                         "dispatch": _r(np.nanmean(total - comp - merge)),
                         "http": _r(np.nanmean(lat - total))},
                "p50": {"compute": _r(np.nanmedian(comp)), "merge": _r(np.nanmedian(merge)),
                        "transport": _r(np.nanmedian(transport)),
                        "dispatch": _r(np.nanmedian(total - comp - merge)),
                        "http": _r(np.nanmedian(lat - total)),
                        "latency_minus_compute": _r(np.nanmedian(lat - comp))},
            },
            "compute_sum_ms": summarize(self.compute_sum),
            "per_worker_compute_ms": {k: summarize(v) for k, v in sorted(self.per_worker.items())},
            "top1": round(self.correct / self.answered, 5) if self.answered else None,
            "images": self.answered,
        }


def _r(v: float) -> float | None:
    return round(float(v), 4) if v is not None and math.isfinite(float(v)) else None


# --------------------------------------------------------------------------------------------
# HTTP: the gateway under uvicorn in a thread; the client runs in its own process


class GatewayServer:
    """``create_app(predictor)`` served by uvicorn on 127.0.0.1 (a free port), in a thread."""

    def __init__(self, predictor, *, startup_timeout_s: float = 30.0):
        import uvicorn

        from .app import create_app
        from .settings import GatewaySettings

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; no race with others
        self.port = self.sock.getsockname()[1]
        app = create_app(predictor, GatewaySettings(), close_predictor=False)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"gateway-{predictor.name}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise SensaiError(f"the gateway for {predictor.name} did not start on "
                                  f"127.0.0.1:{self.port}")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


# --------------------------------------------------------------------------------------------
# The strategies


@dataclass
class Strategy:
    key: str
    predictor: Any
    workers: list  # TimedWorker
    info: dict[str, Any]
    server: GatewayServer | None = None


def _resolved_runtime(runtime: str, device: str) -> str:
    if runtime == "auto":
        return "onnx" if device == "cpu" else "torch"
    return runtime


def _check_args(workers, replicas, images, warmup, concurrency, requests, threads, strategies,
                transports, rounds, runtime):
    from .pools import RUNTIMES

    for name, v, low in (("--workers", workers, 1), ("--replicas", replicas, 1),
                         ("--images", images, 1), ("--warmup", warmup, 0),
                         ("--concurrency", concurrency, 1), ("--requests", requests, 1),
                         ("--threads", threads, 1), ("--rounds", rounds, 1)):
        if v is not None and (not isinstance(v, int) or v < low):
            raise SensaiError(f"{name} must be an integer >= {low}, got {v!r}")
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise SensaiError(f"unknown strategy {', '.join(bad) or '(none)'}; choose from "
                          f"{', '.join(STRATEGIES)}")
    if not transports or any(t not in TRANSPORTS for t in transports):
        raise SensaiError(f"transports must be some of {', '.join(TRANSPORTS)}")
    if runtime not in RUNTIMES:
        raise SensaiError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")


def _check_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".bench-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SensaiError(f"cannot write to output directory {out}: {e.strerror or e}") from None


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
    ``out_dir``.

    ``workers``: K, the number of model-parallel stages (default: G, the number of subnets, so both
    parallel strategies use as many workers). ``replicas``: data-parallel replicas (default K).
    ``images``: real test images (stratified) timed at concurrency 1 in ``rounds`` interleaved
    rounds, after ``warmup`` untimed requests per strategy and transport. ``concurrency`` and
    ``requests`` (default: max(images, 4 x concurrency)): the throughput run. ``threads``: intra-op
    threads of every worker's runner. ``device``/``runtime``: as for ``sensai serve`` (auto: ONNX
    Runtime on CPUs, torch on GPUs), the same for every strategy. Returns what bench.json holds.
    The HTTP client is a spawned process, so a script calling this needs the usual
    ``if __name__ == "__main__":`` guard (the ``sensai`` command has it).
    """
    import torch

    from sensai.checkpoint import load_trained_model
    from sensai.data import encode_png, load_split, normalize, resolve_dataset, stratified_subset
    from sensai.manifest import load_manifest
    from sensai.models import select_device

    _check_args(workers, replicas, images, warmup, concurrency, requests, threads,
                list(strategies or []), list(transports or []), rounds, runtime)
    strategies = [s for s in STRATEGIES if s in set(strategies)]  # canonical order
    transports = [t for t in TRANSPORTS if t in set(transports)]
    t_start = time.perf_counter()
    art = Path(artifact_dir)
    manifest = load_manifest(art)
    if not manifest.subnets:
        raise CheckpointError(f"manifest in {art} lists no subnets (decomposition unfinished?)")
    dev = select_device(device)
    needs_original = any(s != "class-parallel" for s in strategies)
    model = record = None
    if needs_original:
        try:
            model, record = load_trained_model(manifest.source.model_dir)
        except CheckpointError as e:
            raise CheckpointError(f"the baselines need the original model the artifact was made "
                                  f"from ({manifest.source.model_dir}): {e}") from None
        if record.weights_sha256 != manifest.source.weights_sha256:
            raise CheckpointError(f"the model in {manifest.source.model_dir} is not the one "
                                  f"{art} was decomposed from (weights hash differs)")
    spec = manifest.dataset.to_spec().with_data_dir(data_dir)
    resolve_dataset(spec.name, spec.data_dir, spec.input_shape[1])
    out = Path(out_dir)
    _check_out_dir(out)
    g = len(manifest.subnets)
    k = workers or g
    if "model-parallel" in strategies:
        k = _stage_count(model, spec, k, explicit=workers is not None)
    r = replicas or k
    if "class-parallel" in strategies:
        from .pools import runner_specs

        # Fails now, not after the baselines are ready, when a subnet's file is missing.
        runner_specs(art, manifest, device=str(dev), runtime=runtime, threads=threads)
    n_requests = requests or max(images, 4 * concurrency)

    # ---- the images: the same real test images for every strategy and transport
    test = load_split(spec, "test")
    idx = stratified_subset(test.labels, images, seed)
    u8 = torch.stack([test[int(i)][0] for i in idx])
    labels = np.asarray(test.labels)[idx]
    xs = [normalize(u8[i:i + 1], spec).numpy() for i in range(len(idx))]
    pngs = [encode_png(u8[i]) for i in range(len(idx))] if "http" in transports else []
    n = len(xs)
    log.info("benchmarking %s (G=%d) on %d %s test images", manifest.model, g, n, spec.name)

    machine = machine_description()
    result: dict[str, Any] = {
        "kind": "sensai-bench", "schema_version": 1,
        "command": command, "created": _now(),
        "artifact": str(art.resolve()), "model": manifest.model, "dataset": spec.name,
        "groups": manifest.groups,
        "settings": {"strategies": list(strategies), "transports": list(transports),
                     "images": n, "warmup": warmup, "rounds": rounds, "concurrency": concurrency,
                     "throughput_requests": n_requests, "stages": k, "replicas": r, "subnets": g,
                     "threads_per_worker": threads, "device": str(dev), "runtime": runtime,
                     "seed": seed, "batch": 1},
        "machine": machine,
    }

    # ---- prepare runner recipes (ONNX files of the full model and the stages)
    models_dir = out / "models"
    recipes: dict[str, dict] = {}
    bar = _bar(progress)
    try:
        if needs_original:
            recipes.update(_prepare_baselines(model, record, manifest, spec, xs, models_dir, k,
                                              r, strategies, str(dev), runtime, threads, result,
                                              bar))
        if "class-parallel" in strategies:
            recipes["class-parallel"] = _prepare_class_parallel(art, manifest, spec, xs,
                                                                str(dev), runtime, threads)
        result["strategies"] = {}
        built: list[Strategy] = []
        try:
            for key in strategies:
                built.append(_build(key, recipes[key], art, spec, result, bar))
            result["settings"]["runtime_resolved"] = sorted(
                {str(w.get("runtime")) for s in result["strategies"].values()
                 for w in s["per_worker"]})
            asyncio.run(_measure(built, xs, pngs, labels, transports, warmup, rounds, concurrency,
                                 n_requests, isolated_images, result, bar))
        finally:
            for s in built:
                if s.server is not None:
                    s.server.close()
                _close(s.predictor)
    finally:
        bar.close()

    result["targets"] = evaluate_targets(result)
    result["machine"]["load_average_end"] = _load_average()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    from sensai.fsutil import write_json_atomic, write_text_atomic

    write_json_atomic(out / "bench.json", result)
    write_text_atomic(out / "bench.md", render_markdown(result))
    plot(result, out / "bench.png")
    log.info("benchmark done in %.0f s -> %s", result["seconds"], out)
    return result


def _now() -> str:
    from sensai.manifest import utc_now

    return utc_now()


def _bar(enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=0, desc="bench", unit="req", disable=not enabled, leave=False)


def _close(predictor) -> None:
    try:
        asyncio.run(predictor.close())
    except Exception as e:  # closing is best effort; the measurements are already taken
        log.warning("closing %s: %s", getattr(predictor, "name", "?"), e)


# --------------------------------------------------------------------------------------------
# Preparation


def _stage_count(model, spec, k: int, explicit: bool) -> int:
    """K checked against where the model can be cut, before any long work."""
    import torch

    from sensai.stages import plan_stages, trace

    k_max = plan_stages(trace(model, torch.zeros(1, *spec.input_shape)), 1)[0].max_stages
    if k > k_max:
        if explicit:
            raise SensaiError(f"--workers {k}: {model.__class__.__name__} can be cut into at most "
                              f"{k_max} stages with one tensor between consecutive stages")
        # The default K is G; a small model may have fewer places to cut.
        log.warning("model parallel: the model can be cut into at most %d stages; using %d "
                    "instead of G=%d", k_max, k_max, k)
        return k_max
    return k


def _prepare_baselines(model, record, manifest, spec, xs, models_dir: Path, k: int, r: int,
                       strategies, device: str, runtime: str, threads: int, result: dict,
                       bar) -> dict[str, dict]:
    import torch

    from sensai.export import export_onnx
    from sensai.flops import count_flops
    from sensai.models import count_params, device_for_worker
    from sensai.stages import export_stage_onnx, peak_activation_bytes, split_model

    from .baselines import ModuleRunnerFactory
    from .pools import RunnerSpec

    recipes: dict[str, dict] = {}
    check = torch.from_numpy(np.concatenate(xs[:32]))
    model = model.eval()
    params = count_params(model)
    flops = count_flops(model, spec.input_shape)
    act = peak_activation_bytes(model, check[:2])
    weights = Path(manifest.source.model_dir) / record.weights
    needs_onnx = any(_resolved_runtime(runtime, str(device_for_worker(i, device))) == "onnx"
                     for i in range(max(k, r)))
    full_onnx = models_dir / "full.onnx"
    if needs_onnx and any(s in strategies for s in ("single", "data-parallel")):
        bar.set_description("export full model")
        export_onnx(model, spec.input_shape, full_onnx, check_batch=check)

    def full_spec(name: str, i: int) -> RunnerSpec:
        return RunnerSpec(name=name, input_shape=tuple(spec.input_shape),
                          device=str(device_for_worker(i, device)), runtime=runtime,
                          threads=threads, onnx_path=str(full_onnx) if needs_onnx else None,
                          arch=record.model, num_outputs=record.num_classes,
                          in_channels=record.in_channels, weights_path=str(weights),
                          weights_sha256=record.weights_sha256)

    full_worker = {"params": params, "flops": flops, "weights_mb": round(params * 4 / 1e6, 3),
                   "activations_mb": round(act / 1e6, 3)}
    if "single" in strategies:
        recipes["single"] = {"names": ["full"], "factories": [full_spec("full", 0)],
                             "workers": [dict(full_worker)]}
    if "data-parallel" in strategies:
        names = [f"replica_{i:02d}" for i in range(r)]
        recipes["data-parallel"] = {"names": names,
                                    "factories": [full_spec(nm, i) for i, nm in enumerate(names)],
                                    "workers": [dict(full_worker) for _ in names]}
    if "model-parallel" in strategies:
        bar.set_description(f"cut into {k} stages")
        stages, plan = split_model(model, k, check)
        result["settings"]["stages"] = plan.num_stages
        result["stage_plan"] = plan.to_dict()
        names = [f"stage_{i:02d}" for i in range(plan.num_stages)]
        factories, infos = [], []
        h = check
        for i, (stage, nm) in enumerate(zip(stages, names)):
            dev_i = str(device_for_worker(i, device))
            in_shape = tuple(h.shape[1:])
            stage_act = peak_activation_bytes(stage, h[:2].clone())
            if _resolved_runtime(runtime, dev_i) == "onnx":
                bar.set_description(f"export stage {i + 1}/{plan.num_stages}")
                path = models_dir / f"{nm}.onnx"
                export_stage_onnx(stage, h, path)
                factories.append(RunnerSpec(name=nm, input_shape=in_shape, device=dev_i,
                                            runtime="onnx", threads=threads, onnx_path=str(path)))
            else:
                factories.append(ModuleRunnerFactory(nm, stage, in_shape, device=dev_i,
                                                     threads=threads))
            with torch.no_grad():
                h = stage(h.clone())
            p = plan.stage_params[i]
            infos.append({"params": p, "flops": plan.stage_macs[i],
                          "weights_mb": round(p * 4 / 1e6, 3),
                          "activations_mb": round(stage_act / 1e6, 3),
                          "input_shape": [1, *in_shape]})
        recipes["model-parallel"] = {"names": names, "factories": factories, "workers": infos}
    return recipes


def _prepare_class_parallel(art: Path, manifest, spec, xs, device: str, runtime: str,
                            threads: int) -> dict:
    import torch

    from sensai.pruning.decompose import load_subnets
    from sensai.stages import peak_activation_bytes

    from .pools import runner_specs

    specs = runner_specs(art, manifest, device=device, runtime=runtime, threads=threads)
    _, subnets = load_subnets(art, "cpu")
    example = torch.from_numpy(np.concatenate(xs[:2]))
    infos = []
    for rec, sub in zip(manifest.subnets, subnets):
        infos.append({"params": rec.params, "flops": rec.flops,
                      "weights_mb": round(rec.params * 4 / 1e6, 3),
                      "activations_mb": round(peak_activation_bytes(sub, example) / 1e6, 3),
                      "classes": list(rec.classes)})
    return {"names": [s.name for s in specs], "factories": specs, "workers": infos}


def _build(key: str, recipe: dict, art: Path, spec, result: dict, bar) -> Strategy:
    from .baselines import (DataParallelPredictor, ModelParallelPredictor, SingleDevicePredictor,
                            build_workers, class_parallel_predictor)

    bar.set_description(f"load {key}")
    infos = recipe["workers"]
    cuda = CudaMemory([getattr(f, "device", "cpu") for f in recipe["factories"]])
    gc.collect()
    peak_reset = reset_peak_rss()
    cuda.start()
    rss0 = rss_bytes()
    last = [rss0]

    def on_ready(i: int, w) -> None:
        now = rss_bytes()
        if now is not None and last[0] is not None:
            infos[i]["rss_load_mb"] = round((now - last[0]) / 1e6, 2)
        last[0] = now
        infos[i]["name"] = w.name
        infos[i].update({k: v for k, v in w.describe().items() if k in ("device", "runtime",
                                                                          "threads")})

    workers = build_workers(recipe["names"], recipe["factories"], on_ready=on_ready)
    if key == "single":
        predictor = SingleDevicePredictor(workers[0], spec, name="single")
    elif key == "model-parallel":
        predictor = ModelParallelPredictor(workers, spec, name="model-parallel")
    elif key == "data-parallel":
        predictor = DataParallelPredictor(workers, spec, name="data-parallel")
    else:
        predictor = class_parallel_predictor(art, workers, name="class-parallel")
    rss1 = rss_bytes()
    result["strategies"][key] = {
        "label": LABELS[key],
        "workers": len(workers),
        "per_worker": infos,
        "params_max_per_worker": max(i["params"] for i in infos),
        "flops_max_per_worker": max(i["flops"] for i in infos),
        "params_total": sum(i["params"] for i in infos),
        "flops_total": sum(i["flops"] for i in infos),
        "memory": {
            "rss_growth_mb": round((rss1 - rss0) / 1e6, 2) if rss0 and rss1 else None,
            "peak_rss_growth_mb": (round((peak_rss_bytes() - rss0) / 1e6, 2)
                                   if rss0 and peak_reset else None),
            "process_peak_rss_mb": round(peak_rss_bytes() / 1e6, 1),
            "peak_scope": "since this strategy started loading" if peak_reset
                          else "process lifetime (peak reset unavailable)",
            "cuda": cuda.growth_mb(),
        },
        "transports": {},
    }
    return Strategy(key, predictor, workers, result["strategies"][key])


# --------------------------------------------------------------------------------------------
# Measurement


async def _measure(built: list[Strategy], xs, pngs, labels, transports, warmup: int, rounds: int,
                   concurrency: int, n_requests: int, isolated_images: int, result: dict,
                   bar) -> None:
    n = len(xs)
    per_transport = warmup * len(built) + n * len(built) + n_requests * len(built)
    bar.total = per_transport * len(transports) + sum(
        isolated_images * len(s.workers) for s in built if s.key == "class-parallel")
    bar.refresh()
    for transport in transports:
        drivers: dict[str, Any] = {}
        client = None
        try:
            if transport == "http":
                from .http_client import HttpClientProcess

                client = HttpClientProcess(pngs)
            for s in built:
                if transport == "inprocess":
                    drivers[s.key] = _InProcessDriver(s.predictor, xs)
                else:
                    s.server = await asyncio.to_thread(GatewayServer, s.predictor)
                    drivers[s.key] = _HttpDriver(client, s.server.url)
            # Warm-up, excluded: first requests allocate buffers, open connections, fill caches.
            for s in built:
                bar.set_description(f"{transport}: warm-up {s.key}")
                await drivers[s.key].sequential([j % n for j in range(warmup)])
                bar.update(warmup)
            # Latency at concurrency 1, interleaved in rounds over the same images.
            samples = {s.key: Samples() for s in built}
            chunks = np.array_split(np.arange(n), min(rounds, n))
            for chunk in chunks:
                for s in built:
                    bar.set_description(f"{transport}: latency {s.key}")
                    gc.collect()
                    for j, (ms, pred, timings) in zip(chunk, await drivers[s.key].sequential(
                            [int(j) for j in chunk])):
                        samples[s.key].add(ms, timings, pred == int(labels[j]))
                    bar.update(len(chunk))
            # Throughput at the chosen concurrency, one strategy at a time.
            for s in built:
                bar.set_description(f"{transport}: throughput {s.key} (c={concurrency})")
                gc.collect()
                wall, latencies = await drivers[s.key].concurrent(n_requests, concurrency)
                bar.update(n_requests)
                rep = samples[s.key].report()
                rep["throughput"] = {"concurrency": concurrency, "requests": n_requests,
                                     "seconds": round(wall, 3),
                                     "images_per_s": round(n_requests / wall, 2),
                                     "latency_ms": summarize(latencies)}
                rep["latencies_ms"] = [round(v, 4) for v in samples[s.key].latency]
                s.info["transports"][transport] = rep
        finally:
            if client is not None:
                await asyncio.to_thread(client.close)
            for s in built:
                if s.server is not None:
                    await asyncio.to_thread(s.server.close)
                    s.server = None
    # Each subnet alone: its compute time without neighbours competing for the cores.
    from .baselines import run_sequentially

    for s in built:
        if s.key != "class-parallel":
            continue
        bar.set_description("class-parallel: subnets one at a time")
        times: dict[str, list[float]] = {w.name: [] for w in s.workers}
        for j in range(min(isolated_images, n)):
            for w, ms in zip(s.workers, await run_sequentially(s.workers, xs[j])):
                times[w.name].append(ms)
            bar.update(len(s.workers))
        s.info["isolated_compute_ms"] = {k: summarize(v) for k, v in times.items()}
        p50s = [v["p50"] for v in s.info["isolated_compute_ms"].values() if v["p50"] is not None]
        s.info["isolated_compute_ms_p50_sum"] = round(sum(p50s), 4) if p50s else None
        s.info["isolated_compute_ms_p50_max"] = round(max(p50s), 4) if p50s else None
        cores = result["machine"].get("usable_cores") or 1
        on_cpu = all(str(w.get("device", "cpu")) == "cpu" for w in s.info["per_worker"])
        if p50s and on_cpu:
            # G single-thread subnets on fewer cores cannot all finish before this, however
            # cheap the fan-out: the core-bound floor, next to the slowest subnet's own compute.
            threads = result["settings"]["threads_per_worker"]
            s.info["core_bound_floor_ms"] = round(max(max(p50s), sum(p50s) * threads / cores), 4)


class _InProcessDriver:
    """Calls the predictor from this event loop: no HTTP, no serialisation."""

    def __init__(self, predictor, xs):
        self.predictor, self.xs = predictor, xs

    async def _one(self, j: int) -> tuple[float, int, dict]:
        t0 = time.perf_counter()
        pred = await self.predictor.predict(self.xs[j])
        ms = (time.perf_counter() - t0) * 1e3
        return ms, int(np.argmax(pred.scores[0])), pred.timings_ms

    async def sequential(self, indices: list[int]) -> list[tuple[float, int, dict]]:
        return [await self._one(j) for j in indices]

    async def concurrent(self, n_requests: int, concurrency: int) -> tuple[float, list[float]]:
        counter = iter(range(n_requests))
        latencies: list[float] = []

        async def client() -> None:
            for j in counter:
                latencies.append((await self._one(j % len(self.xs)))[0])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


class _HttpDriver:
    """PNG requests to the gateway from the benchmark's client process (see http_client)."""

    def __init__(self, client, url: str):
        self.client, self.url = client, url

    async def sequential(self, indices: list[int]) -> list[tuple[float, int, dict]]:
        try:
            return await asyncio.to_thread(self.client.sequential, self.url, indices)
        except RuntimeError as e:
            raise SensaiError(f"HTTP benchmark client: {e}") from None

    async def concurrent(self, n_requests: int, concurrency: int) -> tuple[float, list[float]]:
        try:
            r = await asyncio.to_thread(self.client.concurrent, self.url, n_requests, concurrency)
        except RuntimeError as e:
            raise SensaiError(f"HTTP benchmark client: {e}") from None
        return r["seconds"], r["latencies"]


# --------------------------------------------------------------------------------------------
# Targets, report, plot


def evaluate_targets(result: dict) -> dict[str, Any]:
    """Issue 5's targets, over HTTP at p50; each one met, missed, or not measured (and why)."""
    strategies = result.get("strategies", {})

    def p50(key: str, transport: str) -> float | None:
        try:
            return strategies[key]["transports"][transport]["latency_ms"]["p50"]
        except KeyError:
            return None

    def overhead(transport: str) -> float | None:
        try:
            return strategies["class-parallel"]["transports"][transport]["breakdown_ms"]["p50"][
                "latency_minus_compute"]
        except KeyError:
            return None

    out: dict[str, Any] = {
        "transport": "http", "statistic": "p50",
        "applies_to": TARGET_MODEL,
        "this_model": result.get("model"),
        "note": (None if result.get("model") == TARGET_MODEL else
                 f"the targets are set for a {TARGET_MODEL} artifact; shown here for orientation"),
        "checks": [],
    }
    cp = p50("class-parallel", "http")
    for name, base, limit in (("class_parallel_vs_single", "single", TARGET_VS_SINGLE),
                              ("class_parallel_vs_model_parallel", "model-parallel",
                               TARGET_VS_MODEL_PARALLEL)):
        b = p50(base, "http")
        ratio = round(cp / b, 4) if cp is not None and b else None
        inproc = (p50("class-parallel", "inprocess"), p50(base, "inprocess"))
        out["checks"].append({
            "name": name, "rule": f"p50(class parallel) <= {limit} x p50({LABELS[base]})",
            "value": ratio, "limit": limit, "met": None if ratio is None else ratio <= limit,
            "inprocess_value": (round(inproc[0] / inproc[1], 4)
                                if inproc[0] is not None and inproc[1] else None),
            "why_not_measured": None if ratio is not None else "needs both strategies over HTTP",
        })
    ov = overhead("http")
    out["checks"].append({
        "name": "fanout_overhead_ms",
        "rule": f"p50(class-parallel latency - slowest subnet's compute) <= {TARGET_FANOUT_MS} ms",
        "value": ov, "limit": TARGET_FANOUT_MS,
        "met": None if ov is None else ov <= TARGET_FANOUT_MS,
        "inprocess_value": overhead("inprocess"),
        "why_not_measured": None if ov is not None else "needs class parallel over HTTP",
    })
    out["all_met"] = all(c["met"] for c in out["checks"]) if all(
        c["met"] is not None for c in out["checks"]) else None
    return out


def _fmt(v, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def latency_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, s in result.get("strategies", {}).items():
        for transport, t in s.get("transports", {}).items():
            lat, b = t["latency_ms"], t["breakdown_ms"]["p50"]
            rows.append([LABELS[key], transport, str(s["workers"]), _fmt(lat["p50"]),
                         _fmt(lat["p90"]), _fmt(lat["p99"]), _fmt(lat["mean"]),
                         _fmt(t["throughput"]["images_per_s"], 1), _fmt(b["compute"]),
                         _fmt(b["transport"]), _fmt(b["merge"], 3), _fmt(t["top1"], 4)])
    return rows


LATENCY_HEADER = ["strategy", "transport", "workers", "p50 ms", "p90 ms", "p99 ms", "mean ms",
                  "img/s", "compute p50", "transport p50", "merge p50", "top-1"]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in
                      enumerate(zip(r, widths))) for r in rows]
    return "\n".join([line, sep, *body])


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def worker_rows(result: dict) -> list[list[str]]:
    rows = []
    for key, s in result.get("strategies", {}).items():
        m = s["memory"]
        per = s["per_worker"]
        rss = [w.get("rss_load_mb") for w in per if w.get("rss_load_mb") is not None]
        rows.append([LABELS[key], str(s["workers"]), _human(s["params_max_per_worker"]),
                     _human(s["flops_max_per_worker"]), _human(s["flops_total"]),
                     _fmt(max((w["weights_mb"] + w["activations_mb"] for w in per), default=None)),
                     _fmt(max(rss) if rss else None), _fmt(m["rss_growth_mb"]),
                     _fmt(m["peak_rss_growth_mb"]),
                     ", ".join(f"{d}: {v['torch_peak_mb']} / {v['device_used_mb']}"
                               for d, v in m["cuda"].items()) or "-"])
    return rows


WORKER_HEADER = ["strategy", "workers", "params/worker (max)", "MACs/worker (max)", "MACs total",
                 "weights+act. MB/worker (max)", "RSS on load MB/worker (max)",
                 "RSS growth MB", "peak RSS growth MB", "CUDA MB (torch peak / device)"]


def render_table(result: dict) -> str:
    parts = [format_table(LATENCY_HEADER, latency_rows(result)), "",
             format_table(WORKER_HEADER, worker_rows(result))]
    t = result.get("targets")
    if t:
        parts.append("")
        for c in t["checks"]:
            state = {True: "MET", False: "NOT MET", None: "not measured"}[c["met"]]
            parts.append(f"target {c['rule']}: {_fmt(c['value'], 3)} -> {state}")
    return "\n".join(parts)


def render_markdown(result: dict) -> str:
    m = result["machine"]
    st = result["settings"]
    gpu = ", ".join(f"{x['name']} ({x['memory_gb']} GB)" for x in m["gpus"]) or "none"
    v = m["versions"]
    lines = [
        f"# sensai bench: {result['model']} on {result['dataset']}",
        "",
        f"Command: `{result.get('command') or 'run_bench(...)'}`",
        "",
        f"Artifact `{result['artifact']}`, {st['subnets']} subnets (groups {result['groups']}); "
        f"{st['images']} real test images at batch 1 and concurrency 1 in {st['rounds']} "
        f"interleaved rounds after {st['warmup']} warm-up requests per strategy and transport; "
        f"throughput: {st['throughput_requests']} requests at concurrency {st['concurrency']}. "
        f"Every worker: runtime {', '.join(st.get('runtime_resolved') or [st['runtime']])} "
        f"(--runtime {st['runtime']}) on {st['device']}, {st['threads_per_worker']} thread(s). "
        f"Model parallel: {st['stages']} stages; data parallel: {st['replicas']} replicas.",
        "",
        f"Machine: {m['cpu_model']}, {m['logical_cores']} logical cores "
        f"({m['usable_cores']} usable), {m['memory_gb']} GB; GPU: {gpu}; load average "
        f"{m.get('load_average')} at the start, {m.get('load_average_end')} at the end. "
        f"torch {v.get('torch')}, onnxruntime {v.get('onnxruntime')}, numpy {v.get('numpy')}, "
        f"ray {v.get('ray')}, fastapi {v.get('fastapi')}, uvicorn {v.get('uvicorn')}, "
        f"python {v.get('python')}.",
        "",
        "## Latency (ms, one image per request)",
        "",
        _md_table(LATENCY_HEADER, latency_rows(result)),
        "",
        *_summary_lines(result),
        "compute: the runners' own time measured inside the worker threads - the one run (single, "
        "data parallel), the sum of the stages (model parallel), the slowest subnet (class "
        "parallel: the floor). transport: latency - compute - merge (executor hand-offs, fan-out "
        "and gather; over HTTP also the request, PNG decoding and JSON). merge: outputs -> class "
        "scores (softmax, or merge_outputs for the subnets).",
        "",
        "## Where the time goes (mean ms; the parts add up to the mean latency)",
        "",
    ]
    rows = []
    for key, s in result["strategies"].items():
        for transport, t in s["transports"].items():
            b = t["breakdown_ms"]["mean"]
            rows.append([LABELS[key], transport, _fmt(t["latency_ms"]["mean"]), _fmt(b["compute"]),
                         _fmt(b["dispatch"]), _fmt(b["http"]), _fmt(b["merge"], 3),
                         _fmt(t["compute_sum_ms"]["mean"])])
    lines += [_md_table(["strategy", "transport", "latency", "compute (critical path)",
                         "dispatch (in predictor)", "http + decode (outside)", "merge",
                         "work done (all workers)"], rows), ""]
    cp = result["strategies"].get("class-parallel")
    if cp and cp.get("isolated_compute_ms"):
        lines += [
            "Class parallel, each subnet alone (no neighbour competing for the cores): p50 "
            f"compute of the slowest {_fmt(cp['isolated_compute_ms_p50_max'])} ms, sum over "
            f"subnets {_fmt(cp['isolated_compute_ms_p50_sum'])} ms"
            + (f"; with {m['usable_cores']} usable core(s) the subnets of one image cannot all be "
               f"done in less than {_fmt(cp['core_bound_floor_ms'])} ms (the core-bound floor)"
               if cp.get("core_bound_floor_ms") is not None else "") + ".", ""]
    lines += ["## Per worker", "", _md_table(WORKER_HEADER, worker_rows(result)), "",
              "MACs: multiply-accumulates of convolutions and linear layers per image "
              "(sensai.flops). Memory: the workers are threads of one process, so RSS figures are "
              "this process's growth while a worker / strategy was loaded and warmed up; "
              "weights+act. is float32 weights plus the largest set of activations alive at once "
              "(a lower bound of the runtime's working memory).", ""]
    if result.get("stage_plan"):
        p = result["stage_plan"]
        lines += [f"Model-parallel cut: {p['num_stages']} stages after "
                  f"{', '.join(p['boundaries']) or '-'} (MACs per stage "
                  f"{', '.join(_human(x) for x in p['stage_macs'])}; at most "
                  f"{p['max_stages']} stages possible).", ""]
    t = result["targets"]
    lines += ["## Targets (end to end over HTTP, p50)", ""]
    if t.get("note"):
        lines += [f"Note: {t['note']}.", ""]
    rows = [[c["rule"], _fmt(c["value"], 3), _fmt(c["inprocess_value"], 3),
             {True: "met", False: "NOT met", None: "not measured"}[c["met"]]] for c in t["checks"]]
    lines += [_md_table(["target", "HTTP", "in process (for reference)", "status"], rows), ""]
    busiest = max((s["workers"] for s in result["strategies"].values()), default=0)
    cores = m.get("usable_cores")
    if cores and not m["gpus"] and busiest * st["threads_per_worker"] > cores:
        lines += [f"Note: up to {busiest} workers x {st['threads_per_worker']} thread(s) shared "
                  f"{cores} usable cores, so the workers of one request waited for a core; "
                  "that wait counts as transport (dispatch), and a worker's compute time includes "
                  "time its thread was preempted. The 'each subnet alone' figures above show the "
                  "compute without that competition.", ""]
    lines += ["The machine's cores may have been shared with other work while this ran (see the "
              "load averages); compare figures from one run, not across runs.", ""]
    return "\n".join(lines)


def _summary_lines(result: dict) -> list[str]:
    """One sentence per transport comparing the strategies' p50 latency and throughput."""
    s = result["strategies"]
    out = []
    for t in TRANSPORTS:
        def get(key: str, what: str):
            rep = s.get(key, {}).get("transports", {}).get(t)
            if rep is None:
                return None
            return rep["latency_ms"]["p50"] if what == "p50" else rep["throughput"]["images_per_s"]

        parts = []
        cp, single = get("class-parallel", "p50"), get("single", "p50")
        mp = get("model-parallel", "p50")
        if cp and single:
            parts.append(f"class parallel p50 is {cp / single:.2f}x the single device's")
        if cp and mp:
            parts.append(f"{cp / mp:.2f}x model parallel's")
        dp = get("data-parallel", "p50")
        if dp and single:
            thr = get("data-parallel", "thr"), get("single", "thr")
            parts.append(f"data parallel p50 is {dp / single:.2f}x the single device's (one image "
                         f"is not cut up) for {thr[0] / thr[1]:.2f}x its throughput")
        if parts:
            out += [f"{'In process' if t == 'inprocess' else 'Over HTTP'}: " + "; ".join(parts)
                    + ".", ""]
    return out


def plot(result: dict, path: Path) -> None:
    """Latency distribution per strategy and transport, and the mean latency split in parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sensai.fsutil import atomic_path

    strategies = result["strategies"]
    transports = [t for t in TRANSPORTS if any(t in s["transports"] for s in strategies.values())]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    data, labels, colors = [], [], []
    palette = {"inprocess": "#4C72B0", "http": "#DD8452"}
    for key, s in strategies.items():
        for t in transports:
            samples = s["transports"].get(t, {}).get("latencies_ms")
            if samples:
                data.append(samples)
                labels.append(f"{LABELS[key].replace(' (sensAI)', '')}\n{t}")
                colors.append(palette[t])
    if data:
        # ``orientation`` replaced ``vert`` in matplotlib 3.10.
        horizontal = ({"orientation": "horizontal"}
                      if tuple(int(p) for p in matplotlib.__version__.split(".")[:2]) >= (3, 10)
                      else {"vert": False})
        parts = ax.boxplot(data, showfliers=True, patch_artist=True, whis=(1, 99),
                           flierprops={"markersize": 2}, **horizontal)
        for patch, c in zip(parts["boxes"], colors):
            patch.set_facecolor(c)
            patch.set_alpha(0.6)
        ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=8)
        ax.invert_yaxis()
    ax.set_xlabel("latency per image (ms), whiskers p1-p99")
    ax.set_title(f"{result['model']}: latency at concurrency 1")
    ax.grid(axis="x", alpha=0.3)

    ax = axes[1]
    names, comp, disp, http, merge = [], [], [], [], []
    for key, s in strategies.items():
        for t in transports:
            rep = s["transports"].get(t)
            if not rep:
                continue
            b = rep["breakdown_ms"]["mean"]
            names.append(f"{LABELS[key].replace(' (sensAI)', '')}\n{t}")
            comp.append(b["compute"] or 0)
            disp.append(max(0.0, b["dispatch"] or 0))
            http.append(max(0.0, b["http"] or 0))
            merge.append(b["merge"] or 0)
    y = np.arange(len(names))
    left = np.zeros(len(names))
    for vals, label, c in ((comp, "compute (critical path)", "#55A868"),
                           (disp, "dispatch / fan-out", "#C44E52"),
                           (merge, "merge", "#8172B2"), (http, "HTTP + decode", "#937860")):
        ax.barh(y, vals, left=left, label=label, color=c)
        left += np.asarray(vals)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per image")
    ax.set_title("where the time goes")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)

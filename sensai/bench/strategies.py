"""How ``sensai bench`` builds each strategy, and what each costs per worker: ``single`` (the
original model on one worker), ``model-parallel`` (K contiguous stages on K workers),
``class-parallel`` (exactly the predictor ``sensai serve`` builds, ``class-parallel@<backend>``
the same on each further backend; on ``ray-serve`` and ``processes``, ``sensai serve --backend
B`` itself, a server of its own) and ``data-parallel`` (R replicas).  The baselines run on the
same thread workers as the default class-parallel backend, with the same runtime, device and
threads; their ONNX files go to ``out/models``.  Each strategy is loaded under a
:class:`~.machine.MemoryProbe`, one at a time, so its memory figures are its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from sensai.artifact import Artifact
from sensai.checkpoint import load_trained_model
from sensai.errors import CheckpointError, SensaiError
from sensai.export import export_onnx
from sensai.flops import count_flops
from sensai.fsutil import sha256_file
from sensai.models import count_params
from sensai.serving.core.contract import Predictor
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.engine.plan import worker_devices
from sensai.serving.launch.build import build_predictor, launch_triton
from sensai.serving.workers.runners import RunnerSpec, resolve_runtime, runner_specs

from .baselines import BASELINES, WorkerSet
from .harness import TestImages, model_code_trusted
from .machine import MemoryProbe
from .names import UNTIMED_TRANSPORTS, label
from .options import BenchOptions, Workers
from .server import Server, serve_env, served, start_server
from .stages import export_stage_onnx, peak_activation_bytes, plan_stages, split_model, trace

SERVE_STARTUP_S = 300.0  # Ray, Serve and the replicas start on a busy machine too

log = logging.getLogger(__name__)


@dataclass
class Recipe:
    """What a strategy's workers run (one runner recipe each) and what each one costs."""

    key: str
    names: list[str]
    specs: list[RunnerSpec]
    workers: list[dict[str, Any]]  # params, flops, weights_mb, activations_mb per worker


@dataclass
class Strategy:
    key: str
    predictor: Predictor | None  # None: served by a server of its own only (``server``)
    recipe: Recipe
    info: dict[str, Any] = field(default_factory=dict)  # what bench.json holds for it
    # What it runs beside its predictor (a tritonserver), or instead of one (a gateway process).
    stop: Callable[[], None] | None = None
    server: Server | None = None  # the gateway of a strategy without a predictor in this process


def load_original(artifact: Artifact):
    """The model the artifact was decomposed from (the baselines run it), checked by hash."""
    source = artifact.manifest.source
    try:
        model, record = load_trained_model(source.model_dir, trust_code=model_code_trusted())
    except CheckpointError as e:
        raise CheckpointError(f"the baselines need the original model the artifact was made "
                              f"from ({source.model_dir}): {e}") from None
    if record.weights_sha256 != source.weights_sha256:
        raise CheckpointError(f"the model in {source.model_dir} is not the one {artifact.root} "
                              "was decomposed from (weights hash differs)")
    return model.eval(), record


def stage_count(model, input_shape: Sequence[int], k: int, *, explicit: bool) -> int:
    """K checked against where the model can be cut, before any long work."""
    k_max = plan_stages(trace(model, torch.zeros(1, *input_shape)), 1)[0].max_stages
    if k <= k_max:
        return k
    if explicit:
        raise SensaiError(f"--stages {k}: {model.__class__.__name__} can be cut into at most "
                          f"{k_max} stages with one tensor between consecutive stages")
    # The default K is G; a small model may have fewer places to cut.
    log.warning("model parallel: the model can be cut into at most %d stages; using %d instead "
                "of G=%d", k_max, k_max, k)
    return k_max


def _cost(params: int, flops: int, activation_bytes: int, **extra) -> dict[str, Any]:
    return {"params": params, "flops": flops, "weights_mb": round(params * 4 / 1e6, 3),
            "activations_mb": round(activation_bytes / 1e6, 3), **extra}


def prepare_baselines(model, record, artifact: Artifact, images: TestImages, models_dir: Path,
                      opts: Workers, *, stages: int, replicas: int, strategies: Sequence[str],
                      status: Callable[[str], None]) -> tuple[dict[str, Recipe], dict | None]:
    """Recipes of the baselines in ``strategies`` on the workers ``opts`` describe (device,
    runtime, threads), and the model-parallel stage plan."""
    spec, runtime, threads = artifact.spec, opts.runtime, opts.threads
    check = images.batch(32)
    cost = _cost(count_params(model), count_flops(model, spec.input_shape),
                 peak_activation_bytes(model, check[:2]))
    devices = worker_devices(max(stages, replicas), opts.device)
    full_onnx = models_dir / "full.onnx"
    if (any(resolve_runtime(runtime, d) == "onnx" for d in devices)
            and {"single", "data-parallel"} & set(strategies)):
        status("export full model")
        export_onnx(model, spec.input_shape, full_onnx, check_batch=check)
    full_sha = sha256_file(full_onnx) if full_onnx.is_file() else None

    def full(name: str, i: int) -> RunnerSpec:
        return RunnerSpec(
            name=name, input_shape=tuple(spec.input_shape), device=devices[i], runtime=runtime,
            threads=threads, onnx_path=str(full_onnx) if full_sha else None,
            onnx_sha256=full_sha, arch=record.model, num_outputs=record.num_classes,
            in_channels=record.in_channels,
            weights_path=str(Path(artifact.manifest.source.model_dir) / record.weights),
            weights_sha256=record.weights_sha256)

    # The single device is data parallel's one replica.
    replicated = {"single": ["full"],
                  "data-parallel": [f"replica_{i:02d}" for i in range(replicas)]}
    recipes = {key: Recipe(key, names, [full(nm, i) for i, nm in enumerate(names)],
                           [dict(cost) for _ in names])
               for key, names in replicated.items() if key in strategies}
    plan = None
    if "model-parallel" in strategies:
        status(f"cut into {stages} stages")
        modules, stage_plan = split_model(model, stages, check)
        plan = stage_plan.to_dict()
        names = [f"stage_{i:02d}" for i in range(stage_plan.num_stages)]
        specs, infos, h = [], [], check
        for i, (stage, name) in enumerate(zip(modules, names)):
            in_shape = tuple(h.shape[1:])
            act = peak_activation_bytes(stage, h[:2].clone())
            model_file: dict[str, Any] = {"runtime": runtime, "module": stage}
            if resolve_runtime(runtime, devices[i]) == "onnx":
                status(f"export stage {i + 1}/{stage_plan.num_stages}")
                path = models_dir / f"{name}.onnx"
                export_stage_onnx(stage, h, path)
                model_file = {"runtime": "onnx", "onnx_path": str(path),
                              "onnx_sha256": sha256_file(path)}
            specs.append(RunnerSpec(name=name, input_shape=in_shape, device=devices[i],
                                    threads=threads, **model_file))
            with torch.no_grad():
                h = stage(h.clone())
            infos.append(_cost(stage_plan.stage_params[i], stage_plan.stage_macs[i], act,
                               input_shape=[1, *in_shape]))
        recipes["model-parallel"] = Recipe("model-parallel", names, specs, infos)
    return recipes, plan


def prepare_class_parallel(artifact: Artifact, images: TestImages, opts: Workers) -> Recipe:
    """The subnets' recipes on the workers ``opts`` describe (checks their files now) and what
    each subnet costs."""
    trust = model_code_trusted()
    specs = runner_specs(artifact, device=opts.device, runtime=opts.runtime, threads=opts.threads,
                         trust_code=trust)
    example = images.batch(2)
    infos = []
    for rec, sub in zip(artifact.manifest.subnets, artifact.load_subnets("cpu", trust_code=trust)):
        infos.append(_cost(rec.params, rec.flops, peak_activation_bytes(sub.eval(), example),
                           classes=list(rec.classes)))
    return Recipe("class-parallel", [s.name for s in specs], specs, infos)


def _worker_fields(worker: dict, spec) -> dict[str, Any]:
    return {"device": worker.get("device"), "runtime": worker.get("runtime"),
            "threads": spec.threads, "worker": worker.get("name"), "node": worker.get("node")}


def served_workers(url: str) -> list[dict[str, Any]]:
    """The workers a gateway describes (``GET /v1/models``), as a predictor's ``describe()``."""
    workers = (served(url, timeout_s=30.0).get("predictor") or {}).get("workers")
    if not isinstance(workers, list):
        raise SensaiError(f"the gateway at {url} did not describe its workers (GET /v1/models)")
    return workers


def build(recipe: Recipe, artifact: Artifact, opts: BenchOptions, *, backend: str,
          settings: GatewaySettings, key: str | None = None,
          log_dir: Path | None = None) -> Strategy:
    """Load one strategy's workers (blocking) under a memory probe, as ``opts`` say (device,
    runtime, threads, Ray address, spread cores); ``key`` (default: the recipe's) names class
    parallel on a further backend.  Backend ``triton``: a ``tritonserver`` started for the
    artifact's subnets, stopped with the strategy.  Backends ``ray-serve`` and ``processes``:
    ``sensai serve --backend B`` in a process of its own on 127.0.0.1 (ray-serve: the Ray Serve
    application, on its own local Ray instance unless ``ray_address``; processes: a gateway
    process over device processes) with the run's device, runtime, threads and gateway
    settings, its log in ``log_dir``, stopped with the strategy and timed over HTTP only
    (bench.json's ``untimed_transports`` says why, for the run's transports)."""
    key = key or recipe.key
    parallel = recipe.key == "class-parallel"
    devices = (worker_devices(len(recipe.specs), opts.device) if parallel
               else [s.device for s in recipe.specs])
    # Class parallel as `sensai serve ART --backend B` runs it, with the gateway's defaults.
    served = settings.model_copy(update=dict(
        backend=backend, device=opts.device, runtime=opts.runtime,
        threads_per_worker=opts.threads, ray_address=opts.ray_address))
    triton = gateway = None
    with MemoryProbe(devices) as probe:
        if parallel and backend in UNTIMED_TRANSPORTS:
            gateway = start_server("sensai", artifact.root, timeout_s=SERVE_STARTUP_S,
                                   backend=backend, deadline_s=settings.deadline_s,
                                   env=serve_env(served), model=settings.model_name,
                                   log_path=Path(log_dir or ".") / f"gateway-{key}.log")
            try:
                described = served_workers(gateway.url)
            except BaseException:
                gateway.stop()
                raise
            predictor = None
        elif parallel:
            triton = (launch_triton(artifact.root, threads=opts.threads)
                      if backend == "triton" else None)
            try:
                predictor = build_predictor(artifact.root, served.model_copy(update=dict(
                    triton_url=triton.url if triton else None, spread_cores=opts.spread_cores)))
            except BaseException:
                if triton is not None:
                    triton.stop()
                raise
            described = predictor.describe()["workers"]
        else:
            workers = WorkerSet(recipe.names, recipe.specs, settings)
            predictor = BASELINES[key](workers, artifact.spec, key)
            described = workers.describe()
    served_by = len(described)
    if parallel:  # a worker is a device hosting several subnets: each subnet's first host
        hosts = {}
        for w in described:
            for g in w.get("groups") or ():
                hosts.setdefault(g, w)
        described = [hosts.get(i, {}) for i in range(len(recipe.specs))]
    per_worker = [dict(info, name=name, **_worker_fields(w, spec))
                  for info, name, w, spec in zip(recipe.workers, recipe.names, described,
                                                 recipe.specs)]
    info = {
        "label": label(key),
        "workers": served_by,
        "backend": backend if parallel else "local",
        "per_worker": per_worker,
        "params_max_per_worker": max(w["params"] for w in per_worker),
        "flops_max_per_worker": max(w["flops"] for w in per_worker),
        "params_total": sum(w["params"] for w in per_worker),
        "flops_total": sum(w["flops"] for w in per_worker),
        "memory": probe.figures,
        "transports": {},
    }
    if gateway is not None:
        info["gateway"] = {"command": gateway.command(), "url": gateway.url,
                           "startup_s": gateway.startup_s, "log": str(gateway.log_path)}
        info["untimed_transports"] = {t: why for t, why in UNTIMED_TRANSPORTS[backend].items()
                                      if t in opts.transports}
        return Strategy(key, None, recipe, info, gateway.stop, gateway)
    return Strategy(key, predictor, recipe, info, triton.stop if triton else None)

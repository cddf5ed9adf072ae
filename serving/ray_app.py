"""Ray Serve: one ``Subnet`` deployment per group, and the gateway as the HTTP ingress.

The application is built from the artifact's manifest by :func:`build_app` - the same function
``serve run deploy/ray-serve.yaml``, ``serve deploy`` and KubeRay's ``serveConfigV2`` call with
``args: {artifact: ...}``, and that ``sensai serve --backend ray`` uses:

* ``Subnet`` (one class, bound once per group under the names ``subnet_00`` ...) builds the
  subnet's runner in its replica: torch on the replica's GPU when Ray gave it one
  (``num_gpus: 1``), ONNX Runtime on CPU otherwise with as many threads as CPUs reserved;
* ``Gateway`` receives the subnets' handles, wraps them in a pool, and serves
  :func:`serving.app.create_app`'s routes (``@serve.ingress()`` with a per-replica app builder),
  fanning out with ``asyncio.gather``-style waiting on ``handle.remote(x)``.

Only the small raw subnet outputs travel back through handles; the merge runs in the gateway.
The artifact directory must be readable at the same path on every node that runs a replica
(shared filesystem, or baked into the container image).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from sensai.errors import SensaiError

from .predictor import ClassParallelPredictor, SubnetFailed, subnet_name

log = logging.getLogger(__name__)

APP_NAME = "sensai"


class RayAppArgs(BaseModel):
    """``args`` of the Serve application (YAML config, ``serve run ... artifact=DIR``, CLI)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    artifact: str = Field(description="decomposition artifact directory (same path on all nodes)")
    gpus: str | int = Field("auto", description="GPUs per subnet replica: auto (1 when the "
                                                "cluster has GPUs), 0 or 1")
    subnet_cpus: float | None = Field(None, gt=0, description="CPUs per subnet replica when no "
                                      "GPU is used (default: 1, or an even share when the "
                                      "cluster has fewer CPUs than replicas)")
    gateway_cpus: float | None = Field(None, ge=0)
    replicas: int = Field(1, ge=1, description="replicas per subnet")
    gateway_replicas: int = Field(1, ge=1)
    runtime: str = Field("auto", pattern=r"^(auto|onnx|torch)$")
    settings: dict[str, Any] = Field(default_factory=dict,
                                     description="GatewaySettings fields (model_name, deadline_s...)")


def _cluster_resources() -> tuple[float, float]:
    """(CPUs, GPUs) of the cluster when connected, else of this machine."""
    import ray

    if ray.is_initialized():
        res = ray.cluster_resources()
        return float(res.get("CPU", 0)), float(res.get("GPU", 0))
    try:
        import torch

        gpus = float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0
    except Exception:
        gpus = 0.0
    return float(os.cpu_count() or 1), gpus


@serve.deployment(max_ongoing_requests=8)
class Subnet:
    """One subnet's runner; ``__call__`` takes a normalized batch and returns the raw output."""

    def __init__(self, spec):
        import ray

        from .pools import RunnerSpec

        spec = RunnerSpec(**spec) if isinstance(spec, dict) else spec
        # Ray sets CUDA_VISIBLE_DEVICES to the replica's own GPU(s): inside, it is cuda:0.
        device = "cuda:0" if ray.get_gpu_ids() else "cpu"
        self.spec = replace(spec, device=device)
        self.runner = self.spec.build()
        log.info("%s ready on %s (%s)", spec.name, device, self.spec.resolved_runtime())

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # Sync method: Serve runs it in the replica's thread pool, off the event loop.
        return np.asarray(self.runner.run(x), dtype=np.float32)

    def describe(self) -> dict:
        return self.spec.describe()


class RayPool:
    """Subnets as Ray Serve deployments, reached through their handles."""

    def __init__(self, handles: list[DeploymentHandle], info: list[dict] | None = None):
        self.handles = list(handles)
        self.names = [subnet_name(i) for i in range(len(self.handles))]
        self.info = info or [{} for _ in self.handles]

    async def run(self, index: int, x: np.ndarray) -> np.ndarray:
        from ray.exceptions import RayError

        try:
            return await self.handles[index].remote(x)
        except RayError as e:
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise SubnetFailed(f"{self.names[index]} failed in Ray: {first}",
                               subnet=self.names[index]) from None

    def describe(self) -> dict:
        return {"kind": "ray", "subnets": [{"name": n, **i} for n, i in zip(self.names, self.info)]}

    async def close(self) -> None:
        return None


@serve.deployment
@serve.ingress()
class Gateway:
    def __init__(self, subnets: list[DeploymentHandle], artifact: str, settings: dict,
                 info: list[dict]):
        from sensai.manifest import load_manifest

        from .settings import GatewaySettings

        self.settings = GatewaySettings(**settings)
        manifest = load_manifest(artifact)
        self.predictor = ClassParallelPredictor(RayPool(subnets, info), manifest,
                                                name=self.settings.model_name,
                                                deadline_s=self.settings.deadline_s, backend="ray")

    def __serve_build_asgi_app__(self):
        from .app import create_app

        # The handles belong to Serve, nothing to close when the app stops.
        return create_app(self.predictor, self.settings, close_predictor=False)


def build_app(args: dict) -> serve.Application:
    """The Serve application for ``args`` (see :class:`RayAppArgs`); validates before binding."""
    from sensai.manifest import load_manifest

    from .pools import runner_specs
    from .settings import GatewaySettings

    try:
        a = RayAppArgs(**dict(args))
        settings = GatewaySettings(**a.settings)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise SensaiError(f"invalid Ray Serve app args ({loc}: {first.get('msg')})") from None
    artifact = str(Path(a.artifact).resolve())
    manifest = load_manifest(artifact)
    specs = runner_specs(artifact, manifest, device="cpu", runtime=a.runtime,
                         threads=settings.threads_per_worker)
    cpus, gpus = _cluster_resources()
    if a.gpus == "auto":
        use_gpu = gpus >= 1
    elif str(a.gpus) in ("0", "1"):
        use_gpu = str(a.gpus) == "1"
    else:
        raise SensaiError(f"gpus must be auto, 0 or 1 (one GPU per subnet replica), got {a.gpus!r}")
    n = len(specs) * a.replicas
    if a.subnet_cpus is not None:
        share = a.subnet_cpus
    elif use_gpu:
        share = 1.0
    else:
        # One CPU per subnet replica when the cluster has them; otherwise an even share so the
        # application can still be placed (fractional CPUs are only a scheduling budget).
        share = 1.0 if cpus >= n + a.gateway_replicas else max(0.01, round(cpus / (n + 1), 2))
        if share < 1.0:
            log.warning("cluster has %.0f CPUs for %d subnet replicas: %.2f CPU each", cpus, n,
                        share)
    gateway_cpus = a.gateway_cpus if a.gateway_cpus is not None else min(1.0, share)
    threads = max(1, int(share)) if not use_gpu else 1
    bound, info = [], []
    for spec in specs:
        spec_d = {**asdict(spec), "threads": threads}
        opts: dict[str, Any] = {"num_cpus": 1.0 if use_gpu else share}
        if use_gpu:
            opts["num_gpus"] = 1
        bound.append(Subnet.options(name=spec.name, num_replicas=a.replicas,
                                    ray_actor_options=opts).bind(spec_d))
        info.append({"replicas": a.replicas, **opts, "threads": threads})
    return Gateway.options(num_replicas=a.gateway_replicas,
                           ray_actor_options={"num_cpus": gateway_cpus}).bind(
        bound, artifact, settings.model_dump(), info)


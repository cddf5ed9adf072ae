"""The Ray Serve application: one deployment per worker, and the gateway as the HTTP ingress.

Built from the artifact's manifest by :func:`build_app` - the function ``serve run
deploy/ray-serve.yaml``, ``serve deploy`` and KubeRay's ``serveConfigV2`` call with
``args: {artifact: ...}``:

* ``SubnetWorker`` (bound once per worker as ``worker_00`` ...) hosts its groups' subnets with
  the same worker body as the Ray actor transport: torch on the replica's GPU when Ray gave it one
  (``num_gpus: 1``), ONNX Runtime on CPU otherwise;
* ``Gateway`` receives the workers' handles (Serve injects them), builds the one
  :class:`~sensai.serving.predictor.ClassParallelPredictor` over the
  :mod:`~sensai.serving.transports.ray_serve` transport, and serves
  :func:`sensai.serving.app.create_app`'s routes.

Only the small raw subnet outputs travel back through handles; the merge runs in the gateway.
On a cluster of several nodes the worker deployments are spread over the nodes, the copies of a
group on distinct nodes (as the Ray actor transport does).  The artifact directory must be
readable at the same path on every node that runs a replica (shared filesystem, or baked into
the container image): Serve rebuilds replicas long after the process that deployed the app is
gone, so the files cannot travel as objects of that process; a replica that cannot read them
fails with an error that names its node.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.raycluster import alive_nodes, share

from .app import create_app
from .messages import Fault, Ready, Skip
from .placement import Placement
from .predictor import ClassParallelPredictor
from .runners import RunnerSpec, runner_specs
from .settings import GatewaySettings
from .transports.ray_actors import RayWorkerBody, spread_plan
from .transports.ray_serve import ServeHandles

log = logging.getLogger(__name__)

APP_NAME = "sensai"
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it


class RayAppArgs(BaseModel):
    """``args`` of the Serve application (YAML config, ``serve run ... artifact=DIR``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    artifact: str = Field(description="decomposition artifact directory (same path on all nodes)")
    gpus: str | int = Field("auto", description="GPUs per worker replica: auto (1 when the "
                                                "cluster has GPUs), 0 or 1")
    worker_cpus: float | None = Field(None, gt=0, description="CPUs per worker replica when no "
                                      "GPU is used (default: 1, or an even share when the "
                                      "cluster has fewer CPUs than replicas)")
    gateway_cpus: float | None = Field(None, ge=0)
    gateway_replicas: int = Field(1, ge=1)
    redundancy: int = Field(0, ge=0, description="extra copies of every group (cyclic)")
    vote: bool = False
    runtime: str = Field("auto", pattern=r"^(auto|onnx|torch)$")
    settings: dict[str, Any] = Field(default_factory=dict,
                                     description="GatewaySettings fields (model_name, deadline_s...)")


@serve.deployment(max_ongoing_requests=64)
class SubnetWorker:
    """One worker's subnets (see :class:`~sensai.serving.transports.ray_actors.RayWorkerBody`)."""

    def __init__(self, name: str, hosted: list, seed: int):
        import ray

        hosted = [(g, RunnerSpec(**spec) if isinstance(spec, dict) else spec)
                  for g, spec in hosted]
        try:
            self.body = RayWorkerBody(name, hosted, Fault(), seed)
        except (SensaiError, OSError) as e:
            ctx = ray.get_runtime_context()
            raise SensaiError(f"{name} on node {ctx.get_node_id()} "
                              f"({ray.util.get_node_ip_address()}): {e}") from None

    def run(self, req: int, group: int, x, calls: int, copy: bool, hedge_s: float):
        return self.body.run(req, group, x, calls, copy, hedge_s)

    def skip(self, s: Skip) -> None:
        self.body.skip(s)

    def fault(self, f: Fault) -> None:
        self.body.fault(f)

    def ping(self) -> Ready:
        return self.body.ping()


@serve.deployment
@serve.ingress()
class Gateway:
    def __init__(self, workers: list[DeploymentHandle], artifact: str, settings: dict,
                 redundancy: int, vote: bool, runtime: str):
        self.settings = GatewaySettings(**settings)
        art = load_artifact(artifact)
        specs = runner_specs(art, device="cpu", runtime=runtime,
                             trust_code=self.settings.trust_model_code)
        placement = Placement.cyclic(len(specs), len(workers), redundancy, vote)
        self.predictor = ClassParallelPredictor(
            art, specs, ServeHandles(workers), placement, name=self.settings.model_name,
            deadline_s=self.settings.deadline_s, hang_timeout_s=None)

    def __serve_build_asgi_app__(self):
        # The replicas belong to Serve: nothing to stop when the app stops.
        return create_app(self.predictor, self.settings, close_predictor=False)


def spread_options(base: dict, placement: Placement, nodes: list[dict], *,
                   use_gpu: bool) -> list[dict]:
    """``ray_actor_options`` of each worker deployment that spread the workers over the nodes as
    the Ray actor transport does (:func:`~sensai.serving.transports.ray_actors.spread_plan`):
    a label selector on the planned node's id, and as fallback any other node, so that a
    replica of a lost node is replaced elsewhere when there is room."""
    plan, _, shared = spread_plan(placement, nodes, use_gpu=use_gpu, num_cpus=base["num_cpus"])
    if shared:
        log.warning("copies of subnet(s) %s share a node: losing that node loses them",
                    ", ".join(map(str, shared)))
    return [{**base, "num_cpus": cpus, "label_selector": {NODE_ID_LABEL: node["id"]},
             "fallback_strategy": [{"label_selector": {NODE_ID_LABEL: f"!{node['id']}"}}]}
            for node, cpus in plan]


def build_app(args: dict) -> serve.Application:
    """The Serve application for ``args`` (see :class:`RayAppArgs`); validates before binding."""
    import ray

    try:
        a = RayAppArgs(**dict(args))
        settings = GatewaySettings(**a.settings)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise SensaiError(f"invalid Ray Serve app args ({loc}: {first.get('msg')})") from None
    artifact = str(Path(a.artifact).resolve())
    art = load_artifact(artifact)
    specs = runner_specs(art, device="cpu", runtime=a.runtime,
                         threads=settings.threads_per_worker,
                         trust_code=settings.trust_model_code)
    placement = Placement.cyclic(len(specs), None, a.redundancy, a.vote)
    n = len(placement.workers)
    if ray.is_initialized():
        res = ray.cluster_resources()
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
    else:  # validated before any cluster exists (serve build, tests): assume enough
        cpus, gpus = float(n + a.gateway_replicas), 0.0
    if a.gpus == "auto":
        use_gpu = gpus >= 1
    elif str(a.gpus) in ("0", "1"):
        use_gpu = str(a.gpus) == "1"
    else:
        raise SensaiError(f"gpus must be auto, 0 or 1 (one GPU per worker replica), got {a.gpus!r}")
    if a.worker_cpus is not None:
        per = a.worker_cpus
    elif use_gpu or cpus >= n + a.gateway_replicas:
        per = 1.0
    else:
        # An even share that always fits, gateway included (fractional CPUs are a budget).
        per = share(cpus, n + a.gateway_replicas)
        log.warning("cluster has %g CPUs for %d worker replicas: %.2f CPU each", cpus, n, per)
    threads = max(1, int(per)) if not use_gpu else 1
    base: dict[str, Any] = {"num_cpus": 1.0 if use_gpu else per}
    if use_gpu:
        base["num_gpus"] = 1
    per_worker = [base] * n
    nodes = alive_nodes() if ray.is_initialized() else []
    if len(nodes) > 1:
        per_worker = spread_options(base, placement, nodes, use_gpu=use_gpu)
    bound = []
    for w, hosted in enumerate(placement.workers):
        opts = per_worker[w]
        spec_dicts = [(g, asdict(replace(specs[g], threads=threads))) for g in hosted]
        bound.append(SubnetWorker.options(name=f"worker_{w:02d}", num_replicas=1,
                                          ray_actor_options=opts).bind(
            f"worker_{w:02d}", spec_dicts, w))
    gateway_cpus = a.gateway_cpus if a.gateway_cpus is not None else min(1.0, per)
    return Gateway.options(num_replicas=a.gateway_replicas,
                           ray_actor_options={"num_cpus": gateway_cpus}).bind(
        bound, artifact, settings.model_dump(), a.redundancy, a.vote, a.runtime)

"""The Ray Serve application: one deployment per worker, and the gateway as the HTTP ingress.

Built from the artifact's manifest by :func:`build_app` - the function ``serve run
deploy/ray-serve.yaml``, ``serve deploy`` and KubeRay's ``serveConfigV2`` call with
``args: {artifact: ..., settings: {...}}``, ``settings`` being the gateway's own
:class:`~sensai.serving.core.settings.GatewaySettings` (redundancy, vote, device, runtime, ray_cpus,
keep_cores_awake...), honoured here as ``sensai serve`` honours them:

* ``SubnetWorker`` (bound once per worker as ``worker_00`` ...) hosts its groups' subnets with
  the same worker body as the Ray actor transport: torch on the replica's GPU when Ray gave it one
  (``num_gpus: 1``), ONNX Runtime on CPU otherwise; the ingress reaches it over the actor
  transport's direct socket, Serve's handle serving only to find and watch it;
* ``ServeIngress`` receives the workers' handles (Serve injects them), builds the one
  :class:`~sensai.serving.engine.predictor.ClassParallelPredictor` over the
  :mod:`~sensai.serving.transports.ray_serve` transport, and serves
  :func:`sensai.serving.gateway.app.create_app`'s routes: through Serve's proxy, and with
  ``own_port`` also on ``settings.host:port`` itself (sensai's own HTTP server on the replica's
  event loop, with the gateway's connection limits), which spares each request the proxy's handle
  call to the ingress and the ingress's call back for the body.  ``sensai serve --backend
  ray-serve`` runs Serve without a proxy and serves on that port alone.

Only the small raw subnet outputs travel back; the merge runs in the gateway.
On a cluster of several nodes the worker deployments are spread over the nodes, the copies of a
group on distinct nodes (as the Ray actor transport does).  The artifact directory must be
readable at the same path on every node that runs a replica (shared filesystem, or baked into
the container image): Serve rebuilds replicas long after the process that deployed the app is
gone, so the files cannot travel as objects of that process; a replica that cannot read them
fails with an error that names its node.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from sensai.artifact import Artifact, load_artifact
from sensai.errors import SensaiError
from sensai.raycluster import alive_nodes

from ..core.messages import Batching, Ready
from ..core.placement import Placement
from ..core.settings import GatewaySettings, check_backend, explain
from ..engine.plan import ServingPlan, class_parallel_plan, subnet_specs
from ..engine.predictor import ClassParallelPredictor
from ..gateway.app import create_app
from ..transports.ray_actors import RayWorkerBody, actor_resources, spread_plan
from ..transports.ray_serve import ServeHandles
from ..workers.runners import RunnerSpec

log = logging.getLogger(__name__)

APP_NAME = "sensai"
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it
HEALTH_HEADROOM = 8  # requests an ingress takes beyond what its admission holds (health checks)
PROXY_QUEUE = 16  # requests Serve's proxy holds for a busy ingress before it refuses


class RayAppArgs(BaseModel):
    """``args`` of the Serve application (YAML config, ``serve run ... artifact=DIR``): where the
    artifact is, whether the ingress serves on its own port, and the gateway's settings,
    embedded whole (the ingress replicas' number and CPUs among them)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    artifact: str = Field(description="decomposition artifact directory (same path on all nodes)")
    own_port: bool = Field(False, description="each ingress replica also serves the gateway on "
                           "settings.host:port of its node, past Serve's proxy (the port shared "
                           "by the replicas there, SO_REUSEPORT)")
    settings: GatewaySettings = Field(default_factory=GatewaySettings,
                                      description="the gateway's settings (deploy/README.md)")


# Requests reach a worker over its socket, not through Serve: Serve's calls are only ping,
# channel and one long watch per ingress, and a replica being stopped has nothing of Serve's to
# drain.
@serve.deployment(max_ongoing_requests=64, graceful_shutdown_timeout_s=2)
class SubnetWorker:
    """One worker's subnets (see :class:`~sensai.serving.transports.ray_actors.RayWorkerBody`)."""

    def __init__(self, name: str, hosted: list, seed: int, keep_awake: str = "off"):
        import ray

        hosted = [(g, RunnerSpec(**spec) if isinstance(spec, dict) else spec)
                  for g, spec in hosted]
        try:
            self.body = RayWorkerBody(name, hosted, seed, keep_awake)
        except (SensaiError, OSError) as e:
            ctx = ray.get_runtime_context()
            raise SensaiError(f"{name} on node {ctx.get_node_id()} "
                              f"({ray.util.get_node_ip_address()}): {e}") from None

    def ping(self) -> Ready:
        return self.body.ping()

    def channel(self, authkey: bytes, owner: str, batching: Batching | None) -> tuple[str, int]:
        return self.body.channel(authkey, owner, batching)

    def watch(self, owner: str) -> None:
        self.body.watch(owner)


@serve.deployment
@serve.ingress()
class ServeIngress:
    """The gateway of the Serve application: the predictor over the workers' handles, placed
    as :func:`build_app` placed the workers (the same settings), and
    :func:`~sensai.serving.gateway.app.create_app`'s routes."""

    async def __init__(self, workers: list[DeploymentHandle], artifact: str, settings: dict,
                       own_port: bool = False):
        self.settings = s = GatewaySettings(**settings)
        self.own_port, self.gateway_app = own_port, None
        art = load_artifact(artifact)
        # The predictor connects to every worker before it returns, through handle calls that
        # wait for their replicas: in a thread, while this loop serves the calls.
        self.predictor = await asyncio.to_thread(
            ClassParallelPredictor, art, worker_plan(art, s),
            ServeHandles(workers, asyncio.get_running_loop()))

    def __serve_build_asgi_app__(self):
        # The replicas belong to Serve: nothing to stop when the app stops.
        self.gateway_app = create_app(self.predictor, self.settings, close_predictor=False,
                                      own_port=self.own_port)
        return self.gateway_app

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose own port stopped serving is replaced."""
        app = self.gateway_app
        http = getattr(app.state, "http", None) if app is not None else None
        if http is not None and http.failed:
            raise RuntimeError(http.failed)


def worker_plan(art: Artifact, settings: GatewaySettings) -> ServingPlan:
    """The workers' plan as ``settings`` describe them: one rule for :func:`build_app`, which
    binds the workers, and the ingress, which reaches them.  Serve replaces dead and unhealthy
    replicas itself: no hang watchdog of ours."""
    return class_parallel_plan(art, settings, specs=subnet_specs(art, settings, device="cpu"),
                               own_devices=False, watch_hangs=False)


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

    given = dict(args).get("settings")
    # The settings would ignore an unknown key (the environment's SENSAI_* feed them too): a
    # misspelt one in a YAML file is refused, as --config refuses it.
    unknown = sorted(set(given) - set(GatewaySettings.model_fields)) \
        if isinstance(given, dict) else []
    if unknown:
        raise SensaiError(f"invalid Ray Serve app args: unknown setting {unknown[0]!r} in "
                          "settings (deploy/README.md lists them)")
    try:
        a = RayAppArgs(**dict(args))
    except ValidationError as e:
        raise SensaiError(f"invalid Ray Serve app args ({explain(e)})") from None
    # The application is the ray-serve backend, whatever the settings' backend field says.
    s = a.settings.model_copy(update={"backend": "ray-serve"})
    check_backend(s, behind_proxy=not a.own_port)
    artifact = str(Path(a.artifact).resolve())
    art = load_artifact(artifact)
    plan = worker_plan(art, s)
    n = len(plan.workers)
    if ray.is_initialized():
        res = ray.cluster_resources()
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
    else:  # validated before any cluster exists (serve build, tests): assume enough
        cpus = (s.ray_cpus or 1.0) * (n + s.gateway_processes())
        gpus = float(n) if s.device.startswith("cuda") else 0.0
    base, threads = actor_resources(n, cpus, gpus, device=s.device, cpus=s.ray_cpus,
                                    others=s.gateway_processes())
    per_worker = [base] * n
    nodes = alive_nodes() if ray.is_initialized() else []
    if len(nodes) > 1:
        per_worker = spread_options(base, plan.placement, nodes, use_gpu="num_gpus" in base)
    bound = []
    for w, wp in enumerate(plan.workers):
        spec_dicts = [(g, asdict(replace(spec, threads=threads)))
                      for g, spec in zip(wp.groups, wp.specs)]
        bound.append(SubnetWorker.options(name=wp.name, num_replicas=1,
                                          ray_actor_options=per_worker[w]).bind(
            wp.name, spec_dicts, w, s.keep_cores_awake))
    # An ingress replica is one event loop: a core at most, less where a worker gets less.
    gateway_cpus = min(1.0, base["num_cpus"])
    # The workers are shared: each gateway process admits its part of what they may hold, or
    # N processes would queue N times as much on them.
    s = s.model_copy(update={"max_predictions": -(-s.max_predictions // s.gateway_processes())})
    # Serve's proxy must shed what the ingress would refuse anyway, and before it costs the
    # hop to the ingress: under overload that hop, not the subnets, is what saturates first.
    # So the ingress takes what the gateway's admission can hold - the predictor's requests
    # and as many waiting for it, and a few more for health checks - and the proxy keeps a
    # short queue in front of it, refusing the rest at once with a 503.
    most = min(s.max_requests, 2 * s.max_predictions + HEALTH_HEADROOM)
    return ServeIngress.options(
        num_replicas=s.gateway_processes(), ray_actor_options={"num_cpus": gateway_cpus},
        max_ongoing_requests=most, max_queued_requests=PROXY_QUEUE,
        backpressure_config={"status_code": 503, "retry_after_s": 1},
        # Serve's access log line per request costs the ingress's one event loop as much as a
        # small part of a prediction; the gateway counts every request in its own metrics.
        logging_config={"enable_access_log": False}).bind(
        bound, artifact, s.model_dump(), a.own_port)

"""The class-parallel predictor of an artifact, on the transport the operator chose.

:func:`build_predictor` is what ``sensai serve``, ``sensai predict``, the benchmark and the demo
call, with the settings whole: it validates every setting against the backend and the artifact
before any worker starts, then blocks while the subnets load.  :func:`launch_triton` starts a
``tritonserver`` for an artifact when the operator has none (:func:`start_tritonserver`, for any
model repository).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import replace
from pathlib import Path
from typing import Callable

from sensai.artifact import Artifact, load_artifact
from sensai.errors import SensaiError
from sensai.optional import require
from sensai.raycluster import alive_nodes, cluster_resources, connect

from ..core.faults import Faults
from ..core.settings import GatewaySettings, check_backend, check_faults, load_settings
from ..engine.plan import class_parallel_plan, subnet_specs
from ..engine.predictor import ClassParallelPredictor
from ..transports.ray_actors import RayActors, actor_resources, node_options
from ..transports.threads import Threads
from .fleet import Fleet, OwnDevices
from .triton_repo import export_triton_repo, triton_model_name
from .tritonserver import TRITON_HINT, TritonServerProcess, find_tritonserver

log = logging.getLogger(__name__)

# The client library each backend needs beyond the gateway's own (the others need none).
BACKEND_NEEDS = {"ray": "ray", "ray-serve": "ray", "triton": "tritonclient"}


def check_backend_installed(backend: str) -> None:
    """One line, before anything starts, when what ``backend`` needs is not installed here."""
    if backend in BACKEND_NEEDS:
        require(BACKEND_NEEDS[backend], f"--backend {backend}")


def build_predictor(artifact_dir: str | Path, settings: GatewaySettings | None = None, *,
                    faults: Faults | None = None, seed: int = 0,
                    ray_share: float = 1.0) -> ClassParallelPredictor:
    """The class-parallel predictor of the artifact in ``artifact_dir`` under ``settings``
    (default: the ``SENSAI_*`` environment over the defaults), its workers on
    ``settings.backend``.  Every setting is checked against the backend and the artifact before
    any worker starts (one line on failure); then it blocks while the subnets load.
    ``faults``: injected into the workers (tests, benchmark).  ``ray_share``: the part of the
    Ray cluster's CPUs these workers may take (a model repository gives each version half, so a
    swap's two versions fit at once)."""
    s = settings if settings is not None else load_settings({})
    check_backend(s)
    check_faults(s, faults)
    if s.backend == "ray-serve":
        raise SensaiError("the ray-serve backend is a Ray Serve application with its own "
                          "gateway, not workers of this process: run 'sensai serve ART "
                          "--backend ray-serve'")
    check_backend_installed(s.backend)
    if s.backend == "ray":
        artifact_dir = Path(artifact_dir).resolve()  # actors may run in other directories
    artifact = load_artifact(artifact_dir)
    if s.backend == "local":
        plan = class_parallel_plan(artifact, s, faults=faults, seed=seed)
        return ClassParallelPredictor(artifact, plan, Threads(spread_cores=s.spread_cores))
    if s.backend == "processes":  # the device processes sensai serve's gateways reach, its own
        fleet = Fleet(artifact_dir, s, processes=0, faults=faults, seed=seed)
        transport = OwnDevices(fleet, row_shape=tuple(artifact.spec.input_shape))
        try:
            return ClassParallelPredictor(artifact, fleet.plan, transport)
        except BaseException:
            transport.close()
            raise
    if s.backend == "triton":
        return triton_predictor(artifact, s, seed=seed)
    return ray_predictor(artifact, s, faults=faults, seed=seed, ray_share=ray_share)


def triton_predictor(artifact: Artifact, s: GatewaySettings, *,
                     seed: int) -> ClassParallelPredictor:
    """The predictor over the Triton server at ``s.triton_url``, which serves the subnets."""
    from ..transports.triton import Triton

    if not s.triton_url:
        raise SensaiError("the triton backend needs the URL of a Triton server "
                          "(--triton-url host:port)")
    specs = subnet_specs(artifact, s, device="cpu", runtime="onnx")
    plan = class_parallel_plan(artifact, s, specs=specs, own_devices=False, seed=seed)
    models = [triton_model_name(g) for g in range(len(specs))]
    return ClassParallelPredictor(artifact, plan,
                                  Triton(s.triton_url, models, timeout_s=s.deadline_s))


def ray_predictor(artifact: Artifact, s: GatewaySettings, *, faults: Faults | None, seed: int,
                  ray_share: float) -> ClassParallelPredictor:
    """The predictor over Ray actors on the cluster at ``s.ray_address`` (see
    :func:`build_predictor` for ``ray_share``)."""
    # The device is chosen inside each actor (the GPU Ray gives it, else CPU); the CPU specs
    # check the files now.
    specs = subnet_specs(artifact, s, device="cpu")
    plan = class_parallel_plan(artifact, s, specs=specs, own_devices=False, faults=faults,
                               seed=seed)
    own = connect(s.ray_address)
    import ray  # heavy, only the ray backend needs it; imported after connect() set Ray up

    try:
        cpus, gpus = cluster_resources()
        cpus *= ray_share
        n = len(plan.workers)
        opts, ort_threads = actor_resources(n, cpus, gpus, device=s.device, cpus=s.ray_cpus)
        if "num_gpus" in opts and s.runtime_kind != "onnx":
            for sub in artifact.subnets:
                if not sub.weights.is_file():
                    raise SensaiError(f"weights file {sub.weights} of {sub.name} does not exist "
                                      "(needed for the torch runtime on GPUs)")
        nodes = alive_nodes()
        per_worker = opts
        if len(nodes) > 1:
            per_worker, node_of, shared = node_options(opts, plan.placement, nodes,
                                                       use_gpu="num_gpus" in opts)
            if shared:
                log.warning("copies of subnet(s) %s share a node: losing that node loses them "
                            "(%d nodes for %d workers with redundancy %d)",
                            ", ".join(map(str, shared)), len(nodes), n, s.redundancy)
        # The files travel through Ray's object store: no shared filesystem needed, and each
        # actor checks them against the manifest's hashes where it loads them.
        specs = [replace(spec, threads=ort_threads).shipped(ray.put) for spec in specs]
        plan = class_parallel_plan(artifact, s, specs=specs, own_devices=False, faults=faults,
                                   seed=seed)
        transport = RayActors(per_worker, own_ray=own, nodes=nodes, keep_awake=s.keep_cores_awake)
    except BaseException:
        if own:
            ray.shutdown()
        raise
    return ClassParallelPredictor(artifact, plan, transport)


def free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def start_tritonserver(fill: Callable[[Path, str], object], *,
                       missing: str = TRITON_HINT) -> TritonServerProcess:
    """A ``tritonserver`` on 127.0.0.1 (free ports) whose model repository, a directory in the
    server's private directory (removed when it stops), ``fill(repo, backend)`` writes for the
    Triton backend this server has: ``onnxruntime``, else ``python`` (ONNX Runtime inside
    Triton's Python backend).  ``missing``: the error when there is no ``tritonserver``."""
    install = find_tritonserver()
    if install is None:
        raise SensaiError(missing)
    backend = "onnxruntime" if "onnxruntime" in install.backends() or not install.backends() \
        else "python"
    http, grpc, metrics = free_ports(3)
    server = TritonServerProcess(None, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                 install=install)
    try:
        server.repo = server.workdir / "models"
        fill(server.repo, backend)
        server.backend = backend
        return server.start()
    except BaseException:
        server.stop()
        raise


def launch_triton(artifact_dir: str | Path, *, threads: int = 1) -> TritonServerProcess:
    """A ``tritonserver`` on 127.0.0.1 serving the artifact's subnets (exported into the
    server's private directory, removed when it stops)."""
    check_backend_installed("triton")  # the server is of no use without its client
    return start_tritonserver(lambda repo, backend: export_triton_repo(
        artifact_dir, repo, backend=backend, threads=threads),
        missing=TRITON_HINT + ", or pass --triton-url")

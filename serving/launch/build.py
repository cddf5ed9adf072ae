"""The class-parallel predictor of an artifact, on the transport the operator chose.

:func:`build_predictor` is what ``sensai serve``, ``sensai predict``, the benchmark and the demo
call: it validates every setting against the artifact before any worker starts, then blocks while
the subnets load.  :func:`launch_triton` starts a ``tritonserver`` for an artifact when the
operator has none (:func:`start_tritonserver`, for any model repository).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.optional import require
from sensai.raycluster import alive_nodes, cluster_resources, connect

from ..core.faults import DelaySpec
from ..core.messages import Batching
from ..core.placement import Placement
from ..core.settings import load_settings
from ..engine.predictor import ClassParallelPredictor, worker_devices
from ..transports.processes import Processes
from ..transports.ray_actors import RayActors, actor_resources, node_options
from ..transports.threads import Threads
from ..workers.runners import runner_specs
from .triton_repo import export_triton_repo
from .tritonserver import TRITON_HINT, TritonServerProcess, find_tritonserver

log = logging.getLogger(__name__)

# The client library each backend needs beyond the gateway's own (the others need none).
BACKEND_NEEDS = {"ray": "ray", "ray-serve": "ray", "triton": "tritonclient"}


def check_backend_installed(backend: str) -> None:
    """One line, before anything starts, when what ``backend`` needs is not installed here."""
    if backend in BACKEND_NEEDS:
        require(BACKEND_NEEDS[backend], f"--backend {backend}")


def build_predictor(artifact_dir: str | Path, *, backend: str = "local", redundancy: int = 0,
                    vote: bool = False, workers: int | None = None, device: str = "auto",
                    runtime: str = "auto", threads: int = 1, name: str = "sensai",
                    deadline_s: float = 5.0, hedge_ms: float = 0.0,
                    restart_delay_s: float = 0.0, hang_timeout_s: float | None = None,
                    delays: dict[int, DelaySpec | str] | None = None, corrupt: Sequence[int] = (),
                    seed: int = 0, ray_address: str | None = None, ray_cpus: float | None = None,
                    triton_url: str | None = None, trust_code: bool = False,
                    keep_awake: str = "off", spread_cores: bool = False,
                    batch_max_rows: int = 8, batch_delay_us: float = 0.0,
                    ray_share: float = 1.0) -> ClassParallelPredictor:
    """``workers`` (default G) workers on ``backend``, with ``redundancy`` extra copies of every
    group (``2r`` in vote mode); see :class:`ClassParallelPredictor` for the rest.  The keywords
    are :class:`GatewaySettings` fields and are validated as such (same bounds, same
    messages), before anything starts.  Host tunings, both off by default: ``keep_awake``,
    whether Ray actors keep their nodes' idle cores awake (:mod:`.wakeup`; the gateway's own
    machine is the gateway's to hold); ``spread_cores``, whether the local backend's worker
    threads are moved apart (:mod:`.transports.spread`).  ``batch_max_rows`` /
    ``batch_delay_us``: how every worker batches the requests it finds waiting
    (:class:`~sensai.serving.core.messages.Batching`; Triton's workers are batched by the server).
    ``ray_share``: the part of the Ray cluster's CPUs these workers may take (a model
    repository gives each version half, so a swap's two versions fit at once)."""
    load_settings(dict(backend=backend, workers=workers, redundancy=redundancy, vote=vote,
                       hedge_ms=hedge_ms, restart_delay_s=restart_delay_s, ray_cpus=ray_cpus,
                       deadline_s=deadline_s, hang_timeout_s=hang_timeout_s, runtime=runtime,
                       device=device, threads_per_worker=threads, model_name=name,
                       keep_cores_awake=keep_awake, spread_cores=spread_cores,
                       batch_max_rows=batch_max_rows, batch_delay_us=batch_delay_us))
    if backend == "ray-serve":
        raise SensaiError("the ray-serve backend is a Ray Serve application with its own "
                          "gateway, not workers of this process: run 'sensai serve ART "
                          "--backend ray-serve'")
    check_backend_installed(backend)
    if backend == "ray":
        artifact_dir = Path(artifact_dir).resolve()  # actors may run in other directories
    artifact = load_artifact(artifact_dir)
    placement = Placement.cyclic(len(artifact.subnets), workers, redundancy, vote)
    n = len(placement.workers)
    common = dict(name=name, deadline_s=deadline_s, hedge_ms=hedge_ms,
                  restart_delay_s=restart_delay_s, hang_timeout_s=hang_timeout_s,
                  delays=delays, corrupt=corrupt, seed=seed,
                  batching=Batching(batch_max_rows, batch_delay_us))
    if backend in ("local", "processes"):
        specs = runner_specs(artifact, device=device, runtime=runtime, threads=threads,
                             trust_code=trust_code, batch_rows=batch_max_rows)
        transport = Threads(spread_cores=spread_cores) if backend == "local" else Processes()
        return ClassParallelPredictor(artifact, specs, transport, placement,
                                      worker_devices=worker_devices(n, device), **common)
    if backend == "triton":
        from ..transports.triton import Triton

        if not triton_url:
            raise SensaiError("the triton backend needs the URL of a Triton server "
                              "(--triton-url host:port)")
        specs = runner_specs(artifact, device="cpu", runtime="onnx")
        return ClassParallelPredictor(artifact, specs, Triton(triton_url, timeout_s=deadline_s),
                                      placement, **common)
    # The device is chosen inside each actor (the GPU Ray gives it, else CPU); the CPU specs
    # check the files now.
    specs = runner_specs(artifact, device="cpu", runtime=runtime, threads=threads,
                         trust_code=trust_code, batch_rows=batch_max_rows)
    own = connect(ray_address)
    import ray  # heavy, only the ray backend needs it; imported after connect() set Ray up

    try:
        cpus, gpus = cluster_resources()
        cpus *= ray_share
        opts, ort_threads = actor_resources(n, cpus, gpus, device=device, cpus=ray_cpus)
        if "num_gpus" in opts and runtime != "onnx":
            for s in artifact.subnets:
                if not s.weights.is_file():
                    raise SensaiError(f"weights file {s.weights} of {s.name} does not exist "
                                      "(needed for the torch runtime on GPUs)")
        nodes = alive_nodes()
        per_worker = opts
        if len(nodes) > 1:
            per_worker, node_of, shared = node_options(opts, placement, nodes,
                                                       use_gpu="num_gpus" in opts)
            if shared:
                log.warning("copies of subnet(s) %s share a node: losing that node loses them "
                            "(%d nodes for %d workers with redundancy %d)",
                            ", ".join(map(str, shared)), len(nodes), n, redundancy)
        # The files travel through Ray's object store: no shared filesystem needed, and each
        # actor checks them against the manifest's hashes where it loads them.
        specs = [replace(s, threads=ort_threads).shipped(ray.put) for s in specs]
        transport = RayActors(per_worker, own_ray=own, nodes=nodes, keep_awake=keep_awake)
    except BaseException:
        if own:
            ray.shutdown()
        raise
    return ClassParallelPredictor(artifact, specs, transport, placement, **common)


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

"""Helpers shared by the serving test modules (real images, offline reference, gateways)."""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import torch

from sensai.artifact import load_artifact
from sensai.data import encode_png, normalize, stratified_subset
from sensai.merge import merge_outputs
from sensai.raycluster import connect
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.server import BackgroundServer
from sensai.serving.workers.loop import Stop, per_request

N_IMAGES = 24


def sample_images(fmnist_test, n: int = N_IMAGES, seed: int = 1):
    """``n`` stratified real test images: (indices, uint8 [n,1,28,28] tensor, labels)."""
    idx = stratified_subset(fmnist_test.labels, n, seed)[:n]
    return idx, fmnist_test.images[idx], fmnist_test.labels[idx]


def offline_scores(artifact, images_u8, spec) -> np.ndarray:
    """Offline evaluation's merged scores: the torch subnets from safetensors, merge_outputs."""
    art = load_artifact(artifact)
    with torch.inference_mode():
        x = normalize(images_u8, spec)
        outs = [m(x).float().numpy() for m in art.load_subnets("cpu")]
    return merge_outputs(outs, art.groups, art.manifest.num_classes)


def png(image_u8) -> bytes:
    return encode_png(image_u8)


def start_gateway(predictor, **settings) -> BackgroundServer:
    return BackgroundServer(create_app(predictor, GatewaySettings(**settings))).start()


def serve_with_grpc(predictor, **settings) -> tuple[BackgroundServer, str]:
    """The gateway with gRPC on a free port: (server, "127.0.0.1:grpc_port")."""
    app = create_app(predictor, GatewaySettings(grpc_port=0, **settings))
    server = BackgroundServer(app).start()
    return server, f"127.0.0.1:{app.state.grpc.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(proc, url: str, *, timeout_s: float) -> None:
    """Until ``sensai serve`` in ``proc`` reports ready at ``url``; fails with its stderr if it
    exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "sensai serve did not become ready"
        time.sleep(0.3)


@contextmanager
def server_process(argv, **popen_kw):
    """``argv`` (a ``sensai serve``) running for the block inside, its output piped; killed if
    it still runs when the block ends (a test that failed before stopping it)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_server(proc, *, timeout_s: float = 60) -> int:
    """SIGTERMs the server in ``proc`` and returns its exit status; one still running after
    ``timeout_s`` is killed (and its status is the kill's)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def serve_queued(core, runs) -> list:
    """Put ``runs`` on a worker loop's queue (a :class:`WorkerCore`), then let it serve them
    all: the per-request events it emitted."""
    q = queue.SimpleQueue()
    for r in [*runs, Stop()]:
        q.put(r)
    events = []
    core.serve(q, per_request(events.append))
    return events


def predict_all(predictor, xs, **kw):
    """One request per image, one after another, in a fresh event loop."""
    async def run():
        return [await predictor.predict(x[None], **kw) for x in xs]

    return asyncio.run(run())


def wait_until(condition, timeout_s: float, what: str, period_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(period_s)


@contextmanager
def local_ray(num_cpus: int):
    """A Ray instance of ``num_cpus`` CPUs on 127.0.0.1 for the tests inside; yields its GCS
    address (for ``--ray-address`` of a ``sensai`` subprocess)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    connect(num_cpus=num_cpus)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (``/proc``, Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # after "pid (comm)": comm may hold spaces


def process_name(pid: int) -> str | None:
    """Process ``pid``'s name (``/proc/PID/comm``, Linux), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None

"""The systems a user would pick instead of sensai, serving the original model: the peers of
``sensai bench --peers``.

* ``triton`` - Triton Inference Server: the ``tritonserver`` sensai's triton backend launches
  (:func:`~sensai.serving.launch.build.start_tritonserver`), the original model written into its
  repository as a subnet is (:func:`~sensai.serving.launch.triton_repo.write_model`);
* ``ray-serve`` - plain Ray Serve (:mod:`.ray_serve_peer`).

Both run the original model's ONNX file (the one the single-device strategy runs) with ONNX
Runtime and the run's threads per worker, and answer the benchmark client's KServe v2 binary
request over HTTP and its bare ``GET /v2/health/live``: the one harness times them
(:meth:`~.harness.RemoteDriver.attach`) in the same interleaved rounds as the strategies.  A peer
that cannot run here (no ``tritonserver``, a server that does not start) is skipped with a
one-line reason; :class:`Peers` stops every peer it started.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from sensai.errors import SensaiError
from sensai.optional import missing
from sensai.serving.launch.build import free_ports, start_tritonserver
from sensai.serving.launch.triton_repo import write_model
from sensai.serving.launch.tritonserver import TRITON_HINT, find_tritonserver

from .names import PEER_LABELS, PEER_TRANSPORT

log = logging.getLogger(__name__)

MODEL = "original"  # the name every peer serves the original model under


@dataclass
class Peer:
    """A running peer: its base URL, the model it serves, what bench.json says of it."""

    key: str
    url: str
    model: str
    stop: Callable[[], None]
    info: dict[str, Any] = field(default_factory=dict)


def _info(key: str, onnx: Path, threads: int, **extra) -> dict[str, Any]:
    return {"label": PEER_LABELS[key], "serves": "the original model", "onnx": str(onnx),
            "threads": threads, "transport": PEER_TRANSPORT, **extra, "transports": {}}


def start_triton_peer(onnx: Path, *, threads: int) -> Peer:
    server = start_tritonserver(lambda repo, backend: write_model(
        repo, MODEL, onnx, backend=backend, threads=threads))
    return Peer("triton", f"http://{server.url}", MODEL, server.stop,
                _info("triton", onnx, threads, triton_backend=server.backend,
                      tritonserver=server.install.source))


def start_ray_serve_peer(onnx: Path, *, threads: int) -> Peer:
    from .ray_serve_peer import serve_original  # Ray: only when this peer runs

    peer = serve_original(onnx, threads=threads, model=MODEL, port=free_ports(1)[0])
    import ray

    return Peer("ray-serve", peer.url, MODEL, peer.stop,
                _info("ray-serve", onnx, threads, ray=ray.__version__,
                      python=platform.python_version()))


STARTERS: dict[str, Callable[..., Peer]] = {"triton": start_triton_peer,
                                             "ray-serve": start_ray_serve_peer}


def unavailable(key: str) -> str | None:
    """Why peer ``key`` cannot run on this machine (one line), or None."""
    if key == "triton" and find_tritonserver() is None:
        return TRITON_HINT
    if key == "ray-serve":
        return missing("ray", "the Ray Serve peer")
    return None


class Peers:
    """The peers of one run: :meth:`start` starts them one after the other (each that cannot
    run is recorded in ``skipped`` with its reason), :meth:`stop` stops every one started."""

    def __init__(self) -> None:
        self.running: list[Peer] = []
        self.skipped: dict[str, str] = {}
        self.keys: list[str] = []

    def start(self, keys: Sequence[str], onnx: Path, *, threads: int,
              status: Callable[[str], None] = lambda _: None) -> None:
        for key in keys:
            self.keys.append(key)
            reason = unavailable(key)
            if reason is None:
                status(f"start {key}")
                try:
                    self.running.append(STARTERS[key](onnx, threads=threads))
                    continue
                except SensaiError as e:
                    reason = f"did not start: {e}"
            self.skipped[key] = " ".join(reason.split())  # one line
            log.warning("peer %s skipped: %s", key, self.skipped[key])

    def report(self) -> dict[str, dict[str, Any]]:
        """bench.json's ``peers``: each running peer's info, each skipped one's reason."""
        info = {p.key: p.info for p in self.running}
        return {k: info[k] if k in info else {"label": PEER_LABELS[k], "skipped": self.skipped[k]}
                for k in self.keys}

    def stop(self) -> None:
        while self.running:
            peer = self.running.pop()
            try:
                peer.stop()
            except Exception as e:  # stopping is best effort; the measurements are taken
                log.warning("stopping peer %s: %s", peer.key, e)

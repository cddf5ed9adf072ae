"""The server a benchmark measures, on 127.0.0.1: :func:`start_server` starts one of a kind,
ready; ``with`` it (or :meth:`Server.stop`) always ends it.  Kinds: ``sensai``, ``sensai serve``
in a process of its own (:class:`SensaiServe`); the peers, what a user would pick instead of
sensai, serving the original model's ONNX file (the single device's) with ONNX Runtime as
:data:`MODEL`: ``triton``, the ``tritonserver`` sensai's triton backend launches, the model
written into its repository as a subnet is; ``ray-serve``, plain Ray Serve
(:mod:`.ray_serve_peer`).  A peer that cannot run here is skipped with a one-line reason
(:func:`start_peer`)."""

from __future__ import annotations

import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

from sensai.errors import SensaiError
from sensai.optional import missing
from sensai.serving.core.settings import SECRETS, GatewaySettings, environment
from sensai.serving.launch import child
from sensai.serving.launch.build import free_ports, start_tritonserver
from sensai.serving.launch.signals import StopSignals
from sensai.serving.launch.triton_repo import write_model
from sensai.serving.launch.tritonserver import TRITON_HINT, find_tritonserver

from .names import PEER_LABELS, PEER_TRANSPORT

log = logging.getLogger(__name__)

MODEL = "original"  # the name every peer serves the original model under


# What :class:`SensaiServe` passes ``sensai serve`` itself, so serve_env leaves out.
OWN_SETTINGS = {"host", "port", "backend", "deadline_s"}


def serve_env(settings: GatewaySettings) -> dict[str, str]:
    """The variables that make ``sensai serve`` load ``settings``: each one given (or read from
    this environment, which it inherits anyway) as its ``SENSAI_*`` variable.  A value of None
    stays out: ``sensai serve`` loads it from the same environment."""
    return environment({f: v for f in sorted(settings.model_fields_set - OWN_SETTINGS
                                             - set(SECRETS))
                        if (v := getattr(settings, f)) is not None})


def served(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """What a gateway says it serves (``GET /v1/models``): its process, every version's
    workers; empty when it does not answer with a JSON object."""
    try:
        body = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def unavailable(kind: str) -> str | None:
    """Why a peer of ``kind`` cannot run on this machine (one line), or None."""
    if kind == "triton" and find_tritonserver() is None:
        return TRITON_HINT
    if kind == "ray-serve":
        return missing("ray", "the Ray Serve peer")
    return None


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds this process like Ctrl-C does (:class:`StopSignals`, never waited on), so
    the server is stopped either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with StopSignals():
        yield


class Server:
    """A running server: its ``url``, the ``model`` requests name, the processes the benchmark
    samples (``pid``: the one it started, ``serving_pid``: the one serving the routes; None: not
    sampled), ``info``: what a result records of a peer."""

    gateway = False  # sensai's gateway, with its /metrics and GET /v1/models
    pid: int | None = None
    serving_pid: int | None = None
    startup_s: float | None = None

    def __init__(self, kind: str, url: str, model: str, stop: Callable[[], Any],
                 info: dict[str, Any]):
        self.kind, self.url, self.model, self._stop, self.info = kind, url, model, stop, info

    def died(self) -> str | None:
        """Why the server is no longer there, or None."""
        return None

    def alive(self) -> bool:
        return self.died() is None

    def stop(self) -> None:
        """Best effort, once: the measurements are taken."""
        stop, self._stop = self._stop, lambda: None
        try:
            stop()
        except Exception as e:
            log.warning("stopping %s: %s", self.kind, e)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SensaiServe(Server):
    """``sensai serve SOURCE`` (an artifact or a model repository, ``args``: more options) on a
    free port in a process and session of its own, so its resident set is its own; its output to
    ``log_path``; it and every process it starts on ``cores`` (taskset).  Stopped as
    :mod:`sensai.serving.launch.child` stops a server (with ``setpriv``, also should the
    benchmark die)."""

    gateway = True

    def __init__(self, source: Path, *, backend: str | None = None,
                 deadline_s: float | None = None, env: dict[str, str], log_path: Path,
                 model: str = "sensai", args: Sequence[str] = (),
                 cores: list[int] | None = None):
        super().__init__("sensai", f"http://127.0.0.1:{free_ports(1)[0]}", model, lambda: None,
                         {})
        self.cores, self.backend, self.env, self.log_path = cores, backend, dict(env), log_path
        self.argv = [sys.executable, "-m", "sensai", "serve", str(source), "--host", "127.0.0.1",
                     "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning"]
        if backend is not None:
            self.argv += ["--backend", backend]
        if deadline_s is not None:
            self.argv += ["--deadline", f"{deadline_s:g}"]
        self.argv += list(args)
        # On its cores from its first instruction (and so every process it starts).
        self.pin = ["taskset", "--cpu-list", ",".join(map(str, cores))] if cores else []
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self._log = None

    def command(self) -> str:
        """The command line, with the environment variables set for it."""
        env = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join([*env, shlex.join([*self.pin, "sensai", *self.argv[3:]])])

    def start(self, timeout_s: float) -> "SensaiServe":
        """Launched, and ready within ``timeout_s``; stopped if it is not."""
        if self.pin and not shutil.which("taskset"):
            raise SensaiError("--set client_cores needs taskset (util-linux) to keep the "
                              "gateway off the clients' cores")
        try:
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen([*child.death_guard("TERM"), *self.pin, *self.argv],
                                         stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=os.environ | self.env,
                                         start_new_session=True)
            self.startup_s = round(child.wait_ready(
                f"{self.url}/v2/health/ready", timeout_s, what="the gateway",
                exited=lambda: self.proc.poll() is not None and f"exited with status "
                                                                f"{self.proc.returncode}",
                tail=lambda: f": {child.log_tail(self.log_path)} (log: {self.log_path})"), 2)
            # The process serving the routes: sensai serve's own, or on Ray Serve the ingress
            # replica's.
            pid = served(self.url).get("pid")
            self.serving_pid = pid if isinstance(pid, int) else self.pid
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def sampled(self) -> dict[str, Any]:
        """Which processes the benchmark samples: the one serving the routes, and the tree
        under ``sensai serve`` (the processes it started: workers, a local Ray instance)."""
        own = self.serving_pid in (None, self.pid)
        return {"pid": self.serving_pid, "tree_of": self.pid,
                "process": "the sensai serve process" if own else
                "the process serving the gateway's routes, as GET /v1/models reports it (with "
                f"--backend {self.backend}: the Serve ingress replica), not the sensai serve "
                "process"}

    def record(self) -> dict[str, Any]:
        """What a result records of the process."""
        return {"command": self.command(), "argv": self.argv, "env": self.env, "pid": self.pid,
                "serving_pid": self.serving_pid, "url": self.url, "startup_s": self.startup_s,
                "exit_code": self.exit_code, "log": str(self.log_path)}

    def report(self, rss_samples: list[dict[str, Any]]) -> dict[str, Any]:
        """What a result records of the process (``gateway``) and of its memory as sampled
        (``rss``)."""
        return {"gateway": self.record(),
                "rss": {"unit": "MB (10^6 bytes)",
                        "source": f"/proc/{self.serving_pid}/status VmRSS",
                        "sampled": self.sampled(), "t": "seconds since the gateway was ready",
                        "samples": rss_samples}}

    def died(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        return (f"the gateway exited with status {self.proc.returncode}: "
                f"{child.log_tail(self.log_path)} (log: {self.log_path})")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the gateway drains and stops its workers), SIGKILL if it is still there
        after ``timeout_s``; the process is reaped either way."""
        if self.proc is not None:
            self.exit_code = child.stop(self.proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None


def _peer_info(kind: str, onnx: Path, threads: int, **extra) -> dict[str, Any]:
    return {"label": PEER_LABELS[kind], "serves": "the original model", "onnx": str(onnx),
            "threads": threads, "transport": PEER_TRANSPORT, **extra, "transports": {}}


def start_server(kind: str, source: Path, *, timeout_s: float, threads: int = 1,
                 **sensai_serve) -> Server:
    """A server of ``kind`` serving ``source``, ready (within ``timeout_s``; Triton: its own
    limit): ``sensai``, :class:`SensaiServe` of ``source`` with ``sensai_serve``, its other
    arguments; ``triton`` or ``ray-serve``, the peer serving the ONNX file ``source`` with
    ``threads`` intra-op threads."""
    if kind == "sensai":
        return SensaiServe(source, **sensai_serve).start(timeout_s)
    if kind == "triton":
        triton = start_tritonserver(lambda repo, backend: write_model(
            repo, MODEL, source, backend=backend, threads=threads))
        return Server(kind, f"http://{triton.url}", MODEL, triton.stop,
                      _peer_info(kind, source, threads, triton_backend=triton.backend,
                                 tritonserver=triton.install.source))
    if kind == "ray-serve":
        import ray  # only when this peer runs

        from .ray_serve_peer import serve_original

        run = serve_original(source, threads=threads, model=MODEL, port=free_ports(1)[0],
                             startup_timeout_s=timeout_s)
        return Server(kind, run.url, MODEL, run.stop,
                      _peer_info(kind, source, threads, ray=ray.__version__,
                                 python=platform.python_version()))
    raise SensaiError(f"unknown server kind {kind!r}")


def start_peer(kind: str, onnx: Path, *, threads: int, timeout_s: float = 180.0
               ) -> Server | str:
    """The peer of ``kind`` started, or why it cannot run here (one line, logged)."""
    reason = unavailable(kind)
    if reason is None:
        try:
            return start_server(kind, onnx, timeout_s=timeout_s, threads=threads)
        except SensaiError as e:
            reason = f"did not start: {e}"
    reason = " ".join(reason.split())
    log.warning("peer %s skipped: %s", kind, reason)
    return reason


"""Running a ``tritonserver`` next to the gateway (``sensai serve --backend triton`` and tests).

:func:`find_tritonserver` looks for a binary (``$SENSAI_TRITONSERVER``, ``tritonserver`` on
``PATH``, or the one inside an installed or unpacked ``nvidia-pytriton`` wheel, see
``$SENSAI_PYTRITON_DIR``); :class:`TritonServerProcess` runs it on 127.0.0.1.  The child never
outlives the gateway: it gets a parent-death signal, runs in its own process group, and its
private directory (log, assembled backends, the model repository) is removed on stop - or, after
a SIGKILL of the gateway, by the next start (:func:`sweep_stale_workdirs`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sensai.errors import SensaiError

from . import child

log = logging.getLogger(__name__)

WORKDIR_PREFIX = "sensai-triton-"
OWNER = "owner.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_workdirs(root: str | Path | None = None) -> list[Path]:
    """Remove the private directories of servers whose gateway is gone; returns them."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*"):
        try:
            pid = int((d / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def set_parent_death_signal() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL) in the calling process (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None: the binary's default (/opt/tritonserver/backends)
    lib_dirs: list[Path] = field(default_factory=list)
    stub: Path | None = None  # Python backend stub for this interpreter (pytriton layout)
    source: str = ""

    def backends(self) -> list[str]:
        d = self.backend_dir or self.binary.parent.parent / "backends"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def _pytriton_roots() -> list[Path]:
    roots = []
    env = os.environ.get("SENSAI_PYTRITON_DIR")
    if env:
        roots.append(Path(env) / "pytriton" if (Path(env) / "pytriton").is_dir() else Path(env))
    try:
        spec = importlib.util.find_spec("pytriton")
        if spec and spec.submodule_search_locations:
            roots.extend(Path(p) for p in spec.submodule_search_locations)
    except (ImportError, ValueError):
        pass
    # deploy/setup.sh unpacks the wheel inside the virtual environment.
    roots.append(Path(sys.prefix) / "triton" / "pytriton")
    roots.append(Path.home() / ".cache" / "sensai" / "pytriton" / "pytriton")
    return roots


def find_tritonserver() -> TritonInstall | None:
    """A runnable ``tritonserver``, or None (callers say why and how to get one)."""
    env = os.environ.get("SENSAI_TRITONSERVER")
    if env and Path(env).is_file():
        return TritonInstall(Path(env), None, source="$SENSAI_TRITONSERVER")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, source="PATH")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for root in _pytriton_roots():
        ts = root / "tritonserver"
        binary = ts / "bin" / "tritonserver"
        stub = ts / "python_backend_stubs" / version / "triton_python_backend_stub"
        if binary.is_file():
            libs = [p for p in (root.parent / "nvidia_pytriton.libs",) if p.is_dir()]
            return TritonInstall(binary, ts / "backends", libs, stub if stub.is_file() else None,
                                 source=f"nvidia-pytriton at {root}")
    return None


TRITON_HINT = ("no tritonserver found: use a Triton container, put tritonserver on PATH, set "
               "SENSAI_TRITONSERVER, or unpack the nvidia-pytriton wheel with "
               "'pip install --no-deps --target ~/.cache/sensai/pytriton nvidia-pytriton'")


class TritonServerProcess:
    """A ``tritonserver`` child process serving ``repo``; ``with`` it or call start()/stop()."""

    def __init__(self, repo: str | Path | None, *, http_port: int, grpc_port: int, metrics_port: int,
                 install: TritonInstall | None = None, host: str = "127.0.0.1",
                 log_path: str | Path | None = None, startup_timeout_s: float = 120.0):
        self.repo = Path(repo) if repo is not None else None  # set before start()
        self.backend: str | None = None
        self.install = install or find_tritonserver()
        if self.install is None:
            raise SensaiError(TRITON_HINT)
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.startup_timeout_s = startup_timeout_s
        sweep_stale_workdirs()
        self._workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        (self._workdir / OWNER).write_text(str(os.getpid()))
        self.log_path = Path(log_path) if log_path else self._workdir / "tritonserver.log"
        self.proc: subprocess.Popen | None = None

    @property
    def workdir(self) -> Path:
        """A private directory removed by :meth:`stop` (e.g. for a model repository)."""
        return self._workdir

    @property
    def url(self) -> str:
        return f"{self.host}:{self.http_port}"

    def _backend_dir(self) -> Path | None:
        inst = self.install
        if inst.stub is None or inst.backend_dir is None:
            return inst.backend_dir
        # pytriton layout: the Python backend expects its stub beside libtriton_python.so, and the
        # wheel ships one stub per Python version - assemble a backend directory for ours.
        bdir = self._workdir / "backends"
        for b in inst.backend_dir.iterdir():
            if b.is_dir():
                shutil.copytree(b, bdir / b.name, symlinks=True)
        shutil.copy2(inst.stub, bdir / "python" / "triton_python_backend_stub")
        return bdir

    def _env(self) -> dict[str, str]:
        env = os.environ.copy()
        libs = [str(p) for p in self.install.lib_dirs]
        if self.install.stub is not None:
            # The stub embeds this interpreter: its own libpython must be found first.
            libdir = sysconfig.get_config_var("LIBDIR")
            if libdir:
                libs.insert(0, libdir)
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        # model.py imports numpy and onnxruntime from this environment.
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p and Path(p).is_dir()])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def command(self) -> list[str]:
        # The server dies with us even when we are SIGKILLed: setpriv (util-linux) sets the
        # parent-death signal before it execs tritonserver.  The parent is the thread that
        # starts it, so start it from a thread that lives as long as the server should.
        cmd = [*child.death_guard("KILL"), str(self.install.binary), f"--model-repository={self.repo}",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               "--strict-readiness=true", "--exit-on-error=true", "--log-verbose=0"]
        bdir = self._backend_dir()
        if bdir is not None:
            cmd.append(f"--backend-directory={bdir}")
        return cmd

    def start(self) -> "TritonServerProcess":
        cmd = self.command()
        log.info("starting %s", " ".join(cmd))
        self._log = open(self.log_path, "wb")
        # Without setpriv the child sets its parent-death signal itself, between fork and exec.
        pre = set_parent_death_signal if not child.SETPRIV and sys.platform == "linux" else None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self._env(), start_new_session=True, preexec_fn=pre)
        try:  # an interrupted or failed start leaves no server and no directory behind
            child.wait_ready(
                f"http://{self.url}/v2/health/ready", self.startup_timeout_s, what="tritonserver",
                exited=lambda: self.proc.poll() is not None and f"exited with code "
                                                                f"{self.proc.returncode}",
                tail=lambda: f": {self.log_tail()}")
            log.info("tritonserver ready at %s", self.url)
            return self
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 15) -> str:
        return child.log_tail(self.log_path, n)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None:
            child.stop(self.proc, timeout_s)
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "TritonServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

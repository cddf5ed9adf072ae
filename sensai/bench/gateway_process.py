"""``sensai serve ART`` (or a model repository) in a process (and session) of its own on
127.0.0.1, for the load and swap benchmarks: its resident set is its own, its output goes to a
log, and it is always stopped (SIGTERM, then SIGKILL; with ``setpriv`` it also gets SIGTERM
should the benchmark die), as :mod:`sensai.serving.launch.child` starts and stops a server."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

from sensai.errors import SensaiError
from sensai.serving.launch import child


def served(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """What a gateway says it serves (``GET /v1/models``): its process, every version's
    workers; empty when it does not answer with a JSON object."""
    try:
        body = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


class GatewayProcess:
    """``sensai serve ART`` on 127.0.0.1 in a process (and session) of its own; its output goes
    to ``log_path``.  ``artifact``: an artifact or a model repository; ``args``: more of
    ``sensai serve``'s options (``--model-control explicit``).  :meth:`start` waits until it
    is ready; :meth:`stop` always ends it."""

    def __init__(self, artifact: Path, *, port: int, backend: str | None,
                 deadline_s: float | None, env: dict[str, str], log_path: Path,
                 args: Sequence[str] = (), cores: list[int] | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.cores = cores
        self.argv = [sys.executable, "-m", "sensai", "serve", str(artifact), "--host",
                     "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        if backend is not None:
            self.argv += ["--backend", backend]
        if deadline_s is not None:
            self.argv += ["--deadline", f"{deadline_s:g}"]
        self.argv += list(args)
        self.backend = backend
        self.env = dict(env)
        self.log_path = log_path
        self.serving_pid: int | None = None  # the process serving the routes, once ready
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.startup_s: float | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> str:
        """The gateway's command line, with the environment variables set for it."""
        env = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        pin = ["taskset", "--cpu-list", ",".join(map(str, self.cores))] if self.cores else []
        return " ".join([*env, shlex.join([*pin, "sensai", *self.argv[3:]])])

    def launch(self) -> None:
        self._log = open(self.log_path, "wb")
        # On its cores from its first instruction (and so every process it starts).
        pin = (["taskset", "--cpu-list", ",".join(map(str, self.cores))]
               if self.cores and shutil.which("taskset") else [])
        if self.cores and not pin:
            raise SensaiError("--set client_cores needs taskset (util-linux) to keep the gateway off "
                              "the clients' cores")
        self.proc = subprocess.Popen([*child.death_guard("TERM"), *pin, *self.argv],
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=os.environ | self.env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        self.startup_s = round(child.wait_ready(
            f"{self.url}/v2/health/ready", timeout_s, what="the gateway",
            exited=lambda: self.proc.poll() is not None and f"exited with status "
                                                            f"{self.proc.returncode}",
            tail=lambda: f": {self.last_line()} (log: {self.log_path})"), 2)
        self.serving_pid = self.reported_pid()

    def reported_pid(self) -> int | None:
        """The process that serves the gateway's routes, as the gateway reports it
        (``GET /v1/models``): ``sensai serve``'s own, or on Ray Serve the ingress replica's."""
        pid = served(self.url).get("pid")
        return pid if isinstance(pid, int) else self.pid

    def sampled(self) -> dict[str, Any]:
        """Which processes the benchmark samples: the one serving the routes, and the tree
        under ``sensai serve`` (the processes it started: workers, a local Ray instance)."""
        own = self.serving_pid in (None, self.pid)
        return {"pid": self.serving_pid, "tree_of": self.pid,
                "process": "the sensai serve process" if own else
                "the process serving the gateway's routes, as GET /v1/models reports it (with "
                f"--backend {self.backend}: the Serve ingress replica), not the sensai serve "
                "process"}

    def report(self, rss_samples: list[dict[str, Any]]) -> dict[str, Any]:
        """What a result records of the gateway process (``gateway``) and of its memory as
        sampled (``rss``)."""
        return {"gateway": {"command": self.command(), "argv": self.argv, "env": self.env,
                            "pid": self.pid, "serving_pid": self.serving_pid, "url": self.url,
                            "startup_s": self.startup_s, "exit_code": self.exit_code,
                            "log": str(self.log_path)},
                "rss": {"unit": "MB (10^6 bytes)",
                        "source": f"/proc/{self.serving_pid}/status VmRSS",
                        "sampled": self.sampled(), "t": "seconds since the gateway was ready",
                        "samples": rss_samples}}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def last_line(self) -> str:
        return child.log_tail(self.log_path)

    def died(self) -> str | None:
        """Why the gateway is no longer there (its exit status and last log line), or None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return (f"the gateway exited with status {self.proc.returncode}: {self.last_line()} "
                f"(log: {self.log_path})")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the gateway drains and stops its workers), SIGKILL if it is still there
        after ``timeout_s``; the process is reaped either way."""
        if self.proc is not None:
            self.exit_code = child.stop(self.proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds this process like Ctrl-C does, so the gateway is stopped either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)

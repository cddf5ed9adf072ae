"""A child process sensai started (a gateway under benchmark, a tritonserver): started with a
guard that ends it should sensai die, waited for until it answers, stopped politely first (so
it can drain and stop its own children) and for sure after a grace period."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx

from sensai.errors import SensaiError

# setpriv (util-linux): the child gets a signal should its parent die, even SIGKILLed.  The
# parent is the thread that starts it, so start it from a thread that outlives it.
SETPRIV = shutil.which("setpriv")


def death_guard(sig: str) -> list[str]:
    """The command prefix that sends ``sig`` (TERM, KILL) to the child when its parent dies."""
    return [SETPRIV, "--pdeathsig", sig, "--"] if SETPRIV else []


def wait_ready(url: str, timeout_s: float, *, what: str,
               exited: Callable[[], str | None] = lambda: None,
               tail: Callable[[], str] = lambda: "") -> float:
    """Poll ``url`` until it answers 200; returns the seconds that took.  Fails with one line
    when ``exited()`` says why the server is gone, or after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        gone = exited()
        if gone:
            raise SensaiError(f"{what} {gone} before it was ready{tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise SensaiError(f"{what} not ready after {timeout_s:g} s{tail()}")
        time.sleep(0.2)


def log_tail(path: Path, n: int = 1) -> str:
    """The last ``n`` non-blank lines of a log, on one line."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return " | ".join(lines[-n:]) or "(no output)"


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int | None:
    """SIGTERM, SIGKILL if it is still there after ``timeout_s``; reaped either way.
    Returns its exit code (negative: the signal that ended it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

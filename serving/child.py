"""A child process sensai started (a gateway under benchmark, a tritonserver): stopped politely
first, so it can drain and stop its own children, and for sure after a grace period."""

from __future__ import annotations

import signal
import subprocess


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

"""Keeping the thread workers of one request on cores of their own, without pinning them.

Opt-in (``spread_cores``, ``--set spread_cores=true``; deploy/README.md, "Latency"): it rewrites
the affinity of the gateway's worker threads, a host tuning the operator chooses.  When it is
off, no affinity is ever read or changed.

Linux wakes a thread on the core it last ran on when that core is idle.  Once two workers last
ran on the same core, the event loop wakes the first there and the second behind it, and the
two subnets of every request run one after the other while the loop's core idles, for many
requests on end.  Two cheap moves keep them apart:

* **after** a run that shared its core with another worker's run of the same request, the
  worker that finished second moves itself to another core (pinned for the instant the kernel
  needs to move it, then free again), so the two last ran on different cores.  It does so after
  its output was handed over, off the request's path;
* the loop **wakes first** the workers that last ran on another core than its own: they take
  their idle cores, and the one that last ran beside the loop waits for the loop to go to sleep
  on its core instead of taking the other's.  Without this order a moved worker was followed
  by the other one, request after request.

A move costs the worker some time while it holds the GIL, so subnets that compute in less than
``MIN_WAIT_MS`` are left where they are: waiting for them costs less than moving.  Pinning
every worker for good is not done (see :mod:`.threads`).  With more workers than cores,
collisions cannot be avoided and nothing is done.  The measured effect is in BENCHMARKS.md.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, Sequence, TypeVar

from sensai.cores import usable_cores

W = TypeVar("W")
NOWHERE = (0, -1, 0.0)
MIN_WAIT_MS = 0.1  # move only a worker that waited at least this long for another's subnets


def _sched_getcpu() -> Callable[[], int] | None:
    """glibc's and musl's ``sched_getcpu`` (a vDSO read: cheap enough for every request); None
    where there is none (not Linux)."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu  # the C library the interpreter is linked with
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn if fn() >= 0 else None


class CoreSpread:
    """One per thread transport.  ``ran`` is called by each worker after each request, from its
    own thread; ``order`` by the predictor before it hands out a request's runs."""

    def __init__(self, cores: int | None = None):
        self.getcpu = _sched_getcpu() if hasattr(os, "sched_setaffinity") else None
        self.cores = usable_cores() if cores is None else cores
        self.last: dict[int, tuple[int, int, float]] = {}  # worker -> its last run's
        # (request, core, compute ms)
        self.moves = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.getcpu is not None and 2 <= len(self.last) <= self.cores

    def order(self, workers: Sequence[W]) -> Sequence[W]:
        """``workers`` (with an ``index``), those that last ran on the caller's core last."""
        if not self.active:
            return workers
        here, last = self.getcpu(), self.last
        beside = [w for w in workers if last.get(w.index, NOWHERE)[1] == here]
        if not beside or len(beside) == len(workers):
            return workers
        return [w for w in workers if last.get(w.index, NOWHERE)[1] != here] + beside

    def ran(self, worker: int, req: int, compute_ms: float) -> bool:
        """Worker ``worker`` (the calling thread) has finished request ``req`` after computing
        for ``compute_ms``: move it to another core if another worker computed ``req`` on this
        one first, for long enough to matter.  Whether it moved."""
        if self.getcpu is None:
            return False
        core = self.getcpu()
        with self._lock:
            shared = any(r == req and c == core and ms >= MIN_WAIT_MS
                         for w, (r, c, ms) in self.last.items() if w != worker)
            self.last[worker] = (req, core, compute_ms)
        if not shared or not self.active:
            return False
        allowed = os.sched_getaffinity(0)
        elsewhere = allowed - {core}
        if not elsewhere:
            return False
        try:
            os.sched_setaffinity(0, elsewhere)  # the kernel moves this thread before returning
            os.sched_setaffinity(0, allowed)
        except OSError:  # a mask changed under us (taskset, cgroup): leave placement alone
            return False
        with self._lock:
            self.last[worker] = (req, self.getcpu(), compute_ms)
            self.moves += 1
        return True

    def forget(self, worker: int) -> None:
        with self._lock:
            self.last.pop(worker, None)

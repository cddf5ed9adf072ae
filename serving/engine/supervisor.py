"""The one supervisor of every transport's workers: start, death, restart, hang - the pool's
state machine (:class:`~.worker.WorkerState`: new -> starting -> up -> down -> starting ...,
closed at shutdown).

* **Death** is reported by the worker's transport the moment it is seen (a process's sentinel, a
  failed Ray call or watch, a thread's end): the worker is marked down, its in-flight copies are
  lost (the pool's listener re-checks those requests at once), and a restart begins.
* **Restart**: one restart thread per dead worker, which starts a new incarnation (on Ray: waits
  for Ray's own restart), waits for it to load and answer a ping, then marks it up.  Failed
  attempts back off exponentially (up to 30 s).  Transports whose workers cannot come back
  (Triton) stay down until their infrastructure is healthy again.
* **Hang**: a watchdog gives up on a worker that has work in flight but has not answered anything
  for the settings' ``hang_timeout()`` - it is ended (killed, or abandoned for a thread) and restarted like a
  dead one.  A slow but progressing worker is never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from sensai.errors import SensaiError

from ..transports.base import Capabilities
from .plan import ServingPlan
from .worker import CLOSED, DOWN, STARTING, UP, Worker

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


class Supervisor:
    """Drives ``workers`` through their states (:class:`~.worker.WorkerState`) under ``lock``,
    with the timeouts of ``plan``; ``on_down(worker, reason)`` is told of every worker that goes
    down."""

    def __init__(self, workers: Sequence[Worker], lock: threading.Lock,
                 capabilities: Capabilities, plan: ServingPlan,
                 on_down: Callable[[Worker, str], None]):
        self.workers = list(workers)
        self.lock = lock
        self.on_down = on_down
        self.capabilities = capabilities
        self.restart_delay_s = plan.settings.restart_delay_s
        self.load_timeout_s = plan.load_timeout_s
        self.probe_timeout_s = plan.probe_timeout_s
        self.hang_timeout_s = plan.hang_timeout_s
        self.closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- start and stop

    def start_all(self) -> None:
        """Start every worker and wait for all of them; on any failure stop them and raise."""
        t0 = time.perf_counter()
        try:
            for wk in self.workers:
                wk.state = STARTING
                wk.handle.start()
            for wk in self.workers:
                wk.handle.wait_ready(self.load_timeout_s)
                with self.lock:
                    if wk.state is not STARTING:
                        raise SensaiError(f"{wk.name} ended right after loading its subnets")
                    wk.state = UP
        except BaseException:
            self.close()
            raise
        log.info("%d workers ready in %.1f s", len(self.workers), time.perf_counter() - t0)
        if self.hang_timeout_s and self.capabilities.kill:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name="sensai-watchdog")
            self._watchdog.start()

    def close(self, timeout: float = 5.0) -> None:
        self.closing.set()
        with self.lock:
            for wk in self.workers:
                wk.state = CLOSED
        for wk in self.workers:
            try:
                wk.handle.stop(timeout)
            except Exception as e:  # best effort: it may be gone already
                log.debug("stopping %s: %s", wk.name, e)

    # -- death

    def exited(self, wk: Worker, generation: int, detail: str) -> None:
        """An incarnation of ``wk`` ended (called by its transport, any thread)."""
        with self.lock:
            if generation != wk.handle.generation or wk.state in (CLOSED, DOWN):
                return
            was_up = wk.state is UP
            wk.state = DOWN
        if self.closing.is_set():
            return
        wk.deaths += 1
        reason = f"{wk.name} {detail}" if detail else f"{wk.name} died"
        if was_up:
            log.error("%s; its groups are answered by their copies, if any, while it restarts",
                      reason)
        self.on_down(wk, reason)
        if was_up:
            self._restart_later(wk)

    def _restart_later(self, wk: Worker) -> None:
        if self.capabilities.restart:
            threading.Thread(target=self._restart, args=(wk,), daemon=True,
                             name=f"{wk.name}-restart").start()

    def _restart(self, wk: Worker) -> None:
        handle, attempt = wk.handle, 0
        while not self.closing.is_set():
            wait = self.restart_delay_s if attempt == 0 else min(
                MAX_BACKOFF_S, max(0.5, self.restart_delay_s) * 2 ** attempt)
            if self.closing.wait(wait):
                return
            with self.lock:
                if wk.state is CLOSED:
                    return
                wk.state = STARTING
            try:
                handle.start()
                generation = handle.generation
                handle.wait_ready(self.load_timeout_s)
                if not handle.probe(self.probe_timeout_s):
                    raise SensaiError(f"{wk.name} did not answer its health probe")
                with self.lock:
                    closing = self.closing.is_set()
                    # It may have died again after the probe: its transport then marked it down.
                    alive = wk.state is STARTING and handle.generation == generation
                    if alive and not closing:
                        wk.state = UP
                        wk.restarts += 1
                if closing:  # shut down while it was starting: do not leave it behind
                    handle.stop()
                    return
                if not alive:
                    raise SensaiError(f"{wk.name} died while starting")
            except Exception as e:
                attempt += 1
                log.error("restarting %s failed (attempt %d): %s", wk.name, attempt, e)
                with self.lock:
                    if wk.state is not CLOSED:
                        wk.state = DOWN
                try:
                    handle.kill()
                except Exception:  # nothing left to kill
                    pass
                continue
            log.info("%s rejoined (restart %d%s)", wk.name, wk.restarts,
                     f", pid {handle.pid}" if handle.pid else "")
            return

    # -- hangs

    def hung(self, wk: Worker, now: float) -> float:
        """Seconds ``wk`` has had work in flight without answering anything (0 if not busy)."""
        if not wk.pending:
            return 0.0
        return now - max(wk.busy_since, wk.last_progress)

    def _watch(self) -> None:
        period = min(1.0, max(0.05, self.hang_timeout_s / 4))
        while not self.closing.wait(period):
            now = time.monotonic()
            for wk in self.workers:
                with self.lock:
                    stuck = wk.state is UP and self.hung(wk, now) > self.hang_timeout_s
                    if stuck:
                        wk.state = DOWN
                if not stuck:
                    continue
                wk.deaths += 1
                reason = (f"{wk.name} has answered nothing for more than "
                          f"{self.hang_timeout_s:g} s with requests in flight (hung)")
                log.error("%s: ending and restarting it", reason)
                self.on_down(wk, reason)
                try:
                    wk.handle.kill()
                except Exception as e:
                    log.error("could not end hung %s: %s", wk.name, e)
                self._restart_later(wk)

"""The workers of one predictor: their handles, their state machine, and what is kept about each.

A :class:`WorkerPool` creates one worker per :class:`~sensai.serving.engine.plan.WorkerPlan` on a
transport, starts them (through its :class:`~sensai.serving.engine.supervisor.Supervisor`, which
also restarts the dead and the hung), and is the transport's
:class:`~sensai.serving.transports.base.Sink`: every event a worker sends comes here first.  The
pool keeps each worker's record (:class:`~.worker.Worker`: its :class:`~.worker.WorkerState`, the
requests in flight on it, its counters) and hands the events that answer a request to its
*listener*: the class-parallel predictor, or a benchmark baseline, which knows what the request is
waiting for.

The pool's ``lock`` guards every record; the listener shares it for its own request state, so a
request handed out to the live workers (:meth:`WorkerPool.take`) and a worker found dead
(:meth:`WorkerPool.lost`) are never half seen by each other.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol, Sequence

from sensai.artifact import subnet_name
from sensai.errors import SensaiError

from ..core.faults import DelaySpec, parse_delay
from ..core.messages import BatchCounts, Done, Output, Run, RunFailed
from ..transports.base import Transport
from .plan import ServingPlan
from .supervisor import Supervisor
from .worker import UP, Worker

log = logging.getLogger(__name__)


class Listener(Protocol):
    """What a pool's owner hears: the events that answer its requests (any thread, the pool's
    lock not held) and the requests a worker took with it when it went down."""

    def result(self, worker: Worker, event: Output | RunFailed) -> None: ...

    def lost(self, worker: Worker, requests: list[int], reason: str) -> None: ...


class WorkerPool:
    """The workers of ``plan`` on ``transport`` (:meth:`start` starts them); their answers go to
    ``listener``."""

    def __init__(self, plan: ServingPlan, transport: Transport, listener: Listener):
        self.transport = transport
        self.listener = listener
        self.lock = threading.Lock()
        self.workers = [Worker(transport.worker(
            w, wp.groups, wp.specs, self, name=wp.name, delay=wp.delay, corrupt=wp.corrupt,
            seed=plan.seed + w, batching=plan.batching if transport.capabilities.batch else None,
            cores=wp.cores))
            for w, wp in enumerate(plan.workers)]
        self.supervisor = Supervisor(self.workers, self.lock, transport.capabilities, plan,
                                     self.lost)

    def start(self) -> None:
        """Start every worker and wait until all are up; on a failure stop them and raise."""
        try:
            self.supervisor.start_all()
        except BaseException:
            self.transport.close()
            raise

    # -- handing out requests

    def take(self, req: int, now: float) -> list[Worker]:
        """The live workers, each now busy with request ``req`` (call holding ``lock``)."""
        taken = []
        for w in self.workers:
            if w.state is UP:
                if not w.pending:
                    w.busy_since = now
                w.pending[req] = now
                taken.append(w)
        return taken

    def submit(self, index: int, run: Run) -> bool:
        """Hand ``run`` to worker ``index`` alone; False when that worker is not up."""
        w = self.workers[index]
        with self.lock:
            if w.state is not UP:
                return False
            now = time.monotonic()
            if not w.pending:
                w.busy_since = now
            w.pending[run.req] = now
        w.handle.send(run)
        sent = getattr(self.transport, "sent", None)  # optional, see Transport
        if sent is not None:
            sent()
        return True

    def busy_with(self, req: int, workers: Sequence[Worker]) -> list[Worker]:
        """Those of ``workers`` that have not finished request ``req`` (call holding ``lock``)."""
        return [w for w in workers if req in w.pending]

    # -- the transport's sink (any thread)

    def deliver(self, worker: int, generation: int, event) -> None:
        w = self.workers[worker]
        if generation != w.handle.generation:
            return  # from an incarnation given up on
        kind = type(event)
        with self.lock:
            w.last_progress = time.monotonic()
            if kind is Done:
                w.pending.pop(event.req, None)
                w.skipped += event.skipped
                if event.counts is not None:
                    w.counted(generation, event.counts)
                return
            if kind is Output:
                w.runs += 1
                w.compute_ms += event.ms
            else:
                w.failures += 1
        if kind is RunFailed:
            log.error("%s: %s failed: %s", w.name, subnet_name(event.group), event.error)
        self.listener.result(w, event)

    def exited(self, worker: int, generation: int, detail: str) -> None:
        self.supervisor.exited(self.workers[worker], generation, detail)

    def lost(self, w: Worker, reason: str) -> None:
        """``w`` is down: its requests in flight will not be answered by it."""
        with self.lock:
            pending, w.pending = list(w.pending), {}
        self.listener.lost(w, pending, reason)

    # -- state

    def up(self) -> set[int]:
        with self.lock:
            return {w.index for w in self.workers if w.state is UP}

    def states(self) -> list[str]:
        with self.lock:
            return [w.state.value for w in self.workers]

    def counters(self) -> dict:
        """Work done so far: subnet runs, compute ms, skipped copies, and the workers' batching
        (their counters summed; ``largest``: the largest of any worker)."""
        with self.lock:
            ws = self.workers
            return {"runs": sum(w.runs for w in ws),
                    "batching": sum((w.batching_counts() for w in ws), BatchCounts()).as_dict(),
                    "compute_ms": sum(w.compute_ms for w in ws),
                    "skipped": sum(w.skipped for w in ws),
                    "per_worker_runs": [w.runs for w in ws]}

    def describe(self) -> list[dict]:
        with self.lock:
            return [w.describe() for w in self.workers]

    def wait_until_up(self, index: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.workers[index].state is not UP and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.workers[index].state is UP

    # -- fault injection (tests, benchmark)

    def inject(self, index: int, *, delay: DelaySpec | str | None = None,
               corrupt: bool = False) -> None:
        """Give worker ``index`` a delay distribution and/or corrupt outputs (None/False: off);
        kept across its restarts."""
        self.workers[index].handle.inject(parse_delay(delay) if isinstance(delay, str) else delay,
                                          corrupt)

    def kill(self, index: int) -> int | None:
        """End worker ``index`` as a crash would (a process: SIGKILL; a thread: abandoned; a
        Ray actor: killed, Ray restarts it); returns its pid when it has one."""
        if not self.transport.capabilities.kill:
            raise SensaiError(f"the {self.transport.name} backend cannot end a worker")
        return self.workers[index].handle.kill()

    def close(self) -> None:
        self.supervisor.close()
        self.transport.close()


def resolve(future, value=None, error: BaseException | None = None) -> None:
    """Settle an asyncio future unless it is settled already (on its loop's thread)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def wake(loop, callback: Callable, *args) -> None:
    """``callback(*args)`` on ``loop`` from any thread; nothing when that loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass

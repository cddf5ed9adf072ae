"""Workers as threads of the gateway's process: the default, and the fastest on one machine.

Each worker is one thread that owns its runners and serves a queue of runs; ONNX Runtime and
torch release the GIL while they compute, so workers on different cores run side by side.  The
worker hands each output straight to the predictor from its own thread, and the predictor wakes
the event loop once per request: less fan-out overhead than ``run_in_executor`` and
``asyncio.gather`` (BENCHMARKS.md).

The kernel places the worker threads, and would sometimes run the workers of one request one
after the other on one core, request after request.  With ``spread_cores`` (opt-in: it rewrites
thread affinity, a host tuning), :class:`~.spread.CoreSpread` moves them apart when that
happens; without it no affinity is touched.  Keeping each worker on a core of its own for good
is not done: a worker then waits for its core whenever that core is busy (a worse tail), and one
preempted while it holds the GIL cannot move to a free core, so the whole gateway waits for it
(event-loop stalls, answered 503).

A thread cannot be killed.  A worker that is given up on (fault injection, or hung) is
*abandoned*: its incarnation is declared dead at once, a new thread takes its place, and whatever
the old one still says is ignored (a thread stuck inside a runner stays stuck, idle).
"""

from __future__ import annotations

import queue
import threading
from functools import partial
from typing import Sequence

from sensai.errors import SensaiError

from ..core.messages import Done, Fault, Output, Run, Skip
from ..workers.device_runner import build_device
from ..workers.loop import Stop, WorkerCore, per_request
from .base import Capabilities, Incarnation, Sink, WorkerHandle
from .spread import CoreSpread


class ThreadIncarnation(Incarnation):
    """One start of a thread worker: its thread, its run queue and its loop."""

    def __init__(self, number: int):
        super().__init__(number)
        self.runs: queue.SimpleQueue = queue.SimpleQueue()
        self.core: WorkerCore | None = None
        self.abandoned = False
        self.stopped = False
        self.thread: threading.Thread | None = None


class ThreadWorker(WorkerHandle):
    transport = "threads"

    def __init__(self, *args, spread: CoreSpread | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._inc: ThreadIncarnation | None = None
        self.spread = spread

    def start(self) -> None:
        self.generation += 1
        inc = ThreadIncarnation(self.generation)
        self._inc = inc
        inc.thread = threading.Thread(target=self._main, args=(inc,), daemon=True,
                                      name=f"sensai-{self.name}-{inc.number}")
        inc.thread.start()

    def _main(self, inc: ThreadIncarnation) -> None:
        detail = "its thread ended"
        try:
            runners = build_device(list(zip(self.groups, self.specs)), cores=self.cores)
            # What runs, which differs from the spec where CUDA graphs fell back.
            self.runtime = runners.runtime
            inc.core = WorkerCore(runners, delay=self.delay, corrupt=self.corrupt,
                                  seed=self.seed + 7919 * inc.number, batching=self.batching)
        except BaseException as e:  # reported by wait_ready; the supervisor decides
            inc.error = str(e) if isinstance(e, SensaiError) else f"{type(e).__name__}: {e}"
            inc.ready.set()
            self.sink.exited(self.index, inc.number, f"loading failed: {inc.error}")
            return
        inc.ready.set()
        deliver = partial(self.sink.deliver, self.index, inc.number)
        if self.spread is not None:
            spread, index = self.spread, self.index
            spread.forget(index)  # a new thread: where the old one ran says nothing
            computed = [0.0]

            def emit(event) -> None:
                deliver(event)
                kind = type(event)
                if kind is Output:
                    computed[0] += event.ms
                elif kind is Done and not inc.abandoned:  # after the outputs went: off
                    # the request's path
                    spread.ran(index, event.req, computed[0])
                    computed[0] = 0.0
        else:
            emit = deliver
        try:
            inc.core.serve(inc.runs, per_request(emit), alive=lambda: not inc.abandoned)
        except BaseException as e:  # a bug in the loop: the worker is dead, say why
            detail = f"its thread failed: {type(e).__name__}: {e}"
        finally:
            # The runners (ONNX Runtime sessions, CUDA graphs) go with the thread that built
            # them, now: the worker's objects hold each other in cycles, which only the cyclic
            # GC would free, whenever it next runs a full collection.
            inc.core = None
            del runners
        if not (inc.stopped or inc.abandoned):
            self.sink.exited(self.index, inc.number, detail)

    def wait_ready(self, timeout: float) -> None:
        self.wait_loaded(self._inc, timeout)

    def send(self, msg) -> None:
        inc = self._inc
        if inc is None:
            return
        if type(msg) is Run:
            inc.runs.put(msg)
        elif (core := inc.core) is not None:
            if type(msg) is Skip:
                core.skip(msg)
            elif type(msg) is Fault:
                core.fault(msg)

    def probe(self, timeout: float) -> bool:
        inc = self._inc
        if inc is None or inc.abandoned:
            return False
        answered = threading.Event()
        inc.runs.put(Stop(reply=answered.set))  # answered between two runs: the loop is alive
        return answered.wait(timeout)

    def kill(self) -> int | None:
        inc = self._inc
        if inc is None or inc.abandoned:
            return None
        inc.abandoned = True
        inc.runs.put(Stop())  # an idle loop ends now; a busy one when its run returns
        if (core := inc.core) is not None:
            core.skip_all()
        self.sink.exited(self.index, inc.number, "abandoned (killed)")
        return None

    def stop(self, timeout: float = 5.0) -> None:
        inc = self._inc
        if inc is None:
            return
        inc.stopped = True
        inc.abandoned = True
        inc.runs.put(Stop())
        if (core := inc.core) is not None:
            core.skip_all()
        if inc.thread is not None and inc.thread is not threading.current_thread():
            inc.thread.join(timeout)  # a thread stuck in a runner is a daemon: left behind

    def exit_detail(self) -> str:
        return ""

    def where(self) -> dict:
        inc = self._inc
        return {**super().where(), "thread": inc.thread.name if inc and inc.thread else None}


class Threads:
    """The thread transport (``--backend local``); ``spread_cores``: move the workers of one
    request apart when they ran on one core (:mod:`.spread`; off: affinity is never touched)."""

    name = "local"
    capabilities = Capabilities()

    def __init__(self, *, spread_cores: bool = False):
        self.spread = CoreSpread() if spread_cores else None
        if self.spread is not None:  # the predictor's optional hook (see Transport)
            self.wake_order = self.spread.order

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **options
               ) -> ThreadWorker:
        return ThreadWorker(index, groups, specs, sink, spread=self.spread, **options)

    def healthy(self) -> bool:
        return True

    def describe(self) -> dict:
        spread = self.spread
        return {"kind": "threads", "spread_cores": spread is not None,
                "spread_moves": None if spread is None else spread.moves}

    def close(self) -> None:
        pass

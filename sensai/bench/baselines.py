"""The baselines of ``sensai bench``, on the same workers the class-parallel predictor uses.

Every baseline's workers are a :class:`~sensai.serving.engine.pool.WorkerPool` of the serving
engine on its thread transport, answering with the compute time measured inside the worker;
:class:`WorkerSet` is the pool's listener their answers come back to.  The class-parallel
predictor's request path cannot serve them: it sends every request to all its workers and
merges their class groups, while a baseline calls one worker (:class:`DataParallel`: the least
busy replica; :class:`SingleDevice`: its one replica) or hands the activation from worker to
worker (:class:`ModelParallel`).  Each answers with the predictor's timing keys (``compute``,
``compute_sum``, ``merge``: a softmax here, ``total``, ``compute.<worker>``) and keeps a
deadline the same way (a late answer is a 504).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Sequence

import numpy as np

from sensai.serving.core.contract import Prediction
from sensai.serving.core.errors import SubnetFailed, SubnetTimeout
from sensai.serving.core.messages import Output, Run, Skip
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.engine.plan import plain_plan
from sensai.serving.engine.pool import WorkerPool, resolve, wake
from sensai.serving.engine.worker import Worker
from sensai.serving.transports.threads import Threads
from sensai.spec import DatasetSpec

GROUP = 0  # a baseline worker hosts one runner, filed under this key (see plain_plan)


def softmax_scores(logits: np.ndarray) -> np.ndarray:
    """A full model's logits -> class scores (rows sum to 1), as the gateway returns them."""
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


class WorkerSet:
    """One plain worker per runner recipe, in a pool of the serving engine on the thread
    transport (started, watched and restarted as the predictor's workers are), and the listener
    their answers come back to.  ``await run(i, x, deadline)`` gives worker ``i``'s output and
    its in-worker compute milliseconds."""

    def __init__(self, names: Sequence[str], specs: Sequence,
                 settings: GatewaySettings | None = None):
        if not specs or len(names) != len(specs):
            raise ValueError("one name per runner recipe, and at least one")
        self.settings = settings or GatewaySettings()
        self._calls: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count(1)
        self.pool = WorkerPool(plain_plan(self.settings, list(zip(names, specs))), Threads(),
                               self)
        self.workers = self.pool.workers
        self.pool.start()

    async def run(self, i: int, x: np.ndarray, deadline: float | None = None
                  ) -> tuple[np.ndarray, float]:
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.settings.deadline_s
        future = loop.create_future()
        req = next(self._ids)
        self._calls[req] = (i, loop, future)
        given = max(0.0, deadline - loop.time())
        timer = loop.call_at(deadline, self._expire, future, i, given)
        try:
            if not self.pool.submit(i, Run(req, x, (GROUP,), 1)):
                w = self.workers[i]
                raise SubnetFailed(f"{w.name} is {w.state.value}", subnet=w.name)
            return await future
        except SubnetTimeout:
            self.workers[i].handle.send(Skip(req, None))  # not computed yet: never mind
            raise
        finally:
            timer.cancel()
            self._calls.pop(req, None)

    def _expire(self, future: asyncio.Future, i: int, given: float) -> None:
        name = self.workers[i].name
        resolve(future, None, SubnetTimeout(f"{name} gave no answer within {given:.3g} s",
                                            subnet=name))

    # -- what the pool hears (any thread)

    def result(self, w: Worker, event) -> None:
        call = self._calls.get(event.req)
        if call is None:
            return
        _, loop, future = call
        if type(event) is Output:
            loop.call_soon_threadsafe(resolve, future, (event.output, event.ms))
        else:  # RunFailed
            error = SubnetFailed(f"{w.name} failed: {event.error}")
            loop.call_soon_threadsafe(resolve, future, None, error)

    def lost(self, w: Worker, requests: list[int], reason: str) -> None:
        error = SubnetFailed(reason)
        for req in requests:
            call = self._calls.get(req)
            if call is not None:
                wake(call[1], resolve, call[2], None, error)

    # -- state

    def is_ready(self) -> bool:
        return all(state == "up" for state in self.pool.states())

    def describe(self) -> list[dict]:
        return [dict(d, threads=w.handle.specs[0].threads)
                for d, w in zip(self.pool.describe(), self.workers)]

    def close(self) -> None:
        self.pool.close()


class _Baseline:
    """What the gateway needs of a predictor (:class:`~sensai.serving.core.contract.Predictor`);
    the deadline is the workers' settings'."""

    strategy = "?"

    def __init__(self, workers: WorkerSet, spec: DatasetSpec, name: str):
        self.workers = workers
        self.spec = spec
        self.name = name
        self.deadline_s = workers.settings.deadline_s

    def is_ready(self) -> bool:
        return self.workers.is_ready()

    def describe(self) -> dict:
        return {"strategy": self.strategy, "backend": "local", "transport": {"kind": "threads"},
                "workers": self.workers.describe()}

    async def close(self) -> None:
        await asyncio.to_thread(self.workers.close)

    def _answer(self, logits: np.ndarray, t0: float, t1: float, compute: dict[str, float]
                ) -> Prediction:
        scores = softmax_scores(logits)
        t2 = time.perf_counter()
        timings = {f"compute.{k}": round(v, 4) for k, v in compute.items()}
        timings["compute"] = round(sum(compute.values()), 4)  # one run, or the stages in a row
        timings["compute_sum"] = timings["compute"]
        timings["merge"] = round((t2 - t1) * 1e3, 4)
        timings["total"] = round((t2 - t0) * 1e3, 4)
        return Prediction(scores=scores, timings_ms=timings)


class ModelParallel(_Baseline):
    """K contiguous stages of the original model on K workers, one after the other."""

    strategy = "model-parallel"

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      deadline: float | None = None) -> Prediction:
        t0 = time.perf_counter()
        until = asyncio.get_running_loop().time() + self.deadline_s if deadline is None \
            else deadline
        h, compute = x, {}
        for i, w in enumerate(self.workers.workers):
            h, compute[w.name] = await self.workers.run(i, h, until)
        return self._answer(h, t0, time.perf_counter(), compute)


class DataParallel(_Baseline):
    """R replicas of the full model; each request goes to the replica with the fewest in flight
    (ties round robin, so idle replicas share the work)."""

    strategy = "data-parallel"

    def __init__(self, workers: WorkerSet, spec: DatasetSpec, name: str):
        super().__init__(workers, spec, name)
        self._inflight = [0] * len(workers.workers)  # touched by the event loop thread only
        self._next = 0

    def _pick(self) -> int:
        n = len(self._inflight)
        order = [(self._next + i) % n for i in range(n)]
        i = min(order, key=lambda j: self._inflight[j])
        self._next = (i + 1) % n
        return i

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      deadline: float | None = None) -> Prediction:
        t0 = time.perf_counter()
        i = self._pick()
        self._inflight[i] += 1
        try:
            logits, ms = await self.workers.run(i, x, deadline)
        finally:
            self._inflight[i] -= 1
        return self._answer(logits, t0, time.perf_counter(), {self.workers.workers[i].name: ms})


class SingleDevice(DataParallel):
    """The original model on one worker: data parallel's one replica."""

    strategy = "single"


BASELINES = {"single": SingleDevice, "model-parallel": ModelParallel,
             "data-parallel": DataParallel}


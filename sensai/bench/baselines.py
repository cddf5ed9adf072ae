"""The baselines of ``sensai bench``, on the same workers the class-parallel predictor uses.

Every baseline's workers are the serving pool's thread workers
(:class:`~sensai.serving.transports.threads.ThreadWorker`), answering with the compute time
measured inside the worker; :class:`WorkerSet` is the sink their answers come back to.  The
class-parallel predictor cannot host them: it sends every request to all its workers and merges
their class groups, while a baseline calls one worker (:class:`SingleDevice`,
:class:`DataParallel`: the least busy replica) or hands the activation from worker to worker
(:class:`ModelParallel`).  Each answers with the predictor's timing keys (``compute``,
``compute_sum``, ``merge``: a softmax here, ``total``, ``compute.<worker>``) and keeps a
deadline the same way (a late answer is a 504).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from sensai.serving.core.contract import Prediction
from sensai.serving.core.errors import SubnetFailed, SubnetTimeout
from sensai.serving.core.messages import Done, Output, Run, Skip
from sensai.serving.transports.threads import ThreadWorker
from sensai.serving.workers.runners import Runner, resolve_runtime, torch_runner
from sensai.spec import DatasetSpec

GROUP = 0  # a baseline worker hosts one runner, filed under this key


def softmax_scores(logits: np.ndarray) -> np.ndarray:
    """A full model's logits -> class scores (rows sum to 1), as the gateway returns them."""
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass(frozen=True)
class ModuleSpec:
    """The recipe of a torch runner for a module that has no weights file (a pipeline stage):
    the duck type of :class:`~sensai.serving.workers.runners.RunnerSpec` a thread worker builds from.
    Thread workers only: the module is shared with the worker (copied there), never pickled."""

    name: str
    module: Any
    input_shape: tuple[int, ...]
    device: str = "cpu"
    threads: int = 1
    runtime: str = "auto"  # auto: CUDA graphs on a GPU, as the subnets get them; else eager
    warmup: bool = True

    def resolved_runtime(self) -> str:
        return resolve_runtime(self.runtime, self.device, has_onnx=False)

    def build(self) -> Runner:
        import torch  # the torch runtime only

        if self.device == "cpu":
            torch.set_num_threads(max(1, self.threads))
        runner = torch_runner(copy.deepcopy(self.module), device=self.device,
                              runtime=self.runtime, name=self.name, input_shape=self.input_shape)
        if self.warmup:
            runner.run(np.zeros((1, *self.input_shape), dtype=np.float32))
        return runner

    def describe(self) -> dict:
        return {"name": self.name, "device": self.device, "threads": self.threads,
                "runtime": self.resolved_runtime()}


def _settle(future: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class WorkerSet:
    """One thread worker per runner recipe, started together (as the predictor's supervisor
    starts its workers), and the sink their events come back to.  ``await run(i, x, timeout_s)``
    gives worker ``i``'s output and its in-worker compute milliseconds."""

    def __init__(self, names: Sequence[str], specs: Sequence, *, load_timeout_s: float = 600.0):
        if not specs or len(names) != len(specs):
            raise ValueError("one name per runner recipe, and at least one")
        self._calls: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count(1)
        self.workers: list[ThreadWorker] = []
        try:
            for i, (name, spec) in enumerate(zip(names, specs)):
                w = ThreadWorker(i, (GROUP,), [spec], self)
                w.name = name
                w.state = "starting"
                self.workers.append(w)
                w.start()
            for w in self.workers:
                w.wait_ready(load_timeout_s)
                w.state = "up"
        except BaseException:
            self.close()
            raise

    async def run(self, i: int, x: np.ndarray, timeout_s: float = 600.0
                  ) -> tuple[np.ndarray, float]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        req = next(self._ids)
        self._calls[req] = (i, loop, future)
        timer = loop.call_later(max(0.0, timeout_s), self._expire, future, i, timeout_s)
        try:
            self.workers[i].send(Run(req, x, (GROUP,), 1))
            return await future
        except SubnetTimeout:
            self.workers[i].send(Skip(req, None))  # not computed yet: never mind
            raise
        finally:
            timer.cancel()
            self._calls.pop(req, None)

    def _expire(self, future: asyncio.Future, i: int, timeout_s: float) -> None:
        name = self.workers[i].name
        _settle(future, None, SubnetTimeout(f"{name} gave no answer within {timeout_s:.3g} s",
                                            subnet=name))

    # -- the sink (called from the worker threads)

    def deliver(self, index: int, generation: int, event) -> None:
        if type(event) is Done:
            return
        call = self._calls.get(event.req)
        if call is None:
            return
        _, loop, future = call
        if type(event) is Output:
            loop.call_soon_threadsafe(_settle, future, (event.output, event.ms))
        else:  # Failure
            error = SubnetFailed(f"{self.workers[index].name} failed: {event.error}")
            loop.call_soon_threadsafe(_settle, future, None, error)

    def exited(self, index: int, generation: int, detail: str) -> None:
        w = self.workers[index] if index < len(self.workers) else None
        if w is None or w.state == "closed":
            return
        w.state = "down"
        error = SubnetFailed(f"{w.name} {detail}")
        for req, (i, loop, future) in list(self._calls.items()):
            if i == index:
                loop.call_soon_threadsafe(_settle, future, None, error)

    # -- state

    def is_ready(self) -> bool:
        return all(w.state == "up" for w in self.workers)

    def describe(self) -> list[dict]:
        return [dict(w.describe(), threads=w.specs[0].threads) for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.state = "closed"
            w.stop()


class _Baseline:
    """What the gateway needs of a predictor (:class:`~sensai.serving.core.contract.Predictor`)."""

    strategy = "?"

    def __init__(self, workers: WorkerSet, spec: DatasetSpec, name: str, *,
                 deadline_s: float = 5.0):
        self.workers = workers
        self.spec = spec
        self.name = name
        self.deadline_s = float(deadline_s)

    def _wait(self, timeout_s: float | None) -> float:
        """How long this request may take: the deadline, or what is left of the caller's."""
        return self.deadline_s if timeout_s is None else max(0.0, min(self.deadline_s, timeout_s))

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


class SingleDevice(_Baseline):
    """The original model on one worker."""

    strategy = "single"

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      timeout_s: float | None = None) -> Prediction:
        t0 = time.perf_counter()
        logits, ms = await self.workers.run(0, x, self._wait(timeout_s))
        return self._answer(logits, t0, time.perf_counter(), {self.workers.workers[0].name: ms})


class ModelParallel(_Baseline):
    """K contiguous stages of the original model on K workers, one after the other."""

    strategy = "model-parallel"

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      timeout_s: float | None = None) -> Prediction:
        t0 = time.perf_counter()
        until = t0 + self._wait(timeout_s)
        h, compute = x, {}
        for i, w in enumerate(self.workers.workers):
            h, compute[w.name] = await self.workers.run(i, h, until - time.perf_counter())
        return self._answer(h, t0, time.perf_counter(), compute)


class DataParallel(_Baseline):
    """R replicas of the full model; each request goes to the replica with the fewest in flight
    (ties round robin, so idle replicas share the work)."""

    strategy = "data-parallel"

    def __init__(self, workers: WorkerSet, spec: DatasetSpec, name: str, *,
                 deadline_s: float = 5.0):
        super().__init__(workers, spec, name, deadline_s=deadline_s)
        self._inflight = [0] * len(workers.workers)  # touched by the event loop thread only
        self._next = 0

    def _pick(self) -> int:
        n = len(self._inflight)
        order = [(self._next + i) % n for i in range(n)]
        i = min(order, key=lambda j: self._inflight[j])
        self._next = (i + 1) % n
        return i

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      timeout_s: float | None = None) -> Prediction:
        t0 = time.perf_counter()
        i = self._pick()
        self._inflight[i] += 1
        try:
            logits, ms = await self.workers.run(i, x, self._wait(timeout_s))
        finally:
            self._inflight[i] -= 1
        return self._answer(logits, t0, time.perf_counter(), {self.workers.workers[i].name: ms})


BASELINES = {"single": SingleDevice, "model-parallel": ModelParallel,
             "data-parallel": DataParallel}


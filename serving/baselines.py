"""The benchmark's baselines as :class:`~serving.predictor.Predictor`\\ s on the gateway's workers.

Every strategy runs on :class:`~serving.pools.LocalWorker`\\ s (one single-thread executor holding
one runner), so single device, model parallel, data parallel and class parallel differ only in how
a request travels between workers:

* :class:`SingleDevicePredictor` - the original model on one worker;
* :class:`ModelParallelPredictor` - K contiguous stages on K workers; the activation goes from
  worker to worker through the same executor hand-off the class-parallel fan-out uses;
* :class:`DataParallelPredictor` - R replicas of the full model, each request on the least busy one
  (more images per second, never a shorter single-image latency);
* :class:`InstrumentedPredictor` - wraps the gateway's class-parallel predictor unchanged and only
  adds the compute-time figures below.

To split a request's latency into compute, transport and merge, each worker's runner is wrapped in a
:class:`TimedRunner` that clocks ``run`` inside the worker thread (with a CUDA synchronisation on
GPUs) and files the time under the input array's ``id``; the predictor collects it when the request
is answered. Every predictor reports the same ``timings_ms`` keys:
``total`` (inside the predictor), ``compute`` (the critical path: the one run, the sum of the
stages, the slowest subnet), ``compute_sum`` (work done by all workers), ``merge`` (logits -> class
scores) and ``compute.<worker>`` per worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .pools import LocalWorker
from .predictor import Prediction

if TYPE_CHECKING:
    from sensai.data import DatasetSpec

    from .runners import Runner

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Compute clocks


class ComputeClock:
    """Compute milliseconds of one worker's runs, keyed by the id of the input array.

    The key is the array object the predictor handed to the worker (the same object reaches the
    runner in a thread worker); it stays alive, so its id stays unique, until the predictor has
    collected the time. Bounded, so times nobody collects cannot pile up.
    """

    def __init__(self, capacity: int = 4096):
        self._ms: OrderedDict[int, float] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity

    def record(self, x: np.ndarray, ms: float) -> None:
        with self._lock:
            self._ms[id(x)] = ms
            while len(self._ms) > self.capacity:
                self._ms.popitem(last=False)

    def pop(self, x: np.ndarray) -> float | None:
        with self._lock:
            return self._ms.pop(id(x), None)


def _cuda_sync(device: str) -> Callable[[], None] | None:
    if not str(device).startswith("cuda"):
        return None
    import torch

    dev = torch.device(device)
    return lambda: torch.cuda.synchronize(dev)


class TimedRunner:
    """A runner whose ``run`` is clocked where it executes (the worker's own thread)."""

    def __init__(self, runner: "Runner", clock: ComputeClock):
        self.runner = runner
        self.clock = clock
        self.name = getattr(runner, "name", "runner")
        self.device = str(getattr(runner, "device", "cpu"))
        # Runners hand back host arrays, so their work is finished when run returns; the explicit
        # synchronisation makes that true by construction for any runner on a GPU.
        self._sync = _cuda_sync(self.device)

    def run(self, x: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.runner.run(x)
        if self._sync is not None:
            self._sync()
        self.clock.record(x, (time.perf_counter() - t0) * 1e3)
        return out


class TimedFactory:
    """Builds a worker's runner (inside the worker) and wraps it in a :class:`TimedRunner`."""

    def __init__(self, factory: Callable[[], "Runner"], clock: ComputeClock):
        self.factory = factory
        self.clock = clock

    def __call__(self) -> TimedRunner:
        return TimedRunner(self.factory(), self.clock)

    def describe(self) -> dict:
        inner = getattr(self.factory, "describe", None)
        return inner() if callable(inner) else {"name": getattr(self.factory, "name", "runner")}


class TimedWorker(LocalWorker):
    """A thread :class:`LocalWorker` whose runs are clocked (``clock``)."""

    def __init__(self, name: str, factory: Callable[[], "Runner"]):
        self.clock = ComputeClock()
        super().__init__(name, TimedFactory(factory, self.clock), processes=False)


class ModuleRunnerFactory:
    """A torch runner for a module that has no registry/weights recipe (a pipeline stage).

    Only for thread workers: the module is shared, not pickled.
    """

    def __init__(self, name: str, module, input_shape: Sequence[int], *, device: str = "cpu",
                 threads: int = 1, warmup: bool = True):
        self.name = name
        self.module = module
        self.input_shape = tuple(int(s) for s in input_shape)
        self.device = device
        self.threads = threads
        self.warmup = warmup

    def __call__(self) -> "Runner":
        import copy

        import torch

        from .runners import TorchRunner

        if self.device == "cpu":
            torch.set_num_threads(max(1, self.threads))
        runner = TorchRunner(copy.deepcopy(self.module), device=self.device, name=self.name)
        if self.warmup:
            runner.run(np.zeros((1, *self.input_shape), dtype=np.float32))
        return runner

    def describe(self) -> dict:
        return {"name": self.name, "device": self.device, "threads": self.threads,
                "runtime": "torch"}


# --------------------------------------------------------------------------------------------
# Predictors


def softmax_scores(logits: np.ndarray) -> np.ndarray:
    """A full model's logits -> class scores (rows sum to 1), as the gateway returns them."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def _collect(workers: Sequence[TimedWorker], inputs: Sequence[np.ndarray]) -> dict[str, float]:
    out = {}
    for w, x in zip(workers, inputs):
        ms = w.clock.pop(x)
        if ms is not None:
            out[f"compute.{w.name}"] = round(ms, 4)
    return out


class _Base:
    strategy = "?"

    def __init__(self, workers: Sequence[TimedWorker], spec: "DatasetSpec", name: str,
                 info: dict | None = None):
        if not workers:
            raise ValueError("a predictor needs at least one worker")
        self.workers = list(workers)
        self.spec = spec
        self.name = name
        self.info = dict(info or {})

    def describe(self) -> dict:
        return {"strategy": self.strategy, "backend": "local", **self.info,
                "workers": [w.describe() for w in self.workers]}

    async def close(self) -> None:
        for w in self.workers:
            w.close()


class SingleDevicePredictor(_Base):
    """The original model on one worker."""

    strategy = "single"

    def __init__(self, worker: TimedWorker, spec: "DatasetSpec", *, name: str = "single",
                 info: dict | None = None):
        super().__init__([worker], spec, name, info)

    async def predict(self, x: np.ndarray) -> Prediction:
        t0 = time.perf_counter()
        logits = await self.workers[0].run(x)
        t1 = time.perf_counter()
        scores = softmax_scores(logits)
        t2 = time.perf_counter()
        timings = _collect(self.workers, [x])
        c = timings.get(f"compute.{self.workers[0].name}", float("nan"))
        timings.update(compute=c, compute_sum=c, merge=round((t2 - t1) * 1e3, 4),
                       total=round((t2 - t0) * 1e3, 4))
        return Prediction(scores=scores, timings_ms=timings)


class ModelParallelPredictor(_Base):
    """K contiguous stages of the original model on K workers, one after the other."""

    strategy = "model-parallel"

    async def predict(self, x: np.ndarray) -> Prediction:
        t0 = time.perf_counter()
        inputs = []
        h = x
        for w in self.workers:
            inputs.append(h)
            h = await w.run(h)
        t1 = time.perf_counter()
        scores = softmax_scores(h)
        t2 = time.perf_counter()
        timings = _collect(self.workers, inputs)
        per = [timings.get(f"compute.{w.name}", float("nan")) for w in self.workers]
        timings.update(compute=round(sum(per), 4), compute_sum=round(sum(per), 4),
                       merge=round((t2 - t1) * 1e3, 4), total=round((t2 - t0) * 1e3, 4))
        return Prediction(scores=scores, timings_ms=timings)


class DataParallelPredictor(_Base):
    """R replicas of the full model; each request goes to the replica with the fewest in flight."""

    strategy = "data-parallel"

    def __init__(self, workers: Sequence[TimedWorker], spec: "DatasetSpec", *,
                 name: str = "data-parallel", info: dict | None = None):
        super().__init__(workers, spec, name, info)
        self._inflight = [0] * len(self.workers)
        self._next = 0

    def _pick(self) -> int:
        # Least in flight, ties broken round robin so idle replicas share the work. Only the event
        # loop thread touches these counters.
        n = len(self.workers)
        order = [(self._next + i) % n for i in range(n)]
        i = min(order, key=lambda j: self._inflight[j])
        self._next = (i + 1) % n
        return i

    async def predict(self, x: np.ndarray) -> Prediction:
        t0 = time.perf_counter()
        i = self._pick()
        self._inflight[i] += 1
        try:
            logits = await self.workers[i].run(x)
        finally:
            self._inflight[i] -= 1
        t1 = time.perf_counter()
        scores = softmax_scores(logits)
        t2 = time.perf_counter()
        timings = _collect([self.workers[i]], [x])
        c = timings.get(f"compute.{self.workers[i].name}", float("nan"))
        timings.update(compute=c, compute_sum=c, merge=round((t2 - t1) * 1e3, 4),
                       total=round((t2 - t0) * 1e3, 4))
        return Prediction(scores=scores, timings_ms=timings)


class InstrumentedPredictor:
    """The gateway's class-parallel predictor, unchanged, plus the compute-time figures.

    ``workers`` are the :class:`TimedWorker`\\ s of its pool; every subnet sees the same input
    array, so each one's compute time is found under that array.
    """

    strategy = "class-parallel"

    def __init__(self, inner, workers: Sequence[TimedWorker]):
        self.inner = inner
        self.workers = list(workers)
        self.spec = inner.spec
        self.name = inner.name

    async def predict(self, x: np.ndarray) -> Prediction:
        pred = await self.inner.predict(x)
        timings = dict(pred.timings_ms)
        per = _collect(self.workers, [x] * len(self.workers))
        values = list(per.values())
        timings.update(per)
        if values:
            timings["compute"] = round(max(values), 4)  # the slowest subnet: the floor
            timings["compute_sum"] = round(sum(values), 4)
        return Prediction(scores=pred.scores, timings_ms=timings)

    def describe(self) -> dict:
        return self.inner.describe()

    async def close(self) -> None:
        await self.inner.close()


# --------------------------------------------------------------------------------------------
# Building the strategies from runner recipes


def build_workers(names: Sequence[str], factories: Sequence[Callable[[], "Runner"]], *,
                  on_ready: Callable[[int, TimedWorker], Any] | None = None,
                  load_timeout_s: float = 600.0) -> list[TimedWorker]:
    """Start the workers one at a time (so ``on_ready`` can attribute memory to each one)."""
    workers: list[TimedWorker] = []
    try:
        for i, (name, factory) in enumerate(zip(names, factories)):
            w = TimedWorker(name, factory)
            workers.append(w)
            w.wait_ready(load_timeout_s)
            if on_ready is not None:
                on_ready(i, w)
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def class_parallel_predictor(artifact_dir: str | Path, workers: Sequence[TimedWorker], *,
                             name: str = "class-parallel", deadline_s: float = 30.0
                             ) -> InstrumentedPredictor:
    """The gateway's :class:`~serving.predictor.ClassParallelPredictor` over timed workers."""
    from sensai.manifest import load_manifest

    from .pools import LocalPool
    from .predictor import ClassParallelPredictor

    manifest = load_manifest(artifact_dir)
    pool = LocalPool(list(workers))
    inner = ClassParallelPredictor(pool, manifest, name=name, deadline_s=deadline_s,
                                   backend="local")
    return InstrumentedPredictor(inner, workers)


async def run_sequentially(workers: Sequence[TimedWorker], x: np.ndarray) -> list[float]:
    """Each worker alone on ``x``, one after the other: its compute time without neighbours."""
    out = []
    for w in workers:
        await w.run(x)
        ms = w.clock.pop(x)
        out.append(float("nan") if ms is None else ms)
    return out

"""The local subnet pool: every subnet on its own worker on this machine, all running at once.

A :class:`LocalWorker` owns one single-thread executor holding one runner, so a subnet's runs are
serialised while different subnets run side by side (ONNX Runtime and torch release the GIL while
they compute).  ``processes=True`` puts each worker in its own process instead (spawned, never
forked: the gateway has threads), which sidesteps the GIL entirely at the price of pickling the
input - useful for the torch runtime on CPU.

Devices come from :func:`sensai.models.device_for_worker` (one GPU per worker round robin, CPU when
there is none): ONNX Runtime on CPU, torch on GPUs, unless ``runtime`` says otherwise.

The benchmark reuses :class:`LocalWorker` / :class:`RunnerSpec` for its own baselines.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from sensai.errors import CheckpointError, SensaiError

from .predictor import ClassParallelPredictor, SubnetFailed, subnet_name

if TYPE_CHECKING:
    from sensai.manifest import DecompositionManifest

    from .runners import Runner

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "onnx", "torch")


@dataclass(frozen=True)
class RunnerSpec:
    """Everything needed to build one subnet's runner, picklable (for worker processes and Ray).

    ``runtime="auto"``: ONNX Runtime when the device is a CPU and an ONNX file exists, torch
    otherwise (GPUs, or artifacts without ONNX files).  The torch network is rebuilt from its
    safetensors weights (hash checked) - nothing is unpickled.
    """

    name: str
    input_shape: tuple[int, int, int]
    device: str = "cpu"
    runtime: str = "auto"
    threads: int = 1
    onnx_path: str | None = None
    arch: str | None = None
    num_outputs: int = 0
    in_channels: int = 0
    weights_path: str | None = None
    weights_sha256: str | None = None
    warmup: bool = True

    def resolved_runtime(self) -> str:
        if self.runtime == "auto":
            return "onnx" if self.device == "cpu" and self.onnx_path else "torch"
        return self.runtime

    def build(self) -> "Runner":
        from .runners import OrtRunner, TorchRunner

        runtime = self.resolved_runtime()
        if runtime == "onnx":
            if not self.onnx_path:
                raise CheckpointError(f"{self.name} has no ONNX file; use the torch runtime")
            runner: Runner = OrtRunner(self.onnx_path, threads=self.threads, device=self.device,
                                       name=self.name)
        else:
            import torch

            from sensai.checkpoint import build_from_weights, load_weights

            if not (self.arch and self.weights_path):
                raise CheckpointError(f"{self.name} has no weights to build a torch runner from")
            if self.device == "cpu":
                # Several CPU workers in one process share torch's intra-op pool; keep it small
                # so they do not oversubscribe the cores.
                torch.set_num_threads(max(1, self.threads))
            state = load_weights(self.weights_path, self.weights_sha256)
            model = build_from_weights(self.arch, self.num_outputs, self.in_channels, state,
                                       f"weights of {self.name} ({self.weights_path})")
            runner = TorchRunner(model, device=self.device, name=self.name)
        if self.warmup:
            # The first run allocates buffers (and JIT-compiles kernels on GPUs); do it now so
            # the first request does not pay for it.
            runner.run(np.zeros((1, *self.input_shape), dtype=np.float32))
        return runner

    def __call__(self) -> "Runner":
        return self.build()

    def describe(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k in ("name", "device", "threads")}
        d["runtime"] = self.resolved_runtime()
        return d


def runner_specs(artifact_dir: str | Path, manifest: "DecompositionManifest", *,
                 device: str = "auto", runtime: str = "auto", threads: int = 1) -> list[RunnerSpec]:
    """One :class:`RunnerSpec` per subnet of an artifact, devices round robin over GPUs."""
    from sensai.models import device_for_worker

    if runtime not in RUNTIMES:
        raise SensaiError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    art = Path(artifact_dir)

    def inside(rel: str) -> str:
        path = (art / rel).resolve()
        if not path.is_relative_to(art.resolve()):
            raise CheckpointError(f"manifest in {art} points outside the artifact ({rel})")
        return str(path)

    if not manifest.subnets:
        raise CheckpointError(f"manifest in {art} lists no subnets (decomposition unfinished?)")
    specs = []
    for s in manifest.subnets:
        dev = str(device_for_worker(s.index, device))
        onnx = inside(s.onnx) if s.onnx else None
        spec = RunnerSpec(name=subnet_name(s.index), input_shape=tuple(manifest.dataset.input_shape),
                          device=dev, runtime=runtime, threads=threads, onnx_path=onnx,
                          arch=manifest.model, num_outputs=s.num_outputs,
                          in_channels=manifest.in_channels, weights_path=inside(s.weights),
                          weights_sha256=s.weights_sha256)
        if spec.resolved_runtime() == "onnx":
            if not onnx or not Path(onnx).is_file():
                raise CheckpointError(f"ONNX file {onnx} of {spec.name} does not exist")
        elif not Path(spec.weights_path).is_file():
            raise CheckpointError(f"weights file {spec.weights_path} of {spec.name} does not exist")
        specs.append(spec)
    return specs


# --------------------------------------------------------------------------------------------
# Workers

_PROCESS_RUNNER: "Runner | None" = None


def _process_init(factory: Callable[[], "Runner"]) -> None:
    global _PROCESS_RUNNER
    _PROCESS_RUNNER = factory()


def _process_run(x: np.ndarray) -> np.ndarray:
    assert _PROCESS_RUNNER is not None
    return np.asarray(_PROCESS_RUNNER.run(x), dtype=np.float32)


def _process_ready() -> str:
    return getattr(_PROCESS_RUNNER, "device", "cpu")


class LocalWorker:
    """One runner behind its own single-worker executor (a thread, or a spawned process).

    ``factory`` builds the runner inside the worker (so a process worker never receives a live
    session); it must be picklable for ``processes=True`` (a :class:`RunnerSpec` is).
    """

    def __init__(self, name: str, factory: Callable[[], "Runner"], *, processes: bool = False):
        self.name = name
        self.factory = factory
        self.processes = processes
        self.runner: "Runner | None" = None
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        if self.processes:
            self.executor: Executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_process_init, initargs=(self.factory,))
            self._ready: Future = self.executor.submit(_process_ready)
        else:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            self._ready = self.executor.submit(self._build)

    def _build(self) -> str:
        self.runner = self.factory()
        return getattr(self.runner, "device", "cpu")

    def _call(self, x: np.ndarray) -> np.ndarray:
        assert self.runner is not None
        return np.asarray(self.runner.run(x), dtype=np.float32)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the runner is built; a build failure is re-raised here, once."""
        try:
            self._ready.result(timeout)
        except SensaiError:
            raise
        except BrokenExecutor as e:
            raise SensaiError(f"{self.name}: worker process died while loading ({e})") from None
        except Exception as e:
            raise SensaiError(f"{self.name}: cannot load the subnet: {type(e).__name__}: {e}") from e

    def run_sync(self, x: np.ndarray) -> np.ndarray:
        if self.processes:
            return self.executor.submit(_process_run, x).result()
        return self.executor.submit(self._call, x).result()

    async def run(self, x: np.ndarray) -> np.ndarray:
        loop = asyncio.get_running_loop()
        fn = _process_run if self.processes else self._call
        try:
            return await loop.run_in_executor(self.executor, fn, x)
        except BrokenExecutor:
            # The worker process died (killed, out of memory...): answer 503 now and start a
            # fresh one so later requests are served again.
            log.error("%s: worker process died; restarting it", self.name)
            self.restarts += 1
            self.executor.shutdown(wait=False, cancel_futures=True)
            self._start()
            raise SubnetFailed(f"{self.name}: its worker process died (restarted)",
                               subnet=self.name) from None

    def describe(self) -> dict:
        d = self.factory.describe() if hasattr(self.factory, "describe") else {"name": self.name}
        d["worker"] = "process" if self.processes else "thread"
        if self.restarts:
            d["restarts"] = self.restarts
        return d

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class LocalPool:
    """Subnets on :class:`LocalWorker`\\ s of this machine; loads them all in parallel."""

    def __init__(self, workers: Sequence[LocalWorker], *, load_timeout_s: float | None = 600.0):
        self.workers = list(workers)
        self.names = [w.name for w in self.workers]
        t0 = time.perf_counter()
        try:
            for w in self.workers:
                w.wait_ready(load_timeout_s)
        except BaseException:
            self._shutdown()
            raise
        log.info("local pool: %d workers ready in %.1f s", len(self.workers), time.perf_counter() - t0)

    @classmethod
    def from_specs(cls, specs: Sequence[RunnerSpec], *, processes: bool = False) -> "LocalPool":
        return cls([LocalWorker(s.name, s, processes=processes) for s in specs])

    async def run(self, index: int, x: np.ndarray) -> np.ndarray:
        return await self.workers[index].run(x)

    def run_sync(self, index: int, x: np.ndarray) -> np.ndarray:
        return self.workers[index].run_sync(x)

    def describe(self) -> dict:
        return {"kind": "local", "workers": [w.describe() for w in self.workers]}

    def _shutdown(self) -> None:
        for w in self.workers:
            w.close()

    async def close(self) -> None:
        self._shutdown()


def local_predictor(artifact_dir: str | Path, *, device: str = "auto", runtime: str = "auto",
                    threads: int = 1, processes: bool = False, name: str = "sensai",
                    deadline_s: float = 5.0) -> ClassParallelPredictor:
    """The embedded class-parallel predictor of an artifact (blocks while the subnets load)."""
    from sensai.manifest import load_manifest

    manifest = load_manifest(artifact_dir)
    specs = runner_specs(artifact_dir, manifest, device=device, runtime=runtime, threads=threads)
    pool = LocalPool.from_specs(specs, processes=processes)
    return ClassParallelPredictor(pool, manifest, name=name, deadline_s=deadline_s, backend="local")

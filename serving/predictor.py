"""What the gateway serves: a :class:`Predictor` turns a normalized batch into N-way class scores.

The gateway (``serving.app``) knows nothing else about where the networks run.  Class-parallel
serving is :class:`ClassParallelPredictor`: a *pool* runs subnet ``i`` on the input (in this
process, in Ray Serve replicas, or in a Triton server), every subnet at the same time, and the
outputs go through :func:`sensai.merge.merge_outputs` - the same rule offline evaluation uses.
Other strategies (the benchmark's single-device and model-parallel baselines) only have to
implement the :class:`Predictor` protocol to be served by the same gateway.

Errors raised here are :class:`sensai.errors.SensaiError` subclasses carrying an HTTP status; the
gateway turns them into JSON answers, the CLI into one line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

from sensai.errors import SensaiError

if TYPE_CHECKING:
    from sensai.data import DatasetSpec
    from sensai.manifest import DecompositionManifest

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Errors with an HTTP status


class ServingError(SensaiError):
    """A request the server cannot answer; ``status`` is the HTTP status the gateway sends."""

    status: int = 400

    def __init__(self, message: str, *, status: int | None = None, subnet: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.subnet = subnet


class InputError(ServingError):
    """The client's input is wrong (not an image, wrong tensor shape, NaN...): 4xx."""

    status = 400


class PayloadTooLarge(InputError):
    status = 413


class ModelNotFound(ServingError):
    status = 404


class SubnetFailed(ServingError):
    """A subnet raised or its host went away: 503 naming the subnet."""

    status = 503


class SubnetTimeout(ServingError):
    """A subnet did not answer within the request's deadline: 504 naming the subnet."""

    status = 504


# --------------------------------------------------------------------------------------------
# The contract


@dataclass
class Prediction:
    scores: np.ndarray  # [B, N] float32
    timings_ms: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Predictor(Protocol):
    spec: "DatasetSpec"
    name: str

    async def predict(self, x: np.ndarray) -> Prediction: ...

    def describe(self) -> dict: ...

    async def close(self) -> None: ...


class SubnetPool(Protocol):
    """Runs subnet ``i`` on a normalized batch and returns its raw output ``[B, k]``."""

    names: list[str]

    async def run(self, index: int, x: np.ndarray) -> np.ndarray: ...

    def describe(self) -> dict: ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------------------------
# Class parallelism


def subnet_name(index: int) -> str:
    return f"subnet_{index:02d}"


class ClassParallelPredictor:
    """Fan one batch out to every subnet of a pool at once, wait (bounded), merge.

    ``deadline_s`` bounds the whole fan-out: a subnet still running when it expires makes the
    request fail with :class:`SubnetTimeout` naming it (its task is cancelled, so nothing waits on
    it any more); a subnet that raises makes it fail with :class:`SubnetFailed`.
    """

    def __init__(self, pool: SubnetPool, manifest: "DecompositionManifest", *, name: str = "sensai",
                 deadline_s: float = 5.0, backend: str = "local"):
        if len(pool.names) != len(manifest.groups):
            raise ValueError(f"pool has {len(pool.names)} subnets, manifest {len(manifest.groups)}")
        self.pool = pool
        self.manifest = manifest
        self.spec = manifest.dataset.to_spec()
        self.name = name
        self.deadline_s = float(deadline_s)
        self.backend = backend
        self._groups = [list(g) for g in manifest.groups]
        self._outputs = [s.num_outputs for s in manifest.subnets] or None

    async def _timed(self, i: int, x: np.ndarray) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        out = await self.pool.run(i, x)
        return out, (time.perf_counter() - t0) * 1e3

    async def predict(self, x: np.ndarray) -> Prediction:
        from sensai.merge import merge_outputs

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(self._timed(i, x)) for i in range(len(self._groups))]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.deadline_s)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        if pending:
            for t in pending:
                t.cancel()
            slow = [self.pool.names[i] for i, t in enumerate(tasks) if t in pending]
            raise SubnetTimeout(f"{', '.join(slow)} did not answer within the "
                                f"{self.deadline_s:g} s deadline", subnet=slow[0])
        # Look at every task's exception (asyncio complains about unretrieved ones), then report
        # the first failure in subnet order.
        errors = [(i, t.exception()) for i, t in enumerate(tasks)]
        for i, exc in errors:
            if exc is not None:
                name = self.pool.names[i]
                if isinstance(exc, ServingError):
                    raise exc
                log.error("%s failed: %r", name, exc)
                raise SubnetFailed(f"{name} failed: {type(exc).__name__}: {exc}", subnet=name)
        outputs, timings = [], {}
        for i, t in enumerate(tasks):
            name = self.pool.names[i]
            out, ms = t.result()
            out = np.asarray(out)
            want = (x.shape[0], self._outputs[i]) if self._outputs else None
            if out.ndim == 1:
                out = out[:, None]
            if want is not None and tuple(out.shape) != want:
                raise SubnetFailed(f"{name} answered shape {tuple(out.shape)}, expected {want}",
                                   subnet=name)
            outputs.append(out)
            timings[name] = round(ms, 3)
        t1 = time.perf_counter()
        scores = merge_outputs(outputs, self._groups, self.manifest.num_classes)
        t2 = time.perf_counter()
        timings["merge"] = round((t2 - t1) * 1e3, 3)
        timings["total"] = round((t2 - t0) * 1e3, 3)
        return Prediction(scores=scores, timings_ms=timings)

    def describe(self) -> dict:
        return {
            "strategy": "class-parallel",
            "backend": self.backend,
            "model": self.manifest.model,
            "groups": self._groups,
            "deadline_s": self.deadline_s,
            "pool": self.pool.describe(),
        }

    async def close(self) -> None:
        await self.pool.close()


def check_batch(x: np.ndarray, spec: "DatasetSpec", max_batch: int) -> np.ndarray:
    """Validate a normalized input batch before any subnet sees it (shape, dtype, finite values)."""
    if not isinstance(x, np.ndarray):
        raise InputError("input must be an array")
    if x.dtype != np.float32:
        raise InputError(f"input must be FP32, got {x.dtype}")
    want = tuple(spec.input_shape)
    if x.ndim != 4 or tuple(x.shape[1:]) != want:
        raise InputError(f"input shape must be [batch, {', '.join(map(str, want))}], "
                         f"got {list(x.shape)}")
    if not 1 <= x.shape[0] <= max_batch:
        raise InputError(f"batch size must be between 1 and {max_batch}, got {x.shape[0]}")
    if not np.isfinite(x).all():
        raise InputError("input contains NaN or infinite values")
    return np.ascontiguousarray(x)


def top_k_rows(scores: np.ndarray, k: int, classes: Sequence[str]) -> list[list[dict]]:
    """Per row, the k best classes as ``{"index", "label", "score"}``, best first."""
    from sensai.merge import top_k

    idx, val = top_k(scores, k)
    return [[{"index": int(i), "label": classes[int(i)], "score": float(v)}
             for i, v in zip(ri, rv)] for ri, rv in zip(idx, val)]

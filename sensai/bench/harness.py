"""What the benchmarks share, written once: the real test images (normalized arrays in process,
lossless PNG over HTTP, so both give the same answers) and the answers offline evaluation gives
them (:func:`offline_reference`); the drivers that time one request
(:class:`InProcessDriver`, the predictor called directly, and :class:`RemoteDriver`, its own
gateway called from :class:`.client.HttpClientProcess`, each request paired with the bare request
that is its transport's floor); warm-up, interleaved rounds (a change in the machine's load hits
every candidate alike), throughput, :func:`quiet_gc`; the argument checks, the result envelope
and the writers.
"""

from __future__ import annotations

import asyncio
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from sensai.artifact import Artifact
from sensai.bounds import check_bounds
from sensai.data import encode_png, load_split, normalize, resolve_dataset, stratified_subset
from sensai.errors import SensaiError
from sensai.fsutil import writable_dir, write_json_atomic, write_text_atomic
from sensai.manifest import utc_now
from sensai.merge import merge_outputs
from sensai.serving.core.contract import Predictor
from sensai.serving.core.settings import GatewaySettings, load_settings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.server import BackgroundServer
from sensai.serving.workers.runners import runner_specs
from sensai.spec import DatasetSpec

from .client import HttpClientProcess, closed_loop
from .machine import load_average, machine_description
from .stats import summarize

SCHEMA_VERSION = 2  # 2: the harness on the unified predictor; accuracy and per-model targets

# One timed request: (latency ms, predicted class index, the predictor's timings_ms, and for a
# remote transport the bare request's ms just before it - None in process).
Timed = tuple[float, int, dict, float | None]


# --------------------------------------------------------------------------------------------
# Settings and output


def check_settings(options: Any = None, *,
                   choices: Sequence[tuple[str, Sequence[str], Sequence[str]]] = ()) -> None:
    """A benchmark's arguments, checked before anything is loaded: every bound ``options`` (a
    dataclass of :mod:`.options`) declares (:func:`sensai.bounds.check_bounds`), then
    ``choices`` (what, the values given, those allowed; at least one)."""
    if options is not None:
        check_bounds(options)
    for what, given, allowed in choices:
        bad = [v for v in given if v not in allowed]
        if bad or not given:
            raise SensaiError(f"unknown {what} {', '.join(map(repr, bad)) or '(none)'}; choose "
                              f"from {', '.join(allowed)}")


def inputs(artifact: Artifact, data_dir: str | None, out_dir: str | Path
           ) -> tuple[DatasetSpec, Path]:
    """The run's dataset and output directory, checked now rather than after the measurements:
    the test split must be where the spec says, the directory writable."""
    return checked_dataset(artifact.spec, data_dir), writable_dir(out_dir)


def checked_dataset(spec: DatasetSpec, data_dir: str | None) -> DatasetSpec:
    """``spec`` read from ``data_dir`` (None: where it says), its test split checked there."""
    spec = spec.with_data_dir(data_dir)
    resolve_dataset(spec.name, spec.data_dir, spec.input_shape[1])
    return spec


def progress_bar(enabled: bool, desc: str = "bench"):
    return tqdm(total=0, desc=desc, unit="req", disable=not enabled, leave=False)


def envelope(kind: str, *, command: str | None, artifact: Artifact, spec: DatasetSpec,
             settings: dict[str, Any]) -> dict[str, Any]:
    """The fields every benchmark result starts with."""
    return {"kind": kind, "schema_version": SCHEMA_VERSION, "command": command,
            "created": utc_now(), "artifact": str(artifact.root), "model": artifact.manifest.model,
            "dataset": spec.name, "input_shape": list(spec.input_shape),
            "groups": artifact.groups, "settings": settings,
            "machine": machine_description()}


def finish(out: Path, stem: str, result: dict[str, Any], t_start: float,
           markdown: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> None:
    """The run's end in ``result``, then ``stem.json``, ``stem.md`` and ``stem.png`` in
    ``out``, each written atomically."""
    result["machine"]["load_average_end"] = load_average()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json_atomic(out / f"{stem}.json", result)
    write_text_atomic(out / f"{stem}.md", markdown(result))
    plot(result, out / f"{stem}.png")


# --------------------------------------------------------------------------------------------
# The images


def model_code_trusted() -> bool:
    """The operator's consent to import a ``package.module:factory`` the files name, for the
    bench commands, which take no ``--trust-model-code``: ``SENSAI_TRUST_MODEL_CODE=1``, the
    setting ``sensai serve --trust-model-code`` sets."""
    return load_settings({}).trust_model_code


def offline_reference(artifact: Artifact, xs: Sequence[np.ndarray], *, runtime: str = "auto",
                      threads: int = 1) -> np.ndarray:
    """The answers to compare with: every subnet run in this process on CPU, merged."""
    runners = [s.build() for s in runner_specs(artifact, device="cpu", runtime=runtime,
                                               threads=threads, trust_code=model_code_trusted())]
    x = np.concatenate(xs)
    outs = [np.asarray(r.run(x), dtype=np.float32) for r in runners]
    return merge_outputs(outs, artifact.groups, artifact.manifest.num_classes)


@dataclass
class TestImages:
    """The same real test images for every candidate: ``xs[j]`` is a normalized ``[1, C, H, W]``
    float32 array, ``pngs[j]`` its PNG bytes (when HTTP needs them), ``labels[j]`` its class."""

    xs: list[np.ndarray]
    labels: np.ndarray
    pngs: list[bytes]
    indices: np.ndarray  # into the test split

    def __len__(self) -> int:
        return len(self.xs)

    def batch(self, count: int) -> torch.Tensor:
        """The first ``count`` images as one tensor (export checks, activation estimates)."""
        return torch.from_numpy(np.concatenate(self.xs[:count]))


def load_test_images(spec: DatasetSpec, count: int, seed: int, *, png: bool) -> TestImages:
    test = load_split(spec, "test")
    idx = stratified_subset(test.labels, count, seed)
    u8 = torch.stack([test[int(i)][0] for i in idx])
    xs = [normalize(u8[i:i + 1], spec).numpy() for i in range(len(idx))]
    pngs = [encode_png(u8[i]) for i in range(len(idx))] if png else []
    return TestImages(xs, np.asarray(test.labels)[idx], pngs, np.asarray(idx))


# --------------------------------------------------------------------------------------------
# Drivers


class InProcessDriver:
    """Calls the predictor from this event loop: no HTTP, no serialisation."""

    transport = "inprocess"

    def __init__(self, predictor: Predictor, images: TestImages):
        self.predictor, self.xs = predictor, images.xs

    async def sequential(self, indices: Sequence[int]) -> list[Timed]:
        out = []
        for j in indices:
            t0 = time.perf_counter()
            pred = await self.predictor.predict(self.xs[int(j)])
            ms = (time.perf_counter() - t0) * 1e3
            out.append((ms, int(np.argmax(pred.scores[0])), pred.timings_ms, None))
        return out

    async def concurrent(self, n_requests: int, concurrency: int) -> dict[str, Any]:
        """:func:`.client.closed_loop`'s answer: seconds, latencies and shed (none here)."""
        async def one(j: int) -> bool:
            await self.predictor.predict(self.xs[j % len(self.xs)])
            return True

        return await closed_loop(n_requests, concurrency, one)

    async def close(self) -> None:
        pass


class RemoteDriver:
    """Requests over ``transport`` (``http``: PNG upload, ``http-v2``: KServe v2 binary tensor,
    ``grpc``: KServe v2 over gRPC) to the predictor's own gateway on 127.0.0.1 (free ports; with
    its gRPC server for ``grpc``), from the benchmark's client process: :meth:`start`.  Made
    with ``server`` None: requests to a server the driver does not own (a peer of ``sensai bench
    --peers``, serving ``model`` at ``address``), which closing the driver leaves running."""

    def __init__(self, transport: str, server: BackgroundServer | None,
                 client: HttpClientProcess, address: str, model: str):
        self.transport, self.server, self.client = transport, server, client
        self.address, self.model = address, model

    @classmethod
    async def start(cls, transport: str, predictor: Predictor, client: HttpClientProcess,
                    settings: GatewaySettings | None = None) -> "RemoteDriver":
        # A free port for gRPC, and none for the others (whatever SENSAI_GRPC_PORT says: every
        # strategy has a gateway of its own).
        settings = (settings or GatewaySettings()).model_copy(
            update={"grpc_port": 0 if transport == "grpc" else None})
        app = create_app(predictor, settings, close_predictor=False)
        server = await asyncio.to_thread(BackgroundServer(app).start)
        address = (f"{server.host}:{app.state.grpc.port}" if transport == "grpc"
                   else server.url)
        return cls(transport, server, client, address, predictor.name)

    async def _ask(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except RuntimeError as e:
            raise SensaiError(f"{self.transport} benchmark client: {e}") from None

    async def sequential(self, indices: Sequence[int]) -> list[Timed]:
        return await self._ask(self.client.timed, self.transport, self.address, self.model,
                               indices)

    async def concurrent(self, n_requests: int, concurrency: int) -> dict[str, Any]:
        """Seconds, ``latencies`` of the answered requests, and ``shed``, those the server
        turned away."""
        return await self._ask(self.client.concurrent, self.address, n_requests, concurrency,
                               self.transport, self.model)

    async def close(self) -> None:
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)


# --------------------------------------------------------------------------------------------
# Measurement steps


async def warm_up(driver, n_images: int, count: int) -> None:
    """``count`` untimed requests: first requests allocate buffers, open connections, fill
    caches."""
    if count:
        await driver.sequential([j % n_images for j in range(count)])


@contextmanager
def quiet_gc() -> Iterator[None]:
    """``with quiet_gc(): <measure>``: everything alive now is moved out of the collector's
    sight (``gc.freeze``), so the collections run between timed runs (to keep a collector pause
    out of them) take milliseconds, not the half second a full pass over torch and the rest
    takes."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def interleaved(keys: Sequence[str], n: int, rounds: int,
                      run_chunk: Callable[[str, np.ndarray], Awaitable[None]]) -> None:
    """Every key serves each round's images in turn, rounds one after the other, so a change in
    the machine's load hits every key alike (the rounds: the image indices ``0..n-1`` in
    ``min(rounds, n)`` consecutive chunks)."""
    for chunk in np.array_split(np.arange(n), min(rounds, n)):
        for key in keys:
            gc.collect()
            await run_chunk(key, chunk)


async def throughput(driver, n_requests: int, concurrency: int) -> dict[str, Any]:
    """Answers per second at ``concurrency``; requests the server turns away (503, gRPC
    UNAVAILABLE: its admission shedding load) are counted in ``shed``, not in the rate."""
    gc.collect()
    r = await driver.concurrent(n_requests, concurrency)
    latencies = r["latencies"]
    return {"concurrency": concurrency, "requests": n_requests, "answered": len(latencies),
            "shed": r["shed"], "seconds": round(r["seconds"], 3),
            "images_per_s": round(len(latencies) / r["seconds"], 2),
            "latency_ms": summarize(latencies) if latencies else None}

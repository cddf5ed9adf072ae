"""CUDA graphs: a torch network's forward pass captured once per batch-size bucket, then replayed.

At batch 1 a small CNN on a GPU is bound by the CPU launching its kernels one by one, not by
their arithmetic, so a subnet ten times smaller with as many layers is hardly faster in eager
mode.  Replaying a captured graph launches the whole forward pass at once; that is the floor
class parallelism on GPUs has to reach.

:class:`GraphRunner` owns, per bucket, static device buffers the graph reads and writes, and
pinned host buffers the request is staged through with non-blocking copies on the runner's own
stream, so several runners on one GPU (one per worker thread) run side by side.  A batch is cut
into chunks of the largest bucket; each chunk runs in the smallest bucket that holds it, padded
with zeros (rows of a CNN's batch do not mix in eval mode, so the padding changes nothing).

``capture`` is what turns (model, static input) into (replay, static output): :func:`cuda_capture`
on a GPU; the tests pass an eager stand-in to check the buffers and buckets on a CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from sensai.errors import SensaiError

from ..core.errors import GraphCaptureError

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1,)
WARMUP_RUNS = 3  # eager passes before a capture: cuDNN picks its kernels, lazy state initialises

# (model, static input, stream=) -> (replay, static output)
Capture = Callable[..., tuple[Callable[[], None], Any]]


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted({int(b) for b in buckets}))
    if not out or out[0] < 1:
        raise SensaiError(f"batch-size buckets must be positive integers, got {list(buckets)}")
    return out


def buckets_up_to(rows: int) -> tuple[int, ...]:
    """One graph per power of two below ``rows``, and ``rows`` itself: a micro-batch of n rows
    pads to at most twice n."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return (*out, max(1, int(rows)))


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``n`` rows (``n`` at most the largest bucket)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


# Worker threads build their runners at the same time; captures go one at a time, and each is
# "thread_local" so that the other threads' CUDA calls meanwhile do not invalidate it.
CAPTURE_LOCK = threading.Lock()


def cuda_capture(model, static_input, *, stream):
    """Capture ``model(static_input)`` on ``stream``: (replay, static output)."""
    import torch

    with CAPTURE_LOCK, torch.cuda.device(static_input.device), torch.no_grad():
        # Warm-up passes run on the capture stream, as torch requires before capturing.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                model(static_input)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            output = model(static_input)
    return graph.replay, output


class _Bucket:
    def __init__(self, replay, static_input, static_output, host_in, host_out):
        self.replay = replay
        self.input, self.output = static_input, static_output
        self.host_in, self.host_out = host_in, host_out


class GraphRunner:
    """A torch network replayed from CUDA graphs (see the module's docstring)."""

    runtime = "cuda-graph"

    def __init__(self, model, *, device: str, input_shape: Sequence[int], name: str = "model",
                 buckets: Sequence[int] = DEFAULT_BUCKETS, capture: Capture | None = None):
        import torch

        self._torch = torch
        self.name, self.device = name, str(device)
        dev = torch.device(device)
        if capture is None and dev.type != "cuda":
            raise GraphCaptureError(f"{name}: CUDA graphs need a CUDA device, not {device!r} "
                                    "(use the onnx or torch runtime)")
        self.buckets = check_buckets(buckets)
        self.model = model.eval().to(dev)
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        capture = capture or cuda_capture
        pin = dev.type == "cuda"
        self.graphs: dict[int, _Bucket] = {}
        for b in self.buckets:
            static_in = torch.zeros((b, *input_shape), dtype=torch.float32, device=dev)
            try:
                replay, static_out = capture(self.model, static_in, stream=self.stream)
            except Exception as e:  # torch raises RuntimeError and friends for what it cannot capture
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise GraphCaptureError(f"{name}: capturing the forward pass at batch {b} as a "
                                        f"CUDA graph failed: {first}") from e
            host_in = torch.zeros(static_in.shape, dtype=torch.float32, pin_memory=pin)
            host_out = torch.empty(static_out.shape, dtype=torch.float32, pin_memory=pin)
            self.graphs[b] = _Bucket(replay, static_in, static_out, host_in, host_out)

    def run(self, x: np.ndarray) -> np.ndarray:
        top = self.buckets[-1]
        if len(x) <= top:
            return self._run_chunk(x)
        return np.concatenate([self._run_chunk(x[i:i + top]) for i in range(0, len(x), top)])

    def _run_chunk(self, x: np.ndarray) -> np.ndarray:
        torch = self._torch
        n = len(x)
        g = self.graphs[bucket_for(n, self.buckets)]
        staged = g.host_in.numpy()
        staged[:n] = x  # numpy copies from read-only arrays too (Ray, shared buffers)
        staged[n:] = 0.0
        if self.stream is None:
            g.input.copy_(g.host_in)
            g.replay()
            g.host_out.copy_(g.output)
        else:
            with torch.cuda.stream(self.stream):
                g.input.copy_(g.host_in, non_blocking=True)
                g.replay()
                g.host_out.copy_(g.output, non_blocking=True)
            # Waits for this stream only: other runners' work on the GPU goes on meanwhile.
            self.stream.synchronize()
        return g.host_out.numpy()[:n].copy()

    def replay_ms(self, repeats: int = 200, batch: int = 1) -> float:
        """The device's own time for one forward pass of ``batch`` rows: back-to-back replays
        timed by CUDA events, without the host copies and the host's wake-ups."""
        torch = self._torch
        g = self.graphs[bucket_for(batch, self.buckets)]
        if self.stream is None:
            t0 = time.perf_counter()
            for _ in range(repeats):
                g.replay()
            return (time.perf_counter() - t0) * 1e3 / repeats
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_RUNS):
                g.replay()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                g.replay()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

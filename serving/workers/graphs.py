"""CUDA graphs: a torch network's forward pass captured once per batch-size bucket, then replayed.

At batch 1 a small CNN on a GPU is bound by the CPU launching its kernels one by one, not by
their arithmetic, so a subnet ten times smaller with as many layers is hardly faster in eager
mode.  Replaying a captured graph launches the whole forward pass at once; that is the floor
class parallelism on GPUs has to reach.

:class:`GraphRunner` owns, per bucket, static device buffers the graph reads and writes, and
pinned host buffers the request is staged through with non-blocking copies on the runner's own
stream, so several runners on one GPU run side by side.  A batch runs in the smallest bucket
that holds it, padded with zeros (rows of a CNN's batch do not mix in eval mode, so the padding
changes nothing); one larger than every bucket is cut into chunks of the largest.

:meth:`GraphRunner.launch` stages the rows of several requests straight into the pinned buffer
(one pass), enqueues the copy in, the replay and the copy out, and returns without waiting: a
device process launches every subnet of a batch this way, then waits once for all of them
(:func:`wait_graphs`: the streams joined on one event).  That wait spins or sleeps
(``gpu_wait``: a spinning wait answers sooner, a sleeping one leaves the core to others); either
way the waiting thread holds no interpreter lock.

``capture`` is what turns (model, static input) into (replay, static output): :func:`cuda_capture`
on a GPU; the tests pass an eager stand-in to check the buffers and buckets on a CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from sensai.errors import SensaiError, first_line

from ..core.errors import GraphCaptureError

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1,)
GPU_WAITS = ("spin", "sleep")
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
    def __init__(self, replay, static_input, static_output, host_in, host_out, done, sleeps):
        self.replay = replay
        self.device = static_input.device
        self.input, self.output = static_input, static_output
        self.host_in, self.host_out = host_in, host_out
        self.done = done  # the event recorded after its last launch (None off CUDA)
        self.sleeps = sleeps  # whether a wait for it sleeps (else it spins)
        self.launch: GraphLaunch | None = None  # its launch whose output is not read yet


class GraphLaunch:
    """One launch of a bucket's graph: its rows' output once the device is done."""

    __slots__ = ("bucket", "n", "out", "waited")

    def __init__(self, bucket: _Bucket, n: int):
        self.bucket, self.n = bucket, n
        self.out: np.ndarray | None = None
        self.waited = bucket.done is None

    def result(self) -> np.ndarray:
        if self.out is None:
            b = self.bucket
            if not self.waited:
                b.done.synchronize()
                self.waited = True
            # The caller's own copy: the bucket's next launch overwrites the pinned buffer.
            self.out = b.host_out.numpy()[:self.n].copy()
            if b.launch is self:
                b.launch = None
        return self.out


# Per thread (thread workers on one GPU wait side by side): (device, sleeps) -> the stream that
# joins runners' streams, and its event.
JOINS = threading.local()


def wait_graphs(launches: Sequence[GraphLaunch]) -> None:
    """Wait once for every one of ``launches`` (on one or more runners' streams)."""
    waiting = [launch for launch in launches if not launch.waited]
    if len(waiting) > 1:
        import torch

        first = waiting[0].bucket
        joins = JOINS.__dict__
        key = (first.device, first.sleeps)
        if key not in joins:
            joins[key] = (torch.cuda.Stream(first.device),
                          torch.cuda.Event(blocking=first.sleeps))
        stream, event = joins[key]
        for launch in waiting:
            stream.wait_event(launch.bucket.done)
        event.record(stream)
        event.synchronize()
    elif waiting:
        waiting[0].bucket.done.synchronize()
    for launch in waiting:
        launch.waited = True


GraphLaunch.waits = staticmethod(wait_graphs)


class GraphRunner:
    """A torch network replayed from CUDA graphs (see the module's docstring).  ``wait``:
    ``spin`` or ``sleep`` while the host waits for the device."""

    runtime = "cuda-graph"

    def __init__(self, model, *, device: str, input_shape: Sequence[int], name: str = "model",
                 buckets: Sequence[int] = DEFAULT_BUCKETS, capture: Capture | None = None,
                 wait: str = "spin"):
        import torch

        self._torch = torch
        self.name, self.device = name, str(device)
        dev = torch.device(device)
        if capture is None and dev.type != "cuda":
            raise GraphCaptureError(f"{name}: CUDA graphs need a CUDA device, not {device!r} "
                                    "(use the onnx or torch runtime)")
        if wait not in GPU_WAITS:
            raise SensaiError(f"gpu_wait must be one of {', '.join(GPU_WAITS)}, not {wait!r}")
        self.buckets = check_buckets(buckets)
        self.input_shape = tuple(input_shape)
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
                raise GraphCaptureError(f"{name}: capturing the forward pass at batch {b} as a "
                                        f"CUDA graph failed: {first_line(e)}") from e
            host_in = torch.zeros(static_in.shape, dtype=torch.float32, pin_memory=pin)
            host_out = torch.empty(static_out.shape, dtype=torch.float32, pin_memory=pin)
            done = torch.cuda.Event(blocking=wait == "sleep") if pin else None
            self.graphs[b] = _Bucket(replay, static_in, static_out, host_in, host_out, done,
                                     wait == "sleep")

    @property
    def overlaps(self) -> bool:
        """Whether a launch returns before the device is done (on CUDA; the tests' stand-in
        computes as it launches)."""
        return self.stream is not None

    def run(self, x: np.ndarray) -> np.ndarray:
        top = self.buckets[-1]
        if len(x) <= top:
            return self.launch((x,)).result()
        return np.concatenate([self.launch((x[i:i + top],)).result()
                               for i in range(0, len(x), top)])

    def launch(self, parts: Sequence[np.ndarray]) -> GraphLaunch:
        """Stage ``parts`` (stacked, in order) into a bucket and enqueue its replay; returns
        without waiting for the device.  More rows than the largest bucket run in chunks, and
        wait."""
        n = sum(len(p) for p in parts)
        if n > self.buckets[-1]:
            out = self.run(parts[0] if len(parts) == 1 else np.concatenate(parts))
            done = GraphLaunch(self.graphs[self.buckets[-1]], len(out))
            done.out, done.waited = out, True
            return done
        g = self.graphs[bucket_for(n, self.buckets)]
        if g.launch is not None:  # its pinned buffers are still in use: read that one out first
            g.launch.result()
        staged = g.host_in.numpy()
        if len(parts) == 1:
            staged[:n] = parts[0]  # numpy copies from read-only arrays too (shared buffers)
        else:
            np.concatenate(parts, out=staged[:n])
        staged[n:] = 0.0
        launch = GraphLaunch(g, n)
        if self.stream is None:  # the tests' stand-in for a capture: computed now
            g.input.copy_(g.host_in)
            g.replay()
            g.host_out.copy_(g.output)
            launch.result()
            return launch
        torch = self._torch
        with torch.cuda.stream(self.stream):
            g.input.copy_(g.host_in, non_blocking=True)
            g.replay()
            g.host_out.copy_(g.output, non_blocking=True)
            g.done.record(self.stream)
        g.launch = launch
        return launch

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

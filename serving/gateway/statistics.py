"""Triton's statistics extension: per model version, what its requests cost, as Triton counts it.

``GET /v2/models[/{m}[/versions/{v}]]/stats`` and gRPC ``ModelStatistics`` answer from here
(what ``tritonclient``'s ``get_inference_statistics`` reads and perf_analyzer prints as its
server-side breakdown).  Each request that reached a model version is counted once, with
Triton's meanings:

* ``success`` / ``fail`` - requests answered / failed (bad tensors included) and their time, from
  the moment the request was whole (HTTP: its body received; gRPC: the call reached the
  servicer) to its answer built;
* ``queue`` - the wait for a place at the predictor (the admission's line);
* ``compute_input`` - parsing, decoding and checking the input up to that line;
* ``compute_infer`` - the predictor: the fan-out to the subnets and the merge;
* ``compute_output`` - the requested outputs and the answer's encoding;
* ``inference_count`` (images) and ``execution_count`` (predictor calls), ``batch_stats`` per
  batch size, ``last_inference`` (ms since the epoch).

Class parallelism's own split of ``compute_infer`` - the slowest subnet's compute and the merge -
is in the HTTP answer's extra ``class_parallel`` object (gRPC's message has no field for it).

Every value is an int64 in an array per model version; where several gateway processes serve one
port (:mod:`~sensai.serving.launch.fleet`) each keeps its arrays in a file of the server's shared
directory and an answer sums every process's files, so it is the whole server's whichever process
answers (the same scheme as the Prometheus metrics' multiprocess files).
"""

from __future__ import annotations

import glob
import hashlib
import mmap
import os
import time
from typing import Iterable

STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
EXTRA = ("slowest_subnet", "merge")
PHASES = ("compute_input", "compute_infer", "compute_output")  # batch_stats' fields
HEAD = 3  # inference_count, execution_count, last_inference
INFERENCE, EXECUTION, LAST = 0, 1, 2
SLOT = {name: HEAD + 2 * k for k, name in enumerate(STATS + EXTRA)}  # its count; ns after it
SUCCESS, FAIL, QUEUE, INPUT, INFER, OUTPUT, SLOWEST, MERGE = (SLOT[n] for n in STATS + EXTRA)
BATCHES = HEAD + 2 * len(STATS + EXTRA)  # where batch size 1's six values start
MS_NS = 1_000_000


class RequestClock:
    """One request's marks (``perf_counter_ns``): :meth:`start` when it is whole, then the end of
    its input's work, of its wait in line, and of the predictor (set by the prediction path)."""

    __slots__ = ("t0", "input_end", "queue_end", "infer_end")

    def __init__(self) -> None:
        self.t0 = time.perf_counter_ns()
        self.input_end = self.queue_end = self.infer_end = 0


def key_name(model: str, version: str) -> str:
    return hashlib.sha1(f"{model}\0{version}".encode()).hexdigest()[:20]


class VersionCounters:
    """One model version's values in this process: a memoryview of int64s, over a file of the
    shared directory (several gateway processes) or over memory of its own."""

    def __init__(self, size: int, path: str | None):
        self.path = path
        if path is None:
            self.buffer = bytearray(size * 8)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size * 8)
                self.buffer = mmap.mmap(fd, size * 8)
            finally:
                os.close(fd)
        self.values = memoryview(self.buffer).cast("q")

    def close(self) -> None:
        self.values.release()
        if self.path is not None:
            self.buffer.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


class InferenceStats:
    """The counters of every model version this process serves (``shared_dir``: where every
    gateway process of the server keeps its own; None: this process is the server)."""

    def __init__(self, max_batch: int, shared_dir: str | None = None):
        self.max_batch = max(1, int(max_batch))
        self.size = BATCHES + 6 * self.max_batch
        self.shared_dir = shared_dir
        self.versions: dict[tuple[str, str], VersionCounters] = {}

    def counters(self, model: str, version: str) -> VersionCounters:
        key = (model, version)
        c = self.versions.get(key)
        if c is None:
            path = None
            if self.shared_dir is not None:
                path = os.path.join(self.shared_dir,
                                    f"stats_{os.getpid()}_{key_name(model, version)}.bin")
            c = self.versions[key] = VersionCounters(self.size, path)
        return c

    def forget(self, model: str, version: str) -> None:
        """An unloaded version's counters go (Triton's restart from zero when it comes back)."""
        c = self.versions.pop((model, version), None)
        if c is not None:
            c.close()

    # -- counting (the event loop: no lock, no system call)

    def success(self, model: str, version: str, rows: int, clock: RequestClock,
                timings_ms: dict | None = None) -> None:
        end = time.perf_counter_ns()
        v = self.counters(model, version).values
        t0, input_end, queue_end, infer_end = (clock.t0, clock.input_end, clock.queue_end,
                                               clock.infer_end)
        infer = infer_end - queue_end
        # Unrolled: this runs on every answer.
        v[SUCCESS] += 1
        v[SUCCESS + 1] += end - t0
        v[QUEUE] += 1
        v[QUEUE + 1] += queue_end - input_end
        v[INPUT] += 1
        v[INPUT + 1] += input_end - t0
        v[INFER] += 1
        v[INFER + 1] += infer
        v[OUTPUT] += 1
        v[OUTPUT + 1] += end - infer_end
        if timings_ms:
            slowest, merge = timings_ms.get("compute"), timings_ms.get("merge")
            if slowest is not None:
                v[SLOWEST] += 1
                v[SLOWEST + 1] += int(slowest * MS_NS)
            if merge is not None:
                v[MERGE] += 1
                v[MERGE + 1] += int(merge * MS_NS)
        v[INFERENCE] += rows
        v[EXECUTION] += 1
        v[LAST] = time.time_ns() // MS_NS
        if 1 <= rows <= self.max_batch:
            b = BATCHES + 6 * (rows - 1)
            v[b] += 1
            v[b + 1] += input_end - t0
            v[b + 2] += 1
            v[b + 3] += infer
            v[b + 4] += 1
            v[b + 5] += end - infer_end

    def failure(self, model: str, version: str, clock: RequestClock) -> None:
        v = self.counters(model, version).values
        v[FAIL] += 1
        v[FAIL + 1] += time.perf_counter_ns() - clock.t0

    # -- reading (any process of the server)

    def totals(self, model: str, version: str) -> list[int]:
        """The version's values summed over every process of the server (the latest
        ``last_inference``)."""
        own = self.versions.get((model, version))
        if self.shared_dir is None:
            return list(own.values) if own is not None else [0] * self.size
        out = [0] * self.size
        pattern = os.path.join(self.shared_dir, f"stats_*_{key_name(model, version)}.bin")
        for path in glob.glob(pattern):
            try:
                with open(path, "rb") as f:
                    raw = f.read(self.size * 8)
            except OSError:  # a process going away meanwhile
                continue
            values = memoryview(raw).cast("q") if len(raw) == self.size * 8 else ()
            for i, x in enumerate(values):
                out[i] = max(out[i], x) if i == LAST else out[i] + x
        return out

    def model_stats(self, model: str, version: str) -> dict:
        """One version's statistics as Triton's HTTP answer has them, plus ``class_parallel``."""
        v = self.totals(model, version)

        def pair(name: str) -> dict:
            i = SLOT[name]
            return {"count": v[i], "ns": v[i + 1]}

        batches = []
        for size in range(1, self.max_batch + 1):
            b = BATCHES + 6 * (size - 1)
            if v[b + 2]:  # compute_infer's count: executions of this size
                batches.append({"batch_size": size, **{
                    p: {"count": v[b + 2 * k], "ns": v[b + 2 * k + 1]}
                    for k, p in enumerate(PHASES)}})
        return {"name": model, "version": version, "last_inference": v[LAST],
                "inference_count": v[INFERENCE], "execution_count": v[EXECUTION],
                "inference_stats": {**{s: pair(s) for s in STATS},
                                    "cache_hit": {"count": 0, "ns": 0},
                                    "cache_miss": {"count": 0, "ns": 0}},
                "response_stats": {}, "batch_stats": batches, "memory_usage": [],
                "class_parallel": {s: pair(s) for s in EXTRA}}

    def answer(self, versions: Iterable[tuple[str, str]]) -> dict:
        return {"model_stats": [self.model_stats(m, v) for m, v in versions]}

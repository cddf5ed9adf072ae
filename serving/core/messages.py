"""The typed messages between a predictor and its workers, whatever carries them (a queue, a
pipe to a process, a Ray call).  Small, picklable, immutable.

To a worker: :class:`Run` (compute groups of one request, in order), :class:`Skip` (do not
compute these groups of a request, or none of it), :class:`Fault` (fault injection),
:class:`Ping`, :class:`Shutdown`; when it starts, its :class:`Batching`.  From a worker:
:class:`Output`, :class:`RunFailed`, :class:`Done` (the request's run is over, with the worker's
:class:`BatchCounts`), :class:`Pong`, and while starting :class:`Ready` or :class:`StartFailed`.
Inside a worker the loop speaks per batch - :class:`Outputs` (one launch's rows for many
requests) and :class:`Dones` - which :func:`each` splits into the per-request events where a
transport carries those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from .faults import DelaySpec


@dataclass(frozen=True, slots=True)
class Run:
    req: int
    x: np.ndarray
    groups: tuple[int, ...]  # the worker's own groups first, then its copies
    primaries: int  # how many of ``groups`` are its own
    hedge_s: float = 0.0  # wait this long for a Skip before computing a copy


@dataclass(frozen=True, slots=True)
class Skip:
    req: int
    groups: tuple[int, ...] | None  # None: the whole request (answered, failed or timed out)


@dataclass(frozen=True, slots=True)
class Fault:
    delay: DelaySpec | None = None  # slept once per request, before its first group
    corrupt: bool = False  # answer wrong outputs
    seed: int | None = None  # reseed the delay sampler (None: keep)


@dataclass(frozen=True, slots=True)
class Batching:
    """How a worker batches the runs it finds waiting: at most ``max_rows`` image rows in one
    batch (a run with more still goes, alone and whole; 1: no batching), and a lone run may be
    held up to ``delay_us`` for company (0: only what is already queued is batched, nothing ever
    waits).  Where runners compute apart from the host (a GPU's), the next batch is always
    launched before the previous one is answered (:class:`~sensai.serving.workers.loop.WorkerCore`)."""

    max_rows: int = 8
    delay_us: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchCounts:
    """A worker's batching so far (since it started), as one subnet saw it: the batches it ran
    (a run alone counts as a batch of one), the requests they held and their image rows, the
    most requests in one; and of the worker's loop, how many requests were held back waiting
    for company (never any when the delay is 0), and the batches that held requests of more
    than one gateway process (a device process's)."""

    batches: int = 0
    requests: int = 0
    largest: int = 0
    held: int = 0
    mixed: int = 0
    rows: int = 0

    def __add__(self, other: "BatchCounts") -> "BatchCounts":
        return BatchCounts(self.batches + other.batches, self.requests + other.requests,
                           max(self.largest, other.largest), self.held + other.held,
                           self.mixed + other.mixed, self.rows + other.rows)

    def as_dict(self) -> dict:
        return {"batches": self.batches, "requests": self.requests, "largest": self.largest,
                "held": self.held, "mixed": self.mixed, "rows": self.rows}


@dataclass(frozen=True, slots=True)
class Ping:
    token: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Ends a worker process's loop (a worker thread gets
    :class:`~sensai.serving.workers.loop.Stop` on its run queue instead, which carries a callback
    and so never crosses a pipe)."""


@dataclass(frozen=True, slots=True)
class Pong:
    token: int


@dataclass(frozen=True, slots=True)
class Output:
    req: int
    group: int
    output: np.ndarray
    ms: float  # compute time inside the worker (of the whole batch its rows were in)


@dataclass(frozen=True, slots=True)
class RunFailed:
    req: int
    group: int
    error: str


@dataclass(frozen=True, slots=True)
class Done:
    req: int
    skipped: int
    counts: BatchCounts | None = None  # the worker's batching, as of this request's batch


@dataclass(frozen=True, slots=True)
class Outputs:
    """One launch of group ``group``: requests ``reqs`` in order, ``sizes[i]`` rows each, their
    rows stacked in ``out``; ``ms``: the launch's time in the worker."""

    group: int
    reqs: Sequence[int]
    out: np.ndarray
    sizes: Sequence[int]
    ms: float


@dataclass(frozen=True, slots=True)
class Dones:
    """Requests ``reqs`` are over in this worker, ``skipped[i]`` of their groups skipped.
    ``counts``: each subnet's batching (group -> counts) as of their batch; a request's Done
    carries its first group's (``firsts[i]``)."""

    reqs: Sequence[int]
    skipped: Sequence[int]
    firsts: Sequence[int]
    counts: Mapping[int, BatchCounts]


def each(event) -> Iterator["Output | RunFailed | Done"]:
    """A loop's event as the per-request events a transport carries."""
    kind = type(event)
    if kind is Outputs:
        group, out, ms = event.group, event.out, event.ms
        if len(event.reqs) == 1:
            yield Output(event.reqs[0], group, out, ms)
            return
        at = 0
        for req, n in zip(event.reqs, event.sizes):
            yield Output(req, group, out[at:at + n], ms)
            at += n
    elif kind is Dones:
        counts = event.counts
        for req, skipped, first in zip(event.reqs, event.skipped, event.firsts):
            yield Done(req, skipped, counts.get(first))
    else:
        yield event


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    device: str
    runtime: str | None
    node: str | None = None
    cores_awake: bool | None = None  # None: not asked (the gateway's machine is the gateway's)


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: str


Event = Output | RunFailed | Done

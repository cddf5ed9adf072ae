"""The typed messages between a predictor and its workers, whatever carries them (a queue, a
pipe to a process, a Ray call).  Small, picklable, immutable.

To a worker: :class:`Run` (compute groups of one request, in order), :class:`Skip` (do not
compute these groups of a request, or none of it), :class:`Fault` (fault injection),
:class:`Ping`, :class:`Shutdown`.  From a worker: :class:`Output`, :class:`Failure`,
:class:`Done` (the request's run is over), :class:`Pong`, and while starting :class:`Ready` or :class:`LoadFailed`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class Ping:
    token: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Ends a worker process's loop (a worker thread gets :class:`~.worker_core.Stop` on its run
    queue instead, which carries a callback and so never crosses a pipe)."""


@dataclass(frozen=True, slots=True)
class Pong:
    token: int


@dataclass(frozen=True, slots=True)
class Output:
    req: int
    group: int
    output: np.ndarray
    ms: float  # compute time inside the worker


@dataclass(frozen=True, slots=True)
class Failure:
    req: int
    group: int
    error: str


@dataclass(frozen=True, slots=True)
class Done:
    req: int
    skipped: int


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    device: str
    runtime: str | None
    node: str | None = None
    cores_awake: bool | None = None  # None: not asked (the gateway's machine is the gateway's)


@dataclass(frozen=True, slots=True)
class LoadFailed:
    error: str


Event = Output | Failure | Done

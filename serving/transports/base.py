"""The interface every transport implements, and the bookkeeping every worker handle shares.

A *worker* hosts the runners of one or more groups (its own, and with redundancy copies of
others).  The predictor talks to it only through :meth:`WorkerHandle.send` with the typed
messages of :mod:`sensai.serving.core.messages`; the worker hands back what it computes by calling
``sink.deliver(index, generation, event)`` from whatever thread it runs on, and reports the end of
an incarnation (death, or a failed load) with ``sink.exited(index, generation, detail)``.  Every
start is a new *generation*, so anything a dead or abandoned incarnation still says is ignored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from sensai.artifact import subnet_name
from sensai.errors import SensaiError

from ..core.messages import BatchCounts, Batching

if TYPE_CHECKING:
    from ..core.faults import DelaySpec
    from ..workers.runners import RunnerSpec

TOKENS = itertools.count(1)  # ping tokens, unique in this process


@dataclass(frozen=True)
class Capabilities:
    """What a transport's workers can do; the predictor refuses settings they cannot honour."""

    several_groups: bool = True  # host several groups (needed for redundancy)
    skip: bool = True  # skip copies already answered elsewhere (hedging)
    restart: bool = True  # a dead worker comes back (restarted by us or by Ray)
    kill: bool = True  # can be ended from outside (fault injection, hung-worker watchdog)
    batch: bool = True  # a worker runs the requests it finds waiting as one batch


class Sink(Protocol):
    def deliver(self, worker: int, generation: int, event) -> None: ...

    def exited(self, worker: int, generation: int, detail: str) -> None: ...


class WorkerHandle:
    """The predictor's side of one worker.  Transports subclass it and implement the lifecycle
    (:meth:`start`, :meth:`wait_ready`, :meth:`probe`, :meth:`kill`, :meth:`stop`) and
    :meth:`send`.  ``state`` (new, starting, up, down, closed), ``pending`` and the counters are
    kept by the predictor under its lock.  ``batching``: how the worker batches the requests it
    finds waiting (None: it does not, or not in-house - Triton, Ray Serve)."""

    transport = "?"

    def __init__(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"],
                 sink: Sink, *, delay: "DelaySpec | None" = None, corrupt: bool = False,
                 seed: int = 0, batching: Batching | None = None):
        self.index = index
        self.name = f"worker_{index:02d}"
        self.groups = tuple(groups)
        self.specs = list(specs)
        self.sink = sink
        self.delay, self.corrupt, self.seed = delay, bool(corrupt), seed
        self.batching = batching
        self.state = "new"
        self.generation = 0
        self.restarts = 0
        self.deaths = 0
        self.pid: int | None = None
        self.device: str | None = self.specs[0].device if self.specs else None
        self.runtime: str | None = self.specs[0].resolved_runtime() if self.specs else None
        self.node: str | None = None
        self.cores_awake: bool | None = None  # held on the worker's own node (Ray)
        self.pending: dict[int, float] = {}  # request -> when it was sent here (monotonic)
        self.busy_since = 0.0  # when pending last became non-empty
        self.last_progress = 0.0  # when this worker last answered anything
        self.runs = 0
        self.compute_ms = 0.0
        self.skipped = 0
        self.failures = 0
        # The worker's batching counters: of its current incarnation (as its latest Done said),
        # and of the ones before it (an incarnation counts from zero).
        self.batch_counts = BatchCounts()
        self.batch_counts_before = BatchCounts()
        self.batch_generation = 0

    # -- implemented by transports

    def start(self) -> None:
        """Start a new incarnation (``generation += 1``) without waiting for it."""
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> None:
        """Block until the incarnation has loaded its subnets; :class:`SensaiError` if it
        cannot."""
        raise NotImplementedError

    def send(self, msg) -> None:
        """Hand a Run, Skip or Fault to the worker; never blocks."""
        raise NotImplementedError

    # -- shared by transports

    def counted(self, generation: int, counts: BatchCounts) -> None:
        """The batching counters incarnation ``generation`` reported (with a Done)."""
        if generation != self.batch_generation:
            self.batch_counts_before = self.batch_counts_before + self.batch_counts
            self.batch_generation = generation
        self.batch_counts = counts

    def batching_counts(self) -> BatchCounts:
        """The worker's batching counters over all its incarnations."""
        return self.batch_counts_before + self.batch_counts

    def wait_loaded(self, inc, timeout: float) -> None:
        """Block until incarnation ``inc`` (its ``ready`` event set, and ``error`` if loading
        failed) has loaded its subnets; :class:`SensaiError` if it did not."""
        if inc is None:
            raise SensaiError(f"{self.name} was never started")
        if not inc.ready.wait(timeout):
            raise SensaiError(f"{self.name} did not load its subnets within {timeout:g} s")
        if inc.error:
            raise SensaiError(f"{self.name}: {inc.error}")

    def probe(self, timeout: float) -> bool:
        """Whether the worker answers a ping within ``timeout``."""
        raise NotImplementedError

    def kill(self) -> int | None:
        """End the incarnation at once (it reports :meth:`Sink.exited`); returns its pid."""
        raise NotImplementedError

    def stop(self, timeout: float = 5.0) -> None:
        """End the worker for good (shutdown); waits up to ``timeout``."""
        raise NotImplementedError

    def exit_detail(self) -> str:
        """How the last incarnation ended, for logs and error messages (may be empty)."""
        return ""

    def where(self) -> dict:
        """Where the worker runs, for ``/v1/models``: device, runtime, pid, node..."""
        return {"device": self.device, "runtime": self.runtime, "pid": self.pid,
                "node": self.node}

    def describe(self) -> dict:
        return {"name": self.name, "transport": self.transport, "groups": list(self.groups),
                "subnets": [subnet_name(g) for g in self.groups], "state": self.state,
                "generation": self.generation, "restarts": self.restarts, "deaths": self.deaths,
                "runs": self.runs, "skipped": self.skipped, "failures": self.failures,
                **self.where(),
                **({"batching": {"max_rows": self.batching.max_rows,
                                 "delay_us": self.batching.delay_us,
                                 **self.batching_counts().as_dict()}}
                   if self.batching is not None else {}),
                **({"injected_delay": str(self.delay)} if self.delay is not None else {}),
                **({"injected_corruption": True} if self.corrupt else {})}


class Transport(Protocol):
    name: str
    capabilities: Capabilities

    def worker(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"],
               sink: Sink, *, delay: "DelaySpec | None" = None, corrupt: bool = False,
               seed: int = 0, batching: Batching | None = None) -> WorkerHandle: ...

    def healthy(self) -> bool:
        """Whether the transport's own infrastructure is up (e.g. the Triton server)."""
        ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...

    # Optional: ``wake_order(workers) -> workers``, the order in which the predictor hands a
    # request's runs to its workers (threads: see :class:`~.spread.CoreSpread`).  Transports
    # without it get the workers' own order.

"""The pool's record of one worker (:class:`Worker`) and the states a worker goes through."""

from __future__ import annotations

import enum

from ..core.messages import BatchCounts
from ..transports.base import WorkerHandle


class WorkerState(enum.Enum):
    """Where a worker is in its life; only the pool and its supervisor move it."""

    NEW = "new"
    STARTING = "starting"  # an incarnation is loading its subnets
    UP = "up"  # requests are sent to it
    DOWN = "down"  # dead or hung: its requests in flight are lost, a restart may be under way
    CLOSED = "closed"  # the pool is shut down


UP, STARTING, DOWN, CLOSED = (WorkerState.UP, WorkerState.STARTING, WorkerState.DOWN,
                              WorkerState.CLOSED)


class Worker:
    """The pool's record of one worker: its transport handle and everything kept about it."""

    __slots__ = ("handle", "index", "name", "groups", "state", "pending", "busy_since",
                 "last_progress", "runs", "compute_ms", "skipped", "failures", "restarts",
                 "deaths", "batch_counts", "batch_counts_before", "batch_generation")

    def __init__(self, handle: WorkerHandle):
        self.handle = handle
        self.index, self.name, self.groups = handle.index, handle.name, handle.groups
        self.state = WorkerState.NEW
        self.pending: dict[int, float] = {}  # request -> when it was sent here (monotonic)
        self.busy_since = 0.0  # when pending last became non-empty
        self.last_progress = 0.0  # when this worker last answered anything
        self.runs = 0
        self.compute_ms = 0.0
        self.skipped = 0
        self.failures = 0
        self.restarts = 0
        self.deaths = 0
        # The worker's batching counters: of its current incarnation (as its latest Done said),
        # and of the ones before it (an incarnation counts from zero).
        self.batch_counts = BatchCounts()
        self.batch_counts_before = BatchCounts()
        self.batch_generation = 0

    def counted(self, generation: int, counts: BatchCounts) -> None:
        """The batching counters incarnation ``generation`` reported (with a Done)."""
        if generation != self.batch_generation:
            self.batch_counts_before = self.batch_counts_before + self.batch_counts
            self.batch_generation = generation
        self.batch_counts = counts

    def batching_counts(self) -> BatchCounts:
        """The worker's batching counters over all its incarnations."""
        return self.batch_counts_before + self.batch_counts

    def describe(self) -> dict:
        batching = self.handle.batching
        return {**self.handle.describe(), "state": self.state.value, "restarts": self.restarts,
                "deaths": self.deaths, "runs": self.runs, "skipped": self.skipped,
                "failures": self.failures,
                **({"batching": {"max_rows": batching.max_rows, "delay_us": batching.delay_us,
                                 **self.batching_counts().as_dict()}}
                   if batching is not None else {})}

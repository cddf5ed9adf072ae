"""What every worker does with a request, whatever transport carries it: the one in-worker loop.

A worker hosts the runners of its groups.  :meth:`WorkerCore.serve` takes the runs waiting on its
queue together as one batch (:class:`~sensai.serving.core.messages.Batching`: at most ``max_rows``
image rows; by default only what is queued already, so a request alone never waits for company)
and computes its groups in order - its own first, then its copies of other workers' groups -
each group once for the whole batch, the requests' rows stacked in arrival order.  Each request
gets exactly its own rows back, sent as soon as they are computed, and its
:class:`~sensai.serving.core.messages.Done` after its last group.  A batch costs the runner one call
where its requests one by one cost one each (and a small CNN's call is mostly overhead), so
batching lifts what a worker answers per second exactly when requests queue.

Everything else keeps its meaning per request inside a batch.  Each request first sleeps its
injected delay (fault injection; none by default).  Before a copy the worker may wait up to
``hedge_s`` for the predictor to say the group is answered already
(:class:`~sensai.serving.core.messages.Skip`), so a straggler's copies cost compute only when
needed. A request skipped meanwhile (answered elsewhere, cancelled, expired) leaves the batch before
its rows are computed.  A request whose input cannot be stacked with the others' runs in a batch of
its own, and when a batch's run fails its requests are run again one by one: only a request that
fails alone fails.  Skips can arrive at any time from another thread; they are applied under a
condition variable the waits sleep on.

Thread and process workers, and Ray actors over their socket, feed :meth:`WorkerCore.serve` a
queue of :class:`~sensai.serving.core.messages.Run` messages; Ray Serve replicas call
:meth:`WorkerCore.compute` once per (request, group), unbatched, and :meth:`WorkerCore.begin` /
:meth:`WorkerCore.end` around a request.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ..core.faults import DelaySpec, corrupt_output
from ..core.messages import BatchCounts, Batching, Done, Fault, Output, Run, RunFailed, Skip
from .runners import Runner

EVERY = "every"  # a skip of every group of a request (Skip.groups is None)
MEMORY = 4096  # requests a worker remembers skips for (a late Skip must find its request)


class Stop:
    """Put on a worker's run queue to end :meth:`WorkerCore.serve` (or use it as a ping)."""

    def __init__(self, reply: Callable[[], None] | None = None):
        self.reply = reply


def rows(run: Run) -> int | None:
    """The image rows of a run; None when its input has no batch axis (it cannot be stacked)."""
    x = run.x
    return len(x) if getattr(x, "ndim", 0) >= 1 else None


def stackable(a: Run, b: Run) -> bool:
    """Whether ``b`` can share ``a``'s batch: the same groups to compute the same way, and
    inputs that stack (same row shape and type)."""
    return (a.groups == b.groups and a.primaries == b.primaries and a.hedge_s == b.hedge_s
            and getattr(b.x, "ndim", 0) == a.x.ndim and b.x.shape[1:] == a.x.shape[1:]
            and b.x.dtype == a.x.dtype)


class WorkerCore:
    def __init__(self, runners: Mapping[int, Runner], *, delay: DelaySpec | None = None,
                 corrupt: bool = False, seed: int = 0, batching: Batching | None = None,
                 origin: Callable[[int], int] | None = None,
                 flush: Callable[[], None] | None = None):
        self.runners = dict(runners)
        self.origin = origin  # request -> who sent it, where several do (a device process)
        # Called once a group's events, and once a batch's Dones, are all emitted: where emit
        # only queues (a device process), that is when they leave, together.
        self.flush = flush or (lambda: None)
        self.delay, self.corrupt = delay, bool(corrupt)
        self.batching = batching or Batching()
        self.counts = BatchCounts()
        self.rng = random.Random(seed)
        self.cv = threading.Condition()
        self.skips: OrderedDict[int, set[int] | str] = OrderedDict()
        self.hedge_until: dict[int, float] = {}
        self.closing = False

    # -- control (any thread)

    def fault(self, f: Fault) -> None:
        with self.cv:
            self.delay, self.corrupt = f.delay, bool(f.corrupt)
            if f.seed is not None:
                self.rng = random.Random(f.seed)

    def skip(self, s: Skip) -> None:
        with self.cv:
            if s.groups is None:
                self.skips[s.req] = EVERY
            else:
                cur = self.skips.get(s.req, set())
                if cur is not EVERY:
                    self.skips[s.req] = cur | set(s.groups)
            self.skips.move_to_end(s.req)
            while len(self.skips) > MEMORY:
                self.skips.popitem(last=False)
            self.cv.notify_all()

    def skip_all(self) -> None:
        """Wake every wait (delay, hedge, company) and skip what is queued: the worker is being
        ended."""
        with self.cv:
            self.closing = True
            self.cv.notify_all()

    def skipped(self, req: int, group: int) -> bool:
        if self.closing:
            return True
        s = self.skips.get(req)
        return s is not None and (s is EVERY or group in s)

    # -- one request

    def begin(self, req: int) -> None:
        """The injected delay of this request, if any (cut short when the request is dropped;
        an injected hang only ends with the worker)."""
        if self.delay is None:  # nothing injected (every request in service): no lock to take
            return
        with self.cv:
            if self.delay is not None and self.delay.hangs:
                self.cv.wait_for(lambda: self.closing)
                return
            d = self.delay.sample(self.rng) if self.delay is not None else 0.0
            if d > 0:
                self.cv.wait_for(lambda: self.closing or self.skips.get(req) is EVERY,
                                 timeout=d)

    def hedge(self, reqs: Sequence[int], group: int, hedge_s: float) -> None:
        """Wait until ``group`` of every one of ``reqs`` is answered elsewhere, for at most
        ``hedge_s`` from each request's first copy."""
        with self.cv:
            now = time.perf_counter()
            until = max(self.hedge_until.setdefault(r, now + hedge_s) for r in reqs)
            self.cv.wait_for(lambda: all(self.skipped(r, group) for r in reqs),
                             timeout=max(0.0, until - time.perf_counter()))

    def compute(self, req: int, group: int, x: np.ndarray, *, copy: bool = False,
                hedge_s: float = 0.0) -> Output | RunFailed | None:
        """Group ``group`` of request ``req`` alone: its output, a failure, or None when
        skipped."""
        if copy and hedge_s > 0:
            self.hedge((req,), group, hedge_s)
        # Without a hedge wait no lock: the skip may land an instant later either way, and
        # right after a wake-up every lock taken on the request's path costs (cold caches).
        if self.skipped(req, group):
            return None
        return next(self.results(group, (req,), (x,)))

    def results(self, group: int, reqs: Sequence[int], xs: Sequence[np.ndarray]
                ) -> Iterator[Output | RunFailed]:
        """Group ``group`` of requests ``reqs`` (inputs ``xs``, stackable), in one runner call:
        each request's output of its own rows (or its failure), yielded as soon as computed."""
        runner, corrupt = self.runners[group], self.corrupt
        if len(xs) > 1:
            sizes = [len(x) for x in xs]
            t0 = time.perf_counter()
            try:
                out = np.asarray(runner.run(np.concatenate(xs)), dtype=np.float32)
            except Exception:
                out = None
            if out is not None and out.ndim >= 1 and len(out) == sum(sizes):
                ms = (time.perf_counter() - t0) * 1e3
                for r, part in zip(reqs, np.split(out, np.cumsum(sizes)[:-1])):
                    yield Output(r, group, corrupt_output(part) if corrupt else part, ms)
                return
            # The batch failed (or answered other rows than it was given): each request again
            # on its own, so that only one that fails alone fails, with its own error.
            for r, x in zip(reqs, xs):
                yield from self.results(group, (r,), (x,))
            return
        t0 = time.perf_counter()
        try:
            out = np.asarray(runner.run(xs[0]), dtype=np.float32)
        except Exception as e:  # one subnet failing must not take the worker down
            yield RunFailed(reqs[0], group, f"{type(e).__name__}: {e}")
            return
        ms = (time.perf_counter() - t0) * 1e3
        yield Output(reqs[0], group, corrupt_output(out) if corrupt else out, ms)

    def end(self, req: int) -> None:
        if req not in self.skips and req not in self.hedge_until:
            return  # the usual case; a Skip arriving after this check ages out of MEMORY
        with self.cv:
            self.skips.pop(req, None)
            self.hedge_until.pop(req, None)

    # -- batches of requests

    def run(self, batch: Sequence[Run], emit: Callable[[object], None]) -> None:
        """All of a batch of stackable runs: each group's outputs (or failures) as soon as the
        group's rows are computed, then each request's :class:`Done`."""
        for m in batch:
            self.begin(m.req)
        first = batch[0]
        skipped = [0] * len(batch)
        for j, g in enumerate(first.groups):
            if j >= first.primaries and first.hedge_s > 0:
                self.hedge([m.req for m in batch], g, first.hedge_s)
            live = []
            for i, m in enumerate(batch):
                if self.skipped(m.req, g):
                    skipped[i] += 1
                else:
                    live.append(m)
            if live:
                for event in self.results(g, [m.req for m in live], [m.x for m in live]):
                    emit(event)
                if j + 1 < len(first.groups):
                    self.flush()
        counts = self.counts
        for m, n in zip(batch, skipped):
            self.end(m.req)
            emit(Done(m.req, n, counts))
        self.flush()

    def gather(self, first: Run, runs: "queue.SimpleQueue") -> tuple[list[Run], int, object]:
        """``first`` and the runs queued behind it that can share its batch; how many of them
        were held back waiting for company; and the message taken that ends the batch (None:
        none taken)."""
        most, delay_us = self.batching.max_rows, self.batching.delay_us
        batch, n = [first], rows(first)
        if n is None:
            return batch, 0, None
        held, deadline = 0, None
        while n < most:
            if not runs.empty():  # the one reader: what is there stays there
                msg = runs.get_nowait()
            elif delay_us <= 0:
                break
            else:
                now = time.perf_counter()
                if deadline is None:
                    deadline = now + delay_us / 1e6
                if now >= deadline or self.closing:
                    break
                held = len(batch)  # every one of them waits now
                try:
                    msg = runs.get(timeout=deadline - now)
                except queue.Empty:
                    break
            if type(msg) is not Run or not stackable(first, msg) or n + rows(msg) > most:
                return batch, held, msg
            batch.append(msg)
            n += rows(msg)
        return batch, held, None

    def serve(self, runs: "queue.SimpleQueue", emit: Callable[[object], None],
              alive: Callable[[], bool] = lambda: True) -> None:
        """Runs from ``runs``, in batches of what is waiting, until a :class:`Stop` without a
        reply, or ``alive()`` turns false (the worker was given up on: nothing more is
        emitted)."""
        ahead = None  # taken from the queue while gathering, but not part of that batch
        while True:
            msg, ahead = (runs.get() if ahead is None else ahead), None
            if not alive():
                return
            if isinstance(msg, Stop):
                if msg.reply is None:
                    return
                msg.reply()  # a ping: proves the loop is not stuck
                continue
            batch, held, ahead = self.gather(msg, runs)
            n = len(batch)
            mixed = self.origin is not None and n > 1 and len(
                {self.origin(m.req) for m in batch}) > 1
            self.counts = self.counts + BatchCounts(1, n, n, held, int(mixed))
            self.run(batch, emit)

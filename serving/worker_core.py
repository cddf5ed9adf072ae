"""What every worker does with a request, whatever transport carries it: the one in-worker loop.

A worker hosts the runners of its groups.  For each request it sleeps an injected delay (fault
injection; none by default), then computes its groups in order - its own first, then its copies
of other workers' groups.  Before a copy it may wait up to ``hedge_s`` for the predictor to say
the group is answered already (:class:`~sensai.serving.messages.Skip`), so a straggler's copies
cost compute only when needed.  Skips can arrive at any time from another thread; they are
applied under a condition variable the hedge wait sleeps on.

Thread and process workers feed :meth:`WorkerCore.serve` a queue of
:class:`~sensai.serving.messages.Run` messages; Ray actors call :meth:`WorkerCore.compute` once
per (request, group) and :meth:`WorkerCore.begin` / :meth:`WorkerCore.end` around a request.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import OrderedDict
from typing import Callable, Mapping

import numpy as np

from .faults import DelaySpec, corrupt_output
from .messages import Done, Failure, Fault, Output, Run, Skip
from .runners import Runner

EVERY = "every"  # a skip of every group of a request (Skip.groups is None)
MEMORY = 4096  # requests a worker remembers skips for (a late Skip must find its request)


class Stop:
    """Put on a worker's run queue to end :meth:`WorkerCore.serve` (or use it as a ping)."""

    def __init__(self, reply: Callable[[], None] | None = None):
        self.reply = reply


class WorkerCore:
    def __init__(self, runners: Mapping[int, Runner], *, delay: DelaySpec | None = None,
                 corrupt: bool = False, seed: int = 0):
        self.runners = dict(runners)
        self.delay, self.corrupt = delay, bool(corrupt)
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
        """Wake every wait (delay, hedge) and skip what is queued: the worker is being ended."""
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

    def compute(self, req: int, group: int, x: np.ndarray, *, copy: bool = False,
                hedge_s: float = 0.0) -> Output | Failure | None:
        """Group ``group`` of request ``req``: its output, a failure, or None when skipped."""
        if copy and hedge_s > 0:
            with self.cv:
                until = self.hedge_until.setdefault(req, time.perf_counter() + hedge_s)
                self.cv.wait_for(lambda: self.skipped(req, group),
                                 timeout=max(0.0, until - time.perf_counter()))
        # Without a hedge wait no lock: the skip may land an instant later either way, and
        # right after a wake-up every lock taken on the request's path costs (cold caches).
        if self.skipped(req, group):
            return None
        corrupt = self.corrupt
        t0 = time.perf_counter()
        try:
            out = np.asarray(self.runners[group].run(x), dtype=np.float32)
        except Exception as e:  # one subnet failing must not take the worker down
            return Failure(req, group, f"{type(e).__name__}: {e}")
        ms = (time.perf_counter() - t0) * 1e3
        return Output(req, group, corrupt_output(out) if corrupt else out, ms)

    def end(self, req: int) -> None:
        if req not in self.skips and req not in self.hedge_until:
            return  # the usual case; a Skip arriving after this check ages out of MEMORY
        with self.cv:
            self.skips.pop(req, None)
            self.hedge_until.pop(req, None)

    def run(self, msg: Run, emit: Callable[[object], None]) -> None:
        """All of a :class:`Run`: outputs (or failures) one by one as they are computed, then
        :class:`Done`."""
        self.begin(msg.req)
        skipped = 0
        for j, g in enumerate(msg.groups):
            res = self.compute(msg.req, g, msg.x, copy=j >= msg.primaries, hedge_s=msg.hedge_s)
            if res is None:
                skipped += 1
            else:
                emit(res)
        self.end(msg.req)
        emit(Done(msg.req, skipped))

    def serve(self, runs: "queue.SimpleQueue", emit: Callable[[object], None],
              alive: Callable[[], bool] = lambda: True) -> None:
        """Runs from ``runs`` until a :class:`Stop` without a reply, or ``alive()`` turns false
        (the worker was given up on: nothing more is emitted)."""
        while True:
            msg = runs.get()
            if not alive():
                return
            if isinstance(msg, Stop):
                if msg.reply is None:
                    return
                msg.reply()  # a ping: proves the loop is not stuck
                continue
            self.run(msg, emit)

"""What every worker does with a request, whatever transport carries it: the one in-worker loop.

A worker is one device (:class:`~.device_runner.DeviceRunner`: every subnet placed on it,
computed in one call).  :meth:`WorkerCore.serve` takes the runs waiting on its queue together as
one batch (:class:`~sensai.serving.core.messages.Batching`: at most ``max_rows`` image rows of
any subnet; by default only what is queued already, so a request alone never waits for company),
whatever groups they ask for and in whatever order they came, and computes every group that the
same rows need in one device call: the usual batch (every run asking for every group the device
holds) is one call, one wait.  Copies of other workers' groups join that call unless a run hedges
them (then they are a call of their own, after the own groups are answered).  Each request gets
exactly its own rows back, sent as soon as its call is computed
(:class:`~sensai.serving.core.messages.Outputs`, one per group), and its Done after its last
group (:class:`~sensai.serving.core.messages.Dones`, one per batch); transports that carry
per-request events split them (:func:`~sensai.serving.core.messages.each`).  While a GPU
computes one batch, the next gathers on the queue, so batches grow with the load by themselves;
and where the device computes apart from the host (GPUs, the sim runtime), the next batch is
launched before the one in flight is answered, so the host's work overlaps the device's
(where the runners' devices compute apart from the host, see :meth:`WorkerCore.serve`).
A batch costs the device one call where its requests one by one cost one each (and a small
CNN's call is mostly overhead), so batching lifts what a worker answers per second exactly
when requests queue.

Everything else keeps its meaning per request inside a batch.  Each request first sleeps its
injected delay (fault injection; none by default).  Before a copy the worker may wait up to
``hedge_s`` for the predictor to say the group is answered already
(:class:`~sensai.serving.core.messages.Skip`), so a straggler's copies cost compute only when
needed. A request skipped meanwhile (answered elsewhere, cancelled, expired) leaves the batch before
its rows are computed.  A request whose input cannot be stacked with the others' runs in a batch of
its own, and when a batch's run fails its requests are run again one by one: only a request that
fails alone fails, and one subnet failing fails only its own answers.  Skips can arrive at any
time from another thread; they are applied under a condition variable the waits sleep on.

Thread and process workers, device processes, and Ray actors and Ray Serve replicas over their
socket, feed :meth:`WorkerCore.serve` a queue of :class:`~sensai.serving.core.messages.Run`
messages.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np

from ..core.faults import DelaySpec, corrupt_output
from ..core.messages import (BatchCounts, Batching, Dones, Fault, Outputs, Run, RunFailed,
                             Skip, each)
from .device_runner import DeviceLaunch, DeviceRunner, as_device, wait_devices
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


def row_kind(x: np.ndarray) -> tuple:
    """What rows must share to be stacked: their shape and type."""
    return x.shape[1:], x.dtype


def per_request(emit: Callable[[object], None]) -> Callable[[object], None]:
    """An emitter of the loop's batch events for a transport that carries per-request ones."""
    def split(event) -> None:
        for one in each(event):
            emit(one)

    return split


class Control:
    """What any thread may change about a worker's requests, under the one condition variable
    that every wait of the loop sleeps on (delay, hedge, company): the injected faults, the
    skips, each request's hedge deadline, and the worker's end."""

    def __init__(self, delay: DelaySpec | None, corrupt: bool, seed: int):
        self.delay, self.corrupt = delay, bool(corrupt)
        self.rng = random.Random(seed)
        self.cv = threading.Condition()
        self.skips: OrderedDict[int, set[int] | str] = OrderedDict()
        self.hedge_until: dict[int, float] = {}
        self.closing = False

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

    def hedge(self, waits: Sequence[tuple[int, int, float]]) -> None:
        """Wait until every ``(request, group, hedge_s)`` of ``waits`` is answered elsewhere,
        for at most ``hedge_s`` from each request's first copy."""
        with self.cv:
            now = time.perf_counter()
            until = max(self.hedge_until.setdefault(r, now + h) for r, _, h in waits)
            self.cv.wait_for(lambda: all(self.skipped(r, g) for r, g, _ in waits),
                             timeout=max(0.0, until - time.perf_counter()))

    def end(self, req: int) -> None:
        if req not in self.skips and req not in self.hedge_until:
            return  # the usual case; a Skip arriving after this check ages out of MEMORY
        with self.cv:
            self.skips.pop(req, None)
            self.hedge_until.pop(req, None)


def tasks(batch: Sequence[Run]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """A batch's work, each group -> its runs' places in ``batch``: the worker's own groups
    (and the copies, unless some run hedges them), and the copies of other workers' groups."""
    own: dict[int, list[int]] = {}
    copies: dict[int, list[int]] = {}
    # Copies nobody waits to hedge are computed in the same call as the own groups.
    hedged = any(m.hedge_s > 0 for m in batch)
    for i, m in enumerate(batch):
        groups = m.groups
        p = m.primaries if hedged else len(groups)
        for j, g in enumerate(groups):
            (own if j < p else copies).setdefault(g, []).append(i)
    return own, copies


def gather(first: Run, runs: "queue.SimpleQueue", batching: Batching, control: Control,
           hold: bool = True) -> tuple[list[Run], int, object]:
    """``first`` and the runs queued behind it that fit its batch (at most ``max_rows`` rows of
    any group); how many of them were held back waiting for company (never any without
    ``hold``: a batch in flight is waiting to be answered); and the message taken that ends the
    batch (None: none taken)."""
    most = batching.max_rows
    delay_us = batching.delay_us if hold else 0.0
    batch = [first]
    n = rows(first)
    if n is None:
        return batch, 0, None
    filled = dict.fromkeys(first.groups, n)  # rows per group
    held, deadline = 0, None
    while True:
        if not runs.empty():  # the one reader: what is there stays there
            msg = runs.get_nowait()
        elif delay_us <= 0 or min(filled.values()) >= most:
            break
        else:
            now = time.perf_counter()
            if deadline is None:
                deadline = now + delay_us / 1e6
            if now >= deadline or control.closing:
                break
            held = len(batch)  # every one of them waits now
            try:
                msg = runs.get(timeout=deadline - now)
            except queue.Empty:
                break
        if type(msg) is not Run or getattr(msg.x, "ndim", 0) < 1:
            return batch, held, msg
        k, groups = len(msg.x), msg.groups
        if len(groups) == 1:  # the usual: one group
            now_filled = filled.get(groups[0], 0) + k
            if now_filled > most:
                return batch, held, msg
            filled[groups[0]] = now_filled
        else:
            if any(filled.get(g, 0) + k > most for g in groups):
                return batch, held, msg
            for g in groups:
                filled[g] = filled.get(g, 0) + k
        batch.append(msg)

    return batch, held, None


class DeviceCalls:
    """The device calls of one worker: each group of a batch computed on the rows of its runs
    not skipped, and each request's rows (or its failure) emitted once computed; the calls and
    each subnet's batches counted."""

    def __init__(self, device: DeviceRunner, control: Control):
        self.device = device
        self.control = control  # the skips, and whether outputs are corrupted
        self.calls = 0  # the device's calls (each computes every group it is asked for)
        self.group_counts = {g: BatchCounts() for g in device.groups}  # each subnet's

    def alone(self, groups: Sequence[int], req: int, x: np.ndarray) -> list[Outputs | RunFailed]:
        """Groups ``groups`` of one request, in a device call of their own."""
        t0 = time.perf_counter()
        one = self.device.launch((x,), groups)
        self.calls += 1
        wait_devices((one,))
        ms = (time.perf_counter() - t0) * 1e3
        return [self.single(g, req, *self.picked(one, g), ms) for g in groups]

    @staticmethod
    def picked(one: DeviceLaunch, g: int) -> tuple[np.ndarray | None, Exception | None]:
        """Group ``g``'s rows of launch ``one``, or the error they failed with."""
        try:
            return np.asarray(one.result(g), dtype=np.float32), None
        except Exception as e:  # one subnet failing must not take the worker down
            return None, e

    def single(self, group: int, req: int, out: np.ndarray | None, error: Exception | None,
               ms: float) -> Outputs | RunFailed:
        """One request's answer from group ``group``: its rows, or its failure."""
        if error is not None:
            return RunFailed(req, group, f"{type(error).__name__}: {error}")
        return Outputs(group, (req,), corrupt_output(out) if self.control.corrupt else out,
                       (len(out) if out.ndim else 1,), ms)

    def launch(self, tasks: Mapping[int, list[int]], batch: Sequence[Run], skipped: list[int],
               emit: Callable[[object], None]) -> None:
        """Each group of ``tasks`` (group -> its runs' places in ``batch``) on the rows of its
        runs not skipped: every call made before any is waited for, then emitted."""
        self.collect(self.launches(tasks, batch, skipped), emit)

    def launches(self, tasks: Mapping[int, list[int]], batch: Sequence[Run],
                 skipped: list[int]) -> list[tuple]:
        """The groups of ``tasks`` computed on the rows of their runs not skipped (counted in
        ``skipped``), nothing waited for: one device call for all the groups that the same runs
        need (the usual: every group, every run), one per kind of rows.  Each is (groups, runs,
        launch, start, seconds it took where it computed as it launched)."""
        control = self.control
        some_skipped = control.skips or control.closing
        calls: dict[tuple[int, ...], list[int]] = {}  # the runs' places -> their groups
        for g, places in tasks.items():
            if some_skipped:
                live = []
                for i in places:
                    if control.skipped(batch[i].req, g):
                        skipped[i] += 1
                    else:
                        live.append(i)
                if not live:
                    continue
                places = live
            calls.setdefault(tuple(places), []).append(g)
        launched = []
        for places, groups in calls.items():
            live = [batch[i] for i in places]
            if len(live) > 1 and len({row_kind(m.x) for m in live}) > 1:
                kinds: dict[tuple, list[Run]] = {}
                for m in live:
                    kinds.setdefault(row_kind(m.x), []).append(m)
                parts = list(kinds.values())
            else:
                parts = [live]
            for runs in parts:
                t0 = time.perf_counter()
                one = self.device.launch([m.x for m in runs], groups)
                self.calls += 1
                # A device that computed as it launched (CPUs) took its own time; the others
                # are done when the wait below is.
                took = time.perf_counter() - t0 if one.computed else None
                launched.append((groups, runs, one, t0, took))
        return launched

    def collect(self, launched: list[tuple], emit: Callable[[object], None]) -> None:
        """Wait once for every one of ``launched`` (see :meth:`launches`), then emit each."""
        if not launched:
            return
        wait_devices([one for _, _, one, _, _ in launched])
        done = time.perf_counter()
        for groups, runs, one, t0, took in launched:
            ms = ((done - t0) if took is None else took) * 1e3
            for g in groups:
                self.answer(g, runs, one, ms, emit)

    def answer(self, g: int, runs: Sequence[Run], one: DeviceLaunch, ms: float,
               emit: Callable[[object], None]) -> None:
        """Emit group ``g`` of launch ``one`` for ``runs``: each request's rows, or (when the
        batch failed, or answered other rows than it was given) each request again alone, so
        that only one that fails alone fails, with its own error."""
        out, error = self.picked(one, g)
        n = len(runs)
        if n == 1:
            m = runs[0]
            self.count(g, 1, len(m.x) if getattr(m.x, "ndim", 0) else 1)
            emit(self.single(g, m.req, out, error, ms))
            return
        sizes = [len(m.x) for m in runs]  # several runs: each has rows (gather saw to it)
        total = sum(sizes)
        self.count(g, n, total)
        if error is None and out.ndim >= 1 and len(out) == total:
            emit(Outputs(g, [m.req for m in runs],
                         corrupt_output(out) if self.control.corrupt else out, sizes, ms))
            return
        for m in runs:
            emit(self.alone((g,), m.req, m.x)[0])

    def count(self, g: int, requests: int, rows: int) -> None:
        c = self.group_counts[g]
        self.group_counts[g] = BatchCounts(c.batches + 1, c.requests + requests,
                                           max(c.largest, requests), 0, 0, c.rows + rows)


class WorkerCore:
    """The loop of one worker over its device (:class:`~.device_runner.DeviceRunner`, or a
    mapping of group -> runner, computed one after the other): batches gathered from its queue
    (:func:`gather`), their device calls (:class:`DeviceCalls`), and what other threads say
    about its requests (:class:`Control`)."""

    def __init__(self, runners: DeviceRunner | Mapping[int, Runner], *,
                 delay: DelaySpec | None = None,
                 corrupt: bool = False, seed: int = 0, batching: Batching | None = None,
                 origin: Callable[[int], int] | None = None,
                 flush: Callable[[], None] | None = None):
        self.device = as_device(runners)
        self.groups = frozenset(self.device.groups)
        self.origin = origin  # request -> who sent it, where several do (a device process)
        # Called once the own groups' events, and once a batch's Dones, are all emitted: where
        # emit only queues (a device process), that is when they leave, together.
        self.flush = flush or (lambda: None)
        self.control = Control(delay, corrupt, seed)
        self.device_calls = DeviceCalls(self.device, self.control)
        self.batching = batching or Batching()
        # Overlap a batch's answers with the next batch's device time: only where a launch
        # returns before its device is done (a CPU runner computes as it launches, so the next
        # batch would only delay this one's answers).
        self.overlap = self.device.overlaps
        self.counts = BatchCounts()  # the loop's batches of runs

    @property
    def calls(self) -> int:
        """The device's calls (each computes every group it is asked for)."""
        return self.device_calls.calls

    @property
    def group_counts(self) -> dict[int, BatchCounts]:
        """Each subnet's batches."""
        return self.device_calls.group_counts

    # -- control (any thread): see Control

    def fault(self, f: Fault) -> None:
        self.control.fault(f)

    def skip(self, s: Skip) -> None:
        self.control.skip(s)

    def skip_all(self) -> None:
        self.control.skip_all()

    # -- batches of requests

    def gather(self, first: Run, runs: "queue.SimpleQueue", hold: bool = True
               ) -> tuple[list[Run], int, object]:
        """See :func:`gather`, under this worker's batching."""
        return gather(first, runs, self.batching, self.control, hold)

    def run(self, batch: Sequence[Run], emit: Callable[[object], None]) -> None:
        """All of a batch of runs: its own groups launched together, their outputs (or
        failures) once computed; then the copies, after their hedge; then the Dones."""
        control, calls = self.control, self.device_calls
        if control.delay is not None:
            for m in batch:
                control.begin(m.req)
        own, copies = tasks(batch)
        skipped = [0] * len(batch)
        calls.launch(own, batch, skipped, emit)
        if copies:
            self.flush()
            waits = [(batch[i].req, g, batch[i].hedge_s) for g, idx in copies.items()
                     for i in idx if batch[i].hedge_s > 0]
            if waits:
                control.hedge(waits)
            calls.launch(copies, batch, skipped, emit)
        self.close(batch, skipped, emit)

    def close(self, batch: Sequence[Run], skipped: list[int],
              emit: Callable[[object], None]) -> None:
        """A batch's end: what the worker remembered of its requests let go, its Dones."""
        control = self.control
        if control.skips or control.hedge_until:
            for m in batch:
                control.end(m.req)
        core = self.counts
        counts = {g: BatchCounts(c.batches, c.requests, c.largest, core.held, core.mixed, c.rows)
                  for g, c in self.device_calls.group_counts.items()}
        emit(Dones([m.req for m in batch], skipped, [m.groups[0] if m.groups else -1
                                                     for m in batch], counts))
        self.flush()

    def start(self, batch: Sequence[Run]) -> "Started | None":
        """Launch a batch's groups and return without waiting for them (see :meth:`serve`):
        None where it needs the whole of :meth:`run` (injected delays, copies to hedge)."""
        if self.control.delay is not None:
            return None
        own, copies = tasks(batch)
        if copies:
            return None
        skipped = [0] * len(batch)
        return Started(batch, skipped, self.device_calls.launches(own, batch, skipped))

    def finish(self, started: "Started", emit: Callable[[object], None]) -> None:
        """A batch :meth:`start` launched: its outputs once computed, then its Dones."""
        self.device_calls.collect(started.launched, emit)
        self.close(started.batch, started.skipped, emit)

    def tally(self, batch: Sequence[Run], held: int) -> None:
        """Count a gathered batch in :attr:`counts`."""
        n = len(batch)
        mixed = self.origin is not None and n > 1 and len(
            {self.origin(m.req) for m in batch}) > 1
        self.counts = self.counts + BatchCounts(
            1, n, n, held, int(mixed), sum(rows(m) or 1 for m in batch))

    def serve(self, runs: "queue.SimpleQueue", emit: Callable[[object], None],
              alive: Callable[[], bool] = lambda: True) -> None:
        """Runs from ``runs``, in batches of what is waiting, until a :class:`Stop` without a
        reply, or ``alive()`` turns false (the worker was given up on: nothing more is
        emitted).  ``emit`` gets the loop's batch events (:func:`per_request` splits them).

        Where the worker overlaps (:attr:`overlap`: its runners' devices compute apart from the
        host), a batch is launched and left in flight while the next one is gathered from what
        is queued and launched; only then is the first waited for and answered.  The host's
        work for one batch (answering, gathering, staging) then runs while the device computes
        the other, where one batch at a time leaves the device idle meanwhile.  A lone run is
        answered as soon as before: with nothing queued the batch in flight is finished at once."""
        ahead = None  # taken from the queue while gathering, but not part of that batch
        pending: Started | None = None  # launched, not answered yet (overlapping only)
        while True:
            if ahead is not None:
                msg, ahead = ahead, None
            elif pending is None:
                msg = runs.get()
            elif runs.empty():  # the one reader: nothing queued, so nothing to overlap with
                self.finish(pending, emit)
                pending = None
                continue
            else:
                msg = runs.get_nowait()
            if not alive():
                return
            if isinstance(msg, Stop):
                if pending is not None:
                    self.finish(pending, emit)
                    pending = None
                if msg.reply is None:
                    return
                msg.reply()  # a ping: proves the loop is not stuck
                continue
            batch, held, ahead = gather(msg, runs, self.batching, self.control,
                                        hold=pending is None)
            self.tally(batch, held)
            started = self.start(batch) if self.overlap else None
            if pending is not None:
                self.finish(pending, emit)
            pending = started
            if started is None:
                self.run(batch, emit)


class Started:
    """A batch :meth:`WorkerCore.start` launched: its runs, how many of each were skipped, and
    its launches (see :meth:`DeviceCalls.launches`)."""

    __slots__ = ("batch", "skipped", "launched")

    def __init__(self, batch: Sequence[Run], skipped: list[int], launched: list[tuple]):
        self.batch, self.skipped, self.launched = batch, skipped, launched

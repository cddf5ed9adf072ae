"""Class parallelism: one image fanned out to every subnet at once, their outputs merged.

:class:`ClassParallelPredictor` is the only class-parallel predictor, and its one job is the
request path.  What varies is elsewhere:

* the *plan* (:class:`~sensai.serving.engine.plan.ServingPlan`): which worker hosts which
  groups.  Without redundancy every group has its own worker; with redundancy ``r`` every group
  has ``r + 1`` copies on distinct workers (``2r + 1`` in vote mode);
* the *transport* (:mod:`sensai.serving.transports`): threads, processes, Ray actors, Ray Serve
  replicas or a Triton server run the workers, which the
  :class:`~sensai.serving.engine.pool.WorkerPool` starts, watches and restarts;
* the *decoder* (:class:`~sensai.serving.engine.decoder.CoverageDecoder`): per request, the first
  copy of each group to arrive answers it (vote mode: ``r + 1`` agreeing copies), so a straggler
  or a dead worker does not stall the answer; without redundancy it waits for every group.

A request is answered as soon as every group is decided, and the outputs go through
:class:`sensai.merge.Merger` - the rule offline evaluation uses.  When some classes cannot be
answered (every copy lost) the request fails at once with a 503 naming them, or at its deadline
with a 504; a caller that allows partial answers gets the others, flagged ``degraded``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import numpy as np

from sensai.artifact import Artifact, subnet_name
from sensai.merge import Merger, merger

from ..core.contract import Prediction
from ..core.errors import SubnetFailed, SubnetTimeout
from ..core.messages import Output, Run, RunFailed, Skip
from ..transports.base import Transport
from .decoder import CoverageDecoder
from .plan import ServingPlan
from .pool import WorkerPool, resolve, wake
from .worker import UP, Worker

log = logging.getLogger(__name__)


class _Request:
    __slots__ = ("id", "loop", "thread", "future", "decoder", "allow_partial", "t0",
                 "arrival_ms", "compute_ms", "parts", "dispatched", "done", "timed_out")

    def __init__(self, req_id: int, loop: asyncio.AbstractEventLoop, decoder: CoverageDecoder,
                 allow_partial: bool):
        self.id = req_id
        self.loop = loop
        self.thread = threading.get_ident()  # the loop's
        self.future = loop.create_future()
        self.decoder = decoder
        self.allow_partial = allow_partial
        self.t0 = time.perf_counter()
        self.arrival_ms: dict[int, float] = {}
        self.compute_ms: dict[int, float] = {}
        self.parts: dict[int, list[float]] = {}  # each decided group's share of the merge
        self.dispatched: list[Worker] = []
        self.done = False  # no event changes the decoder any more
        self.timed_out = False


class Answers:
    """How a finished request is answered: its decided groups' outputs merged by the rule
    offline evaluation uses (over the answered groups only, for a partial answer), with its
    timings and who answered each group; or the error that names the classes left without an
    answer.  It counts each worker's deciding and outvoted copies, and the degraded answers."""

    def __init__(self, artifact: Artifact, redundancy: int, worker_names: list[str]):
        manifest = artifact.manifest
        self.manifest = manifest
        self.classes = artifact.spec.classes
        self.redundancy = redundancy
        self.groups = [list(g) for g in manifest.groups]
        self.outputs = [s.num_outputs for s in manifest.subnets]
        self.merge = Merger(self.groups, self.outputs, manifest.num_classes)
        self.names = [subnet_name(g) for g in range(len(self.groups))]
        self.compute_keys = ["compute." + n for n in self.names]
        self.every_group = list(range(len(self.groups)))
        self.worker_names = worker_names
        n = len(worker_names)
        self.answered = [0] * n  # per worker: groups its copy decided
        self.outvoted = [0] * n
        self.degraded = 0

    def answer(self, req: _Request, given: float) -> Prediction:
        dec = req.decoder
        if dec.complete:  # every request but a degraded or failed one
            missing, covered, merge = None, self.every_group, self.merge
        else:
            missing = dec.undecided()
            if not (req.allow_partial and dec.decided):
                self.fail(req, missing, given)
            covered = sorted(dec.decided)
            # The same rule over the answered groups: 0 for the classes of the others.
            merge = merger(tuple(tuple(self.groups[g]) for g in covered),
                           tuple(self.outputs[g] for g in covered), self.manifest.num_classes)
        decided = [dec.decided[g] for g in covered]
        parts = req.parts
        t2 = time.perf_counter()
        scores = merge([d.output for d in decided], [parts.get(g) for g in covered])
        t3 = time.perf_counter()
        # Unrounded: this runs on every request, after the last subnet answered.
        names, keys, workers = self.names, self.compute_keys, self.worker_names
        arrival, compute = req.arrival_ms, req.compute_ms
        timings, answered_by = {}, {}
        for g, d in zip(covered, decided):
            name = names[g]
            timings[name] = arrival[g]
            timings[keys[g]] = compute[g]
            answered_by[name] = workers[d.worker]
            self.answered[d.worker] += 1
            for w in d.outvoted:
                self.outvoted[w] += 1
        spent = compute.values()
        timings["compute"] = max(spent)  # the slowest subnet: the floor
        timings["compute_sum"] = sum(spent)
        timings["merge"] = (t3 - t2) * 1e3
        timings["total"] = (t3 - req.t0) * 1e3
        if not missing:
            return Prediction(scores, timings, answered_by=answered_by)
        self.degraded += 1
        log.warning("request %d answered degraded: no answer for %s", req.id,
                    self.describe_groups(missing))
        return Prediction(scores, timings, degraded=True,
                          covered_classes=sorted(c for g in covered for c in self.groups[g]),
                          missing_classes=self.class_names(missing), answered_by=answered_by)

    def fail(self, req: _Request, missing: list[int], given: float) -> None:
        dec = req.decoder
        if req.timed_out:
            waiting = sorted({self.worker_names[w] for g in missing for w in dec.waiting_on(g)})
            raise SubnetTimeout(
                f"no answer within the {given:.3g} s deadline for classes "
                f"{self.describe_groups(missing)} (waiting for "
                f"{', '.join(waiting) or 'no live worker'})",
                subnet=subnet_name(missing[0]), missing_classes=self.class_names(missing))
        missing = dec.unreachable() or missing  # name the groups out of reach
        reasons = sorted({r for g in missing for r in dec.lost_reasons.get(g, [])})
        raise SubnetFailed(
            f"no live copy of classes {self.describe_groups(missing)} "
            f"({'; '.join(reasons) or 'copies lost'}; redundancy {self.redundancy}); "
            "retry, or allow a partial answer over the other classes",
            subnet=subnet_name(missing[0]), missing_classes=self.class_names(missing))

    def class_names(self, groups) -> list[str]:
        names = self.classes
        return [names[c] for g in sorted(groups) for c in self.groups[g]]

    def describe_groups(self, groups) -> str:
        names = self.classes
        return "; ".join(f"{subnet_name(g)}: " + ", ".join(f"{c} ({names[c]})"
                                                           for c in self.groups[g])
                         for g in sorted(groups))


class ClassParallelPredictor:
    """``artifact``'s subnets on the workers ``plan`` lays out, over ``transport``; blocks until
    every worker is ready.  ``hedge_ms`` (a setting): a worker computes its own groups at once
    but waits up to this long before computing copies, skipped if their group is answered
    meanwhile."""

    def __init__(self, artifact: Artifact, plan: ServingPlan, transport: Transport):
        manifest = artifact.manifest
        self.artifact = artifact
        self.manifest = manifest
        self.spec = artifact.spec
        self.plan = plan
        self.name = plan.settings.model_name
        self.groups = [list(g) for g in manifest.groups]
        self.placement = plan.placement
        if len(self.placement.hosts) != len(self.groups):
            raise ValueError(f"a plan for {len(self.placement.hosts)} groups, an artifact of "
                             f"{len(self.groups)}")
        self.transport = transport
        self._wake_order = getattr(transport, "wake_order", None)  # optional, see Transport
        self._sent = getattr(transport, "sent", None)  # optional, see Transport
        self.deadline_s = plan.settings.deadline_s
        self.hedge_s = plan.settings.hedge_ms / 1e3
        self.hosts = [list(h) for h in self.placement.hosts]
        self._single_copy = all(len(h) == 1 for h in self.hosts)
        self.need = self.placement.need
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.pool = WorkerPool(plan, transport, self)
        self.lock = self.pool.lock  # one lock for the workers' records and the requests'
        self.workers = self.pool.workers
        self.answers = Answers(artifact, self.placement.redundancy,
                               [w.name for w in self.workers])
        # The answers' own lists, which they count into: readable here as before.
        self.answered, self.outvoted = self.answers.answered, self.answers.outvoted
        self._runs = [(w.groups, self.placement.primaries(w.index)) for w in self.workers]
        self.pool.start()

    @property
    def degraded_answers(self) -> int:
        return self.answers.degraded

    # -- the request path

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      deadline: float | None = None) -> Prediction:
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.deadline_s
        given = max(0.0, deadline - loop.time())
        req = _Request(next(self._ids), loop, CoverageDecoder(self.hosts, need=self.need),
                       allow_partial)
        dec = req.decoder
        self._requests[req.id] = req
        timer = None
        try:
            with self.lock:
                for w in self.workers:
                    if w.state is not UP:
                        dec.lose(w.index, reason=f"{w.name} is {w.state.value}")
                if not (dec.blocked and not allow_partial):  # else fail now, computing nothing
                    req.dispatched = self.pool.take(req.id, time.monotonic())
                finished = dec.finished(allow_partial)
                req.done = finished
            if not finished:
                timer = loop.call_at(deadline, self._expire, req)
            # The runs leave last, right before this thread waits and lets go of the GIL: a
            # worker woken while the GIL is still held sleeps again until it is handed on, and
            # then tends to run after the other workers instead of beside them.
            order = self._wake_order
            for w in (req.dispatched if order is None else order(req.dispatched)):
                groups, primaries = self._runs[w.index]
                w.handle.send(Run(req.id, x, groups, primaries, self.hedge_s))
            if self._sent is not None:
                self._sent()
            if not finished:
                await req.future
        finally:
            if timer is not None:
                timer.cancel()
            self._requests.pop(req.id, None)
            # Answered, failed or timed out: what a worker has not computed yet is not needed.
            # Without copies a complete answer leaves nothing to skip (and the worker that
            # completed it marked it done).
            if not (req.done and self._single_copy and dec.complete):
                with self.lock:
                    req.done = True
                    busy = self.pool.busy_with(req.id, req.dispatched)
                for w in busy:
                    w.handle.send(Skip(req.id, None))
        return self.answers.answer(req, given)

    def _expire(self, req: _Request) -> None:
        with self.lock:
            if not req.done:
                req.done = True
                req.timed_out = True
        resolve(req.future)

    # -- what the pool hears from the workers (any thread)

    def result(self, w: Worker, event: Output | RunFailed) -> None:
        req = self._requests.get(event.req)
        if req is None:
            return  # a late copy, or a request already answered
        skips: list[int] = []
        share = None
        g = event.group
        with self.lock:
            if req.done:
                return
            dec = req.decoder
            if type(event) is Output:
                out = event.output
                if out.ndim == 1:
                    out = out[:, None]
                width = self.answers.outputs[g]
                if out.shape[-1] != width:
                    log.error("%s answered %s with shape %s, expected [B, %d]", w.name,
                              subnet_name(g), out.shape, width)
                    dec.lose(w.index, g, f"{w.name} answered a wrong shape")
                elif dec.add(g, w.index, out):
                    req.arrival_ms[g] = (time.perf_counter() - req.t0) * 1e3
                    req.compute_ms[g] = event.ms
                    share = dec.decided[g].output
                    if not dec.complete:
                        skips = dec.waiting_on(g)
            else:
                dec.lose(w.index, g, f"{w.name}: {event.error}")
            finished = dec.finished(req.allow_partial)
            if finished:
                req.done = True
        for i in skips:  # the other holders of that group need not compute it
            self.workers[i].handle.send(Skip(req.id, (g,)))
        if finished:
            if threading.get_ident() == req.thread:  # read on the request's own loop
                resolve(req.future)
            else:
                req.loop.call_soon_threadsafe(resolve, req.future)
        elif share is not None and share.shape[0] == 1:
            # While other subnets still compute, this group's share of the merge is worked out
            # here, off the request's path; the answer then only combines the shares.  (The last
            # group's is left to the event loop: working it out before waking the loop gains
            # nothing, as nothing else runs then.)
            req.parts[g] = self.answers.merge.part(share)

    def lost(self, w: Worker, requests: list[int], reason: str) -> None:
        """``w`` went down: its copies of ``requests`` will not arrive."""
        finished = []
        with self.lock:
            for req_id in requests:
                req = self._requests.get(req_id)
                if req is None or req.done:
                    continue
                req.decoder.lose(w.index, reason=reason)
                if req.decoder.finished(req.allow_partial):
                    req.done = True
                    finished.append(req)
        for req in finished:
            wake(req.loop, resolve, req.future)

    # -- state

    def is_ready(self) -> bool:
        """Ready when every group can be decided by the live workers."""
        up = self.pool.up()
        return (all(sum(1 for w in h if w in up) >= self.need for h in self.hosts)
                and self.transport.healthy())

    def describe(self) -> dict:
        classes = self.spec.classes
        workers = [dict(d, answered=self.answered[i], outvoted=self.outvoted[i],
                        primary=[g for g in d["groups"] if self.hosts[g][0] == i],
                        classes=[[classes[c] for c in self.groups[g]] for g in d["groups"]])
                   for i, d in enumerate(self.pool.describe())]
        batching = self.workers[0].handle.batching
        return {"strategy": "class-parallel", "backend": self.transport.name,
                "transport": self.transport.describe(), "model": self.manifest.model,
                "groups": self.groups, "deadline_s": self.deadline_s,
                "redundancy": self.placement.redundancy, "vote": self.placement.vote,
                "copies_per_group": len(self.hosts[0]), "agreeing_copies_needed": self.need,
                "hedge_ms": round(self.hedge_s * 1e3, 3),
                "batching": None if batching is None else
                {"max_rows": batching.max_rows, "delay_us": batching.delay_us},
                "placement": [list(p) for p in self.placement.workers], "hosts": self.hosts,
                "degraded_answers": self.degraded_answers, "workers": workers}

    def shutdown(self) -> None:
        self.pool.close()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

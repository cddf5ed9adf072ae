"""Class parallelism: one image fanned out to every subnet at once, their outputs merged.

:class:`ClassParallelPredictor` is the only class-parallel predictor; what varies is

* the *transport* (:mod:`sensai.serving.transports`): threads, processes, Ray actors, Ray Serve
  replicas or a Triton server run the workers;
* the *placement* (:class:`~sensai.serving.core.placement.Placement`): which worker hosts which
  groups.  Without redundancy every group has its own worker; with redundancy ``r`` every group
  has ``r + 1`` copies on distinct workers (``2r + 1`` in vote mode);
* the *decoder* (:class:`~sensai.serving.engine.decoder.CoverageDecoder`): per request, the first copy of
  each group to arrive answers it (vote mode: ``r + 1`` agreeing copies), so a straggler or a
  dead worker does not stall the answer; without redundancy it waits for every group.

A request is answered as soon as every group is decided, and the outputs go through
:func:`sensai.merge.merge_outputs` - the rule offline evaluation uses.  When some classes cannot
be answered (every copy lost) the request fails at once with a 503 naming them, or after the
deadline with a 504; a caller that allows partial answers gets the others, flagged ``degraded``.
Dead or hung workers are restarted by the :class:`~sensai.serving.engine.supervisor.Supervisor`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import replace
from typing import Sequence

import numpy as np

from sensai.artifact import Artifact, subnet_name
from sensai.errors import SensaiError
from sensai.merge import Merger, merge_outputs
from sensai.models import device_for_worker

from ..core.contract import Prediction
from ..core.errors import SubnetFailed, SubnetTimeout
from ..core.faults import DelaySpec, parse_delay
from ..core.messages import BatchCounts, Batching, Done, Failure, Fault, Output, Run, Skip
from ..core.placement import Placement
from ..transports.base import Transport, WorkerHandle
from ..workers.runners import RunnerSpec
from .decoder import CoverageDecoder
from .supervisor import Supervisor

log = logging.getLogger(__name__)


class _Request:
    __slots__ = ("id", "loop", "future", "decoder", "allow_partial", "t0", "arrival_ms",
                 "compute_ms", "parts", "dispatched", "done", "timed_out")

    def __init__(self, req_id: int, loop: asyncio.AbstractEventLoop, decoder: CoverageDecoder,
                 allow_partial: bool):
        self.id = req_id
        self.loop = loop
        self.future = loop.create_future()
        self.decoder = decoder
        self.allow_partial = allow_partial
        self.t0 = time.perf_counter()
        self.arrival_ms: dict[int, float] = {}
        self.compute_ms: dict[int, float] = {}
        self.parts: dict[int, list[float]] = {}  # each decided group's share of the merge
        self.dispatched: list[WorkerHandle] = []
        self.done = False  # no event changes the decoder any more
        self.timed_out = False


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class ClassParallelPredictor:
    """See the module docstring.  ``specs[g]`` is group ``g``'s runner recipe; a worker is one
    device, so its subnets run on ``worker_devices[w]`` (default: one GPU per worker round robin,
    else the CPU).  ``hedge_ms``: a worker computes its own groups at once but waits up to this
    long before computing copies, skipped if their group is answered meanwhile.  ``batching``:
    how each worker batches the requests it finds waiting (default :class:`Batching`'s; ignored
    by transports that do not batch in their workers).  ``delays`` / ``corrupt``: fault
    injection per worker.  Blocks until every worker is ready."""

    def __init__(self, artifact: Artifact, specs: Sequence[RunnerSpec], transport: Transport,
                 placement: Placement | None = None, *, name: str = "sensai",
                 deadline_s: float = 5.0, hedge_ms: float = 0.0, restart_delay_s: float = 0.0,
                 load_timeout_s: float = 600.0, probe_timeout_s: float = 30.0,
                 hang_timeout_s: float | None = None,
                 delays: dict[int, DelaySpec | str] | None = None, corrupt: Sequence[int] = (),
                 seed: int = 0, worker_devices: Sequence[str] | None = None,
                 batching: Batching | None = None):
        manifest = artifact.manifest
        self.artifact = artifact
        self.manifest = manifest
        self.spec = artifact.spec
        self.name = name
        self.groups = [list(g) for g in manifest.groups]
        self.placement = placement or Placement.cyclic(len(self.groups))
        self.transport = transport
        self._wake_order = getattr(transport, "wake_order", None)  # optional, see Transport
        if len(specs) != len(self.groups):
            raise ValueError(f"{len(specs)} runner specs for {len(self.groups)} groups")
        caps = transport.capabilities
        if not caps.several_groups and any(len(p) > 1 for p in self.placement.workers):
            raise SensaiError(f"the {transport.name} backend runs one subnet per worker: it "
                              "cannot host redundant copies")
        if hedge_ms and not caps.skip:
            raise SensaiError(f"the {transport.name} backend cannot hold copies back (hedging)")
        self.deadline_s = float(deadline_s)
        self.hedge_s = max(0.0, float(hedge_ms)) / 1e3
        self.hosts = [list(h) for h in self.placement.hosts]
        self._single_copy = all(len(h) == 1 for h in self.hosts)
        self.need = self.placement.need
        self._outputs = [s.num_outputs for s in manifest.subnets]
        self._merge = Merger(self.groups, self._outputs, manifest.num_classes)
        self._names = [subnet_name(g) for g in range(len(self.groups))]
        self._every_group = list(range(len(self.groups)))
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.answered = [0] * len(self.placement.workers)
        self.outvoted = [0] * len(self.placement.workers)
        self.degraded_answers = 0
        delays = {int(k): (parse_delay(v) if isinstance(v, str) else v)
                  for k, v in (delays or {}).items()}
        corrupt = {int(c) for c in corrupt}
        for w in [*delays, *corrupt]:
            if not 0 <= w < len(self.placement.workers):
                raise SensaiError(f"no worker {w}: workers are 0..{len(self.placement.workers) - 1}")
        if (delays or corrupt) and not caps.skip:
            raise SensaiError(f"the {transport.name} backend has no fault injection")
        self.batching = (batching or Batching()) if caps.batch else None
        self.workers: list[WorkerHandle] = []
        for w, hosted in enumerate(self.placement.workers):
            dev = worker_devices[w] if worker_devices else specs[hosted[0]].device
            ws = [replace(specs[g], device=dev) for g in hosted]
            self.workers.append(transport.worker(w, hosted, ws, self, delay=delays.get(w),
                                                 corrupt=w in corrupt, seed=seed + w,
                                                 batching=self.batching))
        self._runs = [(wk.groups, self.placement.primaries(wk.index)) for wk in self.workers]
        self._worker_names = [wk.name for wk in self.workers]
        self._compute_keys = ["compute." + n for n in self._names]
        self.supervisor = Supervisor(self.workers, self._lock, caps, self._lose_worker,
                                     restart_delay_s=restart_delay_s,
                                     load_timeout_s=load_timeout_s,
                                     probe_timeout_s=probe_timeout_s,
                                     hang_timeout_s=hang_timeout_s)
        try:
            self.supervisor.start_all()
        except BaseException:
            transport.close()
            raise

    # -- the request path

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      timeout_s: float | None = None) -> Prediction:
        loop = asyncio.get_running_loop()
        wait = self.deadline_s if timeout_s is None else max(0.0, min(self.deadline_s, timeout_s))
        req = _Request(next(self._ids), loop, CoverageDecoder(self.hosts, need=self.need),
                       allow_partial)
        dec = req.decoder
        self._requests[req.id] = req
        timer = None
        try:
            with self._lock:
                for wk in self.workers:
                    if wk.state != "up":
                        dec.lose(wk.index, reason=f"{wk.name} is {wk.state}")
                if not (dec.blocked and not allow_partial):  # else fail now, computing nothing
                    now = time.monotonic()
                    for wk in self.workers:
                        if wk.state == "up":
                            if not wk.pending:
                                wk.busy_since = now
                            wk.pending[req.id] = now
                            req.dispatched.append(wk)
                finished = dec.finished(allow_partial)
                req.done = finished
            if not finished:
                timer = loop.call_later(wait, self._expire, req)
            # The runs leave last, right before this thread waits and lets go of the GIL: a
            # worker woken while the GIL is still held sleeps again until it is handed on, and
            # then tends to run after the other workers instead of beside them.
            order = self._wake_order
            for wk in (req.dispatched if order is None else order(req.dispatched)):
                groups, primaries = self._runs[wk.index]
                wk.send(Run(req.id, x, groups, primaries, self.hedge_s))
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
                with self._lock:
                    req.done = True
                    busy = [wk for wk in req.dispatched if req.id in wk.pending]
                for wk in busy:
                    wk.send(Skip(req.id, None))
        return self._answer(req, wait)

    def _expire(self, req: _Request) -> None:
        with self._lock:
            if not req.done:
                req.done = True
                req.timed_out = True
        _resolve(req.future)

    def _answer(self, req: _Request, wait: float) -> Prediction:
        dec = req.decoder
        if dec.complete:  # every request but a degraded or failed one
            missing, covered = None, self._every_group
        else:
            missing = dec.undecided()
            if not (req.allow_partial and dec.decided):
                self._fail(req, missing, wait)
            covered = sorted(dec.decided)
        decided = [dec.decided[g] for g in covered]
        t2 = time.perf_counter()
        if not missing:
            parts, merge = req.parts, self._merge
            if decided[0].output.shape[0] == 1:  # one image: what the workers left to do
                scores = merge.combine([parts[g] if g in parts else merge.part(g, d.output)
                                        for g, d in zip(covered, decided)])
            else:
                scores = merge([d.output for d in decided])
        else:  # the same merge over the answered groups: 0 for the classes of the others
            scores = merge_outputs([d.output for d in decided],
                                   [self.groups[g] for g in covered], self.manifest.num_classes)
        t3 = time.perf_counter()
        # Unrounded: this runs on every request, after the last subnet answered.
        names, keys, workers = self._names, self._compute_keys, self._worker_names
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
        self.degraded_answers += 1
        log.warning("request %d answered degraded: no answer for %s", req.id,
                    self._describe_groups(missing))
        return Prediction(scores, timings, degraded=True,
                          covered_classes=sorted(c for g in covered for c in self.groups[g]),
                          missing_classes=self._class_names(missing), answered_by=answered_by)

    def _fail(self, req: _Request, missing: list[int], wait: float) -> None:
        dec = req.decoder
        if req.timed_out:
            waiting = sorted({self.workers[w].name for g in missing for w in dec.waiting_on(g)})
            raise SubnetTimeout(
                f"no answer within the {wait:.3g} s deadline for classes "
                f"{self._describe_groups(missing)} (waiting for "
                f"{', '.join(waiting) or 'no live worker'})",
                subnet=subnet_name(missing[0]), missing_classes=self._class_names(missing))
        missing = dec.unreachable() or missing  # name the groups out of reach
        reasons = sorted({r for g in missing for r in dec.lost_reasons.get(g, [])})
        raise SubnetFailed(
            f"no live copy of classes {self._describe_groups(missing)} "
            f"({'; '.join(reasons) or 'copies lost'}; redundancy {self.placement.redundancy}); "
            "retry, or allow a partial answer over the other classes",
            subnet=subnet_name(missing[0]), missing_classes=self._class_names(missing))

    # -- events from workers (any thread)

    def deliver(self, worker: int, generation: int, event) -> None:
        wk = self.workers[worker]
        if generation != wk.generation:
            return  # from an incarnation given up on
        kind = type(event)
        now = time.monotonic()
        if kind is Done:
            with self._lock:
                wk.pending.pop(event.req, None)
                wk.skipped += event.skipped
                wk.last_progress = now
                if event.counts is not None:
                    wk.counted(generation, event.counts)
            return
        req = self._requests.get(event.req)
        skips: list[int] = []
        share = None
        with self._lock:
            wk.last_progress = now
            if kind is Output:
                wk.runs += 1
                wk.compute_ms += event.ms
            elif kind is Failure:
                wk.failures += 1
                log.error("%s: %s failed: %s", wk.name, subnet_name(event.group), event.error)
            if req is None or req.done:
                return  # a late copy, or a request already answered
            dec, g = req.decoder, event.group
            if kind is Output:
                out = event.output
                if out.ndim == 1:
                    out = out[:, None]
                if out.shape[-1] != self._outputs[g]:
                    log.error("%s answered %s with shape %s, expected [B, %d]", wk.name,
                              subnet_name(g), out.shape, self._outputs[g])
                    dec.lose(worker, g, f"{wk.name} answered a wrong shape")
                elif dec.add(g, worker, out):
                    req.arrival_ms[g] = (time.perf_counter() - req.t0) * 1e3
                    req.compute_ms[g] = event.ms
                    share = dec.decided[g].output
                    if not dec.complete:
                        skips = dec.waiting_on(g)
            else:
                dec.lose(worker, g, f"{wk.name}: {event.error}")
            finished = dec.finished(req.allow_partial)
            if finished:
                req.done = True
        for w in skips:  # the other holders of that group need not compute it
            self.workers[w].send(Skip(req.id, (g,)))
        if finished:
            req.loop.call_soon_threadsafe(_resolve, req.future)
        elif share is not None and share.shape[0] == 1:
            # While other subnets still compute, this group's share of the merge is worked out
            # here, off the request's path; the answer then only combines the shares.  (The last
            # group's is left to the event loop: working it out before waking the loop gains
            # nothing, as nothing else runs then.)
            req.parts[g] = self._merge.part(g, share)

    def exited(self, worker: int, generation: int, detail: str) -> None:
        self.supervisor.exited(self.workers[worker], generation, detail)

    def _lose_worker(self, wk: WorkerHandle, reason: str) -> None:
        """``wk`` is down: its copies in flight will not arrive."""
        with self._lock:
            pending, wk.pending = list(wk.pending), {}
            finished = []
            for req_id in pending:
                req = self._requests.get(req_id)
                if req is None or req.done:
                    continue
                req.decoder.lose(wk.index, reason=reason)
                if req.decoder.finished(req.allow_partial):
                    req.done = True
                    finished.append(req)
        for req in finished:
            try:
                req.loop.call_soon_threadsafe(_resolve, req.future)
            except RuntimeError:
                pass  # that event loop is closed

    # -- state

    def is_ready(self) -> bool:
        """Ready when every group can be decided by the live workers."""
        with self._lock:
            up = {wk.index for wk in self.workers if wk.state == "up"}
        return (all(sum(1 for w in h if w in up) >= self.need for h in self.hosts)
                and self.transport.healthy())

    def worker_states(self) -> list[str]:
        with self._lock:
            return [wk.state for wk in self.workers]

    def counters(self) -> dict:
        """Work done so far (for the benchmark): subnet runs, compute ms, skipped copies, and the
        workers' batching (their counters summed; ``largest``: the largest of any worker)."""
        with self._lock:
            batching = sum((w.batching_counts() for w in self.workers), BatchCounts())
            return {"runs": sum(w.runs for w in self.workers),
                    "batching": batching.as_dict(),
                    "compute_ms": sum(w.compute_ms for w in self.workers),
                    "skipped": sum(w.skipped for w in self.workers),
                    "per_worker_runs": [w.runs for w in self.workers],
                    "answered": list(self.answered), "outvoted": list(self.outvoted)}

    def _class_names(self, groups: Sequence[int]) -> list[str]:
        names = self.spec.classes
        return [names[c] for g in sorted(groups) for c in self.groups[g]]

    def _describe_groups(self, groups: Sequence[int]) -> str:
        names = self.spec.classes
        return "; ".join(f"{subnet_name(g)}: " + ", ".join(f"{c} ({names[c]})"
                                                           for c in self.groups[g])
                         for g in sorted(groups))

    def placement_table(self) -> str:
        """One line per worker: where it runs and the subnets it hosts (printed by serve)."""
        lines = []
        for wk in self.workers:
            parts = [subnet_name(g) + ("" if self.hosts[g][0] == wk.index else " (copy)")
                     for g in wk.groups]
            where = wk.where()
            at = ", ".join(f"{k} {v}" for k, v in where.items() if k in ("device", "node") and v)
            lines.append(f"  {wk.name}: {', '.join(parts)}" + (f"  [{at}]" if at else ""))
        return "\n".join(lines)

    def describe(self) -> dict:
        classes = self.spec.classes
        with self._lock:
            workers = [dict(wk.describe(), answered=self.answered[i], outvoted=self.outvoted[i],
                            primary=[g for g in wk.groups if self.hosts[g][0] == i],
                            classes=[[classes[c] for c in self.groups[g]] for g in wk.groups])
                       for i, wk in enumerate(self.workers)]
        return {"strategy": "class-parallel", "backend": self.transport.name,
                "transport": self.transport.describe(), "model": self.manifest.model,
                "groups": self.groups, "deadline_s": self.deadline_s,
                "redundancy": self.placement.redundancy, "vote": self.placement.vote,
                "copies_per_group": len(self.hosts[0]), "agreeing_copies_needed": self.need,
                "hedge_ms": round(self.hedge_s * 1e3, 3),
                "batching": None if self.batching is None else
                {"max_rows": self.batching.max_rows, "delay_us": self.batching.delay_us},
                "placement": [list(p) for p in self.placement.workers], "hosts": self.hosts,
                "degraded_answers": self.degraded_answers, "workers": workers}

    # -- fault injection (tests, benchmark)

    def inject(self, worker: int, *, delay: DelaySpec | str | None = None,
               corrupt: bool = False) -> None:
        """Give worker ``worker`` a delay distribution and/or corrupt outputs (None/False: off);
        kept across its restarts."""
        wk = self.workers[worker]
        wk.delay = parse_delay(delay) if isinstance(delay, str) else delay
        wk.corrupt = bool(corrupt)
        wk.send(Fault(wk.delay, wk.corrupt))

    def kill_worker(self, worker: int) -> int | None:
        """End worker ``worker`` as a crash would (a process: SIGKILL; a thread: abandoned; a
        Ray actor: killed, Ray restarts it); returns its pid when it has one."""
        if not self.transport.capabilities.kill:
            raise SensaiError(f"the {self.transport.name} backend cannot end a worker")
        return self.workers[worker].kill()

    def wait_until_up(self, worker: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.workers[worker].state == "up":
                return True
            time.sleep(0.02)
        return self.workers[worker].state == "up"

    def shutdown(self) -> None:
        self.supervisor.close()
        self.transport.close()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)


def worker_devices(workers: int, device: str) -> list[str]:
    """One device per worker, by :func:`~sensai.models.device_for_worker`: GPU ``w mod n`` with
    ``n`` GPUs (``auto`` or ``cuda``), else as asked."""
    return [str(device_for_worker(w, device)) for w in range(workers)]

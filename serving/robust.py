"""Robust class parallelism: every group on several workers, answer as soon as each group has one.

Yang et al. (Asilomar 2020) make class parallelism tolerate stragglers with redundancy: worker
``w`` also holds the subnets of its neighbours' groups, so an answer can be decoded before the
slowest worker replies, and a dead worker's groups are still served by their copies.

* :func:`cyclic_placement` - which groups each worker hosts (pure): with redundancy ``r`` group
  ``g`` lives on workers ``g, g-1, ..., g-r`` (mod W), so worker ``w`` hosts ``w, w+1, ..., w+r``
  when W = G.  Copies of one group are always on distinct workers (``r < W``).
* :class:`CoverageDecoder` - per request, which copy of each group is used (pure): the first copy
  to arrive wins and later ones are dropped; in vote mode every group has ``2r+1`` copies and a
  group is decided when ``r+1`` of them agree, so up to ``r`` wrong copies are outvoted.  It also
  knows when a group can no longer be decided (its copies were lost), so a request fails at once
  instead of at its deadline.
* :class:`ProcessWorker` - one spawned process hosting its groups' runners, run one after another
  for each request, the worker's own group first.  Results stream back group by group; the gateway
  tells a worker to skip groups already answered by another copy and requests already decoded, so
  a slow worker does not pile up a backlog.  A reader thread notices the process's death at once.
* :class:`RobustPredictor` - the :class:`~serving.predictor.Predictor` the gateway serves: fan out
  to the live workers, decode, merge with :func:`sensai.merge.merge_outputs`.  A dead worker is
  marked down (its in-flight copies count as lost), restarted in the background and marked up
  again when it has loaded its subnets and answered a health probe.  If coverage cannot be reached
  the request fails with a 503 (copies lost) or 504 (deadline) naming the missing classes, or, when
  the caller allows it, gets a partial answer flagged ``degraded`` whose scores cover only the
  answered classes.
* :class:`RayWorker` - the same worker as a Ray actor (``robust_predictor(..., backend="ray")``):
  one actor method call per (request, group), so each group's output comes back as soon as it is
  computed.  *Ray* restarts a dead actor (``max_restarts=-1``; its constructor reloads the
  subnets); the predictor sees the death as a failed call, serves the groups from their copies,
  and takes the actor back once it answers a ``ping`` again.

Fault injection for tests and the benchmark (off by default): a worker can be given a delay
distribution (:func:`parse_delay`, e.g. ``exp:20ms``) slept before each request, or told to corrupt
its outputs; :meth:`RobustPredictor.kill_worker` SIGKILLs a worker process (on Ray:
``ray.kill(actor, no_restart=False)``, so Ray restarts it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import re
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from sensai.errors import SensaiError

from .predictor import Prediction, SubnetFailed, SubnetTimeout, subnet_name

if TYPE_CHECKING:
    from sensai.manifest import DecompositionManifest

    from .pools import RunnerSpec

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Placement


def cyclic_placement(groups: int, workers: int, redundancy: int) -> list[list[int]]:
    """Groups hosted by each worker: copy ``j`` (0..r) of group ``g`` on worker ``(g - j) mod W``.

    Each worker's list starts with the groups it is the primary for (copy 0), then its copies in
    order, which is the order the worker computes them in.  Raises :class:`SensaiError` unless
    ``0 <= redundancy < workers`` (copies of a group on distinct workers) and every worker hosts
    at least one group.
    """
    for what, v in (("groups", groups), ("workers", workers), ("redundancy", redundancy)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise SensaiError(f"{what} must be an integer, got {v!r}")
    if groups < 1:
        raise SensaiError(f"need at least one group, got {groups}")
    if workers < 1:
        raise SensaiError(f"need at least one worker, got {workers}")
    if not 0 <= redundancy < workers:
        raise SensaiError(f"redundancy must be between 0 and workers - 1 = {workers - 1} (each "
                          f"copy of a group on another worker), got {redundancy}")
    placement: list[list[int]] = [[] for _ in range(workers)]
    for j in range(redundancy + 1):
        for g in range(groups):
            placement[(g - j) % workers].append(g)
    idle = [w for w, hosted in enumerate(placement) if not hosted]
    if idle:
        raise SensaiError(f"{workers} workers for {groups} groups with redundancy {redundancy} "
                          f"leave worker(s) {', '.join(map(str, idle))} without a subnet; use at "
                          f"most {groups * (redundancy + 1)} workers")
    return placement


def group_hosts(placement: Sequence[Sequence[int]], groups: int) -> list[list[int]]:
    """For each group, the workers holding a copy of it (primary first)."""
    hosts: list[list[int]] = [[] for _ in range(groups)]
    order = sorted(((j, w, g) for w, hosted in enumerate(placement)
                    for j, g in enumerate(hosted)), key=lambda t: (t[0], t[1]))
    for _, w, g in order:
        hosts[g].append(w)
    return hosts


def copies_for(redundancy: int, vote: bool) -> int:
    """Copies of each group: ``r + 1``, or ``2r + 1`` in vote mode (a majority of ``r + 1``)."""
    return 2 * redundancy + 1 if vote else redundancy + 1


# --------------------------------------------------------------------------------------------
# Delay injection (a test and benchmark knob)

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s)?\s*$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}


def _duration(text: str, spec: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise SensaiError(f"bad duration {text!r} in delay {spec!r} (e.g. 20ms, 0.5s)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class DelaySpec:
    """A delay distribution: ``fixed`` (a), ``exp`` (mean a), ``uniform`` (a..b), applied to a
    fraction ``prob`` of requests."""

    kind: str
    a: float
    b: float = 0.0
    prob: float = 1.0
    text: str = ""

    def sample(self, rng: random.Random) -> float:
        if self.prob < 1.0 and rng.random() >= self.prob:
            return 0.0
        if self.kind == "fixed":
            return self.a
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return rng.uniform(self.a, self.b)

    def mean(self) -> float:
        base = {"fixed": self.a, "exp": self.a, "uniform": (self.a + self.b) / 2}[self.kind]
        return base * self.prob

    def __str__(self) -> str:
        return self.text


def parse_delay(text: str) -> DelaySpec:
    """``fixed:50ms``, ``exp:20ms`` (exponential, mean 20 ms), ``uniform:10ms-80ms``, each
    optionally ``@p`` (only a fraction p of requests is delayed, e.g. ``fixed:200ms@0.05``).
    A bare number is milliseconds."""
    if not isinstance(text, str) or not text.strip():
        raise SensaiError("empty delay spec; use e.g. fixed:50ms, exp:20ms, uniform:10ms-80ms")
    spec = text.strip()
    body, _, prob_text = spec.partition("@")
    prob = 1.0
    if prob_text:
        try:
            prob = float(prob_text)
        except ValueError:
            prob = -1.0
        if not 0.0 < prob <= 1.0:
            raise SensaiError(f"bad probability {prob_text!r} in delay {spec!r} (0 < p <= 1)")
    kind, sep, arg = body.partition(":")
    kind = kind.strip().lower()
    if not sep:
        raise SensaiError(f"bad delay {spec!r}; use fixed:50ms, exp:20ms or uniform:10ms-80ms")
    if kind in ("fixed", "exp"):
        return DelaySpec(kind, _duration(arg, spec), prob=prob, text=spec)
    if kind == "uniform":
        lo, dash, hi = arg.partition("-")
        if not dash:
            raise SensaiError(f"uniform delay needs a range, e.g. uniform:10ms-80ms, got {spec!r}")
        a, b = _duration(lo, spec), _duration(hi, spec)
        if b < a:
            raise SensaiError(f"uniform delay {spec!r}: the upper bound is below the lower one")
        return DelaySpec(kind, a, b, prob=prob, text=spec)
    raise SensaiError(f"unknown delay distribution {kind!r} in {spec!r}; use fixed, exp or uniform")


def corrupt_output(out: np.ndarray) -> np.ndarray:
    """What a worker told to misbehave answers: its logits negated and shifted (argmaxes flip)."""
    return (-3.0 * np.asarray(out, dtype=np.float32) + 1.0).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Decoding


def outputs_agree(a: np.ndarray, b: np.ndarray, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Two copies of one subnet agree: same shape, same values up to float noise."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


@dataclass
class Decision:
    worker: int  # the copy whose output is used (the first of the agreeing copies)
    output: Any
    voters: list[int]  # workers whose copies agreed (just ``[worker]`` without voting)
    outvoted: list[int] = field(default_factory=list)  # copies that disagreed before the decision


class CoverageDecoder:
    """Decides, for one request, which copy of each group to use (no I/O, no clock).

    ``hosts[g]``: workers holding a copy of group ``g``.  ``need``: agreeing copies required
    (1 = first arrival wins; ``r + 1`` of ``2r + 1`` in vote mode).  Copies arrive with
    :meth:`add` and are lost with :meth:`lose` (worker dead or down, subnet raised).
    """

    def __init__(self, hosts: Sequence[Sequence[int]], *, need: int = 1,
                 agree: Callable[[Any, Any], bool] = outputs_agree):
        if need < 1:
            raise ValueError("need must be >= 1")
        self.hosts = [list(h) for h in hosts]
        self.need = need
        self.agree = agree
        self.pending: list[set[int]] = [set(h) for h in self.hosts]
        self.arrivals: list[list[tuple[int, Any]]] = [[] for _ in self.hosts]
        self.decided: dict[int, Decision] = {}
        self.lost_reasons: dict[int, list[str]] = {}
        self.dropped = 0  # copies that arrived after their group was decided

    # -- events

    def add(self, group: int, worker: int, output: Any) -> bool:
        """A copy arrived; True when it decided its group."""
        if worker not in self.pending[group]:
            return False  # unknown or duplicate copy, or one already counted as lost
        self.pending[group].discard(worker)
        if group in self.decided:
            self.dropped += 1
            return False
        self.arrivals[group].append((worker, output))
        agreeing = [w for w, o in self.arrivals[group] if w == worker or self.agree(o, output)]
        if len(agreeing) < self.need:
            return False
        first = agreeing[0]
        first_out = next(o for w, o in self.arrivals[group] if w == first)
        outvoted = [w for w, _ in self.arrivals[group] if w not in agreeing]
        self.decided[group] = Decision(first, first_out, agreeing, outvoted)
        return True

    def lose(self, worker: int, group: int | None = None, reason: str | None = None) -> list[int]:
        """``worker``'s copies (of ``group``, or of all its groups) will not arrive.

        Returns the groups that can no longer be decided because of it."""
        became = []
        for g, pend in enumerate(self.pending):
            if (group is not None and g != group) or worker not in pend:
                continue
            pend.discard(worker)
            if reason:
                self.lost_reasons.setdefault(g, []).append(reason)
            if g not in self.decided and not self._reachable(g):
                became.append(g)
        return became

    # -- state

    def _best_cluster(self, group: int) -> int:
        arr = self.arrivals[group]
        return max((sum(1 for _, o2 in arr if self.agree(o2, o)) for _, o in arr), default=0)

    def _reachable(self, group: int) -> bool:
        return self._best_cluster(group) + len(self.pending[group]) >= self.need

    def undecided(self) -> list[int]:
        return [g for g in range(len(self.hosts)) if g not in self.decided]

    def unreachable(self) -> list[int]:
        """Undecided groups that can no longer be decided."""
        return [g for g in self.undecided() if not self._reachable(g)]

    @property
    def complete(self) -> bool:
        return len(self.decided) == len(self.hosts)

    @property
    def blocked(self) -> bool:
        """Some group can no longer be decided: the full answer is out of reach."""
        return bool(self.unreachable())

    @property
    def settled(self) -> bool:
        """Nothing more can change: every group is decided or out of reach."""
        return all(g in self.decided or not self._reachable(g) for g in range(len(self.hosts)))

    def finished(self, allow_partial: bool) -> bool:
        """Time to answer: complete, out of reach (full answers), or settled (partial allowed)."""
        return self.complete or (self.blocked and not allow_partial) or self.settled

    def waiting_on(self, group: int) -> list[int]:
        return sorted(self.pending[group])


# --------------------------------------------------------------------------------------------
# Errors and results


class CoverageError(SubnetFailed):
    """Some classes cannot be answered (their copies are lost): 503 naming them."""

    def __init__(self, message: str, *, subnet: str | None = None,
                 missing_classes: list[str] | None = None):
        super().__init__(message, subnet=subnet)
        self.missing_classes = missing_classes


class CoverageTimeout(SubnetTimeout):
    """Some classes were not answered within the deadline: 504 naming them."""

    def __init__(self, message: str, *, subnet: str | None = None,
                 missing_classes: list[str] | None = None):
        super().__init__(message, subnet=subnet)
        self.missing_classes = missing_classes


@dataclass
class RobustPrediction(Prediction):
    """A :class:`Prediction` that also says which worker answered each group, and whether the
    answer is partial (``degraded``: ``scores`` cover only ``covered_classes``, 0 elsewhere)."""

    degraded: bool = False
    covered_classes: list[int] | None = None
    missing_classes: list[str] | None = None
    answered_by: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# The worker process


class _Stop(Exception):
    pass


def _worker_main(rx, tx, name: str, hosted: list, delay: DelaySpec | None, corrupt: bool,
                 seed: int) -> None:
    """Body of a worker process: build the runners, then serve requests from ``rx`` in order.

    Messages in: ``("run", req, x, groups, primaries, hedge_s)`` (the first ``primaries`` groups
    are the worker's own; before the copies it waits up to ``hedge_s`` for a "skip"),
    ``("skip", req, groups)``, ``("drop", req)``,
    ``("fault", delay, corrupt)``, ``("ping", token)``, ``("stop",)``.  Out: ``("ready", pid)``,
    ``("error", text)``, ``("out", req, group, output, ms)``, ``("fail", req, group, text)``,
    ``("end", req, skipped)``, ``("pong", token)``.
    """
    # Ctrl-C in a terminal reaches the whole process group; the gateway stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runners = {}
        for g, spec in hosted:
            runners[g] = spec.build()
    except BaseException as e:  # report why, then exit: the gateway decides what to do
        try:
            tx.send(("error", f"{type(e).__name__}: {e}"))
        finally:
            return
    tx.send(("ready", os.getpid()))
    rng = random.Random(seed)
    tasks: deque = deque()
    queued: set = set()
    skip: dict[int, set[int]] = {}
    dropped: set[int] = set()
    state = {"delay": delay, "corrupt": corrupt}

    def handle(msg) -> None:
        kind = msg[0]
        if kind == "run":
            tasks.append(msg)
            queued.add(msg[1])
        elif kind == "skip":
            if msg[1] in queued:
                skip.setdefault(msg[1], set()).update(msg[2])
        elif kind == "drop":
            if msg[1] in queued:
                dropped.add(msg[1])
        elif kind == "ping":
            tx.send(("pong", msg[1]))
        elif kind == "fault":
            state["delay"], state["corrupt"] = msg[1], msg[2]
        elif kind == "stop":
            raise _Stop

    def drain() -> None:
        while rx.poll():
            handle(rx.recv())

    try:
        while True:
            if not tasks:
                handle(rx.recv())
            drain()
            if not tasks:
                continue
            _, req, x, groups, primaries, hedge_s = tasks.popleft()
            skipped = 0
            if req not in dropped:
                d = state["delay"].sample(rng) if state["delay"] is not None else 0.0
                if d > 0:
                    time.sleep(d)
                    drain()
            for j, g in enumerate(groups):
                if j == primaries and hedge_s > 0:
                    # Hedge: give the copies' own workers a moment to answer (and the gateway
                    # to say "skip") before spending compute on a copy.
                    until = time.perf_counter() + hedge_s
                    while req not in dropped and not skip.get(req, set()) >= set(groups[j:]):
                        left = until - time.perf_counter()
                        if left <= 0 or not rx.poll(left):
                            break
                        handle(rx.recv())
                if req in dropped or g in skip.get(req, ()):
                    skipped += 1
                    continue
                t0 = time.perf_counter()
                try:
                    out = np.asarray(runners[g].run(x), dtype=np.float32)
                except Exception as e:  # one subnet failing must not take the worker down
                    tx.send(("fail", req, g, f"{type(e).__name__}: {e}"))
                    continue
                ms = (time.perf_counter() - t0) * 1e3
                if state["corrupt"]:
                    out = corrupt_output(out)
                tx.send(("out", req, g, out, ms))
                drain()
            tx.send(("end", req, skipped))
            queued.discard(req)
            dropped.discard(req)
            skip.pop(req, None)
    except (_Stop, EOFError, OSError, KeyboardInterrupt):
        return


# --------------------------------------------------------------------------------------------
# The gateway's handle on one worker process


class _Generation:
    """One incarnation of a worker process: its own message queue and readiness."""

    def __init__(self, number: int):
        import queue

        self.number = number
        self.process = None
        self.send_q: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.error: str | None = None


class _WorkerBase:
    """What the predictor reads and writes on every worker, whatever runs it."""

    backend = "?"

    def __init__(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"], *,
                 owner: "RobustPredictor", delay: DelaySpec | None = None, corrupt: bool = False,
                 seed: int = 0):
        self.index = index
        self.name = f"worker_{index:02d}"
        self.groups = list(groups)
        self.specs = list(specs)
        self.owner = owner
        self.delay = delay
        self.corrupt = corrupt
        self.seed = seed
        self.state = "new"
        self.generation = 0
        self.restarts = 0
        self.deaths = 0
        self.pid: int | None = None
        self.pending: set[int] = set()
        self.process = None
        # Counters (the thread that receives results writes, anyone reads).
        self.runs = 0
        self.compute_ms = 0.0
        self.skipped = 0
        self.failures = 0

    def _where(self) -> dict:  # where the worker runs: device, runtime, and backend details
        return {}

    def describe(self) -> dict:
        classes = self.owner.manifest.dataset.classes
        d = {"name": self.name, "groups": list(self.groups),
             "primary": [g for g in self.groups if self.owner.hosts[g][0] == self.index],
             "subnets": [subnet_name(g) for g in self.groups],
             "classes": [[classes[c] for c in self.owner.groups[g]] for g in self.groups],
             "state": self.state, "pid": self.pid, "restarts": self.restarts,
             "deaths": self.deaths, "runs": self.runs, "skipped": self.skipped,
             **self._where()}
        if self.delay is not None:
            d["injected_delay"] = str(self.delay)
        if self.corrupt:
            d["injected_corruption"] = True
        return d


class ProcessWorker(_WorkerBase):
    """One worker process (spawned) hosting the runners of ``groups``, with its reader and sender
    threads.  State: ``starting`` -> ``up`` -> ``down`` (dead, restarting) -> ``up`` ...; the
    owning :class:`RobustPredictor` keeps the state under its lock."""

    backend = "local"

    def __init__(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"], *,
                 owner: "RobustPredictor", delay: DelaySpec | None = None, corrupt: bool = False,
                 seed: int = 0):
        super().__init__(index, groups, specs, owner=owner, delay=delay, corrupt=corrupt,
                         seed=seed)
        self._gen: _Generation | None = None
        self._pongs: dict[int, threading.Event] = {}

    # -- lifecycle

    def start(self) -> None:
        """Spawn a fresh process (a new generation) with its reader and sender threads."""
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        to_child_r, to_child_w = ctx.Pipe(duplex=False)
        from_child_r, from_child_w = ctx.Pipe(duplex=False)
        self.generation += 1
        gen = _Generation(self.generation)
        hosted = list(zip(self.groups, self.specs))
        proc = ctx.Process(target=_worker_main, name=f"sensai-{self.name}", daemon=True,
                           args=(to_child_r, from_child_w, self.name, hosted, self.delay,
                                 self.corrupt, self.seed + 7919 * gen.number))
        proc.start()
        # Our copies of the child's ends: closing them lets EOF reach us when the child dies.
        to_child_r.close()
        from_child_w.close()
        gen.process = proc
        self.process = proc
        self.pid = proc.pid
        self._gen = gen
        threading.Thread(target=self._sender, args=(to_child_w, gen.send_q), daemon=True,
                         name=f"{self.name}-send-{gen.number}").start()
        threading.Thread(target=self._reader, args=(from_child_r, gen), daemon=True,
                         name=f"{self.name}-read-{gen.number}").start()

    def wait_ready(self, timeout: float) -> None:
        gen = self._gen
        if gen is None:
            raise SensaiError(f"{self.name} was never started")
        if not gen.ready.wait(timeout):
            raise SensaiError(f"{self.name} did not load its subnets within {timeout:g} s")
        if gen.error:
            raise SensaiError(f"{self.name} ({', '.join(subnet_name(g) for g in self.groups)}): "
                              f"{gen.error}")

    def probe(self, timeout: float) -> bool:
        """Health probe: the process answers a ping (between two subnet runs) in ``timeout``."""
        token = next(_TOKENS)
        ev = threading.Event()
        self._pongs[token] = ev
        try:
            self.send(("ping", token))
            return ev.wait(timeout)
        finally:
            self._pongs.pop(token, None)

    def send(self, msg) -> None:
        gen = self._gen
        if gen is not None:
            gen.send_q.put(msg)

    def kill(self) -> int | None:
        """SIGKILL the process (tests and the benchmark's failure scenario)."""
        proc = self.process
        if proc is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            return proc.pid
        return None

    def stop(self, timeout: float = 5.0) -> None:
        proc, gen = self.process, self._gen
        if gen is not None:
            gen.send_q.put(("stop",))
            gen.send_q.put(None)
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)

    def exit_detail(self) -> str:
        """How the process ended, for the log and the error of a request that lost it."""
        code = self.process.exitcode if self.process is not None else None
        if code is None:
            return ""
        return f" (signal {-code})" if code < 0 else f" (exit code {code})"

    # -- threads

    @staticmethod
    def _sender(conn, q) -> None:
        # A thread of its own: a busy or sleeping worker with a full pipe must not block the
        # event loop or the other workers.
        while True:
            msg = q.get()
            if msg is None:
                break
            try:
                conn.send(msg)
            except (OSError, ValueError):
                break  # the process is gone; the reader reports it
        try:
            conn.close()
        except OSError:
            pass

    def _reader(self, conn, gen: "_Generation") -> None:
        from multiprocessing.connection import wait

        proc = gen.process
        try:
            while True:
                ready = wait([conn, proc.sentinel])
                if conn in ready:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        break
                    self._handle(msg, gen)
                    continue
                # The process ended: read what it sent before dying, then report.
                while True:
                    try:
                        if not conn.poll():
                            break
                        self._handle(conn.recv(), gen)
                    except (EOFError, OSError):
                        break
                break
        finally:
            try:
                conn.close()
            except OSError:
                pass
            gen.send_q.put(None)  # stops this generation's sender
            proc.join(1.0)
            if not gen.ready.is_set():
                gen.error = gen.error or (f"worker process died while loading (exit code "
                                          f"{proc.exitcode})")
                gen.ready.set()
            self.owner._on_exit(self, gen.number)

    def _handle(self, msg, gen: "_Generation") -> None:
        kind = msg[0]
        if kind == "out":
            _, req, g, out, ms = msg
            self.runs += 1
            self.compute_ms += ms
            self.owner._deliver(req, "out", self.index, g, out)
        elif kind == "fail":
            _, req, g, text = msg
            self.failures += 1
            log.error("%s: %s failed: %s", self.name, subnet_name(g), text)
            self.owner._deliver(req, "fail", self.index, g, text)
        elif kind == "end":
            self.skipped += msg[2]
            with self.owner._lock:
                self.pending.discard(msg[1])
        elif kind == "ready":
            self.pid = msg[1]
            gen.ready.set()
        elif kind == "error":
            gen.error = msg[1]
            gen.ready.set()
        elif kind == "pong":
            ev = self._pongs.get(msg[1])
            if ev is not None:
                ev.set()

    def _where(self) -> dict:
        return {"device": self.specs[0].device if self.specs else None,
                "runtime": self.specs[0].resolved_runtime() if self.specs else None}


_TOKENS = itertools.count(1)


# --------------------------------------------------------------------------------------------
# The predictor


class _Request:
    __slots__ = ("id", "loop", "decoder", "future", "t0", "arrival_ms", "allow_partial",
                 "dispatched")

    def __init__(self, req_id: int, loop, decoder: CoverageDecoder, allow_partial: bool):
        self.id = req_id
        self.loop = loop
        self.decoder = decoder
        self.future = loop.create_future()
        self.t0 = time.perf_counter()
        self.arrival_ms: dict[int, float] = {}
        self.allow_partial = allow_partial
        self.dispatched: list[int] = []


class RobustPredictor:
    """Class parallelism over redundant worker processes (see the module docstring).

    ``specs[g]``: the runner recipe of group ``g``'s subnet; ``placement[w]``: the groups worker
    ``w`` hosts (:func:`cyclic_placement`).  ``vote``: decide a group when ``need`` copies agree
    (a majority of its copies) instead of on the first arrival.  ``delays`` / ``corrupt``: fault
    injection per worker index (tests, benchmark).  ``hedge_ms``: a worker computes its own
    groups at once but waits up to this long before computing copies, which are skipped if
    their group is answered meanwhile (less duplicate work, a straggler costs up to this much
    more; 0: copies right away).  ``restart_delay_s``: wait before restarting a
    dead worker (later attempts back off exponentially; on Ray, which restarts the actor at
    once, the least time it stays out of rotation).  ``worker_factory``: builds worker ``w``
    with :class:`ProcessWorker`'s constructor arguments (default: :class:`ProcessWorker`;
    :class:`RayWorkerFactory` for Ray actors).  Blocks until every worker is ready.
    """

    supports_partial = True

    def __init__(self, specs: Sequence["RunnerSpec"], manifest: "DecompositionManifest",
                 placement: Sequence[Sequence[int]], *, redundancy: int, vote: bool = False,
                 name: str = "sensai", deadline_s: float = 5.0,
                 delays: dict[int, DelaySpec | str] | None = None,
                 corrupt: Sequence[int] = (), restart_delay_s: float = 0.0,
                 load_timeout_s: float = 600.0, probe_timeout_s: float = 30.0, seed: int = 0,
                 worker_devices: Sequence[str] | None = None, hedge_ms: float = 0.0,
                 worker_factory: Callable[..., Any] | None = None):
        self.manifest = manifest
        self._factory = worker_factory or ProcessWorker
        self.backend = getattr(self._factory, "backend", "local")
        self.spec = manifest.dataset.to_spec()
        self.name = name
        self.deadline_s = float(deadline_s)
        self.groups = [list(g) for g in manifest.groups]
        self.redundancy = int(redundancy)
        self.vote = bool(vote)
        self.placement = [list(p) for p in placement]
        self.hosts = group_hosts(self.placement, len(self.groups))
        copies = {len(h) for h in self.hosts}
        if len(specs) != len(self.groups):
            raise ValueError(f"{len(specs)} runner specs for {len(self.groups)} groups")
        self.need = self.redundancy + 1 if self.vote else 1
        if min(copies) < (2 * self.need - 1 if self.vote else 1):
            raise SensaiError(f"vote mode with redundancy {self.redundancy} needs "
                              f"{2 * self.redundancy + 1} copies of every group")
        self.hedge_s = max(0.0, float(hedge_ms)) / 1e3
        self._primaries = [self.primaries(w) for w in range(len(self.placement))]
        self.restart_delay_s = float(restart_delay_s)
        self.load_timeout_s = float(load_timeout_s)
        self.probe_timeout_s = float(probe_timeout_s)
        self._outputs = [s.num_outputs for s in manifest.subnets] or None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.outvoted = [0] * len(self.placement)
        self.answered = [0] * len(self.placement)
        self.degraded_answers = 0
        delays = {int(k): (parse_delay(v) if isinstance(v, str) else v)
                  for k, v in (delays or {}).items()}
        corrupt = set(int(c) for c in corrupt)
        for w in list(delays) + list(corrupt):
            if not 0 <= w < len(self.placement):
                raise SensaiError(f"no worker {w}: workers are 0..{len(self.placement) - 1}")
        self.workers: list[Any] = []  # ProcessWorker or RayWorker
        for w, hosted in enumerate(self.placement):
            # A worker is one device: its subnets follow it (one GPU per worker round robin).
            dev = worker_devices[w] if worker_devices else specs[hosted[0]].device
            ws = [replace(specs[g], device=dev) for g in hosted]
            self.workers.append(self._factory(w, hosted, ws, owner=self, delay=delays.get(w),
                                              corrupt=w in corrupt, seed=seed + w))
        t0 = time.perf_counter()
        try:
            for wk in self.workers:
                wk.state = "starting"
                wk.start()
            for wk in self.workers:
                wk.wait_ready(self.load_timeout_s)
                with self._lock:
                    if wk.state != "starting":
                        raise SensaiError(f"{wk.name} died right after loading its subnets")
                    wk.state = "up"
        except BaseException:
            self.shutdown()
            raise
        log.info("robust pool: %d %s workers (redundancy %d%s) ready in %.1f s",
                 len(self.workers), self.backend, self.redundancy, ", vote" if self.vote else "",
                 time.perf_counter() - t0)

    # -- information

    def primaries(self, w: int) -> int:
        """How many of worker ``w``'s groups it is the primary (copy 0) for."""
        return sum(1 for g in self.placement[w] if self.hosts[g][0] == w)

    def _class_names(self, groups: Sequence[int]) -> list[str]:
        names = self.spec.classes
        return [names[c] for g in sorted(groups) for c in self.groups[g]]

    def _describe_missing(self, groups: Sequence[int]) -> str:
        names = self.spec.classes
        return "; ".join(f"{subnet_name(g)}: " + ", ".join(f"{c} ({names[c]})"
                                                           for c in self.groups[g])
                         for g in sorted(groups))

    def placement_table(self) -> str:
        """One line per worker: the subnets (classes) it hosts - printed by ``sensai serve``."""
        lines = []
        for wk in self.workers:
            parts = []
            for j, g in enumerate(wk.groups):
                tag = "" if self.hosts[g][0] == wk.index else " (copy)"
                parts.append(f"{subnet_name(g)}{tag}")
            lines.append(f"  {wk.name}: " + ", ".join(parts))
        return "\n".join(lines)

    def describe(self) -> dict:
        with self._lock:
            workers = [wk.describe() for wk in self.workers]
        return {
            "strategy": "class-parallel-robust",
            "backend": self.backend,
            "model": self.manifest.model,
            "groups": self.groups,
            "deadline_s": self.deadline_s,
            "redundancy": self.redundancy,
            "vote": self.vote,
            "copies_per_group": len(self.hosts[0]),
            "agreeing_copies_needed": self.need,
            "hedge_ms": round(self.hedge_s * 1e3, 3),
            "placement": [list(p) for p in self.placement],
            "hosts": self.hosts,
            "degraded_answers": self.degraded_answers,
            "workers": [dict(w, answered=self.answered[i], outvoted=self.outvoted[i])
                        for i, w in enumerate(workers)],
        }

    def is_ready(self) -> bool:
        """Ready when every group can be decided by the live workers."""
        with self._lock:
            up = {wk.index for wk in self.workers if wk.state == "up"}
        return all(sum(1 for w in h if w in up) >= self.need for h in self.hosts)

    def worker_states(self) -> list[str]:
        with self._lock:
            return [wk.state for wk in self.workers]

    def counters(self) -> dict[str, Any]:
        """Work done so far, for the benchmark: subnet runs, compute ms, skipped copies."""
        return {"runs": sum(w.runs for w in self.workers),
                "compute_ms": sum(w.compute_ms for w in self.workers),
                "skipped": sum(w.skipped for w in self.workers),
                "per_worker_runs": [w.runs for w in self.workers],
                "answered": list(self.answered), "outvoted": list(self.outvoted)}

    # -- fault injection (tests, benchmark)

    def inject(self, worker: int, *, delay: DelaySpec | str | None = None,
               corrupt: bool = False) -> None:
        """Give worker ``worker`` a delay distribution and/or corrupt outputs (None/False: off).
        Kept across its restarts."""
        wk = self.workers[worker]
        wk.delay = parse_delay(delay) if isinstance(delay, str) else delay
        wk.corrupt = bool(corrupt)
        wk.send(("fault", wk.delay, wk.corrupt))

    def kill_worker(self, worker: int) -> int | None:
        """SIGKILL worker ``worker``'s process (Ray: kill its actor, which Ray restarts);
        returns its pid."""
        return self.workers[worker].kill()

    def wait_until_up(self, worker: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.workers[worker].state == "up":
                return True
            time.sleep(0.02)
        return self.workers[worker].state == "up"

    # -- serving

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False) -> RobustPrediction:
        from sensai.merge import merge_outputs

        loop = asyncio.get_running_loop()
        req = _Request(next(self._ids), loop,
                       CoverageDecoder(self.hosts, need=self.need), allow_partial)
        dec = req.decoder
        self._requests[req.id] = req
        try:
            with self._lock:
                up = [wk for wk in self.workers if wk.state == "up"]
            for wk in self.workers:
                if wk not in up:
                    dec.lose(wk.index, reason=f"{wk.name} is down")
            if dec.blocked and not allow_partial:
                up = []  # fail now: no worker needs to compute anything for this request
            for wk in up:
                with self._lock:
                    if wk.state != "up":  # died since the snapshot: its copies are lost
                        dec.lose(wk.index, reason=f"{wk.name} is down")
                        continue
                    wk.pending.add(req.id)
                req.dispatched.append(wk.index)
                wk.send(("run", req.id, x, wk.groups, self._primaries[wk.index], self.hedge_s))
            if not dec.finished(allow_partial):
                try:
                    await asyncio.wait_for(asyncio.shield(req.future), self.deadline_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._requests.pop(req.id, None)
            for w in req.dispatched:
                wk = self.workers[w]
                with self._lock:
                    still = req.id in wk.pending
                if still:
                    wk.send(("drop", req.id))
        missing = dec.undecided()
        timed_out = not dec.finished(allow_partial)
        if missing and not (allow_partial and dec.decided):
            if not timed_out:
                # Failed fast: name the groups out of reach, not those merely not yet answered.
                missing = dec.unreachable() or missing
            names = self._class_names(missing)
            what = self._describe_missing(missing)
            if timed_out:
                waiting = sorted({self.workers[w].name for g in missing for w in dec.waiting_on(g)})
                raise CoverageTimeout(
                    f"no answer within the {self.deadline_s:g} s deadline for classes {what} "
                    f"(waiting for {', '.join(waiting) or 'no live worker'})",
                    subnet=subnet_name(missing[0]), missing_classes=names)
            reasons = sorted({r for g in missing for r in dec.lost_reasons.get(g, [])})
            raise CoverageError(
                f"no live copy of classes {what} ({'; '.join(reasons) or 'copies lost'}; "
                f"redundancy {self.redundancy}); retry, or pass allow_partial=true for the "
                f"other classes", subnet=subnet_name(missing[0]), missing_classes=names)
        covered = sorted(dec.decided)
        outs = [np.asarray(dec.decided[g].output) for g in covered]
        t2 = time.perf_counter()
        # Partial answers: the same merge over the answered groups only, so the scores are a
        # distribution over the covered classes and 0 for the others.
        scores = merge_outputs(outs, [self.groups[g] for g in covered], self.manifest.num_classes)
        t3 = time.perf_counter()
        timings = {subnet_name(g): round(req.arrival_ms.get(g, float("nan")), 3) for g in covered}
        timings["merge"] = round((t3 - t2) * 1e3, 3)
        timings["total"] = round((t3 - req.t0) * 1e3, 3)
        answered_by = {}
        for g in covered:
            d = dec.decided[g]
            answered_by[subnet_name(g)] = self.workers[d.worker].name
            self.answered[d.worker] += 1
            for w in d.outvoted:
                self.outvoted[w] += 1
        degraded = bool(missing)
        if degraded:
            self.degraded_answers += 1
            log.warning("request %d answered degraded: no answer for %s", req.id,
                        self._describe_missing(missing))
        covered_classes = sorted(c for g in covered for c in self.groups[g])
        return RobustPrediction(
            scores=scores, timings_ms=timings, degraded=degraded,
            covered_classes=covered_classes if degraded else None,
            missing_classes=self._class_names(missing) if degraded else None,
            answered_by=answered_by)

    # Called from reader threads: hand the event to the request's own loop.
    def _deliver(self, req_id: int, kind: str, worker: int, group: int, payload) -> None:
        req = self._requests.get(req_id)
        if req is None:
            return  # answered, failed or timed out already: a late copy, dropped
        try:
            req.loop.call_soon_threadsafe(self._on_event, req, kind, worker, group, payload)
        except RuntimeError:
            pass  # that loop is closed

    def _on_event(self, req: _Request, kind: str, worker: int, group: int, payload) -> None:
        if req.future.done():
            return
        dec = req.decoder
        if kind == "out":
            out = np.asarray(payload)
            if out.ndim == 1:
                out = out[:, None]
            want = self._outputs[group] if self._outputs else None
            if want is not None and out.shape[-1] != want:
                log.error("%s answered %s with shape %s, expected [B, %d]",
                          self.workers[worker].name, subnet_name(group), out.shape, want)
                dec.lose(worker, group, f"{self.workers[worker].name} answered a wrong shape")
            elif dec.add(group, worker, out):
                req.arrival_ms[group] = (time.perf_counter() - req.t0) * 1e3
                # Tell the other holders of this group not to compute it (if not started yet).
                if not dec.complete:
                    for w in dec.waiting_on(group):
                        self.workers[w].send(("skip", req.id, [group]))
        elif kind == "fail":
            dec.lose(worker, group, f"{self.workers[worker].name}: {payload}")
        elif kind == "lost":
            dec.lose(worker, reason=payload)
        if dec.finished(req.allow_partial):
            req.future.set_result(None)

    def _on_exit(self, wk: ProcessWorker, gen: int) -> None:
        """A worker process ended (reader thread): mark it down, fail its copies, restart it."""
        with self._lock:
            if gen != wk.generation or wk.state in ("closed", "down"):
                return
            was_up = wk.state == "up"
            wk.state = "down"
            pending, wk.pending = wk.pending, set()
        if self._closing.is_set():
            return
        wk.deaths += 1
        reason = f"{wk.name} died{wk.exit_detail()}"
        if was_up:
            log.error("%s; its groups are served by their copies while it restarts", reason)
        for req_id in pending:
            req = self._requests.get(req_id)
            if req is not None:
                try:
                    req.loop.call_soon_threadsafe(self._on_event, req, "lost", wk.index, -1,
                                                  reason)
                except RuntimeError:
                    pass
        if was_up:
            threading.Thread(target=self._supervise, args=(wk,), daemon=True,
                             name=f"{wk.name}-restart").start()

    def _supervise(self, wk: ProcessWorker) -> None:
        """Restart a dead worker until it loads and answers a probe, then mark it up."""
        attempt = 0
        while not self._closing.is_set():
            wait = self.restart_delay_s if attempt == 0 else min(
                30.0, max(0.5, self.restart_delay_s) * 2 ** attempt)
            if self._closing.wait(wait):
                return
            with self._lock:
                if wk.state == "closed":
                    return
                wk.state = "starting"
            try:
                wk.start()
                gen = wk.generation
                wk.wait_ready(self.load_timeout_s)
                if not wk.probe(self.probe_timeout_s):
                    raise SensaiError(f"{wk.name} did not answer its health probe")
                with self._lock:
                    closing = self._closing.is_set()
                    # It may have died again after the probe: its reader then marked it down.
                    alive = wk.state == "starting" and wk.generation == gen
                    if alive and not closing:
                        wk.state = "up"
                        wk.restarts += 1
                if closing:  # shut down while it was starting: do not leave it behind
                    wk.kill()
                    return
                if not alive:
                    raise SensaiError(f"{wk.name} died while starting")
            except Exception as e:
                attempt += 1
                log.error("restarting %s failed (attempt %d): %s", wk.name, attempt, e)
                with self._lock:
                    if wk.state != "closed":
                        wk.state = "down"
                wk.kill()
                continue
            log.info("%s rejoined (pid %s, restart %d)", wk.name, wk.pid, wk.restarts)
            return

    def shutdown(self) -> None:
        self._closing.set()
        with self._lock:
            for wk in self.workers:
                wk.state = "closed"
        for wk in self.workers:
            try:
                wk.stop()
            except Exception as e:  # best effort: the process may be gone already
                log.debug("stopping %s: %s", wk.name, e)
        close = getattr(self._factory, "close", None)
        if callable(close):
            close()  # e.g. the Ray instance the factory started

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)


# --------------------------------------------------------------------------------------------
# Ray actors: the same workers, restarted by Ray

_ALL = "all"  # skip marker: every group of the request (answered or given up)
_ACTOR_MEMORY = 4096  # requests an actor remembers skips and progress for
_PUT_BYTES = 64 * 1024  # inputs above this go to the object store once per request


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ray_error_text(e: BaseException) -> str:
    """One line for a Ray error: what the remote code raised, else Ray's reason."""
    def lines(x) -> list[str]:
        return [ln.strip() for ln in _ANSI.sub("", str(x)).splitlines() if ln.strip()]

    cause = getattr(e, "cause", None)  # RayTaskError: the exception raised in the actor
    if isinstance(cause, Exception):
        first = lines(cause)
        text = f"{type(cause).__name__}: {first[0]}" if first else type(cause).__name__
    elif getattr(e, "actor_init_failed", False) and lines(e):
        # The constructor raised: Ray's message ends with the remote traceback's last line.
        text = f"loading its subnets failed: {lines(e)[-1]}"
    else:
        first = lines(e)
        text = f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class _RayWorkerActor:
    """Body of a Ray worker actor: its hosted subnets' runners, one ``run`` call per (request,
    group), executed one at a time in submission order (the worker's own groups first).

    ``skip``, ``fault``, ``ping`` and ``watch`` go to the "control" concurrency group, so they
    reach an actor that is busy computing or sleeping an injected delay.  Ray re-runs
    ``__init__`` (reloading the subnets) when it restarts the actor.
    """

    def __init__(self, name: str, hosted: list, delay: DelaySpec | None, corrupt: bool,
                 seed: int):
        from collections import OrderedDict

        import ray

        # Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPU(s): inside, it is cuda:0.
        self.device = "cuda:0" if ray.get_gpu_ids() else "cpu"
        self.name = name
        specs = [(g, replace(spec, device=self.device)) for g, spec in hosted]
        self.runtime = specs[0][1].resolved_runtime() if specs else None
        self.runners = {g: spec.build() for g, spec in specs}
        self.delay, self.corrupt = delay, bool(corrupt)
        self.rng = random.Random(seed)
        self.cv = threading.Condition()
        self.skips: OrderedDict = OrderedDict()  # req -> set of groups, or _ALL
        self.progress: OrderedDict = OrderedDict()  # req -> run calls started
        self.hedge_until: dict[int, float] = {}
        self.watch_stop: threading.Event | None = None
        try:
            self.node = ray.get_runtime_context().get_node_id()
        except Exception:
            self.node = None
        log.info("%s ready on %s (%s): %s", name, self.device, self.runtime,
                 ", ".join(subnet_name(g) for g, _ in hosted))

    def ping(self) -> dict:
        return {"pid": os.getpid(), "device": self.device, "runtime": self.runtime,
                "node": self.node}

    def fault(self, delay: DelaySpec | None, corrupt: bool, seed: int | None = None) -> None:
        with self.cv:
            self.delay, self.corrupt = delay, bool(corrupt)
            if seed is not None:
                self.rng = random.Random(seed)

    def skip(self, req: int, groups: Sequence[int] | None) -> None:
        """Do not compute ``groups`` of request ``req`` (None: any of its groups)."""
        with self.cv:
            cur = self.skips.get(req, set())
            if cur != _ALL:
                self.skips[req] = _ALL if groups is None else cur | set(groups)
                self.skips.move_to_end(req)
                while len(self.skips) > _ACTOR_MEMORY:
                    self.skips.popitem(last=False)
            self.cv.notify_all()

    def watch(self) -> None:
        """Returns only when a newer watch replaces it: the caller learns of this actor's death
        when the call fails, without waiting for a request to fail."""
        ev = threading.Event()
        with self.cv:
            if self.watch_stop is not None:
                self.watch_stop.set()
            self.watch_stop = ev
        ev.wait()

    def _skipped(self, req: int, group: int) -> bool:
        s = self.skips.get(req)
        return s is not None and (s == _ALL or group in s)

    def run(self, req: int, group: int, x: np.ndarray, calls: int,
            hedge_s: float) -> tuple[np.ndarray, float] | None:
        """Group ``group`` of request ``req`` (one of the ``calls`` calls this worker gets for
        it): ``(raw output, compute ms)``, or None when it was skipped."""
        with self.cv:
            started = self.progress.get(req, 0)
            self.progress[req] = started + 1
            self.progress.move_to_end(req)
            while len(self.progress) > _ACTOR_MEMORY:
                self.progress.popitem(last=False)
            delay = self.delay if started == 0 and self.skips.get(req) != _ALL else None
            d = delay.sample(self.rng) if delay is not None else 0.0
        last = started + 1 >= calls
        try:
            if d > 0:
                time.sleep(d)  # the injected straggler: one sleep per request, like a process
            with self.cv:
                if hedge_s > 0:
                    # Hedge: give the copies' own workers a moment to answer (and the gateway
                    # to say "skip") before spending compute on a copy.
                    until = self.hedge_until.setdefault(req, time.perf_counter() + hedge_s)
                    self.cv.wait_for(lambda: self._skipped(req, group),
                                     timeout=max(0.0, until - time.perf_counter()))
                if self._skipped(req, group):
                    return None
                corrupt = self.corrupt
            if self.runtime == "torch" and not x.flags.writeable:
                x = np.array(x)  # arguments from Ray are read-only; torch wants to own them
            t0 = time.perf_counter()
            out = np.asarray(self.runners[group].run(x), dtype=np.float32)
            ms = (time.perf_counter() - t0) * 1e3
            return (corrupt_output(out) if corrupt else out), ms
        finally:
            if last:
                with self.cv:
                    self.progress.pop(req, None)
                    self.skips.pop(req, None)
                    self.hedge_until.pop(req, None)


_ACTOR_CLASS = None


def _ray_actor_class():
    """The Ray actor class (built on first use, so the local backend never imports Ray)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        # max_restarts=-1: Ray restarts a dead worker (its constructor reloads the subnets);
        # max_task_retries=0: a call in flight when it dies fails at once instead of being
        # replayed late - its group is served by a copy meanwhile.
        _ACTOR_CLASS = ray.remote(max_restarts=-1, max_task_retries=0,
                                  concurrency_groups={"control": 4})(_RayWorkerActor)
    return _ACTOR_CLASS


class RayWorker(_WorkerBase):
    """The gateway's handle on one worker actor, with :class:`ProcessWorker`'s interface.

    A request becomes one ``run`` call per hosted group (own groups first); each call's result
    is handed to the predictor as soon as it arrives.  A call failing with ``RayActorError``
    (``ActorDiedError``, ``ActorUnavailableError``), or the actor's pending ``watch`` call
    failing, means the actor died: the predictor marks it down and its supervisor waits (in
    :meth:`wait_ready`) for Ray's restart to answer ``ping``, then marks it up again.
    """

    backend = "ray"

    def __init__(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"], *,
                 owner: "RobustPredictor", delay: DelaySpec | None = None, corrupt: bool = False,
                 seed: int = 0, actor_options: dict | None = None):
        super().__init__(index, groups, specs, owner=owner, delay=delay, corrupt=corrupt,
                         seed=seed)
        self.actor_options = dict(actor_options or {})
        self.actor = None  # Ray owns the process
        self.actor_id: str | None = None
        self.node: str | None = None
        self.device: str | None = None
        self.runtime: str | None = None
        self._calls: dict[int, int] = {}  # request -> its run calls still in flight here
        self._calls_lock = threading.Lock()
        self._death: str | None = None

    # -- lifecycle

    def start(self) -> None:
        """First start: create the actor.  After a death: a new generation of the same actor,
        which Ray restarts by itself (a new actor only if Ray gave up on the old one)."""
        self.generation += 1
        self._death = None
        if self.actor is None:
            hosted = list(zip(self.groups, self.specs))
            self.actor = _ray_actor_class().options(**self.actor_options).remote(
                self.name, hosted, self.delay, self.corrupt, self.seed)
            self.actor_id = self.actor._actor_id.hex()

    def _control(self, method: str, returns: bool = True):
        opts: dict[str, Any] = {"concurrency_group": "control"}
        if not returns:
            opts["num_returns"] = 0  # fire and forget: no result, no unobserved error
        return getattr(self.actor, method).options(**opts)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the actor (created, or restarted by Ray) answers ``ping``, which it does
        once its constructor has loaded the subnets; then give it the current fault settings
        and a ``watch`` call for this generation."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError

        if self.actor is None:
            raise SensaiError(f"{self.name} was never started")
        deadline = time.monotonic() + timeout
        ref = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SensaiError(f"{self.name} did not load its subnets within {timeout:g} s "
                                  "(is the Ray cluster short of resources?)")
            if self.owner._closing.is_set():
                raise SensaiError(f"{self.name}: shutting down")
            if ref is None:
                ref = self._control("ping").remote()
            try:
                info = ray.get(ref, timeout=min(left, 2.0))
                break
            except GetTimeoutError:
                continue  # still loading or waiting for resources: keep the same ping
            except ActorDiedError as e:
                # Dead for good (its constructor raised, or Ray stopped restarting it): the next
                # start creates a new actor.
                self.actor = None
                raise SensaiError(f"{self.name} ({', '.join(subnet_name(g) for g in self.groups)})"
                                  f": {_ray_error_text(e)}") from None
            except RayActorError:
                ref = None  # Ray is restarting it: ask again
                time.sleep(0.1)
        self.pid = info.get("pid")
        self.device, self.runtime, self.node = info.get("device"), info.get("runtime"), \
            info.get("node")
        # A restarted actor was built with its creation arguments: bring it up to date.
        try:
            ray.get(self._control("fault").remote(self.delay, self.corrupt,
                                                  self.seed + 7919 * self.generation),
                    timeout=max(1.0, deadline - time.monotonic()))
        except RayError as e:
            raise SensaiError(f"{self.name} failed right after loading its subnets: "
                              f"{_ray_error_text(e)}") from None
        gen = self.generation
        self._control("watch").remote().future().add_done_callback(
            lambda fut: self._watch_done(gen, fut))

    def probe(self, timeout: float) -> bool:
        import ray
        from ray.exceptions import RayError

        if self.actor is None:
            return False
        try:
            ray.get(self._control("ping").remote(), timeout=timeout)
            return True
        except (RayError, TimeoutError):
            return False

    def send(self, msg) -> None:
        """:class:`ProcessWorker`'s messages, as actor calls: run, skip, drop, fault."""
        actor, kind = self.actor, msg[0]
        if actor is None:
            return
        if kind == "run":
            _, req, x, groups, primaries, hedge_s = msg
            self._run(req, x, groups, primaries, hedge_s)
        elif kind in ("skip", "drop"):
            with self._calls_lock:
                busy = msg[1] in self._calls
            if busy:  # nothing left to skip once its calls are done
                self._control("skip", returns=False).remote(
                    msg[1], list(msg[2]) if kind == "skip" else None)
        elif kind == "fault":
            self._control("fault", returns=False).remote(msg[1], msg[2], None)

    def _run(self, req: int, x: np.ndarray, groups: Sequence[int], primaries: int,
             hedge_s: float) -> None:
        import ray

        gen = self.generation
        arg = ray.put(x) if x.nbytes > _PUT_BYTES else x
        n = len(groups)
        with self._calls_lock:
            self._calls[req] = n
        for j, g in enumerate(groups):
            ref = self.actor.run.remote(req, g, arg, n, hedge_s if j >= primaries else 0.0)
            # Runs in a Ray thread when the result arrives; the predictor hands it to the
            # request's event loop.
            ref.future().add_done_callback(
                lambda fut, g=g: self._done(req, g, gen, fut))

    def _done(self, req: int, group: int, gen: int, fut) -> None:
        from ray.exceptions import RayActorError, TaskCancelledError

        try:
            try:
                res = fut.result()
            except RayActorError as e:
                self._died(gen, e)
                self.owner._deliver(req, "lost", self.index, -1,
                                    f"{self.name} died ({_ray_error_text(e)})")
                return
            except TaskCancelledError:
                self.skipped += 1
                return
            except Exception as e:  # the subnet raised: this copy is lost, the worker lives
                self.failures += 1
                text = _ray_error_text(e)
                log.error("%s: %s failed: %s", self.name, subnet_name(group), text)
                self.owner._deliver(req, "fail", self.index, group, text)
                return
            if res is None:
                self.skipped += 1
                return
            out, ms = res
            self.runs += 1
            self.compute_ms += ms
            self.owner._deliver(req, "out", self.index, group, out)
        finally:
            with self._calls_lock:
                left = self._calls.get(req, 0) - 1
                if left > 0:
                    self._calls[req] = left
                else:
                    self._calls.pop(req, None)
            if left <= 0:
                with self.owner._lock:
                    self.pending.discard(req)

    def _watch_done(self, gen: int, fut) -> None:
        exc = fut.exception()
        if exc is not None:  # None: replaced by a newer watch
            self._died(gen, exc)

    def _died(self, gen: int, exc: BaseException) -> None:
        if gen == self.generation and self._death is None:
            self._death = _ray_error_text(exc)
        self.owner._on_exit(self, gen)

    def exit_detail(self) -> str:
        return f" ({self._death})" if self._death else ""

    def kill(self) -> int | None:
        """Kill the actor's process; Ray restarts it (unless the predictor is shutting down)."""
        import ray

        actor = self.actor
        if actor is None or not ray.is_initialized():
            return None
        pid = self.pid
        ray.kill(actor, no_restart=self.owner._closing.is_set())
        return pid

    def stop(self, timeout: float = 5.0) -> None:
        import ray

        actor, self.actor = self.actor, None
        if actor is not None and ray.is_initialized():
            ray.kill(actor, no_restart=True)

    def _where(self) -> dict:
        return {"device": self.device, "runtime": self.runtime, "actor_id": self.actor_id,
                "node": self.node, "resources": dict(self.actor_options)}


class RayWorkerFactory:
    """Builds :class:`RayWorker` s for :class:`RobustPredictor` (``worker_factory=``) with the
    same Ray resources each; ``own_ray``: shut Ray down when the predictor shuts down."""

    backend = "ray"

    def __init__(self, actor_options: dict, *, own_ray: bool = False):
        self.actor_options = dict(actor_options)
        self.own_ray = own_ray

    def __call__(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"], *,
                 owner: "RobustPredictor", delay: DelaySpec | None = None,
                 corrupt: bool = False, seed: int = 0) -> RayWorker:
        return RayWorker(index, groups, specs, owner=owner, delay=delay, corrupt=corrupt,
                         seed=seed, actor_options=self.actor_options)

    def close(self) -> None:
        if self.own_ray:
            import ray

            if ray.is_initialized():
                ray.shutdown()


def ensure_ray(address: str | None = None) -> bool:
    """Connect this process to Ray: ``address`` (an existing cluster, e.g. ``auto`` or
    ``ray://head:10001``), or a new local instance when None; nothing if connected already.
    Returns True when this call connected (the caller then shuts Ray down)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, include_dashboard=False if address is None else None,
                 logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SensaiError(f"cannot connect to Ray at {address or 'a new local instance'}: "
                          f"{first}") from None
    return True


def _check_ray_cpus(cpus: float | None) -> None:
    if cpus is not None and not cpus > 0:
        raise SensaiError(f"--ray-cpus must be > 0, got {cpus}")


def ray_actor_options(workers: int, cluster_cpus: float, cluster_gpus: float, *,
                      device: str = "auto", cpus: float | None = None) -> tuple[dict, int]:
    """Ray resources of each of ``workers`` worker actors, and ONNX Runtime threads per subnet.

    A GPU per worker when the cluster has GPUs and ``device`` is not ``cpu`` (an even share of
    them when there are fewer GPUs than workers); otherwise ``cpus`` CPUs each (default: 1, or
    an even share with the gateway when the cluster has fewer CPUs than that, as
    :func:`serving.ray_app.build_app` does).  Raises :class:`SensaiError` when they cannot fit.
    """
    import math

    if not (device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device or "")):
        raise SensaiError(f"device must be auto, cpu or cuda on the ray backend, got {device!r}")
    if device.startswith("cuda") and cluster_gpus < 1:
        raise SensaiError(f"device {device} requested but the Ray cluster has no GPU")
    use_gpu = device != "cpu" and cluster_gpus >= 1
    if cpus is not None:
        _check_ray_cpus(cpus)
        share = float(cpus)
    elif cluster_cpus >= workers + (0 if use_gpu else 1):
        share = 1.0
    else:
        share = max(0.01, math.floor(cluster_cpus / (workers + 1) * 100) / 100)
        log.warning("Ray cluster has %g CPUs for %d worker actors: %.2f CPU each",
                    cluster_cpus, workers, share)
    if workers * share > cluster_cpus + 1e-9:
        raise SensaiError(f"{workers} worker actors with {share:g} CPUs each do not fit the Ray "
                          f"cluster's {cluster_cpus:g} CPUs; lower --ray-cpus")
    opts: dict[str, Any] = {"num_cpus": share}
    if use_gpu:
        opts["num_gpus"] = 1.0 if cluster_gpus >= workers else \
            math.floor(cluster_gpus / workers * 100) / 100
    threads = 1 if use_gpu else max(1, int(share))
    return opts, threads



# --------------------------------------------------------------------------------------------


def check_robust_args(groups: int, workers: int | None, redundancy: int, vote: bool) -> int:
    """Validate the redundancy settings against the artifact's G; returns W (default G)."""
    w = groups if workers is None else workers
    if isinstance(redundancy, bool) or not isinstance(redundancy, int) or redundancy < 0:
        raise SensaiError(f"--redundancy must be an integer >= 0, got {redundancy!r}")
    if vote and redundancy < 1:
        raise SensaiError("--vote needs --redundancy >= 1 (2r+1 copies outvote r wrong ones)")
    copies = copies_for(redundancy, vote)
    if copies > w:
        what = f"vote mode with redundancy {redundancy} needs 2r+1 = {copies}" if vote else \
            f"redundancy {redundancy} needs r+1 = {copies}"
        raise SensaiError(f"{what} copies of each group on distinct workers, but there are only "
                          f"{w} workers" + (f" (W = G = {groups})" if workers is None else ""))
    cyclic_placement(groups, w, copies - 1)
    return w


def robust_predictor(artifact_dir: str | Path, *, redundancy: int, vote: bool = False,
                     workers: int | None = None, device: str = "auto", runtime: str = "auto",
                     threads: int = 1, name: str = "sensai", deadline_s: float = 5.0,
                     delays: dict[int, str] | None = None, corrupt: Sequence[int] = (),
                     restart_delay_s: float = 0.0, hedge_ms: float = 0.0,
                     seed: int = 0, backend: str = "local", ray_address: str | None = None,
                     ray_cpus: float | None = None) -> RobustPredictor:
    """The redundant class-parallel predictor of an artifact: ``workers`` workers (default G),
    cyclic placement with ``redundancy`` extra copies of every group (``2r`` in vote mode).

    ``backend="local"``: worker processes on this machine, restarted by the predictor.
    ``backend="ray"``: worker actors on a Ray cluster (``ray_address``, or a local instance
    started here when this process is not connected to Ray yet), restarted by Ray; each actor
    reserves ``ray_cpus`` CPUs (default: see :func:`ray_actor_options`) or a GPU when the
    cluster has GPUs, and runs its subnets on the device it is given.  Validates everything
    before any worker starts; blocks while the subnets load."""
    from sensai.manifest import load_manifest
    from sensai.models import device_for_worker

    from .pools import runner_specs

    if backend not in ("local", "ray"):
        raise SensaiError(f"redundancy runs on the local or ray backend, not {backend!r}")
    _check_ray_cpus(ray_cpus)  # before Ray starts
    if backend == "ray":
        # Actors may run on other nodes and in other working directories.
        artifact_dir = Path(artifact_dir).resolve()
    manifest = load_manifest(artifact_dir)
    g = len(manifest.groups)
    w = check_robust_args(g, workers, redundancy, vote)
    placement = cyclic_placement(g, w, copies_for(redundancy, vote) - 1)
    parsed = {int(k): parse_delay(v) for k, v in (delays or {}).items()}
    common = dict(redundancy=redundancy, vote=vote, name=name, deadline_s=deadline_s,
                  delays=parsed, corrupt=corrupt, restart_delay_s=restart_delay_s, seed=seed,
                  hedge_ms=hedge_ms)
    if backend == "local":
        specs = runner_specs(artifact_dir, manifest, device=device, runtime=runtime,
                             threads=threads)
        devices = [str(device_for_worker(i, device)) for i in range(w)]
        return RobustPredictor(specs, manifest, placement, worker_devices=devices, **common)
    # The device is chosen inside each actor (the GPU Ray gives it, else CPU); the CPU specs
    # check the ONNX files now.
    specs = runner_specs(artifact_dir, manifest, device="cpu", runtime=runtime, threads=threads)
    own = ensure_ray(ray_address)
    try:
        import ray

        res = ray.cluster_resources()
        opts, ort_threads = ray_actor_options(w, float(res.get("CPU", 0)),
                                              float(res.get("GPU", 0)), device=device,
                                              cpus=ray_cpus)
        if "num_gpus" in opts and runtime != "onnx":
            for spec in specs:
                if not (spec.weights_path and Path(spec.weights_path).is_file()):
                    raise SensaiError(f"weights file {spec.weights_path} of {spec.name} does "
                                      "not exist (needed for the torch runtime on GPUs)")
        specs = [replace(s, threads=ort_threads) for s in specs]
        factory = RayWorkerFactory(opts, own_ray=own)
    except BaseException:
        if own:
            import ray

            ray.shutdown()
        raise
    # On failure the predictor shuts itself down, and the factory Ray with it.
    return RobustPredictor(specs, manifest, placement, worker_factory=factory, **common)

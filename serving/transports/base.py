"""The interface every transport implements: a worker's handle, and what every handle shares.

A *worker* hosts the runners of one or more groups (its own, and with redundancy copies of
others).  The engine talks to it only through :meth:`WorkerHandle.send` with the typed messages
of :mod:`sensai.serving.core.messages`; the worker hands back what it computes by calling
``sink.deliver(index, generation, event)`` from whatever thread it runs on, and reports the end
of an incarnation (death, or a failed load) with ``sink.exited(index, generation, detail)`` -
the sink being its :class:`~sensai.serving.engine.pool.WorkerPool`.  Every start is a new
*generation*, so anything a dead or abandoned incarnation still says is ignored.  All Ray,
process and socket calls of a worker are made here, in its transport, never by the engine.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from sensai.artifact import subnet_name
from sensai.errors import SensaiError

from ..core.messages import Batching, Fault

if TYPE_CHECKING:
    from ..core.faults import DelaySpec
    from ..workers.runners import RunnerSpec

TOKENS = itertools.count(1)  # ping tokens, unique in this process


@dataclass(frozen=True)
class Capabilities:
    """What the pool may do with a transport's workers (the settings a backend cannot honour at all
    are refused before anything starts, by :func:`~sensai.serving.core.settings.check_backend`)."""

    restart: bool = True  # a dead worker comes back (restarted by us or by Ray)
    kill: bool = True  # can be ended from outside (fault injection, hung-worker watchdog)
    batch: bool = True  # a worker runs the requests it finds waiting as one batch


class Sink(Protocol):
    def deliver(self, worker: int, generation: int, event) -> None: ...

    def exited(self, worker: int, generation: int, detail: str) -> None: ...


class Incarnation:
    """One start of a worker: its number (the handle's ``generation`` when it started), set
    ``ready`` once it has loaded its subnets or failed to (``error`` says why).  Transports
    subclass it with what their incarnations carry (a thread and its queue, a connection)."""

    def __init__(self, number: int):
        self.number = number
        self.ready = threading.Event()
        self.error: str | None = None


class WorkerHandle:
    """The transport's side of one worker: its incarnations (:meth:`start`, :meth:`wait_ready`,
    :meth:`probe`, :meth:`kill`, :meth:`stop`), the one way to reach it (:meth:`send`) and where
    it runs.  Only its transport writes it; what the predictor keeps about a worker - its state,
    its requests in flight, its counters - is the pool's
    (:class:`~sensai.serving.engine.pool.Worker`).  ``batching``: how the worker batches the
    requests it finds waiting (None: it does not, or not in-house - Triton)."""

    transport = "?"

    def __init__(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"],
                 sink: Sink, *, name: str | None = None, delay: "DelaySpec | None" = None,
                 corrupt: bool = False, seed: int = 0, batching: Batching | None = None,
                 cores: int = 1):
        self.index = index
        self.name = name or f"worker_{index:02d}"
        self.groups = tuple(groups)
        self.specs = list(specs)
        self.sink = sink
        self.delay, self.corrupt, self.seed = delay, bool(corrupt), seed
        self.batching = batching
        self.cores = cores  # the CPU cores its device's one call may use side by side
        self.generation = 0
        self.pid: int | None = None
        self.device: str | None = self.specs[0].device if self.specs else None
        self.runtime: str | None = self.specs[0].resolved_runtime() if self.specs else None
        self.node: str | None = None
        self.cores_awake: bool | None = None  # held on the worker's own node (Ray)

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

    # -- shared by transports

    def wait_loaded(self, inc: Incarnation | None, timeout: float) -> None:
        """Block until incarnation ``inc`` has loaded its subnets; :class:`SensaiError` if it
        did not."""
        if inc is None:
            raise SensaiError(f"{self.name} was never started")
        if not inc.ready.wait(timeout):
            raise SensaiError(f"{self.name} did not load its subnets within {timeout:g} s")
        if inc.error:
            raise SensaiError(f"{self.name}: {inc.error}")

    def inject(self, delay: "DelaySpec | None", corrupt: bool) -> None:
        """Fault injection: a delay before each request and/or corrupt outputs, from now on and
        in every later incarnation."""
        self.delay, self.corrupt = delay, bool(corrupt)
        self.send(Fault(delay, self.corrupt))

    def where(self) -> dict:
        """Where the worker runs, for ``/v1/models``: device, runtime, pid, node..."""
        return {"device": self.device, "runtime": self.runtime, "pid": self.pid,
                "node": self.node}

    def describe(self) -> dict:
        return {"name": self.name, "transport": self.transport, "groups": list(self.groups),
                "subnets": [subnet_name(g) for g in self.groups],
                "generation": self.generation, **self.where(),
                **({"injected_delay": str(self.delay)} if self.delay is not None else {}),
                **({"injected_corruption": True} if self.corrupt else {})}


class Transport(Protocol):
    name: str
    capabilities: Capabilities

    def worker(self, index: int, groups: Sequence[int], specs: Sequence["RunnerSpec"],
               sink: Sink, **options) -> WorkerHandle:
        """Worker ``index``'s handle, not started; ``options``: :class:`WorkerHandle`'s
        keywords."""
        ...

    def healthy(self) -> bool:
        """Whether the transport's own infrastructure is up (e.g. the Triton server)."""
        ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...

    # Optional: ``wake_order(workers) -> workers``, the order in which the predictor hands a
    # request's runs to its workers (threads: see :class:`~.spread.CoreSpread`).  Transports
    # without it get the workers' own order.
    #
    # Optional: ``sent()``, called once a request's runs are all handed to :meth:`send`; a
    # transport that has it may hold runs until then and send them together (device processes:
    # one write per device process and request, however many of its workers the request
    # needs).

"""Workers as Ray actors (``--backend ray``): one actor per worker, anywhere on a Ray cluster,
placed, restarted and watched by Ray.

Ray carries the actors' lifecycle; requests and results travel over one direct socket per actor
(:mod:`.connection`, the same messages and in-worker loop as a worker process), because a Ray
call's round trip costs several times a small subnet's compute (BENCHMARKS.md).  Each
incarnation opens its socket on its node's Ray address when the gateway asks (``channel``, a Ray
call carrying a fresh 32-byte key); the two ends prove they hold the key (HMAC challenges both
ways) before anything is read.  The gateway's node must be able to open TCP connections to the
worker nodes, as Ray's own workers do.

A death is seen twice over: the socket closes when the actor's process ends, and a long-lived
``watch`` call fails when Ray declares the actor (or its node) dead.  Actors are created with
``max_restarts=-1`` (Ray restarts them; the constructor reloads the subnets) and
``max_task_retries=0``.  The same worker body, and the same gateway end
(:class:`ChannelWorker`), serve the Ray Serve application (:mod:`.ray_serve`): there Serve
places and restarts the replicas, and the requests take the same socket.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Sequence

from sensai.errors import SensaiError
from sensai.raycluster import error_text, share

from ..core.messages import Batching, Fault, Ready
from ..core.placement import Placement, spread
from ..core.wakeup import keep_cores_awake
from ..workers.device_runner import DeviceLaunch, DeviceRunner, build_device, wait_devices
from ..workers.loop import WorkerCore
from ..workers.runners import Computed
from .base import Capabilities, Sink
from .connection import (ConnectionIncarnation, ConnectionWorker, accept, cut, dial,
                         serve_connection)

log = logging.getLogger(__name__)

ACCEPT_S = 60.0  # how long an actor's socket waits for the gateway to connect


class OneAtATime(DeviceRunner):
    """A device shared by the gateways a worker serves (several Serve ingress replicas, each over
    its own socket): one call at a time, waited for, as a runner's static buffers (CUDA graphs)
    require."""

    def __init__(self, device: DeviceRunner):
        super().__init__(device.groups, device.widths, device=device.device, name=device.name)
        self.inner = device
        self.runtime = device.runtime
        self.lock = threading.Lock()

    def launch(self, parts, groups) -> DeviceLaunch:
        with self.lock:
            one = self.inner.launch(parts, groups)
            wait_devices((one,))
            done = []
            for g in groups:
                try:
                    done.append(Computed(one.result(g)))
                except Exception as e:  # that group's failure, kept for its requests
                    done.append(Computed(error=e))
        return DeviceLaunch(done, {g: (i, None) for i, g in enumerate(groups)})


def assigned_cores(ctx) -> int:
    """The CPU cores Ray gave this actor (its device's executor threads); 1 outside an actor
    (a body built in the driver, as a test of a replica's start does), where Ray has none."""
    try:
        return max(1, int(ctx.get_assigned_resources().get("CPU", 1)))
    except AssertionError:  # Ray asserts it is called in a worker process
        return 1


class RayWorkerBody:
    """The worker inside a Ray actor or a Serve replica: its hosted subnets' runners, served to
    each gateway over a socket of its own (:meth:`channel`) by the in-worker loop of
    :mod:`sensai.serving.workers.loop`.

    A gateway is known by its ``owner`` token: a newer channel of the same owner replaces its
    older one (the gateway reconnecting), while the channels of other owners - the ingress
    replicas of a Serve application - live side by side, each with its own
    :class:`~sensai.serving.workers.loop.WorkerCore`, since each gateway numbers its requests on
    its own."""

    def __init__(self, name: str, hosted: list, seed: int, keep_awake: str = "off"):
        import ray

        self.device = actor_device()  # where it runs is settled before any runner is built
        self.name = name
        self.seed = seed
        specs = [(g, replace(spec, device=self.device)) for g, spec in hosted]
        ctx = ray.get_runtime_context()
        cores = assigned_cores(ctx)
        self.runners = OneAtATime(build_device(specs, cores=cores))
        # What runs, which differs from the spec where CUDA graphs fell back to eager.
        self.runtime = self.runners.runtime
        self.lock = threading.Lock()
        self.conns: dict[str, Connection] = {}  # owner -> its gateway's socket
        self.watches: dict[str, threading.Event] = {}  # owner -> its watch call's release
        self.node = ctx.get_node_id()
        # Its node's idle cores, held for the actor's life (the process ending withdraws it),
        # as the operator set it: "on" on a node that refuses fails the worker, as it fails
        # the gateway.
        self.awake = keep_cores_awake(keep_awake)
        log.info("%s ready on %s (%s), node %s", name, self.device, self.runtime, self.node)

    def ping(self) -> Ready:
        return Ready(os.getpid(), self.device, self.runtime, self.node, self.awake.held)

    def channel(self, authkey: bytes, owner: str = "", batching: Batching | None = None
                ) -> tuple[str, int]:
        """Open a socket on this node's Ray address for the gateway ``owner`` holding
        ``authkey``; its requests are then served over it, batched as ``batching`` says."""
        import ray

        server = socket.create_server((ray.util.get_node_ip_address(), 0))
        threading.Thread(target=self._serve_channel, args=(server, authkey, owner, batching),
                         daemon=True, name="sensai-channel").start()
        return server.getsockname()[:2]

    def _serve_channel(self, server: socket.socket, authkey: bytes, owner: str,
                       batching: Batching | None) -> None:
        try:
            conn = accept(server, authkey, ACCEPT_S)
        finally:
            server.close()
        if conn is None:
            log.warning("%s: the gateway did not connect within %g s", self.name, ACCEPT_S)
            return
        with self.lock:
            old, self.conns[owner] = self.conns.get(owner), conn
        if old is not None:
            cut(old)
        core = WorkerCore(self.runners, seed=self.seed, batching=batching)
        try:
            serve_connection(conn, conn, core, self.ping())
        finally:
            conn.close()
            with self.lock:
                if self.conns.get(owner) is conn:
                    del self.conns[owner]

    def watch(self, owner: str = "") -> None:
        """Returns only when a newer watch of the same ``owner`` replaces it: the caller learns
        of this worker's death when the call fails, without waiting for a request to fail."""
        ev = threading.Event()
        with self.lock:
            old, self.watches[owner] = self.watches.get(owner), ev
        if old is not None:
            old.set()
        ev.wait()


def actor_device() -> str:
    """The device of the worker in this Ray actor or task: Ray sets CUDA_VISIBLE_DEVICES to the
    GPU it gave the worker (a share of one when workers outnumber GPUs), so inside it is always
    ``cuda:0``; the CPU when Ray gave it none."""
    import ray

    return "cuda:0" if ray.get_gpu_ids() else "cpu"


_ACTOR_CLASS = None


def actor_class():
    """The Ray actor class (made on first use, so the other transports never import Ray)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        _ACTOR_CLASS = ray.remote(max_restarts=-1, max_task_retries=0,
                                  concurrency_groups={"control": 4})(RayWorkerBody)
    return _ACTOR_CLASS


def actor_resources(workers: int, cluster_cpus: float, cluster_gpus: float, *,
                    device: str = "auto", cpus: float | None = None, others: int = 0
                    ) -> tuple[dict, int]:
    """Ray resources of each of ``workers`` worker actors or Serve replicas, and ONNX Runtime
    threads per subnet - the one sizing rule of the Ray actor transport and the Serve app.

    Each worker gets ``cpus`` CPUs (default: 1, or an even share when the cluster has fewer
    CPUs than workers and ``others`` - replicas of another kind, such as the Serve ingress, that
    take at most one worker's share each - always one that fits, so the workers start on any
    cluster), and a GPU when the cluster has GPUs and ``device`` is not ``cpu``.

    With more workers than GPUs they share: each asks for ``1/k`` of a GPU, ``k`` the workers
    the busiest GPU must hold, because Ray places a fraction within one GPU (three workers asking
    for 2/3 of two GPUs each would leave the third waiting forever).  Ray fills one GPU before
    the next, so some GPUs may hold fewer than ``k`` (even none), but none holds more: the
    busiest GPU, which sets the latency, is as loaded as with one worker per GPU in turn.

    Raises :class:`SensaiError` when they cannot fit.
    """
    if not (device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device or "")):
        raise SensaiError(f"device must be auto, cpu or cuda on the ray backend, got {device!r}")
    if device.startswith("cuda") and cluster_gpus < 1:
        raise SensaiError(f"device {device} requested but the Ray cluster has no GPU")
    if cpus is not None and not cpus > 0:
        raise SensaiError(f"ray_cpus must be > 0, got {cpus}")
    use_gpu = device != "cpu" and cluster_gpus >= 1
    slots = workers + others
    if cpus is not None:
        per = float(cpus)
    elif cluster_cpus >= slots:
        per = 1.0
    else:
        per = share(cluster_cpus, slots)
        log.warning("Ray cluster has %g CPUs for %d workers%s: %.2f CPU each", cluster_cpus,
                    workers, f" and {others} other replica(s)" if others else "", per)
    if workers * per + others * min(1.0, per) > cluster_cpus + 1e-9:
        raise SensaiError(f"{workers} workers with {per:g} CPUs each do not fit the "
                          f"{cluster_cpus:g} CPUs they may take of the Ray cluster (a model "
                          "repository's version: half); lower ray_cpus (--set ray_cpus, "
                          "SENSAI_RAY_CPUS)")
    opts: dict[str, Any] = {"num_cpus": per}
    if use_gpu:
        whole = int(cluster_gpus)  # Ray's GPUs are whole devices
        opts["num_gpus"] = 1.0 if whole >= workers else share(1.0, math.ceil(workers / whole))
    return opts, (1 if use_gpu else max(1, int(per)))


def spread_plan(placement: Placement, nodes: list[dict], *, use_gpu: bool, num_cpus: float
                ) -> tuple[list[tuple[dict, float]], list[int], list[int]]:
    """Where each worker goes: the workers spread over ``nodes`` (the copies of a group on
    distinct nodes when possible: :func:`~sensai.serving.core.placement.spread`), only over nodes
    with GPUs when ``use_gpu``, with a CPU share that fits each node.  Returns ``([(node, CPUs)
    per worker], node index per worker into ``nodes``, groups whose copies share a node)``; the
    Ray actors and the Serve deployments alike are placed from it."""
    kind = "gpus" if use_gpu else "cpus"
    usable = [n for n in nodes if n[kind] > 0] or nodes
    node_of, shared = spread(placement, len(usable))
    plan = []
    for n in node_of:
        cpus = num_cpus if use_gpu else min(num_cpus, share(usable[n]["cpus"], node_of.count(n)))
        plan.append((usable[n], cpus))
    return plan, [nodes.index(usable[n]) for n in node_of], shared


def node_options(base: dict, placement: Placement, nodes: list[dict], *,
                 use_gpu: bool) -> tuple[list[dict], list[int], list[int]]:
    """Per-worker actor options from :func:`spread_plan`.  The node is a soft preference: if it
    dies, Ray restarts the actor wherever there is room."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plan, node_of, shared = spread_plan(placement, nodes, use_gpu=use_gpu,
                                        num_cpus=base["num_cpus"])
    opts = [{**base, "num_cpus": cpus,
             "scheduling_strategy": NodeAffinitySchedulingStrategy(node["id"], soft=True)}
            for node, cpus in plan]
    return opts, node_of, shared


class ChannelWorker(ConnectionWorker):
    """The gateway's end of a worker living in a Ray process - an actor, or a Serve replica -
    reached over the socket the worker opens for it (:meth:`RayWorkerBody.channel`) and watched
    by a long-lived ``watch`` call.  Subclasses say how a call reaches the worker
    (:meth:`call`, :meth:`call_async`) and how it is started."""

    def __init__(self, *args, owner: str = "", closing: threading.Event | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = owner  # this gateway, to the worker (it may serve others too)
        self._closing = closing or threading.Event()
        self.channel: str | None = None  # host:port of the worker's socket
        self._death: str | None = None

    def call(self, method: str, *args, timeout: float):
        """``method(*args)`` on the worker, its answer within ``timeout`` seconds."""
        raise NotImplementedError

    def call_async(self, method: str, *args, done) -> None:
        """``method(*args)`` on the worker; ``done(exception or None)`` when it ends."""
        raise NotImplementedError

    def start(self) -> None:
        self.generation += 1
        self._death = None
        self.inc = ConnectionIncarnation(self.generation)

    def time_left(self, deadline: float, timeout: float) -> float:
        """Seconds left to wait for the worker to load; :class:`SensaiError` when none are, or
        the gateway is shutting down."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise SensaiError(f"{self.name} did not load its subnets within {timeout:g} s "
                              "(is the Ray cluster short of resources?)")
        if self._closing.is_set():
            raise SensaiError(f"{self.name}: shutting down")
        return left

    def connect_channel(self, deadline: float) -> None:
        """Once the worker answers: open its socket for this gateway, connect, bring its fault
        settings up to date (over the socket, ahead of any request), wait for it to say it has
        loaded, and give it a ``watch`` call for this generation."""
        from ray.exceptions import RayError

        inc = self.inc
        authkey = os.urandom(32)
        try:
            address = self.call("channel", authkey, self.owner, self.batching,
                                timeout=max(1.0, deadline - time.monotonic()))
        except (RayError, TimeoutError) as e:
            raise SensaiError(f"{self.name} failed right after loading its subnets: "
                              f"{error_text(e)}") from None
        conn = dial(tuple(address), authkey, max(1.0, deadline - time.monotonic()))
        self.channel = f"{address[0]}:{address[1]}"
        self.attach(inc, conn, conn)
        # A restarted worker forgot them; a fresh seed per incarnation.
        self.send(Fault(self.delay, self.corrupt, self.seed + 7919 * self.generation))
        self.wait_loaded(inc, max(1.0, deadline - time.monotonic()))
        gen = self.generation
        self.call_async("watch", self.owner, done=lambda exc: self._watch_done(gen, exc))

    def ended(self, inc: ConnectionIncarnation) -> str:
        return f"died ({self._death or 'its connection closed'})"

    def _watch_done(self, gen: int, exc: BaseException | None) -> None:
        if exc is None:  # replaced by a newer watch
            return
        if gen == self.generation and self._death is None:
            self._death = error_text(exc)
        inc = self.inc
        if inc is not None and inc.number == gen and inc.conn is not None:
            cut(inc.conn)  # a lost node never closes it: its reader reports the end
        self.sink.exited(self.index, gen, f"died ({self._death or error_text(exc)})")

    def exit_detail(self) -> str:
        return self._death or ""

    def where(self) -> dict:
        return {**super().where(), "channel": self.channel, "cores_awake": self.cores_awake}


class RayActorWorker(ChannelWorker):
    """The gateway's handle on one worker actor."""

    transport = "ray"

    def __init__(self, *args, actor_options: dict | None = None, keep_awake: str = "off",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.actor_options = dict(actor_options or {})
        self.keep_awake = keep_awake
        self.actor = None  # Ray owns the process
        self.actor_id: str | None = None
        self.owner_nodes: dict[str, str] = {}  # node id -> address, filled by the transport

    def start(self) -> None:
        """First start: create the actor.  After a death: a new generation of the same actor,
        which Ray restarts by itself (a new actor only if Ray gave up on the old one)."""
        super().start()
        if self.actor is None:
            self.actor = actor_class().options(**self.actor_options).remote(
                self.name, list(zip(self.groups, self.specs)), self.seed, self.keep_awake)
            self.actor_id = self.actor._actor_id.hex()

    def _control(self, method: str):
        return getattr(self.actor, method).options(concurrency_group="control")

    def call(self, method: str, *args, timeout: float):
        import ray

        return ray.get(self._control(method).remote(*args), timeout=timeout)

    def call_async(self, method: str, *args, done) -> None:
        self._control(method).remote(*args).future().add_done_callback(
            lambda fut: done(fut.exception()))

    def wait_ready(self, timeout: float) -> None:
        """Wait until the actor (created, or restarted by Ray) answers ``ping``, which it does
        once its constructor has loaded the subnets; then connect to it."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        if self.actor is None:
            raise SensaiError(f"{self.name} was never started")
        deadline = time.monotonic() + timeout
        ref = None
        while True:
            left = self.time_left(deadline, timeout)
            if ref is None:
                ref = self._control("ping").remote()
            try:
                ray.get(ref, timeout=min(left, 2.0))
                break
            except GetTimeoutError:
                continue  # still loading or waiting for resources: keep the same ping
            except ActorDiedError as e:
                # Dead for good (its constructor raised, or Ray stopped restarting it): the
                # next start creates a new actor.
                self.actor = None
                raise SensaiError(f"{self.name}: {error_text(e)}") from None
            except RayActorError:
                ref = None  # Ray is restarting it: ask again
                time.sleep(0.1)
        self.connect_channel(deadline)

    def kill(self) -> int | None:
        """Kill the actor's process; Ray restarts it (unless we are shutting down)."""
        import ray

        actor = self.actor
        if actor is None or not ray.is_initialized():
            return None
        pid = self.pid
        ray.kill(actor, no_restart=self._closing.is_set())
        return pid

    def stop(self, timeout: float = 5.0) -> None:
        import ray

        self._closing.set()
        self.hang_up(self.inc)
        actor, self.actor = self.actor, None
        if actor is not None and ray.is_initialized():
            ray.kill(actor, no_restart=True)

    def where(self) -> dict:
        resources = {k: v for k, v in self.actor_options.items() if k != "scheduling_strategy"}
        planned = self.actor_options.get("scheduling_strategy")
        return {**super().where(), "actor_id": self.actor_id, "resources": resources,
                "node_planned": getattr(planned, "node_id", None),
                "node_address": self.owner_nodes.get(self.node)}


class RayActors:
    """The Ray actor transport: every worker an actor with ``actor_options`` (resources,
    scheduling); ``own_ray``: shut Ray down on close (this process started it); ``keep_awake``:
    whether each actor keeps its node's idle cores awake (:mod:`~sensai.serving.core.wakeup`)."""

    name = "ray"
    capabilities = Capabilities()

    def __init__(self, actor_options: dict | Sequence[dict], *, own_ray: bool = False,
                 nodes: Sequence[dict] = (), keep_awake: str = "off"):
        self.actor_options = actor_options
        self.keep_awake = keep_awake
        self.own_ray = own_ray
        self.owner = os.urandom(8).hex()  # this gateway, to its workers
        self.closing = threading.Event()
        self.node_addresses = {n["id"]: n["address"] for n in nodes}

    def options_for(self, index: int) -> dict:
        opts = self.actor_options
        return dict(opts[index] if isinstance(opts, (list, tuple)) else opts)

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **options
               ) -> RayActorWorker:
        w = RayActorWorker(index, groups, specs, sink, actor_options=self.options_for(index),
                           closing=self.closing, keep_awake=self.keep_awake, owner=self.owner,
                           **options)
        w.owner_nodes = self.node_addresses
        return w

    def healthy(self) -> bool:
        import ray

        return ray.is_initialized()

    def describe(self) -> dict:
        return {"kind": "ray-actors", "nodes": len(self.node_addresses)}

    def close(self) -> None:
        self.closing.set()
        if self.own_ray:
            import ray

            if ray.is_initialized():
                ray.shutdown()

"""One host's server as several processes: gateway processes that share the port, device processes
that run the subnets for all of them (``sensai serve`` on the processes backend, whatever the
count of gateway processes, and on the local backend with ``gateway_replicas`` above 1).

This process (the *parent*) only starts and watches.  It works out the serving plan once, starts a
device process per GPU that hosts workers (on CPUs one per worker, or ``device_processes`` shared
round robin) and waits for their subnets to load, then starts the gateway processes: each parses
HTTP and gRPC, decodes and admits on its own event loop and core, and binds the port itself
(SO_REUSEPORT: the kernel spreads the connections).  A gateway process imports no torch: its
predictor reaches the device processes over :mod:`~sensai.serving.transports.devices`.  A dead
process is started again - a gateway costs only its own requests in flight, a device process
those it held in every gateway (whose supervisors mark its workers down and up again, as for any
worker).  What one process admits is its share of the server's ``max_requests``,
``max_connections`` and ``max_predictions`` (the ceiling of its own adaptive limit), with a line
as long as the whole server's; ``/metrics`` from any of them sums all (prometheus_client's
multiprocess files in this server's private directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path

from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.logs import configure as configure_logging

from ..core.faults import Faults
from ..core.messages import Fault
from ..core.settings import GatewaySettings
from ..engine.plan import LOAD_TIMEOUT_S, ServingPlan, class_parallel_plan, cpu_cores
from ..engine.predictor import ClassParallelPredictor
from ..gateway.app import create_app
from ..gateway.metrics import SHARED_DIR_ENV
from ..gateway.server import DRAIN_MARGIN_S, bind_port, uvicorn_config
from ..transports.devices import Devices
from ..workers.device import STOP, DevicePlan, device_main, die_with_parent, hosted_of

log = logging.getLogger(__name__)

# Split between the gateway processes.  max_predictions too: the device processes hold what
# every gateway hands them, so the server's requests in its predictors stay what one gateway
# would hold, and what is admitted is what the devices drain within the latency it brings.  The
# kernel spreads connections unevenly, so a gateway's line keeps the whole server's length (a
# crowd that stands is never refused for want of places elsewhere); under overload the line
# stands and each gateway admits only to a free place of its own (see gateway/limit.py).
SHARED_LIMITS = ("max_requests", "max_connections", "max_predictions")
GATEWAY_START_S = 120.0
# A gateway's slots per worker and request its predictor may hold: a request that timed out
# keeps its slot until the device process is done with it, and the next one needs its own.
SLOTS_PER_PREDICTION = 2
MAX_BACKOFF_S = 30.0
STABLE_S = 10.0  # a process that lived this long restarts without waiting
# A process that ended cleanly was asked to stop; when a signal to the whole process group asked
# (systemd, kill -- -PGID), this process is stopping too, and sees it within this long.
CLEAN_EXIT_GRACE_S = 1.0


def share(settings: GatewaySettings, n: int) -> GatewaySettings:
    """The settings of one of ``n`` gateway processes: its part of the server's limits."""
    return settings.model_copy(update={f: -(-getattr(settings, f) // n) for f in SHARED_LIMITS})


def device_key(w: int, specs, cpu_processes: int) -> str:
    """Which device process worker ``w`` (of runner recipes ``specs``) runs in: its GPU's, the
    simulated GPU's (the sim runtime: all subnets in one, as on one GPU), else on CPUs the one
    of ``cpu_processes`` it shares round robin."""
    spec = specs[0] if specs else None
    if spec is not None and spec.resolved_runtime() == "sim":
        return "sim"
    if spec is not None and spec.device.startswith("cuda"):
        return spec.device
    return f"cpu-{w % cpu_processes}"


def cpu_processes_of(plan: ServingPlan) -> int:
    """How many device processes the CPU workers of ``plan`` share
    (:meth:`~sensai.serving.core.settings.GatewaySettings.cpu_device_processes`); one line
    where fewer than the workers would put a copy, or one worker's injected faults, in another
    worker's process."""
    s, workers = plan.settings, len(plan.workers)
    n = s.cpu_device_processes(workers)
    on_cpus = any(device_key(w, wp.specs, n).startswith("cpu-")
                  for w, wp in enumerate(plan.workers))
    if n < workers and on_cpus:
        name = "SENSAI_DEVICE_PROCESSES (--set device_processes)"
        if s.redundancy or s.vote:
            raise SensaiError(f"{name} {n} with copies of the groups: a copy is there to "
                              "outlive its primary's process, so each worker keeps its own")
        if any(wp.delay is not None or wp.corrupt for wp in plan.workers):
            raise SensaiError(f"{name} {n} with injected faults: they are injected per worker, "
                              "so each worker keeps its own process")
    return n


def device_plans(plan: ServingPlan, folder: Path) -> tuple[list[DevicePlan], dict[int, str]]:
    """The device processes of ``plan``'s workers - one per GPU that hosts workers (one for the
    simulated GPU), on CPUs as many as :func:`cpu_processes_of` says (by default one per
    worker), shared round robin - and the socket of each worker's."""
    cpu_processes = cpu_processes_of(plan)
    by_key: dict[str, list[int]] = {}
    for w, wp in enumerate(plan.workers):
        by_key.setdefault(device_key(w, wp.specs, cpu_processes), []).append(w)
    devices, addresses = [], {}
    cores = cpu_cores(sum(1 for key in by_key if key.startswith("cpu-")))
    for d, (key, workers) in enumerate(by_key.items()):
        first = plan.workers[workers[0]]
        address = str(folder / f"device-{d}.sock")
        devices.append(DevicePlan(
            name=f"device_{d}" + ("" if key.startswith("cpu-") else f" ({key})"),
            address=address,
            hosted=hosted_of([plan.workers[i].groups for i in workers],
                             [plan.workers[i].specs for i in workers]),
            batching=plan.batching, fault=Fault(first.delay, first.corrupt),
            seed=plan.seed + workers[0], cores=cores if key.startswith("cpu-") else 1))
        addresses.update({w: address for w in workers})
    return devices, addresses


@dataclass
class GatewayPlan:
    """What a gateway process needs (picklable): which of how many it is, the artifact, the plan
    (its share of the limits, the port), where each worker's device process listens, and the
    folder of the server's metrics."""

    index: int
    processes: int
    artifact_dir: str
    plan: ServingPlan
    addresses: dict[int, str]
    metrics_dir: str
    line: int  # how many may wait for its predictor: the server's max_predictions


def gateway_main(gp: GatewayPlan, report) -> None:
    """Body of a gateway process: its predictor over the device processes, its app, uvicorn on
    its own socket of the shared port; ``("ready", pid)`` or ``("failed", why)`` on ``report``,
    then serve until SIGTERM (graceful)."""
    die_with_parent()
    configure_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent stops us
    os.environ[SHARED_DIR_ENV] = gp.metrics_dir
    # The event loop uvicorn will run, made first: the device links read their answers on it.
    with asyncio.Runner(loop_factory=uvicorn_config(None).get_loop_factory()) as runner:
        serve_gateway(gp, report, runner)


def serve_gateway(gp: GatewayPlan, report, runner: asyncio.Runner) -> None:
    import uvicorn  # the gateway's own; the parent needs none of it

    settings = gp.plan.settings
    try:
        artifact = load_artifact(gp.artifact_dir)
        transport = Devices(gp.addresses, row_shape=tuple(artifact.spec.input_shape),
                            slots_per_worker=SLOTS_PER_PREDICTION * settings.max_predictions,
                            gateway=gp.index,
                            gateways=gp.processes,
                            load_timeout_s=gp.plan.load_timeout_s, loop=runner.get_loop())
        predictor = ClassParallelPredictor(artifact, gp.plan, transport)
        sock = bind_port(settings.host, settings.port, shared=True)
    except BaseException as e:
        report.send(("failed", str(e) if isinstance(e, SensaiError)
                     else f"{type(e).__name__}: {e}"))
        return
    app = create_app(predictor, settings, shared_ports=True, line=gp.line)
    server = uvicorn.Server(uvicorn_config(app, host=settings.host, port=settings.port,
                                           log_level=settings.log_level, graceful_s=10.0))

    @contextlib.contextmanager
    def sigterm_only():
        old = signal.signal(signal.SIGTERM, server.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, old)

    server.capture_signals = sigterm_only

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started:
            report.send(("ready", os.getpid()))

    threading.Thread(target=announce, daemon=True, name="sensai-announce").start()
    try:
        runner.run(server.serve(sockets=[sock]))  # what server.run does, on the runner's loop
    except SystemExit:  # uvicorn's exit when the app's startup failed
        pass
    if not server.started:
        failed = getattr(app.state, "startup_error", None)
        report.send(("failed", f"the gateway did not start: {failed or 'uvicorn ended'}"))
        sys.exit(3)


class Member:
    """One process of the fleet: what starts it again, and its restarts."""

    def __init__(self, name: str, target, args: tuple, role: str, *, daemon: bool = False):
        self.name, self.target, self.args, self.role = name, target, args, role
        self.daemon = daemon  # ended with this process (a predictor's own device processes)
        self.process: multiprocessing.Process | None = None
        self.pid: int | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.attempt = 0
        self.due: float | None = None  # when a dead one is started again
        self.clean_exit = False  # it ended with status 0 (asked to stop) and awaits its restart

    def start(self, ctx) -> object:
        """Spawn it; returns the end of its report pipe."""
        rx, tx = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=self.target, args=(*self.args, tx),
                                   name=f"sensai-{self.name}", daemon=self.daemon)
        self.process.start()
        tx.close()
        self.pid = self.process.pid
        self.started_at = time.monotonic()
        return rx

    def describe(self) -> dict:
        return {"name": self.name, "role": self.role, "pid": self.pid, "restarts": self.restarts,
                "alive": bool(self.process is not None and self.process.is_alive())}


def await_report(member: Member, rx, timeout: float) -> None:
    """Block until ``member`` says it is ready; :class:`SensaiError` with its reason if not."""
    if not rx.poll(timeout):
        raise SensaiError(f"{member.name} did not start within {timeout:g} s")
    try:
        what, detail = rx.recv()
    except (EOFError, OSError):
        member.process.join(1.0)
        raise SensaiError(f"{member.name} died while starting (exit code "
                          f"{member.process.exitcode})") from None
    finally:
        rx.close()
    if what != "ready":
        raise SensaiError(f"{member.name}: {detail}")


class Fleet:
    """``artifact_dir`` served by ``processes`` gateway processes over device processes (see the
    module); :meth:`start` blocks until all are up, :meth:`watch` restarts the dead until
    :meth:`stop`.  ``processes`` 0: the device processes alone, for a predictor of this process
    (:class:`OwnDevices`).  ``names``: how the user gave each setting, for one-line errors
    (:func:`~sensai.serving.core.settings.setting_name`)."""

    def __init__(self, artifact_dir: str | Path, settings: GatewaySettings, *,
                 processes: int, faults: Faults | None = None, seed: int = 0,
                 names: dict[str, str] | None = None):
        if processes < 0:
            raise SensaiError("a server's gateway processes cannot be fewer than none")
        self.artifact_dir = str(Path(artifact_dir).resolve())
        self.settings = settings  # its ports as bound once started (0: the kernel's choice)
        self.names = names
        self.processes = processes
        self.faults, self.seed = faults, seed
        self.ctx = multiprocessing.get_context("spawn")
        self.folder: Path | None = None
        self.port_holder: socket.socket | None = None
        self.grpc_holder: socket.socket | None = None
        self.device_plans: list[DevicePlan] = []
        self.addresses: dict[int, str] = {}  # each worker's device process
        self.devices: list[Member] = []
        self.gateways: list[Member] = []
        self.plan: ServingPlan | None = None
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.port_holder.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def start(self) -> "Fleet":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        s = self.settings
        artifact = load_artifact(self.artifact_dir)  # fails fast with one line
        self.plan = class_parallel_plan(artifact, s, faults=self.faults, seed=self.seed)
        self.folder = Path(tempfile.mkdtemp(prefix="sensai-serve-"))
        if self.processes:
            (self.folder / "metrics").mkdir()
            # Holds the ports (bound, never listening: they take no connection) from now until
            # the end, so a restarted gateway gets them back, and a port 0 becomes a number
            # every gateway process shares.
            self.port_holder = bind_port(s.host, s.port, names=self.names, shared=True)
            if s.grpc_port is not None:
                self.grpc_holder = bind_port(s.host, s.grpc_port, field="grpc_port",
                                             names=self.names, shared=True)
            grpc_port = None if self.grpc_holder is None else self.grpc_holder.getsockname()[1]
            self.settings = s = s.model_copy(update={"port": self.port, "grpc_port": grpc_port})
        self.device_plans, self.addresses = device_plans(self.plan, self.folder)
        self.devices = [Member(p.name, device_main, (p,), "device", daemon=not self.processes)
                        for p in self.device_plans]
        waiting = [(m, m.start(self.ctx)) for m in self.devices]
        for m, rx in waiting:
            await_report(m, rx, self.plan.load_timeout_s)
        if not self.processes:
            return
        gateway_plan = replace(self.plan, settings=share(s, self.processes))
        self.gateways = [Member(f"gateway_{i}", gateway_main, (GatewayPlan(
            i, self.processes, self.artifact_dir, gateway_plan, self.addresses,
            str(self.folder / "metrics"), s.max_predictions),), "gateway")
            for i in range(self.processes)]
        waiting = [(m, m.start(self.ctx)) for m in self.gateways]
        for m, rx in waiting:
            await_report(m, rx, GATEWAY_START_S)
        log.info("%d gateway process(es) and %d device processes up on %s", self.processes,
                 len(self.devices), self.url)

    # -- watching

    def members(self) -> list[Member]:
        return self.devices + self.gateways

    def watch(self) -> None:
        """Start the dead again (backing off when one keeps dying) until :meth:`stop`."""
        while not self.stopping.is_set():
            with self.lock:
                live = {m.process.sentinel: m for m in self.members()
                        if m.process is not None and m.due is None}
            ready = wait(list(live), timeout=0.2) if live else time.sleep(0.2) or []
            now = time.monotonic()
            with self.lock:
                if self.stopping.is_set():
                    return
                for sentinel in ready:
                    self.died(live[sentinel], now)
                for m in self.members():
                    if m.due is not None and now >= m.due:
                        self.restart(m)

    def died(self, m: Member, now: float) -> None:
        m.process.join(1.0)
        code = m.process.exitcode
        if m.role == "gateway":
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(m.pid, str(self.folder / "metrics"))
        m.attempt = 0 if now - m.started_at > STABLE_S else m.attempt + 1
        wait_s = 0.0 if m.attempt == 0 else min(MAX_BACKOFF_S, 0.5 * 2 ** m.attempt)
        m.clean_exit = code == 0
        if m.clean_exit:  # said when it is started again, unless this server stops first
            m.due = now + max(wait_s, CLEAN_EXIT_GRACE_S)
            return
        m.due = now + wait_s
        log.error("%s (pid %s) ended with %s; starting it again%s", m.name, m.pid,
                  f"signal {-code}" if code is not None and code < 0 else f"exit code {code}",
                  f" in {wait_s:g} s" if wait_s else "")

    def restart(self, m: Member) -> None:
        if m.clean_exit:
            log.warning("%s (pid %s) stopped (exit code 0) though this server did not; starting "
                        "it again", m.name, m.pid)
        m.due, m.clean_exit = None, False
        m.restarts += 1
        rx = m.start(self.ctx)
        # Its report is not waited for here: a gateway's own supervisor reconnects to a device
        # process when it answers, and a gateway takes connections once it listens.
        threading.Thread(target=self.reported, args=(m, rx), daemon=True,
                         name=f"sensai-{m.name}-start").start()

    def reported(self, m: Member, rx) -> None:
        try:
            await_report(m, rx, LOAD_TIMEOUT_S if m.role == "device" else GATEWAY_START_S)
            log.info("%s is back (pid %s, restart %d)", m.name, m.pid, m.restarts)
        except SensaiError as e:
            log.error("%s", e)
            if m.process is not None and m.process.is_alive():
                m.process.kill()

    def describe(self) -> dict:
        with self.lock:
            return {"gateway_processes": self.processes, "url": self.url,
                    "processes": [m.describe() for m in self.members()]}

    # -- stopping

    def stop(self, timeout_s: float = 15.0) -> None:
        """Gateways first (each drains its requests, for as long as their deadline), then the
        device processes."""
        self.stopping.set()
        if self.plan is not None:
            timeout_s = max(timeout_s, self.plan.settings.deadline_s + DRAIN_MARGIN_S + 3.0)
        with self.lock:
            for group in (self.gateways, self.devices):
                for m in group:
                    if m.process is not None and m.process.is_alive():
                        with contextlib.suppress(ProcessLookupError):  # it just ended
                            os.kill(m.process.pid,
                                    STOP if group is self.devices else signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                for m in group:
                    if m.process is None:
                        continue
                    m.process.join(max(0.1, deadline - time.monotonic()))
                    if m.process.is_alive():
                        m.process.kill()
                        m.process.join(5.0)
        for holder in (self.port_holder, self.grpc_holder):
            if holder is not None:
                holder.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "Fleet":
        self.start()
        threading.Thread(target=self.watch, daemon=True, name="sensai-fleet-watch").start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class OwnDevices(Devices):
    """The processes backend under one predictor of this process (what :func:`build_predictor`
    gives: the model repository's versions, ``sensai predict``, the benchmark): device
    processes of its own - a :class:`Fleet` without gateway processes - reached over the same
    links as a gateway process reaches its server's.  A thread of its own starts them and
    restarts the dead (a device process dies with the thread that started it, so never a
    caller's, which may be short-lived); another runs the loop the answers are read on (no
    gateway's loop need run: ``sensai predict`` has none)."""

    name = "processes"

    def __init__(self, fleet: Fleet, *, row_shape: tuple[int, ...]):
        self.fleet = fleet
        started, failed = threading.Event(), []
        self.keeper = threading.Thread(target=self.keep, args=(started, failed), daemon=True,
                                       name="sensai-device-keeper")
        self.keeper.start()
        started.wait()
        if failed:
            raise failed[0]
        loop = asyncio.new_event_loop()
        self.reader = threading.Thread(target=loop.run_forever, daemon=True,
                                       name="sensai-device-answers")
        self.reader.start()
        plan = fleet.plan
        super().__init__(fleet.addresses, row_shape=row_shape, loop=loop,
                         slots_per_worker=SLOTS_PER_PREDICTION * plan.settings.max_predictions,
                         load_timeout_s=plan.load_timeout_s)

    def keep(self, started: threading.Event, failed: list) -> None:
        try:
            self.fleet.start()
        except BaseException as e:  # raised in the caller's thread
            failed.append(e)
            return
        finally:
            started.set()
        self.fleet.watch()

    def describe(self) -> dict:
        return {"kind": "processes", "device_processes": len(self.links)}

    def close(self) -> None:
        super().close()
        self.fleet.stop()
        self.keeper.join(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.reader.join(5.0)

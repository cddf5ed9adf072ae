"""A device process: every subnet that lives on one device (a GPU, or one CPU worker's cores), fed
by every gateway process of the server at once.

It builds its runners, listens on a Unix socket, and serves each gateway that connects
(:mod:`.devicewire`: the gateway's slots in shared memory, small frames on the socket).  Three
kinds of thread share the work:

* one *reader* reads every gateway's socket (a selector over all of them): whatever has arrived,
  in bulk, parsed frame by frame into runs on one queue, skips applied at once;
* the *computing* thread runs the one in-worker loop (:class:`~.loop.WorkerCore`): it takes
  everything that waits, from every gateway, and computes each subnet once for all the rows that
  need it, all the device's subnets launched before one wait (a request alone still never waits
  for company); while the device computes, the reader gathers the next batch;
* a short-lived thread per new connection reads its hello (a silent client holds up no one).

What the loop answers leaves per batch: one frame per subnet with every request's rows, and one
frame with the Dones, for each gateway (one write each).  Each connection gets back exactly its own
requests' outputs and Done.  A gateway that breaks the protocol is hung up on; the others go on.
The process ends when its parent says so (:data:`STOP`), or dies with it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import selectors
import signal
import socket
import threading
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import numpy as np

from sensai.errors import SensaiError
from sensai.logs import configure as configure_logging

from ..core.faults import parse_delay
from ..core.messages import Batching, Dones, Fault, Outputs, Run, RunFailed, Skip
from . import devicewire as w
from .device_runner import DeviceRunner, build_device
from .loop import Stop, WorkerCore
from .runners import RunnerSpec

PR_SET_PDEATHSIG = 1
CONN_BITS = 56  # a run's id here: the connection's number above, the gateway's wire id below
WIRE_MASK = (1 << CONN_BITS) - 1
READ_BYTES = 256 * 1024  # a connection's read buffer (grown for a larger frame)
HELLO_S = 10.0


@dataclass(frozen=True)
class DevicePlan:
    """One device process: its name, the socket it listens on, the (group, recipe) pairs it
    hosts, the faults injected into it, its batching and its fault sampler's seed."""

    name: str
    address: str
    hosted: tuple[tuple[int, RunnerSpec], ...]
    batching: Batching
    fault: Fault = Fault()
    seed: int = 0
    cores: int = 1  # the CPU cores its subnets' one call may use side by side

    @property
    def device(self) -> str:
        return self.hosted[0][1].device if self.hosted else "cpu"


class Link:
    """One gateway's connection, seen from the device process: its slots, what the reader has
    of its stream (its frames), and what the computing thread queued for it."""

    def __init__(self, number: int, sock: socket.socket, slots: w.MappedSlots):
        self.number = number
        self.base = number << CONN_BITS
        self.sock = sock
        self.slots = slots
        self.lock = threading.Lock()
        self.open = True
        self.queued: list[bytes] = []  # the computing thread's frames, sent by flush()
        self.frames = w.FrameReader(READ_BYTES)

    def queue(self, data: bytes) -> None:
        self.queued.append(data)

    def flush(self) -> None:
        if self.queued:
            data, self.queued = b"".join(self.queued), []
            self.send(data)

    def send(self, data: bytes) -> None:
        with self.lock:
            if not self.open:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.open = False  # the gateway is gone; the reader sees it and drops it

    def close(self) -> None:
        self.open = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class DeviceServer:
    """The device process's body once its runners are built (see :func:`device_main`)."""

    def __init__(self, plan: DevicePlan, runners: DeviceRunner, listener: socket.socket,
                 runtime: str | None):
        self.plan = plan
        self.listener = listener
        self.ready = w.control(w.READY, {"pid": os.getpid(), "device": plan.device,
                                         "runtime": runtime})
        self.links: dict[int, Link] = {}
        self.links_lock = threading.Lock()
        self.numbers = itertools.count(1)
        self.runs: queue.SimpleQueue = queue.SimpleQueue()
        self.core = WorkerCore(runners, delay=plan.fault.delay, corrupt=plan.fault.corrupt,
                               seed=plan.seed, batching=plan.batching, origin=self.origin,
                               flush=self.flush)
        self.selector = selectors.DefaultSelector()
        self.doorbell, self.ring = socket.socketpair()  # wakes the reader for a new link
        self.joining: queue.SimpleQueue = queue.SimpleQueue()

    @staticmethod
    def origin(req: int) -> int:
        return req >> CONN_BITS

    def serve(self) -> None:
        """Compute on this thread; accept and read gateways on others.  Returns when the
        listening socket is closed."""
        threading.Thread(target=self.accept, daemon=True, name="sensai-device-accept").start()
        threading.Thread(target=self.read, daemon=True, name="sensai-device-read").start()
        self.core.serve(self.runs, self.emit)

    # -- connections

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                self.runs.put(Stop())
                return
            threading.Thread(target=self.greet, args=(sock,), daemon=True,
                             name="sensai-device-hello").start()

    def greet(self, sock: socket.socket) -> None:
        """A new connection's hello and slots; then it is the reader's."""
        try:
            sock.settimeout(HELLO_S)
            data, fds, _, _ = socket.recv_fds(sock, 64 * 1024, 1)
            sock.settimeout(None)
            if len(data) < w.FRAME.size or len(fds) != 1:
                raise w.WireError("a connection that did not start with a hello and its slots")
            n, kind = w.FRAME.unpack_from(data)
            if kind != w.HELLO or n != len(data) - w.FRAME.size:
                raise w.WireError("a connection that did not start with a hello")
            slots = w.MappedSlots(fds[0], w.parse_control(memoryview(data)[w.FRAME.size:]))
        except (OSError, EOFError, w.WireError):
            sock.close()
            return
        with self.links_lock:
            link = Link(next(self.numbers), sock, slots)
            self.links[link.number] = link
        link.send(self.ready)
        self.joining.put(link)
        try:
            self.ring.send(b"\0")
        except OSError:
            pass

    def drop(self, link: Link) -> None:
        with self.links_lock:
            self.links.pop(link.number, None)
        try:
            self.selector.unregister(link.sock)
        except (KeyError, ValueError):
            pass
        link.close()
        link.sock.close()

    # -- reading (the reader thread)

    def read(self) -> None:
        self.selector.register(self.doorbell, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.selector.select():
                link = key.data
                if link is None:
                    self.doorbell.recv(4096)
                    while not self.joining.empty():
                        joined = self.joining.get_nowait()
                        self.selector.register(joined.sock, selectors.EVENT_READ, joined)
                    continue
                try:
                    self.take(link)
                except (OSError, EOFError, w.WireError):
                    self.drop(link)

    def take(self, link: Link) -> None:
        """What has arrived on ``link``, every whole frame of it handled."""
        link.frames.take(link.sock, partial(self.frame, link))

    def frame(self, link: Link, kind: int, body: memoryview) -> None:
        core = self.core
        if kind == w.RUN:
            if len(body) < w.RUN_HEAD.size:
                raise w.WireError("a short run")
            wire, slot, rows, hedge_s, primaries, n = w.RUN_HEAD.unpack_from(body)
            groups, at = w.groups_of(body, w.RUN_HEAD.size, n)
            hosted = core.groups
            if primaries > n or any(g not in hosted for g in groups):
                raise w.WireError(f"a run of groups {groups} this device does not host")
            if slot < 0:
                x = np.array(w.array_of(body, at))  # the read buffer is reused: a copy
            else:
                if at != len(body):
                    raise w.WireError("a slotted run with bytes after its header")
                x = link.slots.rows(slot, rows)
            self.runs.put(Run(link.base | wire, x, groups, primaries, hedge_s))
        elif kind == w.SKIP:
            if len(body) < w.SKIP_HEAD.size:
                raise w.WireError("a short skip")
            wire, n = w.SKIP_HEAD.unpack_from(body)
            groups = None if n == w.EVERY else w.groups_of(body, w.SKIP_HEAD.size, n)[0]
            core.skip(Skip(link.base | wire, groups))
        elif kind == w.PING:
            token = bytes(body[:w.TOKEN.size])
            self.runs.put(Stop(reply=partial(link.send, w.frame(w.PONG, token))))
        elif kind == w.FAULT:
            msg = w.parse_control(body)
            delay = msg.get("delay")
            try:
                core.fault(Fault(parse_delay(delay) if delay else None,
                                 bool(msg.get("corrupt")), msg.get("seed")))
            except SensaiError as e:
                raise w.WireError(str(e)) from None
        else:
            raise w.WireError(f"a frame of kind {kind}")

    # -- answering (the computing thread)

    def flush(self) -> None:
        """Send what the core emitted since the last flush, one write per connection."""
        for link in list(self.links.values()):
            link.flush()

    def emit(self, event) -> None:
        """An event of the loop, queued for the connections its requests came on (the loop
        flushes after the own groups and after each batch)."""
        kind = type(event)
        if kind is Outputs:
            self.outputs(event)
        elif kind is Dones:
            self.dones(event)
        elif kind is RunFailed:
            link = self.links.get(event.req >> CONN_BITS)
            if link is not None:
                link.queue(w.frame(w.FAILED, w.FAILED_HEAD.pack(event.req & WIRE_MASK,
                                                                event.group),
                                   event.error.encode()[:4000]))

    def per_link(self, reqs: Sequence[int]) -> list[tuple[Link, list[int] | None, list[int]]]:
        """``reqs`` split by the connection they came on: (link, their places in ``reqs`` or
        None for all, their wire ids)."""
        first = reqs[0] >> CONN_BITS
        if len(reqs) == 1 or all(r >> CONN_BITS == first for r in reqs):
            link = self.links.get(first)
            return [] if link is None else [(link, None, [r & WIRE_MASK for r in reqs])]
        places: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            places.setdefault(r >> CONN_BITS, []).append(i)
        out = []
        for c, mine in places.items():
            link = self.links.get(c)
            if link is not None:
                out.append((link, mine, [reqs[i] & WIRE_MASK for i in mine]))
        return out

    def outputs(self, event: Outputs) -> None:
        out, sizes = event.out, event.sizes
        for link, mine, wires in self.per_link(event.reqs):
            if mine is None:
                part, n = out, sizes
            else:
                n = [sizes[i] for i in mine]
                if len(out) == len(sizes):  # a row each
                    part = out[mine]
                else:
                    at = np.cumsum([0, *sizes])
                    part = out[np.concatenate([np.arange(at[i], at[i + 1]) for i in mine])]
            link.queue(w.outputs_frame(event.group, event.ms, wires, n, part))

    def dones(self, event: Dones) -> None:
        skipped = event.skipped
        for link, mine, wires in self.per_link(event.reqs):
            link.queue(w.dones_frame(wires, skipped if mine is None else
                                     [skipped[i] for i in mine], event.counts))


def listen(address: str) -> socket.socket:
    """The device's Unix socket at ``address`` (a stale one from a dead predecessor replaced)."""
    try:
        os.unlink(address)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address)
    sock.listen(256)
    return sock


# What stops a device process.  Not SIGTERM: a supervisor (systemd, ``kill -- -PGID``) sends
# that to the whole group, and the devices must go on computing while the gateways drain their
# requests; the parent stops them after the gateways.
STOP = signal.SIGUSR1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """This process gets ``sig`` when the thread that started it ends (Linux ``prctl``), so a
    server killed outright leaves no process of its own behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the parent's stop() is all there is
        pass


def device_main(plan: DevicePlan, report) -> None:
    """Body of a device process: build the runners, listen, say so on ``report`` (a pipe to the
    parent: ``("ready", pid)`` or ``("failed", why)``), then serve until :data:`STOP`."""
    die_with_parent(STOP)
    configure_logging()
    # Ctrl-C and a supervisor's SIGTERM reach the group; the parent stops us after the gateways.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        runners = build_device(plan.hosted, cores=plan.cores)
        listener = listen(plan.address)
    except BaseException as e:
        report.send(("failed", str(e) if isinstance(e, SensaiError)
                     else f"{type(e).__name__}: {e}"))
        return
    server = DeviceServer(plan, runners, listener, runners.runtime)
    signal.signal(STOP, lambda *_: stop(server))
    report.send(("ready", os.getpid()))
    report.close()
    # The main thread only waits (in short joins, so the STOP handler runs at once).
    computing = threading.Thread(target=server.serve, daemon=True, name="sensai-device-runs")
    computing.start()
    while computing.is_alive():
        computing.join(0.5)


def stop(server: DeviceServer) -> None:
    server.core.skip_all()
    try:
        server.listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    server.listener.close()
    server.runs.put(Stop())


def hosted_of(groups_per_worker: Sequence[Sequence[int]], specs_per_worker: Sequence[Sequence]
              ) -> tuple[tuple[int, RunnerSpec], ...]:
    """The (group, recipe) pairs of several workers on one device, each group once."""
    seen: dict[int, RunnerSpec] = {}
    for groups, specs in zip(groups_per_worker, specs_per_worker):
        for g, spec in zip(groups, specs):
            seen.setdefault(g, spec)
    return tuple(seen.items())

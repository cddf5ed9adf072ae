"""Workers in device processes shared by several gateway processes (``sensai serve`` with more than
one gateway process, :mod:`~sensai.serving.launch.fleet`).

The device processes are the server's, not this gateway's: its parent starts them and restarts a
dead one.  A worker here is a :class:`DeviceWorker` over this gateway's :class:`DeviceLink` to the
device process that hosts the worker's groups (workers on one GPU share one device process, and so
one link).  *Starting* a worker is connecting the link (again, after a death: dialing until the
parent's new device process answers); *killing* it ends the device process, which every gateway
sees.  Requests travel as :mod:`~sensai.serving.workers.devicewire` frames, their rows through this
gateway's shared-memory slots; the answers are read on the gateway's event loop, where the requests
wait, and the runs of every request dispatched in one turn of the loop leave in one write per
device process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from typing import Callable, Mapping, Sequence

import numpy as np

from sensai.errors import SensaiError

from ..core.messages import BatchCounts, Done, Fault, Output, Run, RunFailed, Skip
from ..workers import devicewire as w
from .base import TOKENS, Capabilities, Incarnation, Sink, WorkerHandle

log = logging.getLogger(__name__)

DIAL_RETRY_S = 0.05
READY_TIMEOUT_S = 30.0
# The answers go through the link, not straight to the sink: only the link knows whether the
# worker's incarnation that sent a request still runs over it.
Deliver = Callable[["DeviceWorker", object], None]


class InFlight:
    """The requests in flight on one device process, by wire id: each one's worker, request and
    slot, so that the device's answers find their requests; and the runs framed but not sent
    yet.  Changed under ``lock`` (the link's: a run's frame is made and sent under it); the
    answers' reader looks a wire up without it, as an answer whose request is gone is dropped
    either way."""

    def __init__(self, slots: int, row_shape: tuple[int, ...], lock: threading.Lock):
        self.slots = w.Slots(slots, 1, row_shape)
        self.lock = lock
        self.pending: dict[int, tuple[DeviceWorker, int, int]] = {}  # wire -> handle, req, slot
        self.wires: dict[tuple[int, int], int] = {}  # (worker, req) -> wire
        self.ids = itertools.count(1)
        self.outbox: list[bytes] = []  # runs held until their request's runs are all out

    def forget(self) -> None:
        """The connection is over: no request is in flight on it, every slot is free (call
        holding ``lock``)."""
        self.pending.clear()
        self.wires.clear()
        self.outbox = []
        self.slots.free = list(range(self.slots.count - 1, -1, -1))

    def run_frame(self, handle: "DeviceWorker", run: Run) -> bytes:
        """``run`` as a frame, its rows in a free slot when they fit one (call holding
        ``lock``)."""
        wire = next(self.ids)
        x, slots = run.x, self.slots
        head = (wire, -1, len(x), run.hedge_s, run.primaries, len(run.groups))
        if slots.free and slots.fits(x):
            slot = slots.free.pop()
            slots.put(slot, x)
            data = w.frame(w.RUN, w.RUN_HEAD.pack(wire, slot, *head[2:]),
                           w.groups_bytes(run.groups))
        else:
            slot = -1
            data = w.frame(w.RUN, w.RUN_HEAD.pack(*head), w.groups_bytes(run.groups),
                           w.array_bytes(np.asarray(x)))
        self.pending[wire] = (handle, run.req, slot)
        self.wires[(handle.index, run.req)] = wire
        return data

    def skip_frame(self, handle: "DeviceWorker", msg: Skip) -> bytes | None:
        """``msg`` as a frame; None when its request is not in flight here (call holding
        ``lock``)."""
        wire = self.wires.get((handle.index, msg.req))
        if wire is None:
            return None
        groups = () if msg.groups is None else msg.groups
        return w.frame(w.SKIP, w.SKIP_HEAD.pack(
            wire, w.EVERY if msg.groups is None else len(groups)), w.groups_bytes(groups))

    def outputs(self, body: memoryview, deliver: Deliver) -> None:
        """An OUTPUTS frame: each request's rows of one group."""
        group, ms, wires, sizes, out = w.parse_outputs(body)
        out = np.array(out)  # the frame's bytes are read-only; one copy for all requests
        pending = self.pending
        if len(wires) == 1:
            to = pending.get(int(wires[0]))
            if to is not None:
                deliver(to[0], Output(to[1], group, out, ms))
            return
        at = 0
        for wire, n in zip(wires.tolist(), sizes.tolist()):
            to = pending.get(wire)
            if to is not None:
                deliver(to[0], Output(to[1], group, out[at:at + n], ms))
            at += n

    def dones(self, body: memoryview, deliver: Deliver) -> None:
        """A DONES frame: its requests are no longer in flight, their slots free again."""
        wires, skipped, counts = w.parse_dones(body)
        ended = []
        with self.lock:
            pending, free = self.pending, self.slots.free
            for wire, n in zip(wires.tolist(), skipped.tolist()):
                to = pending.pop(wire, None)
                if to is not None:
                    self.wires.pop((to[0].index, to[1]), None)
                    if to[2] >= 0:
                        free.append(to[2])
                    ended.append((to[0], to[1], n))
        made: dict[int, BatchCounts | None] = {}
        for handle, req, n in ended:
            first = handle.groups[0] if handle.groups else -1
            if first not in made:
                c = counts.get(first)
                made[first] = BatchCounts(*c) if c is not None else None
            deliver(handle, Done(req, n, made[first]))

    def failed(self, body: memoryview, deliver: Deliver) -> None:
        """A FAILED frame: one group of one request failed."""
        wire, group = w.FAILED_HEAD.unpack_from(body)
        to = self.pending.get(wire)
        if to is not None:
            deliver(to[0], RunFailed(to[1], group,
                                     bytes(body[w.FAILED_HEAD.size:]).decode(errors="replace")))


class DeviceLink:
    """This gateway's connection to one device process, shared by the workers it hosts: the
    connection itself (dialed, read on the gateway's loop, written under ``lock``), the requests
    in flight on it (:class:`InFlight`), and the incarnations of the workers that wait on it or
    run over it."""

    def __init__(self, address: str, *, slots: int, row_shape: tuple[int, ...],
                 loop: asyncio.AbstractEventLoop):
        self.address = address
        self.loop = loop  # where the answers are read
        self.frames = w.FrameReader()
        self.lock = threading.Lock()  # the connection, the maps, the slots, a frame's send
        self.inflight = InFlight(slots, row_shape, self.lock)
        self.sock: socket.socket | None = None
        self.info: dict | None = None  # the device's READY
        self.attached: dict[int, tuple[DeviceWorker, Incarnation]] = {}
        self.pongs: dict[int, threading.Event] = {}
        self.dialing = False
        self.closed = False

    # -- connection

    def attach(self, handle: "DeviceWorker", inc: Incarnation, timeout: float) -> None:
        """``handle``'s new incarnation runs over this link: ready at once when it is connected,
        else once a dial (started here if none is under way) connects."""
        with self.lock:
            self.attached[handle.index] = (handle, inc)
            if self.sock is not None:
                self.ready(handle, inc)
                return
            if self.dialing:
                return
            self.dialing = True
        threading.Thread(target=self.dial, args=(timeout,), daemon=True,
                         name=f"sensai-dial-{os.path.basename(self.address)}").start()

    def ready(self, handle: "DeviceWorker", inc: Incarnation) -> None:
        info = self.info or {}
        handle.pid, handle.device = info.get("pid"), info.get("device", handle.device)
        handle.runtime = info.get("runtime", handle.runtime)
        inc.ready.set()

    def dial(self, timeout: float) -> None:
        deadline, why = time.monotonic() + timeout, "no device process answered"
        sock = None
        slots = self.inflight.slots
        while not self.closed and time.monotonic() < deadline:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.address)
                hello = w.control(w.HELLO, slots.describe())
                socket.send_fds(sock, [hello], [slots.fd])
                sock.settimeout(READY_TIMEOUT_S)
                info = self.await_ready(sock)
                sock.settimeout(None)
                break
            except (OSError, EOFError, w.WireError) as e:
                why = f"{type(e).__name__}: {e}"
                sock.close()
                sock = None
                time.sleep(DIAL_RETRY_S)
        with self.lock:
            self.dialing = False
            waiting = list(self.attached.values())
            if sock is not None and not self.closed:
                self.sock, self.info = sock, info
                for handle, inc in waiting:
                    self.ready(handle, inc)
            else:
                if sock is not None:
                    sock.close()
                for _, inc in waiting:
                    inc.error = f"cannot reach its device process at {self.address} ({why})"
                    inc.ready.set()
                return
        try:
            self.loop.call_soon_threadsafe(self.read_on_loop, sock)
        except RuntimeError:  # the loop is closed: the gateway is stopping
            self.ended(sock, "the gateway is stopping")

    @staticmethod
    def await_ready(sock: socket.socket) -> dict:
        """The device's answer to our hello (blocking: the dial's thread)."""
        head = sock.recv(w.FRAME.size, socket.MSG_WAITALL)
        if len(head) < w.FRAME.size:
            raise EOFError("the device process hung up")
        n, kind = w.FRAME.unpack(head)
        if kind != w.READY or n > w.MAX_FRAME:
            raise w.WireError(f"the device process answered a hello with kind {kind}")
        body = sock.recv(n, socket.MSG_WAITALL) if n else b""
        if len(body) < n:
            raise EOFError("the device process hung up")
        return w.parse_control(memoryview(body))

    # -- the device's answers, read on the gateway's event loop: no thread between an answer
    # and the request that waits for it

    def read_on_loop(self, sock: socket.socket) -> None:
        self.loop.add_reader(sock.fileno(), self.readable, sock)

    def readable(self, sock: socket.socket) -> None:
        try:
            self.frames.take(sock, self.handle)
        except BlockingIOError:  # woken for nothing
            return
        except (OSError, EOFError):
            self.ended(sock, "lost its device process (the connection closed)")
        except w.WireError as e:
            self.ended(sock, f"its device process broke the protocol ({e})")

    def ended(self, sock: socket.socket, detail: str) -> None:
        """The connection is over: every request on it and every worker over it is told."""
        if sock.fileno() >= 0:
            try:
                self.loop.remove_reader(sock.fileno())
            except RuntimeError:  # the loop is closed (the server stopped)
                pass
        with self.lock:
            if self.sock is sock:
                self.sock = None
            lost, self.attached = list(self.attached.values()), {}
            self.inflight.forget()
            self.frames = w.FrameReader()
        sock.close()
        for handle, inc in lost:
            if not inc.ready.is_set():
                inc.error = detail
                inc.ready.set()
            handle.sink.exited(handle.index, inc.number, detail)

    def handle(self, kind: int, body: memoryview) -> None:
        if kind == w.OUTPUTS:
            self.inflight.outputs(body, self.deliver)
        elif kind == w.DONES:
            self.inflight.dones(body, self.deliver)
        elif kind == w.FAILED:
            self.inflight.failed(body, self.deliver)
        elif kind == w.PONG:
            answered = self.pongs.get(w.TOKEN.unpack_from(body)[0])
            if answered is not None:
                answered.set()
        else:
            raise w.WireError(f"a frame of kind {kind}")

    def deliver(self, handle: "DeviceWorker", event) -> None:
        entry = self.attached.get(handle.index)
        if entry is not None:
            handle.sink.deliver(handle.index, entry[1].number, event)

    # -- to the device

    def send(self, handle: "DeviceWorker", msg) -> None:
        """``msg`` to the device process: a Run waits in the outbox for :meth:`push` (the
        request's other runs join it), anything else leaves at once, after the outbox."""
        kind = type(msg)
        inflight = self.inflight
        with self.lock:
            sock = self.sock
            if sock is None or handle.index not in self.attached:
                return  # down: the pool has been or will be told
            if kind is Run:
                inflight.outbox.append(inflight.run_frame(handle, msg))
                return
            if kind is Skip:
                data = inflight.skip_frame(handle, msg)
                if data is None:
                    return
            elif kind is Fault:
                data = w.control(w.FAULT, {"delay": None if msg.delay is None else str(msg.delay),
                                           "corrupt": bool(msg.corrupt), "seed": msg.seed})
            else:
                raise TypeError(f"a {kind.__name__} for a device process")
            if inflight.outbox:
                data, inflight.outbox = b"".join((*inflight.outbox, data)), []
            try:
                sock.sendall(data)
            except OSError:
                pass  # the reader sees the end and reports it

    def push(self) -> None:
        """Send the runs held in the outbox, in one write."""
        inflight = self.inflight
        with self.lock:
            if not inflight.outbox:
                return
            data, inflight.outbox = b"".join(inflight.outbox), []
            sock = self.sock
            if sock is None:
                return
            try:
                sock.sendall(data)
            except OSError:
                pass  # the reader sees the end and reports it

    def ping(self, timeout: float) -> bool:
        token = next(TOKENS)
        answered = threading.Event()
        self.pongs[token] = answered
        try:
            with self.lock:
                if self.sock is None:
                    return False
                try:
                    self.sock.sendall(w.frame(w.PING, w.TOKEN.pack(token)))
                except OSError:
                    return False
            return answered.wait(timeout)
        finally:
            self.pongs.pop(token, None)

    def detach(self, handle: "DeviceWorker") -> None:
        """``handle`` is stopped for good; the last one out hangs up."""
        with self.lock:
            self.attached.pop(handle.index, None)
            last = not self.attached
            sock = self.sock if last else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        with self.lock:
            sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class DeviceWorker(WorkerHandle):
    transport = "devices"

    def __init__(self, *args, link: DeviceLink, load_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.link = link
        self.load_timeout_s = load_timeout_s
        self.inc: Incarnation | None = None

    def start(self) -> None:
        self.generation += 1
        self.inc = Incarnation(self.generation)
        self.link.attach(self, self.inc, self.load_timeout_s)

    def wait_ready(self, timeout: float) -> None:
        self.wait_loaded(self.inc, timeout)
        if self.delay is not None or self.corrupt:  # injected faults outlive a restart
            self.send(Fault(self.delay, self.corrupt, self.seed + 7919 * self.generation))

    def send(self, msg) -> None:
        self.link.send(self, msg)

    def probe(self, timeout: float) -> bool:
        return self.link.ping(timeout)

    def kill(self) -> int | None:
        """End the device process (every gateway's link to it ends; the server restarts it)."""
        pid = self.pid
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def stop(self, timeout: float = 5.0) -> None:
        self.link.detach(self)

    def where(self) -> dict:
        return {**super().where(), "device_process": self.link.address}


class Devices:
    """The transport of gateway process ``gateway`` of ``gateways``: worker ``w`` reached at
    ``addresses[w]`` (workers with one address share one device process and one link); the
    answers are read on ``loop``, the gateway's event loop, where its requests wait (it need
    not run yet)."""

    name = "devices"
    capabilities = Capabilities()

    def __init__(self, addresses: Mapping[int, str], *, row_shape: Sequence[int],
                 slots_per_worker: int, gateway: int = 0, gateways: int = 1,
                 loop: asyncio.AbstractEventLoop, load_timeout_s: float = 600.0):
        self.addresses = dict(addresses)
        self.gateway, self.gateways = gateway, gateways
        self.load_timeout_s = load_timeout_s
        sharing = Counter(self.addresses.values())
        self.links = {a: DeviceLink(a, slots=n * slots_per_worker, row_shape=tuple(row_shape),
                                    loop=loop)
                      for a, n in sharing.items()}
        self.loop = loop
        self.loop_thread: int | None = None  # the thread that runs loop, once it runs
        self.flushing = False  # a flush is due on the loop
        loop.call_soon_threadsafe(self.on_loop)

    def on_loop(self) -> None:
        self.loop_thread = threading.get_ident()

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **options
               ) -> DeviceWorker:
        if index not in self.addresses:
            raise SensaiError(f"no device process for worker {index}")
        return DeviceWorker(index, groups, specs, sink,
                            link=self.links[self.addresses[index]],
                            load_timeout_s=self.load_timeout_s, **options)

    def sent(self) -> None:
        """A request's runs are all handed out: each device process's leave together - on the
        gateway's loop, together with those of every request dispatched in the same turn of the
        loop (one write for all of them, at the start of the next turn)."""
        if self.loop_thread == threading.get_ident():
            if not self.flushing:
                self.flushing = True
                self.loop.call_soon(self.flush)
            return
        self.flush()

    def flush(self) -> None:
        self.flushing = False
        for link in self.links.values():
            if link.inflight.outbox:
                link.push()

    def healthy(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"kind": "devices", "gateway_process": self.gateway,
                "gateway_processes": self.gateways, "device_processes": len(self.links)}

    def close(self) -> None:
        for link in self.links.values():
            link.close()

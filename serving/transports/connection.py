"""A worker behind a ``multiprocessing.connection`` - both ends, shared by the transports whose
requests travel over one: a pipe to a local process (:mod:`.processes`) and an authenticated
socket to a Ray actor (:mod:`.ray_actors`).

The worker's end (:func:`serve_connection`) feeds the in-worker loop of
:mod:`~sensai.serving.workers.loop` from the connection and writes back what it computes.  The
gateway's end (:class:`ConnectionWorker`) has a sender thread, so a busy worker with a full pipe
never blocks the event loop, and a reader thread, which hands each result to the predictor the
moment it arrives and reports the incarnation's end when the connection closes.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from functools import partial
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait

from sensai.errors import SensaiError

from ..core.messages import (Done, Fault, Output, Ping, Pong, Ready, Run, RunFailed, Shutdown, Skip,
                             StartFailed)
from ..workers.loop import Stop, WorkerCore, per_request
from .base import TOKENS, Incarnation, WorkerHandle

HANDSHAKE_S = 5.0  # a client that has not proved the key by then is hung up on


def serve_connection(rx: Connection, tx: Connection, core: WorkerCore, ready: Ready) -> None:
    """The worker's end: say ``ready``, then serve messages from ``rx`` until Shutdown or the
    connection ends.  Runs are computed one after another on a thread of their own, so a Skip,
    Fault or Ping is read (and a Skip applied) while a run computes."""
    lock = threading.Lock()

    def emit(event) -> None:
        with lock:
            try:
                tx.send(event)
            except (OSError, ValueError):
                pass  # the gateway hung up: the loop below sees it and ends

    runs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=core.serve, args=(runs, per_request(emit)), daemon=True,
                     name="sensai-worker-runs").start()
    try:
        emit(ready)
        while True:
            msg = rx.recv()
            kind = type(msg)
            if kind is Run:
                runs.put(msg)
            elif kind is Skip:
                core.skip(msg)
            elif kind is Fault:
                core.fault(msg)
            elif kind is Ping:
                runs.put(Stop(reply=partial(emit, Pong(msg.token))))
            elif kind is Shutdown:
                break
            else:  # a bug on the predictor's side: end, so the supervisor sees it
                raise TypeError(f"unexpected message {kind.__name__} to a worker")
    except (EOFError, OSError):
        pass
    finally:
        runs.put(Stop())


def accept(server: socket.socket, authkey: bytes, timeout: float) -> Connection | None:
    """The worker's end of its socket: the first client on ``server`` that proves it holds
    ``authkey`` (HMAC challenges both ways, before anything is unpickled); None when none does
    within ``timeout`` seconds.  Anyone else is hung up on, a silent one after HANDSHAKE_S."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        server.settimeout(left)
        try:
            sock, _ = server.accept()
        except OSError:  # timed out, or the server was closed
            return None
        conn = Connection(nodelay(sock).detach())
        if handshake(conn, authkey, min(left, HANDSHAKE_S), server_side=True) is None:
            return conn
        conn.close()


def handshake(conn: Connection, authkey: bytes, timeout: float, *, server_side: bool
              ) -> str | None:
    """Mutual HMAC authentication on a fresh connection; None when it succeeded, else why not."""
    # It reads a blocking socket: a peer that never answers is cut off after ``timeout``.
    timer = threading.Timer(timeout, cut, args=(conn,))
    timer.start()
    try:
        if server_side:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        return None
    except AuthenticationError as e:
        return f"authentication failed ({e})"
    except (OSError, EOFError) as e:
        return f"no authenticated handshake within {timeout:g} s ({e or type(e).__name__})"
    finally:
        timer.cancel()


def nodelay(sock: socket.socket) -> socket.socket:
    """Blocking, and every message sent at once: with Nagle's algorithm a small result waits
    for the peer's delayed ACK (tens of milliseconds)."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def cut(conn: Connection) -> None:
    """Shut a socket connection down, which wakes a thread blocked reading it (closing alone
    would not)."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except (OSError, ValueError):
        return  # closed already
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def dial(address: tuple[str, int], authkey: bytes, timeout: float) -> Connection:
    """The gateway's end of a worker's socket: connected and mutually authenticated (HMAC
    challenges both ways, before anything is unpickled) within ``timeout`` seconds."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as e:
        raise SensaiError(f"cannot reach the worker at {address[0]}:{address[1]} ({e}); the "
                          "gateway's node must be able to open TCP connections to the worker "
                          "nodes") from None
    conn = Connection(nodelay(sock).detach())
    failed = handshake(conn, authkey, timeout, server_side=False)
    if failed is not None:
        conn.close()
        raise SensaiError(f"the worker at {address[0]}:{address[1]}: {failed}")
    return conn


class ConnectionIncarnation(Incarnation):
    """One start of a worker reached over a connection: the connection and its send queue."""

    def __init__(self, number: int):
        super().__init__(number)
        self.send_q: queue.SimpleQueue = queue.SimpleQueue()
        self.conn: Connection | None = None


class ConnectionWorker(WorkerHandle):
    """The gateway's end of a worker reached over a connection.  Subclasses start the worker
    and call :meth:`attach` with the connections of each incarnation; :meth:`ended` says how an
    incarnation ended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inc: ConnectionIncarnation | None = None
        self._pongs: dict[int, threading.Event] = {}

    def attach(self, inc: ConnectionIncarnation, rx: Connection, tx: Connection,
               sentinel=None) -> None:
        """Start ``inc``'s sender and reader threads.  ``sentinel``: a handle that becomes ready
        when the worker's process ends, waited on beside the connection."""
        inc.conn = rx
        threading.Thread(target=self._sender, args=(tx, inc.send_q), daemon=True,
                         name=f"{self.name}-send-{inc.number}").start()
        threading.Thread(target=self._reader, args=(rx, inc, sentinel), daemon=True,
                         name=f"{self.name}-read-{inc.number}").start()

    def ended(self, inc: ConnectionIncarnation) -> str:
        """How ``inc`` ended, for the supervisor (called once its connection has closed)."""
        return "its connection closed"

    def send(self, msg) -> None:
        inc = self.inc
        if inc is not None:
            inc.send_q.put(msg)

    def probe(self, timeout: float) -> bool:
        token = next(TOKENS)
        answered = threading.Event()
        self._pongs[token] = answered
        try:
            self.send(Ping(token))
            return answered.wait(timeout)
        finally:
            self._pongs.pop(token, None)

    def hang_up(self, inc: ConnectionIncarnation | None) -> None:
        """Close ``inc``'s connection (its reader then reports the end) after a Shutdown."""
        if inc is not None:
            inc.send_q.put(Shutdown())
            inc.send_q.put(None)

    @staticmethod
    def _sender(conn: Connection, q: queue.SimpleQueue) -> None:
        while True:
            msg = q.get()
            if msg is None:
                break
            try:
                conn.send(msg)
            except (OSError, ValueError):
                break  # the worker is gone; the reader reports it
        try:
            conn.close()
        except OSError:
            pass

    def _reader(self, conn: Connection, inc: ConnectionIncarnation, sentinel) -> None:
        try:
            while True:
                try:
                    ready = wait([conn] if sentinel is None else [conn, sentinel])
                except (OSError, ValueError):
                    break  # closed under us: the sender hung up after a Shutdown
                if conn in ready:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError, TypeError):
                        break  # TypeError: the sender closed the connection mid-read
                    self._handle(msg, inc)
                    continue
                # The process ended: read what it sent before dying, then report.
                while True:
                    try:
                        if not conn.poll():
                            break
                        self._handle(conn.recv(), inc)
                    except (EOFError, OSError):
                        break
                break
        finally:
            try:
                conn.close()
            except OSError:
                pass
            inc.send_q.put(None)  # stops this incarnation's sender
            detail = self.ended(inc)
            if not inc.ready.is_set():
                inc.error = inc.error or f"{detail} while loading"
                inc.ready.set()
            self.sink.exited(self.index, inc.number,
                             detail if inc.error is None else f"loading failed: {inc.error}")

    def _handle(self, msg, inc: ConnectionIncarnation) -> None:
        kind = type(msg)
        if kind is Output or kind is RunFailed or kind is Done:
            self.sink.deliver(self.index, inc.number, msg)
        elif kind is Ready:
            self.pid, self.device, self.runtime = msg.pid, msg.device, msg.runtime
            if msg.node is not None:
                self.node = msg.node
            self.cores_awake = msg.cores_awake
            inc.ready.set()
        elif kind is StartFailed:
            inc.error = msg.error
            inc.ready.set()
        elif kind is Pong:
            answered = self._pongs.get(msg.token)
            if answered is not None:
                answered.set()

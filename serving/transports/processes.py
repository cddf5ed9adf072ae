"""Workers as processes of this machine (``--backend processes``): no GIL shared with the
gateway, at the price of pickling each input and output through a pipe.

Each worker is a spawned process (never forked: the gateway has threads) running the same
in-worker loop as a thread worker.  On the gateway's side a reader thread waits on the pipe *and*
the process's sentinel, so a death is noticed the moment it happens, and a sender thread writes
to the pipe, so a busy worker with a full pipe never blocks the event loop.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
from functools import partial
from typing import Sequence

from sensai.errors import SensaiError

from ..messages import (Done, Failure, Fault, LoadFailed, Output, Ping, Pong, Ready, Run, Shutdown,
                        Skip)
from ..worker_core import Stop, WorkerCore
from .base import TOKENS, Capabilities, Sink, WorkerHandle


def process_main(rx, tx, hosted: list, fault: Fault, seed: int) -> None:
    """Body of a worker process: build the runners, then serve messages until told to stop."""
    # Ctrl-C in a terminal reaches the whole process group; the gateway stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runners = {g: spec.build() for g, spec in hosted}
    except BaseException as e:  # say why, then end: the gateway decides what to do
        text = str(e) if isinstance(e, SensaiError) else f"{type(e).__name__}: {e}"
        try:
            tx.send(LoadFailed(text))
        finally:
            return
    core = WorkerCore(runners, delay=fault.delay, corrupt=fault.corrupt, seed=seed)
    lock = threading.Lock()

    def emit(event) -> None:
        with lock:
            tx.send(event)

    runs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=core.serve, args=(runs, emit), daemon=True).start()
    spec = hosted[0][1] if hosted else None
    emit(Ready(os.getpid(), spec.device if spec else "cpu",
               spec.resolved_runtime() if spec else None))
    try:
        while True:
            msg = rx.recv()
            if type(msg) is Run:
                runs.put(msg)
            elif type(msg) is Skip:
                core.skip(msg)
            elif type(msg) is Fault:
                core.fault(msg)
            elif type(msg) is Ping:
                runs.put(Stop(reply=partial(emit, Pong(msg.token))))
            elif type(msg) is Shutdown:
                break
            else:  # a bug on the predictor's side: die, so the supervisor sees it
                raise TypeError(f"unexpected message {type(msg).__name__} to a worker process")
    except (EOFError, OSError, KeyboardInterrupt):
        pass


class _Incarnation:
    def __init__(self, number: int):
        self.number = number
        self.process = None
        self.send_q: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.error: str | None = None


class ProcessWorker(WorkerHandle):
    transport = "processes"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inc: _Incarnation | None = None
        self._pongs: dict[int, threading.Event] = {}
        self.process = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        to_child_r, to_child_w = ctx.Pipe(duplex=False)
        from_child_r, from_child_w = ctx.Pipe(duplex=False)
        self.generation += 1
        inc = _Incarnation(self.generation)
        proc = ctx.Process(target=process_main, name=f"sensai-{self.name}", daemon=True,
                           args=(to_child_r, from_child_w, list(zip(self.groups, self.specs)),
                                 Fault(self.delay, self.corrupt),
                                 self.seed + 7919 * inc.number))
        proc.start()
        # Our copies of the child's ends: closing them lets EOF reach us when the child dies.
        to_child_r.close()
        from_child_w.close()
        inc.process = proc
        self.process = proc
        self.pid = proc.pid
        self._inc = inc
        threading.Thread(target=self._sender, args=(to_child_w, inc.send_q), daemon=True,
                         name=f"{self.name}-send-{inc.number}").start()
        threading.Thread(target=self._reader, args=(from_child_r, inc), daemon=True,
                         name=f"{self.name}-read-{inc.number}").start()

    def wait_ready(self, timeout: float) -> None:
        inc = self._inc
        if inc is None:
            raise SensaiError(f"{self.name} was never started")
        if not inc.ready.wait(timeout):
            raise SensaiError(f"{self.name} did not load its subnets within {timeout:g} s")
        if inc.error:
            raise SensaiError(f"{self.name}: {inc.error}")

    def send(self, msg) -> None:
        inc = self._inc
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

    def kill(self) -> int | None:
        proc = self.process
        if proc is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            return proc.pid
        return None

    def stop(self, timeout: float = 5.0) -> None:
        proc, inc = self.process, self._inc
        if inc is not None:
            inc.send_q.put(Shutdown())
            inc.send_q.put(None)
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)

    def exit_detail(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        if code is None:
            return ""
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    @staticmethod
    def _sender(conn, q: queue.SimpleQueue) -> None:
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

    def _reader(self, conn, inc: _Incarnation) -> None:
        from multiprocessing.connection import wait

        proc = inc.process
        try:
            while True:
                ready = wait([conn, proc.sentinel])
                if conn in ready:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        break
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
            proc.join(1.0)
            if not inc.ready.is_set():
                inc.error = inc.error or (f"its process died while loading "
                                          f"({self.exit_detail() or 'no exit code'})")
                inc.ready.set()
            self.sink.exited(self.index, inc.number,
                             f"its process died ({self.exit_detail() or 'no exit code'})"
                             if inc.error is None else f"loading failed: {inc.error}")

    def _handle(self, msg, inc: _Incarnation) -> None:
        kind = type(msg)
        if kind is Output or kind is Failure or kind is Done:
            self.sink.deliver(self.index, inc.number, msg)
        elif kind is Ready:
            self.pid, self.device, self.runtime = msg.pid, msg.device, msg.runtime
            inc.ready.set()
        elif kind is LoadFailed:
            inc.error = msg.error
            inc.ready.set()
        elif kind is Pong:
            answered = self._pongs.get(msg.token)
            if answered is not None:
                answered.set()


class Processes:
    """The process transport (``--backend processes``)."""

    name = "processes"
    capabilities = Capabilities(several_groups=True, skip=True, restart=True, kill=True)

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **faults
               ) -> ProcessWorker:
        return ProcessWorker(index, groups, specs, sink, **faults)

    def healthy(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"kind": "processes"}

    def close(self) -> None:
        pass

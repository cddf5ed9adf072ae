"""Workers as processes of this machine (``--backend processes``): no GIL shared with the
gateway, at the price of pickling each input and output through a pipe.

Each worker is a spawned process (never forked: the gateway has threads) running the same
in-worker loop as a thread worker, over the pipes of :mod:`.connection`.  The gateway's reader
thread waits on the pipe *and* the process's sentinel, so a death is noticed the moment it
happens.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Sequence

from sensai.errors import SensaiError

from ..core.messages import Batching, Fault, Ready, StartFailed
from ..workers.device_runner import build_device
from ..workers.loop import WorkerCore
from .base import Capabilities, Sink
from .connection import ConnectionIncarnation, ConnectionWorker, serve_connection


def process_main(rx, tx, hosted: list, fault: Fault, seed: int,
                 batching: Batching | None = None, cores: int = 1) -> None:
    """Body of a worker process: build the runners, then serve messages until told to stop."""
    # Ctrl-C in a terminal reaches the whole process group; the gateway stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = build_device(hosted, cores=cores)
    except BaseException as e:  # say why, then end: the gateway decides what to do
        text = str(e) if isinstance(e, SensaiError) else f"{type(e).__name__}: {e}"
        try:
            tx.send(StartFailed(text))
        finally:
            return
    spec = hosted[0][1] if hosted else None
    serve_connection(rx, tx, WorkerCore(device, delay=fault.delay, corrupt=fault.corrupt,
                                        seed=seed, batching=batching),
                     Ready(os.getpid(), spec.device if spec else "cpu", device.runtime))


class ProcessWorker(ConnectionWorker):
    transport = "processes"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.process = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        to_child_r, to_child_w = ctx.Pipe(duplex=False)
        from_child_r, from_child_w = ctx.Pipe(duplex=False)
        self.generation += 1
        inc = ConnectionIncarnation(self.generation)
        proc = ctx.Process(target=process_main, name=f"sensai-{self.name}", daemon=True,
                           args=(to_child_r, from_child_w, list(zip(self.groups, self.specs)),
                                 Fault(self.delay, self.corrupt),
                                 self.seed + 7919 * inc.number, self.batching, self.cores))
        proc.start()
        # Our copies of the child's ends: closing them lets EOF reach us when the child dies.
        to_child_r.close()
        from_child_w.close()
        self.process = proc
        self.pid = proc.pid
        self.inc = inc
        self.attach(inc, from_child_r, to_child_w, sentinel=proc.sentinel)

    def wait_ready(self, timeout: float) -> None:
        self.wait_loaded(self.inc, timeout)

    def ended(self, inc: ConnectionIncarnation) -> str:
        self.process.join(1.0)
        return f"its process died ({self.exit_detail() or 'no exit code'})"

    def kill(self) -> int | None:
        proc = self.process
        if proc is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            return proc.pid
        return None

    def stop(self, timeout: float = 5.0) -> None:
        proc = self.process
        self.hang_up(self.inc)
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


class Processes:
    """The process transport (``--backend processes``)."""

    name = "processes"
    capabilities = Capabilities()

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **options
               ) -> ProcessWorker:
        return ProcessWorker(index, groups, specs, sink, **options)

    def healthy(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"kind": "processes"}

    def close(self) -> None:
        pass

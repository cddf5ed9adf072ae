"""The gateway's long-lived heap, kept out of the garbage collector's way.

A gateway holds a large heap that lives as long as it does (torch, ONNX Runtime, the web stack,
the models) and, under load, promotes the objects of requests in flight to the oldest
generation often enough that CPython runs a full collection every few seconds.  Each one walks
the whole heap holding the GIL: the event loop and every worker thread stop for it, which shows
as a spike in tail latency, and it finds nothing there to free.

:func:`settle` collects once and then freezes what is alive (``gc.freeze``, as preforking
servers do before they fork, and Ray Serve for each replica it starts): later collections skip
it and walk only what was allocated since.  It runs on the event loop once the models are built
and again after every load or unload, unfreezing first so that the cycles of a model let go
are collected, not kept for good.  :class:`CollectorWatch` times every full collection into
the gateway's metrics, so an operator sees what the process lost to them.
"""

from __future__ import annotations

import gc
import time

OLDEST = 2  # CPython's generations are 0, 1 and 2: a collection of 2 walks the whole heap

# Seconds this process has spent in settle(): the admission's measure of the event loop's lag
# leaves them out (a collection run on purpose once is not an overload).
settled_s = 0.0


def settle() -> None:
    """Collect what is garbage now, then freeze everything alive (one full collection)."""
    global settled_s
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    settled_s += time.perf_counter() - t0


class CollectorWatch:
    """Times the collector's full collections of this process into ``histogram`` (seconds
    each), from ``gc.callbacks``; a collection never starts inside another, so one start time
    is enough."""

    def __init__(self, histogram) -> None:
        self.histogram = histogram
        self.t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != OLDEST:
            return
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.histogram.observe(time.perf_counter() - self.t0)

    def start(self) -> None:
        gc.callbacks.append(self)

    def stop(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

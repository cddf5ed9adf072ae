"""The gateway's long-lived heap, kept out of the garbage collector's way.

A gateway holds a large heap that lives as long as it does (torch, ONNX Runtime, the web stack,
the models) and, under load, promotes the objects of requests in flight to the oldest
generation often enough that CPython runs a full collection every few seconds.  Each one walks
the whole heap holding the GIL: the event loop and every worker thread stop for it, which shows
as a spike in tail latency, and it finds nothing there to free.

:func:`settle` collects once and then freezes what is alive (``gc.freeze``, as preforking
servers do before they fork): later collections skip it and walk only what was allocated
since.  It runs on the event loop once the models are warm and again after every load or
unload, unfreezing first so that the cycles of a model let go are collected, not kept for good.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what is garbage now, then freeze everything alive (one full collection)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()

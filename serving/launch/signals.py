"""SIGTERM and SIGINT for a server's main thread, as a supervisor sends them: the first asks for
a clean stop, later ones (``timeout`` and systemd signal the process and then its group) only
repeat it."""

from __future__ import annotations

import signal
import time


class StopSignals:
    """SIGTERM and SIGINT (this process's main thread), while in the ``with``: before
    :meth:`wait`, a ``KeyboardInterrupt`` (start-up is abandoned and cleaned up, as after
    Ctrl-C; ``received`` says which); from then on, what :meth:`wait` returns on; later ones
    ignored while stopping."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        # Plain flags, no lock: a handler runs on the main thread between any two bytecodes,
        # so a lock it shares with that thread (an Event's) can be held already - by an
        # earlier signal's handler, when SIGTERM comes twice - and it would wait forever.
        self.waiting = self.stopped = False
        self.received: int | None = None  # the first signal
        self.old: dict = {}

    def handler(self, signum, frame) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if self.waiting:
            self.stopped = True
        elif first:  # a later one would break off the clean-up the first one started
            raise KeyboardInterrupt

    def __enter__(self) -> "StopSignals":
        self.old = {s: signal.signal(s, self.handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def wait(self) -> None:
        self.waiting = True
        while not self.stopped:
            time.sleep(0.2)

"""Idle cores kept out of deep sleep while sensai serves: a PM QoS CPU latency request.

A class-parallel request wakes a sleeping worker on another core, and the last worker to finish
wakes the event loop, so how long an idle core takes to wake up is on every request's path.  Linux
lets a process ask that no core sleep deeper than a given wake-up latency for as long as it keeps
``/dev/cpu_dma_latency`` open with the limit written in it (the kernel's PM QoS interface, the
one tuned's ``latency-performance`` profile uses).  Closing the file withdraws the request, and
so does the process ending, however it ends: nothing is left behind.  With a limit of zero
(``LATENCY_US``) an idle core polls instead of halting; in a KVM guest the wake-up then no longer goes through the hypervisor.

What it costs: idle cores draw power (on a VM, the host keeps the vCPUs running; on bare metal
it eats into turbo headroom) while the request is held.  Idle time still counts as idle and every
runnable thread gets the core at once.  It changes the whole machine, not only this process, so
it is the operator's choice: ``off`` by default (deploy/README.md, "Latency"; the measured effect
is in BENCHMARKS.md).

Only root may open the file (or whoever the operator gave it to).  ``off`` never asks (nor opens
the file); ``auto`` holds the request when this process may and says in one line when it may
not; ``on`` refuses to start without it.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field

from sensai.errors import SensaiError

log = logging.getLogger(__name__)

DEVICE = "/dev/cpu_dma_latency"
MODES = ("auto", "on", "off")
LATENCY_US = 0  # an idle core polls: the cheapest wake-up there is


@dataclass
class CoresAwake:
    """One held (or refused, or not asked) request; :meth:`release` withdraws it."""

    mode: str
    held: bool
    detail: str
    fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.held = False

    def describe(self) -> dict:
        return {"mode": self.mode, "held": self.held, "latency_us": LATENCY_US if self.held
                else None, "detail": self.detail}

    def __enter__(self) -> "CoresAwake":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise SensaiError(f"keep_cores_awake must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def keep_cores_awake(mode: str = "off", device: str = DEVICE) -> CoresAwake:
    """Ask the kernel that no core sleep deeper than :data:`LATENCY_US` until the result is
    released.  ``on`` raises a one-line :class:`SensaiError` when it cannot; ``auto`` logs why
    and carries on."""
    check_mode(mode)
    if mode == "off":
        return CoresAwake(mode, False, "not asked: keep_cores_awake off")
    fd = None
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
        os.write(fd, struct.pack("=i", LATENCY_US))
    except OSError as e:
        if fd is not None:
            os.close(fd)
        why = f"cannot {'write' if fd is not None else 'open'} {device}: {e.strerror or e}"
        if mode == "on":
            raise SensaiError(f"cannot keep idle cores awake: {why} (it takes root, or access "
                              "to that file; or set keep_cores_awake to auto or off)") from None
        log.info("idle cores may sleep deeply between requests: %s (root only; see "
                 "deploy/README.md, 'Latency')", why)
        return CoresAwake(mode, False, why)
    log.info("idle cores kept awake while serving (%s: %d us; keep_cores_awake)", device,
             LATENCY_US)
    return CoresAwake(mode, True, f"{device}: {LATENCY_US} us", fd)


def current_limit_us(device: str = DEVICE) -> int | None:
    """The wake-up latency the kernel now grants every core (the strictest request held by any
    process), or None when this process may not read it."""
    try:
        with open(device, "rb") as f:
            raw = f.read(4)
    except OSError:
        return None
    return struct.unpack("=i", raw)[0] if len(raw) == 4 else None

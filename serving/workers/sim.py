"""A simulated GPU (``--runtime sim``): a runner that behaves as a small subnet on a GPU does, for
measuring and testing the serving path on machines without one.

On a GPU a small subnet's forward pass costs about one fixed launch whatever the rows of the
batch (up to a few hundred), the host thread that waits for it holds no interpreter lock, and
the subnets of one GPU run side by side on their own streams.  :class:`SimRunner` does the same:
:meth:`SimRunner.launch` stages the rows as the CUDA-graph runner does (one pass into a buffer of
its own), answers rows of the right shape that depend on each row's own input (its first values:
so the tests can tell whose rows came back to whom), and is done ``launch_ms`` after it was
launched, or after this runner's previous launch is done (one stream per runner).  As the
CUDA-graph runner's pinned buffers, its staging buffer is one: a launch made before the previous
one is read waits for that one first.
:func:`wait_sims` sleeps until the last of several launches is done: one wait per batch, in
``time.sleep``, which holds no interpreter lock.

Being a GPU's stand-in, every subnet of a server on the sim runtime shares one device process
when there are several gateway processes, as the subnets of one GPU do.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from sensai.errors import SensaiError

from ..core.settings import SIM_LAUNCH_MS


class SimLaunch:
    """One simulated launch: its output, ready at ``end`` (``time.perf_counter``)."""

    __slots__ = ("end", "out", "waited")

    def __init__(self, end: float, out: np.ndarray):
        self.end, self.out, self.waited = end, out, False

    def result(self) -> np.ndarray:
        if not self.waited:
            wait_sims((self,))
        return self.out


def wait_sims(launches: Sequence[SimLaunch]) -> None:
    """Sleep until every one of ``launches`` is done (once, for the last)."""
    waiting = [launch for launch in launches if not launch.waited]
    if not waiting:
        return
    left = max(launch.end for launch in waiting) - time.perf_counter()
    if left > 0:
        time.sleep(left)
    for launch in waiting:
        launch.waited = True


SimLaunch.waits = staticmethod(wait_sims)


class SimRunner:
    """A subnet on a simulated GPU (see the module's docstring): ``num_outputs`` scores per row
    of ``input_shape``, each launch done ``launch_ms`` after it started."""

    runtime = "sim"
    overlaps = True  # a launch returns at once; the device's time passes apart from the host's

    def __init__(self, *, input_shape: Sequence[int], num_outputs: int,
                 launch_ms: float = SIM_LAUNCH_MS, name: str = "sim", device: str = "cpu",
                 batch_rows: int = 1):
        if launch_ms < 0:
            raise SensaiError(f"a simulated launch takes >= 0 ms, not {launch_ms:g}")
        self.name, self.device = name, device
        self.input_shape = tuple(input_shape)
        self.num_outputs = max(1, int(num_outputs))
        self.launch_s = launch_ms / 1e3
        self.busy_until = 0.0
        self.launches = 0
        self.unread: SimLaunch | None = None  # holds the staging buffer until it is done
        self.staged = np.zeros((max(1, batch_rows), *self.input_shape), dtype=np.float32)

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.launch((x,)).result()

    def launch(self, parts: Sequence[np.ndarray]) -> SimLaunch:
        n = sum(len(p) for p in parts)
        for p in parts:
            if tuple(p.shape[1:]) != self.input_shape:
                raise ValueError(f"{self.name}: rows of shape {list(p.shape[1:])}, the subnet "
                                 f"takes {list(self.input_shape)}")
        if self.unread is not None and not self.unread.waited:
            wait_sims((self.unread,))
        if n > len(self.staged):
            self.staged = np.zeros((n, *self.input_shape), dtype=np.float32)
        staged = self.staged[:n]
        if len(parts) == 1:
            staged[:] = parts[0]
        else:
            np.concatenate(parts, out=staged)
        out = sim_scores(staged, self.num_outputs)
        now = time.perf_counter()
        self.launches += 1
        end = max(now, self.busy_until) + self.launch_s
        self.busy_until = end
        self.unread = SimLaunch(end, out)
        return self.unread


def sim_scores(x: np.ndarray, num_outputs: int) -> np.ndarray:
    """What :class:`SimRunner` answers for rows ``x`` (the tests' and benchmark's reference)."""
    flat = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
    out = np.zeros((len(x), num_outputs), dtype=np.float32)
    m = min(num_outputs, flat.shape[1])
    out[:, :m] = flat[:, :m]
    return out

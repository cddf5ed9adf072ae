"""A serving plan: what every worker of one predictor runs, and how, worked out once from the
settings and passed whole to whatever builds the workers.

:func:`class_parallel_plan` turns an artifact and
:class:`~sensai.serving.core.settings.GatewaySettings` into a :class:`ServingPlan`: the placement of
the groups on the workers (redundancy, vote), each worker's runner recipes on its device, its
injected faults, and the settings themselves, whole, for everything that is read as it is (deadline,
hedging, batching, restart delay, hang timeout).  The predictor, its pool and supervisor, the
launchers of every backend and the Ray Serve application read the same plan; nothing re-spells a
setting.  A benchmark baseline builds a plan of its own workers (one recipe each, no artifact).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Sequence

from sensai.artifact import Artifact
from sensai.errors import SensaiError
from sensai.models import device_for_worker

from ..core.faults import DelaySpec, Faults
from ..core.messages import Batching
from ..core.placement import Placement
from ..core.settings import CPU_BATCH_ROWS, GatewaySettings, default_batch_rows
from ..workers.runners import RunnerSpec, runner_specs

# How long a worker may take to load its subnets, and to answer a health probe after a restart.
LOAD_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerPlan:
    """One worker: its name, the groups it hosts (its own first, then its copies), a runner
    recipe per group on the worker's device, and the faults injected into it (tests,
    benchmark)."""

    name: str
    groups: tuple[int, ...]
    specs: tuple[RunnerSpec, ...]
    delay: DelaySpec | None = None
    corrupt: bool = False
    cores: int = 1  # the CPU cores its device's one call may use side by side


@dataclass(frozen=True)
class ServingPlan:
    """The workers of one predictor and the settings they run under.  ``placement``: where each
    group's copies live (class parallelism; None for a baseline's plain workers);
    ``watch_hangs``: whether this process restarts hung workers (not where the platform does,
    Serve); ``seed``: of the workers' fault samplers (worker ``w`` gets ``seed + w``)."""

    settings: GatewaySettings
    workers: tuple[WorkerPlan, ...]
    placement: Placement | None = None
    seed: int = 0
    watch_hangs: bool = True
    load_timeout_s: float = LOAD_TIMEOUT_S
    probe_timeout_s: float = PROBE_TIMEOUT_S
    batching: Batching = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        rows = s.batch_max_rows
        if rows is None:  # the default of the device the workers run on
            first = next((spec for wp in self.workers for spec in wp.specs), None)
            rows = (default_batch_rows(first.device, first.resolved_runtime()) if first
                    else CPU_BATCH_ROWS)
        object.__setattr__(self, "batching", Batching(rows, s.batch_delay_us))

    @property
    def hang_timeout_s(self) -> float | None:
        return self.settings.hang_timeout() if self.watch_hangs else None


def worker_count(settings: GatewaySettings, groups: int) -> int:
    """How many workers ``settings`` place ``groups`` subnets on: as set (``--workers 1``: one
    device running every subnet in one call), else one per group."""
    return settings.workers if settings.workers is not None else groups


def cpu_cores(workers: int) -> int:
    """The cores each of ``workers`` CPU devices of this host gets (an even cut)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


def worker_devices(workers: int, device: str) -> list[str]:
    """One device per worker, by :func:`~sensai.models.device_for_worker`: GPU ``w mod n`` with
    ``n`` GPUs (``auto`` or ``cuda``), else as asked."""
    return [str(device_for_worker(w, device)) for w in range(workers)]


def subnet_specs(artifact: Artifact, settings: GatewaySettings, *, device: str | None = None,
                 runtime: str | None = None) -> list[RunnerSpec]:
    """The runner recipe of every subnet as ``settings`` ask (``device`` / ``runtime``: what a
    backend fixes instead, e.g. the CPU where the worker picks its own device)."""
    return runner_specs(artifact, device=device or settings.device,
                        runtime=runtime or settings.runtime_kind, threads=settings.threads_per_worker,
                        trust_code=settings.trust_model_code, batch_rows=settings.batch_max_rows,
                        gpu_wait=settings.gpu_wait, sim_launch_ms=settings.sim_launch_ms)


def class_parallel_plan(artifact: Artifact, settings: GatewaySettings, *,
                        specs: Sequence[RunnerSpec] | None = None, own_devices: bool = True,
                        faults: Faults | None = None, seed: int = 0,
                        watch_hangs: bool = True) -> ServingPlan:
    """The plan of ``artifact``'s class-parallel workers under ``settings``: ``workers``
    (default :func:`worker_count`) workers, each a device computing its groups in one call, each group on ``redundancy + 1`` of them (``2r + 1`` in vote mode).
    ``specs``: the subnets' recipes (default :func:`subnet_specs`); ``own_devices``: each
    worker on a device of its own (:func:`worker_devices`), else on its recipes' (a Ray worker
    picks its own); ``faults``: injected per worker."""
    s = settings
    specs = list(specs) if specs is not None else subnet_specs(artifact, s)
    placement = Placement.cyclic(len(specs), worker_count(s, len(specs)), s.redundancy, s.vote)
    n = len(placement.workers)
    faults = faults or Faults()
    faults.check(n)
    devices = worker_devices(n, s.device) if own_devices else None
    chosen = [devices[w] if devices else specs[hosted[0]].device
              for w, hosted in enumerate(placement.workers)]
    cores = cpu_cores(sum(1 for d in chosen if d == "cpu"))
    workers = []
    for w, hosted in enumerate(placement.workers):
        dev = chosen[w]
        workers.append(WorkerPlan(f"worker_{w:02d}", tuple(hosted),
                                  tuple(replace(specs[g], device=dev) for g in hosted),
                                  faults.delays.get(w), w in faults.corrupt,
                                  cores if dev == "cpu" else 1))
    return ServingPlan(s, tuple(workers), placement, seed=seed, watch_hangs=watch_hangs)


def plain_plan(settings: GatewaySettings, named_specs: Sequence[tuple[str, object]]
               ) -> ServingPlan:
    """A plan of plain workers, one recipe each (``(name, spec)``; a worker hosts it as group
    0): the benchmark's baselines."""
    if not named_specs:
        raise SensaiError("a plan needs at least one worker")
    return ServingPlan(settings, tuple(WorkerPlan(name, (0,), (spec,))
                                       for name, spec in named_specs))

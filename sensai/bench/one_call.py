"""The one-call reference: every subnet of an artifact in one device call, in process, nothing
else running - the compute alone that class parallel's fan-out is measured against.

It is :func:`~sensai.serving.workers.device_runner.build_device` of all the subnets on the
first device the run asks for (the CPU with every usable core as its intra-op threads, or
GPU 0), called image by image: what a served request's device call costs without a gateway,
a queue or a transport around it.  ``sensai bench`` reports it beside class parallel's
latencies, ``bench-load --sweep`` beside its table; the gap between it and a served image is
the serving's own cost.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from sensai.artifact import Artifact
from sensai.models import device_for_worker
from sensai.serving.core.settings import SIM_LAUNCH_MS
from sensai.serving.workers.device_runner import build_device
from sensai.serving.workers.runners import runner_specs

from .harness import model_code_trusted
from .stats import summarize

CALLS = 200  # images timed (cycling through the run's images), after WARMUP untimed
WARMUP = 20


def one_call_reference(artifact: Artifact, xs: Sequence[np.ndarray], *, device: str,
                       runtime: str, threads: int = 1, sim_launch_ms: float = SIM_LAUNCH_MS,
                       cores: int | None = None, calls: int = CALLS) -> dict[str, Any]:
    """Every subnet of ``artifact`` as one device, timed one image at a time on ``xs``: its
    kind and runtime, the device, the cores it was given and the call's latency summary (and,
    on CUDA graphs, the one graph's replay)."""
    first = str(device_for_worker(0, device))
    specs = [replace(s, device=first)
             for s in runner_specs(artifact, device=first, runtime=runtime, threads=threads,
                                   sim_launch_ms=sim_launch_ms, trust_code=model_code_trusted())]
    cores = cores or len(os.sched_getaffinity(0))
    one = build_device(list(enumerate(specs)), cores=cores if first == "cpu" else 1)
    times = []
    for i in range(WARMUP + calls):
        x = xs[i % len(xs)]
        x = x[None] if x.ndim == len(specs[0].input_shape) else x
        t0 = time.perf_counter()
        one.run(x)
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {"what": "every subnet in one device call, in process",
                           **one.describe(), "subnets": len(specs),
                           "cores": cores if first == "cpu" else None, "ms": summarize(times)}
    runner = getattr(one, "runner", None)
    if hasattr(runner, "replay_ms"):  # one captured graph holding every subnet
        out["graph_replay_ms"] = round(runner.replay_ms(200), 4)
    return out

"""How many CPU cores this process may really use: the fewest of the affinity mask and, in a
container, the cgroup's CPU quota (a pod limited to 2 CPUs on a 64-core host sees 64 in
``os.cpu_count()``).  Sizes the gateway's decode slots, the retraining workers and the
benchmark's machine description alike."""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup may use (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``); None: no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)

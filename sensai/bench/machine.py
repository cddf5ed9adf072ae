"""The machine a benchmark ran on, and the memory a strategy takes while it loads.

:func:`machine_description` records what the figures must be read against (CPU, cores, GPUs,
how idle cores sleep, library versions, load).  :class:`MemoryProbe` measures one strategy: the
growth of this process's resident set and of its peak (Linux: the kernel's peak mark is reset
first), and on GPUs the growth of torch's peak allocation and of the device's memory in use.
Workers that are threads of this process share its resident set, so memory is attributed per
strategy, not per worker.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import resource
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Sequence

import onnxruntime as ort
import torch

from sensai.cores import usable_cores
from sensai.errors import SensaiError

log = logging.getLogger(__name__)

VERSIONED = ("torch", "onnxruntime", "numpy", "ray", "fastapi", "uvicorn", "httpx", "onnx",
             "sensai")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _cpu() -> tuple[str | None, int | None]:
    cpu_model, physical, phys_id = None, set(), None
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and cpu_model is None:
            cpu_model = value
        elif key == "physical id":
            phys_id = value
        elif key == "core id":
            physical.add((phys_id, value))
    return cpu_model or platform.processor() or platform.machine() or None, len(physical) or None


def _gpus() -> tuple[list[dict], str | None]:
    try:
        if not torch.cuda.is_available():
            return [], None
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name,
                         "memory_gb": round(p.total_memory / 1024 ** 3, 1)})
        return gpus, torch.version.cuda
    except Exception as e:  # a broken CUDA install should not stop a CPU benchmark
        log.warning("cannot query GPUs: %s", e)
        return [], None


def cpu_idle(sysfs: str = "/sys") -> dict[str, Any] | None:
    """How this machine's idle cores sleep (Linux cpuidle), or None where it does not say.

    A class-parallel request wakes its sleeping workers, and the last of them wakes the event
    loop; each wake-up of an idle core pays that core's way out of its idle state.  Under a
    hypervisor's ``haltpoll`` driver an idle core first polls for up to ``guest_halt_poll_ns``
    (the kernel's default: 200000) before it halts, and a halted core is woken through the
    hypervisor: with 0 every wake-up goes that way (its effect: BENCHMARKS.md)."""
    base = Path(sysfs, "devices/system/cpu/cpuidle")
    driver = _read(str(base / "current_driver"))
    if driver is None:
        return None
    governor = _read(str(base / "current_governor_ro")) or _read(str(base / "current_governor"))
    poll = (_read(str(Path(sysfs, "module/haltpoll/parameters/guest_halt_poll_ns"))) or "").strip()
    return {"driver": driver.strip(), "governor": governor.strip() if governor else None,
            "guest_halt_poll_ns": int(poll) if poll.isdigit() else None}


def machine_description() -> dict[str, Any]:
    """CPU model and cores, memory, GPUs, idle policy, library versions, load - to read the
    figures against."""
    cpu_model, physical = _cpu()
    mem_total = _size("/proc/meminfo", "MemTotal")
    gpus, cuda = _gpus()
    versions = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    try:
        providers = ort.get_available_providers()
    except Exception:
        providers = []
    return {"cpu_model": cpu_model, "logical_cores": os.cpu_count(), "physical_cores": physical,
            "usable_cores": usable_cores(), "gpus": gpus, "cuda": cuda,
            "memory_gb": None if mem_total is None else round(mem_total / 1024 ** 3, 1),
            "onnxruntime_providers": providers,
            "os": f"{platform.system()} {platform.release()}", "cpu_idle": cpu_idle(),
            "load_average": load_average(),
            "versions": versions}


def _size(path: str, field: str) -> int | None:
    """A size in bytes from a ``Field: N kB`` file of ``/proc`` (``/proc/<pid>/status``,
    ``/proc/meminfo``; Linux), or None where it cannot be read (the process is gone)."""
    for line in (_read(path) or "").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def process_rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set (``VmRSS``) of process ``pid`` (default: this one), or None when it is
    gone."""
    return _size(f"/proc/{pid}/status", "VmRSS")


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``stat`` file of ``/proc`` after ``comm`` (which may hold spaces and
    parentheses): state, ppid, ...; None when it is gone."""
    stat = _read(path)
    return stat.rpartition(")")[2].split() if stat else None


def _stat_cpu_seconds(path: str) -> float | None:
    """User plus system CPU seconds from a ``stat`` file of ``/proc``, None when it is gone."""
    fields = _stat_fields(path)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf(
        "SC_CLK_TCK")


def machine_cpu_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot, summed over its cores, from
    ``/proc/stat``; None where it cannot be read.  Busy: user, nice, system, irq and softirq
    time, not idle, iowait or steal (a hypervisor's other guests)."""
    fields = (_read("/proc/stat") or "").split("\n", 1)[0].split()[1:8]
    ticks = [int(v) for v in fields if v.isdigit()]
    if len(ticks) < 7:
        return None
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int | None) -> tuple[float, dict[int, float]] | None:
    """CPU seconds of process ``pid`` so far (threads that ended included), and of each of its
    live threads by thread id (Linux); None when it is gone."""
    total = None if pid is None else _stat_cpu_seconds(f"/proc/{pid}/stat")
    if total is None:
        return None
    threads = {}
    for entry in Path(f"/proc/{pid}/task").glob("*"):
        cpu = _stat_cpu_seconds(f"{entry}/stat")
        if cpu is not None:  # else the thread ended meanwhile
            threads[int(entry.name)] = cpu
    return total, threads


def descendant_pids(pid: int) -> list[int]:
    """The processes below ``pid`` - children, their children, ... - from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        fields = _stat_fields(f"{entry}/stat") if entry.name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_rss(pid: int | None, read: dict[int, int] | None = None) -> tuple[int, int]:
    """The resident sets of process ``pid`` and every live process below it, summed in bytes,
    and how many of them are live.  Pages two processes share count twice: an upper bound of
    what the tree holds.  ``read``: resident sets read already, by pid, used as they are (read
    again, a process's figure would be another instant's: the tree could come out smaller than
    one of its own processes)."""
    if pid is None:
        return 0, 0
    read = read or {}
    rss = [r for p in [pid, *descendant_pids(pid)]
           if (r := read[p] if p in read else process_rss_bytes(p)) is not None]
    return sum(rss), len(rss)


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """Peak resident set (``VmHWM``) of process ``pid`` (default: this one) since the last
    :func:`reset_peak_rss` or since it started; None when it is gone."""
    peak = _size(f"/proc/{pid}/status", "VmHWM")
    if peak is not None or pid != "self":
        return peak
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset the kernel's peak-RSS mark of process ``pid`` (Linux >= 4.0, the same user);
    False where that is not possible."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """``with MemoryProbe(devices) as probe: <load a strategy>``, then ``probe.figures``: the
    growth of this process's resident set and of its peak, and per CUDA device of ``devices``
    (none: no GPU figures) ``torch_peak_mb``, the growth of torch's peak allocation over its
    allocation at the start, and ``device_used_mb``, the growth of the memory in use on the
    whole device (``cudaMemGetInfo``, which also sees ONNX Runtime's allocations)."""

    def __init__(self, devices: Sequence[str] = ()):
        self.devices = sorted({str(d) for d in devices if str(d).startswith("cuda")})
        self.figures: dict[str, Any] = {}

    def _cuda(self, reset: bool = False) -> dict[str, tuple[int, int, int]]:
        """Per device: torch's allocation, its peak, the device's memory in use."""
        out = {}
        for d in self.devices:
            dev = torch.device(d)
            torch.cuda.synchronize(dev)
            if reset:
                torch.cuda.reset_peak_memory_stats(dev)
            free, total = torch.cuda.mem_get_info(dev)
            out[d] = (torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev),
                      total - free)
        return out

    def __enter__(self) -> "MemoryProbe":
        gc.collect()
        self._peak_reset = reset_peak_rss()
        self._cuda0 = self._cuda(reset=True)
        self._rss0 = process_rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        rss0, rss1, peak = self._rss0, process_rss_bytes(), peak_rss_bytes()
        cuda = {}
        for d, (_, peak_alloc, used) in (self._cuda() if exc[0] is None else {}).items():
            alloc0, _, used0 = self._cuda0[d]
            cuda[d] = {"torch_peak_mb": round((peak_alloc - alloc0) / 1e6, 2),
                       "device_used_mb": round((used - used0) / 1e6, 2)}
        self.figures = {
            "rss_growth_mb": round((rss1 - rss0) / 1e6, 2) if rss0 and rss1 else None,
            "peak_rss_growth_mb": (round((peak - rss0) / 1e6, 2)
                                   if rss0 and self._peak_reset else None),
            "process_peak_rss_mb": round(peak / 1e6, 1),
            "peak_scope": ("since this strategy started loading" if self._peak_reset
                           else "process lifetime (peak reset unavailable)"),
            "cuda": cuda,
        }


def split_cores(client_cores: int) -> tuple[list[int] | None, list[int] | None]:
    """The cores this process may use split in two: the server's (all but the last
    ``client_cores``) and the clients' (those); (None, None) for 0 (nobody pinned)."""
    if client_cores == 0:
        return None, None
    usable = sorted(os.sched_getaffinity(0))
    if not 0 < client_cores < len(usable):
        raise SensaiError(f"--set client_cores={client_cores}: must be between 1 and "
                          f"{len(usable) - 1} (this process may use {len(usable)} cores), or 0")
    return usable[:-client_cores], usable[-client_cores:]

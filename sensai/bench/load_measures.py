"""What a load phase is measured by: the gateway's RSS over time, the clients' records merged
into counts, latencies and a timeline, the gateway's own ``/metrics`` before and after, and its
health afterwards."""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from typing import Any, Sequence

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from .client import HttpClientProcess
from .machine import (descendant_pids, machine_cpu_seconds, process_cpu_seconds,
                      process_rss_bytes, tree_rss)
from .server import served
from .stats import summarize

PREDICT_ROUTE = "/v1/predict"
LAST_WINDOW_S = 60.0  # the soak's end, compared with its start


class RssSampler:
    """The gateway's RSS over time: ``t`` in seconds since ``t0`` (the gateway ready), the
    phase, the resident set of process ``pid`` (the one serving the routes), and of process
    ``tree_of`` (default: ``pid``; ``sensai serve``) with its descendant processes (device
    processes, other gateway processes; a local Ray instance), in MB (10^6 bytes)."""

    def __init__(self, pid: int | None, t0: float, period_s: float, *,
                 tree_of: int | None = None):
        self.pid, self.t0, self.period_s = pid, t0, period_s
        self.tree_of = tree_of or pid
        self.samples: list[dict[str, Any]] = []
        self.next_due = t0

    def due(self) -> bool:
        return time.monotonic() >= self.next_due

    def sample(self, phase: str) -> dict[str, Any] | None:
        now = time.monotonic()
        t = round(now - self.t0, 3)
        if self.samples and t <= self.samples[-1]["t"]:
            return self.samples[-1]
        rss = process_rss_bytes(self.pid)
        if rss is None:
            return None
        tree, processes = tree_rss(self.tree_of, {self.pid: rss})
        s = {"t": t, "phase": phase, "rss_mb": round(rss / 1e6, 2),
             "tree_rss_mb": round(tree / 1e6, 2), "processes": processes}
        self.samples.append(s)
        self.next_due = now + self.period_s
        return s


def gpu_busy(text: str) -> dict[str, Any]:
    """nvidia-smi's utilization.gpu samples (one percentage a line, one line per GPU per
    sample): how many, their mean and maximum."""
    values = []
    for line in text.splitlines():
        try:
            values.append(float(line.rsplit(",", 1)[-1].strip().rstrip("%").strip()))
        except ValueError:
            continue  # [N/A], a header, a message
    if not values:
        return {"samples": 0, "mean_pct": None, "max_pct": None}
    return {"samples": len(values), "mean_pct": round(sum(values) / len(values), 1),
            "max_pct": max(values)}


class GpuSampler:
    """The GPU's busy share over a phase: nvidia-smi sampling every ``period_ms`` between
    :meth:`start` and :meth:`stop` (None where there is no nvidia-smi)."""

    def __init__(self, period_ms: int = 200):
        self.period_ms = period_ms
        self.exe = shutil.which("nvidia-smi")
        self.proc: subprocess.Popen | None = None
        self.file = None

    def start(self) -> None:
        if self.exe is None:
            return
        self.file = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen(
                [self.exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", str(self.period_ms)], stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None

    def stop(self) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self.file.seek(0)
        text = self.file.read()
        self.file.close()
        return gpu_busy(text)


def cores(cpu_s: float, seconds: float) -> float:
    """CPU seconds used over ``seconds``: the cores they kept busy on average."""
    return round(cpu_s / seconds, 3)


def used_since(before: dict, after: dict) -> list[float]:
    """Each process's or thread's CPU seconds between two readings by key (one that started
    meanwhile counts from zero)."""
    return [cpu - before.get(key, 0.0) for key, cpu in after.items()]


def busy_cores(before: float | None, seconds: float) -> float | None:
    """Cores the machine kept busy on average since ``before`` (a :func:`machine_cpu_seconds`)
    over ``seconds``."""
    after = machine_cpu_seconds()
    if before is None or after is None or seconds <= 0:
        return None
    return cores(after - before, seconds)


def process_cores(before: tuple[float, dict[int, float]] | None,
                  after: tuple[float, dict[int, float]] | None,
                  seconds: float) -> dict[str, float] | None:
    """A process's cores over a phase (two :func:`~.machine.process_cpu_seconds`): all its
    threads', and its busiest thread's.  The busiest is the gateway's event loop under load,
    and one thread can use at most one core: a busiest thread near 1.0 is a ceiling more cores
    cannot lift."""
    if before is None or after is None or seconds <= 0:
        return None
    used = used_since(before[1], after[1])
    # The process's figure and its threads' are read one after the other, a clock tick may
    # fall between: never less than its live threads' sum (which holds the busiest).
    process = max(after[0] - before[0], sum(used))
    return {"process_cores": cores(process, seconds),
            "busiest_thread_cores": cores(max(used, default=0.0), seconds)}


def worker_pids(url: str) -> set[int]:
    """The processes of the gateway's subnet workers, as ``GET /v1/models`` reports them:
    device processes (``--backend processes``, several gateway processes), worker processes (a
    model repository on the processes backend); none where the workers are threads of the
    gateway."""
    info = served(url)
    gateway = info.get("pid")
    workers = (info.get("predictor") or {}).get("workers") or []
    return {w["pid"] for w in workers if isinstance(w.get("pid"), int) and w["pid"] != gateway}


def server_cpu(tree_of: int | None, workers: set[int]) -> dict[str, dict]:
    """CPU seconds so far of every process of the server under ``tree_of`` (``sensai serve``),
    split into its subnet ``workers`` and the ``rest`` (gateway processes, and the parent that
    watches them), and of each of their threads (``workers_threads``, ``rest_threads``, by
    (pid, thread id))."""
    out: dict[str, dict] = {"rest": {}, "workers": {}, "rest_threads": {}, "workers_threads": {}}
    if tree_of is None:
        return out
    for pid in [tree_of, *descendant_pids(tree_of)]:
        got = process_cpu_seconds(pid)
        if got is not None:
            part = "workers" if pid in workers else "rest"
            out[part][pid] = got[0]
            out[f"{part}_threads"].update(((pid, tid), cpu) for tid, cpu in got[1].items())
    return out


def server_split(before: dict[str, dict], after: dict[str, dict], seconds: float,
                 answers_per_s: float) -> dict[str, Any] | None:
    """The server's cores over a phase, split as :func:`server_cpu` splits them: each part's
    CPU milliseconds per answer (a process that started during the phase counts from zero), and
    its busiest thread's cores - a device process's computing thread or a gateway's event loop
    near 1.0 is a ceiling more processes of the other kind cannot lift."""
    if seconds <= 0 or not after["rest"]:
        return None
    out: dict[str, Any] = {}
    for part, name in (("rest", "gateway"), ("workers", "workers")):
        used = sum(used_since(before[part], after[part]))
        out[f"{name}_processes"] = len(after[part])
        out[f"{name}_cores"] = cores(used, seconds)
        out[f"{name}_ms_per_answer"] = (round(used * 1e3 / (answers_per_s * seconds), 3)
                                        if answers_per_s > 0 else None)
        threads = used_since(before.get(f"{part}_threads", {}),
                             after.get(f"{part}_threads", {}))
        out[f"{name}_busiest_thread_cores"] = cores(max(threads), seconds) if threads else None
    return out


def columns(outs: Sequence[dict[str, Any]], t0: float) -> dict[str, np.ndarray]:
    """The clients' records of one phase (:func:`.client.load_phase`) merged into arrays: ``t``
    (s since ``t0``), ``ms``, ``status``; with ``answers``, also ``version`` (str, "" where no
    answer named one), ``image`` and ``index`` (-1 where there was no 200 answer)."""
    def cat(key: str, dtype) -> np.ndarray:
        return np.concatenate([np.asarray(o[key], dtype=dtype) for o in outs]) if outs \
            else np.zeros(0, dtype=dtype)

    out = {"t": cat("t", np.float64) - t0, "ms": cat("ms", np.float64),
           "status": cat("status", np.int64)}
    if outs and "version" in outs[0]:
        out |= {"version": np.asarray([v or "" for o in outs for v in o["version"]],
                                      dtype=object),
                "image": cat("image", np.int64),
                "index": np.asarray([-1 if i is None else i for o in outs for i in o["index"]],
                                    dtype=np.int64)}
    return out


def code_counts(status: np.ndarray) -> dict[str, int]:
    """How many requests got each status code (0: no answer), in code order."""
    return {str(k): v for k, v in sorted(Counter(int(s) for s in status).items())}


def timeline(t: np.ndarray, ms: np.ndarray, status: np.ndarray, start: float, span: float,
              bin_s: float) -> list[dict[str, Any]]:
    """The phase in bins of ``bin_s`` from ``start``: requests sent (by when they were sent, or
    due), and answers (by when they came back): status codes, 200s per second, p50/p99 of the
    200s."""
    bins = []
    n_bins = max(1, round(span / bin_s))  # the last bin takes the remainder: up to 1.5 bins

    def bin_of(x: np.ndarray) -> np.ndarray:
        return np.clip(((x - start) // bin_s).astype(int), 0, n_bins - 1)

    sent, back = bin_of(t), bin_of(t + ms / 1e3)
    for b in range(n_bins):
        sel = back == b
        width = bin_s if b < n_bins - 1 else max(span - b * bin_s, 1e-3)
        ok = sel & (status == 200)
        p50, p99 = (np.percentile(ms[ok], [50, 99]) if ok.any() else (None, None))
        bins.append({"t": round(start + b * bin_s, 3), "seconds": round(width, 3),
                     "sent": int((sent == b).sum()), "answered": int(sel.sum()),
                     "ok_per_s": round(int(ok.sum()) / width, 2),
                     "status_counts": code_counts(status[sel]),
                     "p50_ok_ms": None if p50 is None else round(float(p50), 3),
                     "p99_ok_ms": None if p99 is None else round(float(p99), 3)})
    return bins


def phase_report(outs: list[dict[str, Any]], *, t0: float, bin_s: float) -> dict[str, Any]:
    """What the clients recorded in one phase, merged: counts, throughput, latencies, the
    timeline (``t`` in seconds since ``t0``)."""
    req = columns(outs, t0)
    t, ms, status = req["t"], req["ms"], req["status"]
    start = min(o["t0"] for o in outs) - t0
    wall = max(o["t0"] + o["seconds"] for o in outs) - t0 - start
    ok, no_answer = status == 200, int((status == 0).sum())
    failures: Counter = Counter()
    for o in outs:
        failures.update(o["failures"])
    n, client_cpu_s = int(len(status)), sum(o.get("cpu_s", 0.0) for o in outs)
    return {
        "start_s": round(start, 3), "seconds": round(wall, 3), "requests": n,
        "status_counts": code_counts(status),
        "ok": int(ok.sum()), "errors": n - int(ok.sum()),
        "not_200_or_503": int(((status != 200) & (status != 503)).sum()),
        "no_answer": no_answer, "failures": dict(failures),
        "wrong": sum(o["wrong"] for o in outs),
        "throughput_rps": round(int(ok.sum()) / wall, 2) if wall > 0 else None,
        # The client processes' own CPU (they share the machine with the server).
        "client_cpu_s": round(client_cpu_s, 3),
        "client_cores": cores(client_cpu_s, wall) if wall > 0 else None,
        "answers_per_s": round((n - no_answer) / wall, 2) if wall > 0 else None,
        "latency_ms": summarize(ms.tolist()),
        "latency_ok_ms": summarize(ms[ok].tolist()),
        "latency_rejected_ms": summarize(ms[status == 503].tolist()),
        "timeline": timeline(t, ms, status, start, wall, bin_s),
    }


def scrape_metrics(url: str) -> dict[str, Any] | None:
    """From the gateway's ``/metrics``: POST requests by status, and the latency histogram of
    ``/v1/predict`` as the gateway measures it (from when its middleware sees a request)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    statuses: Counter = Counter()
    rejected: Counter = Counter()
    buckets: dict[float, float] = {}
    gc_full = {"collections": 0.0, "seconds": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sensai_gc_full_collection_seconds_count":
                gc_full["collections"] = s.value
            elif s.name == "sensai_gc_full_collection_seconds_sum":
                gc_full["seconds"] = s.value
            elif s.name == "sensai_requests_total" and s.labels.get("method") == "POST":
                statuses[s.labels["status"]] += int(s.value)
            elif s.name == "sensai_rejected_total":
                rejected[s.labels.get("reason", "")] += int(s.value)
            elif (s.name == "sensai_request_seconds_bucket"
                  and s.labels.get("route") == PREDICT_ROUTE):
                buckets[float(s.labels["le"])] = s.value
    return {"status": statuses, "rejected": rejected, "buckets": buckets, "gc_full": gc_full}


def server_view(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """The gateway's own count of a phase's requests by status (``sensai_requests_total``,
    which leaves out the requests turned away on arrival at ``max_requests``), of the requests
    it turned away (``sensai_rejected_total`` by reason: on arrival or after waiting for the
    predictor), the histogram bucket its p50/p99 of ``/v1/predict`` fall in (``<=`` that
    many ms), and the collector's full collections in the gateway's process meanwhile."""
    if before is None or after is None:
        return None
    codes = after["status"] - before["status"]
    rejected = after["rejected"] - before["rejected"]
    les = sorted(after["buckets"])
    counts = np.array([after["buckets"][le] - before["buckets"].get(le, 0.0) for le in les])
    total = counts[-1] if len(counts) else 0.0

    def at_most(q: float) -> float | None:
        if not total:
            return None
        le = les[int(np.searchsorted(counts, q * total))]
        return None if math.isinf(le) else round(le * 1e3, 3)

    return {"status_counts": {k: v for k, v in sorted(codes.items())},
            "rejected": dict(sorted(rejected.items())),
            "predict_requests": int(total),
            "predict_latency_ms_at_most": {"p50": at_most(0.5), "p99": at_most(0.99)},
            "gc_full": {"collections": int(after["gc_full"]["collections"]
                                           - before["gc_full"]["collections"]),
                        "paused_ms": round(1e3 * (after["gc_full"]["seconds"]
                                                  - before["gc_full"]["seconds"]), 1)}}


def rss_growth(samples: Sequence[dict], phase: str, key: str,
               window_s: float = LAST_WINDOW_S) -> dict[str, Any] | None:
    """The phase's first sample (after warm-up) against the mean of its last ``window_s``
    seconds; also its maximum, its last sample and a least-squares slope."""
    sel = [s for s in samples if s["phase"] == phase]
    if not sel:
        return None
    base, end = sel[0], sel[-1]
    last = [s for s in sel if s["t"] >= end["t"] - window_s]
    final = float(np.mean([s[key] for s in last]))
    t = np.array([s["t"] for s in sel])
    v = np.array([s[key] for s in sel])
    slope = (float(np.polyfit(t, v, 1)[0]) * 60.0
             if len(sel) >= 3 and np.ptp(t) > 0 else None)
    return {"baseline_mb": base[key], "baseline_t": base["t"],
            "last_window_s": round(min(window_s, end["t"] - base["t"]), 1),
            "last_window_samples": len(last), "last_window_mean_mb": round(final, 2),
            "last_mb": end[key], "max_mb": float(v.max()),
            "growth_mb": round(final - base[key], 2),
            "growth_pct": round((final - base[key]) / base[key] * 100, 3),
            "slope_mb_per_min": None if slope is None else round(slope, 3),
            "samples": len(sel)}


def check_health(url: str, client: HttpClientProcess, expected: Sequence[int],
                 n_images: int) -> dict[str, Any]:
    """``/v2/health/ready`` and ``n_images`` sequential predictions against offline top-1."""
    out: dict[str, Any] = {"ready_status": None, "predictions": 0, "correct": 0, "error": None}
    try:
        out["ready_status"] = httpx.get(f"{url}/v2/health/ready", timeout=10.0).status_code
    except httpx.HTTPError as e:
        out["error"] = f"/v2/health/ready: {type(e).__name__}: {e}"
    try:
        answers = client.timed("http", url, "sensai", range(n_images))
        out["predictions"] = len(answers)
        out["correct"] = sum(int(a[1] == expected[j]) for j, a in enumerate(answers))
    except (RuntimeError, TimeoutError, EOFError, OSError) as e:
        out["error"] = out["error"] or str(e)
    out["healthy"] = (out["ready_status"] == 200 and out["predictions"] == n_images
                      and out["correct"] == n_images)
    return out

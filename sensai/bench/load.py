"""``sensai bench-load``'s run loop, which the soak, the sweep (:mod:`.load_run`), ``sensai
plan`` and ``sensai bench-swap`` drive: the gateway's settings from the options, ``sensai serve
ART`` in a process of its own (:class:`~.server.SensaiServe`, so its resident set is its own),
the client processes (:mod:`.client`) sending real test images, every 200 answer checked
against offline evaluation's top-1, and :class:`LoadRun`, one method per kind of phase: a closed
loop, an open-loop overload (requests leave when due whatever the answers, latency counts from
when a request was due, a new connection is opened whenever all are busy, so the client does
not limit the requests in flight), the health afterwards, a burst of the largest legal image for
the peak memory; the gateway's RSS sampled throughout.
"""

from __future__ import annotations

import io
import math
import resource
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from PIL import Image
from pydantic import ValidationError

from sensai.errors import SensaiError
from sensai.serving.core.settings import BACKENDS, GatewaySettings, check_backend
from sensai.serving.gateway.imaging import decode_image

from .client import HttpClientProcess
from .harness import offline_reference, progress_bar
from .load_measures import (GpuSampler, RssSampler, busy_cores, check_health, phase_report,
                            process_cores, scrape_metrics, server_cpu, server_split, server_view,
                            worker_pids)
from .machine import (machine_cpu_seconds, peak_rss_bytes, process_cpu_seconds,
                      process_rss_bytes, reset_peak_rss, split_cores)
from .options import BenchData, LoadOptions
from .server import SensaiServe, Server, sigterm_as_exit, start_server
from .stats import summarize

HEALTH_IMAGES = 20  # predictions checked after the overload
RECOVERY_S = 30.0  # how long an unhealthy gateway is given to recover after the overload
# Settings the benchmark sets itself (--backend, the deadline, the address).
OWN_SETTINGS = ("SENSAI_HOST", "SENSAI_PORT", "SENSAI_BACKEND", "SENSAI_DEADLINE_S")


# --------------------------------------------------------------------------------------------
# Arguments


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``["SENSAI_MAX_PREDICTIONS=8", ...]`` -> a dict; each must name a gateway setting."""
    env = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise SensaiError(f"--env wants NAME=VALUE (e.g. SENSAI_MAX_PREDICTIONS=8), got "
                              f"{item!r}")
        env[key] = value
    return env


def gateway_settings(options: LoadOptions) -> tuple[GatewaySettings, dict[str, str]]:
    """The settings the gateway will run with (this environment's ``SENSAI_*`` variables,
    overridden by ``options.env`` and the options), and the variables to add to its
    environment."""
    extra = {}
    for key, value in options.env.items():
        name = key[len("SENSAI_"):].lower()
        if not key.startswith("SENSAI_") or name not in GatewaySettings.model_fields:
            raise SensaiError(f"--env {key}: not a gateway setting (e.g. "
                              "SENSAI_MAX_PREDICTIONS, SENSAI_REDUNDANCY; see "
                              "deploy/README.md)")
        if key in OWN_SETTINGS:
            raise SensaiError(f"--env {key}: set by the benchmark itself (from --backend and "
                              "the deadline; the gateway listens on 127.0.0.1)")
        extra[key] = str(value)
    if options.backend is not None and options.backend not in BACKENDS:
        raise SensaiError(f"unknown backend {options.backend!r}; choose one of "
                          f"{', '.join(BACKENDS)}")
    overrides = {k[len("SENSAI_"):].lower(): v for k, v in extra.items()}
    overrides |= {k: v for k, v in (("backend", options.backend),
                                    ("deadline_s", options.deadline_s)) if v is not None}
    try:
        settings = GatewaySettings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise SensaiError(f"invalid gateway setting {loc}: {first.get('msg')}") from None
    check_backend(settings)  # now, not when the gateway exits
    return settings, extra


def seconds_bar(options: BenchData, desc: str):
    """A progress bar of the seconds of each phase."""
    bar = progress_bar(options.progress, desc)
    bar.bar_format = ("{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
                      "[{elapsed}{postfix}]")
    return bar


def sensai_serve(options: LoadOptions, root: Path, env: dict[str, str], log_path: Path, *,
                 model: str = "sensai", args: Sequence[str] = ()) -> SensaiServe:
    """``sensai serve ROOT`` with ``options`` on a free port, ready."""
    return start_server("sensai", root, timeout_s=options.startup_timeout, backend=options.backend,
                        deadline_s=options.deadline_s, env=env, log_path=log_path, model=model,
                        args=args, cores=split_cores(options.client_cores)[0])


@contextmanager
def client_processes(n: int, *args, cores: list[int] | None = None
                     ) -> Iterator[list[HttpClientProcess]]:
    """``n`` client processes (:class:`HttpClientProcess` of ``args``) on ``cores``; every
    process in the list (those added to it too) closed after, on SIGTERM too."""
    procs: list[HttpClientProcess] = []
    try:
        with sigterm_as_exit():
            for _ in range(n):  # one at a time: those started are closed if one fails
                procs.append(HttpClientProcess(*args, cores=cores))
            yield procs
    finally:
        for p in procs:
            p.close()


def offline_top1(artifact, xs, gs: GatewaySettings) -> list[int]:
    """Offline evaluation's top-1 of each of ``xs``, the answers to check, computed as the
    gateway computes them where it simulates a GPU (the sim runtime answers from its inputs, not
    the model), else by the model."""
    runtime = "sim" if gs.runtime_kind == "sim" else "auto"
    return [int(i) for i in offline_reference(artifact, xs, runtime=runtime).argmax(1)]


def request_timeout(gs: GatewaySettings) -> float:
    """How long a client waits for an answer: past the gateway's own deadline and body
    timeout, so the gateway's answer (a 503) is what the client sees, not its own timeout."""
    return gs.deadline_s + gs.client_timeout_s + 10.0


def split(n: int, parts: int) -> list[int]:
    """``n`` in ``parts`` near-equal integers (10, 3 -> 4, 3, 3)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def files_per_process() -> int:
    """Connections the gateway may hold (it inherits this process's open-file limit), less some
    to spare."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(1, soft - 64)


def check_open_files(connections: int) -> None:
    if connections > files_per_process():
        raise SensaiError(f"--set overload_connections={connections} is more than the gateway "
                          f"may open ({files_per_process() + 64} files, ulimit -n): raise the "
                          "limit or lower overload_connections")


# --------------------------------------------------------------------------------------------
# The run


def burst_image(artifact, spec, gs: GatewaySettings) -> tuple[bytes, dict[str, Any]]:
    """The largest RGBA picture the gateway accepts for this model (95% of the side its pixel
    limit allows): legal, and as costly to decode as a legal upload gets (4 bytes a pixel, the
    most any mode takes)."""
    pixels = gs.image_pixels(spec.input_shape)
    side = max(1, int(math.sqrt(pixels) * 0.95))
    buf = io.BytesIO()
    Image.new("RGBA", (side, side), (200, 100, 50, 255)).save(buf, "PNG")
    png = buf.getvalue()
    x = decode_image(png, spec, pixels)
    expected = offline_top1(artifact, [x], gs)[0]
    return png, {"width": side, "height": side, "mode": "RGBA", "png_bytes": len(png),
                 "decoded_bytes": side * side * 4, "expected": expected}


class LoadRun:
    """The running benchmark: the server, the client processes, the RSS sampler, the progress
    bar; one method per step."""

    def __init__(self, server: Server, procs: list[HttpClientProcess], *,
                 expected: list[int], concurrency: int, timeout_s: float, sample_s: float,
                 bar, progress: bool, request: dict[str, str] | None = None):
        """``server``: the server under load; ``expected``: each image's offline top-1 (empty:
        the answers are not checked); ``request``: the clients' ``transport`` and ``model``
        (default: PNG uploads)."""
        self.server, self.procs, self.expected = server, procs, expected
        self.concurrency, self.timeout_s, self.sample_s = concurrency, timeout_s, sample_s
        self.bar, self.progress = bar, progress
        self.request = dict(request or {})
        self.t0 = self.t_phase = time.monotonic()
        self.sampler = RssSampler(server.serving_pid, self.t0, sample_s, tree_of=server.pid)
        # Each client process starts at its own image, so they do not send the same ones.
        n, k = len(expected) or 1, len(procs)
        self.offsets = [int(o) for o in np.cumsum([0] + split(n, k))[:-1]]

    def say(self, message: str) -> None:
        if self.progress:
            self.bar.write(message)

    @contextmanager
    def background(self, plans: list[dict[str, Any]],
                   procs: list[HttpClientProcess] | None = None) -> Iterator[list[Future]]:
        """Each client process's share of a phase (``plans``) running while the body watches
        it (:meth:`watch`) and collects it (:meth:`collect`); should the body fail, the client
        processes are killed, which unblocks the threads waiting for their answers."""
        procs = procs or self.procs
        with ThreadPoolExecutor(len(procs), thread_name_prefix="bench-load") as pool:
            futures = [pool.submit(c.load, self.server.url, **plan)
                       for c, plan in zip(procs, plans)]
            self.t_phase = time.monotonic()
            try:
                yield futures
            except BaseException:
                for c in procs:
                    c.process.kill()
                raise

    def watch(self, name: str, futures: list[Future], *, seconds: float = math.inf,
              until: Callable[[], bool] | None = None) -> bool:
        """Sample the RSS (now, then when due) and move the bar while the clients run, for
        ``seconds`` or until ``until()``: True once every client is done or one failed.  A dead
        server ends the run at once."""
        bar, sampler, end = self.bar, self.sampler, time.monotonic() + seconds
        poll = 0.5 if until is None else 0.05  # until() is polled, the clients waited for
        bar.set_description(name)
        self._show(sampler.sample(name))
        while not (until and until()) and (now := time.monotonic()) < end:
            timeout = min(poll, max(0.01, min(sampler.next_due, end) - now))
            done, pending = wait(futures, timeout=timeout, return_when=FIRST_EXCEPTION)
            if sampler.due():
                self._show(sampler.sample(name))
            bar.n = round(min(bar.total or math.inf, time.monotonic() - self.t_phase), 1)
            bar.refresh()
            if not pending or any(f.exception() for f in done):
                return True
            died = self.server.died()
            if died:
                raise SensaiError(f"during the {name}, {died}")
        return False

    def collect(self, name: str, futures: list[Future], timeout_s: float | None = None
                ) -> list[dict[str, Any]]:
        """What each client process's share of the phase returned."""
        try:
            return [f.result(timeout=timeout_s) for f in futures]
        except (RuntimeError, EOFError, OSError, TimeoutError) as e:
            raise SensaiError(f"HTTP load client during the {name}: {e}") from None

    def drive(self, name: str, plans: list[dict[str, Any]], seconds: float,
              procs: list[HttpClientProcess] | None = None) -> list[dict[str, Any]]:
        """Every client process's share of one phase, while the RSS is sampled and the server
        watched; a dead server or client ends the run at once."""
        self.bar.reset(total=round(seconds, 1))
        with self.background(plans, procs) as futures:
            self.watch(name, futures)
            outs = self.collect(name, futures)
        self._show(self.sampler.sample(name))
        return outs

    def _show(self, sample: dict | None) -> None:
        if sample is not None:
            self.bar.set_postfix_str(f"gateway RSS {sample['rss_mb']:.1f} MB", refresh=False)

    def phase(self, name: str, seconds: float, plans: list[dict], bare: bool = False
              ) -> dict[str, Any]:
        """One phase of ``plans``; ``bare``: the bare ``GET /v2/health/live`` in place of the
        run's request (no answers to check, nothing the gateway's ``/metrics`` count)."""
        request = {"transport": "live"} if bare else self.request
        for plan, first in zip(plans, self.offsets):
            plan.update(seconds=seconds, expected=None if bare else self.expected or None,
                        timeout_s=self.timeout_s, first=first, **request)
        metrics = self.server.gateway and not bare
        scrape = scrape_metrics if metrics else lambda url: None
        before = scrape(self.server.url)
        pid, tree_of = self.server.serving_pid, self.server.pid
        workers = worker_pids(self.server.url) if tree_of is not None else set()
        split_before = server_cpu(tree_of, workers)
        gpu = GpuSampler()
        gpu.start()
        cpu, threads, t_cpu = machine_cpu_seconds(), process_cpu_seconds(pid), time.monotonic()
        outs = self.drive(name, plans, seconds)
        elapsed = time.monotonic() - t_cpu
        busy = busy_cores(cpu, elapsed)
        gpu_busy = gpu.stop()
        threads_after, split_after = process_cpu_seconds(pid), server_cpu(tree_of, workers)
        rep = phase_report(outs, t0=self.t0, bin_s=self.sample_s)
        rep["machine_busy_cores"] = busy
        if gpu_busy is not None:
            rep["gpu_busy"] = gpu_busy
        rep["gateway_cpu"] = process_cores(threads, threads_after, elapsed)
        rep["server_cpu"] = server_split(split_before, split_after, elapsed,
                                         rep["throughput_rps"])
        rep["duration_s"] = seconds
        rep["server"] = server_view(before, scrape(self.server.url))
        ok = rep["latency_ok_ms"]
        self.say(f"{name}: {rep['requests']} requests, {rep['throughput_rps']} answered 200 per "
                 f"second, status codes {rep['status_counts']}, p50/p99 of the 200s "
                 f"{ok['p50']}/{ok['p99']} ms, wrong answers {rep['wrong']}")
        rep["outs"] = outs
        return rep

    def closed(self, name: str, seconds: float, concurrency: int | None = None,
               bare: bool = False) -> dict[str, Any]:
        """A closed loop at ``concurrency`` (default: the run's), shared by as many client
        processes as it has requests in flight (up to all of them); ``bare``: see
        :meth:`phase`."""
        concurrency = concurrency or self.concurrency
        k = min(concurrency, len(self.procs))
        rep = self.phase(name, seconds, [{"concurrency": c} for c in split(concurrency, k)],
                         bare)
        del rep["outs"]
        rep["concurrency"] = concurrency
        return rep

    def overload(self, seconds: float, rate: float, gs: GatewaySettings, retry_after: bool,
                 connections: int | None = None) -> dict[str, Any]:
        """An open loop at ``rate``.  The connections opened at the start are the population
        the gateway admits (its ``max_requests``) and the run's concurrency; at most
        ``connections`` in all: by default, if the clients honour Retry-After, that population,
        each pausing after a refusal (more would only open more connections to pause); else
        enough for every request to take up to the deadline, within the open-file limit."""
        k = len(self.procs)
        population = gs.max_requests + self.concurrency
        connections = connections or max(k, population if retry_after else min(
            gs.max_requests + math.ceil(rate * gs.deadline_s), files_per_process()))
        preopen = min(connections, population)
        plans = [{"rate": rate / k, "connections": c, "preopen": min(c, o),
                  "retry_after": retry_after}
                 for c, o in zip(split(connections, k), split(preopen, k))]
        rep = self.phase("overload", seconds, plans)
        outs = rep.pop("outs")
        # Every request due is sent, late if the client falls behind: the rate offered is the
        # requests that left before the phase's end over its duration.
        rep.update({"target_rate_rps": round(rate, 2),
                    "offered_rate_rps": round(sum(o["sent_in_time"] for o in outs) / seconds, 2),
                    "send_lag_ms": summarize([v for o in outs for v in o["lag_ms"]]),
                    "connections_allowed": connections,
                    "connections_opened": sum(o["connections"] for o in outs),
                    "retry_after_honoured": retry_after,
                    "parked_by_retry_after": sum(o["parked"] for o in outs)})
        self.say(f"overload: {rep['requests']} requests offered at {rep['offered_rate_rps']}/s "
                 f"(asked {rep['target_rate_rps']}/s); {rep['connections_opened']} connections")
        return rep

    def burst(self, client: HttpClientProcess, image: dict[str, Any], concurrency: int,
              seconds: float) -> dict[str, Any]:
        """``concurrency`` uploads of one large legal image always in flight: what decoding
        them costs the gateway at its peak (``VmHWM``, reset first), against what decoding
        every one at once would take."""
        pid = self.server.serving_pid
        before = process_rss_bytes(pid)
        reset = reset_peak_rss(pid)
        plan = {"concurrency": concurrency, "seconds": seconds, "expected": [image["expected"]],
                "timeout_s": self.timeout_s, "first": 0}
        rep = phase_report(self.drive("burst", [plan], seconds, procs=[client]), t0=self.t0,
                           bin_s=self.sample_s)
        peak = peak_rss_bytes(pid)
        rep.update({
            "duration_s": seconds, "concurrency": concurrency,
            "image": {k: v for k, v in image.items() if k != "expected"},
            "rss_before_mb": None if before is None else round(before / 1e6, 2),
            "peak_rss_mb": None if peak is None or not reset else round(peak / 1e6, 2),
            "all_at_once_mb": round(concurrency * image["decoded_bytes"] / 1e6, 1)})
        if rep["peak_rss_mb"] is not None and rep["rss_before_mb"] is not None:
            rep["peak_growth_mb"] = round(rep["peak_rss_mb"] - rep["rss_before_mb"], 2)
        self.say(f"burst: {rep['requests']} uploads of {image['width']}x{image['height']} "
                 f"{image['mode']} ({image['decoded_bytes'] / 1e6:.1f} MB decoded each), "
                 f"{concurrency} at a time, status codes {rep['status_counts']}; gateway peak "
                 f"RSS {rep['peak_rss_mb']} MB (from {rep['rss_before_mb']})")
        return rep

    def health(self) -> dict[str, Any]:
        """Right after the overload, and if that fails, again every second for a while."""
        self.bar.set_description("health after the overload")
        n = min(HEALTH_IMAGES, len(self.expected))
        health = check_health(self.server.url, self.procs[0], self.expected, n)
        health["recovered_after_s"] = 0.0 if health["healthy"] else None
        t = time.monotonic()
        while not health["healthy"] and time.monotonic() - t < RECOVERY_S \
                and self.server.alive():
            time.sleep(1.0)
            if check_health(self.server.url, self.procs[0], self.expected, n)["healthy"]:
                health["recovered_after_s"] = round(time.monotonic() - t, 2)
                break
        self.sampler.sample("after")
        self.say(f"after the overload: ready {health['ready_status']}, {health['correct']}/"
                 f"{health['predictions']} predictions agree with offline evaluation")
        return health

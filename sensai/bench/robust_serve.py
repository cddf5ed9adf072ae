"""``sensai bench-robust --backend ray-serve``: each configuration as the Ray Serve application,
called over HTTP.

A configuration (redundancy ``r``, hedge) is ``sensai serve ART --backend ray-serve`` with its
settings as its environment (:func:`.server.serve_env`: ``SENSAI_REDUNDANCY=r``, ...) in a process
of its own, started by the bench's server starter (:func:`.server.start_server`), its ingress
serving on 127.0.0.1 itself, on a new local Ray instance of its own (or the cluster at
``ray_address``), and stopped before the next starts: Serve runs one application per Ray instance
here. The requests are KServe v2 binary tensors of the same normalized images the offline answers
are computed from, sent by the benchmark's client process (:func:`.client.load_phase`) with
:data:`IN_FLIGHT` requests always in flight (a closed loop), in every scenario alike; ``wrong``:
answers whose top-1 differs from offline evaluation's (the v2 answer's ``class_index``). Subnet
runs and skipped copies come from the ingress's ``GET /v1/models``; the ingress does not report
compute time.

``failure``: the victim worker's replica process is SIGKILLed while the loop runs, then
``GET /v1/models`` is polled: the outage ends when the ingress reports the victim up on a new
replica, which serves again once its runs grow; the loop goes on until the new replica has run
:data:`~.robust_records.AFTER_REJOIN` requests, so the answers after the rejoin are checked
under the same load.  The requests sent before the victim served again count as the outage's
(with r = 0, one sent just after the ingress reported the victim up may still fail while the
new replica's first run is on its way); those sent after it are the rejoin's.  A closed loop
rather than paced single requests because what is measured is whether a kill *under load*
costs a request: the kill lands with requests in flight on the victim (``in_flight_at_kill``
says how many), and requests keep coming through the replacement and the reconnection.  The
price: where the outage does cost requests (r = 0), a fast 503 pulls the next request in sooner,
so that error count grows with how fast errors come back; the outage's length is the figure to
compare.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sensai.artifact import Artifact
from sensai.errors import SensaiError
from sensai.raycluster import local_raylet_pid
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.serve_run import STARTUP_TIMEOUT_S

from .client import HttpClientProcess
from .robust_records import AFTER_REJOIN, Outage, Records, outage_report
from .server import SensaiServe, serve_env, served, start_server

IN_FLIGHT = 4  # requests the closed loop keeps in flight
TRANSPORT = "http-v2"
POLL_S = 0.05  # how often GET /v1/models is read during an outage
PHASE_LIMIT_S = 3600.0  # a bound on a phase of a given number of requests, never reached
class ServeConfig:
    """One configuration's running application: its URL, what its ingress reports, and load
    phases from the client process."""

    def __init__(self, url: str, model: str, client: HttpClientProcess, expected: np.ndarray):
        self.url, self.model, self.client, self.expected = url, model, client, expected

    def predictor(self) -> dict[str, Any]:
        return predictor(self.url)

    def phase(self, **plan) -> dict[str, Any]:
        plan.setdefault("seconds", PHASE_LIMIT_S)
        return self.client.load(self.url, transport=TRANSPORT, model=self.model, answers=True,
                                concurrency=IN_FLIGHT, **plan)

    def records(self, out: dict) -> Records:
        """A phase's requests as records."""
        run = Records()
        for t, ms, status, image, index in zip(out["t"], out["ms"], out["status"],
                                               out["image"], out["index"]):
            error = (None if status == 200 else str(status) if status
                     else "no answer (" + ", ".join(out["failures"]) + ")")
            run.add(t, ms, error, wrong=index != int(self.expected[image]))
        return run


def predictor(url: str) -> dict[str, Any]:
    """What the ingress at ``url`` says of its predictor (empty: it did not answer)."""
    return served(url, timeout_s=30.0).get("predictor") or {}


def wait_all_up(url: str, timeout_s: float) -> list[dict[str, Any]]:
    """The workers, once the ingress at ``url`` reports every one up on a known replica."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = predictor(url).get("workers") or []
        if workers and all(w["state"] == "up" and w.get("pid") for w in workers):
            return workers
        if time.monotonic() > deadline:
            raise SensaiError(f"the Serve application's workers are not all up after "
                              f"{timeout_s:g} s: {[w.get('state') for w in workers]}")
        time.sleep(0.2)


def work(predictor: dict) -> dict[str, Any]:
    """The workers' counters as the ingress reports them (no compute time)."""
    ws = predictor.get("workers") or []
    return {"runs": sum(w["runs"] for w in ws), "skipped": sum(w["skipped"] for w in ws),
            "compute_ms": None}


def counted(cfg: ServeConfig, out: dict, before: dict, after: dict) -> Records:
    """A phase's records with the work and degraded answers between two ingress readings."""
    run = cfg.records(out)
    run.add_work(work(before), work(after))
    run.degraded = after.get("degraded_answers", 0) - before.get("degraded_answers", 0)
    return run


def measured_phase(cfg: ServeConfig, **plan) -> Records:
    before = cfg.predictor()
    out = cfg.phase(**plan)
    return counted(cfg, out, before, cfg.predictor())


def local_victim(worker: dict) -> int:
    """The pid of the victim's replica, if it runs on this machine (else killing that pid would
    end some other process)."""
    node = worker.get("node")
    if not worker.get("pid") or not node or local_raylet_pid(node) is None:
        raise SensaiError(f"the failure scenario kills {worker['name']}'s replica process, which "
                          f"must run on this machine; it runs on node {node or 'unknown'}")
    return int(worker["pid"])


def failure(cfg: ServeConfig, n: int, victim: int, kill_at: float, rejoin_timeout_s: float,
            rate: float) -> dict[str, Any]:
    """The closed loop; after ``kill_at`` x ``n`` requests' time at ``rate``, the victim's
    replica is SIGKILLed; the loop runs until its replacement has served at least
    :data:`AFTER_REJOIN` requests (and for at least ``n`` requests' time), or
    ``rejoin_timeout_s``."""
    w0 = wait_all_up(cfg.url, rejoin_timeout_s)[victim]
    pid = local_victim(w0)
    lead, span = kill_at * n / rate, n / rate
    # A request runs at most one subnet per group on the victim, and of the runs counted after
    # the reading that first showed the new replica serving, at most IN_FLIGHT requests' were
    # sent before it: this many such runs are at least AFTER_REJOIN requests of the rejoin's.
    # (Counting from the replica's first run instead undercounts: the runs between it and the
    # poll that sees it belong to requests sent before, and how many depends on the poll's lag.)
    after_runs = (AFTER_REJOIN + IN_FLIGHT) * len(w0["groups"])
    before = cfg.predictor()
    outage = Outage()
    ev = outage.events
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(cfg.phase, seconds=span + rejoin_timeout_s + 60.0)
        w, runs_up, runs_served = w0, 0, 0
        try:
            # The kill is timed from the loop's first answers, which the workers' runs show.
            while work(cfg.predictor())["runs"] <= work(before)["runs"] and not load.done():
                time.sleep(POLL_S)
            t_start = time.monotonic()
            time.sleep(lead)
            outage.killed()
            os.kill(pid, signal.SIGKILL)
            while not load.done() and time.monotonic() - ev["kill"] < rejoin_timeout_s:
                time.sleep(POLL_S)
                ws = cfg.predictor().get("workers") or []
                if not ws:  # the ingress did not answer this time
                    continue
                w, was_up = ws[victim], "up" in ev
                # Up again: on a new replica (the old one may still be reported up at first).
                outage.see(down=w["state"] != "up" or w.get("pid") != pid,
                           up=w["state"] == "up" and w.get("pid") not in (None, pid))
                if "up" in ev and not was_up:
                    runs_up = w["runs"]
                if "up" in ev and "served" not in ev and w["runs"] > runs_up:
                    ev["served"], runs_served = time.monotonic(), w["runs"]
                if ("served" in ev and w["runs"] - runs_served >= after_runs
                        and time.monotonic() - t_start >= span):
                    break
        finally:
            cfg.client.stop_load()
        out = load.result()
    after = cfg.predictor()
    run = counted(cfg, out, before, after)
    w_after = (after.get("workers") or [w])[victim]
    return outage_report(
        run, outage, run.window(outage.after), w_after["runs"] - runs_up if "up" in ev else 0,
        victim=w0["name"], killed_pid=pid, replica_pid_after=w_after.get("pid"),
        kill_at_s=round(ev["kill"] - t_start, 3),
        in_flight_at_kill=run.window(lambda t0, t1: t0 <= ev["kill"] < t1).requests,
        restarted=w_after["restarts"] > w0["restarts"], rejoined="up" in ev,
        serving_again_s=outage.since_kill("served"))


def start_config(artifact: Artifact, key: str, settings: GatewaySettings, log_dir: Path,
                 rejoin_timeout_s: float) -> tuple[SensaiServe, dict[str, Any]]:
    """Configuration ``key``'s ``sensai serve`` (its log in ``log_dir``) started, and once every
    worker is up, what its ingress says it runs with how it was started (``startup_s``: from
    the start to every worker up)."""
    t0 = time.monotonic()
    name = re.sub(r"[^\w.=-]+", "_", key)  # the key's spaces and commas: not in a file name
    server = start_server("sensai", artifact.root, timeout_s=STARTUP_TIMEOUT_S,
                          backend=settings.backend, deadline_s=settings.deadline_s,
                          log_path=log_dir / f"serve-{name}.log", model=settings.model_name,
                          env=serve_env(settings))
    try:
        wait_all_up(server.url, rejoin_timeout_s)
        described = predictor(server.url)
    except BaseException:
        server.stop()
        raise
    return server, dict(described, url=server.url, startup_s=round(time.monotonic() - t0, 2))


def measure_on_serve(artifact: Artifact, configs: dict[str, GatewaySettings],
                     scenarios: Sequence[str], xs: Sequence[np.ndarray], refs: np.ndarray, *,
                     warmup: int, victim: int, kill_at: float, rejoin_timeout_s: float,
                     log_dir: Path, bar) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every configuration's ``sensai serve`` in turn (:func:`start_config`): warm-up, ``none``,
    ``failure`` (those asked).  Returns the scenarios' reports and what each application's
    ingress said it runs, with its server's record (``gateway``)."""
    n = len(xs)
    client = HttpClientProcess([], [np.ascontiguousarray(x, np.float32).tobytes() for x in xs],
                               list(xs[0].shape))
    measured: dict[str, dict] = {}
    described: dict[str, dict] = {}
    try:
        for key, settings in configs.items():
            bar.set_description(f"start {key}")
            server, described[key] = start_config(artifact, key, settings, log_dir,
                                                  rejoin_timeout_s)
            try:
                cfg = ServeConfig(server.url, server.model, client, refs.argmax(1))
                bar.set_description(f"warm-up {key}")
                rate = n / 2.0  # requests/s assumed until one is measured
                if warmup:
                    out = cfg.phase(count=warmup)
                    rate = warmup / max(out["seconds"], 1e-3)
                    bar.update(warmup)
                measured[key] = {}
                if "none" in scenarios:
                    bar.set_description(f"none: {key}")
                    measured[key]["none"] = measured_phase(cfg, count=n).report()
                    lat = measured[key]["none"]["latency_ms"]
                    if lat["mean"]:
                        rate = IN_FLIGHT * 1e3 / lat["mean"]
                    bar.update(n)
                if "failure" in scenarios:
                    bar.set_description(f"failure: {key}")
                    measured[key]["failure"] = failure(cfg, n, victim, kill_at,
                                                       rejoin_timeout_s, rate)
                    bar.update(n)
            finally:
                server.stop()
                described[key]["gateway"] = server.record()
    finally:
        client.close()
    return measured, described

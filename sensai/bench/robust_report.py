"""``sensai bench-robust``'s report: the terminal table, ``robust.md`` and ``robust.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .names import SCENARIOS
from .render import (SHARED_CORES, Col, Panel, Table, draw, fmt, heading, machine_line, markdown,
                     mark, p50_p99, quantiles)
from .robust_records import AFTER_REJOIN

WORKERS = {"local": "worker threads of this process", "processes": "worker processes",
           "ray": "Ray actors"}
ENDED = {"local": "abandoned (a thread cannot be killed: it is declared dead at once and a new "
                  "thread takes its place)",
         "processes": "SIGKILLed", "ray": "killed (Ray restarts the actor)"}
SERVED = "ray-serve"  # the backend whose configurations are Serve applications called over HTTP


def _note(rep: dict) -> str:
    scen = rep["scenario"]
    if scen == "straggler" and rep.get("straggler_answered_share") is not None:
        return (f"{rep['straggler']}'s own groups answered by it: "
                f"{rep['straggler_answered_share'] * 100:.0f}%")
    if scen not in ("failure", "node-loss"):
        return ""
    after = rep["after_rejoin"]
    lost = (f"node {rep['node'][:8]} ({', '.join(rep['workers_on_node'])}) lost; "
            if scen == "node-loss" else "")
    if "in_flight_at_kill" in rep:  # an application called over HTTP
        lost += (f"{rep['in_flight_at_kill']} in flight at the kill; serving again after "
                 f"{fmt(rep.get('serving_again_s'))} s; ")
    return (f"{lost}outage {fmt(rep.get('outage_s'))} s, {rep['errors_during_outage']} "
            f"errors in it, p50/p99 in it {p50_p99(rep.get('latency_during_outage_ms'))} ms; "
            f"after rejoin {after['requests'] - after['errors']}/{after['requests']} ok, p50/p99 "
            f"{p50_p99(after.get('latency_ms'))} ms")


TABLE = Table(
    Col("config", "config"), Col("scenario", "scenario"),
    Col("answered", lambda r: f"{r['answered']}/{r['requests']}"), Col("errors", "errors"),
    Col("wrong", "wrong"), *quantiles("latency_ms", "p50", "p99", "mean"),
    Col("p99 / no-fault p99", "p99_vs_no_fault"),
    Col("subnet runs/req", "subnet_runs_per_request"),
    Col("compute overhead (runs)", "compute_overhead_runs"),
    Col("compute overhead (time)", "compute_overhead_time"), Col("note", _note))


def runs(result: dict) -> list[dict]:
    """Each configuration's scenarios, in the scenarios' order."""
    return [rep | {"config": key, "scenario": scen} for key, c in result.get("configs", {}).items()
            for scen in SCENARIOS if (rep := c["scenarios"].get(scen)) is not None]


def render_table(result: dict) -> str:
    return TABLE.text(runs(result))


def _nodes(result: dict) -> str | None:
    """Which node each worker ran on (Ray), when there is more than one node."""
    nodes = result.get("worker_nodes", {})
    if len({n for ws in nodes.values() for n in ws if n}) < 2:
        return None
    return "Workers' nodes (Ray node id, first 8 characters): " + "; ".join(
        f"{key}: " + ", ".join(f"w{i} {(n or '-')[:8]}" for i, n in enumerate(ws))
        for key, ws in nodes.items()) + "."


def render_markdown(result: dict) -> str:
    st = result["settings"]
    served = st.get("backend", "local") == SERVED
    cores = result["machine"].get("usable_cores")
    return markdown(
        heading(result, "bench-robust", "run_robust_bench(...)"),
        _setup(result, served),
        machine_line(result, length=False) + "  Offline top-1 on these images: "
        f"{result['offline_top1']}.", _nodes(result), TABLE.md(runs(result)),
        (LEGEND_SERVE if served else LEGEND) + HOSTS,
        f"Note: {st['workers']} workers per configuration shared {cores} cores, so extra copies "
        "compete with the primaries for CPU time; on machines with a core (or GPU) per worker "
        "that competition disappears." if cores and st["workers"] > cores else None,
        SHARED_CORES)


def _setup(result: dict, served: bool) -> str:
    """The configurations, the requests, where they ran, and the faults."""
    st = result["settings"]
    backend, kill_at = st.get("backend", "local"), int(st["kill_at"] * st["images"])
    placed = f"{len(result['groups'])} subnets on W = {st['workers']} "
    vote = ", vote mode" if st["vote"] else ""
    runtime, device = (", ".join(st[f"{k}_resolved"]) + f" (--{k} {st[k]})"
                       if st.get(f"{k}_resolved") else st[k] for k in ("runtime", "device"))
    run = (f"after {st['warmup']} warm-up requests; runtime {runtime} on {device}, "
           f"{st['threads_per_worker']} thread(s) per worker; deadline {st['deadline_s']} s.  ")
    if not served:
        return (
            placed + f"{WORKERS.get(backend, backend)} (backend {backend}: the predictor `sensai "
            f"serve --backend {backend} --redundancy r` builds; r = 0 is the default serving path "
            f"that `sensai bench` measures), cyclic placement{vote}; {st['images']} real test "
            "images per scenario at batch 1, concurrency 1, in process, " + run
            + f"Straggler: worker {st['straggler_worker']} sleeps `{st['delay']}` before each "
            f"request.  Failure: worker {st['victim_worker']} is {ENDED.get(backend, 'ended')} "
            f"while request {kill_at} is in flight, then restarted (restart delay "
            f"{st['restart_delay_s']} s); in that scenario requests start every "
            f"{st.get('failure_interval_ms', 0):g} ms (paced, so a fast error does not pull the "
            "next request in sooner)."
            + (f"  Node loss: the raylet of worker {st['victim_worker']}'s Ray node and every "
               "process it started are SIGKILLed at the same point, as losing the machine would, "
               "so every worker on that node is lost at once; Ray restarts them where there is "
               "room once it has declared the node dead, and the node does not come back."
               if "node-loss" in st.get("scenarios", ()) else ""))
    starts = ", ".join(f"{k} {fmt(v.get('startup_s'))} s" for k, v in
                       result.get("serve", {}).items())
    return (
        placed + "worker deployments of the Ray Serve application (`sensai serve --backend "
        "ray-serve --redundancy r`: one replica per worker, the gateway as the ingress), cyclic "
        f"placement{vote}; each configuration's `sensai serve` started in turn in a process of its "
        "own, on a Ray instance of its own unless --ray-address (its ingress on 127.0.0.1; start "
        f"to all workers up: {starts}) and stopped before the next.  Requests: KServe v2 binary "
        f"tensors of {st['images']} real test images at batch 1 to the ingress's own port, from "
        f"the benchmark's client process, {st['concurrency']} always in flight (a closed loop), "
        + run + f"Failure: the replica process of worker {st['victim_worker']} is SIGKILLed, with "
        f"requests in flight, after the time {kill_at} requests take at the no-fault run's rate; "
        "Serve starts a new replica and the ingress reconnects to it; the loop goes on until the "
        f"new replica has served at least {AFTER_REJOIN} requests, so the answers after it "
        "rejoined are checked under the same load.  Requests keep coming while the worker is "
        "down (closed loop, not paced): a kill under load is what is measured, and where the "
        "outage costs requests (r = 0) a fast 503 pulls the next one in sooner, so that error "
        "count grows with how fast errors come back; compare the outage's length.")


LEGEND = ("answered/errors: requests answered / answered with an error (503 no live copy, 504 "
          "deadline); latency is over answered requests.  wrong: answers whose top-1 or scores "
          "differ from offline evaluation's.  subnet runs/req: subnets actually computed per "
          "request over all workers (G without redundancy; fewer when requests fail fast or "
          "copies are skipped); compute overhead: runs and summed compute time per request "
          "relative to r = 0 without faults.")
HOSTS = "  Each worker hosts r+1 subnets (weights memory (r+1) x)."


LEGEND_SERVE = (
    "answered/errors: requests answered 200 / answered otherwise or not at all; latency "
    "is over answered requests, from the client.  wrong: answers whose top-1 differs "
    "from offline evaluation's.  subnet runs/req: subnets computed per request over all "
    "workers, as the ingress counts them (GET /v1/models; it does not report compute "
    "time).  Failure note: requests in flight at the kill; when the victim served again "
    "(its runs grew on the new replica) and the outage (kill until the ingress reports "
    "it up on a new replica), from the kill; errors and latency of the requests that "
    "overlapped the outage or were sent before the victim served again; the answers of "
    "the requests sent after it served again.")


def plot(result: dict, path: Path) -> None:
    configs = result.get("configs", {})
    timed = [rep for rep in runs(result) if rep["latencies_ms"]]
    scen = [s for s in SCENARIOS if any(s in c["scenarios"] for c in configs.values())]
    width = 0.8 / max(1, len(configs))
    bars = []
    for i, (key, c) in enumerate(configs.items()):
        at = np.arange(len(scen)) + i * width
        p99 = [c["scenarios"].get(s, {}).get("latency_ms", {}).get("p99") or 0 for s in scen]
        errs = [c["scenarios"].get(s, {}).get("errors", 0) for s in scen]
        bars.append(mark("bar", at, p99, width, label=key))
        bars += [mark("annotate", f"{e} err", (x, h), ha="center", va="bottom", fontsize=7,
                      color="#C44E52") for x, h, e in zip(at, p99, errs) if e]
    draw(path, [
        Panel([mark("box", [r["latencies_ms"] for r in timed],
                    [f"{r['config']}\n{r['scenario']}" for r in timed])],
              "latency by redundancy and scenario",
              "latency per image (ms, log), whiskers: farthest samples within p1-p99",
              xscale="log" if timed else "linear", grid={"axis": "x", "alpha": 0.3}),
        Panel(bars, "p99 and errors", ylabel="p99 latency (ms)", legend={"fontsize": 8},
              grid={"axis": "y", "alpha": 0.3},
              xticks=(np.arange(len(scen)) + width * (len(configs) - 1) / 2, scen))],
        (13, 4.8), 1, 2)

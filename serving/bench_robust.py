"""``sensai bench-robust``: latency, errors and compute cost of redundant class parallelism.

For each configuration (redundancy ``r``, and optionally a hedge delay) one
:class:`~serving.robust.RobustPredictor` runs the artifact's G subnets on W = G worker processes
(cyclic placement), and the same real test images are sent one at a time (concurrency 1, in
process: ``predictor.predict`` called directly) under three scenarios:

* ``none`` - no fault: the reference latency;
* ``straggler`` - one worker sleeps before every request, its delay drawn from a distribution
  (``--delay``, e.g. ``exp:50ms``);
* ``failure`` - one worker process is SIGKILLed while a request is in flight (at ``--kill-at`` of
  the run); the pool restarts it and it rejoins.  Requests are paced (one every ``interval_ms``)
  so the error count reflects the outage's length rather than how fast errors come back.

The ``none`` and ``straggler`` runs are interleaved in rounds across configurations, so a change
in the machine's load hits them alike; ``failure`` runs one configuration at a time (an outage is
a wall-clock event).  Every answer is compared with the offline answer (the same ONNX subnets run
in this process, merged with :func:`sensai.merge.merge_outputs`): ``wrong`` counts answers whose
top-1 or scores differ.  ``errors`` counts requests answered with an error (503: no live copy of
some classes, 504: deadline); latency figures are over answered requests.

Compute overhead: subnet runs per request (G without redundancy; up to (r+1) G with it, less
when copies are skipped because their group was already answered) and the summed compute time of
all workers per request, both relative to r = 0 without faults (one full answer's work).
Hosting cost: each worker holds r+1 subnets (memory (r+1) x).

Outputs in ``out_dir``: ``robust.json`` (every figure and latency), ``robust.md``, ``robust.png``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sensai.errors import SensaiError

log = logging.getLogger(__name__)

SCENARIOS = ("none", "straggler", "failure")


def _config_key(r: int, hedge_ms: float) -> str:
    return f"r={r}" + (f", hedge {hedge_ms:g} ms" if hedge_ms else "")


def _check(redundancies, hedges, scenarios, images, warmup, delay, straggler, victim, kill_at,
           rounds, groups: int, vote: bool, interval_ms: float = 0.0) -> None:
    from .robust import check_robust_args, parse_delay

    if not redundancies:
        raise SensaiError("give at least one --redundancy")
    for r in redundancies:
        check_robust_args(groups, None, r, vote)
    if any(h < 0 for h in hedges):
        raise SensaiError("--hedge-ms must be >= 0")
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or not scenarios:
        raise SensaiError(f"unknown scenario {', '.join(bad) or '(none)'}; choose from "
                          f"{', '.join(SCENARIOS)}")
    for name, v, low in (("--images", images, 2), ("--warmup", warmup, 0),
                         ("--rounds", rounds, 1)):
        if not isinstance(v, int) or v < low:
            raise SensaiError(f"{name} must be an integer >= {low}, got {v!r}")
    parse_delay(delay)
    for name, v in (("--straggler", straggler), ("--victim", victim)):
        if not isinstance(v, int) or not 0 <= v < groups:
            raise SensaiError(f"{name} must be a worker index 0..{groups - 1}, got {v!r}")
    if not 0.0 <= kill_at < 1.0:
        raise SensaiError(f"--kill-at must be in [0, 1), got {kill_at}")
    if not interval_ms >= 0:
        raise SensaiError(f"--interval-ms must be >= 0, got {interval_ms}")


def offline_reference(artifact_dir: str | Path, manifest, xs: Sequence[np.ndarray], *,
                      runtime: str = "auto", threads: int = 1) -> np.ndarray:
    """The answers to compare with: every subnet run in this process on CPU, merged."""
    from sensai.merge import merge_outputs

    from .pools import runner_specs

    specs = runner_specs(artifact_dir, manifest, device="cpu", runtime=runtime, threads=threads)
    runners = [s.build() for s in specs]
    x = np.concatenate(xs)
    outs = [np.asarray(r.run(x), dtype=np.float32) for r in runners]
    return merge_outputs(outs, manifest.groups, manifest.num_classes)


class _Run:
    """Per-request records of one configuration in one scenario."""

    def __init__(self) -> None:
        self.latency: list[float] = []
        self.errors: list[str] = []
        self.wrong = 0
        self.degraded = 0
        self.answered_by: list[dict[str, str]] = []
        self.runs = 0
        self.compute_ms = 0.0
        self.skipped = 0
        self.requests = 0

    def report(self, extra: dict | None = None) -> dict[str, Any]:
        from .bench import summarize

        out = {"requests": self.requests, "answered": len(self.latency),
               "errors": len(self.errors), "wrong": self.wrong, "degraded": self.degraded,
               "latency_ms": summarize(self.latency),
               "subnet_runs_per_request": round(self.runs / max(1, self.requests), 3),
               "compute_ms_per_request": round(self.compute_ms / max(1, self.requests), 4),
               "copies_skipped_per_request": round(self.skipped / max(1, self.requests), 3),
               "error_examples": sorted(set(self.errors))[:3],
               "latencies_ms": [round(v, 4) for v in self.latency]}
        out.update(extra or {})
        return out


async def _one(pred, x: np.ndarray, ref: np.ndarray, run: _Run, *, kill=None) -> None:
    from .predictor import ServingError

    run.requests += 1
    t0 = time.perf_counter()
    task = asyncio.ensure_future(pred.predict(x))
    if kill is not None:
        await asyncio.sleep(0)  # the request is dispatched to every worker...
        kill()  # ...and one of them dies while it is in flight
    try:
        p = await task
    except ServingError as e:
        run.errors.append(f"{e.status}: {e}")
        return
    run.latency.append((time.perf_counter() - t0) * 1e3)
    run.answered_by.append(dict(p.answered_by))
    if p.degraded:
        run.degraded += 1
    if int(p.scores[0].argmax()) != int(ref.argmax()) or not np.allclose(p.scores[0], ref,
                                                                          atol=1e-5):
        run.wrong += 1


def _counter_delta(pred, before: dict) -> tuple[int, float, int]:
    c = pred.counters()
    return (c["runs"] - before["runs"], c["compute_ms"] - before["compute_ms"],
            c["skipped"] - before["skipped"])


async def _settle(pred, timeout: float = 5.0) -> None:
    """Let copies still being computed for the last request finish, so counters are complete."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with pred._lock:
            busy = any(w.pending for w in pred.workers)
        if not busy:
            return
        await asyncio.sleep(0.005)


async def _measure(preds: dict[str, Any], scenarios, xs, refs, warmup: int, rounds: int,
                   straggler: int, delay: str, victim: int, kill_at: float,
                   rejoin_timeout_s: float, interval_s: float,
                   bar) -> dict[str, dict[str, dict]]:
    n = len(xs)
    results: dict[str, dict[str, dict]] = {k: {} for k in preds}
    for key, pred in preds.items():
        bar.set_description(f"warm-up {key}")
        for j in range(warmup):
            await pred.predict(xs[j % n])
            bar.update(1)
    chunks = np.array_split(np.arange(n), min(rounds, n))
    for scenario in [s for s in SCENARIOS if s in scenarios and s != "failure"]:
        runs = {k: _Run() for k in preds}
        if scenario == "straggler":
            for pred in preds.values():
                pred.inject(straggler, delay=delay)
        try:
            for chunk in chunks:
                for key, pred in preds.items():
                    bar.set_description(f"{scenario}: {key}")
                    await _settle(pred)
                    before = pred.counters()
                    for j in chunk:
                        await _one(pred, xs[j], refs[j], runs[key])
                        bar.update(1)
                    await _settle(pred)
                    d = _counter_delta(pred, before)
                    runs[key].runs += d[0]
                    runs[key].compute_ms += d[1]
                    runs[key].skipped += d[2]
        finally:
            if scenario == "straggler":
                for pred in preds.values():
                    pred.inject(straggler, delay=None)
        for key, pred in preds.items():
            extra = {}
            if scenario == "straggler":
                own = [f"subnet_{g:02d}" for g in pred.placement[straggler]
                       if pred.hosts[g][0] == straggler]
                name = pred.workers[straggler].name
                total = sum(1 for a in runs[key].answered_by for s in own if s in a)
                by_straggler = sum(1 for a in runs[key].answered_by for s in own
                                   if a.get(s) == name)
                extra = {"straggler": name, "straggler_delay": delay,
                         "straggler_groups": own,
                         "straggler_answered_share": round(by_straggler / total, 4) if total
                         else None}
            results[key][scenario] = runs[key].report(extra)
    if "failure" in scenarios:
        for key, pred in preds.items():
            bar.set_description(f"failure: {key}")
            results[key]["failure"] = await _failure(pred, xs, refs, victim, kill_at,
                                                     rejoin_timeout_s, interval_s, bar)
    return results


async def _failure(pred, xs, refs, victim: int, kill_at: float, rejoin_timeout_s: float,
                   interval_s: float, bar) -> dict:
    n = len(xs)
    run = _Run()
    kill_index = int(kill_at * n)
    wk = pred.workers[victim]
    events: dict[str, float] = {}
    stop = asyncio.Event()

    async def watch() -> None:
        # Poll the worker's state to time the outage: dead -> restarted -> up again.
        seen_down = False
        while not stop.is_set():
            state = wk.state
            if "kill" in events:
                if state != "up" and not seen_down:
                    seen_down = True
                    events["down"] = time.perf_counter()
                elif state == "up" and seen_down and "up" not in events:
                    events["up"] = time.perf_counter()
            await asyncio.sleep(0.002)

    def kill() -> None:
        events["kill"] = time.perf_counter()
        events["pid"] = wk.kill()

    restarts0 = wk.restarts
    await _settle(pred)
    before = pred.counters()
    watcher = asyncio.ensure_future(watch())
    errors_in_outage = 0
    next_start = time.perf_counter()
    try:
        for j in range(n):
            # Paced arrivals: a request that fails fast must not let the next ones rush in, or
            # the error count would measure how quickly errors come back, not the outage.
            wait = next_start - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            next_start = time.perf_counter() + interval_s
            was = len(run.errors)
            await _one(pred, xs[j], refs[j], run, kill=kill if j == kill_index else None)
            if len(run.errors) > was and "kill" in events and "up" not in events:
                errors_in_outage += 1
            bar.update(1)
        await _settle(pred)
        d = _counter_delta(pred, before)
        run.runs, run.compute_ms, run.skipped = d
        # Wait for the rejoin, then check the worker serves again.
        rejoined = await asyncio.to_thread(pred.wait_until_up, victim, rejoin_timeout_s)
        await asyncio.sleep(0.01)
    finally:
        stop.set()
        await watcher
    after = _Run()
    answered0 = pred.counters()["per_worker_runs"][victim]
    for j in range(min(n, 20)):
        await _one(pred, xs[j], refs[j], after)
    await _settle(pred)
    rejoin_runs = pred.counters()["per_worker_runs"][victim] - answered0
    outage = (events["up"] - events["kill"]) if "up" in events and "kill" in events else None
    return run.report({
        "victim": wk.name, "killed_pid": events.get("pid"), "kill_at_request": kill_index,
        "restarted": wk.restarts > restarts0, "rejoined": bool(rejoined),
        "outage_s": round(outage, 3) if outage is not None else None,
        "errors_during_outage": errors_in_outage,
        "after_rejoin": {"requests": after.requests, "errors": len(after.errors),
                         "wrong": after.wrong, "victim_subnet_runs": rejoin_runs},
    })


def run_robust_bench(
    artifact_dir: str | Path,
    out_dir: str | Path,
    *,
    redundancies: Sequence[int] = (0, 1),
    hedges_ms: Sequence[float] = (0.0,),
    scenarios: Sequence[str] = SCENARIOS,
    images: int = 200,
    warmup: int = 20,
    rounds: int = 5,
    delay: str = "exp:50ms",
    straggler: int = 0,
    victim: int = 1,
    kill_at: float = 0.3,
    interval_ms: float = 10.0,
    vote: bool = False,
    deadline_s: float = 5.0,
    restart_delay_s: float = 0.0,
    rejoin_timeout_s: float = 120.0,
    device: str = "cpu",
    runtime: str = "auto",
    threads: int = 1,
    data_dir: str | None = None,
    seed: int = 0,
    command: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the robust benchmark on the artifact in ``artifact_dir``; write robust.json,
    robust.md and robust.png to ``out_dir``; return what robust.json holds.

    ``redundancies`` x ``hedges_ms`` (hedges only for r >= 1) are the configurations, each on
    W = G worker processes.  ``straggler``/``victim``: worker indices that get the ``delay`` /
    the SIGKILL (at request ``kill_at`` x ``images``; in that scenario a request starts every
    ``interval_ms``, or right after the previous one if it took longer).  ``restart_delay_s``: how
    long the pool waits before restarting the dead worker (stretches the outage).
    """
    import torch

    from sensai.data import load_split, normalize, resolve_dataset, stratified_subset
    from sensai.manifest import load_manifest

    from .bench import _bar, _check_out_dir, _load_average, _now, machine_description
    from .robust import robust_predictor

    art = Path(artifact_dir)
    manifest = load_manifest(art)
    g = len(manifest.groups)
    scenarios = [s for s in SCENARIOS if s in set(scenarios)] or list(scenarios)
    redundancies = sorted({int(r) for r in redundancies})
    hedges = sorted({float(h) for h in hedges_ms}) or [0.0]
    _check(redundancies, hedges, scenarios, images, warmup, delay, straggler, victim, kill_at,
           rounds, g, vote, interval_ms)
    spec = manifest.dataset.to_spec().with_data_dir(data_dir)
    resolve_dataset(spec.name, spec.data_dir, spec.input_shape[1])
    out = Path(out_dir)
    _check_out_dir(out)
    t_start = time.perf_counter()

    test = load_split(spec, "test")
    idx = stratified_subset(test.labels, images, seed)
    u8 = torch.stack([test[int(i)][0] for i in idx])
    xs = [normalize(u8[i:i + 1], spec).numpy() for i in range(len(idx))]
    refs = offline_reference(art, manifest, xs, runtime=runtime, threads=threads)
    labels = np.asarray(test.labels)[idx]
    configs = [(r, 0.0) for r in redundancies if r == 0] + [
        (r, h) for r in redundancies if r > 0 for h in hedges]

    result: dict[str, Any] = {
        "kind": "sensai-bench-robust", "schema_version": 1, "command": command,
        "created": _now(), "artifact": str(art.resolve()), "model": manifest.model,
        "dataset": spec.name, "groups": manifest.groups,
        "settings": {"configs": [_config_key(r, h) for r, h in configs],
                     "scenarios": scenarios, "images": len(xs), "warmup": warmup,
                     "rounds": rounds, "workers": g, "vote": vote, "delay": delay,
                     "straggler_worker": straggler, "victim_worker": victim, "kill_at": kill_at,
                     "failure_interval_ms": interval_ms,
                     "deadline_s": deadline_s, "restart_delay_s": restart_delay_s,
                     "device": device, "runtime": runtime, "threads_per_worker": threads,
                     "seed": seed, "batch": 1, "concurrency": 1, "transport": "inprocess"},
        "machine": machine_description(),
        "offline_top1": round(float((refs.argmax(1) == labels).mean()), 5),
    }
    preds: dict[str, Any] = {}
    bar = _bar(progress)
    try:
        # The failure scenario also sends up to 20 requests after the rejoin.
        bar.total = len(configs) * (warmup + len(xs) * len(scenarios))
        bar.refresh()
        for r, h in configs:
            key = _config_key(r, h)
            bar.set_description(f"start {key}")
            preds[key] = robust_predictor(art, redundancy=r, vote=vote, device=device,
                                          runtime=runtime, threads=threads,
                                          deadline_s=deadline_s, hedge_ms=h,
                                          restart_delay_s=restart_delay_s, seed=seed)
        result["placement"] = {k: p.placement for k, p in preds.items()}
        measured = asyncio.run(_measure(preds, scenarios, xs, refs, warmup, rounds, straggler,
                                        delay, victim, kill_at, rejoin_timeout_s,
                                        interval_ms / 1e3, bar))
    finally:
        bar.close()
        for p in preds.values():
            p.shutdown()
    # Compute overheads relative to r = 0 without faults: the work of one full answer.
    base_key = _config_key(0, 0.0) if 0 in redundancies else None
    for key, per in measured.items():
        for scen, rep in per.items():
            base = measured.get(base_key, {}).get("none") if base_key else None
            if base and base["subnet_runs_per_request"]:
                rep["compute_overhead_runs"] = round(
                    rep["subnet_runs_per_request"] / base["subnet_runs_per_request"], 3)
                rep["compute_overhead_time"] = round(
                    rep["compute_ms_per_request"] / base["compute_ms_per_request"], 3) \
                    if base["compute_ms_per_request"] else None
            none = per.get("none")
            if scen != "none" and none and none["latency_ms"]["p99"] and rep["latency_ms"]["p99"]:
                rep["p99_vs_no_fault"] = round(rep["latency_ms"]["p99"]
                                               / none["latency_ms"]["p99"], 3)
    result["configs"] = {k: {"redundancy": r, "hedge_ms": h,
                             "subnets_hosted_per_worker": r * (2 if vote else 1) + 1,
                             "scenarios": measured[k]}
                         for (r, h), k in zip(configs, preds)}
    result["machine"]["load_average_end"] = _load_average()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    from sensai.fsutil import write_json_atomic, write_text_atomic

    write_json_atomic(out / "robust.json", result)
    write_text_atomic(out / "robust.md", render_markdown(result))
    plot(result, out / "robust.png")
    return result


# --------------------------------------------------------------------------------------------
# Reporting


HEADER = ["config", "scenario", "answered", "errors", "wrong", "p50 ms", "p99 ms", "mean ms",
          "p99 / no-fault p99", "subnet runs/req", "compute overhead (runs)",
          "compute overhead (time)", "note"]


def table_rows(result: dict) -> list[list[str]]:
    from .bench import _fmt

    rows = []
    for key, c in result.get("configs", {}).items():
        for scen in SCENARIOS:
            rep = c["scenarios"].get(scen)
            if rep is None:
                continue
            lat = rep["latency_ms"]
            note = ""
            if scen == "straggler" and rep.get("straggler_answered_share") is not None:
                note = (f"{rep['straggler']}'s own groups answered by it: "
                        f"{rep['straggler_answered_share'] * 100:.0f}%")
            if scen == "failure":
                note = (f"outage {_fmt(rep.get('outage_s'))} s, "
                        f"{rep['errors_during_outage']} errors in it; after rejoin "
                        f"{rep['after_rejoin']['requests'] - rep['after_rejoin']['errors']}/"
                        f"{rep['after_rejoin']['requests']} ok")
            rows.append([key, scen, f"{rep['answered']}/{rep['requests']}", str(rep["errors"]),
                         str(rep["wrong"]), _fmt(lat["p50"]), _fmt(lat["p99"]),
                         _fmt(lat["mean"]), _fmt(rep.get("p99_vs_no_fault")),
                         _fmt(rep["subnet_runs_per_request"]),
                         _fmt(rep.get("compute_overhead_runs")),
                         _fmt(rep.get("compute_overhead_time")), note])
    return rows


def render_table(result: dict) -> str:
    from .bench import format_table

    return format_table(HEADER, table_rows(result))


def render_markdown(result: dict) -> str:
    from .bench import _md_table

    st = result["settings"]
    m = result["machine"]
    lines = [
        f"# sensai bench-robust: {result['model']} on {result['dataset']}",
        "",
        f"Command: `{result.get('command') or 'run_robust_bench(...)'}`",
        "",
        f"{len(result['groups'])} subnets on W = {st['workers']} worker processes (cyclic "
        f"placement){', vote mode' if st['vote'] else ''}; {st['images']} real test images per "
        f"scenario at batch 1, concurrency 1, in process, after {st['warmup']} warm-up requests; "
        f"runtime {st['runtime']} on {st['device']}, {st['threads_per_worker']} thread(s) per "
        f"worker; deadline {st['deadline_s']} s.  Straggler: worker {st['straggler_worker']} "
        f"sleeps `{st['delay']}` before each request.  Failure: worker {st['victim_worker']} is "
        f"SIGKILLed while request {int(st['kill_at'] * st['images'])} is in flight, then "
        f"restarted by the pool (restart delay {st['restart_delay_s']} s); in that scenario "
        f"requests start every {st.get('failure_interval_ms', 0):g} ms (paced, so a fast "
        "error does not pull the next request in sooner).",
        "",
        f"Machine: {m['cpu_model']}, {m['usable_cores']} usable cores; load average "
        f"{m.get('load_average')} at the start, {m.get('load_average_end')} at the end.  "
        f"Offline top-1 on these images: {result['offline_top1']}.",
        "",
        _md_table(HEADER, table_rows(result)),
        "",
        "answered/errors: requests answered / answered with an error (503 no live copy, 504 "
        "deadline); latency is over answered requests.  wrong: answers whose top-1 or scores "
        "differ from offline evaluation's.  subnet runs/req: subnets actually computed per "
        "request over all workers (G without redundancy; fewer when requests fail fast); compute "
        "overhead: runs and summed compute time per request relative to r = 0 without "
        "faults.  Each worker hosts r+1 subnets (weights memory (r+1) x).",
        "",
    ]
    cores = m.get("usable_cores")
    if cores and st["workers"] > cores:
        lines += [f"Note: {st['workers']} worker processes per configuration shared {cores} "
                  "cores, so extra copies compete with the primaries for CPU time; on machines "
                  "with a core (or GPU) per worker that competition disappears.", ""]
    lines += ["The cores may have been shared with other work while this ran; compare figures "
              "from one run, not across runs.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sensai.fsutil import atomic_path

    configs = result.get("configs", {})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    data, labels = [], []
    for key, c in configs.items():
        for scen in SCENARIOS:
            rep = c["scenarios"].get(scen)
            if rep and rep["latencies_ms"]:
                data.append(rep["latencies_ms"])
                labels.append(f"{key}\n{scen}")
    if data:
        horizontal = ({"orientation": "horizontal"}
                      if tuple(int(p) for p in matplotlib.__version__.split(".")[:2]) >= (3, 10)
                      else {"vert": False})
        ax.boxplot(data, whis=(1, 99), showfliers=True, flierprops={"markersize": 2},
                   **horizontal)
        ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
    ax.set_xlabel("latency per image (ms, log), whiskers p1-p99")
    ax.set_title("latency by redundancy and scenario")
    ax.grid(axis="x", alpha=0.3)

    ax = axes[1]
    scen = [s for s in SCENARIOS if any(s in c["scenarios"] for c in configs.values())]
    width = 0.8 / max(1, len(configs))
    for i, (key, c) in enumerate(configs.items()):
        p99 = [c["scenarios"].get(s, {}).get("latency_ms", {}).get("p99") or 0 for s in scen]
        errs = [c["scenarios"].get(s, {}).get("errors", 0) for s in scen]
        xs = np.arange(len(scen)) + i * width
        bars = ax.bar(xs, p99, width, label=key)
        for b, e in zip(bars, errs):
            if e:
                ax.annotate(f"{e} err", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7, color="#C44E52")
    ax.set_xticks(np.arange(len(scen)) + width * (len(configs) - 1) / 2, scen)
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title("p99 and errors")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)

"""``sensai bench-swap``: new versions of a model swapped in while a steady load runs.

A model repository in the output directory starts with one version (artifact A); ``sensai serve REPO
--model-control explicit`` serves it in a process of its own
(:class:`~.server.SensaiServe`).  A client process (:mod:`.client`) sends real test
images as PNG uploads to ``/v1/predict`` in one closed loop for the whole run, recording every
request's send time, latency, status, and the version its answer names.  After a warm-up and a
steady period, each swap writes the next version (B, A, B, ... in turn) into the repository
(:func:`~sensai.serving.core.repository.add_version`) and calls
``POST /v2/repository/models/{name}/load``, which returns once the new version is ready and the
old one drained and unloaded, then waits.  The gateway's RSS is sampled throughout, just before
each swap and at the end of each wait.  The figures (:func:`~.swap_report.swap_figures`): per
swap, errors, answers by version, the p99 during the swap against the steady state's, the time to
the first answer by the new version, the RSS before and after.  The load and the watching
are bench-load's (:class:`~.load.LoadRun`).  Outputs: ``swap.json``,
``swap.md``, ``swap.png`` and ``gateway.log``.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from sensai.artifact import Artifact, load_artifact
from sensai.errors import SensaiError
from sensai.serving.core.repository import add_version, check_model_name

from .harness import check_settings, envelope, finish, inputs, load_test_images
from .load import (LoadRun, client_processes, gateway_settings, offline_top1, request_timeout,
                   seconds_bar, sensai_serve)
from .load_measures import columns
from .options import LoadOptions, SwapOptions
from .swap_report import plot, render_markdown, swap_figures


def check_swap_settings(options: SwapOptions) -> None:
    check_settings(options)
    if not Path("/proc/self/status").is_file():
        raise SensaiError("bench-swap reads the gateway's memory from /proc: Linux only")


def check_same_task(a: Artifact, b: Artifact) -> None:
    """The two artifacts must answer the same question: the same dataset and classes."""
    sa, sb = a.manifest.dataset, b.manifest.dataset
    if (sa.name, list(sa.classes), list(sa.input_shape)) != \
            (sb.name, list(sb.classes), list(sb.input_shape)):
        raise SensaiError(f"{a.root} and {b.root} are not versions of one model: one is for "
                          f"{sa.name} {list(sa.input_shape)}, the other for {sb.name} "
                          f"{list(sb.input_shape)} (or their classes differ)")


def repository_dir(out: Path) -> Path:
    repo = out / "repo"
    if repo.exists():
        raise SensaiError(f"{repo} already exists: remove it, or choose another --out")
    return repo


def request_load(url: str, name: str, timeout_s: float) -> dict[str, Any]:
    """``POST /v2/repository/models/{name}/load``: when it was sent and when it returned (s of
    ``time.monotonic()``), its status and its answer (status 0: no answer)."""
    sent = time.monotonic()
    try:
        resp = httpx.post(f"{url}/v2/repository/models/{name}/load", json={},
                          timeout=timeout_s)
        status, text = resp.status_code, resp.text[:500]
    except httpx.HTTPError as e:
        status, text = 0, f"{type(e).__name__}: {e}"
    return {"sent": sent, "returned": time.monotonic(), "status": status, "answer": text}


class SwapRun:
    """The swaps while the client's closed loop (``load``) runs in the background of ``run``,
    which samples the RSS and watches the gateway and the client."""

    def __init__(self, run: LoadRun, load: Future):
        self.run, self.load = run, load
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="bench-swap")  # the load calls

    def wait(self, phase: str, **how) -> None:
        """As :meth:`~.load.LoadRun.watch` takes ``how``; the client's loop ending here is an
        error: it runs until the last swap's wait is over."""
        if self.run.watch(phase, [self.load], **how):
            raise SensaiError(f"the load client stopped during the {phase}: "
                              f"{self.load.exception() or 'its phase ended early'}")

    def swaps(self, name: str, repo: Path, artifacts: tuple[Artifact, Artifact], first: str,
              *, count: int, after_s: float, timeout_s: float) -> list[dict[str, Any]]:
        """``count`` swaps, the second artifact and the first in turn: each writes the next
        version and loads it, then waits ``after_s``; their records (times in seconds since the
        gateway was ready)."""
        records, serving = [], first
        for i in range(1, count + 1):
            artifact = artifacts[i % 2]
            self.run.sampler.sample(f"before swap {i}")
            t = time.monotonic()
            version = str(add_version(repo, name, artifact.root))
            copy_s = time.monotonic() - t
            call = self.pool.submit(request_load, self.run.server.url, name, timeout_s)
            self.wait(f"swap {i}", until=call.done)
            load = call.result()
            records.append({"swap": i, "version": version, "from_version": serving,
                            "artifact": str(artifact.root), "artifact_name": artifact.root.name,
                            "copy_s": round(copy_s, 3), "load_status": load["status"],
                            "load_answer": load["answer"],
                            "sent_s": round(load["sent"] - self.run.t0, 3),
                            "returned_s": round(load["returned"] - self.run.t0, 3)})
            self.wait(f"swap {i}", seconds=after_s)
            after = self.run.sampler.sample(f"after swap {i}")
            self.run.say(f"swap {i}/{count}: version {serving} -> {version} "
                         f"({artifact.root.name}): "
                         + (f"loaded in {load['returned'] - load['sent']:.2f} s"
                            if load["status"] == 200 else
                            f"refused: {load['status']} {load['answer'][:200]}")
                         + (f"; gateway RSS {after['rss_mb']:.1f} MB" if after else ""))
            serving = version if load["status"] == 200 else serving
        return records


def run_swap_bench(artifact_a: str | Path, artifact_b: str | Path, out_dir: str | Path,
                   options: SwapOptions) -> dict[str, Any]:
    """Swap versions of one model (artifacts A and B in turn) ``options.swaps`` times under a
    steady closed loop at ``options.concurrency``; write swap.json, swap.md, swap.png (and
    gateway.log) to ``out_dir``; return what swap.json holds.  ``options.model``: the name in
    the repository (default: A's model); the repository (``out_dir/repo``) is removed at the end
    unless ``options.keep_repo``."""
    check_swap_settings(options)
    # The gateway's settings, as bench-load's.
    served = LoadOptions(backend=options.backend, startup_timeout=options.startup_timeout)
    gs, gateway_env = gateway_settings(served)
    a, b = load_artifact(artifact_a), load_artifact(artifact_b)
    check_same_task(a, b)
    options = replace(options, model=check_model_name(options.model or a.manifest.model))
    spec, out = inputs(a, options.data_dir, out_dir)
    repo = repository_dir(out)
    t_start = time.perf_counter()

    imgs = load_test_images(spec, options.images, options.seed, png=True)
    reference = {x.root: offline_top1(x, imgs.xs, gs) for x in (a, b)}
    result = envelope("sensai-bench-swap", command=options.command, artifact=a, spec=spec,
                      settings=swap_settings(options, (a, b), gs, images=len(imgs), repo=repo))
    try:
        swap_under_load(result, options, request_timeout(gs), served, gateway_env,
                        out / "gateway.log", repo, (a, b), imgs.pngs, reference)
    finally:
        if not options.keep_repo:
            shutil.rmtree(repo, ignore_errors=True)
    result["repository_kept"] = options.keep_repo
    finish(out, "swap", result, t_start, render_markdown, plot)
    return result


def swap_settings(options: SwapOptions, artifacts: tuple[Artifact, Artifact], gs, *,
                  images: int, repo: Path) -> dict[str, Any]:
    """swap.json's ``settings``."""
    a, b, o = *artifacts, options
    return {"model": o.model, "artifacts": [str(a.root), str(b.root)],
            "groups": [len(a.groups), len(b.groups)], "backend": gs.backend,
            "swaps": o.swaps, "concurrency": o.concurrency, "warmup_s": o.warmup_seconds,
            "steady_s": o.steady_seconds, "after_s": o.after_seconds,
            "sample_s": o.sample_seconds, "load_timeout_s": o.load_timeout, "images": images,
            "seed": o.seed, "request_timeout_s": request_timeout(gs), "transport": "http",
            "upload": "PNG as the raw body of POST /v1/predict", "repository": str(repo)}


def swap_under_load(result: dict[str, Any], options: SwapOptions, request_timeout_s: float,
                    served: LoadOptions, env: dict[str, str], log_path: Path, repo: Path,
                    artifacts: tuple[Artifact, Artifact], pngs: list[bytes],
                    reference: dict[Path, list[int]]) -> None:
    """The gateway started on the first artifact's version, the client's closed loop on it
    through the warm-up, the steady period and the swaps; the client and the gateway stopped
    after, whatever happens.  Into ``result``: the swaps' figures (each answer checked against
    ``reference``, the offline answers of the version that gave it), the gateway's report, and
    every request."""
    first = str(add_version(repo, options.model, artifacts[0].root))
    bar = seconds_bar(options, "bench-swap")
    try:
        with client_processes(1, pngs) as procs, \
                sensai_serve(served, repo, env, log_path,
                             args=["--model-control", "explicit"]) as gateway:
            run = LoadRun(gateway, procs, expected=[], concurrency=options.concurrency,
                          timeout_s=request_timeout_s, sample_s=options.sample_seconds, bar=bar,
                          progress=options.progress)
            run.say(f"gateway pid {gateway.serving_pid} ready at {gateway.url} in "
                    f"{gateway.startup_s} s serving {options.model} version {first}; its "
                    f"output: {gateway.log_path}")
            plan = {"concurrency": options.concurrency, "seconds": options.longest_s(),
                    "answers": True, "timeout_s": request_timeout_s}
            o = options
            bar.reset(total=round(o.warmup_seconds + o.steady_seconds
                                  + o.swaps * o.after_seconds, 1))
            with run.background([plan]) as futures:
                swaps = SwapRun(run, futures[0])
                try:
                    swaps.wait("warm-up", seconds=options.warmup_seconds)
                    steady_start = time.monotonic() - run.t0
                    swaps.wait("steady", seconds=options.steady_seconds)
                    records = swaps.swaps(options.model, repo, artifacts, first,
                                          count=options.swaps, after_s=options.after_seconds,
                                          timeout_s=options.load_timeout)
                finally:
                    procs[0].stop_load()
                    swaps.pool.shutdown(wait=True)
                outs = run.collect("swaps", futures, timeout_s=request_timeout_s + 60.0)
    finally:
        bar.close()
    expected = {first: reference[artifacts[0].root]} | {
        r["version"]: reference[Path(r["artifact"])] for r in records}
    req = columns(outs, run.t0)
    result["figures"] = swap_figures(req, first_version=first, swaps=records,
                                     steady_start_s=steady_start,
                                     rss_samples=run.sampler.samples, expected=expected,
                                     failures=outs[0]["failures"])
    result |= gateway.report(run.sampler.samples)
    result["requests"] = {"t": [round(float(x), 4) for x in req["t"]],
                          "ms": [round(float(x), 3) for x in req["ms"]],
                          "status": [int(x) for x in req["status"]],
                          "version": list(req["version"])}

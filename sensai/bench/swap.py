"""``sensai bench-swap``: new versions of a model swapped in while a steady load runs.

A model repository in the output directory starts with one version (artifact A); ``sensai serve REPO
--model-control explicit`` serves it in a process of its own
(:class:`~.gateway_process.GatewayProcess`).  A client process (:mod:`.client`) sends real test
images as PNG uploads to ``/v1/predict`` in one closed loop for the whole run, recording every
request's send time, latency, status, and the version its answer names.  After a warm-up and a
steady period, each swap writes the next version (B, A, B, ... in turn) into the repository
(:func:`~sensai.serving.core.repository.add_version`) and calls
``POST /v2/repository/models/{name}/load``, which returns once the new version is ready and the
old one drained and unloaded, then waits.  The gateway's RSS is sampled throughout, just before
each swap and at the end of each wait.  The figures (:func:`~.swap_figures.swap_figures`): per
swap, errors, answers by version, the p99 during the swap against the steady state's, the time to
the first answer by the new version, the RSS before and after.  Outputs: ``swap.json``,
``swap.md``, ``swap.png`` and ``gateway.log``.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import httpx

from sensai.artifact import Artifact, load_artifact
from sensai.errors import SensaiError
from sensai.serving.core.repository import add_version, check_model_name

from .client import HttpClientProcess
from .gateway_process import GatewayProcess, sigterm_as_exit
from .harness import check_settings, envelope, finish, inputs, load_test_images
from .load import gateway_process, gateway_settings, request_timeout
from .load_measures import RssSampler
from .options import LoadOptions, SwapOptions
from .robust import offline_reference
from .swap_figures import columns, swap_figures
from .swap_report import plot, render_markdown


def check_swap_settings(options: SwapOptions) -> None:
    o = options
    check_settings(
        ints=(("--swaps", o.swaps, 1), ("--concurrency", o.concurrency, 1),
              ("--images", o.images, 1)),
        numbers=(("--set warmup_seconds", o.warmup_seconds, True),
                 ("--set steady_seconds", o.steady_seconds, False),
                 ("--set after_seconds", o.after_seconds, True),
                 ("--set sample_seconds", o.sample_seconds, False),
                 ("--set load_timeout", o.load_timeout, False),
                 ("--set startup_timeout", o.startup_timeout, False)))
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


@dataclass(frozen=True)
class SwapOutcome:
    """What the swaps under load recorded: the first version, the run's start (monotonic), when
    the steady period began (s from it), the RSS samples, each swap's record and the client's
    phase."""

    first: str
    t0: float
    steady_start: float
    samples: list[dict[str, Any]]
    records: list[dict[str, Any]]
    outs: list[dict[str, Any]]


class SwapRun:
    """The running benchmark: the gateway, the client's closed loop in the background, the RSS
    sampler; all sampling and checks happen in the calling thread."""

    def __init__(self, gateway: GatewayProcess, sampler: RssSampler, pool: ThreadPoolExecutor,
                 load: Future, *, progress: bool, request_timeout_s: float):
        self.gateway, self.sampler, self.pool, self.load = gateway, sampler, pool, load
        self.progress, self.request_timeout_s = progress, request_timeout_s

    def say(self, message: str) -> None:
        if self.progress:
            print(message, file=sys.stderr, flush=True)

    def wait(self, phase: str, *, seconds: float = math.inf,
             until: Callable[[], bool] = lambda: False) -> None:
        """For ``seconds``, or until ``until()``: sample the RSS when due, and end the run at
        once if the gateway or the client is gone."""
        end = time.monotonic() + seconds
        self.sampler.sample(phase)
        while not until() and time.monotonic() < end:
            if self.sampler.due():
                self.sampler.sample(phase)
            died = self.gateway.died()
            if died:
                raise SensaiError(f"during the {phase}, {died}")
            if self.load.done():
                error = self.load.exception()
                raise SensaiError(f"the load client stopped during the {phase}: "
                                  f"{error or 'its phase ended early'}")
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def swap(self, i: int, name: str, repo: Path, artifact: Artifact, serving: str,
             timeout_s: float) -> dict[str, Any]:
        """Swap ``i``: the next version written and loaded; returns its record (monotonic
        times)."""
        self.sampler.sample(f"before swap {i}")
        t = time.monotonic()
        version = str(add_version(repo, name, artifact.root))
        copy_s = time.monotonic() - t
        call = self.pool.submit(request_load, self.gateway.url, name, timeout_s)
        self.wait(f"swap {i}", until=call.done)
        load = call.result()
        return {"swap": i, "version": version, "from_version": serving,
                "artifact": str(artifact.root), "artifact_name": artifact.root.name,
                "copy_s": round(copy_s, 3), "sent": load["sent"], "returned": load["returned"],
                "load_status": load["status"], "load_answer": load["answer"]}

    def swaps(self, name: str, repo: Path, artifacts: tuple[Artifact, Artifact], first: str,
              *, count: int, after_s: float, timeout_s: float) -> list[dict[str, Any]]:
        """``count`` swaps, the second artifact and the first in turn, each followed by a wait
        of ``after_s``: their records."""
        records, serving = [], first
        for i in range(1, count + 1):
            artifact = artifacts[i % 2]
            rec = self.swap(i, name, repo, artifact, serving, timeout_s)
            records.append(rec)
            ok = rec["load_status"] == 200
            serving = rec["version"] if ok else serving
            self.wait(f"swap {i}", seconds=after_s)
            after = self.sampler.sample(f"after swap {i}")
            self.say(f"swap {i}/{count}: version {rec['from_version']} -> {rec['version']} "
                     f"({artifact.root.name}): "
                     + (f"loaded in {rec['returned'] - rec['sent']:.2f} s" if ok else
                        f"refused: {rec['load_status']} {rec['load_answer'][:200]}")
                     + (f"; gateway RSS {after['rss_mb']:.1f} MB" if after else ""))
        return records

    def phases(self, options: SwapOptions, client: HttpClientProcess, repo: Path,
               artifacts: tuple[Artifact, Artifact], first: str, t0: float
               ) -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
        """The warm-up, the steady period and the swaps under the client's closed loop, which
        is then stopped: when the steady period began (s from ``t0``), the swaps' records, and
        the client's phase."""
        try:
            self.wait("warm-up", seconds=options.warmup_seconds)
            steady_start = time.monotonic() - t0
            self.wait("steady", seconds=options.steady_seconds)
            records = self.swaps(options.model, repo, artifacts, first, count=options.swaps,
                                 after_s=options.after_seconds, timeout_s=options.load_timeout)
        finally:
            client.stop_load()
        try:
            outs = [self.load.result(timeout=self.request_timeout_s + 60.0)]
        except (RuntimeError, EOFError, OSError, TimeoutError) as e:
            raise SensaiError(f"the load client: {e}") from None
        return steady_start, records, outs


def run_swap_bench(artifact_a: str | Path, artifact_b: str | Path, out_dir: str | Path,
                   options: SwapOptions) -> dict[str, Any]:
    """Swap versions of one model (artifacts A and B in turn) ``options.swaps`` times under a
    steady closed loop at ``options.concurrency``; write swap.json, swap.md, swap.png (and
    gateway.log) to ``out_dir``; return what swap.json holds.  ``options.model``: the name in
    the repository (default: A's model); the repository (``out_dir/repo``) is removed at the end
    unless ``options.keep_repo``."""
    check_swap_settings(options)
    served = LoadOptions(backend=options.backend)  # the gateway's settings, as bench-load's
    gs, gateway_env = gateway_settings(served)
    a, b = load_artifact(artifact_a), load_artifact(artifact_b)
    check_same_task(a, b)
    options = replace(options, model=check_model_name(options.model or a.manifest.model))
    spec, out = inputs(a, options.data_dir, out_dir)
    repo = repository_dir(out)
    t_start = time.perf_counter()

    imgs = load_test_images(spec, options.images, options.seed, png=True)
    reference = {a.root: [int(i) for i in offline_reference(a, imgs.xs).argmax(1)],
                 b.root: [int(i) for i in offline_reference(b, imgs.xs).argmax(1)]}
    result = envelope("sensai-bench-swap", command=options.command, artifact=a, spec=spec,
                      settings=swap_settings(options, (a, b), gs, images=len(imgs), repo=repo))
    gateway = gateway_process(served, repo, gateway_env, out / "gateway.log",
                              args=["--model-control", "explicit"])
    try:
        outcome = swap_under_load(options, request_timeout(gs), gateway, repo, (a, b),
                                  imgs.pngs)
    finally:
        if not options.keep_repo:
            shutil.rmtree(repo, ignore_errors=True)
    add_figures(result, outcome, reference, a, gateway)
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


def swap_under_load(options: SwapOptions, request_timeout_s: float, gateway: GatewayProcess,
                    repo: Path, artifacts: tuple[Artifact, Artifact],
                    pngs: list[bytes]) -> SwapOutcome:
    """The gateway started on the first artifact's version, the client's closed loop on it, the
    swaps; the client and the gateway stopped after, whatever happens."""
    client: HttpClientProcess | None = None
    load: Future | None = None
    pool = ThreadPoolExecutor(2, thread_name_prefix="bench-swap")
    try:
        with sigterm_as_exit():
            first = str(add_version(repo, options.model, artifacts[0].root))
            gateway.launch()
            client = HttpClientProcess(pngs)
            gateway.wait_ready(options.startup_timeout)
            t0 = time.monotonic()
            sampler = RssSampler(gateway.serving_pid, t0, options.sample_seconds,
                                 tree_of=gateway.pid)
            load = pool.submit(client.load, gateway.url, concurrency=options.concurrency,
                               seconds=options.longest_s(), answers=True,
                               timeout_s=request_timeout_s)
            run = SwapRun(gateway, sampler, pool, load, progress=options.progress,
                          request_timeout_s=request_timeout_s)
            run.say(f"gateway pid {gateway.serving_pid} ready at {gateway.url} in "
                    f"{gateway.startup_s} s serving {options.model} version {first}; its "
                    f"output: {gateway.log_path}")
            steady_start, records, outs = run.phases(options, client, repo, artifacts, first,
                                                     t0)
    finally:
        if client is not None and load is not None and not load.done():
            client.process.kill()  # unblocks the thread waiting for its answer
        pool.shutdown(wait=True)
        with ThreadPoolExecutor(2, thread_name_prefix="bench-swap-stop") as stopping:
            waits = [stopping.submit(gateway.stop)]
            if client is not None:
                waits.append(stopping.submit(client.close))
            for w in waits:
                w.result()
    return SwapOutcome(first=first, t0=t0, steady_start=steady_start, samples=sampler.samples,
                       records=records, outs=outs)


def add_figures(result: dict[str, Any], outcome: SwapOutcome,
                reference: dict[Path, list[int]], first_artifact: Artifact,
                gateway: GatewayProcess) -> None:
    """The swaps' figures (each answer checked against the offline answers of the version that
    gave it), the gateway's report, and every request."""
    o = outcome
    expected = {o.first: reference[first_artifact.root]} | {
        r["version"]: reference[Path(r["artifact"])] for r in o.records}
    req = columns(o.outs, o.t0)
    swaps_rel = [{k: v for k, v in r.items() if k not in ("sent", "returned")}
                 | {"sent_s": round(r["sent"] - o.t0, 3),
                    "returned_s": round(r["returned"] - o.t0, 3)}
                 for r in o.records]
    result["figures"] = swap_figures(req, first_version=o.first, swaps=swaps_rel,
                                     steady_start_s=o.steady_start,
                                     rss_samples=o.samples, expected=expected,
                                     failures=o.outs[0]["failures"])
    result |= gateway.report(o.samples)
    result["requests"] = {"t": [round(float(x), 4) for x in req["t"]],
                          "ms": [round(float(x), 3) for x in req["ms"]],
                          "status": [int(x) for x in req["status"]],
                          "version": list(req["version"])}

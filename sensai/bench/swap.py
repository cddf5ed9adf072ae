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
each swap and at the end of each wait.  The figures (:func:`~.swap_report.swap_figures`): per
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from sensai.artifact import Artifact, load_artifact
from sensai.errors import SensaiError
from sensai.serving.core.repository import add_version, check_model_name

from .client import HttpClientProcess
from .gateway_process import GatewayProcess, sigterm_as_exit
from .harness import check_settings, envelope, finish, inputs, load_test_images
from .load import LoadOptions, request_timeout
from .load_measures import RssSampler
from .robust import offline_reference
from .swap_report import columns, plot, render_markdown, swap_figures


def check_swap_settings(*, swaps: int, concurrency: int, warmup_s: float, steady_s: float,
                        after_s: float, sample_s: float, load_timeout_s: float, images: int,
                        startup_timeout_s: float) -> None:
    check_settings(
        ints=(("--swaps", swaps, 1), ("--concurrency", concurrency, 1), ("--images", images, 1)),
        numbers=(("--warmup-seconds", warmup_s, True), ("--steady-seconds", steady_s, False),
                 ("--after-seconds", after_s, True), ("--sample-seconds", sample_s, False),
                 ("--load-timeout", load_timeout_s, False),
                 ("--startup-timeout", startup_timeout_s, False)))
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
class SwapPlan:
    """What the swaps under load are given of ``bench-swap``'s options: the model's name in the
    repository, the swaps, the closed loop and its phases, and the timeouts."""

    name: str
    swaps: int
    concurrency: int
    warmup_s: float
    steady_s: float
    after_s: float
    sample_s: float
    load_timeout_s: float
    startup_timeout_s: float
    request_timeout_s: float

    def longest_s(self) -> float:
        """The closed loop is stopped when the last swap's wait is over; until then, it runs
        as long as the longest run the settings allow."""
        return (self.warmup_s + self.steady_s
                + self.swaps * (self.after_s + self.load_timeout_s + 60.0) + 60.0)


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
                 load: Future, progress: bool):
        self.gateway, self.sampler, self.pool, self.load = gateway, sampler, pool, load
        self.progress = progress

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

    def phases(self, plan: SwapPlan, client: HttpClientProcess, repo: Path,
               artifacts: tuple[Artifact, Artifact], first: str, t0: float
               ) -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
        """The warm-up, the steady period and the swaps under the client's closed loop, which
        is then stopped: when the steady period began (s from ``t0``), the swaps' records, and
        the client's phase."""
        try:
            self.wait("warm-up", seconds=plan.warmup_s)
            steady_start = time.monotonic() - t0
            self.wait("steady", seconds=plan.steady_s)
            records = self.swaps(plan.name, repo, artifacts, first, count=plan.swaps,
                                 after_s=plan.after_s, timeout_s=plan.load_timeout_s)
        finally:
            client.stop_load()
        try:
            outs = [self.load.result(timeout=plan.request_timeout_s + 60.0)]
        except (RuntimeError, EOFError, OSError, TimeoutError) as e:
            raise SensaiError(f"the load client: {e}") from None
        return steady_start, records, outs


def run_swap_bench(
    artifact_a: str | Path,
    artifact_b: str | Path,
    out_dir: str | Path,
    *,
    model: str | None = None,
    swaps: int = 5,
    concurrency: int = 8,
    warmup_s: float = 5.0,
    steady_s: float = 10.0,
    after_s: float = 10.0,
    backend: str | None = None,
    sample_s: float = 0.5,
    load_timeout_s: float = 600.0,
    images: int = 200,
    data_dir: str | None = None,
    seed: int = 0,
    startup_timeout_s: float = 180.0,
    keep_repo: bool = False,
    command: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Swap versions of one model (artifacts A and B in turn) ``swaps`` times under a steady
    closed loop at ``concurrency``; write swap.json, swap.md, swap.png (and gateway.log) to
    ``out_dir``; return what swap.json holds.  ``model``: the name in the repository (default:
    A's model); the repository (``out_dir/repo``) is removed at the end unless ``keep_repo``."""
    check_swap_settings(swaps=swaps, concurrency=concurrency, warmup_s=warmup_s,
                        steady_s=steady_s, after_s=after_s, sample_s=sample_s,
                        load_timeout_s=load_timeout_s, images=images,
                        startup_timeout_s=startup_timeout_s)
    options = LoadOptions(backend=backend)
    gs, gateway_env = options.gateway_settings()
    a, b = load_artifact(artifact_a), load_artifact(artifact_b)
    check_same_task(a, b)
    name = check_model_name(model or a.manifest.model)
    spec, out = inputs(a, data_dir, out_dir)
    repo = repository_dir(out)
    t_start = time.perf_counter()

    imgs = load_test_images(spec, images, seed, png=True)
    reference = {a.root: [int(i) for i in offline_reference(a, imgs.xs).argmax(1)],
                 b.root: [int(i) for i in offline_reference(b, imgs.xs).argmax(1)]}
    plan = SwapPlan(name=name, swaps=swaps, concurrency=concurrency, warmup_s=warmup_s,
                    steady_s=steady_s, after_s=after_s, sample_s=sample_s,
                    load_timeout_s=load_timeout_s, startup_timeout_s=startup_timeout_s,
                    request_timeout_s=request_timeout(gs))
    result = envelope("sensai-bench-swap", command=command, artifact=a, spec=spec,
                      settings=swap_settings(plan, (a, b), gs, images=len(imgs), seed=seed,
                                             repo=repo))
    gateway = options.gateway(repo, gateway_env, out / "gateway.log",
                              args=["--model-control", "explicit"])
    try:
        outcome = swap_under_load(plan, gateway, repo, (a, b), imgs.pngs, progress)
    finally:
        if not keep_repo:
            shutil.rmtree(repo, ignore_errors=True)
    add_figures(result, outcome, reference, a, gateway)
    result["repository_kept"] = keep_repo
    finish(out, "swap", result, t_start, render_markdown, plot)
    return result


def swap_settings(plan: SwapPlan, artifacts: tuple[Artifact, Artifact], gs, *, images: int,
                  seed: int, repo: Path) -> dict[str, Any]:
    """swap.json's ``settings``."""
    a, b = artifacts
    return {"model": plan.name, "artifacts": [str(a.root), str(b.root)],
            "groups": [len(a.groups), len(b.groups)], "backend": gs.backend,
            "swaps": plan.swaps, "concurrency": plan.concurrency, "warmup_s": plan.warmup_s,
            "steady_s": plan.steady_s, "after_s": plan.after_s, "sample_s": plan.sample_s,
            "load_timeout_s": plan.load_timeout_s, "images": images, "seed": seed,
            "request_timeout_s": plan.request_timeout_s, "transport": "http",
            "upload": "PNG as the raw body of POST /v1/predict", "repository": str(repo)}


def swap_under_load(plan: SwapPlan, gateway: GatewayProcess, repo: Path,
                    artifacts: tuple[Artifact, Artifact], pngs: list[bytes],
                    progress: bool) -> SwapOutcome:
    """The gateway started on the first artifact's version, the client's closed loop on it, the
    swaps; the client and the gateway stopped after, whatever happens."""
    client: HttpClientProcess | None = None
    load: Future | None = None
    pool = ThreadPoolExecutor(2, thread_name_prefix="bench-swap")
    try:
        with sigterm_as_exit():
            first = str(add_version(repo, plan.name, artifacts[0].root))
            gateway.launch()
            client = HttpClientProcess(pngs)
            gateway.wait_ready(plan.startup_timeout_s)
            t0 = time.monotonic()
            sampler = RssSampler(gateway.serving_pid, t0, plan.sample_s, tree_of=gateway.pid)
            load = pool.submit(client.load, gateway.url, concurrency=plan.concurrency,
                               seconds=plan.longest_s(), answers=True,
                               timeout_s=plan.request_timeout_s)
            run = SwapRun(gateway, sampler, pool, load, progress)
            run.say(f"gateway pid {gateway.serving_pid} ready at {gateway.url} in "
                    f"{gateway.startup_s} s serving {plan.name} version {first}; its output: "
                    f"{gateway.log_path}")
            steady_start, records, outs = run.phases(plan, client, repo, artifacts, first, t0)
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

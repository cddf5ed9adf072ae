"""Running the subnets' retraining jobs: one after another in this process, or as Ray tasks
spread over a cluster's nodes (a task whose node is lost runs again elsewhere).

Retraining is the decomposition's longest step, so both ways show one live progress bar over the
images of every subnet (done / total, images/s, time left).  In process, the training loop calls
:meth:`RetrainProgress.report` directly; on Ray, each task sends its count to a small actor
(:class:`ProgressBoard`) that the driver reads while it waits for the tasks.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterator

from tqdm.auto import tqdm

from sensai.errors import SensaiError
from sensai.models import device_for_worker
from sensai.optional import installed, require
from sensai.raycluster import connect, error_text

from .retrain import retrain_state

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the driver reads the Ray tasks' counts, and tasks send theirs at most


class RetrainProgress:
    """The console's view of a retraining: images done over all subnets, and subnets done.

    Counts are per subnet and absolute (images of its plan done so far), so a task that is run
    again after a lost node starts its count over instead of adding to it.
    """

    def __init__(self, subnets: int, images: int, desc: str = "retrain") -> None:
        self.subnets, self.images = subnets, images
        self.done: dict[int, int] = {}
        self.finished = 0
        self.updates = 0  # how many times the counts changed (the bar moved)
        self._bar = tqdm(total=images, desc=desc, unit="img", dynamic_ncols=True)
        self._bar.set_postfix_str(f"subnets 0/{subnets}")

    def report(self, subnet: int, done: int) -> None:
        """Subnet ``subnet`` has retrained on ``done`` images of its plan so far."""
        if self.done.get(subnet) == done:
            return
        self.done[subnet] = done
        self.updates += 1
        self._bar.update(sum(self.done.values()) - self._bar.n)

    def subnet_finished(self) -> None:
        self.finished += 1
        self._bar.set_postfix_str(f"subnets {self.finished}/{self.subnets}")

    @property
    def total_done(self) -> int:
        return sum(self.done.values())

    def close(self) -> None:
        self._bar.close()
        log.debug("retrained %d of %d subnets on %d of %d images", self.finished, self.subnets,
                 self.total_done, self.images)

    def __enter__(self) -> "RetrainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProgressBoard:
    """Ray actor: the latest count of every subnet's task, for the driver to read."""

    def __init__(self) -> None:
        self.done: dict[int, int] = {}

    def report(self, subnet: int, done: int) -> None:
        self.done[subnet] = done

    def counts(self) -> dict[int, int]:
        return dict(self.done)


def ray_or_in_process(address: str | None) -> bool:
    """Whether the retraining runs on Ray: where Ray is not installed, it runs in this process
    (one warning says so), unless a cluster was named (``address``, else ``RAY_ADDRESS``):
    only Ray can reach that, so that run stops here in one line."""
    if installed("ray"):
        return True
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        require("ray", f"retraining on the Ray cluster at {address}")
    log.warning("Ray is not installed: retraining the subnets one after another in this process")
    return False


def run_in_process(jobs: Iterator[dict], retrain_fn: Callable, device: str,
                   progress: RetrainProgress, on_done: Callable, failures: dict[int, str],
                   at_once: int = 1) -> None:
    """Retrain the jobs in this process, ``at_once`` at a time: one after another by default;
    more at once run a thread each, and on CUDA a stream each on the GPUs in turn (``cuda``
    with two GPUs: jobs 0, 2, 4... on the first), so the subnets on one GPU overlap their
    kernels where one small subnet alone leaves it idle."""
    lock = threading.Lock()  # the bar and the files of finished subnets, one thread at a time

    def one(job: dict, device: str) -> None:
        g = job.pop("index")

        def report(n: int) -> None:
            with lock:
                progress.report(g, n)

        try:
            with stream_for(device, at_once > 1):
                state, metrics = retrain_fn(**job, device=device, progress=report)
        except Exception as e:  # one subnet's failure must not lose the others
            log.error("retraining subnet %d failed: %s", g, e)
            with lock:
                failures[g] = f"{type(e).__name__}: {e}"
        else:
            with lock:
                on_done(g, state, metrics)
        with lock:
            progress.subnet_finished()

    if at_once <= 1:
        for job in jobs:
            one(job, device)
        return
    with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="retrain") as pool:
        running: set[Future] = set()
        for k, job in enumerate(jobs):  # one at a time: at most at_once are in memory
            if len(running) >= at_once:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()  # what on_done raised (a full disk) stops the run, as in series
            running.add(pool.submit(one, job, device_for_worker(k, device)))
        for f in running:
            f.result()


def stream_for(device: str, own: bool) -> ContextManager:
    """A CUDA stream of the thread's own when ``own`` and ``device`` is CUDA, so subnets trained
    side by side are not ordered one behind the other on the default stream."""
    if not (own and device.startswith("cuda")):
        return nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.Stream(torch.device(device)))


def gpu_share(cluster_gpus: float, at_once: int) -> float:
    """The GPUs one retraining task asks Ray for so that ``at_once`` tasks run together: a whole
    GPU each while there are enough, else the share of one GPU that lets the tasks on the
    busiest GPU fit (a task never spans GPUs: 3 tasks on 2 GPUs get half of one each), rounded
    down to the 1/10,000 that Ray resolves."""
    if cluster_gpus >= at_once:
        return 1.0
    per_gpu = math.ceil(at_once / max(1.0, math.floor(cluster_gpus)))
    return max(1e-4, math.floor(1e4 / per_gpu) / 1e4)


def retrain_on_node(board, subnet: int, **job) -> tuple[dict, dict]:
    """``retrain_state`` as a Ray task reporting to ``board``; the metrics name the node that
    did the work."""
    import ray

    last = {"t": 0.0, "ref": None}

    def report(n: int, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - last["t"] >= POLL_S:  # no faster than the driver reads
            last["t"], last["ref"] = now, board.report.remote(subnet, n)

    state, metrics = retrain_state(**job, progress=report)
    report(metrics["samples"], final=True)
    # One caller's calls to an actor run in order: once the last is in, so are all the others,
    # and the driver's final reading is complete.
    ray.get(last["ref"])
    return state, {**metrics, "node": ray.get_runtime_context().get_node_id()}


def run_on_ray(jobs: Iterator[dict], workers: int, device: str, progress: RetrainProgress,
               on_done: Callable, failures: dict[int, str], address: str | None) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = connect(address)
    board = None
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        if device != "cpu" and gpus >= 1:
            # The task sees only the GPU Ray gave it, so "cuda" there is always the right one;
            # with more subnets at once than GPUs, several tasks share one (a process each).
            options = {"num_gpus": gpu_share(gpus, workers), "num_cpus": 1}
            task_device, threads = "cuda", None
        else:
            if device.startswith("cuda"):
                raise SensaiError(f"device {device} requested but the Ray cluster has no GPU")
            options, task_device, threads = {"num_cpus": 1}, "cpu", 1
        # No CPU of its own: the board only stores numbers and must not take a task's core. On
        # the driver's node: losing a worker node must cost only its tasks, never the board.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        board = ray.remote(num_cpus=0)(ProgressBoard).options(scheduling_strategy=here).remote()
        # SPREAD: subnets go to different nodes when there are several; a task whose node dies
        # is run again elsewhere (a subnet's retraining is deterministic, so a rerun is the same).
        remote = ray.remote(retrain_on_node).options(max_retries=3, scheduling_strategy="SPREAD",
                                                     **options)

        def read_board() -> None:
            for g, n in ray.get(board.counts.remote()).items():
                progress.report(g, n)

        pending: dict = {}
        it = iter(jobs)
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < workers:
                job = next(it, None)
                if job is None:
                    exhausted = True
                    break
                g = job.pop("index")
                pending[remote.remote(board, g, **job, device=task_device, threads=threads)] = g
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            read_board()
            for ref in done:
                g = pending.pop(ref)
                try:
                    state, metrics = ray.get(ref)
                except ray.exceptions.RayError as e:
                    failures[g] = error_text(e)
                    log.error("retraining subnet %d failed: %s", g, failures[g])
                else:
                    on_done(g, state, metrics)
                progress.subnet_finished()
    finally:
        if board is not None and not started:  # a cluster that outlives this run
            ray.kill(board)
        if started:
            ray.shutdown()

"""Running the subnets' retraining jobs: one after another in this process, or as Ray tasks
spread over a cluster's nodes (a task whose node is lost runs again elsewhere)."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from tqdm.auto import tqdm

from sensai.errors import SensaiError
from sensai.raycluster import connect, error_text

from .retrain import retrain_state

log = logging.getLogger(__name__)


def run_in_process(jobs: Iterator[dict], retrain_fn: Callable, device: str, total: int,
                    on_done: Callable, failures: dict[int, str]) -> None:
    with tqdm(total=total, desc="retrain: subnets", unit="subnet") as bar:
        for job in jobs:
            g = job.pop("index")
            try:
                state, metrics = retrain_fn(**job, device=device,
                                            progress=f"retrain subnet {g:02d}")
            except Exception as e:  # one subnet's failure must not lose the others
                log.error("retraining subnet %d failed: %s", g, e)
                failures[g] = f"{type(e).__name__}: {e}"
            else:
                on_done(g, state, metrics)
            bar.update(1)


def retrain_on_node(**job) -> tuple[dict, dict]:
    """``retrain_state`` as a Ray task; the metrics name the node that did the work."""
    import ray

    state, metrics = retrain_state(**job)
    return state, {**metrics, "node": ray.get_runtime_context().get_node_id()}


def run_on_ray(jobs: Iterator[dict], workers: int, device: str, total: int,
                on_done: Callable, failures: dict[int, str], address: str | None) -> None:
    import ray

    started = connect(address)
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        if device != "cpu" and gpus >= 1:
            # The task sees only the GPU Ray gave it, so "cuda" there is always the right one.
            options, task_device, threads = {"num_gpus": 1, "num_cpus": 1}, "cuda", None
        else:
            if device.startswith("cuda"):
                raise SensaiError(f"device {device} requested but the Ray cluster has no GPU")
            options, task_device, threads = {"num_cpus": 1}, "cpu", 1
        # SPREAD: subnets go to different nodes when there are several; a task whose node dies
        # is run again elsewhere (a subnet's retraining is deterministic, so a rerun is the same).
        remote = ray.remote(retrain_on_node).options(max_retries=3, scheduling_strategy="SPREAD",
                                                     **options)
        pending: dict = {}
        it = iter(jobs)
        exhausted = False
        with tqdm(total=total, desc=f"retrain: subnets ({workers} Ray workers)", unit="subnet") as bar:
            while pending or not exhausted:
                while not exhausted and len(pending) < workers:
                    job = next(it, None)
                    if job is None:
                        exhausted = True
                        break
                    g = job.pop("index")
                    pending[remote.remote(**job, device=task_device, threads=threads)] = g
                if not pending:
                    break
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    g = pending.pop(ref)
                    try:
                        state, metrics = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        failures[g] = error_text(e)
                        log.error("retraining subnet %d failed: %s", g, failures[g])
                    else:
                        on_done(g, state, metrics)
                    bar.update(1)
    finally:
        if started:
            ray.shutdown()

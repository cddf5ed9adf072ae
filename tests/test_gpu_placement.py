"""GPU placement on a machine without a GPU.

A real Ray instance that declares four (fake) GPUs places the worker actors, sized by the Ray
backend's own rule: one GPU each, or a share of one when workers outnumber GPUs; each actor sees
its GPU as ``cuda:0``.  The actors host no subnet, because a CUDA runner cannot be built here:
where a worker runs and which device it uses is settled before its runners are built.  The local
pool's devices come from torch made to report 0, 1, 2 or 4 GPUs.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter

import pytest
import torch

from sensai import models
from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.models import device_for_worker, select_device
from sensai.raycluster import LOOPBACK, cluster_resources
from sensai.serving.core.settings import CPU_BATCH_ROWS, GPU_BATCH_ROWS, GatewaySettings
from sensai.serving.engine.plan import class_parallel_plan, worker_devices
from sensai.serving.launch.fleet import device_plans
from sensai.serving.transports.ray_actors import actor_class, actor_resources
from sensai.serving.workers.graphs import buckets_up_to
from sensai.serving.workers.runners import RunnerSpec, runner_specs

FAKE_GPUS = 4


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch, and the driver check done before asking it, report ``n`` GPUs."""
    def report(n: int) -> None:
        monkeypatch.setattr(models, "gpu_possible", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return report


@pytest.mark.parametrize("n", [1, 2, 4])
def test_local_pool_puts_subnet_i_on_gpu_i_mod_n(gpus, tiny_artifact, n):
    gpus(n)
    artifact = load_artifact(tiny_artifact)
    g = len(artifact.subnets)
    assert g > n  # more subnets than GPUs: some GPUs hold two
    for device in ("auto", "cuda"):
        specs = runner_specs(artifact, device=device)
        assert [s.device for s in specs] == [f"cuda:{i % n}" for i in range(g)]
        assert {s.resolved_runtime() for s in specs} == {"cuda-graph"}  # GPUs replay graphs
        # A worker is one device: worker w (its own subnet w first) on GPU w mod n, for any
        # number of workers (redundant copies add workers).
        assert worker_devices(g + 2, device) == [f"cuda:{w % n}" for w in range(g + 2)]


def test_a_numbered_gpu_holds_every_worker(gpus, tiny_artifact):
    gpus(2)
    artifact = load_artifact(tiny_artifact)
    assert {s.device for s in runner_specs(artifact, device="cuda:1")} == {"cuda:1"}
    assert worker_devices(3, "cuda:1") == ["cuda:1"] * 3
    assert worker_devices(3, "cpu") == ["cpu"] * 3
    assert {s.resolved_runtime() for s in runner_specs(artifact, device="cpu")} == {"onnx"}
    with pytest.raises(SensaiError, match=r"^device 'cuda:2' requested but only 2 GPU\(s\) "
                                          r"exist$"):
        runner_specs(artifact, device="cuda:2")


def test_cuda_without_a_gpu_is_a_one_line_error(gpus, tiny_artifact):
    gpus(0)
    artifact = load_artifact(tiny_artifact)
    assert worker_devices(3, "auto") == ["cpu"] * 3
    assert {s.device for s in runner_specs(artifact)} == {"cpu"}
    for device in ("cuda", "cuda:0"):
        with pytest.raises(SensaiError, match=rf"^device '{device}' requested but no CUDA GPU "
                                              r"is available$"):
            runner_specs(artifact, device=device)
        with pytest.raises(SensaiError, match="no CUDA GPU"):
            worker_devices(2, device)
    for device in ("gpu", "cuda:x"):
        with pytest.raises(SensaiError, match=rf"^unknown device '{device}' \(use auto, cpu, "
                                              r"cuda or cuda:N\)$"):
            select_device(device)
    assert device_for_worker(4, "cpu") == "cpu"


@pytest.mark.parametrize("n", [1, 2])
def test_device_processes_are_one_per_gpu_with_gpu_sized_batches(gpus, tiny_artifact, tmp_path,
                                                                 n):
    """Several gateway processes: the subnets of one GPU share its device process, which
    batches up to the GPU's default rows with CUDA graphs up to that size; on CPUs each worker
    has its own or shares the count asked for, batching the CPU's default; the simulated GPU
    holds every subnet in one."""
    gpus(n)
    artifact = load_artifact(tiny_artifact)
    g = len(artifact.subnets)
    plan = class_parallel_plan(artifact, GatewaySettings(device="auto"))
    devices, addresses = device_plans(plan, tmp_path)
    assert [p.device for p in devices] == [f"cuda:{i}" for i in range(n)]
    assert [sorted(gr for gr, _ in p.hosted) for p in devices] == \
        [[w for w in range(g) if w % n == i] for i in range(n)]
    assert len(set(addresses.values())) == n and len(addresses) == g
    assert plan.batching.max_rows == GPU_BATCH_ROWS
    assert {spec.batch_rows for p in devices for _, spec in p.hosted} == {GPU_BATCH_ROWS}
    assert buckets_up_to(GPU_BATCH_ROWS)[-1] == GPU_BATCH_ROWS
    sim = class_parallel_plan(artifact, GatewaySettings(device="cpu", runtime="sim"))
    devices, _ = device_plans(sim, tmp_path)
    assert len(devices) == 1 and len(devices[0].hosted) == g
    assert sim.batching.max_rows == GPU_BATCH_ROWS
    cpu = class_parallel_plan(artifact, GatewaySettings(device="cpu"))
    devices, _ = device_plans(cpu, tmp_path)
    assert len(devices) == g and cpu.batching.max_rows == CPU_BATCH_ROWS
    # CPU workers sharing two device processes: round robin, one socket each.
    shared = class_parallel_plan(artifact, GatewaySettings(device="cpu", device_processes=2))
    devices, addresses = device_plans(shared, tmp_path)
    assert [sorted(gr for gr, _ in p.hosted) for p in devices] == \
        [[w for w in range(g) if w % 2 == i] for i in range(2)]
    assert [addresses[w] for w in range(g)] == [devices[w % 2].address for w in range(g)]
    fixed = class_parallel_plan(artifact, GatewaySettings(device="auto", batch_max_rows=16))
    assert fixed.batching.max_rows == 16


@pytest.fixture(scope="module")
def fake_gpu_ray():
    """One local Ray instance declaring FAKE_GPUS GPUs (Ray hands them out as it would real
    ones, CUDA_VISIBLE_DEVICES included) for the placement tests below."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, num_gpus=FAKE_GPUS, include_dashboard=False,
             _node_ip_address=LOOPBACK, logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def placed(workers: int, device: str = "auto") -> tuple[dict, list[tuple]]:
    """``workers`` worker actors sized by the Ray backend for this cluster, each hosting one
    simulated subnet (no GPU is touched); returns their Ray options and what each saw inside: (its device, as it reports it
    to the gateway, Ray's GPU ids, CUDA_VISIBLE_DEVICES)."""
    import ray

    cpus, gpus = cluster_resources()
    opts, _ = actor_resources(workers, cpus, gpus, device=device)
    sim = RunnerSpec(name="sim", input_shape=(1, 28, 28), runtime="sim", num_outputs=2)
    actors = [actor_class().options(**opts).remote(f"worker-{w}", [(0, sim)], w)
              for w in range(workers)]

    def inside(body) -> tuple:  # runs in the actor, on its RayWorkerBody
        return (body.ping().device, [int(i) for i in ray.get_gpu_ids()],
                os.environ.get("CUDA_VISIBLE_DEVICES"))

    try:
        # Every actor must start: one Ray cannot place would make this time out.
        return opts, ray.get([a.__ray_call__.remote(inside) for a in actors], timeout=90)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


@pytest.mark.slow  # a Ray instance and actor starts
def test_ray_places_one_worker_per_gpu(fake_gpu_ray):
    opts, seen = placed(FAKE_GPUS)
    assert opts["num_gpus"] == 1.0
    assert [dev for dev, _, _ in seen] == ["cuda:0"] * FAKE_GPUS  # its own GPU, seen as the first
    ids = [gpu for _, (gpu,), _ in seen]  # exactly one GPU each
    assert sorted(ids) == list(range(FAKE_GPUS))  # distinct: no two workers on one GPU
    assert [visible for _, _, visible in seen] == [str(i) for i in ids]
    opts, seen = placed(1, device="cpu")
    assert "num_gpus" not in opts and [s[:2] for s in seen] == [("cpu", [])]


@pytest.mark.slow
def test_ray_shares_gpus_among_more_workers(fake_gpu_ray):
    workers = FAKE_GPUS + 2
    per_gpu = math.ceil(workers / FAKE_GPUS)
    opts, seen = placed(workers)  # all start: a share each that the busiest GPU can hold
    assert opts["num_gpus"] == 1 / per_gpu
    assert [dev for dev, _, _ in seen] == ["cuda:0"] * workers
    load = Counter(gpu for _, (gpu,), _ in seen)
    assert set(load) <= set(range(FAKE_GPUS)) and max(load.values()) == per_gpu

"""The device as the unit: one call runs every subnet placed on a device, and a request makes one
run per device; every place that runs workers in processes runs them in device processes.

A device's one call (a merged ONNX Runtime session, torch branches, the sim runtime's one
launch) must answer exactly what its subnets answer one by one, for plain and residual networks
and any G; the predictor must send a request to each device once; the sim device must launch
once per batch for all its subnets; redundancy must keep working when a device dies.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.serving.core.messages import Batching, Done, Output, Run
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.engine.plan import class_parallel_plan, worker_count
from sensai.serving.launch.build import build_predictor
from sensai.serving.workers.device_runner import (EachRunner, OrtDevice, SharedRunner, SimDevice,
                                                  build_device, merge_branches)
from sensai.serving.workers.loop import WorkerCore
from sensai.serving.workers.runners import runner_specs
from sensai.serving.workers.sim import sim_scores

from tests.conftest import TINY_DECOMPOSE
from tests.helpers import offline_scores, predict_all, sample_images, serve_queued


@pytest.fixture(scope="module")
def tiny_artifact_g10(tmp_path_factory, trained_model_dir):
    """G = 10: one subnet per class (binary subnets), the paper's finest decomposition."""
    from sensai.pruning.decompose import DecomposeConfig, decompose

    out = tmp_path_factory.mktemp("artifact") / "fmnist_g10"
    decompose(trained_model_dir, out, groups=10, config=DecomposeConfig(**TINY_DECOMPOSE),
              device="cpu", use_ray=False, eval_limit=100)
    return out


@pytest.fixture(scope="module")
def u8(fmnist_test):
    return sample_images(fmnist_test, 6)[1]


@pytest.fixture(scope="module")
def images(u8, fmnist_spec):
    return normalize(u8, fmnist_spec).numpy()


def one_by_one(specs, x) -> dict[int, np.ndarray]:
    return {i: np.asarray(s.build().run(x), dtype=np.float32) for i, s in enumerate(specs)}


@pytest.mark.parametrize("which", ["tiny_artifact_g2", "tiny_artifact", "tiny_artifact_g10"])
@pytest.mark.parametrize("runtime", ["onnx", "torch"])
def test_one_call_answers_as_the_subnets_one_by_one(which, runtime, images, request):
    art = load_artifact(request.getfixturevalue(which))
    specs = runner_specs(art, device="cpu", runtime=runtime)
    device = build_device(list(enumerate(specs)), cores=2)
    assert isinstance(device, OrtDevice if runtime == "onnx" else SharedRunner)
    assert device.groups == tuple(range(len(specs)))
    alone = one_by_one(specs, images)
    together = device.run(images)
    assert sorted(together) == sorted(alone)
    for g in alone:
        np.testing.assert_allclose(together[g], alone[g], atol=1e-5)
    if runtime == "onnx":  # the device's cores as the one session's intra-op threads
        import onnxruntime as ort

        opts = device.runner.session.get_session_options()
        assert opts.intra_op_num_threads == 2 and opts.inter_op_num_threads == 1
        assert opts.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    if runtime == "onnx" and len(specs) > 2:  # a subset computes only its branches, same rows
        part = device.run(images[:2], (1, len(specs) - 1))
        assert sorted(part) == [1, len(specs) - 1]
        np.testing.assert_allclose(part[1], alone[1][:2], atol=1e-5)


def residual_onnx(tmp_path, seed: int, classes: int) -> tuple[str, str]:
    import torch

    from sensai.export import export_onnx
    from sensai.models import create_model

    torch.manual_seed(seed)
    net = create_model("resnet20", classes, 1)
    path = tmp_path / f"res{seed}.onnx"
    export_onnx(net, (1, 28, 28), path)
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def test_residual_branches_merge_into_one_graph(tmp_path, images):
    """Skip connections (Add nodes fed by earlier layers) and differing widths survive the
    merge: each branch's output equals its own network's."""
    from sensai.serving.workers.runners import OrtRunner, RunnerSpec

    specs, alone = {}, {}
    for g, width in enumerate((2, 3, 1)):
        path, digest = residual_onnx(tmp_path, g, width)
        specs[g] = RunnerSpec(name=f"res{g}", input_shape=(1, 28, 28), device="cpu",
                              runtime="onnx", onnx_path=path, onnx_sha256=digest,
                              num_outputs=width)
        alone[g] = OrtRunner(path).run(images)
    model, outputs = merge_branches({g: s.onnx_bytes() for g, s in specs.items()})
    assert len(outputs) == 3 and len(set(outputs.values())) == 3
    device = build_device(list(specs.items()), cores=2)
    got = device.run(images)
    for g, want in alone.items():
        assert got[g].shape == want.shape
        np.testing.assert_allclose(got[g], want, atol=1e-5)


def test_a_tampered_subnet_file_is_refused_before_merging(tmp_path):
    from sensai.errors import CheckpointError
    from sensai.serving.workers.runners import RunnerSpec

    path, digest = residual_onnx(tmp_path, 0, 2)
    spec = RunnerSpec(name="res", input_shape=(1, 28, 28), runtime="onnx", onnx_path=path,
                      onnx_sha256=digest, num_outputs=2)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        build_device([(0, spec), (1, spec)])


def sim_specs(art, launch_ms: float):
    return runner_specs(art, device="cpu", runtime="sim", sim_launch_ms=launch_ms)


def test_the_sim_device_launches_once_per_batch_for_all_its_subnets(tiny_artifact, images):
    art = load_artifact(tiny_artifact)
    specs = [replace(s, batch_rows=8) for s in sim_specs(art, 40.0)]
    device = build_device(list(enumerate(specs)))
    assert isinstance(device, SimDevice)
    core = WorkerCore(device, batching=Batching(max_rows=8))
    runs = [Run(i + 1, images[i:i + 1], tuple(range(5)), 5) for i in range(4)]
    before = device.runner.launches  # the warm-up's
    events = serve_queued(core, runs)
    # Four requests queued together: one batch, one launch for the five subnets (not five, nor
    # twenty), its one staging of the rows.
    assert core.calls == 1 and core.counts.batches == 1
    assert device.runner.launches - before == 1
    outs = [e for e in events if type(e) is Output]
    assert sorted((e.req, e.group) for e in outs) == [(r, g) for r in (1, 2, 3, 4)
                                                      for g in range(5)]
    for e in outs:
        np.testing.assert_allclose(e.output, sim_scores(images[e.req - 1:e.req],
                                                        specs[e.group].num_outputs))
    assert sorted(e.req for e in events if type(e) is Done) == [1, 2, 3, 4]


def test_a_device_hosting_copies_computes_them_in_the_same_call(tiny_artifact, images):
    """Redundancy 1 on two devices: each hosts its own groups and the other's as copies; without
    a hedge the copies run in the own groups' call; with one, in a call of their own after it."""
    art = load_artifact(tiny_artifact)
    device = build_device(list(enumerate(sim_specs(art, 0.0))))
    core = WorkerCore(device)
    serve_queued(core, [Run(1, images[:1], (0, 2, 4, 1, 3), 3)])
    assert core.calls == 1
    hedged = WorkerCore(build_device(list(enumerate(sim_specs(art, 0.0)))))
    serve_queued(hedged, [Run(1, images[:1], (0, 2, 4, 1, 3), 3, 0.001)])
    assert hedged.calls == 2


def test_a_failing_device_call_fails_only_its_own_requests(tiny_artifact, images):
    """One request whose rows the device cannot take (wrong shape) beside good ones: the batch
    is retried one by one, and only the bad request fails, for each group."""
    art = load_artifact(tiny_artifact)
    device = build_device(list(enumerate(runner_specs(art, device="cpu", runtime="onnx"))))
    core = WorkerCore(device, batching=Batching(max_rows=8))
    bad = np.zeros((1, 1, 27, 28), dtype=np.float32)
    runs = [Run(1, images[:1], tuple(range(5)), 5), Run(2, bad, tuple(range(5)), 5),
            Run(3, images[1:2], tuple(range(5)), 5)]
    events = serve_queued(core, runs)
    failed = sorted((e.req, e.group) for e in events if type(e).__name__ == "RunFailed")
    assert failed == [(2, g) for g in range(5)]
    answered = {(e.req, e.group) for e in events if type(e) is Output}
    assert answered >= {(r, g) for r in (1, 3) for g in range(5)}


def test_one_worker_places_every_subnet_on_the_one_cpu_device(tiny_artifact):
    art = load_artifact(tiny_artifact)
    s = GatewaySettings(device="cpu", workers=1)
    assert worker_count(s, 5) == 1 and worker_count(GatewaySettings(), 5) == 5
    plan = class_parallel_plan(art, s)
    assert [wp.groups for wp in plan.workers] == [(0, 1, 2, 3, 4)]
    # Copies need devices of their own; each hosts every group (its own ones first).
    r1 = class_parallel_plan(art, s.model_copy(update={"workers": 2, "redundancy": 1}))
    assert len(r1.workers) == 2 and all(sorted(wp.groups) == list(range(5)) for wp in r1.workers)
    assert r1.workers[0].groups[:3] == (0, 2, 4) and r1.workers[1].groups[:2] == (1, 3)


@pytest.mark.parametrize("backend", ["local", "processes"])
def test_a_request_makes_one_run_per_device(backend, tiny_artifact, images, u8, fmnist_spec):
    """Counted at the devices: six requests to one device are six device runs, however many
    subnets; the answers are the offline ones."""
    settings = GatewaySettings(backend=backend, device="cpu", deadline_s=30, workers=1)
    pred = build_predictor(tiny_artifact, settings)
    try:
        assert len(pred.workers) == 1 and pred.workers[0].groups == (0, 1, 2, 3, 4)
        got = predict_all(pred, images)
        want = offline_scores(tiny_artifact, u8, fmnist_spec)
        for p, w in zip(got, want):
            np.testing.assert_allclose(p.scores[0], w, atol=1e-4)
        c = pred.pool.counters()
        assert c["batching"]["requests"] == 6  # one run per request reached the device
        assert c["runs"] == 6 * 5  # its five groups' outputs
        assert {p.answered_by[n] for p in got for n in p.answered_by} == {"worker_00"}
    finally:
        pred.shutdown()


def test_redundancy_keeps_answering_when_a_device_is_killed(tiny_artifact, images):
    """Redundancy 1: two devices, each with every group; one killed under load loses no
    answer."""
    settings = GatewaySettings(backend="processes", device="cpu", deadline_s=30, redundancy=1,
                               workers=2, restart_delay_s=5)
    pred = build_predictor(tiny_artifact, settings)
    try:
        assert len(pred.workers) == 2
        before = predict_all(pred, images)
        pred.pool.kill(0)

        async def many():
            return await asyncio.gather(*[pred.predict(images[i % 6][None])
                                          for i in range(24)])

        after = asyncio.run(many())
        assert all(not p.degraded for p in after)
        for i, p in enumerate(after):
            np.testing.assert_allclose(p.scores, before[i % 6].scores, atol=1e-5)
        assert {p.answered_by[n] for p in after[-6:] for n in p.answered_by} == {"worker_01"}
    finally:
        pred.shutdown()


def test_each_runner_is_what_plain_runner_mappings_become(tiny_artifact):
    art = load_artifact(tiny_artifact)
    runners = {g: s.build() for g, s in enumerate(runner_specs(art, device="cpu"))}
    core = WorkerCore(runners)
    assert isinstance(core.device, EachRunner) and core.groups == frozenset(range(5))


def test_bench_robust_on_processes_measures_the_device_processes_of_serve(tiny_artifact,
                                                                          tmp_path):
    """``sensai bench-robust --backend processes``: its predictors run on device processes of
    their own (the transport ``sensai serve``'s gateways use); a killed one is restarted and,
    under r = 1, costs no answer."""
    from sensai.bench.options import RobustOptions
    from sensai.bench.robust import run_robust_bench

    out = tmp_path / "robust"
    res = run_robust_bench(tiny_artifact, out, RobustOptions(
        backend="processes", redundancies=(1,), images=20, warmup=2, rounds=1,
        delay="fixed:50ms", straggler=2, victim=1, kill_at=0.25, restart_delay_s=1.0,
        progress=False, command="test"))
    on_disk = json.loads((out / "robust.json").read_text())
    assert on_disk["worker_transport"] == {"r=1": {"kind": "processes", "device_processes": 5}}
    failure = res["configs"]["r=1"]["scenarios"]["failure"]
    assert failure["killed_pid"] and failure["restarted"] and failure["rejoined"]
    assert failure["errors"] == 0 and failure["wrong"] == 0
    assert failure["answered"] == failure["requests"] == 20  # two per class

"""The CUDA-graph runner: buckets, staging buffers, chunking and capture errors on the CPU (with an
eager stand-in for the capture), and the real capture where CUDA is present."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sensai.artifact import load_artifact
from sensai.errors import CheckpointError, SensaiError
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.core.errors import GraphCaptureError
from sensai.serving.workers.graphs import (GraphRunner, bucket_for,
                                           buckets_up_to, check_buckets)
from sensai.serving.workers.runners import (TorchRunner, launch, resolve_runtime, runner_specs,
                                            torch_runner, wait_all)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def eager_capture(model, static_input, *, stream):
    """What a capture gives (a replay writing into one static output), computed eagerly."""
    with torch.no_grad():
        output = model(static_input)

    def replay():
        with torch.no_grad():
            output.copy_(model(static_input))

    return replay, output


def failing_capture(model, static_input, *, stream):
    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


@pytest.fixture(scope="module")
def subnet(tiny_artifact):
    art = load_artifact(tiny_artifact)
    return art.load_subnets("cpu")[0].eval(), tuple(art.manifest.dataset.input_shape)


def test_buckets():
    assert buckets_up_to(1) == (1,) and buckets_up_to(8) == (1, 2, 4, 8)
    assert buckets_up_to(6) == (1, 2, 4, 6)
    assert check_buckets([8, 1, 4, 4]) == (1, 4, 8)
    assert [bucket_for(n, (1, 4, 8)) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(9, (1, 4, 8))
    with pytest.raises(SensaiError, match="positive"):
        check_buckets([0, 2])


@pytest.mark.parametrize("batch", [1, 3, 4, 9])
def test_static_buffers_answer_like_eager(subnet, fmnist_test, batch):
    model, shape = subnet
    runner = GraphRunner(model, device="cpu", input_shape=shape, buckets=(1, 4),
                         capture=eager_capture, name="g0")
    x = np.stack([fmnist_test[i][0].numpy() for i in range(batch)]).astype(np.float32)
    x.setflags(write=False)  # as Ray and shared buffers hand them over
    want = TorchRunner(model, device="cpu").run(np.array(x))
    got = runner.run(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The answer is the caller's own array: the next request does not overwrite it.
    again = runner.run(np.zeros_like(x[:1]))
    assert not np.allclose(again[0], got[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert runner.replay_ms(repeats=3) > 0


def test_launches_stage_several_requests_into_one_bucket_and_answer_each(subnet, fmnist_test):
    """A batch given as several requests' rows is staged into the bucket in order (one pass);
    two launches of one bucket in a row each get their own rows back (the first is read out
    before the second overwrites the pinned buffers); wait_all waits for all at once."""
    model, shape = subnet
    runner = GraphRunner(model, device="cpu", input_shape=shape, buckets=(1, 4),
                         capture=eager_capture, name="g0")
    x = np.stack([fmnist_test[i][0].numpy() for i in range(4)]).astype(np.float32)
    want = TorchRunner(model, device="cpu").run(x)
    first = launch(runner, [x[0:1], x[1:3]])  # 3 rows: bucket 4
    second = launch(runner, [x[3:4], x[0:1], x[2:3]])  # bucket 4 again
    wait_all([first, second])
    np.testing.assert_allclose(first.result(), want[0:3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second.result(), want[[3, 0, 2]], rtol=1e-5, atol=1e-5)
    wrong = launch(runner, [x[:, :, :27, :27]])
    with pytest.raises(ValueError):
        wrong.result()
    big = launch(runner, [x, x[:2]])  # more rows than the largest bucket: in chunks
    np.testing.assert_allclose(big.result(), np.concatenate([want, want[:2]]), rtol=1e-5,
                               atol=1e-5)


def test_capture_failure_is_one_clear_error(subnet):
    model, shape = subnet
    with pytest.raises(GraphCaptureError) as e:
        GraphRunner(model, device="cpu", input_shape=shape, capture=failing_capture, name="g0")
    assert str(e.value) == ("g0: capturing the forward pass at batch 1 as a CUDA graph failed: "
                            "operation not permitted when stream is capturing")
    with pytest.raises(CheckpointError, match="use --runtime torch"):
        torch_runner(model, device="cpu", runtime="cuda-graph", name="g0", input_shape=shape)


def test_runtime_choice_per_device(tiny_artifact):
    assert resolve_runtime("auto", "cuda:1") == "cuda-graph"
    assert resolve_runtime("auto", "cpu") == "onnx"
    assert resolve_runtime("auto", "cpu", has_onnx=False) == "torch"
    assert resolve_runtime("torch", "cuda:0") == "torch"
    specs = runner_specs(load_artifact(tiny_artifact), device="cpu")
    assert {s.resolved_runtime() for s in specs} == {"onnx"}
    with pytest.raises(SensaiError, match="needs a CUDA device"):
        runner_specs(load_artifact(tiny_artifact), device="cpu", runtime="cuda-graph")


class HostSync(torch.nn.Module):
    """A network that reads a value back to the host mid-forward: not capturable."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        if float(y.abs().sum()) < 0:  # a host sync inside the capture
            y = -y
        return y


@needs_cuda
def test_cuda_graph_matches_eager_on_the_gpu(subnet, fmnist_test):
    model, shape = subnet
    x = np.stack([fmnist_test[i][0].numpy() for i in range(5)]).astype(np.float32)
    want = TorchRunner(model, device="cpu").run(x)
    runner = torch_runner(model, device="cuda:0", runtime="auto", name="g0", input_shape=shape,
                          batch_rows=8)
    assert isinstance(runner, GraphRunner) and runner.buckets == (1, 2, 4, 8)
    np.testing.assert_allclose(runner.run(x), want, rtol=1e-3, atol=1e-3)  # 5 rows: bucket 8
    np.testing.assert_allclose(runner.run(x[:1]), want[:1], rtol=1e-3, atol=1e-3)
    assert 0 < runner.replay_ms(repeats=20) < 50


@needs_cuda
def test_uncapturable_network_falls_back_to_eager_unless_asked(subnet, caplog):
    model, shape = subnet
    bad = HostSync(model)
    with caplog.at_level(logging.WARNING):
        runner = torch_runner(bad, device="cuda:0", runtime="auto", name="g0", input_shape=shape)
    assert isinstance(runner, TorchRunner) and runner.runtime == "torch"
    assert "running it eagerly" in caplog.text
    with pytest.raises(CheckpointError, match="CUDA graph failed"):
        torch_runner(bad, device="cuda:0", runtime="cuda-graph", name="g0", input_shape=shape)


@needs_cuda
def test_the_local_pool_on_the_gpu_answers_batches_like_offline(tiny_artifact, fmnist_test,
                                                               fmnist_spec):
    """Concurrent requests through the default GPU pool (CUDA graphs, micro-batches padded to
    their bucket) give the offline evaluation's scores."""
    import asyncio

    from sensai.data import normalize
    from sensai.merge import merge_outputs
    from sensai.serving.launch.build import build_predictor

    art = load_artifact(tiny_artifact)
    x = normalize(fmnist_test.images[:16], fmnist_spec)
    with torch.inference_mode():
        want = merge_outputs([m(x).float().numpy() for m in art.load_subnets("cpu")], art.groups,
                             art.manifest.num_classes)
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cuda"))

    async def run():
        try:
            return await asyncio.gather(*(pred.predict(x[i:i + 1].numpy()) for i in range(16)))
        finally:
            await pred.close()

    got = np.concatenate([p.scores for p in asyncio.run(run())])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    assert {w["runtime"] for w in pred.describe()["workers"]} == {"cuda-graph"}

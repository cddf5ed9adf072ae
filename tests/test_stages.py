"""Stage cutting for the model-parallel baseline (sensai/stages.py), on real Fashion-MNIST."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from sensai.bench.stages import (_balanced_cuts, _cut_candidates, export_stage_onnx, node_macs,
                                 plan_stages, split_model, trace)
from sensai.data import iterate_batches, normalize
from sensai.errors import SensaiError
from sensai.flops import count_flops
from sensai.models import create_model

MODELS = ["fmnist_cnn", "vgg11_bn", "resnet20", "mobilenet_v2"]


@pytest.fixture(scope="module")
def images(fmnist_spec, fmnist_test):
    x, _ = next(iterate_batches(fmnist_test, 4, indices=np.arange(0, 400, 100)))
    return normalize(x, fmnist_spec)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = create_model(name, 10, 1).eval()
    # Non-trivial batch-norm statistics, so a stage that skipped or repeated a layer would show.
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_chained_stages_equal_whole_model(name, images):
    model = _model(name)
    with torch.no_grad():
        want = model(images.clone())
    assert want.std() > 0  # the check below compares something that varies
    for k in (1, 3):
        stages, plan = split_model(model, k, images)
        assert len(stages) == plan.num_stages == k
        assert len(plan.boundaries) == k - 1
        got = images.clone()
        with torch.no_grad():
            for stage in stages:  # the pipeline, one stage after the other
                got = stage(got)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # Every stage computes something; the parameters are shared, never copied or lost.
        assert all(n > 0 for n in plan.stage_nodes)
        assert sum(plan.stage_params) == sum(p.numel() for p in model.parameters())
        # Same MAC definition as sensai.flops, so the benchmark's columns are comparable.
        assert sum(plan.stage_macs) == count_flops(model, (1, 28, 28))


def test_resnet_cuts_only_between_blocks(images):
    """resnet20: 3 stem positions + (add, relu) after each of 9 blocks + pool + flatten."""
    gm = trace(_model("resnet20"), images)
    names = [v.name for _, v in _cut_candidates(gm)]
    assert len(names) == 3 + 2 * 9 + 2
    # Inside a block the block input stays alive for the shortcut, so no cut lands there.
    assert not any(("conv" in n or "bn1" in n or "relu1" in n) and "layer" in n for n in names)
    stages, plan = split_model(_model("resnet20"), 3, images)
    assert all(b.startswith(("add", "layer")) for b in plan.boundaries)


def test_balanced_cuts_are_optimal():
    """The DP's choice equals a brute-force search over every choice of cuts: the smallest
    largest stage, then the most even split among those."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = [int(c) for c in rng.integers(0, 100, size=14)]
        cand = sorted(rng.choice(13, size=8, replace=False).tolist())
        for k in (2, 3, 4):
            def worst(cuts):
                b = [-1, *cuts, len(costs) - 1]
                return max(sum(costs[x + 1:y + 1]) for x, y in zip(b, b[1:]))

            def squares(cuts):
                b = [-1, *cuts, len(costs) - 1]
                return sum(sum(costs[x + 1:y + 1]) ** 2 for x, y in zip(b, b[1:]))

            choices = list(itertools.combinations(cand, k - 1))
            brute = min(worst(c) for c in choices)
            even = min(squares(c) for c in choices if worst(c) == brute)
            got = _balanced_cuts(costs, cand, k)
            assert len(got) == k - 1 and worst(got) == brute and squares(got) == even


def test_plan_balances_vgg(images):
    model = _model("vgg11_bn")
    gm = trace(model, images)
    plan, _ = plan_stages(gm, 4)
    total = sum(node_macs(gm, n) for n in gm.graph.nodes)  # traced at batch 1
    assert sum(plan.stage_macs) == total
    # Below what a naive split into equal numbers of layers gives on this model.
    assert max(plan.stage_macs) < 0.4 * total


def test_too_many_stages_is_a_clear_error(images):
    model = _model("fmnist_cnn")
    _, plan = split_model(model, 2, images)
    with pytest.raises(SensaiError, match="at most"):
        split_model(model, plan.max_stages + 1, images)
    with pytest.raises(SensaiError, match="at least 1"):
        split_model(model, 0, images)


def test_untraceable_model_is_a_clear_error(images):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                return self.conv(x)
            return self.conv(-x)

    with pytest.raises(SensaiError, match="torch.fx"):
        split_model(Branchy(), 2, images)


@pytest.mark.parametrize("name", ["fmnist_cnn", "resnet20"])
def test_onnx_stages_chain_like_the_model(name, images, tmp_path):
    from sensai.serving.workers.runners import OrtRunner

    model = _model(name)
    stages, plan = split_model(model, 3, images)
    x = images
    paths = []
    for i, stage in enumerate(stages):
        paths.append(tmp_path / f"stage_{i}.onnx")
        assert export_stage_onnx(stage, x, paths[-1]) < 1e-4
        with torch.no_grad():
            x = stage(x.clone())
    a = images.numpy()
    for p in paths:
        a = OrtRunner(p).run(a)
    with torch.no_grad():
        want = model(images.clone()).numpy()
    np.testing.assert_allclose(a, want, atol=1e-4, rtol=0)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave nothing behind

"""APoZ / mean |a| statistics: hand-made activations and a really trained model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sensai.errors import SensaiError
from sensai.pruning.apoz import ChannelStatsAccumulator, collect_activation_stats

CPU = torch.device("cpu")


def test_accumulator_known_values():
    act = torch.zeros(2, 3, 2, 2)
    act[:, 1] = 1.0
    act[:, 2, 0] = 0.005   # exactly at the threshold: counts as zero
    act[:, 2, 1] = -2.0    # negative values count by magnitude
    acc = ChannelStatsAccumulator(zero_threshold=0.005)
    acc.update(act)
    s = acc.result()
    np.testing.assert_allclose(s.apoz, [1.0, 0.0, 0.5])
    np.testing.assert_allclose(s.mean_abs, [0.0, 1.0, (0.005 + 2.0) / 2])
    assert s.count == 8 and s.channels == 3


def test_accumulator_2d_and_threshold():
    acc = ChannelStatsAccumulator(zero_threshold=0.1)
    acc.update(torch.tensor([[0.0, 0.05, 3.0], [0.2, 0.1, 1.0]]))
    s = acc.result()
    np.testing.assert_allclose(s.apoz, [0.5, 1.0, 0.0])
    np.testing.assert_allclose(s.mean_abs, [0.1, 0.075, 2.0])
    assert s.count == 2


def test_accumulator_streaming_equals_one_batch():
    gen = torch.Generator().manual_seed(0)
    act = torch.relu(torch.randn(23, 5, 4, 3, generator=gen) - 0.3)
    whole = ChannelStatsAccumulator()
    whole.update(act)
    parts = ChannelStatsAccumulator()
    for chunk in act.split([7, 1, 15]):
        parts.update(chunk)
    a, b = whole.result(), parts.result()
    np.testing.assert_allclose(a.apoz, b.apoz, rtol=0, atol=1e-12)
    np.testing.assert_allclose(a.mean_abs, b.mean_abs, rtol=1e-12)
    assert a.count == b.count == 23 * 12
    np.testing.assert_allclose(a.apoz, (act <= 0.005).double().mean(dim=(0, 2, 3)).numpy())


def test_accumulator_waits_for_the_device_only_for_its_result():
    """The sums stay where the activations are: on a GPU a copy to the host per batch would
    wait for the device at every layer.  A meta tensor (no data: any copy to the host raises)
    stands in for a device the host must wait for."""
    acc = ChannelStatsAccumulator(0.1)
    for _ in range(3):
        acc.update(torch.empty(4, 3, 5, 5, device="meta"))  # no copy to the host
    with pytest.raises(NotImplementedError):
        acc.result()  # the one copy to the host


def test_accumulator_errors():
    acc = ChannelStatsAccumulator()
    with pytest.raises(ValueError, match="no activations"):
        acc.result()
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        acc.update(torch.zeros(2, 3, 4))
    acc.update(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="changed from 3 to 4 channels"):
        acc.update(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="zero_threshold"):
        ChannelStatsAccumulator(-1.0)


@pytest.fixture(scope="module")
def trained(trained_model_dir):
    from sensai.checkpoint import load_trained_model

    return load_trained_model(trained_model_dir)[0]


def _all_hooks_gone(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_collect_stats_on_group_images(trained, fmnist_spec, fmnist_train):
    from sensai.data import normalize

    labels = fmnist_train.labels
    bags = np.flatnonzero(labels == 8)[:40]
    trousers = np.flatnonzero(labels == 1)[:40]
    stats = collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU, indices=bags,
                                     batch_size=16)
    relus = [n for n, m in trained.named_modules() if isinstance(m, nn.ReLU)]
    assert sorted(stats) == sorted(relus)
    assert _all_hooks_gone(trained)
    # Only the 40 given images were seen: 28x28 maps for the first two ReLUs, 7x7 for the last.
    assert stats["features.2"].count == 40 * 28 * 28
    assert stats["features.16"].count == 40 * 7 * 7
    assert stats["features.16"].apoz.shape == (128,)
    # Same numbers as a direct computation on exactly those images.
    with torch.no_grad():
        act = trained.features[:17](normalize(fmnist_train.images[bags], fmnist_spec))
    np.testing.assert_allclose(stats["features.16"].apoz,
                               (act.abs() <= 0.005).double().mean(dim=(0, 2, 3)).numpy(), atol=1e-12)
    np.testing.assert_allclose(stats["features.16"].mean_abs,
                               act.abs().double().mean(dim=(0, 2, 3)).numpy(), rtol=1e-5)
    # Other classes give other statistics: the scores are class-specific.
    other = collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU, indices=trousers,
                                     modules=["features.16"])
    assert list(other) == ["features.16"]
    assert np.abs(other["features.16"].apoz - stats["features.16"].apoz).max() > 0.05


def test_collect_stats_mode_hooks_and_errors(trained, fmnist_spec, fmnist_train):
    bn = trained.features[1]
    before = bn.running_mean.clone()
    trained.train()
    try:
        collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU, indices=np.arange(8),
                                 modules=["features.2"])
        assert trained.training and bn.training
        assert torch.equal(bn.running_mean, before)  # eval mode inside: batch norm untouched
    finally:
        trained.eval()
    # A failure in the middle of the pass still removes every hook.
    with pytest.raises(IndexError):
        collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU,
                                 indices=np.array([0, len(fmnist_train) + 5]))
    assert _all_hooks_gone(trained)
    with pytest.raises(ValueError, match="not an nn.ReLU"):
        collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU, indices=np.arange(4),
                                 modules=["features.0"])
    with pytest.raises(ValueError, match="not an nn.ReLU"):
        collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU, indices=np.arange(4),
                                 modules=["nope"])
    with pytest.raises(SensaiError, match="empty index list"):
        collect_activation_stats(trained, fmnist_train, fmnist_spec, CPU, indices=[])
    assert _all_hooks_gone(trained)


def test_collect_stats_rejects_reused_relu(fmnist_spec, fmnist_train):
    relu = nn.ReLU()
    model = nn.Sequential(nn.Conv2d(1, 4, 3), relu, nn.Conv2d(4, 4, 3), relu, nn.Flatten(),
                          nn.LazyLinear(2))
    with pytest.raises(ValueError, match="called more than once"):
        collect_activation_stats(model, fmnist_train, fmnist_spec, CPU, indices=np.arange(4))
    assert _all_hooks_gone(model)

"""The offline loops' data path: images held on the training device, batches cut there, and the
losses read only every so many steps.  On the CPU it must give exactly what the batch-by-batch
host path (``iterate_batches`` + ``augment`` + ``normalize``) gives for the same seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sensai.data import iterate_batches, normalize
from sensai.feed import DeviceImages
from sensai.learning import StepLosses, augment, fast_layout, mixed_precision


@pytest.mark.parametrize("batch_size", [32, 100])
def test_held_batches_are_the_host_paths_batches(fmnist_spec, fmnist_train, batch_size):
    """The trainer's epoch: the shuffled order of iterate_batches, the flips of augment drawn
    batch by batch, normalised - the same tensors, bit for bit, and the same labels."""
    indices = np.arange(0, 6000, 7)
    seed = 3
    host_gen = torch.Generator().manual_seed(seed)
    host = [(normalize(augment(x, host_gen), fmnist_spec), y)
            for x, y in iterate_batches(fmnist_train, batch_size, indices=indices, shuffle=True,
                                        seed=seed)]
    held = DeviceImages(fmnist_train.images, fmnist_spec, torch.device("cpu"))
    labels = torch.from_numpy(fmnist_train.labels)
    order = np.random.default_rng(seed).permutation(indices)
    ours = [(b.x, labels[b.positions], b.size)
            for b in held.epoch(order, batch_size, generator=torch.Generator().manual_seed(seed))]
    assert len(ours) == len(host) == -(-len(indices) // batch_size)
    for (hx, hy), (x, y, size) in zip(host, ours):
        assert torch.equal(hx, x) and torch.equal(hy, y) and size == len(hy)
    # Some images were mirrored and some not: the comparison above covered both branches.
    plain = [normalize(x, fmnist_spec) for x, _ in
             iterate_batches(fmnist_train, batch_size, indices=indices, shuffle=True, seed=seed)]
    mirrored = sum(int(not torch.equal(p[i], x[i])) for p, (x, _, _) in zip(plain, ours)
                   for i in range(len(p)))
    assert 0.3 < mirrored / len(indices) < 0.7


def test_plan_items_and_images_are_kept_apart(fmnist_spec, fmnist_train):
    """Retraining indexes the distinct images it holds by position (a repeated positive is held
    once) and its targets by plan item: a batch says both."""
    images = fmnist_train.images[:50]
    positions = np.array([4, 4, 9, 0, 49, 4, 7])
    held = DeviceImages(images, fmnist_spec, torch.device("cpu"))
    batches = list(held.epoch(positions, 3))
    assert [b.rows for b in batches] == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert torch.equal(torch.cat([b.positions for b in batches]), torch.from_numpy(positions))
    assert torch.equal(torch.cat([b.x for b in batches]),
                       normalize(images[torch.from_numpy(positions)], fmnist_spec))
    with pytest.raises(ValueError, match="uint8"):
        DeviceImages(images.float(), fmnist_spec, torch.device("cpu"))


def test_step_losses_are_read_only_when_asked():
    losses = StepLosses(5, torch.device("cpu"))
    for value, size in ((1.0, 4), (2.0, 4), (4.0, 2)):
        losses.add(torch.tensor(value), size)
    assert losses.check() is None and len(losses) == 3
    # Weighted by items: a short last batch counts less.
    assert losses.mean() == pytest.approx((4 + 8 + 8) / 10)
    assert losses.tail_mean(0.1) == 4.0
    losses.add(torch.tensor(float("nan")), 4)
    losses.add(torch.tensor(1.0), 4)
    assert losses.check() == 4  # the first bad step, counted from the start
    assert losses.check() is None  # already reported


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_layout_and_precision_by_device(fmnist_spec):
    """Channels-last on the CPU and on CUDA (tensor-core kernels), put back afterwards; bf16
    autocast only on CUDA."""
    from sensai.models import create_model

    model = create_model("fmnist_cnn", 10, 1)
    conv = next(p for p in model.parameters() if p.dim() == 4)
    with fast_layout(model, torch.device("cpu")) as layout:
        assert conv.is_contiguous(memory_format=torch.channels_last)
        assert layout(torch.zeros(2, 1, 28, 28)).is_contiguous(memory_format=torch.channels_last)
    assert conv.is_contiguous()
    with mixed_precision(torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    assert isinstance(mixed_precision(torch.device("cuda")), torch.autocast)

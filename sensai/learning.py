"""What every training loop here shares: the augmentation, batched prediction and top-1.

Training the original model (``sensai.training``) and retraining subnets (``sensai.pruning``)
both use these, so they live in the core rather than in either stage.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from tqdm.auto import tqdm

from sensai.data import DatasetSpec, ImageDataset, iterate_batches, normalize


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flips of a uint8 batch (cheap, and right for clothes and CIFAR objects)."""
    flip = torch.rand(images.shape[0], generator=generator) < 0.5
    if flip.any():
        images = images.clone()
        images[flip] = images[flip].flip(-1)
    return images


@contextmanager
def fast_layout(model: nn.Module, device: torch.device
                ) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Run ``model`` in the memory layout its convolutions run fastest in on ``device``:
    channels-last on CPUs (oneDNN's own layout: no reorder of every activation on the way into
    and out of each convolution), the default elsewhere.  Yields what puts a batch in that
    layout; the model is back in the default layout afterwards, for saving, pruning and export.
    Nested (an evaluation inside training), the outer block keeps the layout."""
    params = list(model.parameters())
    if device.type != "cpu" or any(is_lazy(p) for p in params):  # lazy: no shape to lay out yet
        yield lambda x: x
        return

    def to_layout(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x

    if any(p.dim() == 4 and not p.is_contiguous() for p in params):
        yield to_layout  # in the layout already: an outer block restores it
        return
    model.to(memory_format=torch.channels_last)
    try:
        yield to_layout
    finally:
        model.to(memory_format=torch.contiguous_format)


@torch.no_grad()
def predict_logits(model: nn.Module, dataset: ImageDataset, spec: DatasetSpec, device: torch.device,
                   indices: np.ndarray | None = None, batch_size: int = 512,
                   progress: str | None = None) -> torch.Tensor:
    """Logits of ``model`` for ``dataset[indices]`` (all by default), in order, on the CPU."""
    model.eval().to(device)
    out = []
    n = len(dataset) if indices is None else len(indices)
    with fast_layout(model, device) as layout, \
            tqdm(total=n, desc=progress, disable=progress is None, leave=False) as bar:
        for x, _ in iterate_batches(dataset, batch_size, indices=indices):
            out.append(model(layout(normalize(x.to(device), spec))).float().cpu())
            bar.update(len(x))
    return torch.cat(out) if out else torch.empty(0)


def top1(logits: torch.Tensor, labels) -> float:
    labels = torch.as_tensor(np.asarray(labels))
    return float((logits.argmax(1) == labels).float().mean()) if len(labels) else float("nan")

"""What every training loop here shares: the augmentation, batched prediction and top-1.

Training the original model (``sensai.training``) and retraining subnets (``sensai.pruning``)
both use these, so they live in the core rather than in either stage.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sensai.data import DatasetSpec, ImageDataset, iterate_batches, normalize


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flips of a uint8 batch (cheap, and right for clothes and CIFAR objects)."""
    flip = torch.rand(images.shape[0], generator=generator) < 0.5
    if flip.any():
        images = images.clone()
        images[flip] = images[flip].flip(-1)
    return images


@torch.no_grad()
def predict_logits(model: nn.Module, dataset: ImageDataset, spec: DatasetSpec, device: torch.device,
                   indices: np.ndarray | None = None, batch_size: int = 512,
                   progress: str | None = None) -> torch.Tensor:
    """Logits of ``model`` for ``dataset[indices]`` (all by default), in order, on the CPU."""
    model.eval().to(device)
    out = []
    n = len(dataset) if indices is None else len(indices)
    with tqdm(total=n, desc=progress, disable=progress is None, leave=False) as bar:
        for x, _ in iterate_batches(dataset, batch_size, indices=indices):
            out.append(model(normalize(x.to(device), spec)).float().cpu())
            bar.update(len(x))
    return torch.cat(out) if out else torch.empty(0)


def top1(logits: torch.Tensor, labels) -> float:
    labels = torch.as_tensor(np.asarray(labels))
    return float((logits.argmax(1) == labels).float().mean()) if len(labels) else float("nan")

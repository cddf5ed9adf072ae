"""Training batches cut on the training device from one uint8 tensor of images.

A training step that gathers, flips and normalises its batch on the host and copies it over
leaves an accelerator waiting for Python at every step.  Here the images (and whatever else is
indexed per image: labels, soft targets) go to the device once; an epoch's order and flips are
drawn on the host in one go (the same draws, in the same order, as one batch at a time) and go
over once; each batch is then a gather, a flip and a normalisation on the device that never
waits for the host.  On the CPU the "device" copies are the tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .data import DatasetSpec


def flips(n: int, generator: torch.Generator) -> torch.Tensor:
    """Which of ``n`` images are mirrored: the draws ``augment`` makes batch by batch, at once
    (the CPU generator gives ``rand(n)`` as the concatenation of the smaller draws)."""
    return torch.rand(n, generator=generator) < 0.5


def mirror(images: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """``images`` with the rows where ``flip`` is true mirrored left to right; no data-dependent
    branch, so on a device the host never waits for it."""
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without the host waiting for the copy (pinned first on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class Batch:
    x: torch.Tensor  # float32 network input, normalised, on the device
    positions: torch.Tensor  # which images (rows of the held tensor), on the device
    rows: slice  # which items of the epoch's plan
    size: int


class DeviceImages:
    """uint8 images ``[M, C, H, W]`` held on ``device``, normalised there batch by batch."""

    def __init__(self, images: torch.Tensor, spec: DatasetSpec, device: torch.device) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError("images must be uint8 [M, C, H, W]")
        self.device = device
        self.images = to_device(images, device)
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(spec.mean, dtype=torch.float32, device=device).view(shape)
        self.std = torch.tensor(spec.std, dtype=torch.float32, device=device).view(shape)

    def __len__(self) -> int:
        return len(self.images)

    def input(self, positions: torch.Tensor, flip: torch.Tensor | None = None) -> torch.Tensor:
        """Network input for ``images[positions]``, mirrored where ``flip``: ``augment`` then
        ``normalize``, with the normalisation's constants made once, on the device."""
        x = self.images[positions]
        if flip is not None:
            x = mirror(x, flip)
        return (x.to(torch.float32).div_(255.0) - self.mean) / self.std

    def epoch(self, positions: np.ndarray | torch.Tensor, batch_size: int, *,
              generator: torch.Generator | None = None) -> Iterator[Batch]:
        """Batches over ``positions`` in order; with ``generator`` each image is mirrored at
        random, drawn for the whole epoch up front."""
        pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
        n = len(pos)
        flip = None if generator is None else to_device(flips(n, generator), self.device)
        pos = to_device(pos, self.device)
        for s in range(0, n, batch_size):
            part = slice(s, min(s + batch_size, n))
            yield Batch(self.input(pos[part], None if flip is None else flip[part]), pos[part],
                        part, part.stop - part.start)

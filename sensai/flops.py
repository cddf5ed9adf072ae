"""Multiply-accumulate count of a network, to compare a full model with its pruned subnets."""

from __future__ import annotations

import torch
from torch import nn


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def count_flops(model: nn.Module, input_shape: tuple[int, int, int]) -> int:
    """Multiply-accumulates of every ``nn.Conv2d`` and ``nn.Linear`` for one input ``(C, H, W)``.

    Measured with forward hooks on a real forward pass (batch 1, eval mode), so strides, padding,
    groups and whatever the architecture does between layers are accounted for exactly.  Batch norm,
    activations and pooling are left out: they are a few percent and do not change with pruning
    differently from the convolutions around them.
    """
    if len(input_shape) != 3 or any(int(s) < 1 for s in input_shape):
        raise ValueError(f"input_shape must be (C, H, W) with positive sizes, got {input_shape!r}")
    total = 0

    def conv_hook(m: nn.Conv2d, inputs, out):
        nonlocal total
        k = m.kernel_size[0] * m.kernel_size[1]
        total += (out.numel() // out.shape[0]) * (m.in_channels // m.groups) * k

    def linear_hook(m: nn.Linear, inputs, out):
        nonlocal total
        total += (out.numel() // out.shape[0]) * m.in_features

    modes = {m: m.training for m in model.modules()}
    handles = []
    try:
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                handles.append(m.register_forward_hook(conv_hook))
            elif isinstance(m, nn.Linear):
                handles.append(m.register_forward_hook(linear_hook))
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, *(int(s) for s in input_shape), device=_device_of(model)))
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return int(total)

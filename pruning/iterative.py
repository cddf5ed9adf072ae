"""Iterative pruning: reach a size budget in K prune -> retrain steps instead of one shot.

Step i of K prunes to ``shrink ** (i / K)`` fewer parameters and MACs than the *original* (for the
``params`` policy, ``params_fraction ** (i / K)`` of its parameters), so every step removes the
same ratio and the last one lands exactly on the one-shot budget.  Between steps the subnet is
retrained, and the next step ranks channels by statistics of the *retrained* subnet on the group's
own images: a channel that retraining made redundant goes, one it made important stays.

The first step is the decomposition's prune stage; the later ones run inside the retraining task
(:func:`.retrain.retrain_state`), so they need no more than the task already has: the subnet, the
images of its plan and two numbers, the original's parameters and MACs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
import torch
from torch import nn

from sensai.data import DatasetSpec, TensorImages

from .apoz import collect_activation_stats
from .prune import PruningPolicy, find_prunable, prune_to_policy

MAX_STEPS = 10


def step_policies(policy: PruningPolicy, steps: int) -> list[PruningPolicy]:
    """The policy of each of ``steps`` steps; the last one is ``policy`` itself."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"the number of pruning steps must be an integer from 1 to {MAX_STEPS}, "
                         f"got {steps!r}")
    if steps == 1:
        return [policy]
    if not policy.budgeted:
        raise ValueError("an iterative schedule needs a size budget to approach step by step "
                         "(the shrink or params policy)")
    if policy.kind == "shrink":
        early = [replace(policy, shrink=policy.shrink ** (i / steps)) for i in range(1, steps)]
    else:
        early = [replace(policy, params_fraction=policy.params_fraction ** (i / steps))
                 for i in range(1, steps)]
    return [*early, policy]


def group_images(positions: np.ndarray, targets: np.ndarray, limit: int, seed: int) -> np.ndarray:
    """Indices (into the plan's distinct images) of up to ``limit`` images of the group's own
    classes: targets above 0, the "not mine" target being 0 for both head kinds."""
    own = np.unique(np.asarray(positions)[np.asarray(targets) > 0])
    if len(own) > limit:
        own = np.sort(np.random.default_rng(seed).choice(own, limit, replace=False))
    return own


def prune_further(model: nn.Module, images: torch.Tensor, indices: np.ndarray, spec: DatasetSpec,
                  device: torch.device, policy: PruningPolicy, reference: Sequence[int], *,
                  residual: bool, zero_threshold: float) -> nn.Module:
    """One later step: re-rank ``model``'s channels on ``images[indices]`` and prune it (a copy,
    on the CPU) to ``policy``'s budget stated against ``reference`` = (parameters, MACs)."""
    example = torch.zeros(1, *spec.input_shape)
    model = model.to("cpu")
    layers = find_prunable(model, example, residual=residual)
    relus = sorted({r for layer in layers for r in layer.relus})
    data = TensorImages(images, np.zeros(len(images), dtype=np.int64))
    stats = collect_activation_stats(model, data, spec, device, indices=indices,
                                     zero_threshold=zero_threshold, modules=relus)
    pruned, _ = prune_to_policy(model.to("cpu"), layers, stats, policy, example,
                                reference=(int(reference[0]), int(reference[1])))
    return pruned

"""Per-channel activation statistics (APoZ, mean |a|) over a group's own training images.

APoZ — the Average Percentage of Zeros of a channel after its ReLU — is sensAI's pruning signal: a
channel that is almost always zero on the images of the classes a subnet keeps contributes nothing
to it.  Statistics are streamed batch by batch (only per-channel sums are kept), so any number of
images fits in memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sensai.data import DatasetSpec, ImageDataset, iterate_batches, normalize
from sensai.errors import SensaiError
from sensai.learning import fast_layout

from .errors import UnsupportedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelStats:
    apoz: np.ndarray      # [C] fraction of activations with |a| <= zero_threshold
    mean_abs: np.ndarray  # [C] mean |a|
    count: int            # activation values seen per channel (images x H x W)

    @property
    def channels(self) -> int:
        return int(self.apoz.shape[0])


class ChannelStatsAccumulator:
    """Streaming per-channel zero counts and |a| sums of ``[B, C, H, W]`` or ``[B, C]`` activations."""

    def __init__(self, zero_threshold: float = 0.005):
        if not zero_threshold >= 0:
            raise ValueError(f"zero_threshold must be >= 0, got {zero_threshold}")
        self.zero_threshold = float(zero_threshold)
        self._zeros: torch.Tensor | None = None
        self._abs_sum: torch.Tensor | None = None
        self._count = 0

    def update(self, act: torch.Tensor) -> None:
        if act.ndim not in (2, 4):
            raise ValueError(f"activations must be [B, C, H, W] or [B, C], got shape {tuple(act.shape)}")
        a = act.detach()
        dims = (0, 2, 3) if a.ndim == 4 else (0,)
        mag = a.abs()
        # Compared in the activations' own precision, so a value stored as "0.005" counts as
        # zero for the threshold 0.005; summed in float64 so long streams do not lose counts.
        # Kept on the activations' device until result(): a copy to the host here would wait
        # for the device at every layer of every batch.
        zeros = (mag <= self.zero_threshold).sum(dim=dims)
        abs_sum = mag.to(torch.float64).sum(dim=dims)
        if self._zeros is None:
            self._zeros, self._abs_sum = zeros, abs_sum
        else:
            if zeros.shape != self._zeros.shape:
                raise UnsupportedModel(
                    f"activations changed from {self._zeros.shape[0]} to {zeros.shape[0]} "
                    "channels between calls: one nn.ReLU module applied at two places of "
                    "different widths? give every activation its own nn.ReLU module")
            self._zeros += zeros
            self._abs_sum += abs_sum
        self._count += a.numel() // a.shape[1]

    def result(self) -> ChannelStats:
        if self._zeros is None or self._count == 0:
            raise ValueError("no activations were recorded")
        zeros = self._zeros.to("cpu", torch.float64)
        return ChannelStats(apoz=(zeros / self._count).numpy(),
                            mean_abs=(self._abs_sum.cpu() / self._count).numpy(),
                            count=self._count)


def _relu_modules(model: nn.Module, modules: list[str] | None) -> dict[str, nn.ReLU]:
    named = dict(model.named_modules())
    if modules is None:
        found = {n: m for n, m in named.items() if isinstance(m, nn.ReLU)}
        if not found:
            raise ValueError("the model has no nn.ReLU modules to record activations at")
        return found
    out = {}
    for n in modules:
        m = named.get(n)
        if not isinstance(m, nn.ReLU):
            raise ValueError(f"{n!r} is not an nn.ReLU module of the model"
                             + ("" if m is None else f" (it is {type(m).__name__})"))
        out[n] = m
    return out


@torch.no_grad()
def collect_activation_stats(
    model: nn.Module,
    dataset: ImageDataset,
    spec: DatasetSpec,
    device: torch.device,
    *,
    indices,
    zero_threshold: float = 0.005,
    batch_size: int = 256,
    modules: list[str] | None = None,
    progress: str | None = None,
) -> dict[str, ChannelStats]:
    """APoZ and mean |a| at the output of each ReLU in ``modules`` (all ReLUs when None).

    Only ``dataset[indices]`` is fed — for sensAI, the training images of the subnet's own classes.
    The model runs in eval mode (batch norm uses its running statistics, as at serving time) and
    is put back in the mode it was in; the hooks are removed whatever happens.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size == 0:
        raise SensaiError("no images to collect activation statistics from (empty index list)")
    relus = _relu_modules(model, modules)
    accs = {n: ChannelStatsAccumulator(zero_threshold) for n in relus}
    calls = {n: 0 for n in relus}

    def make_hook(name: str):
        def hook(module, inputs, output):
            calls[name] += 1
            accs[name].update(output)
        return hook

    modes = {m: m.training for m in model.modules()}
    handles = []
    try:
        for n, m in relus.items():
            handles.append(m.register_forward_hook(make_hook(n)))
        model.eval().to(device)
        n_batches = 0
        with fast_layout(model, device) as layout, \
                tqdm(total=len(indices), desc=progress, disable=progress is None, unit="img",
                     leave=False) as bar:
            for x, _ in iterate_batches(dataset, batch_size, indices=indices):
                model(layout(normalize(x.to(device), spec)))
                n_batches += 1
                bar.update(len(x))
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    reused = [n for n, c in calls.items() if c > n_batches]
    if reused:
        # One module applied at two places would mix two different activations in one statistic.
        raise UnsupportedModel(f"ReLU module {reused[0]!r} is called more than once per forward "
                               "pass; give every activation its own nn.ReLU module")
    unused = [n for n, c in calls.items() if c == 0]
    if unused:
        raise UnsupportedModel(f"ReLU module {unused[0]!r} is never called in the forward pass")
    return {n: acc.result() for n, acc in accs.items()}

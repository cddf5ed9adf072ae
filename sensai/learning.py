"""What every training loop here shares: the augmentation, batched prediction and top-1.

Training the original model (``sensai.training``) and retraining subnets (``sensai.pruning``)
both use these, so they live in the core rather than in either stage.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from tqdm.auto import tqdm

from sensai.data import DatasetSpec, ImageDataset, iterate_batches, normalize
from sensai.errors import SensaiError
from sensai.feed import flips, mirror


def warmup_cosine(lr: float, total_steps: int, warm: int) -> Callable[[int], float]:
    """The learning rate at each step: a linear ramp to ``lr`` over ``warm`` steps, then cosine
    decay to zero at ``total_steps`` (training and retraining alike)."""

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        return 0.5 * lr * (1 + math.cos(math.pi * (step - warm) / max(1, total_steps - warm)))

    return lr_at


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flips of a uint8 batch (cheap, and right for clothes and CIFAR objects)."""
    return mirror(images, flips(images.shape[0], generator))


@contextmanager
def fast_layout(model: nn.Module, device: torch.device
                ) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Run ``model`` in the memory layout its convolutions run fastest in on ``device``:
    channels-last on CPUs (oneDNN's own layout: no reorder of every activation on the way into
    and out of each convolution) and on CUDA (the layout of cuDNN's tensor-core kernels, which
    bf16 runs on), the default elsewhere.  Yields what puts a batch in that layout; the model is
    back in the default layout afterwards, for saving, pruning and export.
    Nested (an evaluation inside training), the outer block keeps the layout."""
    params = list(model.parameters())
    if device.type not in ("cpu", "cuda") or any(is_lazy(p) for p in params):  # lazy: no shape
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


def mixed_precision(device: torch.device, cache: bool = True) -> ContextManager:
    """Where training runs in bf16: on CUDA (tensor cores; bf16 keeps fp32's range, so no loss
    scaling), never on the CPU (most have no bf16 arithmetic and would emulate it). ``cache``
    off while a CUDA graph is captured: autocast's cache of cast weights would outlive it."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


def tune_for(device: torch.device) -> None:
    """Let cuDNN pick the fastest convolution algorithms for the shapes it meets (the training
    shapes repeat every step, so the search pays back at once)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def optimizer_options(device: torch.device) -> dict:
    """One fused kernel per optimizer step on CUDA instead of a few per parameter."""
    return {"fused": True} if device.type == "cuda" else {}


def step_model(model: nn.Module, compile_: bool) -> nn.Module:
    """What a training step calls: ``model`` itself, or with ``compile_`` the same module
    through ``torch.compile`` (Inductor fuses each batch norm and ReLU with their neighbours, so
    a step launches fewer kernels; the parameters stay the model's own).  The first step of each
    batch shape compiles, for tens of seconds: worth it for long runs only."""
    return torch.compile(model) if compile_ else model


class StepLosses:
    """Every step's loss, kept on the device so a step never waits for the host to read it.

    :meth:`check` reads the steps recorded since the last check (one host wait per call, made
    when :meth:`read_due` says) and says whether they were all finite; :meth:`values` reads
    them all.
    """

    READ_EVERY = 50  # steps between reads: each makes the host wait for the device

    def __init__(self, steps: int, device: torch.device) -> None:
        self.losses = torch.zeros(max(1, steps), dtype=torch.float32, device=device)
        self.sizes: list[int] = []
        self.checked = 0

    def add(self, loss: torch.Tensor, size: int) -> None:
        self.losses[len(self.sizes)] = loss.detach().float()
        self.sizes.append(size)

    def __len__(self) -> int:
        return len(self.sizes)

    def read_due(self) -> bool:
        """Whether the loop should read the losses now (every ``READ_EVERY`` steps)."""
        return len(self.sizes) % self.READ_EVERY == 0

    def check(self) -> int | None:
        """The first step (1-based) since the last check whose loss is not finite, else None."""
        end = len(self.sizes)
        part = self.losses[self.checked:end].cpu().numpy()
        start, self.checked = self.checked, end
        bad = np.flatnonzero(~np.isfinite(part))
        return start + int(bad[0]) + 1 if len(bad) else None

    def stop_if_diverged(self, what: str) -> None:
        """:meth:`check`, raising the one-line :class:`SensaiError` a user acts on."""
        bad = self.check()
        if bad is not None:
            raise SensaiError(f"{what} diverged (the loss stopped being finite at step {bad}); "
                              "lower the learning rate (--set lr=...)")

    def values(self) -> np.ndarray:
        return self.losses[:len(self.sizes)].cpu().numpy().astype(np.float64)

    def mean(self) -> float:
        """The loss averaged over items (a short last batch weighs less)."""
        if not self.sizes:
            return float("nan")
        sizes = np.asarray(self.sizes, dtype=np.float64)
        return float((self.values() * sizes).sum() / sizes.sum())

    def tail_mean(self, share: float = 0.1) -> float:
        """Mean loss of the last ``share`` of the steps (at least one)."""
        v = self.values()
        return float(v[-max(1, int(len(v) * share)):].mean()) if len(v) else float("nan")


def eval_batch_size(device: torch.device) -> int:
    """Images per forward pass where nothing is trained: on CUDA large enough that a small
    network's pass is not a handful of launches waiting on the host; elsewhere what keeps a
    CPU's caches warm."""
    return 2048 if device.type == "cuda" else 512


@torch.no_grad()
def predict_logits(model: nn.Module, dataset: ImageDataset, spec: DatasetSpec, device: torch.device,
                   indices: np.ndarray | None = None, batch_size: int | None = None,
                   progress: str | None = None) -> torch.Tensor:
    """Logits of ``model`` for ``dataset[indices]`` (all by default), in order, on the CPU."""
    batch_size = batch_size or eval_batch_size(device)
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

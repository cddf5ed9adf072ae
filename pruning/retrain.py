"""Retraining of one pruned subnet on its own classes against everything else (sensAI step 3).

A subnet answers for a group of ``k`` classes.  Its training set is rebalanced so that each class of
the group weighs as much as all the negatives together (the published recipe): ``k + 1`` target
classes with the same number of samples each, positives repeated when a class has too few images,
negatives drawn from all the other classes.  Targets:

* binary head (``k == 1`` and every subnet single-class): 1 logit, BCE-with-logits, 1 = mine;
* group head: ``k + 1`` logits, cross-entropy, 0 = "not one of mine", ``1 + i`` = ``classes[i]``.

``samples`` bounds the cost: each epoch draws a fresh balanced set of that size, so the work per
subnet does not grow with the dataset.

:func:`retrain_state` is a pure function of arrays and a state dict (no dataset object, no files),
so the decomposition can run it in a Ray task on any worker or in process, unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from sensai.bounds import Bound, check_bounds
from sensai.checkpoint import build_from_weights
from sensai.data import DatasetSpec
from sensai.errors import SensaiError
from sensai.feed import DeviceImages, to_device
from sensai.learning import (StepLosses, fast_layout, optimizer_options, step_model, tune_for,
                             warmup_cosine)
from sensai.models import classifier_layer, count_params, select_device
from sensai.train_step import TrainStep

from .iterative import group_images, prune_further
from .prune import PruningPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrainSettings:
    """How one subnet is fine-tuned (SGD with Nesterov momentum, warm-up then cosine to zero).
    A bad value is named as ``sensai decompose`` takes it (``metadata["name"]``), where these
    settings come from."""

    epochs: int = field(default=1, metadata={"bound": Bound(low=0),
                                             "name": "--retrain-epochs"})
    # balanced images drawn per epoch (the cost bound)
    samples: int = field(default=12_000, metadata={"bound": Bound(low=2),
                                                   "name": "--samples-per-subnet"})
    lr: float = field(default=0.02, metadata={"bound": Bound(above=0)})
    batch_size: int = field(default=128, metadata={"bound": Bound(low=1)})
    weight_decay: float = field(default=5e-4, metadata={"bound": Bound(low=0)})
    momentum: float = field(default=0.9, metadata={"bound": Bound(low=0, below=1)})
    flip: bool = True  # random horizontal flips, as in full training
    # None: k+1 equal shares; else negatives' sample fraction
    negative_share: float | None = field(default=None, metadata={"bound": Bound(above=0, below=1)})
    # weight of the teacher's (original model's) soft targets in the loss
    distill: float = field(default=0.0, metadata={"bound": Bound(low=0, high=1)})
    # softening of teacher and student in the distillation term
    temperature: float = field(default=1.0, metadata={"bound": Bound(above=0),
                                                      "name": "distill_temperature"})
    # share of negatives drawn by how much the teacher confuses them
    hard_negatives: float = field(default=0.0, metadata={"bound": Bound(low=0, high=1)})
    optimizer: str = "sgd"  # "sgd" (Nesterov momentum) or "adam" (lr ~1e-3)
    seed: int = field(default=0, metadata={"bound": Bound(low=0)})
    compile: bool = False  # the step through torch.compile (how it runs, not what it learns)
    capture: bool = True  # on CUDA each full batch's step replayed from a captured graph (same)

    def validate(self) -> "RetrainSettings":
        if self.optimizer not in ("sgd", "adam"):
            raise SensaiError(f"unknown optimizer {self.optimizer!r}; choose sgd or adam")
        return check_bounds(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def balanced_sample(labels: np.ndarray, classes: Sequence[int], samples: int, *,
                    binary: bool, rng: np.random.Generator,
                    negative_share: float | None = None,
                    confusion: np.ndarray | None = None, hard_negatives: float = 0.0,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Indices into ``labels`` and their training targets for one epoch of one subnet.

    By default ``samples`` is split evenly over the ``k + 1`` target classes (k group classes +
    "not mine"); with ``negative_share`` that fraction of the samples are negatives and the rest
    is split evenly over the group's classes (the loss then weighs each class like all negatives,
    see :func:`target_weights`).  A class with fewer images than its share is repeated, negatives
    are drawn uniformly from the images of every other class.  When the group holds every class
    there are no negatives and the whole budget goes to the positives.  With ``confusion`` (per
    image of ``labels``: how much the original model believes it is one of ``classes``) a
    ``hard_negatives`` share of the negatives is drawn in proportion to it, so the subnet sees more
    of the images it is most likely to claim wrongly.  The result is shuffled.
    """
    labels = np.asarray(labels)
    classes = [int(c) for c in classes]
    if binary and len(classes) != 1:
        raise ValueError("a binary head answers for exactly one class")
    negatives = np.flatnonzero(~np.isin(labels, classes))
    if not len(negatives):
        n_neg, n_pos = 0, max(1, samples // len(classes))
    elif negative_share is None:
        n_neg = n_pos = max(1, samples // (len(classes) + 1))
    else:
        n_neg = max(1, int(round(samples * negative_share)))
        n_pos = max(1, (samples - n_neg) // len(classes))
    idx, tgt = [], []
    for pos, c in enumerate(classes):
        pool = np.flatnonzero(labels == c)
        if len(pool) == 0:
            raise SensaiError(f"class {c} has no training images to retrain its subnet on")
        reps, rest = divmod(n_pos, len(pool))
        chosen = np.concatenate([np.tile(pool, reps), rng.choice(pool, size=rest, replace=False)])
        idx.append(chosen)
        tgt.append(np.full(len(chosen), 1 if binary else pos + 1, dtype=np.int64))
    if n_neg:
        n_hard = int(round(n_neg * hard_negatives)) if confusion is not None else 0
        chosen = rng.choice(negatives, size=n_neg - n_hard, replace=n_neg - n_hard > len(negatives))
        if n_hard:
            # NaN = the teacher was not asked about that image: it is no hard-negative candidate.
            w = np.clip(np.nan_to_num(np.asarray(confusion, dtype=np.float64)[negatives]), 0, None)
            if w.sum() > 0:
                hard = rng.choice(negatives, size=n_hard, replace=True, p=w / w.sum())
            else:
                hard = rng.choice(negatives, size=n_hard, replace=n_hard > len(negatives))
            chosen = np.concatenate([chosen, hard])
        idx.append(chosen)
        tgt.append(np.zeros(len(chosen), dtype=np.int64))
    idx_a, tgt_a = np.concatenate(idx), np.concatenate(tgt)
    order = rng.permutation(len(idx_a))
    return idx_a[order].astype(np.int64), tgt_a[order]


def target_weights(targets: np.ndarray, num_targets: int) -> np.ndarray:
    """Per-target loss weights making every target's total weight equal to the negatives'.

    ``num_targets`` is 2 for a binary head (0 = not mine, 1 = mine) and k + 1 for a group head.
    With equal counts (the default sampling) every weight is 1.
    """
    counts = np.bincount(np.asarray(targets, dtype=np.int64), minlength=num_targets).astype(float)
    ref = counts[0] if counts[0] > 0 else counts.max()
    return np.where(counts > 0, ref / np.maximum(counts, 1), 1.0)


def retrain_plan(labels: np.ndarray, classes: Sequence[int], settings: RetrainSettings, *,
                 binary: bool, subnet_seed: int, confusion: np.ndarray | None = None,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated per-epoch samples (indices, targets) for ``settings.epochs`` epochs."""
    rng = np.random.default_rng([settings.seed, subnet_seed])
    idx, tgt = [], []
    for _ in range(settings.epochs):
        i, t = balanced_sample(labels, classes, settings.samples, binary=binary, rng=rng,
                               negative_share=settings.negative_share, confusion=confusion,
                               hard_negatives=settings.hard_negatives)
        idx.append(i)
        tgt.append(t)
    if not idx:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(idx), np.concatenate(tgt)


def soft_targets(teacher_logits: np.ndarray, classes: Sequence[int], *, binary: bool,
                 temperature: float = 1.0) -> np.ndarray:
    """What the original model says, in the subnet's output terms (float32).

    The teacher's softmax ``q`` over all N classes (of its logits / ``temperature``), folded to the
    subnet's head: binary -> ``[q_c]``; group -> ``[1 - sum(q_g), q_g...]`` ("not mine" takes the
    mass of every other class).  A subnet matching these reproduces the original's ranking through
    the merge rule.
    """
    z = np.asarray(teacher_logits, dtype=np.float64) / float(temperature)
    q = np.exp(z - z.max(axis=1, keepdims=True))
    q /= q.sum(axis=1, keepdims=True)
    mine = q[:, list(classes)]
    if binary:
        return mine.astype(np.float32)
    rest = np.clip(1.0 - mine.sum(axis=1, keepdims=True), 0.0, 1.0)
    return np.concatenate([rest, mine], axis=1).astype(np.float32)


def make_optimizer(model: nn.Module, settings: RetrainSettings,
                   device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if settings.optimizer == "adam":
        return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay,
                                 **optimizer_options(device))
    return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum,
                           nesterov=settings.momentum > 0, weight_decay=settings.weight_decay,
                           **optimizer_options(device))


def soft_on_device(soft: np.ndarray | None, n_images: int, device: torch.device) -> torch.Tensor:
    """The distillation targets, checked (one finite row per image) and moved to ``device``."""
    if soft is None or len(soft) != n_images:
        raise ValueError("distillation needs soft targets, one row per image")
    if not np.isfinite(soft).all():
        # A NaN target turns the first loss into NaN and reads as divergence; say what it is.
        raise ValueError("soft targets are not all finite (teacher logits missing for some "
                         "images)")
    return to_device(torch.as_tensor(np.asarray(soft, dtype=np.float32)), device)


def retrain_loss(weights: torch.Tensor, *, binary: bool, distill: float,
                 temperature: float) -> Callable[..., torch.Tensor]:
    """The class-weighted loss of a subnet's output against its hard targets ``y``, mixed at
    ``distill`` with the loss against the soft targets ``q`` when they are given."""

    def loss_of(out: torch.Tensor, y: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
        w = weights[y]
        if binary:
            logit = out.reshape(-1)
            hard = nn.functional.binary_cross_entropy_with_logits(logit, y.to(logit.dtype),
                                                                  reduction="none")
        else:
            logp = torch.log_softmax(out, dim=1)
            hard = -logp.gather(1, y[:, None])[:, 0]
        loss = (w * hard).sum() / w.sum()
        if q is None:
            return loss
        # Softened as the targets were; T^2 keeps the gradient's scale independent of T (Hinton).
        t = temperature
        if binary:
            sq = nn.functional.binary_cross_entropy_with_logits(logit / t, q.reshape(-1),
                                                                reduction="none")
        else:
            sq = -(q * torch.log_softmax(out / t, dim=1)).sum(dim=1)
        return (1 - distill) * loss + distill * t * t * (w * sq).sum() / w.sum()

    return loss_of


def retrain_model(model: nn.Module, images: DeviceImages, positions: np.ndarray,
                  targets: np.ndarray, settings: RetrainSettings, *,
                  binary: bool, soft: np.ndarray | None = None,
                  progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``images[positions]`` with ``targets``, in the given order,
    on the device that holds ``images``.

    ``images`` holds the distinct images the plan uses (``positions`` index into it, so repeated
    positives are not copied).  One epoch is ``settings.samples`` items.
    ``soft`` (``[M, outputs]``, see :func:`soft_targets`) is needed when ``settings.distill > 0``:
    the loss is then ``(1 - distill) * hard + distill * soft``, both with the same class weights.
    ``progress`` is called after every step with the number of items trained on so far.
    Returns training metrics; raises :class:`SensaiError` if the loss stops being finite.
    """
    settings.validate()
    device = images.device
    n = len(positions)
    if n != len(targets):
        raise ValueError("positions and targets differ in length")
    tune_for(device)
    model.to(device).train()
    opt = make_optimizer(model, settings, device)
    # Each class of the group weighs as much as all negatives together (sensAI's rebalancing);
    # with the default equal-count sampling these weights are all 1.
    n_targets = 2 if binary else classifier_layer(model)[1].out_features
    weights = torch.as_tensor(target_weights(targets, n_targets), dtype=torch.float32,
                              device=device)
    distill = float(settings.distill)
    if distill > 0:
        soft_d = soft_on_device(soft, len(images), device)
    loss_of = retrain_loss(weights, binary=binary, distill=distill,
                           temperature=settings.temperature)
    total_steps = max(1, math.ceil(n / settings.batch_size))
    # The head is new: a short warm-up keeps its first large gradients from wrecking the
    # pruned features, then cosine decay to zero.
    lr_at = warmup_cosine(settings.lr, total_steps, warm=max(1, int(0.03 * total_steps)))
    gen = torch.Generator().manual_seed(settings.seed)
    targets_d = to_device(torch.from_numpy(np.asarray(targets, dtype=np.int64)), device)
    t0 = time.perf_counter()
    losses = StepLosses(total_steps, device)
    seen = 0
    with fast_layout(model, device) as layout:
        step = TrainStep(step_model(model, settings.compile), opt, loss_of, device,
                         capture=settings.capture, prepare=layout, what="retraining")
        for i, b in enumerate(images.epoch(positions, settings.batch_size,
                                           generator=gen if settings.flip else None)):
            targets_b = (targets_d[b.rows], soft_d[b.positions]) if distill > 0 else \
                (targets_d[b.rows],)
            losses.add(step(lr_at(i), b.x, *targets_b), b.size)
            seen += b.size
            if losses.read_due():  # the only host waits inside the loop
                losses.stop_if_diverged("retraining")
            if progress is not None:
                progress(seen)
    losses.stop_if_diverged("retraining")
    calibrated = recalibrate_batchnorm(model, images, positions, batch_size=settings.batch_size)
    model.eval()
    return {"samples": int(seen), "steps": len(losses), "mean_loss": losses.mean(),
            "final_loss": losses.tail_mean(0.1),
            "seconds": round(time.perf_counter() - t0, 3), "device": str(device),
            "step": step.mode,
            "bn_calibration_images": calibrated}


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, images: DeviceImages, positions: np.ndarray, *,
                          batch_size: int = 128, max_images: int = 2048) -> int:
    """Recompute every batch norm's running mean/var for the current weights.

    Pruning removes inputs of the next layers, so the running statistics inherited from the full
    model no longer describe their outputs, and a short fine-tune (momentum 0.1) does not move
    them far enough.  A forward pass in train mode with a cumulative average (momentum None) over
    up to ``max_images`` training images gives exact statistics at no training cost.
    Returns the number of images used (0 when the model has no batch norm).
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
           and m.track_running_stats]
    if not bns or len(positions) == 0:
        return 0
    saved = [(m, m.momentum) for m in bns]
    modes = {m: m.training for m in model.modules()}
    chosen = np.asarray(positions)[:max_images]
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        for b in images.epoch(chosen, batch_size):
            model(b.x)
    finally:
        for m, momentum in saved:
            m.momentum = momentum
        for m, training in modes.items():
            m.training = training
    return int(len(chosen))


def retrain_state(arch: str, num_outputs: int, in_channels: int, state: dict[str, torch.Tensor],
                  images: np.ndarray, positions: np.ndarray, targets: np.ndarray,
                  spec: dict, settings: dict, *, binary: bool, device: str = "auto",
                  soft: np.ndarray | None = None, threads: int | None = None,
                  progress: Callable[[int], Any] | None = None, trust_code: bool = False,
                  schedule: Sequence[dict] = (), prune: dict | None = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Rebuild the subnet from ``state``, retrain it, return its new CPU state dict and metrics.

    Everything comes in as plain arrays and dicts so this runs unchanged in a Ray task (the device
    is chosen here, at run time, on whatever worker got the task) or in the calling process.
    ``trust_code``: the architecture may be a ``package.module:factory`` to import.
    ``progress`` is called as training goes with the number of plan items done so far.

    ``schedule`` (policy dicts) makes this the rest of an iterative schedule (:mod:`.iterative`):
    the plan is cut into ``len(schedule) + 1`` equal parts, each retrained with its own warm-up
    and decay, and before every part but the first the subnet is pruned further by the next
    policy.  ``prune`` then says how: ``reference`` (the original's parameters and MACs),
    ``residual``, ``zero_threshold`` and ``stats_images`` (group images ranked on).
    """
    if threads:
        torch.set_num_threads(int(threads))
    dev = select_device(device)
    model = build_from_weights(arch, num_outputs, in_channels, state, "pruned subnet weights",
                               trust_code=trust_code)
    spec_o, settings_o = DatasetSpec.from_dict(spec), RetrainSettings(**settings)
    images_t = torch.from_numpy(np.ascontiguousarray(images))
    held = DeviceImages(images_t, spec_o, dev)
    positions, targets = np.asarray(positions), np.asarray(targets)
    if schedule and prune is None:
        raise ValueError("an iterative schedule needs the pruning settings (prune=...)")
    parts = np.array_split(np.arange(len(positions)), len(schedule) + 1)
    steps = []
    before = 0  # items of the earlier parts: the count goes on over the whole plan
    for i, part in enumerate(parts):
        if i:
            own = group_images(positions, targets, int(prune["stats_images"]), settings_o.seed + i)
            model = prune_further(model, images_t, own, spec_o, dev,
                                  PruningPolicy.from_dict(schedule[i - 1]), prune["reference"],
                                  residual=bool(prune["residual"]),
                                  zero_threshold=float(prune["zero_threshold"]))
        step = retrain_model(model, held, positions[part], targets[part], settings_o,
                             binary=binary, soft=soft,
                             progress=None if progress is None else
                             lambda n, before=before: progress(before + n))
        before += len(part)
        steps.append({**step, "params": count_params(model)})
    metrics = dict(steps[-1])
    if len(steps) > 1:
        metrics.update(samples=sum(s["samples"] for s in steps), steps=sum(s["steps"] for s in steps),
                       seconds=round(sum(s["seconds"] for s in steps), 3), schedule=steps)
    metrics["threads"] = torch.get_num_threads()
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}, metrics

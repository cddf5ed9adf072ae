"""Training of a full N-class model (``sensai train``), resumable epoch by epoch."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from sensai.checkpoint import load_state_strict, load_weights, save_weights
from sensai.data import (DatasetSpec, ImageDataset, TensorImages, iterate_batches, normalize,
                         stratified_subset)
from sensai.errors import CheckpointError, SensaiError
from sensai.fsutil import atomic_path, check_out_dir, write_json_atomic
from sensai.manifest import MODEL_WEIGHTS, DatasetInfo, ModelRecord, TrainInfo, save_model_record
from sensai.feed import DeviceImages, to_device
from sensai.learning import (StepLosses, augment, fast_layout, optimizer_options, predict_logits,
                             step_model, top1, tune_for, warmup_cosine)
from sensai.models import count_params, create_model
from sensai.train_step import TrainStep

from .options import TrainOptions

log = logging.getLogger(__name__)

STATE_WEIGHTS = "train_state.safetensors"
STATE_JSON = "train_state.json"


def _save_state(out: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict) -> None:
    # Momentum buffers go into safetensors beside the weights so resuming needs no pickle.
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            tensors[f"momentum.{i}"] = buf
    with atomic_path(out / STATE_WEIGHTS) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    write_json_atomic(out / STATE_JSON, meta)


def _load_state(out: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    meta = json.loads((out / STATE_JSON).read_text())
    tensors = load_weights(out / STATE_WEIGHTS)
    load_state_strict(model, {k[6:]: v for k, v in tensors.items() if k.startswith("model.")},
                      f"training state in {out}")
    for i, p in enumerate(model.parameters()):
        buf = tensors.get(f"momentum.{i}")
        if buf is not None:
            opt.state[p]["momentum_buffer"] = buf.to(p.device)
    return meta


def resume_point(out: Path, model: nn.Module, opt: torch.optim.Optimizer, settings: dict,
                 epochs: int, resume: bool) -> tuple[int, list[dict], float]:
    """The epochs done, their history and training seconds of an unfinished run in ``out`` with
    the same ``settings`` (its weights and optimiser state loaded), else a fresh start."""
    if not (resume and (out / STATE_JSON).is_file() and (out / STATE_WEIGHTS).is_file()):
        return 0, [], 0.0
    try:
        saved = json.loads((out / STATE_JSON).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot resume from {out}: {e}; use --no-resume to start over") from None
    if not isinstance(saved, dict) or saved.get("settings") != settings:
        raise SensaiError(f"{out} holds an unfinished run with other settings; use another "
                          f"--out or --no-resume to start over")
    try:
        meta = _load_state(out, model, opt)
    except (CheckpointError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"cannot resume from {out}: {e}; use --no-resume to start over") from None
    log.info("resuming %s at epoch %d/%d", out, meta["epoch"] + 1, epochs)
    return meta["epoch"], meta["history"], meta["seconds"]


def epoch_batches(train_set: ImageDataset, spec: DatasetSpec, indices: np.ndarray,
                  batch_size: int, seed: int, gen: torch.Generator | None,
                  device: torch.device) -> Callable[[int], Iterator]:
    """``epoch -> (x, y, size)`` batches on ``device``, shuffled and (``gen``: not None)
    flipped by the epoch's seed."""
    # In-memory splits go to the device once; a folder of files is read batch by batch.
    held = labels = None
    if isinstance(train_set, TensorImages):
        held = DeviceImages(train_set.images, spec, device)
        labels = to_device(torch.from_numpy(train_set.labels), device)

    def batches(epoch: int):
        order_seed = seed * 1000 + epoch
        if held is not None:
            # The order iterate_batches(shuffle=True) gives, the flips augment() draws.
            order = np.random.default_rng(order_seed).permutation(indices)
            for b in held.epoch(order, batch_size, generator=gen):
                yield b.x, labels[b.positions], b.size
            return
        for x, y in iterate_batches(train_set, batch_size, indices=indices, shuffle=True,
                                    seed=order_seed):
            x = x if gen is None else augment(x, gen)
            yield normalize(x.to(device), spec), y.to(device), len(y)

    return batches


def train_epoch(step: TrainStep, batches: Iterator, lr_at: Callable[[int], float],
                first_step: int, losses: StepLosses, bar: tqdm, what: str) -> float:
    """One epoch's steps; returns the mean loss (raises when it stops being finite)."""
    for i, (x, y, size) in enumerate(batches):
        losses.add(step(lr_at(first_step + i), x, y), size)
        bar.update(size)
        if losses.read_due():  # the only host waits inside an epoch
            losses.stop_if_diverged(what)
            bar.set_postfix(loss=f"{losses.mean():.3f}")
    bar.close()
    losses.stop_if_diverged(what)
    return losses.mean()


def epoch_entry(model: nn.Module, test_set: ImageDataset, spec: DatasetSpec,
                device: torch.device, epoch: int, epochs: int, loss: float, *,
                evaluate: bool) -> dict:
    """The history entry of epoch ``epoch`` (1-based), with its test top-1 when ``evaluate``."""
    entry = {"epoch": epoch, "loss": loss}
    if evaluate:
        entry["test_top1"] = top1(predict_logits(model, test_set, spec, device,
                                                 progress="evaluate"), test_set.labels)
        log.info("epoch %d/%d: loss %.4f, test top-1 %.4f", epoch, epochs, entry["loss"],
                 entry["test_top1"])
    else:
        log.info("epoch %d/%d: loss %.4f", epoch, epochs, entry["loss"])
    return entry


def finish_training(out: Path, model: nn.Module, spec: DatasetSpec, settings: dict,
                    history: list[dict], seconds: float, phases: dict[str, float], step_mode: str,
                    device: torch.device) -> ModelRecord:
    """Write the trained weights and ``model.json``, and drop the state kept for resuming."""
    final_acc = history[-1].get("test_top1") if history else None
    sha = save_weights(out / MODEL_WEIGHTS, model)
    record = ModelRecord(
        model=settings["model"], num_classes=spec.num_classes, in_channels=spec.in_channels,
        dataset=DatasetInfo.from_spec(spec), weights_sha256=sha, params=count_params(model),
        test_top1=final_acc,
        train=TrainInfo(epochs=settings["epochs"], completed_epochs=len(history),
                        lr=settings["lr"], warmup=settings["warmup"],
                        batch_size=settings["batch_size"], seed=settings["seed"],
                        train_limit=settings["train_limit"], images_per_epoch=settings["n_train"],
                        device=str(device), seconds=round(seconds, 2), step=step_mode,
                        flip=settings["flip"],
                        phases=phases, history=history),
    )
    save_model_record(out, record)
    (out / STATE_JSON).unlink(missing_ok=True)
    (out / STATE_WEIGHTS).unlink(missing_ok=True)
    return record


def check_epochs(epochs: int) -> None:
    if epochs < 1:
        raise SensaiError(f"--epochs must be at least 1, got {epochs}")


def train(
    *,
    model_name: str,
    spec: DatasetSpec,
    train_set: ImageDataset,
    test_set: ImageDataset,
    out_dir: str | Path,
    epochs: int,
    options: TrainOptions = TrainOptions(),
    weight_decay: float = 5e-4,
    seed: int = 0,
    device: torch.device = torch.device("cpu"),
    resume: bool = True,
) -> ModelRecord:
    """Train ``model_name`` on ``train_set``; writes ``model.safetensors`` + ``model.json``.

    The test split is evaluated once, after the last epoch, and also after every
    ``options.eval_every``-th epoch when that is positive (each epoch's ``history`` entry has its
    loss, and ``test_top1`` where it was evaluated).  After each epoch the weights and optimiser
    state are saved, so an interrupted run continues from its last finished epoch when called
    again with the same settings.  ``options.compile`` runs the step through ``torch.compile``
    (see :func:`sensai.learning.step_model`); ``options.capture`` replays each full batch's step
    from a captured CUDA graph on CUDA (:class:`sensai.train_step.TrainStep`).
    """
    t_start = time.perf_counter()
    check_epochs(epochs)
    o = options.validate()
    out = check_out_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # The caller names the architecture itself: its consent to import a factory.
    model = create_model(model_name, spec.num_classes, spec.in_channels, trust_code=True).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=0.9, nesterov=True,
                          weight_decay=weight_decay, **optimizer_options(device))
    indices = stratified_subset(train_set.labels, o.train_limit, seed)
    steps_per_epoch = math.ceil(len(indices) / o.batch_size)
    # The data itself (its folder, classes, input shape; as JSON reads them back): a run resumed
    # on other data would be half of each.
    data = dict(data_dir=spec.data_dir and str(Path(spec.data_dir).resolve()),
                classes=list(spec.classes), input_shape=list(spec.input_shape))
    settings = dict(model=model_name, dataset=spec.name, data=data, epochs=epochs, lr=o.lr,
                    warmup=o.lr_warmup, batch_size=o.batch_size, seed=seed,
                    train_limit=o.train_limit, n_train=len(indices), flip=o.flip)
    start_epoch, history, seconds = resume_point(out, model, opt, settings, epochs, resume)
    phases: dict[str, float] = {}
    total_steps = epochs * steps_per_epoch
    lr_at = warmup_cosine(o.lr, total_steps, max(1, int(o.lr_warmup * total_steps)))
    gen = torch.Generator().manual_seed(seed)
    tune_for(device)
    batches = epoch_batches(train_set, spec, indices, o.batch_size, seed, gen if o.flip else None,
                            device)

    with fast_layout(model, device) as layout:
        step = TrainStep(step_model(model, o.compile), opt, nn.CrossEntropyLoss(), device,
                         capture=o.capture, prepare=layout, what="training")
        for epoch in range(start_epoch, epochs):
            gen.manual_seed(seed * 1000 + epoch)
            model.train()
            t0 = time.perf_counter()
            phases.setdefault("setup", round(t0 - t_start, 2))
            bar = tqdm(total=len(indices), desc=f"train {model_name} epoch {epoch + 1}/{epochs}",
                       unit="img", leave=False)
            loss = train_epoch(step, batches(epoch), lr_at, epoch * steps_per_epoch,
                               StepLosses(steps_per_epoch, device), bar,
                               f"training (epoch {epoch + 1})")
            seconds += time.perf_counter() - t0
            t1 = time.perf_counter()
            entry = epoch_entry(model, test_set, spec, device, epoch + 1, epochs, loss,
                                evaluate=epoch + 1 == epochs or
                                bool(o.eval_every and (epoch + 1) % o.eval_every == 0))
            t2 = time.perf_counter()
            history.append(entry)
            _save_state(out, model, opt, dict(settings=settings, epoch=epoch + 1, history=history,
                                              seconds=seconds))
            phases["evaluate"] = round(phases.get("evaluate", 0.0) + t2 - t1, 2)
            phases["save"] = round(phases.get("save", 0.0) + time.perf_counter() - t2, 2)
    return finish_training(out, model, spec, settings, history, seconds, phases, step.mode, device)

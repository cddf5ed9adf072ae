"""The captured training step (sensai.train_step) computes what the eager step does.

On the CPU the capture is :class:`RecordedCapture`, the stand-in that keeps the step instead of
running it when captured and replays it on the same static tensors, as a CUDA graph does; the
same comparison on a real CUDA graph runs where a GPU is (gpu-check runs this file there).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from sensai import train_step
from sensai.models import create_model
from sensai.train_step import WARMUP_STEPS, RecordedCapture, TrainStep

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.fixture(autouse=True)
def cpu_stand_in(monkeypatch):
    monkeypatch.setitem(train_step.CAPTURES, "cpu", RecordedCapture)


def batches(n_full: int, short: int, seed: int = 0, batch: int = 16):
    g = torch.Generator().manual_seed(seed)
    sizes = [batch] * n_full + ([short] if short else [])
    return [(torch.randn(b, 1, 28, 28, generator=g), torch.randint(0, 10, (b,), generator=g))
            for b in sizes]


def optimizer(kind: str, params, device: torch.device):
    fused = {"fused": True} if device.type == "cuda" else {}
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
                               **fused)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=5e-4, **fused)


def run(kind: str, capture: bool, device: torch.device, data, epochs: int = 2):
    torch.manual_seed(0)
    model = create_model("fmnist_cnn", 10, 1).to(device).train()
    opt = optimizer(kind, model.parameters(), device)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), device, capture=capture)
    losses, i = [], 0
    for _ in range(epochs):  # the short batch between full ones, as epochs end
        for x, y in data:
            lr = 0.05 * (1 - i / (epochs * len(data))) if kind == "sgd" else 3e-3
            losses.append(step(lr, x.to(device), y.to(device)))
            i += 1
    return model, step, torch.stack(losses).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_captured_step_trains_as_the_eager_step_does_a_short_last_batch_included(kind, device):
    device = torch.device(device)
    data = batches(WARMUP_STEPS + 3, short=5)
    eager_model, eager, eager_losses = run(kind, False, device, data)
    model, step, losses = run(kind, True, device, data)
    assert eager.mode == "eager" and step.mode == "captured"
    # Every loss and every weight and batch-norm statistic, after warm-up, capture, replays of
    # a changing learning rate, and eager short batches between replays.
    tol = dict(rtol=1e-4, atol=1e-5) if device.type == "cpu" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(losses, eager_losses, **tol)
    for (name, a), b in zip(model.state_dict().items(), eager_model.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    torch.manual_seed(0)
    untrained = create_model("fmnist_cnn", 10, 1).state_dict()
    moved = [not torch.equal(a.cpu(), b) for a, b in zip(model.state_dict().values(),
                                                          untrained.values())]
    assert sum(moved) > len(moved) // 2  # it trained

def test_a_loss_returned_by_a_replay_is_not_overwritten_by_the_next():
    device = torch.device("cpu")
    data = batches(WARMUP_STEPS + 3, short=0)
    _, step, losses = run("sgd", True, device, data, epochs=1)
    assert step.captured
    replayed = losses[WARMUP_STEPS:]
    assert len(set(replayed.tolist())) == len(replayed)  # each replay's own value


def test_a_step_that_cannot_be_captured_runs_eagerly_after_one_warning_line(monkeypatch, caplog):
    class Failing(RecordedCapture):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setitem(train_step.CAPTURES, "cpu", Failing)
    device = torch.device("cpu")
    data = batches(WARMUP_STEPS + 3, short=5)
    eager_model, _, eager_losses = run("sgd", False, device, data)
    with caplog.at_level(logging.WARNING, logger="sensai.train_step"):
        model, step, losses = run("sgd", True, device, data)
    warned = [r.getMessage() for r in caplog.records if r.name == "sensai.train_step"]
    assert warned == ["training: capturing the step as a CUDA graph failed (RuntimeError: "
                      "operation not permitted when stream is capturing); running it eagerly"]
    assert step.mode.startswith("eager (capture failed: RuntimeError")
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)


def test_without_a_capture_for_the_device_every_step_is_eager(monkeypatch):
    monkeypatch.delitem(train_step.CAPTURES, "cpu")
    _, step, _ = run("sgd", True, torch.device("cpu"), batches(WARMUP_STEPS + 2, short=0), 1)
    assert step.mode == "eager" and not step.captured


def retrain_variants(fmnist_spec, fmnist_train):
    """The decomposition's retraining jobs as they are (group heads, SGD) and with AdamW and
    distillation (a second target per item: the teacher's soft targets)."""
    from tests.test_decompose import retrain_jobs

    jobs = retrain_jobs(fmnist_spec, fmnist_train)
    rng = np.random.default_rng(0)
    for job in jobs[1:]:
        soft = rng.random((len(job["images"]), job["num_outputs"]), dtype=np.float32)
        job["soft"] = soft / soft.sum(1, keepdims=True)
        job["settings"] = {**job["settings"], "optimizer": "adam", "lr": 3e-3, "distill": 0.5}
    return jobs


def retrain_all(jobs, capture: bool, at_once: int) -> dict:
    from sensai.pruning.jobs import RetrainProgress, run_in_process
    from sensai.pruning.retrain import retrain_state

    for job in jobs:
        job["settings"] = {**job["settings"], "capture": capture}
    done, failures = {}, {}
    with RetrainProgress(len(jobs), sum(len(j["positions"]) for j in jobs)) as progress:
        run_in_process(iter(jobs), retrain_state, "cpu", progress,
                       lambda g, state, metrics: done.update({g: (state, metrics)}), failures,
                       at_once=at_once)
    assert not failures
    return done


def test_subnets_retrained_side_by_side_with_captured_steps_learn_what_eager_ones_do(
        fmnist_spec, fmnist_train):
    """Two subnets (SGD; AdamW with distillation) retrained at once in threads of one process,
    each capturing its own step, as subnets share one GPU: each comes out as retrained eagerly
    one after another (300 items in batches of 64: 3 eager steps, a captured one, a short one)."""
    eager = retrain_all(retrain_variants(fmnist_spec, fmnist_train), False, 1)
    captured = retrain_all(retrain_variants(fmnist_spec, fmnist_train), True, 2)
    for g in (0, 1):
        (state, metrics), (state_e, metrics_e) = captured[g], eager[g]
        assert metrics["step"] == "captured" and metrics_e["step"] == "eager"
        assert metrics["steps"] == metrics_e["steps"] == 5
        for k, v in state_e.items():
            torch.testing.assert_close(state[k].float(), v.float(), rtol=1e-5, atol=1e-6, msg=k)
        assert metrics["mean_loss"] == pytest.approx(metrics_e["mean_loss"], rel=1e-5)


def test_training_with_captured_steps_trains_as_eager_training_and_says_how_it_ran(
        tmp_path, fmnist_spec, fmnist_train, fmnist_test):
    from sensai.checkpoint import load_weights
    from sensai.training.options import TrainOptions
    from sensai.training.trainer import train

    records = {}
    for capture in (False, True):
        options = TrainOptions(train_limit=500, batch_size=100, capture=capture)
        records[capture] = train(model_name="tests.user_models:tiny_net", spec=fmnist_spec,
                                 train_set=fmnist_train, test_set=fmnist_test,
                                 out_dir=tmp_path / str(capture), epochs=2, options=options,
                                 device=torch.device("cpu"))
    assert records[False].train.step == "eager" and records[True].train.step == "captured"
    eager, captured = (load_weights(tmp_path / str(c) / "model.safetensors") for c in (False, True))
    for k, v in eager.items():
        torch.testing.assert_close(captured[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert records[True].test_top1 == pytest.approx(records[False].test_top1, abs=1e-3)

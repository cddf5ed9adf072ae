"""One optimizer step of a training loop, run eagerly or, on CUDA, replayed from a captured graph.

A small network's step (forward, backward, optimizer) launches a few hundred short kernels one by
one; at the batch sizes its accuracy wants, the GPU waits for the Python that launches them. Its
shapes repeat every step, so after a few eager steps the whole step is captured once as a CUDA
graph (``torch.cuda.CUDAGraph``) and every later full batch is copied into the graph's input
tensors and replayed: one launch per step. What varies from step to step lives in tensors the
graph reads (the batch, the targets, the learning rate); the parameters, gradients and optimizer
state are updated in place, so the model trains exactly as it would eagerly. A batch of another
shape (the short last one) runs eagerly on the same tensors. Where capture fails, the loop goes on
eagerly after one warning line.

``CAPTURES`` says how a device captures: CUDA by its graphs. :class:`RecordedCapture` is the CPU
stand-in the tests run the same loops on: it keeps the step to replay instead of running it
when captured, and replays it on the same static tensors, writing the gradients rather than
adding to them, as a graph captured with no gradients does.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from sensai.learning import mixed_precision
from sensai.raycluster import error_text

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # eager steps before capture: optimizer state exists, cuDNN has chosen
# One capture at a time in a process: a capture begins by synchronising the whole device, which
# would break another thread's capture under way (subnets retrained side by side on one GPU).
CAPTURE_LOCK = threading.Lock()


class Capture(Protocol):
    """How a device records one step and replays it."""

    optimizer_must_be_capturable: bool
    lr_dtype: torch.dtype  # of the learning rate the optimizer reads from a tensor

    def warmup(self, fn: Callable[[], None]) -> None: ...

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaCapture:
    """A CUDA graph, captured and warmed up as PyTorch documents (the eager steps before capture
    on a side stream). ``thread_local``: subnets retrained side by side in threads of one process
    (a stream each) go on launching while one of them captures."""

    optimizer_must_be_capturable = True
    lr_dtype = torch.float32  # what CUDA's fused optimizer kernels read

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor]) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()
        self.side = torch.cuda.Stream(device)

    def warmup(self, fn: Callable[[], None]) -> None:
        here = torch.cuda.current_stream(self.device)
        self.side.wait_stream(here)
        with torch.cuda.stream(self.side):
            fn()
        here.wait_stream(self.side)

    def capture(self, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class RecordedCapture:
    """The CPU stand-in for a CUDA graph: capture keeps the step without running it, replay runs
    it on the same tensors after zeroing the gradients in place (a graph's backward, captured with
    the gradients unset, writes them rather than adding to them)."""

    optimizer_must_be_capturable = False  # a CPU optimizer cannot be (and need not be)
    lr_dtype = torch.float64  # a CPU optimizer reads it as the Python float eager steps pass

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.fn: Callable[[], None] | None = None

    def warmup(self, fn: Callable[[], None]) -> None:
        fn()

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        self.fn()


CAPTURES: dict[str, Callable[[torch.device, Sequence[torch.Tensor]], Capture]] = {
    "cuda": CudaCapture}


class TrainStep:
    """``step(lr, x, *targets)``: one optimizer step of ``model`` on the batch ``x`` at learning
    rate ``lr``; returns the loss (a tensor of its own, on the device, not read by the host).

    ``loss(out, *targets)`` gets the model's output in float32. ``prepare`` puts a batch in the
    model's memory layout. With ``capture`` and a device in :data:`CAPTURES`, full batches after
    :data:`WARMUP_STEPS` eager ones replay a captured graph; ``what`` names the loop in the
    warning when capture fails. :attr:`mode` says how the steps ran.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss: Callable[..., torch.Tensor], device: torch.device, *,
                 capture: bool, prepare: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                 what: str = "training") -> None:
        self.model, self.opt, self.loss, self.device = model, optimizer, loss, device
        self.prepare, self.what = prepare, what
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        make = CAPTURES.get(device.type) if capture else None
        self.graph: Capture | None = make(device, self.params) if make else None
        self.wanted = self.graph is not None
        self.eager_steps = 0
        self.shapes: tuple | None = None  # of a full batch's tensors, from the first step
        self.static: list[torch.Tensor] = []
        self.static_loss: torch.Tensor | None = None
        self.lr: torch.Tensor | None = None  # the rate the graph reads, once captured
        self.failed: str | None = None

    @property
    def captured(self) -> bool:
        return self.static_loss is not None

    @property
    def mode(self) -> str:
        if self.captured:
            return "captured"
        return f"eager (capture failed: {self.failed})" if self.failed else "eager"

    def __call__(self, lr: float, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        batch = (x, *targets)
        shapes = tuple(t.shape for t in batch)
        if self.shapes is None:
            self.shapes = shapes
        full = shapes == self.shapes
        if self.captured and full:
            return self.replay(lr, batch)
        if self.wanted and full and self.eager_steps >= WARMUP_STEPS and not self.captured:
            try:
                self.capture(lr, batch)
            except Exception as e:  # capture is an optimisation: never the reason a run stops
                self.give_up(e)
            else:
                return self.replay(lr, batch)
        return self.eager(lr, batch)

    def compute(self, x: torch.Tensor, targets: Sequence[torch.Tensor],
                autocast_cache: bool = True) -> torch.Tensor:
        with mixed_precision(self.device, cache=autocast_cache):
            out = self.model(x)
        loss = self.loss(out.float(), *targets)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def set_lr(self, lr: float) -> None:
        if self.lr is not None:
            self.lr.fill_(lr)
            return
        for g in self.opt.param_groups:
            g["lr"] = lr

    def eager(self, lr: float, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.set_lr(lr)
        # Once captured, the gradients are the graph's own tensors: zeroed, never replaced.
        self.opt.zero_grad(set_to_none=not self.captured)
        x, *targets = batch

        def step() -> torch.Tensor:
            return self.compute(self.prepare(x), targets)

        if self.wanted and not self.captured:
            out: list[torch.Tensor] = []
            self.graph.warmup(lambda: out.append(step()))
            loss = out[0]
        else:
            loss = step()
        self.eager_steps += 1
        return loss

    def capture(self, lr: float, batch: tuple[torch.Tensor, ...]) -> None:
        x, *targets = batch
        self.static = [self.prepare(x).clone(), *(t.clone() for t in targets)]
        self.lr = torch.full((), float(lr), dtype=self.graph.lr_dtype,
                             device=self.device)
        # The optimizer's capture check wants capturable groups while it is recorded; eager
        # steps of other shapes afterwards would warn under the flag, so it is set only then.
        flagged = [g for g in self.opt.param_groups if "capturable" in g and not g["capturable"]
                   and self.graph.optimizer_must_be_capturable]
        for g in self.opt.param_groups:
            g["lr"] = self.lr
        for g in flagged:
            g["capturable"] = True
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.opt.zero_grad(set_to_none=True)  # the graph's backward allocates and writes them

        def step() -> None:
            loss.copy_(self.compute(self.static[0], self.static[1:], autocast_cache=False))

        try:
            with CAPTURE_LOCK:
                self.graph.capture(step)
        finally:
            for g in flagged:
                g["capturable"] = False
        self.static_loss = loss

    def replay(self, lr: float, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.lr.fill_(lr)
        for static, t in zip(self.static, batch):
            static.copy_(t)  # into the model's layout, too
        self.graph.replay()
        return self.static_loss.clone()

    def give_up(self, e: Exception) -> None:
        self.failed = error_text(e)
        self.wanted = False
        self.static, self.static_loss = [], None
        self.opt.zero_grad(set_to_none=True)
        if self.lr is not None:
            rate = float(self.lr)
            self.lr = None
            for g in self.opt.param_groups:
                g["lr"] = rate
        log.warning("%s: capturing the step as a CUDA graph failed (%s); running it eagerly",
                    self.what, self.failed)

"""How a model is trained beyond its architecture, data, epochs and seed.

A light module (no torch): the command line reads these fields' help for ``sensai train --set``
and ``sensai demo --set`` without loading the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sensai.bounds import Bound, check_bounds
from sensai.manifest import DEFAULT_WARMUP


@dataclass(frozen=True)
class TrainOptions:
    """The tunable part of :func:`sensai.training.trainer.train` (each field's ``help`` is what
    ``--set help`` prints)."""

    lr: float = field(default=0.05, metadata={"help": "peak learning rate",
                                              "bound": Bound(above=0)})
    lr_warmup: float = field(default=DEFAULT_WARMUP, metadata={
        "help": "fraction of all steps over which the learning rate ramps up to lr, before one "
                "cosine decay to zero", "bound": Bound(low=0, below=1)})
    batch_size: int = field(default=128, metadata={"help": "images per step",
                                                   "bound": Bound(low=1)})
    train_limit: int | None = field(default=None, metadata={
        "help": "train on at most this many images (stratified), for quick runs (none: all)",
        "bound": Bound(low=1)})
    eval_every: int = field(default=0, metadata={
        "help": "also measure test top-1 after every N-th epoch (0: after the last epoch only)",
        "bound": Bound(low=0)})
    flip: bool = field(default=True, metadata={
        "help": "mirror a random half of the training images left to right (false for data "
                "whose classes differ by left and right: digits, text, arrows, signs)"})
    compile: bool = field(default=False, metadata={
        "help": "run each training step through torch.compile (fewer, fused kernels; each "
                "model compiles for tens of seconds first)"})
    capture: bool = field(default=True, metadata={
        "help": "on CUDA, replay each full batch's step from a CUDA graph captured after a few "
                "eager steps (one launch per step); eager where capture fails, after one "
                "warning line (the CPU runs eagerly)"})

    def validate(self) -> "TrainOptions":
        return check_bounds(self)

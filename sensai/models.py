"""Models by name: :func:`create_model`, :func:`list_models` (as in timm) over the registry's
table (:mod:`sensai.registry`, ``@register_model``), and the device a model runs on.

The built-in architectures live in :mod:`sensai.architectures` (see there for what every factory
must return); users' own come in as ``package.module:factory`` strings with the same signature.
This module imports torch only inside the functions that build a network or ask CUDA, so the
command line and an ONNX-only gateway can name models and pick devices without loading it.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from .errors import SensaiError, UnknownModelError
from .registry import DESCRIPTIONS, FACTORIES, ModelFactory

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_MODEL = "fmnist_cnn"  # `sensai train`'s default: small, trains in minutes
# `sensai demo`'s: large enough that one image's compute outweighs the request path, so the
# class-parallel gain shows over HTTP, and small enough to train on a 2-core machine.
DEMO_MODEL = "vgg11_bn"


def registry() -> dict[str, ModelFactory]:
    """Every registered factory by name, the built-in architectures included (importing them is
    what registers them, and what imports torch)."""
    from . import architectures  # noqa: F401

    return FACTORIES


def list_models() -> list[str]:
    return sorted(registry())


def describe_models() -> dict[str, str]:
    return {k: DESCRIPTIONS[k] for k in list_models()}


def is_factory_path(name: str) -> bool:
    return ":" in name


def create_model(name: str, num_classes: int, in_channels: int = 3, *, trust_code: bool = False,
                 **kwargs) -> nn.Module:
    """Build a registry model, or a user's ``package.module:factory`` with the same signature.

    Importing a factory runs its module's code, so it happens only with ``trust_code``: the
    operator named it themselves (``sensai train --model``), or passed ``--trust-model-code`` to
    a command that reads the name from a file they were given.
    """
    if is_factory_path(name):
        if not trust_code:
            raise UnknownModelError(
                f"{name!r} names model code to import, which runs it; pass --trust-model-code "
                "(a command without that flag: set SENSAI_TRUST_MODEL_CODE=1) if you trust "
                "where it came from (registry models need no such consent)")
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:  # ValueError: no module name
            raise UnknownModelError(f"cannot import model factory {name!r}: {e}") from None
    else:
        try:
            factory = registry()[name]
        except KeyError:
            raise UnknownModelError(
                f"unknown model {name!r}; known models: {', '.join(list_models())} "
                "(or give package.module:factory)") from None
    if num_classes < 1 or in_channels < 1:
        raise ValueError("num_classes and in_channels must be positive")
    if not callable(factory):
        raise UnknownModelError(f"model factory {name!r} is not a function")
    try:
        model = factory(num_classes=num_classes, in_channels=in_channels, **kwargs)
    except TypeError as e:  # not a factory of this signature (json:loads, a class of others')
        raise UnknownModelError(f"model factory {name!r} must take num_classes and in_channels "
                                f"keywords and return a torch.nn.Module: {e}") from None
    from torch import nn  # loaded by any factory that built a network

    if not isinstance(model, nn.Module):
        raise UnknownModelError(f"model factory {name!r} did not return a torch.nn.Module")
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def classifier_layer(model: nn.Module) -> tuple[str, nn.Linear]:
    """The last ``nn.Linear`` (the output head that decomposition replaces)."""
    from torch import nn  # loaded: ``model`` is a network

    last = None
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            last = (n, m)
    if last is None:
        raise ValueError("model has no nn.Linear output layer")
    return last


# Where a CUDA (or ROCm) GPU can be, its driver shows one of these; where none shows, "auto"
# means the CPU without asking torch, so a CPU-only ONNX path never imports it.
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def gpu_possible() -> bool:
    return any(os.path.exists(p) for p in GPU_DRIVER_PATHS)


def select_device(preference: str = "auto") -> torch.device:
    """``auto`` -> CUDA when present, else CPU; ``cuda:1`` etc. are checked, never assumed."""
    import torch

    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(preference)
    except RuntimeError:
        raise SensaiError(f"unknown device {preference!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SensaiError(f"device {preference!r} requested but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SensaiError(f"device {preference!r} requested but only "
                              f"{torch.cuda.device_count()} GPU(s) exist")
    return dev


def device_for_worker(index: int, preference: str = "auto") -> str:
    """Device of the ``index``-th of several parallel workers: with ``auto`` or ``cuda`` and
    ``n`` GPUs, GPU ``index mod n`` (one GPU per worker, several workers per GPU when there are
    more workers than GPUs); a numbered GPU (``cuda:1``) is every worker's.  The CPU (asked for,
    or ``auto`` where no GPU driver shows) is answered without torch."""
    if preference == "cpu" or (preference == "auto" and not gpu_possible()):
        return "cpu"
    dev = select_device(preference)
    if dev.type == "cuda" and dev.index is None:
        import torch  # loaded by select_device

        return f"cuda:{index % torch.cuda.device_count()}"
    return str(dev)

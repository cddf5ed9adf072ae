"""Weights on disk: safetensors only, checked against their recorded hash and the architecture.

Pruned subnets are rebuilt without pickled modules: the registry builds the original architecture
and :func:`resize_to_state_dict` shrinks each conv / batch-norm / linear layer to the shapes found in
the safetensors file, which is all structured channel pruning changes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .errors import CheckpointError, first_line
from .fsutil import atomic_path, check_out_dir, sha256_file
from .manifest import MODEL_WEIGHTS, DatasetInfo, ModelRecord, load_model_record, save_model_record
from .models import count_params, create_model

log = logging.getLogger(__name__)


def save_weights(path: str | Path, model: nn.Module) -> str:
    """Write the model's state dict as safetensors, atomically; returns the file's sha256."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp))
    return sha256_file(path)


def load_weights(path: str | Path, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file {path} does not exist")
    if expected_sha256 is not None and not expected_sha256:
        raise CheckpointError(f"weights file {path} has an empty hash in its record; refusing "
                              "to load what cannot be checked")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise CheckpointError(f"weights file {path} does not match the hash in its record "
                              "(corrupt or replaced)")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"weights file {path} is not a readable safetensors file: {e}") from None


def load_state_strict(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``load_state_dict(strict=True)`` with a one-line explanation instead of a traceback."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if mismatched:
            k = mismatched[0]
            parts.append(f"{len(mismatched)} of another shape (e.g. {k}: file "
                         f"{tuple(state[k].shape)} vs model {tuple(own[k].shape)})")
        raise CheckpointError(f"{what} do not fit the architecture: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)


def resize_to_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Replace conv / batch-norm / linear layers by ones with the shapes stored in ``state``.

    Depthwise convolutions (groups == in_channels) stay depthwise at their new width.
    """
    for name, module in list(model.named_modules()):
        if not name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        w = state.get(f"{name}.weight")
        if isinstance(module, nn.Conv2d) and w is not None:
            cout, cin_per_group = int(w.shape[0]), int(w.shape[1])
            depthwise = module.groups > 1 and module.groups == module.in_channels
            groups = cout if depthwise else module.groups
            cin = cin_per_group * groups
            if (cout, cin, groups) != (module.out_channels, module.in_channels, module.groups):
                setattr(parent, attr, nn.Conv2d(
                    cin, cout, module.kernel_size, module.stride, module.padding, module.dilation,
                    groups, module.bias is not None, module.padding_mode))
        elif isinstance(module, nn.BatchNorm2d) and w is not None:
            if int(w.shape[0]) != module.num_features:
                setattr(parent, attr, nn.BatchNorm2d(int(w.shape[0]), module.eps, module.momentum,
                                                     module.affine, module.track_running_stats))
        elif isinstance(module, nn.Linear) and w is not None:
            if tuple(w.shape) != (module.out_features, module.in_features):
                setattr(parent, attr, nn.Linear(int(w.shape[1]), int(w.shape[0]),
                                                module.bias is not None))
    return model


def build_from_weights(arch: str, num_outputs: int, in_channels: int,
                       state: dict[str, torch.Tensor], what: str, *,
                       trust_code: bool = False) -> nn.Module:
    """A (possibly pruned) network of architecture ``arch`` holding ``state`` (``trust_code``:
    see :func:`sensai.models.create_model`)."""
    model = resize_to_state_dict(create_model(arch, num_outputs, in_channels,
                                              trust_code=trust_code), state)
    load_state_strict(model, state, what)
    return model.eval()


def load_trained_model(model_dir: str | Path, *, trust_code: bool = False
                       ) -> tuple[nn.Module, ModelRecord]:
    """Rebuild the model saved by ``sensai train``/``sensai import`` in ``model_dir`` (eval mode;
    ``trust_code``: see :func:`sensai.models.create_model`)."""
    model_dir = Path(model_dir)
    record = load_model_record(model_dir)
    model = create_model(record.model, record.num_classes, record.in_channels,
                         trust_code=trust_code)
    state = load_weights(model_dir / record.weights, record.weights_sha256)
    load_state_strict(model, state, f"weights in {model_dir / record.weights}")
    return model.eval(), record


def import_weights(model_dir: str | Path, arch: str, spec, weights_path: str | Path,
                   test_top1: float | None = None) -> ModelRecord:
    """Adopt a user's own trained weights (safetensors, or a plain tensor state dict in a .pt/.pth
    loaded with ``weights_only=True``) for a registry model or ``package.module:factory``;
    ``model_dir`` is made only once the weights fit the model."""
    model_dir, weights_path = check_out_dir(model_dir), Path(weights_path)
    if weights_path.is_dir():
        raise CheckpointError(f"weights file {weights_path} is a directory; give the file")
    if not weights_path.is_file():
        raise CheckpointError(f"weights file {weights_path} does not exist")
    if weights_path.stat().st_size == 0:
        raise CheckpointError(f"weights file {weights_path} is empty")
    if weights_path.suffix == ".safetensors":
        state = load_weights(weights_path)
    else:
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses arbitrary objects with various errors
            why = first_line(e)
            if why.startswith("Weights only load failed"):
                # torch's own text goes on to advise weights_only=False, which runs the file.
                why = ("it holds objects other than tensors, or is no torch file: save "
                       "model.state_dict(), or the weights as .safetensors")
            raise CheckpointError(f"cannot load {weights_path} as a plain state dict "
                                  f"(weights_only=True): {why}") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{weights_path} does not hold a state dict of tensors")
    # The operator named ``arch`` on the command line: their consent to import it.
    model = create_model(arch, spec.num_classes, spec.in_channels, trust_code=True)
    load_state_strict(model, state, f"weights in {weights_path}")
    model_dir.mkdir(parents=True, exist_ok=True)
    sha = save_weights(model_dir / MODEL_WEIGHTS, model)
    record = ModelRecord(model=arch, num_classes=spec.num_classes, in_channels=spec.in_channels,
                         dataset=DatasetInfo.from_spec(spec), weights_sha256=sha,
                         params=count_params(model), test_top1=test_top1)
    save_model_record(model_dir, record)
    return record

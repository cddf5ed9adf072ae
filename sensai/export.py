"""ONNX export of a (pruned) network, checked against torch before it is trusted.

The legacy TorchScript exporter (``dynamo=False``) is used on purpose: torch >= 2.9 defaults to the
``torch.export``-based exporter, which needs the extra ``onnxscript`` package and gains nothing for
plain CNNs; the TorchScript path ships with torch and gives the same graph for these models.  Every
file is verified with ONNX Runtime against torch on a real batch, so whichever exporter produced it,
a file that computes something else is never left in place.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from .errors import ExportError, first_line
from .fsutil import atomic_path

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "output"
DEFAULT_OPSET = 17


def torch_export(model: nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    """``model`` (one input, ``example`` of it) as ONNX at ``path``, with a dynamic batch axis,
    unchecked (:func:`check_onnx` checks it)."""
    kwargs = dict(input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                  dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                  opset_version=opset, do_constant_folding=True)
    with warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation on every call; it still works.
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        try:
            torch.onnx.export(model, (example,), str(path), dynamo=False, **kwargs)
        except TypeError:  # torch without the ``dynamo`` switch: legacy exporter is the default
            torch.onnx.export(model, (example,), str(path), **kwargs)


def check_onnx(path: str | Path, model: nn.Module, batch: torch.Tensor, *, atol: float = 1e-4) -> float:
    """Max |onnxruntime - torch| on ``batch`` (float32 network input); raises above ``atol``
    times the largest |output| (at least 1).
    torch runs on the model's device (``batch``'s for a module without parameters) on a copy of
    ``batch``, so a module that starts in place leaves it as it was for onnxruntime."""
    import onnxruntime as ort

    model = model.eval()
    device = next(model.parameters(), batch).device
    with torch.no_grad():
        want = model(batch.to(device).clone()).float().cpu().numpy()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), sess_options=opts,
                                       providers=["CPUExecutionProvider"])
        got = session.run([OUTPUT_NAME], {INPUT_NAME: batch.cpu().numpy().astype(np.float32)})[0]
    except Exception as e:  # onnxruntime raises its own exception types for bad graphs
        raise ExportError(f"onnxruntime cannot run {path}: {first_line(e)}") from None
    if got.shape != want.shape:
        raise ExportError(f"{path}: onnxruntime output shape {got.shape} != torch {want.shape}")
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    # float32 rounding grows with the outputs' size: logits in the tens differ by more than
    # ``atol`` between two correct kernels, so the bound scales with the largest output above 1.
    bound = atol * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    if not np.isfinite(err) or err > bound:
        raise ExportError(f"{path}: onnxruntime and torch differ by {err:.3g} "
                          f"(> {bound:.3g}: {atol:g} x max(1, largest |output|))")
    return err


def export_onnx(model: nn.Module, input_shape: Sequence[int], path: str | Path, *,
                opset: int = DEFAULT_OPSET, check_batch: torch.Tensor | None = None,
                atol: float = 1e-4) -> float:
    """Write ``model`` as ONNX at ``path`` (atomically) with a dynamic batch axis.

    ``input_shape`` is ``(C, H, W)``.  The written graph is run with onnxruntime on
    ``check_batch`` (real, normalised images; a random batch of 8 when None) and compared with
    torch; a difference above ``atol`` (times the largest |output| above 1) raises
    :class:`ExportError` and leaves no file behind.
    Returns the measured max absolute difference.
    """
    path = Path(path)
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ExportError(f"input shape must be (C, H, W), got {tuple(input_shape)}")
    # Export and check on the CPU: the graph is device independent and the check needs a
    # deterministic reference the onnxruntime CPU provider can match.
    original_device = next(model.parameters()).device
    was_training = model.training
    model = model.eval().to("cpu")
    if check_batch is None:
        check_batch = torch.randn((8, *shape), generator=torch.Generator().manual_seed(0))
    check_batch = check_batch.detach().to("cpu", torch.float32)
    if tuple(check_batch.shape[1:]) != shape:
        raise ExportError(f"check batch has shape {tuple(check_batch.shape)}, expected [B, {shape}]")
    try:
        with atomic_path(path) as tmp:
            torch_export(model, check_batch[:1], tmp, opset)
            err = check_onnx(tmp, model, check_batch, atol=atol)
    finally:
        model.to(original_device).train(was_training)
    log.debug("exported %s (max |ort - torch| = %.2e)", path, err)
    return err

"""The original model behind the same gateway: a one-group "artifact" of the model an artifact
was decomposed from, for ``sensai bench-load --sweep``'s ``single`` configuration.

The gateway serves subnets with group heads (k + 1 logits, the first "not one of mine"), merged
by :mod:`sensai.merge`.  The original's head gets that first logit as one more output row with
zero weights and a bias far below any real logit, so its softmax share is exactly 0 and the
merged scores are the original's own softmax (same top-1): ``sensai serve`` then runs the
original on one worker with the very settings, batching, admission and HTTP path the
class-parallel configurations get.  The extra row costs one dot product per image.  The
original's plain ONNX file (``full.onnx``, N logits) is written beside it for the Triton peer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sensai.artifact import Artifact, load_artifact, subnet_name
from sensai.checkpoint import save_weights
from sensai.export import export_onnx
from sensai.fsutil import sha256_file
from sensai.manifest import SubnetRecord, save_manifest
from sensai.models import classifier_layer

from .strategies import load_original

NOT_MINE_BIAS = -1e30  # exp(this - any real logit) is 0 in float64: the column never scores


def with_not_mine_head(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (modified in place) with a first output that never wins: a group head over all
    of its classes."""
    name, head = classifier_layer(model)
    grown = torch.nn.Linear(head.in_features, head.out_features + 1, bias=True)
    with torch.no_grad():
        grown.weight.zero_()
        grown.weight[1:] = head.weight
        grown.bias.fill_(NOT_MINE_BIAS)
        grown.bias[1:] = head.bias if head.bias is not None else 0.0
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, grown)
    return model


def original_as_artifact(artifact: Artifact, out_dir: Path,
                         check_batch: torch.Tensor | None = None) -> tuple[Artifact, Path]:
    """The one-group artifact of ``artifact``'s original model in ``out_dir`` (weights, ONNX,
    manifest), and the original's own ONNX file (``out_dir/full.onnx``)."""
    model, record = load_original(artifact)
    m = artifact.manifest
    shape = m.dataset.input_shape
    out_dir.mkdir(parents=True, exist_ok=True)
    full = out_dir / "full.onnx"
    export_onnx(model, shape, full, check_batch=check_batch)
    model = with_not_mine_head(model)
    sub = Path("subnets")
    (out_dir / sub).mkdir(exist_ok=True)
    weights, onnx = sub / f"{subnet_name(0)}.safetensors", sub / f"{subnet_name(0)}.onnx"
    weights_sha = save_weights(out_dir / weights, model)
    export_onnx(model, shape, out_dir / onnx, check_batch=check_batch)
    classes = list(range(m.num_classes))
    view = m.model_copy(update={
        "groups": [classes], "grouping": {"algorithm": "none: the original model, one group"},
        "pruning": {}, "retrain": {}, "evaluation": {}, "stages": {},
        "subnets": [SubnetRecord(
            index=0, classes=classes, head="group", num_outputs=m.num_classes + 1,
            weights=str(weights), weights_sha256=weights_sha, onnx=str(onnx),
            onnx_sha256=sha256_file(out_dir / onnx), params=m.source.params,
            flops=m.source.flops)]})
    save_manifest(out_dir, view)
    return load_artifact(out_dir), full

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
from sensai.checkpoint import load_trained_model, save_weights
from sensai.export import export_onnx
from sensai.flops import count_flops
from sensai.fsutil import sha256_file
from sensai.manifest import (DecompositionManifest, ModelRecord, SourceInfo, SubnetRecord,
                             save_manifest)
from sensai.models import classifier_layer

from .harness import model_code_trusted
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
    return one_group_artifact(model, record, artifact.manifest.source.model_dir, out_dir,
                              check_batch)


def model_dir_as_artifact(model_dir: str | Path, out_dir: Path,
                          check_batch: torch.Tensor | None = None) -> tuple[Artifact, Path]:
    """The same of a model ``sensai train`` (or ``sensai import``) wrote to ``model_dir``
    (its code imported only with the operator's consent, :func:`.harness.model_code_trusted`)."""
    model, record = load_trained_model(model_dir, trust_code=model_code_trusted())
    return one_group_artifact(model, record, model_dir, out_dir, check_batch)


def one_group_artifact(model: torch.nn.Module, record: ModelRecord, model_dir: str | Path,
                       out_dir: Path, check_batch: torch.Tensor | None
                       ) -> tuple[Artifact, Path]:
    shape = tuple(record.dataset.input_shape)
    out_dir.mkdir(parents=True, exist_ok=True)
    full = out_dir / "full.onnx"
    export_onnx(model, shape, full, check_batch=check_batch)
    flops = count_flops(model, shape)
    model = with_not_mine_head(model)
    sub = Path("subnets")
    (out_dir / sub).mkdir(exist_ok=True)
    weights, onnx = sub / f"{subnet_name(0)}.safetensors", sub / f"{subnet_name(0)}.onnx"
    weights_sha = save_weights(out_dir / weights, model)
    export_onnx(model, shape, out_dir / onnx, check_batch=check_batch)
    classes = list(range(record.num_classes))
    manifest = DecompositionManifest(
        model=record.model, in_channels=record.in_channels, num_classes=record.num_classes,
        dataset=record.dataset,
        source=SourceInfo(model=record.model, model_dir=str(Path(model_dir).resolve()),
                          weights_sha256=record.weights_sha256, params=record.params,
                          flops=flops, test_top1=record.test_top1),
        groups=[classes], grouping={"algorithm": "none: the original model, one group"},
        subnets=[SubnetRecord(
            index=0, classes=classes, head="group", num_outputs=record.num_classes + 1,
            weights=str(weights), weights_sha256=weights_sha, onnx=str(onnx),
            onnx_sha256=sha256_file(out_dir / onnx), params=record.params, flops=flops)])
    save_manifest(out_dir, manifest)
    return load_artifact(out_dir), full

"""The versioned records every stage reads and writes (JSON on disk, validated on load).

* :class:`ModelRecord` (``model.json`` beside ``model.safetensors``): a trained N-class model, written
  by ``sensai train`` or ``sensai import``, read by ``sensai decompose``.
* :class:`DecompositionManifest` (``manifest.json`` in an artifact directory): the groups, the method's
  settings and one :class:`SubnetRecord` per subnet; serving and the benchmark are built from it alone.

Like nanoGPT's ``model_args`` saved next to the weights: whatever is needed to rebuild a network
without unpickling anything is in here.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import CheckpointError
from .fsutil import write_json_atomic
from .spec import DatasetSpec

MODEL_RECORD_VERSION = 1
# 2: every subnet's ONNX file has its sha256 in the manifest, and it is checked at load.
MANIFEST_VERSION = 2
SHA256 = r"^[0-9a-f]{64}$"
MODEL_RECORD = "model.json"
MODEL_WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
# The fraction of the training steps the learning rate ramps up over (and what a record written
# before the fraction was recorded used).
DEFAULT_WARMUP = 0.03


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class DatasetInfo(_Frozen):
    name: str
    classes: list[str]
    input_shape: tuple[int, int, int]
    mean: list[float]
    std: list[float]
    data_dir: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if len(self.mean) != self.input_shape[0] or len(self.std) != self.input_shape[0]:
            raise ValueError("mean/std need one value per input channel")
        if any(s <= 0 for s in self.std):
            raise ValueError("std must be positive")
        return self

    @classmethod
    def from_spec(cls, spec: DatasetSpec) -> "DatasetInfo":
        return cls(**spec.to_dict())

    def to_spec(self) -> DatasetSpec:
        return DatasetSpec.from_dict(self.model_dump())


class TrainInfo(_Frozen):
    epochs: int
    completed_epochs: int
    lr: float
    warmup: float = DEFAULT_WARMUP  # the fraction of the steps the learning rate ramps up over
    batch_size: int
    seed: int
    train_limit: int | None = None
    images_per_epoch: int | None = None  # None: recorded before it was
    device: str
    seconds: float  # training steps only (not the evaluations after each epoch)
    step: str | None = None  # how the steps ran: eager or captured (None: recorded before)
    flip: bool = True  # random left-right mirroring (recorded before it could be turned off)
    phases: dict[str, float] = Field(default_factory=dict)  # this run's seconds outside the
    # steps: setup (model, optimizer, images to the device), evaluate, save
    history: list[dict[str, float]] = Field(default_factory=list)


class ModelRecord(_Frozen):
    schema_version: int = MODEL_RECORD_VERSION
    kind: Literal["model"] = "model"
    model: str  # registry name or package.module:factory
    num_classes: int
    in_channels: int
    dataset: DatasetInfo
    weights: str = MODEL_WEIGHTS
    weights_sha256: str = Field(pattern=SHA256)
    params: int
    test_top1: float | None = None
    train: TrainInfo | None = None  # None for imported weights
    created: str = Field(default_factory=utc_now)

    @model_validator(mode="after")
    def _check(self):
        if self.num_classes != len(self.dataset.classes):
            raise ValueError("num_classes does not match the dataset's classes")
        if self.in_channels != self.dataset.input_shape[0]:
            raise ValueError("in_channels does not match the dataset's input shape")
        return self


class SubnetRecord(_Frozen):
    index: int
    classes: list[int]  # indices into the dataset's classes, in output order
    head: Literal["binary", "group"]  # binary: 1 logit (BCE); group: k+1 logits, 0 = "not mine"
    num_outputs: int
    weights: str
    weights_sha256: str = Field(pattern=SHA256)
    onnx: str | None = None
    onnx_sha256: str | None = Field(None, pattern=SHA256)
    widths: dict[str, int] = Field(default_factory=dict)  # prunable layer -> output channels kept
    params: int
    flops: int
    accuracy: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        want = 1 if self.head == "binary" else len(self.classes) + 1
        if self.num_outputs != want:
            raise ValueError(f"subnet {self.index}: a {self.head} head has {want} outputs")
        if self.head == "binary" and len(self.classes) != 1:
            raise ValueError(f"subnet {self.index}: a binary head answers for exactly one class")
        if self.onnx is not None and self.onnx_sha256 is None:
            raise ValueError(f"subnet {self.index}: its ONNX file has no sha256")
        return self


class SourceInfo(_Frozen):
    model: str
    model_dir: str
    weights_sha256: str
    params: int
    flops: int
    test_top1: float | None = None


class DecompositionManifest(_Frozen):
    schema_version: int = MANIFEST_VERSION
    kind: Literal["decomposition"] = "decomposition"
    model: str  # architecture every subnet was pruned from
    in_channels: int
    num_classes: int
    dataset: DatasetInfo
    source: SourceInfo
    groups: list[list[int]]
    grouping: dict[str, Any] = Field(default_factory=dict)
    pruning: dict[str, Any] = Field(default_factory=dict)
    retrain: dict[str, Any] = Field(default_factory=dict)
    subnets: list[SubnetRecord] = Field(default_factory=list)
    evaluation: dict[str, Any] = Field(default_factory=dict)
    # Wall time per decomposition stage ({"retrain": {"seconds", "runs", "done"}, ...}); optional.
    stages: dict[str, Any] = Field(default_factory=dict)
    created: str = Field(default_factory=utc_now)

    @field_validator("groups")
    @classmethod
    def _groups_nonempty(cls, v):
        if not v or any(not g for g in v):
            raise ValueError("groups must be non-empty lists of class indices")
        return v

    @model_validator(mode="after")
    def _check(self):
        if len(self.dataset.classes) != self.num_classes:
            raise ValueError(f"{len(self.dataset.classes)} class names for {self.num_classes} "
                             "classes")
        flat = sorted(c for g in self.groups for c in g)
        if flat != list(range(self.num_classes)):
            raise ValueError("groups must cover every class exactly once")
        if self.subnets:
            if len(self.subnets) != len(self.groups):
                raise ValueError("one subnet per group is required")
            for i, (s, g) in enumerate(zip(self.subnets, self.groups)):
                if s.index != i or list(s.classes) != list(g):
                    raise ValueError(f"subnet {i} does not match group {i}")
        return self

    @property
    def binary(self) -> bool:
        return all(len(g) == 1 for g in self.groups)


def not_there(path: Path, what: str, *, folder: bool) -> CheckpointError:
    """The error for ``path`` that is not the folder (or file) it should be: missing, or the
    other kind."""
    if not path.exists():
        return CheckpointError(f"{what} {path} does not exist")
    return CheckpointError(f"{what} {path} is a {'file' if folder else 'directory'}, not a "
                           f"{'directory' if folder else 'file'}")


def _load(path: Path, cls, what: str, version: int, upgrade: str = ""):
    if not path.is_file():
        raise not_there(path, what, folder=False)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    found = raw.get("schema_version")
    if found != version:
        raise CheckpointError(f"{what} {path} has schema version {found!r}; this sensai reads "
                              f"version {version}{upgrade}")
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise CheckpointError(f"{what} {path} is malformed ({loc}: {first.get('msg')})") from None


def load_model_record(model_dir: str | Path) -> ModelRecord:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise not_there(model_dir, "model directory", folder=True)
    if (model_dir / MANIFEST).is_file() and not (model_dir / MODEL_RECORD).exists():
        raise CheckpointError(f"{model_dir} is an artifact ('sensai decompose'), not a trained "
                              "model directory ('sensai train' or 'sensai import')")
    return _load(model_dir / MODEL_RECORD, ModelRecord, "model record", MODEL_RECORD_VERSION)


def save_model_record(model_dir: str | Path, record: ModelRecord) -> None:
    write_json_atomic(Path(model_dir) / MODEL_RECORD, record.model_dump(mode="json"))


def refuse_model_dir(path: str | Path, wanted: str = "an artifact") -> None:
    """One line when ``path`` is a trained model directory where ``wanted`` is expected."""
    path = Path(path)
    if (path / MODEL_RECORD).is_file() and not (path / MANIFEST).exists():
        raise CheckpointError(f"{path} is a trained model directory ('sensai train' or 'sensai "
                              f"import'), not {wanted}; 'sensai decompose --model-dir {path} "
                              "--groups N --out ART' makes an artifact of it")


def load_manifest(artifact_dir: str | Path) -> DecompositionManifest:
    artifact_dir = Path(artifact_dir)
    if not artifact_dir.is_dir():
        raise not_there(artifact_dir, "artifact directory", folder=True)
    refuse_model_dir(artifact_dir)
    return _load(artifact_dir / MANIFEST, DecompositionManifest, "manifest", MANIFEST_VERSION,
                 " (re-run the same 'sensai decompose' command: it resumes and rewrites the "
                 "manifest)")


def save_manifest(artifact_dir: str | Path, manifest: DecompositionManifest) -> None:
    write_json_atomic(Path(artifact_dir) / MANIFEST, manifest.model_dump(mode="json"))

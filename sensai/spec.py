"""What a model was trained on and how its input is prepared - without importing torch, so
worker processes and Ray actors that only run ONNX subnets stay light."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import DataError


@dataclass(frozen=True)
class DatasetSpec:
    """What a model was trained on and how its input is prepared."""

    name: str
    classes: tuple[str, ...]
    input_shape: tuple[int, int, int]  # C, H, W
    mean: tuple[float, ...]
    std: tuple[float, ...]
    data_dir: str | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    @property
    def pil_mode(self) -> str:
        return "L" if self.in_channels == 1 else "RGB"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DatasetSpec":
        try:
            return cls(
                name=str(d["name"]),
                classes=tuple(str(c) for c in d["classes"]),
                input_shape=tuple(int(x) for x in d["input_shape"]),  # type: ignore[arg-type]
                mean=tuple(float(x) for x in d["mean"]),
                std=tuple(float(x) for x in d["std"]),
                data_dir=d.get("data_dir"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"malformed dataset spec: {e}") from None

    def with_data_dir(self, data_dir: str | None) -> "DatasetSpec":
        if data_dir is None:
            return self
        return DatasetSpec(self.name, self.classes, self.input_shape, self.mean, self.std,
                           str(Path(data_dir).resolve()))

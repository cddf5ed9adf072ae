"""What a model was trained on and how its input is prepared - without importing torch, so
the gateway, worker processes and Ray actors that only run ONNX subnets stay light.

:func:`pil_to_array` then :func:`normalize` is the one preprocessing path from a picture to
network input, for training, decomposition and serving alike; :mod:`sensai.data` builds the
datasets on it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError

if TYPE_CHECKING:
    import torch

DATASET_NAMES = ("fashion-mnist", "cifar10", "cifar100", "imagefolder")


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


def normalize(images: "torch.Tensor | np.ndarray", spec: DatasetSpec) -> "torch.Tensor | np.ndarray":
    """uint8 ``[B, C, H, W]`` (or ``[C, H, W]``) -> float32 network input, on the images' device.

    A numpy array gives a numpy array, by the same float32 operations (bit for bit the same
    values): the gateway normalizes one small image per request, where torch's per-call
    overhead costs more than the arithmetic, and need not import torch at all."""
    shape = (-1, 1, 1)
    if isinstance(images, np.ndarray):
        x = images.astype(np.float32) / np.float32(255.0)
        mean = np.asarray(spec.mean, dtype=np.float32).reshape(shape)
        std = np.asarray(spec.std, dtype=np.float32).reshape(shape)
        return (x - mean) / std
    import torch  # a tensor came in, so torch is loaded already

    x = images.to(torch.float32).div_(255.0)
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=x.device).view(shape)
    std = torch.tensor(spec.std, dtype=torch.float32, device=x.device).view(shape)
    return (x - mean) / std


def pil_to_array(img, spec: DatasetSpec) -> np.ndarray:
    """A PIL image of any size or mode -> uint8 ``[C, H, W]`` in the spec's mode and size
    (writable, contiguous)."""
    from PIL import Image

    if img.mode in ("RGBA", "LA", "P") and spec.pil_mode == "RGB":
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, img)
    if img.mode != spec.pil_mode:  # else convert() would only copy it
        img = img.convert(spec.pil_mode)
    _, h, w = spec.input_shape
    if img.size != (w, h):
        img = img.resize((w, h), Image.BILINEAR)
    arr = np.array(img, dtype=np.uint8)  # a writable copy: torch refuses read-only buffers
    if arr.ndim == 2:
        return arr[None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))

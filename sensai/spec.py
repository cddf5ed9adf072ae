"""What a model was trained on and how its input is prepared - without importing torch, so
the gateway, worker processes and Ray actors that only run ONNX subnets stay light.

:func:`pil_to_array` then :func:`normalize` is the one preprocessing path from a picture to
network input, for training, decomposition and serving alike (:func:`pil_to_input`: both in
one pass, for the gateway); :mod:`sensai.data` builds the datasets on it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError

if TYPE_CHECKING:
    import torch

DATASET_NAMES = ("fashion-mnist", "cifar10", "cifar100", "imagefolder")
# The image formats the gateway decodes, with their files' suffixes: an image folder holds these
# alone, so a model can be asked about the very images it was trained on.  Formats with a long
# history of parser bugs (TIFF, EPS...) are refused.
IMAGE_FORMATS = {"PNG": (".png",), "JPEG": (".jpg", ".jpeg"), "BMP": (".bmp",),
                 "GIF": (".gif",), "WEBP": (".webp",)}


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

    A numpy array gives a numpy array with bit for bit the same values, looked up in a table of
    the 256 levels per channel computed by the same float32 operations: the gateway normalizes
    one small image per request, where one pass over the pixels costs least, and need not
    import torch at all."""
    if isinstance(images, np.ndarray):
        out = np.empty(images.shape, np.float32)
        levels = channel_levels(spec.mean, spec.std)
        for c in range(levels.shape[0]):
            np.take(levels[c], images[..., c, :, :], out=out[..., c, :, :])
        return out
    import torch  # a tensor came in, so torch is loaded already

    shape = (-1, 1, 1)
    x = images.to(torch.float32).div_(255.0)
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=x.device).view(shape)
    std = torch.tensor(spec.std, dtype=torch.float32, device=x.device).view(shape)
    return (x - mean) / std


@functools.lru_cache(maxsize=32)
def channel_levels(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """float32 ``[C, 256]``: the network input of each uint8 level in each channel, by
    :func:`normalize`'s float32 operations (read-only: shared by every call)."""
    x = np.arange(256, dtype=np.float32) / np.float32(255.0)
    levels = ((x[None, :] - np.asarray(mean, np.float32)[:, None])
              / np.asarray(std, np.float32)[:, None])
    levels.flags.writeable = False
    return levels


def pil_to_input(img, spec: DatasetSpec) -> np.ndarray:
    """A PIL image of any size or mode -> float32 ``[1, C, H, W]`` network input
    (:func:`pil_to_array` then :func:`normalize`, the pixels read once)."""
    arr = np.asarray(pil_in_shape(img, spec))
    levels = channel_levels(spec.mean, spec.std)
    out = np.empty((1, *spec.input_shape), np.float32)
    if arr.ndim == 2:
        np.take(levels[0], arr, out=out[0, 0])
    else:
        for c in range(levels.shape[0]):
            np.take(levels[c], arr[:, :, c], out=out[0, c])
    return out


def pil_to_array(img, spec: DatasetSpec) -> np.ndarray:
    """A PIL image of any size or mode -> uint8 ``[C, H, W]`` in the spec's mode and size
    (writable, contiguous)."""
    arr = np.array(pil_in_shape(img, spec), dtype=np.uint8)  # writable: torch refuses read-only
    if arr.ndim == 2:
        return arr[None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def upright_8bit(img):
    """The picture as a model sees it: turned upright by its EXIF orientation (photos from
    phones carry a rotation flag), and 16-bit, 32-bit and float greyscale scaled to 8 bits
    (PIL's convert would clip them at 255); integer or float32 arithmetic only, so a large
    picture costs little extra memory."""
    from PIL import Image, ImageOps

    try:
        img = ImageOps.exif_transpose(img)
    except Exception:  # a malformed EXIF block is no reason to refuse the picture
        pass
    if img.mode.startswith("I;16"):
        arr = np.asarray(img, dtype=np.uint32)
        return Image.fromarray(((arr + 128) // 257).astype(np.uint8), "L")
    if img.mode == "I":
        arr = np.asarray(img, dtype=np.float32)
        scale = np.float32(257.0 if arr.max(initial=0) > 255 else 1.0)
        return Image.fromarray(np.clip(np.rint(arr / scale), 0, 255).astype(np.uint8), "L")
    if img.mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        if arr.size and np.nanmax(arr) <= 1.0:
            arr = arr * np.float32(255.0)
        return Image.fromarray(np.clip(np.nan_to_num(np.rint(arr)), 0, 255).astype(np.uint8), "L")
    return img


def pil_in_shape(img, spec: DatasetSpec):
    """A PIL image of any size or mode -> the PIL image in the spec's mode and size
    (:func:`upright_8bit` first; alpha composed over white for RGB)."""
    from PIL import Image

    img = upright_8bit(img)
    if img.mode in ("RGBA", "LA", "P") and spec.pil_mode == "RGB":
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, img)
    if img.mode != spec.pil_mode:  # else convert() would only copy it
        img = img.convert(spec.pil_mode)
    _, h, w = spec.input_shape
    if img.size != (w, h):
        img = img.resize((w, h), Image.BILINEAR)
    return img

"""Untrusted image bytes -> the normalized tensor the subnets were trained on, or a clear 4xx.

The size is checked from the header *before* any pixel is decoded, so a small file that would
expand to gigabytes (a decompression bomb) costs nothing.  The conversion itself is the
project's one preprocessing path (:func:`sensai.spec.pil_to_input`: ``pil_to_array`` then
``normalize`` in one pass over the pixels), exactly as in training and offline evaluation.
"""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, PngImagePlugin, UnidentifiedImageError

from sensai.spec import IMAGE_FORMATS, pil_to_input

from ..core.errors import InputError, PayloadTooLarge

if TYPE_CHECKING:
    from sensai.spec import DatasetSpec

FORMATS = tuple(IMAGE_FORMATS)
# PNG text chunks are decompressed when the header is read; a thumbnail can carry thousands of
# them.  Nothing here needs their text, so a few KiB each bound that work.
PngImagePlugin.MAX_TEXT_CHUNK = 64 * 1024
PngImagePlugin.MAX_TEXT_MEMORY = 256 * 1024
# Bytes per pixel of each mode as PIL holds it decoded (RGB is stored in 4): none takes more than
# 4, so the pixel limit bounds what a picture costs decoded at 4 bytes a pixel.
MODE_BYTES = {"1": 1, "L": 1, "P": 1, "LA": 4, "PA": 4, "RGB": 4, "RGBA": 4, "RGBX": 4,
              "CMYK": 4, "YCbCr": 4, "LAB": 4, "HSV": 4, "I;16": 2, "I;16B": 2, "I;16L": 2,
              "I;16N": 2, "I": 4, "F": 4}


def open_image(data: bytes, max_pixels: int):
    """Parse the header of untrusted image bytes (no pixel is decoded yet) and check its size.

    Returns the opened PIL image for :func:`image_to_input`.  Raises :class:`InputError`
    (400/415) for empty, unknown or unreadable data and :class:`PayloadTooLarge` (413) when the
    picture has more than ``max_pixels`` pixels (so it takes at most 4 bytes each decoded).
    """
    if not data:
        raise InputError("empty image: send PNG or JPEG bytes as the multipart field 'image' or "
                         "as the request body")
    with warnings.catch_warnings():
        # PIL warns (and past 2x its global limit raises) on huge images; we apply our own
        # limit below from the header, so its warning is noise.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError as e:
            raise PayloadTooLarge(f"image has too many pixels ({e})") from None
        except UnidentifiedImageError:
            raise InputError(f"not a supported image (expected one of {', '.join(FORMATS)}; "
                             f"got {len(data)} bytes starting {data[:8]!r})", status=415) from None
        except (OSError, SyntaxError, ValueError) as e:
            raise InputError(f"unreadable image: {e}") from None
    w, h = img.size
    if w < 1 or h < 1:
        img.close()
        raise InputError(f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        img.close()
        raise PayloadTooLarge(f"image is {w}x{h} = {w * h:,} pixels; the limit is "
                              f"{max_pixels:,} (set SENSAI_MAX_IMAGE_PIXELS)")
    return img


def image_to_input(img, spec: "DatasetSpec") -> np.ndarray:
    """Decode an image from :func:`open_image` (and close it) -> float32 ``[1, C, H, W]`` per
    ``spec``; :class:`InputError` (400) when its pixel data is truncated or corrupt."""
    with warnings.catch_warnings(), img:
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img.load()
            return pil_to_input(img, spec)  # turned upright and to 8 bits there, as in training
        except Image.DecompressionBombError as e:
            raise PayloadTooLarge(f"image has too many pixels ({e})") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise InputError(f"image data is truncated or corrupt: {e}") from None


def decode_image(data: bytes, spec: "DatasetSpec", max_pixels: int) -> np.ndarray:
    """PNG/JPEG/... bytes of any size and colour mode -> float32 ``[1, C, H, W]`` per ``spec``
    (:func:`open_image` then :func:`image_to_input`, with their errors)."""
    return image_to_input(open_image(data, max_pixels), spec)

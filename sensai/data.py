"""Datasets, on the one preprocessing definition (:mod:`sensai.spec`) that training, decomposition
and serving share.

A :class:`DatasetSpec` (name, class labels, input shape, mean/std, where the files are) is recorded
with every model and every decomposition artifact, so the gateway turns an uploaded picture into
exactly the tensor the network was trained on.

Images are kept as ``uint8`` tensors ``[C, H, W]`` until the last moment; :func:`normalize`
(defined in :mod:`sensai.spec`, torch-free, and offered here beside the datasets it applies to) is
the only place that turns them into network input.  Nothing here downloads anything.
"""

from __future__ import annotations

import gzip
import io
import logging
import pickle
import struct
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .errors import DataError
from .spec import DATASET_NAMES, IMAGE_FORMATS, DatasetSpec, normalize, pil_to_array

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
FASHION_MNIST_HINT = (
    "install it with 'apt-get install dataset-fashion-mnist' (Debian/Ubuntu) or pass --data-dir "
    "pointing at the four *-idx*-ubyte(.gz) files"
)
# An image folder's files: those the gateway decodes; other image files are refused.
IMAGE_SUFFIXES = {s for suffixes in IMAGE_FORMATS.values() for s in suffixes}
UNSERVED_SUFFIXES = {".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"}
IMAGE_KINDS = ", ".join(list(IMAGE_FORMATS)[:-1]) + " or " + list(IMAGE_FORMATS)[-1]
# An image folder's side when --image-size is not given: the training images' median, at most
# this (a folder of photos would otherwise make every input megapixels).
MAX_DEFAULT_SIDE = 224


def pil_to_uint8(img, spec: DatasetSpec) -> torch.Tensor:
    """A PIL image of any size or mode -> uint8 ``[C, H, W]`` in the spec's mode and size."""
    return torch.from_numpy(pil_to_array(img, spec))


# --------------------------------------------------------------------------------------------
# Datasets


class ImageDataset(torch.utils.data.Dataset):
    """Items are ``(uint8 [C,H,W], int label)``; ``labels`` is available without loading images."""

    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


class TensorImages(ImageDataset):
    """A split held in memory as one uint8 tensor (Fashion-MNIST, CIFAR)."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray):
        if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise DataError("in-memory images must be uint8 [N, C, H, W] with one label each")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


class FolderImages(ImageDataset):
    """``root/<class>/<image>`` files, decoded on access into the spec's mode and size."""

    def __init__(self, files: Sequence[Path], labels: Sequence[int], spec: DatasetSpec):
        self.files = list(files)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.spec = spec

    def __getitem__(self, i: int):
        return read_image(self.files[i], self.spec), int(self.labels[i])


def read_image(path: Path, spec: DatasetSpec) -> torch.Tensor:
    """An image file -> uint8 ``[C, H, W]`` per ``spec``; one line naming the file when it
    cannot be read (a folder's files are checked as they are read, not all up front)."""
    from PIL import Image, UnidentifiedImageError

    try:
        # The formats the gateway decodes: an image trained on is one the model can be asked.
        with Image.open(path, formats=tuple(IMAGE_FORMATS)) as img:
            return pil_to_uint8(img, spec)
    except UnidentifiedImageError as e:
        raise DataError(f"cannot read image {path}: {e} (sensai reads "
                        f"{', '.join(IMAGE_FORMATS)}, as the gateway does)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise DataError(f"cannot read image {path}: {e}") from None


def iterate_batches(
    dataset: ImageDataset,
    batch_size: int,
    *,
    indices: np.ndarray | None = None,
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(uint8 images [B,C,H,W], int64 labels [B])`` over ``indices`` (default: all)."""
    idx = np.arange(len(dataset)) if indices is None else np.asarray(indices, dtype=np.int64)
    if shuffle:
        idx = np.random.default_rng(seed).permutation(idx)
    if isinstance(dataset, TensorImages):
        # Fancy indexing on one tensor: a DataLoader pays per item, and the items are tiny.
        for s in range(0, len(idx), batch_size):
            b = torch.from_numpy(idx[s:s + batch_size])
            yield dataset.images[b], torch.from_numpy(dataset.labels[idx[s:s + batch_size]])
        return
    subset = torch.utils.data.Subset(dataset, idx.tolist())
    loader = torch.utils.data.DataLoader(subset, batch_size=batch_size, shuffle=False,
                                         num_workers=num_workers)
    for x, y in loader:
        yield x, y.to(torch.int64)


def stratified_subset(labels: np.ndarray, limit: int | None, seed: int = 0) -> np.ndarray:
    """Indices of about ``limit`` samples keeping the class proportions, at least one of each
    class, so never fewer than there are classes (all when None)."""
    labels = np.asarray(labels)
    if limit is None or limit >= len(labels):
        return np.arange(len(labels))
    if limit < 1:
        raise DataError(f"a sample limit must be at least 1, got {limit}")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quota = np.maximum(1, np.floor(counts / counts.sum() * limit).astype(int))
    out = [rng.choice(np.flatnonzero(labels == c), size=min(q, n), replace=False)
           for c, q, n in zip(classes, quota, counts)]
    return np.sort(np.concatenate(out))


# --------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX)


def _idx_file(data_dir: Path, stem: str) -> Path:
    for cand in (data_dir / f"{stem}.gz", data_dir / stem):
        if cand.is_file():
            return cand
    raise DataError(f"Fashion-MNIST file {stem}(.gz) not found in {data_dir}: {FASHION_MNIST_HINT}")


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (optionally gzipped); malformed files raise :class:`DataError`."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            raw = f.read()
        if len(raw) < 4:
            raise ValueError("file too short")
        zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError("not an unsigned-byte IDX file")
        dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
        offset = 4 + 4 * ndim
        expected = int(np.prod(dims))
        if len(raw) - offset != expected:
            raise ValueError(f"expected {expected} bytes of data, found {len(raw) - offset}")
        return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)
    except (OSError, EOFError, ValueError, struct.error, gzip.BadGzipFile) as e:
        raise DataError(f"malformed IDX file {path}: {e}; {FASHION_MNIST_HINT}") from None


def _fashion_mnist_spec(data_dir: str | None) -> DatasetSpec:
    root = Path(data_dir or FASHION_MNIST_DIR)
    if not root.is_dir():
        raise DataError(f"Fashion-MNIST directory {root} does not exist: {FASHION_MNIST_HINT}")
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        _idx_file(root, stem)
    return DatasetSpec("fashion-mnist", FASHION_MNIST_CLASSES, (1, 28, 28), (0.2860,), (0.3530,),
                       str(root.resolve()))


def _load_fashion_mnist(spec: DatasetSpec, split: str) -> TensorImages:
    root = Path(spec.data_dir or FASHION_MNIST_DIR)
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(_idx_file(root, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_idx_file(root, f"{prefix}-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"Fashion-MNIST {split} files in {root} do not match each other")
    if labels.max(initial=0) >= 10:
        raise DataError(f"Fashion-MNIST {split} labels in {root} are out of range")
    return TensorImages(torch.from_numpy(images.copy()).unsqueeze(1), labels.astype(np.int64))


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (the python pickles torchvision uses, or the binary version)

CIFAR_HINT = ("download the dataset yourself (https://www.cs.toronto.edu/~kriz/cifar.html) and "
              "pass --data-dir pointing at the directory that contains it")


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles; only plain containers and numpy arrays may come out."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _load_array_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _ArrayOnlyUnpickler(f, encoding="latin1").load()
    except Exception as e:  # a corrupt pickle can raise nearly anything
        raise DataError(f"malformed CIFAR batch {path}: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(f"malformed CIFAR batch {path}: not a dictionary")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _cifar_layout(name: str, root: Path) -> tuple[str, Path]:
    py, binary = (("cifar-10-batches-py", "cifar-10-batches-bin") if name == "cifar10"
                  else ("cifar-100-python", "cifar-100-binary"))
    for layout, sub in (("py", py), ("bin", binary)):
        for cand in (root / sub, root):
            marker = {"py": ("data_batch_1" if name == "cifar10" else "train"),
                      "bin": ("data_batch_1.bin" if name == "cifar10" else "train.bin")}[layout]
            if (cand / marker).is_file():
                return layout, cand
    raise DataError(f"{name} not found under {root} (looked for {py}/ or {binary}/): {CIFAR_HINT}")


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")


def _cifar_spec(name: str, data_dir: str | None) -> DatasetSpec:
    if not data_dir:
        raise DataError(f"{name} needs --data-dir (nothing is downloaded): {CIFAR_HINT}")
    root = Path(data_dir)
    layout, where = _cifar_layout(name, root)
    if name == "cifar10":
        classes = CIFAR10_CLASSES
        mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    else:
        classes = tuple(f"class_{i}" for i in range(100))
        meta = where / "meta"
        if layout == "py" and meta.is_file():
            names = _load_array_pickle(meta).get("fine_label_names")
            if names and len(names) == 100:
                classes = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
        elif (where / "fine_label_names.txt").is_file():
            names = (where / "fine_label_names.txt").read_text().split()
            if len(names) == 100:
                classes = tuple(names)
        mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    return DatasetSpec(name, classes, (3, 32, 32), mean, std, str(root.resolve()))


def _load_cifar(spec: DatasetSpec, split: str) -> TensorImages:
    layout, where = _cifar_layout(spec.name, Path(spec.data_dir or "."))
    train = split == "train"
    if layout == "py":
        if spec.name == "cifar10":
            files = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
            key = "labels"
        else:
            files, key = (["train"] if train else ["test"]), "fine_labels"
        xs, ys = [], []
        for fname in files:
            if not (where / fname).is_file():
                raise DataError(f"{spec.name} file {where / fname} is missing: {CIFAR_HINT}")
            d = _load_array_pickle(where / fname)
            try:
                if np.asarray(d["data"]).dtype != np.uint8:  # a cast would wrap 300.7 to 44
                    raise ValueError(f"pixels must be uint8, not {np.asarray(d['data']).dtype}")
                xs.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys.append(np.asarray(d[key], dtype=np.int64))
            except (KeyError, ValueError) as e:
                raise DataError(f"malformed CIFAR batch {where / fname}: {e}") from None
    else:
        if spec.name == "cifar10":
            files = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
            head = 1
        else:
            files, head = (["train.bin"] if train else ["test.bin"]), 2
        xs, ys = [], []
        for fname in files:
            path = where / fname
            if not path.is_file():
                raise DataError(f"{spec.name} file {path} is missing: {CIFAR_HINT}")
            raw = np.fromfile(path, dtype=np.uint8)
            rec = head + 3072
            if raw.size % rec:
                raise DataError(f"malformed CIFAR binary file {path}: size is not a multiple of {rec}")
            raw = raw.reshape(-1, rec)
            ys.append(raw[:, head - 1].astype(np.int64))
            xs.append(raw[:, head:].reshape(-1, 3, 32, 32))
    x, y = np.concatenate(xs), np.concatenate(ys)
    if len(x) != len(y) or y.max(initial=0) >= spec.num_classes or y.min(initial=0) < 0:
        raise DataError(f"{spec.name} {split} data in {where} has inconsistent labels")
    return TensorImages(torch.from_numpy(np.ascontiguousarray(x)), y)


# --------------------------------------------------------------------------------------------
# ImageFolder: root/{train,test|val}/<class>/<image>


def _folder_files(split_dir: Path, classes: Sequence[str]) -> tuple[list[Path], list[int]]:
    files, labels = [], []
    for i, c in enumerate(classes):
        d = split_dir / c
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            suffix = p.suffix.lower()
            if suffix in UNSERVED_SUFFIXES:
                raise DataError(f"{p}: the gateway decodes {IMAGE_KINDS} images only, so a "
                                f"model trained on {suffix} files could not be asked about "
                                "them; convert them (to PNG, say)")
            if suffix in IMAGE_SUFFIXES and p.is_file():
                files.append(p)
                labels.append(i)
    return files, labels


def _imagefolder_split_dir(root: Path, split: str) -> Path:
    names = ("train",) if split == "train" else ("test", "val")
    for n in names:
        if (root / n).is_dir():
            return root / n
    raise DataError(f"image folder {root} has no {' or '.join(names)}/ directory "
                    "(expected root/train/<class>/*.png and root/test/<class>/*.png)")


def _imagefolder_spec(data_dir: str | None, image_size: int | None) -> DatasetSpec:
    from PIL import Image, UnidentifiedImageError

    if not data_dir:
        raise DataError("imagefolder needs --data-dir pointing at a directory with train/ and test/")
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist")
    train_dir = _imagefolder_split_dir(root, "train")
    _imagefolder_split_dir(root, "test")
    # Hidden folders (.ipynb_checkpoints and the like) are tools' litter, not classes.
    classes = tuple(sorted(p.name for p in train_dir.iterdir()
                           if p.is_dir() and not p.name.startswith(".")))
    if len(classes) < 2:
        raise DataError(f"image folder {train_dir} needs at least two class directories")
    files, labels = _folder_files(train_dir, classes)
    if not files:
        raise DataError(f"image folder {train_dir} holds no images")
    empty = sorted(set(range(len(classes))) - set(labels))
    if empty:
        raise DataError(f"class folder {train_dir / classes[empty[0]]} holds no {IMAGE_KINDS} "
                        "images: every class needs training images (remove the folder)")
    # Mode, size and normalisation statistics from a fixed sample of the training images: colour
    # when any is (grey converts to colour without loss, not the other way), their median side.
    sample = np.random.default_rng(0).choice(len(files), size=min(500, len(files)),
                                             replace=False)
    modes, sides = set(), []
    for i in sample:
        try:
            with Image.open(files[i]) as img:
                modes.add(img.mode)
                sides.append(max(img.size))
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
            raise DataError(f"cannot read image {files[i]}: {e}") from None
    channels = 1 if modes <= {"L", "1", "I", "I;16", "I;16B", "I;16L", "F"} else 3
    size = image_size or min(MAX_DEFAULT_SIDE, int(np.median(sides)))
    probe = DatasetSpec("imagefolder", classes, (channels, size, size), (0.0,) * channels,
                        (1.0,) * channels)
    acc = [read_image(files[i], probe).reshape(channels, -1).float() / 255.0 for i in sample]
    pix = torch.cat(acc, dim=1)
    mean = tuple(round(float(v), 4) for v in pix.mean(dim=1))
    std = tuple(round(max(float(v), 1e-3), 4) for v in pix.std(dim=1))
    return DatasetSpec("imagefolder", classes, (channels, size, size), mean, std,
                       str(root.resolve()))


def _load_imagefolder(spec: DatasetSpec, split: str) -> FolderImages:
    root = Path(spec.data_dir or ".")
    split_dir = _imagefolder_split_dir(root, split)
    files, labels = _folder_files(split_dir, spec.classes)
    if not files:
        raise DataError(f"image folder {split_dir} holds no images of the known classes")
    return FolderImages(files, labels, spec)


# --------------------------------------------------------------------------------------------
# Entry points


def resolve_dataset(name: str, data_dir: str | None = None, image_size: int | None = None) -> DatasetSpec:
    """Check that the dataset is there and describe it; cheap (never loads a whole split)."""
    if name == "fashion-mnist":
        return _fashion_mnist_spec(data_dir)
    if name in ("cifar10", "cifar100"):
        return _cifar_spec(name, data_dir)
    if name == "imagefolder":
        return _imagefolder_spec(data_dir, image_size)
    raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")


_CACHE: dict[tuple, ImageDataset] = {}


def load_split(spec: DatasetSpec, split: str) -> ImageDataset:
    """The ``train`` or ``test`` split of ``spec`` (in-memory splits are cached per process)."""
    if split not in ("train", "test"):
        raise DataError(f"split must be 'train' or 'test', got {split!r}")
    key = (spec.name, spec.data_dir, split, spec.input_shape)
    if key in _CACHE:
        return _CACHE[key]
    if spec.name == "fashion-mnist":
        ds: ImageDataset = _load_fashion_mnist(spec, split)
    elif spec.name in ("cifar10", "cifar100"):
        ds = _load_cifar(spec, split)
    elif spec.name == "imagefolder":
        ds = _load_imagefolder(spec, split)
    else:
        raise DataError(f"unknown dataset {spec.name!r}; choose one of: {', '.join(DATASET_NAMES)}")
    if isinstance(ds, TensorImages):
        if tuple(ds.images.shape[1:]) != tuple(spec.input_shape):
            raise DataError(f"{spec.name} images are {tuple(ds.images.shape[1:])}, the spec says "
                            f"{spec.input_shape}")
        _CACHE[key] = ds
    log.info("loaded %s/%s: %d images", spec.name, split, len(ds))
    return ds


def encode_png(image_u8: torch.Tensor) -> bytes:
    """uint8 ``[C,H,W]`` -> PNG bytes (used to send dataset images over HTTP)."""
    from PIL import Image

    arr = image_u8.cpu().numpy()
    img = Image.fromarray(arr[0], "L") if arr.shape[0] == 1 else Image.fromarray(arr.transpose(1, 2, 0), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()

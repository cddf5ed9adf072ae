import gzip
import shutil
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from sensai.data import (DatasetSpec, encode_png, iterate_batches, load_split, normalize,
                         pil_to_uint8, resolve_dataset, stratified_subset)
from sensai.errors import DataError
from sensai.spec import pil_to_array, pil_to_input


def test_fashion_mnist_real_files(fmnist_spec, fmnist_train, fmnist_test):
    assert fmnist_spec.num_classes == 10 and fmnist_spec.input_shape == (1, 28, 28)
    assert fmnist_spec.classes[9] == "Ankle boot"
    assert len(fmnist_train) == 60000 and len(fmnist_test) == 10000
    assert np.bincount(fmnist_train.labels).tolist() == [6000] * 10
    x, y = fmnist_test[0]
    assert x.dtype == torch.uint8 and x.shape == (1, 28, 28) and y == 9  # first test image: a boot
    # Normalised with the recorded statistics, the training set is ~zero-mean, unit-std.
    xb = normalize(fmnist_train.images[:5000], fmnist_spec)
    assert abs(float(xb.mean())) < 0.05 and abs(float(xb.std()) - 1) < 0.05


def test_iterate_batches_and_subset(fmnist_test):
    idx = stratified_subset(fmnist_test.labels, 1000, seed=1)
    assert len(idx) == 1000 and np.bincount(fmnist_test.labels[idx]).tolist() == [100] * 10
    seen = []
    for x, y in iterate_batches(fmnist_test, 256, indices=idx, shuffle=True, seed=3):
        assert x.dtype == torch.uint8 and x.shape[1:] == (1, 28, 28)
        seen.append(y)
    assert sorted(torch.cat(seen).tolist()) == sorted(fmnist_test.labels[idx].tolist())


def test_png_round_trip_is_exact(fmnist_spec, fmnist_test):
    from io import BytesIO

    from PIL import Image

    x, _ = fmnist_test[5]
    with Image.open(BytesIO(encode_png(x))) as img:
        assert torch.equal(pil_to_uint8(img, fmnist_spec), x)
    # Any size and colour mode is converted to the spec's.
    big = Image.new("RGBA", (100, 60), (200, 10, 10, 255))
    assert pil_to_uint8(big, fmnist_spec).shape == (1, 28, 28)


def test_missing_dataset_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        resolve_dataset("fashion-mnist", str(tmp_path / "nope"))
    (tmp_path / "fm").mkdir()
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        resolve_dataset("fashion-mnist", str(tmp_path / "fm"))
    with pytest.raises(DataError, match="--data-dir"):
        resolve_dataset("cifar10", None)
    with pytest.raises(DataError, match="unknown dataset"):
        resolve_dataset("mnist2")


def test_malformed_idx_file_is_a_clear_error(tmp_path):
    from tests.conftest import FMNIST_DIR

    d = tmp_path / "fm"
    shutil.copytree(FMNIST_DIR, d)
    with gzip.open(d / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, 3) + struct.pack(">3I", 10000, 28, 28) + b"\0" * 100)
    spec = resolve_dataset("fashion-mnist", str(d))
    with pytest.raises(DataError, match="malformed IDX"):
        load_split(spec, "test")
    (d / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="malformed IDX"):
        load_split(spec.with_data_dir(str(d)), "test")


def test_cifar10_binary_and_python_layouts(tmp_path):
    rng = np.random.default_rng(0)
    # Binary layout: <label byte><3072 pixel bytes> records.
    b = tmp_path / "bin" / "cifar-10-batches-bin"
    b.mkdir(parents=True)
    for name, n in [(f"data_batch_{i}.bin", 20) for i in range(1, 6)] + [("test_batch.bin", 30)]:
        recs = np.zeros((n, 3073), np.uint8)
        recs[:, 0] = np.arange(n) % 10
        recs[:, 1:] = rng.integers(0, 255, (n, 3072))
        recs.tofile(b / name)
    spec = resolve_dataset("cifar10", str(tmp_path / "bin"))
    assert spec.input_shape == (3, 32, 32) and spec.classes[0] == "airplane"
    train, test = load_split(spec, "train"), load_split(spec, "test")
    assert len(train) == 100 and len(test) == 30 and test.labels[:3].tolist() == [0, 1, 2]
    # Python layout (torchvision's): pickled dicts; only arrays may come out of them.
    import pickle

    p = tmp_path / "py" / "cifar-10-batches-py"
    p.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(p / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 255, (4, 3072), dtype=np.uint8),
                         b"labels": [1, 2, 3, 4]}, f)
    spec = resolve_dataset("cifar10", str(tmp_path / "py"))
    assert len(load_split(spec, "train")) == 20

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(p / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": [1]}, f)
    with pytest.raises(DataError, match="refusing to load"):
        load_split(spec, "test")


def test_imagefolder(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for ci, c in enumerate(["cats", "dogs", "fish"]):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 30), (ci * 80, i * 40, 100)).save(d / f"{i}.png")
    (tmp_path / "train" / "cats" / "notes.txt").write_text("not an image")
    spec = resolve_dataset("imagefolder", str(tmp_path), image_size=24)
    assert spec.classes == ("cats", "dogs", "fish") and spec.input_shape == (3, 24, 24)
    test = load_split(spec, "test")  # falls back to val/
    x, y = test[4]
    assert x.shape == (3, 24, 24) and y == 1
    batches = list(iterate_batches(test, 4))
    assert sum(len(b[1]) for b in batches) == 9
    with pytest.raises(DataError, match="no train"):
        resolve_dataset("imagefolder", str(tmp_path / "train"))


def test_spec_round_trip():
    spec = DatasetSpec("x", ("a", "b"), (1, 8, 8), (0.5,), (0.25,), "/d")
    assert DatasetSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(DataError):
        DatasetSpec.from_dict({"name": "x"})


@pytest.mark.parametrize("channels", [1, 3])
def test_one_pass_normalisation_gives_the_arithmetics_values_bit_for_bit(channels):
    """The gateway's table of levels (and its one pass from a picture) against the float32
    arithmetic that training and offline evaluation use: identical bits, for every level."""
    mean, std = (0.4914, 0.4822, 0.4465)[:channels], (0.247, 0.243, 0.261)[:channels]
    spec = DatasetSpec("x", tuple("abcdefghij"), (channels, 16, 16), mean, std)
    u8 = np.arange(4 * channels * 16 * 16, dtype=np.int64).reshape(4, channels, 16, 16) % 256
    u8 = u8.astype(np.uint8)
    arithmetic = ((u8.astype(np.float32) / np.float32(255.0)
                   - np.asarray(mean, np.float32).reshape(-1, 1, 1))
                  / np.asarray(std, np.float32).reshape(-1, 1, 1))
    assert np.array_equal(normalize(u8, spec), arithmetic)
    assert np.array_equal(normalize(torch.from_numpy(u8), spec).numpy(), arithmetic)
    picture = Image.fromarray(u8[1, 0] if channels == 1 else u8[1].transpose(1, 2, 0))
    one_pass = pil_to_input(picture, spec)
    assert one_pass.shape == (1, channels, 16, 16) and one_pass.dtype == np.float32
    assert np.array_equal(one_pass, arithmetic[1:2])
    assert np.array_equal(one_pass, normalize(pil_to_array(picture, spec)[None], spec))

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


def folder(root, split: str, images: dict[str, list]) -> None:
    """``root/split/<class>/<i>.png`` of the PIL images given per class."""
    for c, imgs in images.items():
        d = root / split / c
        d.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(imgs):
            img.save(d / f"{i}.png")


def test_imagefolder_takes_colour_and_size_from_every_sampled_image(tmp_path):
    grey = [Image.new("L", (40, 40), 50 * i) for i in range(4)]
    folder(tmp_path, "train", {"a": grey, "b": grey[:3] + [Image.new("RGB", (40, 40), "red")]})
    folder(tmp_path, "test", {"a": grey[:1], "b": grey[:1]})
    # One colour image among grey ones: colour (grey converts to it without loss).
    assert resolve_dataset("imagefolder", str(tmp_path)).input_shape == (3, 40, 40)
    # The median side, not one image's, and never more than 224 unless asked.
    big = tmp_path / "big"
    folder(big, "train", {"a": [Image.new("L", (400, 300))] * 3, "b": [Image.new("L", (900, 9))]})
    folder(big, "test", {"a": grey[:1], "b": grey[:1]})
    assert resolve_dataset("imagefolder", str(big)).input_shape == (1, 224, 224)
    assert resolve_dataset("imagefolder", str(big), image_size=300).input_shape == (1, 300, 300)


def test_imagefolder_refuses_what_could_not_be_trained_or_served(tmp_path):
    grey = [Image.new("L", (20, 20), 60 * i) for i in range(3)]
    folder(tmp_path, "train", {"a": grey, "b": grey})
    folder(tmp_path, "test", {"a": grey, "b": grey})
    (tmp_path / "train" / "empty").mkdir()
    with pytest.raises(DataError, match=r"class folder .*empty holds no PNG, JPEG"):
        resolve_dataset("imagefolder", str(tmp_path))
    (tmp_path / "train" / "empty").rmdir()
    (tmp_path / "train" / ".ipynb_checkpoints").mkdir()  # hidden: no class
    assert resolve_dataset("imagefolder", str(tmp_path)).classes == ("a", "b")
    grey[0].save(tmp_path / "train" / "b" / "scan.TIF")
    with pytest.raises(DataError, match=r"scan.TIF: the gateway decodes PNG.* convert them"):
        resolve_dataset("imagefolder", str(tmp_path))
    (tmp_path / "train" / "b" / "scan.TIF").unlink()
    # A corrupt test image is named when it is read, in one line.
    (tmp_path / "test" / "b" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    spec = resolve_dataset("imagefolder", str(tmp_path))
    with pytest.raises(DataError, match=r"cannot read image .*test/b/9\.png"):
        list(iterate_batches(load_split(spec, "test"), 4))
    # A TIFF named .png is refused as the gateway refuses it, not trained on.
    grey[0].save(tmp_path / "test" / "b" / "9.png", format="TIFF")
    with pytest.raises(DataError, match=r"9\.png.*sensai reads PNG, JPEG.*as the gateway does"):
        list(iterate_batches(load_split(spec, "test"), 4))


def test_a_folder_image_is_prepared_for_training_as_the_gateway_prepares_it(tmp_path):
    """EXIF orientation and 16-bit depth, read by training and by the gateway alike."""
    from sensai.data import read_image
    from sensai.serving.gateway.imaging import decode_image

    rng = np.random.default_rng(0)
    deep = Image.fromarray(rng.integers(0, 65535, (12, 16), dtype=np.uint16))  # I;16
    deep.save(tmp_path / "deep.png")
    photo = Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8), "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    photo.save(tmp_path / "photo.jpg", exif=exif.tobytes(), quality=95)
    for name, channels in (("deep.png", 1), ("photo.jpg", 3)):
        spec = DatasetSpec("imagefolder", ("a", "b"), (channels, 16, 12), (0.5,) * channels,
                           (0.25,) * channels)
        path = tmp_path / name
        trained = normalize(read_image(path, spec)[None], spec).numpy()
        served = decode_image(path.read_bytes(), spec, 10_000)
        np.testing.assert_allclose(trained, served, atol=1e-6)
    # Not clipped: 16-bit levels are scaled to 8 bits, so the picture keeps its contrast.
    x = read_image(tmp_path / "deep.png", spec=DatasetSpec("imagefolder", ("a", "b"), (1, 12, 16),
                                                           (0.0,), (1.0,)))
    assert 0 < int(x.float().mean()) < 250 and len(torch.unique(x)) > 100


def test_cifar_batches_with_negative_labels_or_non_byte_pixels_are_refused(tmp_path):
    import pickle

    p = tmp_path / "cifar-10-batches-py"
    p.mkdir()
    data = np.zeros((2, 3072), np.uint8)
    for labels, pixels, fragment in (([1, -1], data, "inconsistent labels"),
                                     ([1, 2], data.astype(np.float64) + 0.5, "must be uint8")):
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            with open(p / name, "wb") as f:
                pickle.dump({b"data": pixels, b"labels": labels}, f)
        spec = resolve_dataset("cifar10", str(tmp_path))
        with pytest.raises(DataError, match=fragment):
            load_split(spec, "train")


@pytest.mark.parametrize("argv, fragment", [
    (["--image-size", "32"], "--image-size is for --dataset imagefolder"),
    (["--dataset", "imagefolder", "--image-size", "0"], "--image-size must be from 8 to 2048"),
])
def test_image_size_is_checked_in_one_line(tmp_path, capsys, argv, fragment):
    from sensai.cli import main

    assert main(["train", "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err

"""Shared fixtures: the real Fashion-MNIST files and a small model really trained on them.

Owned by the whole suite; feature-specific fixtures live in their own test modules.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Every Ray instance of the tests is on 127.0.0.1; keep Ray from swapping that for the machine's
# network address when connecting (what sensai.raycluster.connect does for loopback addresses).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

FMNIST_DIR = Path(os.environ.get("SENSAI_FMNIST_DIR", "/usr/share/datasets/fashion-mnist"))


@pytest.fixture(autouse=True)
def unfrozen_heap():
    """A gateway freezes the heap of the process it runs in (sensai.serving.gateway.heap); the tests
    run many gateways in one process, so each test gives what it froze back to the collector."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def fmnist_spec():
    from sensai.data import resolve_dataset

    if not FMNIST_DIR.is_dir():
        pytest.fail(f"Fashion-MNIST is not installed at {FMNIST_DIR}: run deploy/setup.sh "
                    "(apt-get install dataset-fashion-mnist)")
    return resolve_dataset("fashion-mnist", str(FMNIST_DIR))


@pytest.fixture(scope="session")
def fmnist_train(fmnist_spec):
    from sensai.data import load_split

    return load_split(fmnist_spec, "train")


@pytest.fixture(scope="session")
def fmnist_test(fmnist_spec):
    from sensai.data import load_split

    return load_split(fmnist_spec, "test")


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory, fmnist_spec, fmnist_train, fmnist_test):
    """fmnist_cnn trained for one short epoch on 6,000 real images (~10 s on 2 cores)."""
    import torch

    from sensai.training.options import TrainOptions
    from sensai.training.trainer import train

    out = tmp_path_factory.mktemp("trained") / "fmnist_cnn"
    train(model_name="fmnist_cnn", spec=fmnist_spec, train_set=fmnist_train, test_set=fmnist_test,
          out_dir=out, epochs=1, options=TrainOptions(train_limit=6000), device=torch.device("cpu"))
    return out


# Tiny decomposition settings: every stage runs for real, on real images, in seconds.
TINY_DECOMPOSE = dict(use_tsne=False, features_per_class=20, stats_per_class=40,
                      samples_per_subnet=384, retrain_epochs=1, batch_size=64)


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, trained_model_dir):
    """A complete decomposition artifact (G=5 group heads, ONNX files, manifest, report) of
    ``trained_model_dir``, built by ``pruning.decompose.decompose`` in process (no Ray)."""
    from sensai.pruning.decompose import DecomposeConfig, decompose

    out = tmp_path_factory.mktemp("artifact") / "fmnist_g5"
    decompose(trained_model_dir, out, groups=5, config=DecomposeConfig(**TINY_DECOMPOSE),
              device="cpu", use_ray=False, eval_limit=500)
    return out


@pytest.fixture(scope="session")
def tiny_artifact_g2(tmp_path_factory, trained_model_dir):
    """A second decomposition of the same model (G=2): another version of it, for the model
    repository's swaps."""
    from sensai.pruning.decompose import DecomposeConfig, decompose

    out = tmp_path_factory.mktemp("artifact") / "fmnist_g2"
    decompose(trained_model_dir, out, groups=2, config=DecomposeConfig(**TINY_DECOMPOSE),
              device="cpu", use_ray=False, eval_limit=200)
    return out

"""Class grouping: balanced k-means, penultimate features of a really trained model, the plot."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from sklearn.base import clone

from sensai.errors import SensaiError
from sensai.pruning.grouping import (BalancedKMeans, Grouping, _balanced_assign, group_classes,
                                     penultimate_features, plot_grouping)

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------
# BalancedKMeans


def _sizes(labels, k):
    return sorted(np.bincount(labels, minlength=k).tolist())


@pytest.mark.parametrize("n,k,expected", [(12, 3, [4, 4, 4]), (12, 4, [3, 3, 3, 3]),
                                          (10, 3, [3, 3, 4]), (11, 4, [2, 3, 3, 3]),
                                          (7, 7, [1] * 7), (5, 1, [5])])
def test_balanced_sizes(n, k, expected):
    X = np.random.default_rng(n * 10 + k).normal(size=(n, 3))
    km = BalancedKMeans(k, random_state=0).fit(X)
    assert _sizes(km.labels_, k) == expected
    assert km.cluster_centers_.shape == (k, 3)
    assert km.n_iter_ >= 1
    # Centres are the means of their members and inertia is the summed squared distance to them.
    for c in range(k):
        np.testing.assert_allclose(km.cluster_centers_[c], X[km.labels_ == c].mean(0))
    assert km.inertia_ == pytest.approx(((X - km.cluster_centers_[km.labels_]) ** 2).sum())


def test_balanced_recovers_separated_blobs_and_forces_balance():
    rng = np.random.default_rng(0)
    blobs = [rng.normal(loc=c, scale=0.1, size=(4, 2)) for c in ((0, 0), (10, 0), (0, 10))]
    X = np.concatenate(blobs)
    labels = BalancedKMeans(3, random_state=0).fit(X).labels_
    for b in range(3):
        assert len(set(labels[4 * b:4 * b + 4])) == 1
    assert len(set(labels)) == 3
    # Uneven natural clusters (6 + 2 points) are split 4 / 4 anyway: balance is a hard constraint.
    Y = np.concatenate([rng.normal(0, 0.1, (6, 2)), rng.normal(10, 0.1, (2, 2))])
    assert _sizes(BalancedKMeans(2, random_state=0).fit(Y).labels_, 2) == [4, 4]


@pytest.mark.parametrize("n,k", [(6, 3), (7, 3), (8, 3), (7, 2)])
def test_balanced_assignment_is_exact(n, k):
    dist = np.random.default_rng(n + 7 * k).random((n, k))
    labels = _balanced_assign(dist, k)
    base, extra = divmod(n, k)
    assert sorted(np.bincount(labels, minlength=k)) == [base] * (k - extra) + [base + 1] * extra
    best = min(dist[np.arange(n), np.array(lab)].sum()
               for lab in itertools.product(range(k), repeat=n)
               if sorted(np.bincount(lab, minlength=k)) == [base] * (k - extra) + [base + 1] * extra)
    assert dist[np.arange(n), labels].sum() == pytest.approx(best)


def test_balanced_deterministic_and_sklearn_shaped():
    X = np.random.default_rng(3).normal(size=(20, 4))
    a = BalancedKMeans(4, n_init=3, random_state=7).fit(X)
    b = BalancedKMeans(4, n_init=3, random_state=7).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_array_equal(a.cluster_centers_, b.cluster_centers_)
    assert a.get_params() == {"n_clusters": 4, "n_init": 3, "max_iter": 100, "random_state": 7}
    c = clone(a)
    assert c.get_params() == a.get_params() and not hasattr(c, "labels_")
    c.set_params(n_clusters=5)
    np.testing.assert_array_equal(c.fit_predict(X), c.labels_)
    assert _sizes(c.labels_, 5) == [4] * 5
    assert isinstance(a.fit(X), BalancedKMeans)


@pytest.mark.parametrize("k", [0, -1, 11])
def test_balanced_bad_n_clusters(k):
    with pytest.raises(ValueError, match="n_clusters must be between 1 and the number of samples"):
        BalancedKMeans(k).fit(np.zeros((10, 2)))


def test_balanced_bad_params():
    with pytest.raises(ValueError, match="integer"):
        BalancedKMeans(2.5).fit(np.zeros((10, 2)))
    with pytest.raises(ValueError, match="n_init"):
        BalancedKMeans(2, n_init=0).fit(np.zeros((10, 2)))


# --------------------------------------------------------------------------------------------
# Real penultimate features and grouping


@pytest.fixture(scope="module")
def trained(trained_model_dir):
    from sensai.checkpoint import load_trained_model

    return load_trained_model(trained_model_dir)[0]


@pytest.fixture(scope="module")
def features(trained, fmnist_spec, fmnist_train):
    # 30 images per class keep the t-SNE in the tests short.
    return penultimate_features(trained, fmnist_train, fmnist_spec, CPU, per_class=30, seed=0)


@pytest.fixture(scope="module")
def tsne_grouping(features):
    f, y = features
    # One thread: t-SNE's OpenMP threads crawl when the test machine's cores are busy.
    return group_classes(f, y, 10, 3, use_tsne=True, seed=0, threads=1)


def test_penultimate_features_are_classifier_inputs(trained, fmnist_spec, fmnist_train, features):
    from sensai.data import TensorImages, normalize

    f, y = features
    assert f.shape == (300, 128) and f.dtype == np.float32
    assert np.bincount(y, minlength=10).tolist() == [30] * 10
    assert len(trained.classifier._forward_pre_hooks) == 0
    # On a small split every image is taken (in order), and the features are exactly what the
    # classifier receives.
    small = TensorImages(fmnist_train.images[:150], fmnist_train.labels[:150])
    g, z = penultimate_features(trained, small, fmnist_spec, CPU, per_class=1000, batch_size=64)
    np.testing.assert_array_equal(z, small.labels)
    with torch.no_grad():
        direct = trained.features(normalize(small.images, fmnist_spec)).numpy()
    np.testing.assert_allclose(g, direct, rtol=1e-5, atol=1e-5)
    again, _ = penultimate_features(trained, fmnist_train, fmnist_spec, CPU, per_class=30, seed=0)
    np.testing.assert_array_equal(again, f)
    other, _ = penultimate_features(trained, fmnist_train, fmnist_spec, CPU, per_class=30, seed=1)
    assert not np.array_equal(other, f)


def test_penultimate_restores_mode(trained, fmnist_spec, fmnist_train):
    trained.train()
    try:
        penultimate_features(trained, fmnist_train, fmnist_spec, CPU, per_class=2)
        assert trained.training and trained.features[1].training
    finally:
        trained.eval()
    with pytest.raises(SensaiError, match="per_class"):
        penultimate_features(trained, fmnist_train, fmnist_spec, CPU, per_class=0)


def _check_partition(g: Grouping, n_groups: int):
    assert len(g.groups) == n_groups
    assert sorted(c for grp in g.groups for c in grp) == list(range(10))
    assert all(grp == sorted(grp) for grp in g.groups)
    assert [grp[0] for grp in g.groups] == sorted(grp[0] for grp in g.groups)
    sizes = sorted(len(grp) for grp in g.groups)
    assert sizes[-1] - sizes[0] <= 1


def test_group_classes_tsne(tsne_grouping):
    import json

    g = tsne_grouping
    _check_partition(g, 3)
    assert g.class_points.shape == (10, 2)
    assert g.sample_points.shape == (300, 2) and g.sample_labels.shape == (300,)
    assert g.method["tsne"] is True and g.method["per_class"] == 30 and g.method["seed"] == 0
    json.dumps(g.method)


@pytest.mark.parametrize("n_groups", [1, 2, 5])
def test_group_classes_raw_features(features, n_groups):
    f, y = features
    g = group_classes(f, y, 10, n_groups, use_tsne=False, seed=0)
    _check_partition(g, n_groups)
    assert g.class_points.shape == (10, 128) and g.sample_points is None
    assert g.method["tsne"] is False
    assert group_classes(f, y, 10, n_groups, use_tsne=False, seed=0).groups == g.groups
    if n_groups == 5:
        # A trained network sees T-shirt/Shirt, Pullover/Coat or Sandal/Sneaker as alike.
        assert {(0, 6), (2, 4), (5, 7)} & {tuple(grp) for grp in g.groups}


def test_group_classes_singletons_and_errors(features):
    f, y = features
    g = group_classes(f, y, 10, 10, use_tsne=False)
    assert g.groups == [[c] for c in range(10)]
    for bad in (0, -2, 11, 2.5):
        with pytest.raises(SensaiError, match="number of groups must be between 1 and 10"):
            group_classes(f, y, 10, bad)
    with pytest.raises(SensaiError, match="class 3 has no training images"):
        group_classes(f[y != 3], y[y != 3], 10, 2, use_tsne=False)


def test_plot_grouping_png(tsne_grouping, features, fmnist_spec, tmp_path):
    from PIL import Image

    for g, name in ((tsne_grouping, "tsne.png"),
                    (group_classes(*features, 10, 5, use_tsne=False), "raw.png")):
        path = tmp_path / "plots" / name
        plot_grouping(g, fmnist_spec.classes, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as img:
            img.verify()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["raw.png", "tsne.png"]
    with pytest.raises(ValueError, match="class names"):
        plot_grouping(tsne_grouping, fmnist_spec.classes[:3], tmp_path / "x.png")


def test_a_model_whose_last_registered_linear_is_not_its_output_is_refused(fmnist_spec,
                                                                          fmnist_train):
    """Decomposition replaces the last nn.Linear registered; a head registered first (an
    embedding after it) is refused in one line, not a shape error deep in pruning."""
    from torch import nn

    from sensai.pruning.errors import UnsupportedModel

    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = nn.Linear(8, 10)
            self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
            self.embed = nn.Linear(4, 8)

        def forward(self, x):
            return self.classifier(torch.relu(self.embed(self.body(x))))

    with pytest.raises(UnsupportedModel, match="'embed', does not give its output"):
        penultimate_features(HeadFirst(), fmnist_train, fmnist_spec, CPU, per_class=2)
    assert issubclass(UnsupportedModel, SensaiError)  # the CLI says it in one line

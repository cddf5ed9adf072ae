"""Which classes share a subnet: balanced k-means on per-class penultimate features.

sensAI groups classes whose features look alike, so a subnet specialises in telling apart classes
that are genuinely close, and every group has (nearly) the same number of classes so the subnets
have similar sizes and latencies.  The per-class centroids are taken in a 2-D t-SNE embedding of a
bounded sample of training images (as in the paper's figures), or in the raw feature space.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist
from sklearn.base import BaseEstimator, ClusterMixin
from sklearn.cluster import kmeans_plusplus
from sklearn.utils import check_array, check_random_state
from torch import nn
from tqdm.auto import tqdm

from sensai.data import DatasetSpec, ImageDataset, iterate_batches, normalize
from sensai.errors import SensaiError
from sensai.fsutil import atomic_path
from sensai.models import classifier_layer

from .errors import UnsupportedModel

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Balanced k-means


def _balanced_assign(dist: np.ndarray, n_clusters: int) -> np.ndarray:
    """Labels minimising the summed distance with cluster sizes floor(n/k) or floor(n/k)+1.

    Each centre gets floor(n/k) mandatory slots plus one optional slot (when k does not divide n);
    a bonus larger than any distance on the mandatory slots makes every optimum fill all of them,
    so exactly n mod k clusters receive the extra member.  Solved exactly as one rectangular linear
    assignment problem.
    """
    n = dist.shape[0]
    base, extra = divmod(n, n_clusters)
    slot_centre = np.repeat(np.arange(n_clusters), base)
    cost = dist[:, slot_centre]
    if extra:
        bonus = float(dist.max()) + 1.0
        cost = np.concatenate([cost - bonus, dist], axis=1)
        slot_centre = np.concatenate([slot_centre, np.arange(n_clusters)])
    rows, cols = linear_sum_assignment(cost)
    labels = np.empty(n, dtype=np.int64)
    labels[rows] = slot_centre[cols]
    return labels


class BalancedKMeans(BaseEstimator, ClusterMixin):
    """k-means whose clusters have equal sizes (differing by at most one when k does not divide n).

    Lloyd iterations where the assignment step is an exact balanced assignment
    (``scipy.optimize.linear_sum_assignment``) instead of nearest-centre; k-means++ seeding,
    ``n_init`` restarts, the lowest inertia wins.  Deterministic for a given ``random_state``.
    """

    def __init__(self, n_clusters=2, *, n_init=10, max_iter=100, random_state=None):
        self.n_clusters = n_clusters
        self.n_init = n_init
        self.max_iter = max_iter
        self.random_state = random_state

    def _check_params(self, n_samples: int) -> None:
        k = self.n_clusters
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise ValueError(f"n_clusters must be an integer, got {k!r}")
        if k < 1 or k > n_samples:
            raise ValueError(f"n_clusters must be between 1 and the number of samples ({n_samples}), "
                             f"got {k}")
        if not isinstance(self.n_init, (int, np.integer)) or self.n_init < 1:
            raise ValueError(f"n_init must be a positive integer, got {self.n_init!r}")
        if not isinstance(self.max_iter, (int, np.integer)) or self.max_iter < 1:
            raise ValueError(f"max_iter must be a positive integer, got {self.max_iter!r}")

    def fit(self, X, y=None) -> "BalancedKMeans":
        X = check_array(X, dtype=np.float64)
        n = X.shape[0]
        self._check_params(n)
        k = int(self.n_clusters)
        rng = check_random_state(self.random_state)
        best = None
        for _ in range(int(self.n_init)):
            centres, _ = kmeans_plusplus(X, k, random_state=rng)
            labels = None
            for it in range(1, int(self.max_iter) + 1):
                dist = cdist(X, centres, "sqeuclidean")
                new = _balanced_assign(dist, k)
                converged = labels is not None and np.array_equal(new, labels)
                labels = new
                centres = np.stack([X[labels == c].mean(axis=0) for c in range(k)])
                if converged:
                    break
            inertia = float(((X - centres[labels]) ** 2).sum())
            if best is None or inertia < best[0] - 1e-12:
                best = (inertia, labels, centres, it)
        self.inertia_, self.labels_, self.cluster_centers_, self.n_iter_ = best
        self.n_features_in_ = X.shape[1]
        return self


# --------------------------------------------------------------------------------------------
# Class grouping


@dataclass(frozen=True)
class Grouping:
    groups: list[list[int]]            # sorted classes per group; groups ordered by smallest class
    class_points: np.ndarray           # [N, d] class centroids the clustering saw (2-D with t-SNE)
    sample_points: np.ndarray | None   # [n, 2] embedded samples (for the plot), None without t-SNE
    sample_labels: np.ndarray | None
    method: dict                       # how the grouping was made (JSON-able, for the manifest)


def _sample_indices(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        out.append(idx if len(idx) <= per_class else rng.choice(idx, size=per_class, replace=False))
    return np.sort(np.concatenate(out)) if out else np.empty(0, dtype=np.int64)


@torch.no_grad()
def penultimate_features(model: nn.Module, dataset: ImageDataset, spec: DatasetSpec,
                         device: torch.device, *, per_class: int = 200, seed: int = 0,
                         batch_size: int = 256, progress: str | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Inputs of the classifier layer for at most ``per_class`` random training images per class.

    Returns ``(features [n, d] float32, labels [n] int64)``.  The sample bound keeps the cost (and
    the later t-SNE) independent of the dataset size.
    """
    if per_class < 1:
        raise SensaiError(f"per_class must be at least 1, got {per_class}")
    indices = _sample_indices(np.asarray(dataset.labels), per_class, seed)
    if indices.size == 0:
        raise SensaiError("the dataset holds no images to compute features from")
    name, head = classifier_layer(model)
    feats: list[torch.Tensor] = []
    last: list[torch.Tensor] = []  # the head's latest output

    def grab(module, inputs, out):
        feats.append(inputs[0].detach().flatten(1).float().cpu())
        last[:] = [out]

    modes = {m: m.training for m in model.modules()}
    handle = head.register_forward_hook(grab)
    labels = []
    try:
        model.eval().to(device)
        with tqdm(total=len(indices), desc=progress, disable=progress is None, unit="img",
                  leave=False) as bar:
            for x, y in iterate_batches(dataset, batch_size, indices=indices):
                out = model(normalize(x.to(device), spec))
                if not labels:
                    check_head_is_output(name, last, out)
                labels.append(y.numpy())
                bar.update(len(x))
    finally:
        handle.remove()
        for m, training in modes.items():
            m.training = training
    if len(feats) != len(labels):
        raise UnsupportedModel("the classifier layer must be called exactly once per forward "
                               "pass")
    return torch.cat(feats).numpy(), np.concatenate(labels).astype(np.int64)


def check_head_is_output(name: str, last: list[torch.Tensor], out) -> None:
    """Decomposition replaces the last ``nn.Linear`` the model registers (``name``; ``last``:
    its output, if it ran) with the group heads: refused in one line unless that layer's output
    is the model's (as a view or copy)."""
    given = last[0] if last else None
    if not (isinstance(out, torch.Tensor) and given is not None
            and given.numel() == out.numel() and torch.equal(given.reshape(out.shape), out)):
        raise UnsupportedModel(
            f"the last nn.Linear the model registers, {name!r}, does not give its output: "
            "decomposition replaces that layer with the groups' heads; define the output layer "
            "last in __init__")


def group_classes(features: np.ndarray, labels: np.ndarray, num_classes: int, n_groups: int, *,
                  use_tsne: bool = True, seed: int = 0, perplexity: float = 30.0,
                  n_init: int = 10, threads: int | None = None) -> Grouping:
    """Split ``num_classes`` classes into ``n_groups`` groups of (nearly) equal size.

    With ``use_tsne`` the sampled features are embedded in 2-D by t-SNE and the class centroids are
    taken there (t-SNE keeps neighbourhoods, which is what "similar classes" means); otherwise in
    the raw feature space.  Balanced k-means then clusters the ``num_classes`` centroids.
    ``n_groups == num_classes`` gives one class per group without clustering.  ``threads`` caps
    the OpenMP/BLAS threads t-SNE may use (None: the libraries' default, all cores); on a busy
    machine one thread is faster than many competing ones.
    """
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise SensaiError(f"the number of classes must be a positive integer, got {num_classes!r}")
    if (not isinstance(n_groups, (int, np.integer)) or isinstance(n_groups, bool)
            or not 1 <= n_groups <= num_classes):
        raise SensaiError(f"the number of groups must be between 1 and {num_classes} (the number of "
                          f"classes), got {n_groups!r}")
    features = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if features.ndim != 2 or labels.ndim != 1 or len(features) != len(labels):
        raise ValueError(f"features must be [n, d] and labels [n], got {features.shape} and {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    counts = np.bincount(labels, minlength=num_classes)
    missing = np.flatnonzero(counts == 0)
    if missing.size:
        raise SensaiError(f"class {int(missing[0])} has no training images, so it cannot be grouped "
                          f"({missing.size} class(es) without images)")

    method = {"algorithm": "balanced-kmeans", "tsne": bool(use_tsne), "perplexity": None,
              "seed": int(seed), "per_class": int(counts.max()), "samples": int(len(labels)),
              "feature_dim": int(features.shape[1]), "n_groups": int(n_groups),
              "num_classes": int(num_classes)}
    sample_points = sample_labels = None
    points = features
    if use_tsne and len(features) > 2:
        from sklearn.manifold import TSNE

        # t-SNE needs perplexity < n_samples; small samples get a proportionally smaller one.
        perp = float(min(perplexity, max(1.0, (len(features) - 1) / 3)))
        log.info("t-SNE of %d samples (%d features), perplexity %.1f", len(features),
                 features.shape[1], perp)
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=threads):
            points = TSNE(n_components=2, perplexity=perp, init="pca",
                          random_state=seed).fit_transform(features)
        sample_points, sample_labels = points.astype(np.float32), labels.copy()
        method["perplexity"] = perp
    else:
        method["tsne"] = False
    class_points = np.stack([points[labels == c].mean(axis=0) for c in range(num_classes)])

    if n_groups == num_classes:
        groups = [[c] for c in range(num_classes)]
    else:
        km = BalancedKMeans(n_groups, n_init=n_init, random_state=seed).fit(class_points)
        groups = sorted(sorted(int(c) for c in np.flatnonzero(km.labels_ == g)) for g in range(n_groups))
        method["inertia"] = float(km.inertia_)
    return Grouping(groups=groups, class_points=class_points.astype(np.float32),
                    sample_points=sample_points, sample_labels=sample_labels, method=method)


def plot_grouping(grouping: Grouping, class_names, path) -> None:
    """PNG of the (embedded) samples coloured by group, with each class name at its centroid."""
    # A bare Figure renders through Agg and never touches pyplot's global state or backend.
    import matplotlib
    from matplotlib.figure import Figure

    class_names = list(class_names)
    pts = np.asarray(grouping.class_points, dtype=np.float64)
    if len(class_names) != len(pts):
        raise ValueError(f"{len(class_names)} class names for {len(pts)} classes")
    samples = grouping.sample_points
    if pts.shape[1] != 2:
        # Raw features: show the centroids in their first two principal components.
        from sklearn.decomposition import PCA

        pts = PCA(n_components=min(2, *pts.shape), random_state=0).fit_transform(pts)
        if pts.shape[1] == 1:
            pts = np.concatenate([pts, np.zeros_like(pts)], axis=1)
        samples = None
    group_of = {c: g for g, members in enumerate(grouping.groups) for c in members}
    cmap = matplotlib.colormaps["tab10" if len(grouping.groups) <= 10 else "tab20"]

    def colour(g: int):
        return cmap(g % cmap.N)

    fig = Figure(figsize=(8, 7), dpi=110)
    ax = fig.add_subplot()
    if samples is not None and grouping.sample_labels is not None:
        cols = [colour(group_of[int(c)]) for c in grouping.sample_labels]
        ax.scatter(samples[:, 0], samples[:, 1], c=cols, s=5, alpha=0.35, linewidths=0)
    for c, (x, y) in enumerate(pts):
        ax.scatter([x], [y], color=colour(group_of[c]), s=80, edgecolors="black", linewidths=0.8,
                   zorder=3)
        ax.annotate(class_names[c], (x, y), xytext=(5, 5), textcoords="offset points", fontsize=9,
                    zorder=4)
    space = "t-SNE of penultimate features" if samples is not None else "class centroids"
    ax.set_title(f"{len(grouping.groups)} groups of {len(pts)} classes ({space})")
    ax.set_xticks([])
    ax.set_yticks([])
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")

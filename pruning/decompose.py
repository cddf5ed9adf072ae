"""``sensai decompose``: a trained N-class CNN -> G pruned, retrained subnets + ONNX + report.

Stages (each saved under the artifact directory ``ART`` as soon as it is done, so a re-run with the
same settings resumes where the last one stopped):

1. grouping   - penultimate features of a per-class sample -> balanced k-means -> ``grouping.json``
2. stats      - per group, APoZ / mean |a| of every prunable layer on the group's own training
                images -> ``work/stats/group_XX.npz``
3. prune      - per group, keep the most useful channels, new output head
                -> ``work/pruned/subnet_XX.safetensors``
4. retrain    - per subnet, balanced fine-tuning (Ray tasks in parallel, or in process)
                -> ``subnets/subnet_XX.safetensors``, each written the moment it is finished
5. export     - ONNX per subnet, checked against torch -> ``subnets/subnet_XX.onnx``
6. evaluate   - original vs merged top-1 on the test split -> ``work/evaluation.json``
7. artifact   - ``manifest.json``, ``report.md`` / ``report.json`` / ``report.png``

Every intermediate record names the hash of the file it was computed from, so a stale result (its
input was redone) is redone too.  Settings that change results are fingerprinted in
``work/settings.json``; running into an artifact made with other settings is refused unless
``force`` is given.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sensai.artifact import load_artifact
from sensai.bounds import SEED, Bound, check_bounds
from sensai.checkpoint import build_from_weights, load_trained_model, load_weights, save_weights
from sensai.cores import usable_cores
from sensai.data import (DatasetSpec, ImageDataset, TensorImages, iterate_batches, load_split,
                         normalize, resolve_dataset, stratified_subset)
from sensai.errors import CheckpointError, SensaiError
from sensai.export import export_onnx
from sensai.flops import count_flops
from sensai.fsutil import atomic_path, sha256_file, write_json_atomic
from sensai.learning import eval_batch_size, fast_layout, predict_logits
from sensai.manifest import (DatasetInfo, DecompositionManifest, ModelRecord, SourceInfo,
                             SubnetRecord, load_manifest, save_manifest)
from sensai.merge import merge_outputs
from sensai.models import count_params, select_device

from .apoz import ChannelStats, collect_activation_stats
from .errors import RetrainFailed
from .grouping import group_classes, penultimate_features, plot_grouping
from .iterative import MAX_STEPS, step_policies
from .jobs import RetrainProgress, ray_or_in_process, run_in_process, run_on_ray
from .prune import (ALLOCATIONS, PruningPolicy, find_prunable, layer_widths, make_head,
                    prune_to_policy)
from .report import write_report
from .retrain import RetrainSettings, retrain_plan, retrain_state, soft_targets
from .workdir import Layout, Stages, file_ok, prepare_out, read_json

log = logging.getLogger(__name__)

POLICIES = ("keep", "threshold", "params", "shrink")
CHECK_IMAGES = 32  # real test images each ONNX file is checked on


# Retraining images per decomposition when samples_per_subnet is not given: split over the G
# subnets, so the cost (and the wall time) of a decomposition does not grow with G.
AUTO_TOTAL_SAMPLES = 600_000
AUTO_MIN_SAMPLES = 20_000

# Knobs whose default changed after artifacts were made without recording them: such an
# artifact was made with these values (not today's defaults), so re-running it is a new run.
RECORDED_BEFORE = {"channel_multiple": 1}


@dataclass(frozen=True)
class DecomposeConfig:
    """Every knob that changes what a decomposition produces (all recorded in the manifest).

    Defaults were chosen by measurement on fmnist_cnn / Fashion-MNIST (BENCHMARKS.md,
    "Decomposition: shrink against accuracy"): the ``shrink`` policy at 10 makes every subnet
    >= 10x smaller than the original in parameters *and* multiply-accumulates, whatever the
    architecture; 600k retraining images in total (60k per subnet at G = 10) in small batches (a
    much smaller subnet needs more steps, not more images, so a small batch loses less), half of each
    subnet's negatives drawn where the original model is most tempted to answer with the
    subnet's classes, distillation from the original at weight 0.7 and AdamW at lr 5e-3.
    Retraining dominates the cost: ``samples_per_subnet`` trades accuracy for time.  CUDA
    retrains in the same small batches: larger ones at a scaled learning rate lost accuracy at
    20x (BENCHMARKS.md, "What was tried and not kept"); there each step is one captured graph
    launch instead (:mod:`sensai.train_step`).
    """

    # pruning
    policy: str = field(default="shrink", metadata={"help": (
        "keep: the keep_fraction most active channels per layer; threshold: prune APoZ >= "
        "theta1 unless mean |a| >= theta2 (sensAI's rule); params: prune to params_fraction of "
        "the parameters; shrink: at least `shrink` times fewer parameters and MACs"),
        "flag": ()})
    keep_fraction: float = field(default=0.5, metadata={
        "help": "channels kept per layer by policy keep", "bound": Bound(above=0, high=1)})
    theta1: float = field(default=0.73, metadata={
        "help": "policy threshold: prune a channel whose APoZ (share of zero activations) is at "
                "least this", "bound": Bound(low=0, high=1)})
    theta2: float = field(default=0.01, metadata={
        "help": "policy threshold: keep a channel whose mean |activation| is at least this, "
                "whatever its APoZ", "bound": Bound(low=0)})
    params_fraction: float | None = field(default=0.25, metadata={
        "help": "most parameters a subnet may keep, as a fraction of the original's, for policy "
                "params (0.25: >= 4x smaller)", "bound": Bound(above=0, high=1)})
    shrink: float | None = field(default=10.0, metadata={
        "help": "for policy shrink: every subnet has at most 1/shrink of the original's "
                "parameters and of its MACs", "bound": Bound(low=1)})
    allocation: str = field(default="uniform", metadata={
        "help": "how policies params and shrink share the budget over the layers: uniform = the "
                "same keep fraction everywhere, apoz / activity = more where the group's "
                "channels are active", "choices": ALLOCATIONS})
    prune_steps: int = field(default=1, metadata={
        "help": "reach the shrink / params_fraction budget in this many prune -> retrain steps, "
                "each removing the same ratio and re-ranking channels on the retrained subnet; "
                "the retraining images are split over the steps (1: one shot)",
        "bound": Bound(low=1, high=MAX_STEPS)})
    prune_residual: bool = field(default=False, metadata={
        "help": "also prune residual-path channels, as coupled groups across the additions "
                "(sensAI prunes only inside blocks)"})
    min_channels: int = field(default=2, metadata={
        "help": "never keep fewer channels in a layer", "bound": Bound(low=1)})
    channel_multiple: int = field(default=8, metadata={
        "help": "a pruned layer keeping at least this many channels keeps a multiple of it, the "
                "widths GPU tensor cores and CPU vector units work in (1: any width)",
        "bound": Bound(low=1)})
    zero_threshold: float = field(default=0.005, metadata={
        "help": "|activation| counted as zero for APoZ", "bound": Bound(low=0)})
    stats_per_class: int = field(default=500, metadata={
        "help": "training images per class the activation statistics are taken on",
        "bound": Bound(low=1)})
    # grouping (t-SNE off: on fmnist_cnn its 2-D class centroids paired Pullover with Bag and
    # Coat with Shirt, where the raw features give Pullover+Coat and T-shirt+Shirt, and it costs
    # far more time)
    use_tsne: bool = field(default=False, metadata={
        "help": "cluster class centroids in a 2-D t-SNE embedding of the features instead of "
                "the raw features"})
    features_per_class: int = field(default=200, metadata={
        "help": "training images per class for the grouping features", "bound": Bound(low=2)})
    # retraining
    retrain_epochs: int = field(default=1, metadata={
        "help": "epochs per subnet, 0 = no retraining", "flag": (), "bound": Bound(low=0)})
    samples_per_subnet: int | None = field(default=None, metadata={
        "help": f"balanced images per subnet and epoch - the cost bound (none: "
                f"{AUTO_TOTAL_SAMPLES} / G, at least {AUTO_MIN_SAMPLES})", "flag": (),
        "bound": Bound(low=2)})
    negative_share: float | None = field(default=None, metadata={
        "help": "fraction of each subnet's samples that are other classes' images (none: one "
                "(k+1)-th; the loss still weighs each class like all negatives)",
        "bound": Bound(above=0, below=1)})
    distill: float = field(default=0.7, metadata={
        "help": "weight of the original model's soft targets in the retraining loss",
        "bound": Bound(low=0, high=1)})
    distill_temperature: float = field(default=1.0, metadata={
        "help": "temperature T of the distillation term: teacher and subnet outputs are "
                "divided by T (and the term scaled by T^2); larger T weighs the teacher's "
                "ranking of unlikely classes more", "bound": Bound(above=0)})
    hard_negatives: float = field(default=0.5, metadata={
        "help": "share of the negatives drawn by how strongly the original model "
                "mistakes them for the subnet's classes", "bound": Bound(low=0, high=1)})
    flip: bool | None = field(default=None, metadata={
        "help": "mirror a random half of the retraining images left to right (none: as the "
                "model was trained, its model.json)"})
    optimizer: str = field(default="adam", metadata={
        "help": "the retraining optimizer: sgd with Nesterov momentum, or adam (AdamW)",
        "choices": ("sgd", "adam")})
    lr: float = field(default=0.005, metadata={"help": "peak retraining learning rate",
                                               "bound": Bound(above=0)})
    batch_size: int = field(default=32, metadata={"help": "retraining images per step",
                                                  "bound": Bound(low=1)})
    seed: int = field(default=0, metadata={
        "help": "seed of the grouping, the statistics' and retraining's samples and the new heads",
        "flag": (), "bound": SEED})
    # export
    opset: int = field(default=17, metadata={"help": "ONNX opset of the exported subnets",
                                             "bound": Bound(low=7, high=23)})

    def samples_for(self, n_groups: int) -> int:
        if self.samples_per_subnet is not None:
            return int(self.samples_per_subnet)
        return max(AUTO_MIN_SAMPLES, AUTO_TOTAL_SAMPLES // max(1, n_groups))

    def validate(self) -> "DecomposeConfig":
        if self.policy not in POLICIES:
            raise SensaiError(f"unknown pruning policy {self.policy!r}; choose one of: "
                              f"{', '.join(POLICIES)}")
        check_bounds(self)
        if self.policy == "params" and self.params_fraction is None:
            raise SensaiError("--policy params needs params_fraction (e.g. --set "
                              "params_fraction=0.1 for subnets 10x smaller than the original)")
        if self.policy == "shrink" and self.shrink is None:
            raise SensaiError("--policy shrink needs shrink (e.g. --set shrink=10 for subnets "
                              "with 10x fewer parameters and MACs than the original)")
        if self.allocation not in ALLOCATIONS:
            raise SensaiError(f"unknown allocation {self.allocation!r}; choose one of: "
                              f"{', '.join(ALLOCATIONS)}")
        try:
            policy = self.pruning_policy()
        except ValueError as e:
            raise SensaiError(f"bad pruning settings: {e}") from None
        try:
            step_policies(policy, self.prune_steps)
        except ValueError as e:
            raise SensaiError(f"prune_steps: {e}") from None
        if self.prune_steps > 1 and self.retrain_epochs == 0:
            raise SensaiError("prune_steps above 1 retrains between steps; it needs "
                              "--retrain-epochs of at least 1")
        self.retrain_settings(1).validate()
        return self

    def pruning_policy(self):
        return PruningPolicy(kind=self.policy, theta1=self.theta1, theta2=self.theta2,
                             keep_fraction=self.keep_fraction, params_fraction=self.params_fraction,
                             min_channels=self.min_channels, shrink=self.shrink,
                             channel_multiple=self.channel_multiple,
                             allocation=self.allocation)

    def retrain_settings(self, n_groups: int):
        return RetrainSettings(epochs=self.retrain_epochs, samples=self.samples_for(n_groups),
                               lr=self.lr, batch_size=self.batch_size, seed=self.seed,
                               negative_share=self.negative_share, distill=self.distill,
                               temperature=self.distill_temperature,
                               hard_negatives=self.hard_negatives, optimizer=self.optimizer)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DecomposeConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------------------------
# Checks done before any long work


def _check_groups(groups: Any, num_classes: int) -> int:
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)):
        raise SensaiError(f"--groups must be an integer, got {groups!r}")
    if groups < 1:
        raise SensaiError(f"--groups must be at least 1, got {groups}")
    if groups > num_classes:
        raise SensaiError(f"--groups {groups} is more than the model's {num_classes} classes "
                          f"(at most one subnet per class)")
    return int(groups)


def _resolve_spec(record: ModelRecord, data_dir: str | None) -> DatasetSpec:
    """The model's recorded dataset (its normalisation, its classes), found at ``data_dir``."""
    spec = record.dataset.to_spec()
    if data_dir is not None:
        spec = spec.with_data_dir(data_dir)
    found = resolve_dataset(spec.name, spec.data_dir, spec.input_shape[1])
    if tuple(found.classes) != tuple(spec.classes):
        raise SensaiError(f"the {spec.name} data at {found.data_dir} has classes "
                          f"{list(found.classes)[:5]}..., the model was trained on "
                          f"{list(spec.classes)[:5]}...")
    if tuple(found.input_shape) != tuple(spec.input_shape):
        raise SensaiError(f"the {spec.name} data at {found.data_dir} gives images of shape "
                          f"{found.input_shape}, the model expects {spec.input_shape}")
    return spec


# --------------------------------------------------------------------------------------------
# Stage 1: grouping


def stage_grouping(layout, model, spec, train, n_groups, cfg, device) -> tuple[list[list[int]], dict, bool]:
    saved = read_json(layout.grouping_json)
    if saved and saved.get("n_groups") == n_groups and saved.get("groups"):
        groups = [[int(c) for c in g] for g in saved["groups"]]
        if sorted(c for g in groups for c in g) == list(range(spec.num_classes)):
            return groups, saved.get("method", {}), False
    feats, labels = penultimate_features(model, train(), spec, device,
                                         per_class=cfg.features_per_class, seed=cfg.seed,
                                         progress="grouping: features")
    grouping = group_classes(feats, labels, spec.num_classes, n_groups, use_tsne=cfg.use_tsne,
                             seed=cfg.seed)
    try:
        plot_grouping(grouping, spec.classes, layout.grouping_png)
    except Exception as e:  # a plot is a courtesy; never lose the grouping over it
        log.warning("could not draw %s: %s", layout.grouping_png, e)
    write_json_atomic(layout.grouping_json, {
        "n_groups": n_groups, "groups": grouping.groups,
        "class_names": [[spec.classes[c] for c in g] for g in grouping.groups],
        "method": grouping.method,
        "class_points": np.asarray(grouping.class_points).round(5).tolist(),
    })
    return grouping.groups, grouping.method, True


# --------------------------------------------------------------------------------------------
# Stage 2: activation statistics


def _save_stats(path: Path, stats: dict) -> None:
    names = list(stats)
    arrays = {"names": np.array(names, dtype=np.str_),
              "counts": np.array([stats[n].count for n in names], dtype=np.int64)}
    for i, n in enumerate(names):
        arrays[f"apoz_{i}"] = np.asarray(stats[n].apoz, dtype=np.float64)
        arrays[f"mean_abs_{i}"] = np.asarray(stats[n].mean_abs, dtype=np.float64)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a path
            np.savez(f, **arrays)


def _load_stats(path: Path) -> dict | None:

    try:
        with np.load(path, allow_pickle=False) as z:
            names = [str(n) for n in z["names"]]
            counts = z["counts"]
            return {n: ChannelStats(apoz=z[f"apoz_{i}"], mean_abs=z[f"mean_abs_{i}"],
                                    count=int(counts[i])) for i, n in enumerate(names)}
    except (OSError, KeyError, ValueError):
        return None


def _group_indices(labels: np.ndarray, classes: list[int], per_class: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 7919])
    out = []
    for c in classes:
        pool = np.flatnonzero(labels == c)
        if len(pool) == 0:
            raise SensaiError(f"class {c} has no training images")
        out.append(pool if len(pool) <= per_class else rng.choice(pool, per_class, replace=False))
    return np.sort(np.concatenate(out))


# --------------------------------------------------------------------------------------------
# Stage 4: retraining jobs


def _gather(ds: ImageDataset, indices: np.ndarray) -> np.ndarray:
    if isinstance(ds, TensorImages):
        return ds.images[torch.from_numpy(indices)].numpy()
    return torch.cat([x for x, _ in iterate_batches(ds, 256, indices=indices)]).numpy()


def _teacher_logits(layout: Layout, model: nn.Module, train: ImageDataset, spec: DatasetSpec,
                    device: torch.device, needed: np.ndarray) -> np.ndarray:
    """The original model's logits on the training images in ``needed`` (rows of other images
    are NaN); computed once per image and kept in work/ so a resumed run reuses them."""
    want = (len(train), spec.num_classes)
    z = None
    try:
        z = np.load(layout.teacher, allow_pickle=False)
    except (OSError, ValueError):
        pass
    if z is None or z.shape != want or z.dtype != np.float32:
        z = np.full(want, np.nan, dtype=np.float32)
    missing = np.asarray(needed, dtype=np.int64)
    missing = missing[np.isnan(z[missing, 0])]
    if missing.size:
        z[missing] = predict_logits(model, train, spec, device, indices=missing,
                                    progress="retrain: teacher logits").numpy()
        with atomic_path(layout.teacher) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, z, allow_pickle=False)
    return z


def _softmax(z: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)


# --------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate_models(original: nn.Module | None, subnets: list[nn.Module], groups: list[list[int]],
                    dataset: ImageDataset, spec: DatasetSpec, device: torch.device, *,
                    indices: np.ndarray | None = None, batch_size: int | None = None,
                    progress: str | None = "evaluate") -> dict[str, Any]:
    """Top-1 of the original model and of the merged subnets (``merge_outputs``) on ``dataset``.

    Also per group: both top-1s on the group's own images, and each subnet's accuracy at its own
    task ("mine, which one" vs "not mine").
    """
    n_classes = spec.num_classes
    batch_size = batch_size or eval_batch_size(device)
    idx = np.arange(len(dataset)) if indices is None else np.asarray(indices, dtype=np.int64)
    labels = np.asarray(dataset.labels)[idx]
    models = ([original] if original is not None else []) + list(subnets)
    orig_pred, outs = [], [[] for _ in subnets]
    with ExitStack() as stack:
        layout: Callable = lambda x: x
        for m in models:  # every model in the device's fast layout; one for the batch
            m.eval().to(device)
            layout = stack.enter_context(fast_layout(m, device))
        bar = stack.enter_context(tqdm(total=len(idx), desc=progress,
                                       disable=progress is None, unit="img", leave=False))
        for x, _ in iterate_batches(dataset, batch_size, indices=idx):
            x = layout(normalize(x.to(device), spec))
            if original is not None:
                orig_pred.append(original(x).argmax(1).cpu().numpy())
            for j, s in enumerate(subnets):
                outs[j].append(s(x).float().cpu().numpy())
            bar.update(len(x))
    outputs = [np.concatenate(o) for o in outs]
    scores = merge_outputs(outputs, groups, n_classes)
    pred = scores.argmax(1)
    orig = np.concatenate(orig_pred) if original is not None else None
    binary = all(len(g) == 1 for g in groups)
    per_group = []
    for j, (g, out) in enumerate(zip(groups, outputs)):
        mask = np.isin(labels, g)
        if binary:
            target = (labels == g[0]).astype(np.int64)
            own = (out[:, 0] > 0).astype(np.int64)
        else:
            lookup = np.zeros(n_classes, dtype=np.int64)
            lookup[g] = np.arange(1, len(g) + 1)
            target, own = lookup[labels], out.argmax(1)
        recalls = [float((own[target == t] == t).mean()) for t in np.unique(target)]
        per_group.append({
            "group": j, "classes": list(g), "class_names": [spec.classes[c] for c in g],
            "images": int(mask.sum()),
            "decomposed_top1": float((pred[mask] == labels[mask]).mean()) if mask.any() else None,
            "original_top1": (float((orig[mask] == labels[mask]).mean())
                              if orig is not None and mask.any() else None),
            "subnet_top1": float((own == target).mean()),
            "subnet_balanced": float(np.mean(recalls)) if recalls else None,
        })
    result = {"split": "test", "images": int(len(idx)),
              "decomposed_top1": float((pred == labels).mean()) if len(idx) else float("nan"),
              "original_top1": float((orig == labels).mean()) if orig is not None else None,
              "per_group": per_group}
    if result["original_top1"] is not None:
        result["delta_points"] = round(100 * (result["decomposed_top1"] - result["original_top1"]), 3)
    return result


# --------------------------------------------------------------------------------------------
# The pipeline


@dataclass
class DecomposeRun:
    """What every stage of one decomposition reads: the source model and its data, the settings,
    and where the stages leave their results."""

    layout: Layout
    stages: Stages
    config: DecomposeConfig
    model_dir: Path
    model: nn.Module
    record: ModelRecord
    spec: DatasetSpec
    n_groups: int
    device: str  # as asked: "auto" lets Ray choose each retraining task's GPU
    dev: torch.device
    trust_code: bool
    policy: PruningPolicy
    schedule: list[PruningPolicy]
    retrain_settings: RetrainSettings
    workers: int
    on_ray: bool
    example: torch.Tensor
    orig_params: int
    orig_flops: int
    train: ImageDataset | None = None

    def train_set(self) -> ImageDataset:
        # Read on first use: a re-run whose stages are all done never needs it.
        if self.train is None:
            self.train = load_split(self.spec, "train")
        return self.train


def decompose(model_dir: str | Path, out_dir: str | Path, *, groups: int,
              config: DecomposeConfig = DecomposeConfig(), device: str = "auto",
              data_dir: str | None = None, workers: int | None = None, use_ray: bool = True,
              force: bool = False, eval_limit: int | None = None,
              retrain_fn: Callable | None = None,
              ray_address: str | None = None,
              trust_code: bool = False, compile_: bool = False,
              capture: bool = True) -> DecompositionManifest:
    """Decompose the model saved in ``model_dir`` into ``groups`` subnets written to ``out_dir``.

    ``device``: "auto", "cpu", "cuda" or "cuda:N" (retraining on Ray: a GPU per task when the
    cluster has GPUs, chosen by Ray, or a share of one when more tasks run at once than there are
    GPUs).  ``workers``: subnets retrained at the same time (default: on GPUs every subnet, else
    one per CPU core).  ``use_ray=False`` retrains in this process: on a GPU ``workers`` at once
    (a thread and a CUDA stream each), on the CPU one after another, as does a machine without
    Ray; ``ray_address`` names a Ray cluster to retrain on
    (default: ``RAY_ADDRESS``, else a local instance).  ``trust_code``: the model may be a
    ``package.module:factory`` to import (the operator's consent).  ``eval_limit`` evaluates on
    a stratified subset of the test split.  ``retrain_fn`` replaces
    :func:`pruning.retrain.retrain_state` for in-process runs (same signature), e.g. for a custom
    training loop.  ``compile_`` runs each retraining step through ``torch.compile`` (how the
    subnets are trained, not what they learn: not one of the artifact's settings); ``capture``
    replays each full batch's retraining step from a captured CUDA graph on CUDA (the same).
    Raises :class:`SensaiError` for bad input before any long work, and :class:`RetrainFailed`
    (after saving every other subnet) when some subnets could not be retrained.
    """
    t_start = time.perf_counter()
    # ---- validation, all before any long work
    config = config.validate()
    dev = select_device(str(device))
    if workers is not None and workers < 1:
        raise SensaiError(f"retrain_jobs must be at least 1, got {workers}")
    if eval_limit is not None and eval_limit < 1:
        raise SensaiError(f"eval_limit must be at least 1, got {eval_limit}")
    on_ray = (use_ray and retrain_fn is None and config.retrain_epochs > 0
              and ray_or_in_process(ray_address))
    run = open_run(Path(model_dir), out_dir, groups, config, device=device, dev=dev,
                   data_dir=data_dir, workers=workers, on_ray=on_ray, force=force,
                   trust_code=trust_code, compile_=compile_, capture=capture)

    t0 = time.perf_counter()
    group_list, grouping_method, did = stage_grouping(run.layout, run.model, run.spec,
                                                      run.train_set, run.n_groups, config, dev)
    run.stages.run("grouping", time.perf_counter() - t0, did)
    binary = all(len(g) == 1 for g in group_list)
    log.info("groups: %s", "; ".join(",".join(run.spec.classes[c] for c in g) for g in group_list))
    layers, stats = stage_stats(run, group_list)
    pruned_meta = stage_prune(run, group_list, layers, stats, binary)
    stage_retrain(run, group_list, pruned_meta, binary, retrain_fn, ray_address)
    subnets, export_meta, test = stage_export(run, pruned_meta)
    evaluation = stage_evaluate(run, subnets, group_list, export_meta, test, eval_limit)
    write_artifact(run, group_list, grouping_method, len(layers), pruned_meta, export_meta,
                   evaluation)
    log.info("decomposition done in %.1f s: %s", time.perf_counter() - t_start, run.layout.root)
    return load_manifest(run.layout.root)


def open_run(model_dir: Path, out_dir: str | Path, groups: int, config: DecomposeConfig, *,
             device: str, dev: torch.device, data_dir: str | None, workers: int | None,
             on_ray: bool, force: bool, trust_code: bool, compile_: bool,
             capture: bool) -> DecomposeRun:
    """Load the source model, check ``groups`` and its data against it, and take ``out_dir``
    (refused when it holds a decomposition made with other settings, unless ``force``)."""
    model, record = load_trained_model(model_dir, trust_code=trust_code)
    n_groups = _check_groups(groups, record.num_classes)
    spec = _resolve_spec(record, data_dir)
    policy = config.pruning_policy()
    schedule = step_policies(policy, config.prune_steps)  # [policy] unless iterative
    trained_flip = record.train.flip if record.train is not None else True
    retrain_settings = replace(config.retrain_settings(n_groups), compile=compile_,
                               capture=capture,
                               flip=trained_flip if config.flip is None else config.flip)
    layout = Layout(out_dir)
    fingerprint = {"model": record.model, "source_sha256": record.weights_sha256,
                   "dataset": spec.name, "classes": list(spec.classes), "groups": n_groups,
                   "config": config.to_dict()}
    prepare_out(layout, fingerprint, force, {**DecomposeConfig().to_dict(), **RECORDED_BEFORE})
    if workers is None:
        # On GPUs every subnet at once (several share a GPU: one small subnet leaves it idle
        # most of the time); on CPUs one per core.
        workers = (max(torch.cuda.device_count(), n_groups) if dev.type == "cuda"
                   else usable_cores()) or 1
    return DecomposeRun(
        layout=layout, stages=Stages(layout.stages), config=config, model_dir=model_dir,
        model=model, record=record, spec=spec, n_groups=n_groups, device=device, dev=dev,
        trust_code=trust_code, policy=policy, schedule=schedule,
        retrain_settings=retrain_settings, workers=workers, on_ray=on_ray,
        example=torch.zeros(1, *spec.input_shape), orig_params=count_params(model),
        orig_flops=count_flops(model, spec.input_shape))


def stage_stats(run: DecomposeRun, group_list: list[list[int]]) -> tuple[list, dict[int, dict]]:
    """The prunable layers, and their activation statistics on each group's own training images."""
    t0 = time.perf_counter()
    config = run.config
    layers = find_prunable(run.model, run.example, residual=config.prune_residual)
    if not layers:
        raise SensaiError(
            f"{run.record.model} has no prunable conv -> ReLU layers: the channels pruned are a "
            "convolution's whose output goes through an nn.ReLU module used once (F.relu, ReLU6 "
            "and SiLU are not seen) to the next convolution, not into an element-wise product "
            "(squeeze-excitation)")
    relus = sorted({r for layer in layers for r in layer.relus})
    stats: dict[int, dict] = {}
    did = False
    for g, classes in enumerate(tqdm(group_list, desc="stats: groups", unit="group")):
        s = _load_stats(run.layout.stats(g))
        if s is None or set(s) != set(relus):
            idx = _group_indices(run.train_set().labels, classes, config.stats_per_class,
                                 config.seed)
            s = collect_stats(run.model, run.train_set(), run.spec, run.dev, idx,
                              config.zero_threshold, relus, progress=f"stats group {g:02d}")
            _save_stats(run.layout.stats(g), s)
            did = True
        stats[g] = s
    run.stages.run("stats", time.perf_counter() - t0, did)
    return layers, stats


def stage_prune(run: DecomposeRun, group_list: list[list[int]], layers: list,
                stats: dict[int, dict], binary: bool) -> dict[int, dict]:
    """Per group, the pruned subnet with its new head; returns each one's record."""
    t0 = time.perf_counter()
    layout, spec = run.layout, run.spec
    did = False
    pruned_meta: dict[int, dict] = {}
    for g, classes in enumerate(tqdm(group_list, desc="prune: subnets", unit="subnet")):
        meta = read_json(layout.pruned_meta(g))
        if not (meta and meta.get("classes") == classes and meta.get("stats_sha256") ==
                sha256_file(layout.stats(g)) and
                file_ok(layout.pruned(g), meta.get("weights_sha256"))):
            pruned, keep = prune_to_policy(copy.deepcopy(run.model), layers, stats[g],
                                           run.schedule[0], run.example)
            sub = make_head(pruned, classes, binary=binary, seed=run.config.seed + g)
            sha = save_weights(layout.pruned(g), sub)
            meta = {"classes": classes, "head": "binary" if binary else "group",
                    "num_outputs": 1 if binary else len(classes) + 1, "weights_sha256": sha,
                    "stats_sha256": sha256_file(layout.stats(g)),
                    "keep": {k: [int(i) for i in v] for k, v in keep.items()},
                    "widths": {k: int(v) for k, v in layer_widths(sub).items()},
                    "params": count_params(sub), "flops": count_flops(sub, spec.input_shape)}
            write_json_atomic(layout.pruned_meta(g), meta)
            did = True
        pruned_meta[g] = meta
    run.stages.run("prune", time.perf_counter() - t0, did)
    return pruned_meta


@dataclass
class Retraining:
    """The retraining stage's state: the subnets still to retrain, what each trains on, and the
    ones that failed."""

    run: DecomposeRun
    group_list: list[list[int]]
    pruned_meta: dict[int, dict]
    binary: bool
    todo: list[int]
    plans: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    teacher: np.ndarray | None = None
    failures: dict[int, str] = field(default_factory=dict)

    def plan(self) -> None:
        """Each subnet's balanced plan, and the original's logits on the images the plans use
        when they are distilled from."""
        run, config = self.run, self.run.config
        confusion = None
        if self.todo and config.retrain_epochs > 0 and config.hard_negatives > 0:
            # Hard negatives are picked by the original model's beliefs about a stratified pool
            # of training images as large as one subnet's epoch (all of them for the default
            # budgets), so asking the teacher costs no more than one subnet's retraining pass.
            pool = stratified_subset(run.train_set().labels, run.retrain_settings.samples,
                                     config.seed)
            confusion = _softmax(self.teacher_logits(pool))  # NaN rows (not in the pool) stay NaN
        self.plans = {g: retrain_plan(run.train_set().labels, self.group_list[g],
                                      run.retrain_settings, binary=self.binary, subnet_seed=g,
                                      confusion=None if confusion is None else
                                      confusion[:, self.group_list[g]].sum(axis=1))
                      for g in self.todo} if config.retrain_epochs > 0 else {}
        if self.plans and config.distill > 0:
            # The hard-negative pool need not cover every positive, so fill in what the plans use.
            needed = np.unique(np.concatenate([idx for idx, _ in self.plans.values()]))
            self.teacher = self.teacher_logits(needed)

    def teacher_logits(self, needed: np.ndarray) -> np.ndarray:
        run = self.run
        return _teacher_logits(run.layout, run.model, run.train_set(), run.spec, run.dev, needed)

    def later_steps(self) -> dict:
        """What an iterative schedule's retraining job needs to prune further on its own."""
        run, config = self.run, self.run.config
        if len(run.schedule) == 1:
            return {}
        return {"schedule": [p.to_dict() for p in run.schedule[1:]],
                "prune": {"reference": [run.orig_params, run.orig_flops],
                          "residual": config.prune_residual,
                          "zero_threshold": config.zero_threshold,
                          "stats_images": config.stats_per_class * max(len(c) for c in
                                                                       self.group_list)}}

    def jobs(self) -> Iterator[dict]:
        run, later_steps = self.run, self.later_steps()
        for g in self.todo:
            state = load_weights(run.layout.pruned(g), self.pruned_meta[g]["weights_sha256"])
            idx, targets = self.plans.pop(g)
            uniq, positions = np.unique(idx, return_inverse=True)
            soft = (soft_targets(self.teacher[uniq], self.group_list[g], binary=self.binary,
                                 temperature=run.config.distill_temperature)
                    if self.teacher is not None else None)
            yield {"index": g, "soft": soft, "arch": run.record.model,
                   "num_outputs": self.pruned_meta[g]["num_outputs"],
                   "in_channels": run.record.in_channels, "state": state,
                   "trust_code": run.trust_code,
                   "images": _gather(run.train_set(), uniq),
                   "positions": positions.astype(np.int64),
                   "targets": targets, "spec": run.spec.to_dict(),
                   "settings": run.retrain_settings.to_dict(), "binary": self.binary, **later_steps}

    def on_done(self, g: int, state: dict, metrics: dict) -> None:
        run = self.run
        sub = build_from_weights(run.record.model, self.pruned_meta[g]["num_outputs"],
                                 run.record.in_channels, state, f"retrained subnet {g}",
                                 trust_code=run.trust_code)
        sha = save_weights(run.layout.root / run.layout.weights_rel(g), sub)
        # An iterative schedule prunes during retraining: the size is the retrained subnet's.
        write_json_atomic(run.layout.retrain_meta(g), {
            "from_sha256": self.pruned_meta[g]["weights_sha256"], "weights_sha256": sha,
            "metrics": metrics, "widths": {k: int(v) for k, v in layer_widths(sub).items()},
            "params": count_params(sub), "flops": count_flops(sub, run.spec.input_shape)})

    def launch(self, retrain_fn: Callable | None, ray_address: str | None) -> None:
        run, todo = self.run, self.todo
        if run.config.retrain_epochs == 0:
            for g in todo:  # no retraining asked for: the pruned subnet is the result
                self.on_done(g, load_weights(run.layout.pruned(g),
                                             self.pruned_meta[g]["weights_sha256"]),
                             {"samples": 0, "seconds": 0.0})
            return
        at_once = min(run.workers, len(todo))
        where = f"{at_once} Ray workers" if run.on_ray else "in process"
        images = sum(len(idx) for idx, _ in self.plans.values())
        with RetrainProgress(len(todo), images, f"retrain {len(todo)} subnets ({where})") as bar:
            if run.on_ray:
                run_on_ray(self.jobs(), at_once, str(run.dev) if run.device != "auto" else "auto",
                           bar, self.on_done, self.failures, ray_address)
            else:
                run_in_process(self.jobs(), retrain_fn or retrain_state, str(run.dev), bar,
                               self.on_done, self.failures,
                               at_once=at_once if run.dev.type == "cuda" else 1)


def retrain_todo(run: DecomposeRun, pruned_meta: dict[int, dict]) -> list[int]:
    """The subnets with no retrained weights from their current pruned weights."""
    layout, todo = run.layout, []
    for g in range(run.n_groups):
        meta = read_json(layout.retrain_meta(g))
        if not (meta and meta.get("from_sha256") == pruned_meta[g]["weights_sha256"] and
                file_ok(layout.root / layout.weights_rel(g), meta.get("weights_sha256"))):
            todo.append(g)
    return todo


def stage_retrain(run: DecomposeRun, group_list: list[list[int]], pruned_meta: dict[int, dict],
                  binary: bool, retrain_fn: Callable | None, ray_address: str | None) -> None:
    """Retrain every subnet not yet retrained, each saved as soon as it is back; raises
    :class:`RetrainFailed` after all the others are saved when some could not be retrained."""
    t0 = time.perf_counter()
    retraining = Retraining(run, group_list, pruned_meta, binary, retrain_todo(run, pruned_meta))
    retraining.plan()
    if retraining.todo:
        retraining.launch(retrain_fn, ray_address)
    failures = retraining.failures
    run.stages.run("retrain", time.perf_counter() - t0, bool(retraining.todo), done=not failures)
    if failures:
        done = run.n_groups - len(failures)
        detail = "; ".join(f"subnet {g} (classes {group_list[g]}): {why}"
                           for g, why in sorted(failures.items()))
        saved_in = run.layout.root / "subnets"
        raise RetrainFailed(f"retraining failed for {len(failures)} of {run.n_groups} subnets - "
                            f"{detail}. The other {done} are saved in {saved_in}; re-run the same "
                            "command to retrain only the missing ones", failures)


def stage_export(run: DecomposeRun, pruned_meta: dict[int, dict]
                 ) -> tuple[list[nn.Module], dict[int, dict], ImageDataset]:
    """ONNX per subnet, checked against torch on real test images; returns the retrained subnets,
    each one's export record and the test split."""
    t0 = time.perf_counter()
    layout, config, spec, record = run.layout, run.config, run.spec, run.record
    did = False
    test = load_split(spec, "test")
    check_idx = stratified_subset(test.labels, CHECK_IMAGES, config.seed)
    check_batch = normalize(torch.from_numpy(_gather(test, check_idx)), spec)
    subnets: list[nn.Module] = []
    export_meta: dict[int, dict] = {}
    for g in tqdm(range(run.n_groups), desc="export: ONNX", unit="subnet"):
        w_sha = read_json(layout.retrain_meta(g))["weights_sha256"]
        sub = build_from_weights(record.model, pruned_meta[g]["num_outputs"], record.in_channels,
                                 load_weights(layout.root / layout.weights_rel(g), w_sha),
                                 f"subnet {g}", trust_code=run.trust_code)
        subnets.append(sub)
        meta = read_json(layout.export_meta(g))
        if not (meta and meta.get("weights_sha256") == w_sha and meta.get("opset") == config.opset
                and file_ok(layout.root / layout.onnx_rel(g), meta.get("onnx_sha256"))):
            err = export_onnx(sub, spec.input_shape, layout.root / layout.onnx_rel(g),
                              opset=config.opset, check_batch=check_batch)
            meta = {"weights_sha256": w_sha, "opset": config.opset, "max_abs_diff": err,
                    "onnx_sha256": sha256_file(layout.root / layout.onnx_rel(g))}
            write_json_atomic(layout.export_meta(g), meta)
            did = True
        export_meta[g] = meta
    run.stages.run("export", time.perf_counter() - t0, did)
    return subnets, export_meta, test


def stage_evaluate(run: DecomposeRun, subnets: list[nn.Module], group_list: list[list[int]],
                   export_meta: dict[int, dict], test: ImageDataset,
                   eval_limit: int | None) -> dict[str, Any]:
    """Original vs merged top-1 on the test split (``eval_limit``: a stratified subset)."""
    t0 = time.perf_counter()
    weight_shas = [export_meta[g]["weights_sha256"] for g in range(run.n_groups)]
    evaluation = read_json(run.layout.evaluation)
    did = False
    if not (evaluation and evaluation.get("limit") == eval_limit and
            evaluation.get("weights_sha256") == weight_shas):
        idx = stratified_subset(test.labels, eval_limit, run.config.seed) if eval_limit else None
        evaluation = evaluate_models(run.model, subnets, group_list, test, run.spec, run.dev,
                                     indices=idx)
        evaluation.update(limit=eval_limit, weights_sha256=weight_shas)
        write_json_atomic(run.layout.evaluation, evaluation)
        did = True
    run.stages.run("evaluate", time.perf_counter() - t0, did)
    return evaluation


def subnet_records(run: DecomposeRun, group_list: list[list[int]], pruned_meta: dict[int, dict],
                   export_meta: dict[int, dict], evaluation: dict[str, Any]) -> list[SubnetRecord]:
    layout, records = run.layout, []
    for g, classes in enumerate(group_list):
        pg = evaluation["per_group"][g]
        accuracy = {k: pg[k] for k in ("decomposed_top1", "original_top1", "subnet_top1",
                                       "subnet_balanced") if pg.get(k) is not None}
        meta = {**pruned_meta[g], **read_json(layout.retrain_meta(g))}
        records.append(SubnetRecord(
            index=g, classes=classes, head=meta["head"], num_outputs=meta["num_outputs"],
            weights=layout.weights_rel(g), weights_sha256=export_meta[g]["weights_sha256"],
            onnx=layout.onnx_rel(g), onnx_sha256=export_meta[g]["onnx_sha256"],
            widths=meta["widths"], params=meta["params"], flops=meta["flops"], accuracy=accuracy))
    return records


def write_artifact(run: DecomposeRun, group_list: list[list[int]], grouping_method: dict,
                   prunable_layers: int, pruned_meta: dict[int, dict],
                   export_meta: dict[int, dict], evaluation: dict[str, Any]) -> None:
    """``manifest.json`` and the report, the last stage: an artifact with a manifest is whole."""
    t0 = time.perf_counter()
    layout, config, record = run.layout, run.config, run.record
    records = subnet_records(run, group_list, pruned_meta, export_meta, evaluation)
    retrain_info = {**run.retrain_settings.to_dict(), "workers": run.workers, "ray": run.on_ray,
                    "balance": "k+1 target classes with equal samples; positives repeated",
                    "subnets": {str(g): (read_json(layout.retrain_meta(g)) or {}).get("metrics", {})
                                for g in range(run.n_groups)}}
    manifest = DecompositionManifest(
        model=record.model, in_channels=record.in_channels, num_classes=record.num_classes,
        dataset=DatasetInfo.from_spec(run.spec),
        source=SourceInfo(model=record.model, model_dir=str(run.model_dir.resolve()),
                          weights_sha256=record.weights_sha256, params=run.orig_params,
                          flops=run.orig_flops, test_top1=record.test_top1),
        groups=group_list,
        grouping={**grouping_method, "features_per_class": config.features_per_class},
        pruning={**run.policy.to_dict(), "zero_threshold": config.zero_threshold,
                 "stats_per_class": config.stats_per_class, "prunable_layers": prunable_layers,
                 "steps": config.prune_steps,
                 "prune_residual": config.prune_residual},
        retrain=retrain_info,
        subnets=records,
        evaluation={k: v for k, v in evaluation.items() if k != "weights_sha256"},
    )
    run.stages.run("artifact", time.perf_counter() - t0, True)
    manifest = DecompositionManifest.model_validate(
        {**manifest.model_dump(mode="json"), "stages": run.stages.data})
    save_manifest(layout.root, manifest)
    write_report(layout.root, manifest, run.stages.seconds())


def collect_stats(model, dataset, spec, device, indices, zero_threshold, relus, progress=None):

    return collect_activation_stats(model, dataset, spec, device, indices=indices,
                                    zero_threshold=zero_threshold, modules=relus, progress=progress)


# --------------------------------------------------------------------------------------------
# Reading an artifact back


def evaluate_artifact(artifact_dir: str | Path, *, device: str = "auto", limit: int | None = None,
                      data_dir: str | None = None, seed: int = 0,
                      trust_code: bool = False) -> dict[str, Any]:
    """Original vs merged decomposed top-1 on the test split (``limit``: stratified subset).

    The original model is taken from the directory the manifest names; when it is gone (or its
    weights changed) only the decomposed accuracy is measured and the recorded original top-1 is
    reported beside it.
    """
    if limit is not None and limit < 1:
        raise SensaiError(f"--limit must be at least 1, got {limit}")
    dev = select_device(str(device))
    artifact = load_artifact(artifact_dir)
    manifest, subnets = artifact.manifest, artifact.load_subnets(dev, trust_code=trust_code)
    spec = manifest.dataset.to_spec()
    if data_dir is not None:
        spec = spec.with_data_dir(data_dir)
    resolve_dataset(spec.name, spec.data_dir, spec.input_shape[1])
    original, note = None, None
    try:
        original, rec = load_trained_model(manifest.source.model_dir, trust_code=trust_code)
        if rec.weights_sha256 != manifest.source.weights_sha256:
            original, note = None, "original weights changed since the decomposition"
    except CheckpointError as e:
        note = f"original model unavailable ({e})"
    test = load_split(spec, "test")
    idx = stratified_subset(test.labels, limit, seed) if limit else None
    result = evaluate_models(original, subnets, manifest.groups, test, spec, dev, indices=idx)
    if original is None:
        result["original_top1_recorded"] = manifest.source.test_top1
        result["note"] = note
    result["limit"] = limit
    result["params"] = {"original": manifest.source.params,
                        "subnets": [s.params for s in manifest.subnets]}
    return result

"""The iterative prune -> retrain schedule (``prune_steps``), from its budgets to an artifact."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from sensai.checkpoint import load_trained_model
from sensai.flops import count_flops
from sensai.models import count_params
from sensai.pruning.apoz import collect_activation_stats
from sensai.pruning.iterative import group_images, prune_further, step_policies
from sensai.pruning.prune import (PruningPolicy, find_prunable, layer_widths, make_head,
                                  prune_to_policy)

X1 = torch.zeros(1, 1, 28, 28)


def _size(model):
    return count_params(model), count_flops(model, (1, 28, 28))


def test_step_policies_remove_the_same_ratio_and_end_on_the_budget():
    final = PruningPolicy("shrink", shrink=10, allocation="apoz")
    steps = step_policies(final, 3)
    assert steps[-1] == final
    assert [round(p.shrink, 4) for p in steps] == [2.1544, 4.6416, 10]
    assert all(p.allocation == "apoz" and p.kind == "shrink" for p in steps)
    frac = step_policies(PruningPolicy("params", params_fraction=0.04), 2)
    assert [round(p.params_fraction, 6) for p in frac] == [0.2, 0.04]
    assert step_policies(PruningPolicy("keep", keep_fraction=0.3), 1) == [PruningPolicy("keep", keep_fraction=0.3)]
    with pytest.raises(ValueError, match="needs a size budget"):
        step_policies(PruningPolicy("keep", keep_fraction=0.3), 2)
    for bad in (0, 11, 2.0, True):
        with pytest.raises(ValueError, match="from 1 to 10"):
            step_policies(final, bad)


def test_group_images_are_the_groups_own_and_bounded():
    positions = np.array([0, 1, 2, 3, 1, 4, 5, 1])
    targets = np.array([0, 2, 0, 1, 2, 0, 1, 2])
    assert list(group_images(positions, targets, 10, seed=0)) == [1, 3, 5]
    few = group_images(positions, targets, 2, seed=0)
    assert len(few) == 2 and set(few) <= {1, 3, 5}


def test_a_later_step_ranks_channels_on_the_retrained_subnet(trained_model_dir, fmnist_spec,
                                                             fmnist_train):
    """prune_further ranks on the subnet it is given, so what retraining changed is what counts:
    a channel silenced after the first step goes, one made the most active stays."""
    original, _ = load_trained_model(trained_model_dir)
    reference = _size(original)
    classes = [0, 6]
    idx = np.flatnonzero(np.isin(fmnist_train.labels, classes))[:200]
    layers = find_prunable(original, X1)
    stats = collect_activation_stats(original, fmnist_train, fmnist_spec, torch.device("cpu"),
                                     indices=idx, modules=sorted(r for l in layers for r in l.relus))
    first, _ = prune_to_policy(copy.deepcopy(original), layers, stats,
                               PruningPolicy("shrink", shrink=math.sqrt(10)), X1)
    sub = make_head(first, classes, binary=False)
    bn = sub.features[15]  # the last conv's batch norm
    width = bn.num_features
    with torch.no_grad():  # what "retraining" did: channel 0 dies, the last one fires for all
        bn.bias[0] = -100.0
        bn.weight[width - 1], bn.bias[width - 1] = 0.0, 50.0
    images = fmnist_train.images[idx]
    pruned = prune_further(sub, images, np.arange(len(idx)), fmnist_spec, torch.device("cpu"),
                           PruningPolicy("shrink", shrink=10), reference, residual=False,
                           zero_threshold=0.005)
    params, macs = _size(pruned)
    assert reference[0] / params >= 10 and reference[1] / macs >= 10
    assert _size(sub)[0] > params  # it pruned further, on a copy
    kept = pruned.features[15].bias.detach()
    assert len(kept) < width
    assert -100.0 not in kept.tolist() and 50.0 in kept.tolist()
    assert pruned(torch.zeros(2, 1, 28, 28)).shape == (2, 3)


@pytest.mark.slow
def test_iterative_decomposition_end_to_end(trained_model_dir, tmp_path):
    """Two steps at the default budget: the artifact meets the one-shot budget, its manifest
    describes the weights it holds, the steps are recorded, and a re-run does no work."""
    from sensai.artifact import load_artifact
    from sensai.pruning.decompose import DecomposeConfig, decompose

    cfg = DecomposeConfig(use_tsne=False, features_per_class=20, stats_per_class=40,
                          samples_per_subnet=512, batch_size=64, prune_steps=2)
    out = tmp_path / "art"
    m = decompose(trained_model_dir, out, groups=2, config=cfg, device="cpu", use_ray=False,
                  eval_limit=500)
    assert m.pruning["steps"] == 2 and m.pruning["shrink"] == 10
    subnets = load_artifact(out).load_subnets()
    for s, net in zip(m.subnets, subnets):
        assert m.source.params / s.params >= 10 and m.source.flops / s.flops >= 10
        # The manifest describes the twice-pruned weights, not the first step's.
        assert (s.params, s.flops) == _size(net) and s.widths == layer_widths(net)
        first = json.loads((out / "work" / "pruned" / f"subnet_{s.index:02d}.json").read_text())
        assert first["params"] > s.params and m.source.params / first["params"] < 10
        steps = m.retrain["subnets"][str(s.index)]["schedule"]
        # The plan (512 balanced images, rounded to 6 equal targets) split in two equal halves.
        assert [st["samples"] for st in steps] == [255, 255]
        assert steps[0]["params"] == first["params"] and steps[1]["params"] == s.params
    assert m.evaluation["decomposed_top1"] > 0.25  # chance is 0.1; 512 images retrain little
    assert "reached in 2 prune -> retrain steps" in (out / "report.md").read_text()

    stages = json.loads((out / "work" / "stages.json").read_text())
    again = decompose(trained_model_dir, out, groups=2, config=cfg, device="cpu", use_ray=False,
                      eval_limit=500)
    assert [s.weights_sha256 for s in again.subnets] == [s.weights_sha256 for s in m.subnets]
    assert json.loads((out / "work" / "stages.json").read_text())["retrain"] == stages["retrain"]

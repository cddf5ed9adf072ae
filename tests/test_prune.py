"""Structured pruning on every registry architecture, policies, heads and FLOP counting."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from sensai.checkpoint import build_from_weights
from sensai.errors import SensaiError
from sensai.flops import count_flops
from sensai.models import classifier_layer, count_params, create_model, list_models
from sensai.pruning.apoz import ChannelStats
from sensai.pruning.prune import (PrunableLayer, PruningPolicy, channel_ranking, find_prunable,
                                  layer_widths, make_head, prune_model, prune_to_policy,
                                  select_channels)

X1 = torch.zeros(1, 1, 28, 28)
SLOW = {"resnet110", "resnet164", "mobilenet_v2", "resnet18", "vgg19_bn"}
MODELS = [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in list_models()]


def _random_model(name: str) -> nn.Module:
    """A registry model with non-trivial batch-norm statistics, so channels differ."""
    torch.manual_seed(0)
    model = create_model(name, 10, 1)
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(c, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(c, generator=gen) * 0.1)
    return model.eval()


def _random_stats(layers, seed=0):
    rng = np.random.default_rng(seed)
    return {r: ChannelStats(rng.random(l.channels), rng.random(l.channels), 100)
            for l in layers for r in l.relus}


@pytest.mark.parametrize("name", MODELS)
def test_prune_every_architecture(name):
    model = _random_model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = find_prunable(model, X1)
    assert layers, f"{name}: nothing prunable"
    modules = dict(model.named_modules())
    head_name, _ = classifier_layer(model)
    for l in layers:
        assert isinstance(modules[l.conv], nn.Conv2d) and isinstance(modules[l.relu], nn.ReLU)
        assert modules[l.conv].out_channels == l.channels
        assert modules[l.conv].groups == 1  # never a depthwise root
        assert l.conv != head_name
    names = {l.conv for l in layers}
    if name.startswith("resnet"):
        last = "conv3" if name == "resnet164" else "conv2"
        assert not any(n.endswith(last) or "shortcut" in n or "downsample" in n for n in names)
        if name != "resnet164":  # its first block has a projection shortcut, so its stem is free
            assert not {"conv1", "net.conv1"} & names
        assert all(n.endswith("conv1") or n.endswith("conv2") for n in names - {"conv1"})
    if name == "mobilenet_v2":
        # expansion convs yes (with their depthwise conv), linear projections never
        assert "features.2.conv.0.0" in names and "features.1.conv.1" not in names
        assert not any(n.endswith("conv.2") for n in names)
    if name.startswith("vgg") or name == "fmnist_cnn":
        assert len(layers) == sum(isinstance(m, nn.Conv2d) for m in model.modules())

    # Keep half the channels, chosen at random: the pruned net must equal the original with those
    # channels silenced at their ReLU — this checks channel bookkeeping and the ReLU mapping.
    stats = _random_stats(layers)
    pruned, keep = prune_to_policy(model, layers, stats, PruningPolicy("keep", keep_fraction=0.5), X1)
    assert set(keep) == names
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    handles = []
    for l in layers:
        drop = torch.from_numpy(np.setdiff1d(np.arange(l.channels), keep[l.conv]))

        def silence(mod, inp, out, drop=drop):
            out[:, drop] = 0
            return out

        handles.append(modules[l.relu].register_forward_hook(silence))
    with torch.no_grad():
        ref = model(x)
        for h in handles:
            h.remove()
        out = pruned.eval()(x)
    assert out.shape == (3, 10)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    assert count_params(pruned) < count_params(model)
    assert count_flops(pruned, (1, 28, 28)) < count_flops(model, (1, 28, 28))
    widths = layer_widths(pruned)
    assert min(widths.values()) >= 1
    for l in layers:
        assert widths[l.conv] == math.ceil(0.5 * l.channels) == len(keep[l.conv])
    # The original is untouched.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # Round trip through the safetensors path: same network from the state dict alone.
    rebuilt = build_from_weights(name, 10, 1, pruned.state_dict(), "pruned test weights")
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), out, rtol=0, atol=1e-6)


def test_find_prunable_restores_mode_and_hooks():
    model = create_model("resnet20", 10, 1).train()
    find_prunable(model, X1)
    assert all(m.training for m in model.modules())
    assert all(not m._forward_hooks for m in model.modules())


def _layer(n=6):
    return [PrunableLayer("c", "r", n)]


def test_threshold_policy_picks_expected_channels():
    apoz = np.array([0.9, 0.8, 0.5, 0.73, 0.95, 0.1])
    mean = np.array([0.001, 0.02, 0.0, 0.005, 0.009, 0.3])
    stats = {"r": ChannelStats(apoz, mean, 10)}
    # drop: apoz >= 0.73 and mean |a| < 0.01 -> channels 0, 3 (boundary is inclusive), 4
    keep = select_channels(_layer(), stats, PruningPolicy("threshold"))
    assert keep["c"].tolist() == [1, 2, 5]
    keep = select_channels(_layer(), stats, PruningPolicy("threshold", theta1=0.85, theta2=0.002))
    assert keep["c"].tolist() == [1, 2, 3, 4, 5]
    # Everything would go: min_channels keeps the best-ranked ones (lowest APoZ).
    all_dead = {"r": ChannelStats(np.array([0.99, 0.9, 0.95, 1.0, 0.97, 0.91]), np.zeros(6), 10)}
    keep = select_channels(_layer(), all_dead, PruningPolicy("threshold", min_channels=3))
    assert keep["c"].tolist() == [1, 2, 5]


def test_keep_policy_ranking_and_ties():
    apoz = np.array([0.5, 0.2, 0.5, 0.9, 0.2, 0.5])
    mean = np.array([0.1, 0.1, 0.3, 0.0, 0.4, 0.2])
    stats = {"r": ChannelStats(apoz, mean, 10)}
    keep = select_channels(_layer(), stats, PruningPolicy("keep", keep_fraction=0.5))
    assert keep["c"].tolist() == [1, 2, 4]           # apoz 0.2, 0.2, then 0.5 with highest mean
    keep = select_channels(_layer(), stats, PruningPolicy("keep", keep_fraction=0.1))
    assert keep["c"].tolist() == [1, 4]              # ceil(0.6) = 1, raised to min_channels 2
    keep = select_channels(_layer(10), {"r": ChannelStats(np.zeros(10), np.zeros(10), 1)},
                           PruningPolicy("keep", keep_fraction=0.3))
    assert len(keep["c"]) == 3                        # 0.3 * 10 is 3, not 4
    with pytest.raises(ValueError, match="no activation statistics"):
        select_channels(_layer(), {}, PruningPolicy())
    with pytest.raises(ValueError, match="have 6 channels"):
        select_channels(_layer(8), stats, PruningPolicy())
    with pytest.raises(ValueError, match="budget search"):
        select_channels(_layer(), stats, PruningPolicy("params", params_fraction=0.5))


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "magic"}, "kind"), ({"theta1": 1.5}, "theta1"), ({"theta2": -0.1}, "theta2"),
    ({"keep_fraction": 0.0}, "keep_fraction"), ({"keep_fraction": 1.2}, "keep_fraction"),
    ({"kind": "params"}, "params_fraction"), ({"kind": "params", "params_fraction": 0.0}, "params_fraction"),
    ({"min_channels": 0}, "min_channels"),
])
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PruningPolicy(**kwargs)


def test_policy_to_dict_round_trip():
    import json

    p = PruningPolicy("params", params_fraction=0.2, min_channels=4)
    d = p.to_dict()
    json.dumps(d)
    assert d["kind"] == "params" and d["params_fraction"] == 0.2
    assert PruningPolicy.from_dict(d) == p


def test_params_policy_meets_budget():
    model = _random_model("fmnist_cnn")
    layers = find_prunable(model, X1)
    stats = _random_stats(layers)
    original = count_params(model)
    for frac in (0.3, 0.6):
        pruned, keep = prune_to_policy(model, layers, stats,
                                       PruningPolicy("params", params_fraction=frac), X1)
        n = count_params(pruned)
        assert n <= frac * original
        # The largest fraction within budget: one more channel per layer would break it.
        bigger = {k: np.arange(min(len(v) + 1, l.channels))
                  for (k, v), l in zip(keep.items(), layers)}
        assert count_params(prune_model(model, bigger, X1)) > frac * original
        assert pruned(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    full, keep = prune_to_policy(model, layers, stats, PruningPolicy("params", params_fraction=1.0), X1)
    assert count_params(full) == original
    assert all(len(v) == l.channels for v, l in zip(keep.values(), layers))


def test_params_policy_unreachable_budget():
    model = _random_model("resnet20")
    layers = find_prunable(model, X1)
    with pytest.raises(SensaiError, match="cannot prune to 0.01 of the parameters"):
        prune_to_policy(model, layers, _random_stats(layers),
                        PruningPolicy("params", params_fraction=0.01), X1)


def test_prune_model_errors():
    model = _random_model("fmnist_cnn")
    with pytest.raises(ValueError, match="not an nn.Conv2d"):
        prune_model(model, {"features.1": np.arange(3)}, X1)
    with pytest.raises(ValueError, match="in \\[0, 32\\)"):
        prune_model(model, {"features.0": np.array([0, 32])}, X1)
    with pytest.raises(ValueError, match="at least one channel"):
        prune_model(model, {"features.0": np.array([], dtype=np.int64)}, X1)
    with pytest.raises(ValueError, match="repeat"):
        prune_model(model, {"features.0": np.array([1, 1])}, X1)
    same = prune_model(model, {"features.0": np.arange(32)}, X1)
    assert same is not model and count_params(same) == count_params(model)


def test_make_head_binary_and_group():
    model = _random_model("fmnist_cnn")
    layers = find_prunable(model, X1)
    pruned, _ = prune_to_policy(model, layers, _random_stats(layers), PruningPolicy(), X1)
    _, orig = classifier_layer(pruned)
    w, b = orig.weight.detach().clone(), orig.bias.detach().clone()

    twin = copy.deepcopy(pruned)
    binary = make_head(copy.deepcopy(pruned), [7], binary=True)
    _, head = classifier_layer(binary)
    assert (head.out_features, head.in_features) == (1, orig.in_features)
    torch.testing.assert_close(head.weight[0], w[7], rtol=0, atol=0)
    assert head.bias.item() == b[7].item()
    assert binary(torch.zeros(2, 1, 28, 28)).shape == (2, 1)

    group = make_head(pruned, [2, 4, 6], binary=False, seed=3)
    assert group is pruned
    _, head = classifier_layer(group)
    assert head.out_features == 4 and group.classifier is head
    torch.testing.assert_close(head.weight[1:], w[[2, 4, 6]], rtol=0, atol=0)
    torch.testing.assert_close(head.bias[1:], b[[2, 4, 6]], rtol=0, atol=0)
    assert head.bias[0].item() == 0.0
    assert 0.003 < head.weight[0].std().item() < 0.03
    assert group(torch.zeros(2, 1, 28, 28)).shape == (2, 4)
    again = make_head(twin, [2, 4, 6], binary=False, seed=3)  # the seed fixes row 0
    torch.testing.assert_close(classifier_layer(again)[1].weight[0], head.weight[0])

    for classes, binary_, match in (([], False, "at least one"), ([1, 1], False, "distinct"),
                                    ([10], False, "distinct"), ([1, 2], True, "exactly one")):
        with pytest.raises(ValueError, match=match):
            make_head(model, classes, binary=binary_)


def test_count_flops_fmnist_cnn():
    model = create_model("fmnist_cnn", 10, 1).train()
    expected = (28 * 28 * 32 * 1 * 9 + 28 * 28 * 32 * 32 * 9 + 14 * 14 * 64 * 32 * 9
                + 14 * 14 * 64 * 64 * 9 + 7 * 7 * 128 * 64 * 9 + 128 * 10)
    assert count_flops(model, (1, 28, 28)) == expected
    assert model.training  # mode restored
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match="input_shape"):
        count_flops(model, (28, 28))


# --------------------------------------------------------------------------------------------
# The shrink budget (parameters and MACs) and residual paths


def _size(model):
    return count_params(model), count_flops(model, (1, 28, 28))


def _one_more_fits(model, layers, stats, keep, limit_p, limit_m):
    """Whether some layer could keep one more channel (its next best) and stay within budget."""
    for l in layers:
        n = len(keep[l.conv])
        if n == l.channels:
            continue
        grown = {**keep, l.conv: np.sort(channel_ranking(l, stats)[:n + 1])}
        p, m = _size(prune_model(model, grown, X1))
        if p <= limit_p and m <= limit_m:
            return l.conv
    return None


@pytest.mark.parametrize("name,residual,shrink,allocation", [
    ("fmnist_cnn", False, 10, "uniform"), ("fmnist_cnn", False, 4, "uniform"),
    ("fmnist_cnn", False, 10, "apoz"), ("fmnist_cnn", False, 20, "activity"),
    ("resnet20", False, 10, "uniform"), ("resnet20", True, 10, "uniform"),
    ("resnet20", True, 20, "uniform"), ("resnet20", True, 10, "apoz")])
def test_shrink_budget_met_exactly_on_params_and_macs(name, residual, shrink, allocation):
    model = _random_model(name)
    layers = find_prunable(model, X1, residual=residual)
    stats = _random_stats(layers)
    params, macs = _size(model)
    pruned, keep = prune_to_policy(model, layers, stats,
                                   PruningPolicy("shrink", shrink=shrink, allocation=allocation), X1)
    p, m = _size(pruned)
    assert params / p >= shrink and macs / m >= shrink
    # Exactly: not one more channel fits anywhere.
    assert _one_more_fits(model, layers, stats, keep, params / shrink, macs / shrink) is None
    # No layer is emptied, and the kept channels are the best ranked ones.
    for l in layers:
        assert 2 <= len(keep[l.conv]) <= l.channels
        assert set(keep[l.conv]) == set(channel_ranking(l, stats)[:len(keep[l.conv])])
    assert pruned(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_channel_multiple_widths():
    p = PruningPolicy("shrink", shrink=10, channel_multiple=8)
    # Below the multiple any width; from it on, multiples; all kept stays all; the floor holds.
    assert [p.allowed(n, 64) for n in (1, 2, 7, 8, 15, 16, 63, 64)] == [1, 2, 7, 8, 8, 16, 56, 64]
    assert p.allowed(19, 20) == 16 and p.allowed(20, 20) == 20
    assert PruningPolicy(channel_multiple=8, min_channels=10).allowed(12, 64) == 10
    assert [p.next_width(n, 20) for n in (1, 6, 7, 8, 15, 16)] == [2, 7, 8, 16, 16, 20]
    assert PruningPolicy().allowed(13, 64) == 13 and PruningPolicy().next_width(13, 64) == 14
    widths = [p.allowed(n, 100) for n in range(101)]
    assert widths == sorted(widths)  # the budget search needs widths that only grow
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="channel_multiple"):
            PruningPolicy(channel_multiple=bad)


@pytest.mark.parametrize("name,shrink", [("fmnist_cnn", 10), ("vgg11_bn", 20), ("resnet20", 4)])
def test_shrink_budget_met_in_multiples_of_8(name, shrink):
    """Widths a tensor core or a vector unit takes whole, and the budget still spent as tightly
    as such widths allow: no layer can grow by one more step."""
    model = _random_model(name)
    layers = find_prunable(model, X1)
    stats = _random_stats(layers)
    params, macs = _size(model)
    policy = PruningPolicy("shrink", shrink=shrink, channel_multiple=8)
    pruned, keep = prune_to_policy(model, layers, stats, policy, X1)
    p, m = _size(pruned)
    assert params / p >= shrink and macs / m >= shrink
    for l in layers:
        n = len(keep[l.conv])
        assert n < 8 or n % 8 == 0 or n == l.channels, (l.conv, n)
        if n < l.channels:
            grown = {**keep, l.conv: np.sort(channel_ranking(l, stats)[:policy.next_width(
                n, l.channels)])}
            gp, gm = _size(prune_model(model, grown, X1))
            assert gp > params / shrink or gm > macs / shrink, l.conv
    assert pruned(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_apoz_allocation_gives_a_mostly_dead_layer_less_room():
    """The per-layer budget follows the group's statistics: a layer three quarters of whose
    channels never fire on the group's images keeps a smaller share than under uniform."""
    model = _random_model("fmnist_cnn")
    layers = find_prunable(model, X1)
    stats = _random_stats(layers)
    for r in ("features.2", "features.12", "features.16"):
        s = stats[r]
        apoz = np.where(np.arange(len(s.apoz)) % 4 == 0, s.apoz * 0.5, 1.0)
        stats[r] = ChannelStats(apoz, np.where(apoz == 1.0, 0.0, s.mean_abs), s.count)
    share = {}
    for allocation in ("uniform", "apoz"):
        _, keep = prune_to_policy(model, layers, stats,
                                  PruningPolicy("shrink", shrink=10, allocation=allocation), X1)
        share[allocation] = {l.conv: len(keep[l.conv]) / l.channels for l in layers}
    assert share["apoz"]["features.14"] < share["uniform"]["features.14"]
    assert share["apoz"]["features.7"] > share["uniform"]["features.7"]


def test_shrink_policy_validation_and_unreachable_budget():
    for kwargs, match in (({"kind": "shrink"}, "needs shrink"), ({"kind": "shrink", "shrink": 0.5}, ">= 1"),
                          ({"kind": "shrink", "shrink": float("inf")}, ">= 1"),
                          ({"kind": "shrink", "shrink": 4, "allocation": "magic"}, "allocation")):
        with pytest.raises(ValueError, match=match):
            PruningPolicy(**kwargs)
    model = _random_model("resnet20")
    layers = find_prunable(model, X1)
    with pytest.raises(SensaiError, match="cannot prune to 20x fewer parameters and MACs.*residual"):
        prune_to_policy(model, layers, _random_stats(layers), PruningPolicy("shrink", shrink=20), X1)


def test_residual_paths_are_pruned_as_coupled_groups():
    model = _random_model("resnet20")
    inner = find_prunable(model, X1)
    assert not any(l.residual for l in inner)
    units = find_prunable(model, X1, residual=True)
    paths = [l for l in units if l.residual]
    # One unit per stage: the stem / each block's last conv / the projection write into it.
    assert [(l.conv, l.channels) for l in paths] == [("conv1", 16), ("layer2.0.conv2", 32),
                                                     ("layer3.0.conv2", 64)]
    assert set(paths[1].coupled) == {"layer2.0.shortcut.0", "layer2.1.conv2", "layer2.2.conv2"}
    assert paths[0].relus == ("relu", "layer1.0.relu2", "layer1.1.relu2", "layer1.2.relu2")
    assert {l.conv for l in units} - {l.conv for l in paths} == {l.conv for l in inner}

    rng = np.random.default_rng(3)
    keep = {l.conv: np.sort(rng.choice(l.channels, l.channels // 2, replace=False)) for l in units}
    pruned = prune_model(model, keep, X1)
    widths = layer_widths(pruned)
    for l in paths:  # every conv of a path loses the same channels
        assert {widths[c] for c in (l.conv, *l.coupled)} == {l.channels // 2}
    # The pruned net is the original with the dropped channels silenced at every ReLU carrying them.
    modules = dict(model.named_modules())
    handles = []
    for l in units:
        drop = torch.from_numpy(np.setdiff1d(np.arange(l.channels), keep[l.conv]))
        for relu in l.relus:
            def silence(mod, inp, out, drop=drop):
                out[:, drop] = 0
                return out
            handles.append(modules[relu].register_forward_hook(silence))
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(x)
        for h in handles:
            h.remove()
        out = pruned.eval()(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    rebuilt = build_from_weights("resnet20", 10, 1, pruned.state_dict(), "pruned test weights")
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), out, rtol=0, atol=1e-6)

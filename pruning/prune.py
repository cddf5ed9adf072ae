"""Structured channel pruning of a trained CNN into a smaller dense subnet (Torch-Pruning).

Which channels may go is read off Torch-Pruning's dependency graph rather than per-architecture
index arithmetic: removing output channel ``i`` of a convolution also removes whatever is coupled
to it (its batch norm, the matching input channel of the next layer, a depthwise convolution in
between).  A convolution whose channels are tied to another convolution's outputs through an
element-wise operation — a residual addition — is left alone, as sensAI does: only channels
*inside* a block are pruned, never the residual path.

The activation statistics that decide which channels go are recorded at a ReLU module; the ReLU
belonging to a convolution is found in the same graph, by matching the autograd node each ReLU
module produced in the tracing pass.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Literal, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from sensai.errors import SensaiError
from sensai.flops import count_flops
from sensai.models import classifier_layer, count_params

from .apoz import ChannelStats

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Dependency graph helpers


def _save_modes(model: nn.Module) -> dict[nn.Module, bool]:
    return {m: m.training for m in model.modules()}


def _restore_modes(modes: dict[nn.Module, bool]) -> None:
    for m, training in modes.items():
        m.training = training


def _example_on(model: nn.Module, example_input: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        return example_input.to(p.device)
    return example_input


def _build_graph(model: nn.Module, example_input: torch.Tensor, relu_trace: dict | None = None):
    """Torch-Pruning dependency graph of ``model``; optionally records which autograd node each
    ``nn.ReLU`` module produced (``relu_trace[grad_fn] = (name, call order, channels)``)."""
    import torch_pruning as tp

    names = {m: n for n, m in model.named_modules()}
    handles = []
    if relu_trace is not None:
        def hook(module, inputs, output):
            relu_trace[output.grad_fn] = (names[module], len(relu_trace),
                                          int(output.shape[1]) if output.ndim > 1 else 0)

        handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.ReLU)]
    modes = _save_modes(model)
    try:
        # Tracing follows autograd, so it must run with gradients on even inside a no_grad caller.
        with torch.enable_grad():
            return tp.DependencyGraph().build_dependency(
                model, example_inputs=_example_on(model, example_input),
                forward_fn=lambda m, x: m(x), verbose=False)
    finally:
        for h in handles:
            h.remove()
        _restore_modes(modes)  # tracing switches the model to eval mode


def _is_depthwise(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels == m.out_channels


# --------------------------------------------------------------------------------------------
# What can be pruned


@dataclass(frozen=True)
class PrunableLayer:
    """One unit of output channels that can be removed independently of every other unit.

    Usually one convolution and the ReLU after it.  A residual path is one unit too (only when
    asked for, see :func:`find_prunable`): every convolution writing into it (``conv`` and
    ``coupled``) loses the same channels, and its statistics are the average over every ReLU
    that carries it (``relu`` and ``more_relus``).
    """

    conv: str      # nn.Conv2d whose output channels may be removed (the unit's root)
    relu: str      # nn.ReLU whose output carries those channels (where statistics are recorded)
    channels: int
    coupled: tuple[str, ...] = ()     # further convolutions losing the same channels
    more_relus: tuple[str, ...] = ()  # further ReLUs carrying the same channels

    @property
    def relus(self) -> tuple[str, ...]:
        return (self.relu, *self.more_relus)

    @property
    def residual(self) -> bool:
        return bool(self.coupled)


def find_prunable(model: nn.Module, example_input: torch.Tensor, *, residual: bool = False
                  ) -> list[PrunableLayer]:
    """Convolutions whose output channels can be removed independently of any other convolution.

    A convolution qualifies when its pruning group (everything coupled to its output channels):
    holds no other dense or grouped convolution's outputs (depthwise ones are fine), no element-wise
    merge of two tensors (a residual addition), not the network output, and a ReLU module that
    carries exactly its channels.  When several ReLUs carry them (a depthwise block), the last one
    is used: it is the activation the next dense layer actually reads.  The classifier is never a
    root, so the number of outputs never changes.  ``example_input`` is one batch of the model's
    input, e.g. ``torch.zeros(1, C, H, W)``.  Returns layers in module order.

    ``residual=True`` also returns every residual path as one unit: the convolutions whose outputs
    meet in element-wise additions lose the same channels together (Torch-Pruning keeps the
    additions consistent), scored by every ReLU that carries the path.  sensAI itself never
    prunes these; they are what is left to cut once the channels inside the blocks are thin.
    """
    import torch_pruning as tp

    relu_trace: dict = {}
    graph = _build_graph(model, example_input, relu_trace)
    OPTYPE = tp.ops.OPTYPE
    out: list[PrunableLayer] = []
    seen: set[str] = set()
    names = {m: n for n, m in model.named_modules()}
    for name, conv in model.named_modules():
        if not isinstance(conv, nn.Conv2d) or conv not in graph.module2node or conv.out_channels < 2:
            continue
        if name in seen or (conv.groups > 1 and not _is_depthwise(conv)):
            continue
        channels = conv.out_channels
        group = graph.get_pruning_group(conv, tp.prune_conv_out_channels, idxs=list(range(channels)))
        ok, merged, relus, coupled = True, False, [], []
        for item in group:
            dep, idxs = item.dep, item.idxs
            node, target = dep.target, dep.target.module
            if node.type == OPTYPE.OUTPUT:
                ok = False  # the channels would change the network's output
            elif node.type == OPTYPE.ELEMENTWISE and len(node.inputs) > 1:
                merged = True  # two tensors meet channel by channel: a residual (or gating) path
            elif isinstance(target, nn.Conv2d) and target.groups > 1 and not _is_depthwise(target):
                ok = False  # grouped convolutions need whole groups removed
            elif (target is not conv and isinstance(target, (nn.Conv2d, nn.Linear))
                  and not _is_depthwise(target) and graph.is_out_channel_pruning_fn(dep.handler)):
                if not isinstance(target, nn.Conv2d) or list(idxs) != list(range(channels)):
                    ok = False  # tied to a linear layer's outputs or to part of another layer
                else:
                    coupled.append(names[target])
            if not ok:
                break
            traced = relu_trace.get(node.grad_fn)
            if traced is not None and traced[2] == channels and list(idxs) == list(range(channels)):
                relus.append(traced)
        if not ok or not relus or ((merged or coupled) and not residual):
            continue
        if merged or coupled:
            # One unit for the whole path, its ReLUs in call order.
            relus = sorted(set(relus), key=lambda t: t[1])
            coupled = sorted(set(coupled) - {name})
            seen.update(coupled)
            out.append(PrunableLayer(conv=name, relu=relus[0][0], channels=channels,
                                     coupled=tuple(coupled),
                                     more_relus=tuple(t[0] for t in relus[1:])))
        else:
            relu_name = max(relus, key=lambda t: t[1])[0]
            out.append(PrunableLayer(conv=name, relu=relu_name, channels=channels))
    log.debug("prunable convolutions: %s", [p.conv for p in out])
    return out


def layer_widths(model: nn.Module) -> dict[str, int]:
    """Output channels of every ``nn.Conv2d``, by module name."""
    return {n: m.out_channels for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


# --------------------------------------------------------------------------------------------
# Which channels to keep


POLICY_KINDS = ("threshold", "keep", "params", "shrink")
ALLOCATIONS = ("uniform", "apoz", "activity")


@dataclass(frozen=True)
class PruningPolicy:
    """How many and which channels each prunable layer keeps.

    ``threshold``: sensAI's rule — remove a channel when its APoZ >= ``theta1`` unless its mean
    |activation| >= ``theta2``.  ``keep``: every layer keeps the ``ceil(keep_fraction * C)``
    channels with the lowest APoZ (ties: higher mean |a| first).  ``params``: the largest uniform
    keep fraction whose subnet has at most ``params_fraction`` of the original parameters.
    ``shrink``: the largest keep fraction whose subnet has at most ``1 / shrink`` of the original
    parameters *and* at most ``1 / shrink`` of its multiply-accumulates; ``allocation`` says how
    that fraction is shared out over the layers.
    No layer ever drops below ``min_channels``.  A layer that keeps at least ``channel_multiple``
    channels by ``keep``, ``params`` or ``shrink`` keeps a multiple of it (or all of them): the
    widths GPU tensor cores and CPU vector units are built for, so no lane computes padding.
    """

    kind: Literal["threshold", "keep", "params", "shrink"] = "keep"
    theta1: float = 0.73
    theta2: float = 0.01
    keep_fraction: float = 0.25
    params_fraction: float | None = None
    min_channels: int = 2
    shrink: float | None = None
    allocation: str = "uniform"
    channel_multiple: int = 1

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"pruning policy kind must be one of {', '.join(POLICY_KINDS)}, "
                             f"got {self.kind!r}")
        if not 0.0 <= self.theta1 <= 1.0:
            raise ValueError(f"theta1 (APoZ threshold) must be in [0, 1], got {self.theta1}")
        if not self.theta2 >= 0.0:
            raise ValueError(f"theta2 (mean |activation| threshold) must be >= 0, got {self.theta2}")
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be in (0, 1], got {self.keep_fraction}")
        if self.kind == "params" and self.params_fraction is None:
            raise ValueError("the params policy needs params_fraction")
        if self.params_fraction is not None and not 0.0 < self.params_fraction <= 1.0:
            raise ValueError(f"params_fraction must be in (0, 1], got {self.params_fraction}")
        if self.kind == "shrink" and self.shrink is None:
            raise ValueError("the shrink policy needs shrink")
        if self.shrink is not None and not (math.isfinite(self.shrink) and self.shrink >= 1.0):
            raise ValueError(f"shrink must be a finite number >= 1, got {self.shrink}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, "
                             f"got {self.allocation!r}")
        if (not isinstance(self.min_channels, (int, np.integer)) or isinstance(self.min_channels, bool)
                or self.min_channels < 1):
            raise ValueError(f"min_channels must be a positive integer, got {self.min_channels!r}")
        if (not isinstance(self.channel_multiple, (int, np.integer))
                or isinstance(self.channel_multiple, bool) or self.channel_multiple < 1):
            raise ValueError(f"channel_multiple must be a positive integer, got "
                             f"{self.channel_multiple!r}")

    def allowed(self, n: int, channels: int) -> int:
        """``n`` kept channels of ``channels`` as this policy rounds them: down to a multiple of
        ``channel_multiple`` once there are that many (never below the floor, all kept stays
        all).  Only grows with ``n``, which the budget search relies on."""
        m = self.channel_multiple
        if n >= channels or n < m:
            return n
        return max(m * (n // m), min(self.min_channels, channels))

    def next_width(self, n: int, channels: int) -> int:
        """The next width above ``n`` that :meth:`allowed` can give (at most ``channels``)."""
        m = self.channel_multiple
        return min(channels, n + 1 if n + 1 < m else m * (n // m + 1))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["min_channels"] = int(d["min_channels"])
        d["channel_multiple"] = int(d["channel_multiple"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "PruningPolicy":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def budgeted(self) -> bool:
        """Whether the keep fraction is searched for to meet a size budget."""
        return self.kind in ("params", "shrink")


def _ranking(stats: ChannelStats) -> np.ndarray:
    """Channel indices from most to least useful: low APoZ first, then high mean |a|, then index."""
    apoz = np.asarray(stats.apoz, dtype=np.float64)
    mean_abs = np.asarray(stats.mean_abs, dtype=np.float64)
    return np.lexsort((np.arange(len(apoz)), -mean_abs, apoz))


def _stats_for(layer: PrunableLayer, stats: Mapping[str, ChannelStats]) -> ChannelStats:
    """The unit's statistics; a residual path averages every ReLU that carries it."""
    found = []
    for relu in layer.relus:
        s = stats.get(relu)
        if s is None:
            raise ValueError(f"no activation statistics for {relu!r} (layer {layer.conv!r})")
        if len(s.apoz) != layer.channels or len(s.mean_abs) != layer.channels:
            raise ValueError(f"statistics for {relu!r} have {len(s.apoz)} channels, layer "
                             f"{layer.conv!r} has {layer.channels}")
        found.append(s)
    if len(found) == 1:
        return found[0]
    return ChannelStats(apoz=np.mean([s.apoz for s in found], axis=0),
                        mean_abs=np.mean([s.mean_abs for s in found], axis=0),
                        count=sum(s.count for s in found))


def channel_ranking(layer: PrunableLayer, stats: Mapping[str, ChannelStats]) -> np.ndarray:
    """The unit's channel indices from most to least useful to the group (see ``_ranking``)."""
    return _ranking(_stats_for(layer, stats))


def select_channels(layers: Sequence[PrunableLayer], stats: Mapping[str, ChannelStats],
                    policy: PruningPolicy, *,
                    keep_fraction: float | Mapping[str, float] | None = None
                    ) -> dict[str, np.ndarray]:
    """Conv name -> sorted indices of the channels to keep, for every layer in ``layers``.

    ``stats`` is keyed by ReLU module name (as returned by ``collect_activation_stats``).  For the
    budgeted policies pass the keep fraction found by the budget search, one number for every layer
    or one per conv name (what :func:`prune_to_policy` does); it overrides
    ``policy.keep_fraction`` for the ``keep`` policy too.
    """
    if policy.budgeted and keep_fraction is None:
        raise ValueError(f"the {policy.kind} policy needs the keep fraction found by its budget "
                         "search; use prune_to_policy")
    if keep_fraction is None:
        keep_fraction = policy.keep_fraction
    fracs = (dict(keep_fraction) if isinstance(keep_fraction, Mapping)
             else {layer.conv: float(keep_fraction) for layer in layers})
    keep: dict[str, np.ndarray] = {}
    for layer in layers:
        s = _stats_for(layer, stats)
        c = layer.channels
        floor = min(policy.min_channels, c)
        order = _ranking(s)
        if policy.kind == "threshold":
            drop = (np.asarray(s.apoz) >= policy.theta1) & (np.asarray(s.mean_abs) < policy.theta2)
            kept = list(np.flatnonzero(~drop))
            if len(kept) < floor:
                kept += [i for i in order if drop[i]][:floor - len(kept)]
        else:
            frac = fracs.get(layer.conv)
            if frac is None or not 0.0 <= frac <= 1.0:
                raise ValueError(f"keep fraction of {layer.conv!r} must be in [0, 1], got {frac}")
            # The epsilon stops float noise (0.3 * 10 = 3.0000000000000004) from adding a channel.
            n = policy.allowed(min(c, max(floor, math.ceil(frac * c - 1e-9))), c)
            kept = order[:n]
        keep[layer.conv] = np.sort(np.asarray(kept, dtype=np.int64))
    return keep


# --------------------------------------------------------------------------------------------
# Pruning


def prune_model(model: nn.Module, keep: Mapping[str, np.ndarray], example_input: torch.Tensor
                ) -> nn.Module:
    """A pruned deep copy of ``model`` keeping only ``keep[conv]`` output channels of each conv.

    Channels are physically removed (with everything coupled to them), so the result is a smaller
    dense network of the same classes; ``model`` itself is untouched.
    """
    import torch_pruning as tp

    pruned = copy.deepcopy(model)
    modules = dict(pruned.named_modules())
    plan = []
    for name, kept in keep.items():
        conv = modules.get(name)
        if not isinstance(conv, nn.Conv2d):
            raise ValueError(f"{name!r} is not an nn.Conv2d of the model")
        kept = np.asarray(kept)
        c = conv.out_channels
        if kept.ndim != 1 or kept.size == 0:
            raise ValueError(f"layer {name!r} must keep at least one channel")
        if not np.issubdtype(kept.dtype, np.integer) or kept.min() < 0 or kept.max() >= c:
            raise ValueError(f"channel indices for {name!r} must be integers in [0, {c})")
        if len(np.unique(kept)) != kept.size:
            raise ValueError(f"channel indices for {name!r} repeat")
        plan.append((name, conv, c, np.setdiff1d(np.arange(c), kept)))
    if not any(len(remove) for *_, remove in plan):
        return pruned
    graph = _build_graph(pruned, example_input)
    for name, conv, c, remove in plan:
        if conv.out_channels != c:
            raise ValueError(f"layer {name!r} is coupled to another pruned layer; prune only "
                             "independent layers (see find_prunable)")
        if len(remove) == 0:
            continue
        group = graph.get_pruning_group(conv, tp.prune_conv_out_channels,
                                        idxs=[int(i) for i in remove])
        if not graph.check_pruning_group(group):
            raise ValueError(f"pruning {len(remove)} of {c} channels of {name!r} would empty a "
                             "coupled layer")
        group.prune()
    return pruned


def _keep_counts(keep: Mapping[str, np.ndarray]) -> tuple:
    return tuple(sorted((k, len(v)) for k, v in keep.items()))


@dataclass(frozen=True)
class SizeBudget:
    """Most parameters and multiply-accumulates a subnet may keep (``None``: no limit)."""

    params: float | None
    macs: float | None
    input_shape: tuple[int, int, int]

    @classmethod
    def of(cls, policy: PruningPolicy, size: tuple[int, int], input_shape: Sequence[int]
           ) -> "SizeBudget":
        """The budget against a network of ``size`` = (parameters, MACs)."""
        params, macs = size
        shape = tuple(int(d) for d in input_shape)
        if policy.kind == "params":
            return cls(params=policy.params_fraction * params, macs=None, input_shape=shape)
        return cls(params=params / policy.shrink, macs=macs / policy.shrink, input_shape=shape)

    def measure(self, model: nn.Module) -> tuple[int, int | None]:
        macs = count_flops(model, self.input_shape) if self.macs is not None else None
        return count_params(model), macs

    def fits(self, size: tuple[int, int | None]) -> bool:
        params, macs = size
        return ((self.params is None or params <= self.params)
                and (self.macs is None or macs <= self.macs))


def allocation_weights(layers: Sequence[PrunableLayer], stats: Mapping[str, ChannelStats],
                       policy: PruningPolicy) -> dict[str, float]:
    """How much of the budget each layer gets, relative to the others (largest = 1).

    ``uniform``: all equal.  ``apoz``: the share of channels sensAI's threshold rule would keep for
    this group (channels that are mostly zero on the group's images need no room).  ``activity``:
    the participation ratio (sum m)^2 / (C sum m^2) of the channels' mean |a| — 1 when every
    channel is equally active, small when a few channels carry the group's signal.
    """
    weights = {}
    for layer in layers:
        s = _stats_for(layer, stats)
        apoz, m = np.asarray(s.apoz, np.float64), np.asarray(s.mean_abs, np.float64)
        if policy.allocation == "apoz":
            alive = ~((apoz >= policy.theta1) & (m < policy.theta2))
            w = alive.mean()
        elif policy.allocation == "activity":
            w = m.sum() ** 2 / (len(m) * (m ** 2).sum()) if (m ** 2).sum() > 0 else 0.0
        else:
            w = 1.0
        weights[layer.conv] = float(w)
    top = max(weights.values(), default=1.0)
    floor = 1.0 / max((layer.channels for layer in layers), default=1)
    # A layer every channel of which looks dead still gets a sliver, so the level reaches it.
    return {k: max(v / top, floor) if top > 0 else 1.0 for k, v in weights.items()}


def layer_fractions(weights: Mapping[str, float], level: float) -> dict[str, float]:
    """Per-layer keep fractions at budget ``level`` in [0, 1]: 0 puts every layer at its floor,
    1 keeps everything; they only grow with ``level``, which the budget search relies on."""
    low = min(weights.values(), default=1.0)
    return {k: min(1.0, level * w / low) for k, w in weights.items()}


def prune_to_policy(model: nn.Module, layers: Sequence[PrunableLayer],
                    stats: Mapping[str, ChannelStats], policy: PruningPolicy,
                    example_input: torch.Tensor, *, reference: tuple[int, int] | None = None
                    ) -> tuple[nn.Module, dict[str, np.ndarray]]:
    """Select channels by ``policy`` and prune; returns ``(pruned copy, kept indices per conv)``.

    For the budgeted policies (``params``, ``shrink``) the keep fraction is found by bisection:
    parameters and MACs only grow with it, so the largest fraction within budget is found in about
    log2(2 x widest layer) trial prunings, each measured on the real pruned network.  The budget is
    a fraction of ``reference`` = (parameters, MACs) (default: ``model``'s), so an already pruned
    subnet can be pruned further towards a budget stated against the original (the iterative
    schedule).  An unreachable budget raises :class:`SensaiError`.
    """
    if not policy.budgeted:
        keep = select_channels(layers, stats, policy)
        return prune_model(model, keep, example_input), keep

    shape = tuple(int(d) for d in example_input.shape[1:])
    if reference is None:
        reference = (count_params(model), count_flops(model, shape))
    budget = SizeBudget.of(policy, reference, shape)
    tried: dict[tuple, tuple[tuple, nn.Module, dict]] = {}

    def measured(keep: dict[str, np.ndarray]):
        key = _keep_counts(keep)
        if key not in tried:
            pruned = prune_model(model, keep, example_input)
            tried[key] = (budget.measure(pruned), pruned, keep)
        return tried[key]

    weights = allocation_weights(layers, stats, policy)

    def trial(level: float):
        return measured(select_channels(layers, stats, policy,
                                        keep_fraction=layer_fractions(weights, level)))

    full = trial(1.0)
    if budget.fits(full[0]):
        return full[1], full[2]
    smallest = trial(0.0)
    if not budget.fits(smallest[0]):
        raise SensaiError(_unreachable(policy, reference[0], budget, smallest[0]))
    lo, hi = 0.0, 1.0
    widest = max((layer.channels for layer in layers), default=1)
    spread = max(weights.values()) / min(weights.values())
    # Below 1/(2 * widest * spread) no layer's ceil(f*C) changes any more.
    while hi - lo > 1.0 / (2 * widest * spread):
        mid = (lo + hi) / 2
        if budget.fits(trial(mid)[0]):
            lo = mid
        else:
            hi = mid
    best = trial(lo)
    if policy.kind == "shrink":
        best = _fill(layers, stats, best, measured, budget, weights, policy)
    (params, macs), pruned, keep = best
    log.info("%s policy: level %.4f -> %d params (budget %.0f), %s MACs (budget %s)", policy.kind,
             lo, params, budget.params, macs, budget.macs)
    return pruned, keep


def _fill(layers: Sequence[PrunableLayer], stats: Mapping[str, ChannelStats], best: tuple,
          measured: Callable, budget: SizeBudget, weights: Mapping[str, float],
          policy: PruningPolicy) -> tuple:
    """Spend what the bisection left of the budget one width step at a time (a channel, or the
    policy's channel multiple), so it is met as tightly as the allowed widths allow: a narrow
    layer's ceil(f * C) moves in big steps (one channel of 16 is 6%), which leaves up to a whole
    step of every budget unused.

    The layer furthest below its share (kept / (C x weight)) grows next; a layer that cannot
    grow any more never can later, as sizes only grow.
    """
    keep = dict(best[2])
    open_ = {layer.conv: layer for layer in layers if len(keep[layer.conv]) < layer.channels}
    while open_:
        conv = min(open_, key=lambda c: (len(keep[c]) / (open_[c].channels * max(weights[c], 1e-9)),
                                         c))
        layer = open_[conv]
        width = policy.next_width(len(keep[conv]), layer.channels)
        grown = {**keep, conv: np.sort(channel_ranking(layer, stats)[:width])}
        candidate = measured(grown)
        if budget.fits(candidate[0]):
            keep, best = grown, candidate
            if len(grown[conv]) == layer.channels:
                del open_[conv]
        else:
            del open_[conv]
    return best


def _unreachable(policy: PruningPolicy, original: int, budget: SizeBudget,
                 smallest: tuple[int, int | None]) -> str:
    params, macs = smallest
    what = (f"{policy.params_fraction:g} of the parameters" if policy.kind == "params"
            else f"{policy.shrink:g}x fewer parameters and MACs")
    left = f"{params:,} of {original:,} parameters ({params / original:.3f})"
    if macs is not None:
        left += f" and {macs / (budget.macs * policy.shrink):.3f} of the MACs"
    return (f"cannot prune to {what}: even keeping only {policy.min_channels} channel(s) per "
            f"prunable layer leaves {left}; the classifier and layers that are not pruned "
            f"(e.g. the residual path) stay whole — ask for a smaller reduction"
            + ("" if policy.kind == "params" else " or prune the residual path too"))


# --------------------------------------------------------------------------------------------
# Output heads


def make_head(model: nn.Module, classes: Sequence[int], *, binary: bool, seed: int = 0) -> nn.Module:
    """Replace the classifier (last ``nn.Linear``) in place by a subnet head; returns ``model``.

    ``binary``: one logit, started from the original row of ``classes[0]``.  Otherwise
    ``len(classes) + 1`` logits: 1..k start from the original rows of ``classes``, 0 ("not one of
    mine") is drawn from N(0, 0.01) with bias 0, as in sensAI.
    """
    name, head = classifier_layer(model)
    classes = [int(c) for c in classes]
    if not classes:
        raise ValueError("a head needs at least one class")
    if len(set(classes)) != len(classes) or min(classes) < 0 or max(classes) >= head.out_features:
        raise ValueError(f"classes must be distinct and in [0, {head.out_features}), got {classes}")
    if binary and len(classes) != 1:
        raise ValueError(f"a binary head is for exactly one class, got {len(classes)}")
    w, b = head.weight.detach(), head.bias
    outputs = 1 if binary else len(classes) + 1
    new = nn.Linear(head.in_features, outputs, bias=b is not None, device=w.device, dtype=w.dtype)
    idx = torch.tensor(classes, device=w.device)
    with torch.no_grad():
        if binary:
            new.weight.copy_(w[idx])
            if b is not None:
                new.bias.copy_(b.detach()[idx])
        else:
            gen = torch.Generator().manual_seed(seed)
            new.weight[0] = (torch.randn(head.in_features, generator=gen) * 0.01).to(w)
            new.weight[1:] = w[idx]
            if b is not None:
                new.bias[0] = 0.0
                new.bias[1:] = b.detach()[idx]
    new.train(head.training)
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model

"""Cut a network into K contiguous pipeline stages (``sensai bench``'s model-parallel baseline).

The model is traced with ``torch.fx``; the nodes are already in a topological order (the order
``forward`` runs them). A cut is allowed after a node only where exactly one tensor is alive - a
value computed at or before the cut and still needed after it - so each stage has one input and one
output: between VGG layers, between ResNet blocks (never inside one, where the block input waits for
the shortcut), between MobileNet blocks. Among the allowed cuts, :func:`plan_stages` picks the K-1
that make the most expensive stage as cheap as possible (multiply-accumulates of convolutions and
linear layers, counted per node from the traced shapes), since the slowest stage bounds a pipeline's
throughput; the sum, and so one image's latency, is the same wherever the cuts go.

Each stage is an ``fx.GraphModule`` sharing the original parameters; :func:`export_stage_onnx`
writes one to ONNX with a dynamic batch axis, for the same runtime the subnets use. Chaining the
stages reproduces the whole model exactly (the same ops on the same tensors).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from sensai.errors import SensaiError, first_line
from sensai.export import DEFAULT_OPSET, check_onnx, torch_export
from sensai.fsutil import atomic_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePlan:
    """Where a traced model is cut and what each stage costs (per image)."""

    num_stages: int
    boundaries: tuple[str, ...]  # fx node whose output leaves stage i for stage i+1 (K-1 names)
    boundary_shapes: tuple[tuple[int, ...], ...]  # those activations' shapes at batch 1
    stage_macs: tuple[int, ...]
    stage_params: tuple[int, ...]
    stage_nodes: tuple[int, ...]  # how many graph nodes each stage holds
    max_stages: int  # the most stages this model can be cut into
    candidates: tuple[str, ...] = field(default=(), repr=False)  # every allowed cut, in order

    def to_dict(self) -> dict:
        return {"num_stages": self.num_stages, "boundaries": list(self.boundaries),
                "boundary_shapes": [list(s) for s in self.boundary_shapes],
                "stage_macs": list(self.stage_macs), "stage_params": list(self.stage_params),
                "stage_nodes": list(self.stage_nodes), "max_stages": self.max_stages}


# --------------------------------------------------------------------------------------------
# Tracing and cost


def trace(model: nn.Module, example: torch.Tensor) -> fx.GraphModule:
    """``fx`` graph of ``model`` with each node's output shape for one image of ``example``
    recorded (``node.meta``)."""
    was_training = model.training
    model.eval()
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # fx raises many kinds of errors on data-dependent control flow
        raise SensaiError(f"cannot trace {type(model).__name__} with torch.fx for stage cutting "
                          f"(data-dependent control flow?): {first_line(e)}") from None
    finally:
        model.train(was_training)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise SensaiError(f"stage cutting needs a model with one input; {type(model).__name__} "
                          f"has {len(placeholders)}")
    with torch.no_grad():
        # One image is enough for the shapes (and the costs are per image anyway).
        ShapeProp(gm).propagate(example[:1].clone())
    return gm


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    tm = node.meta.get("tensor_meta")
    return tuple(tm.shape) if tm is not None and hasattr(tm, "shape") else None


def _last_uses(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Where each value of ``nodes`` (in the order ``forward`` runs them) is used last, by node
    (unused: its own position).  ``get_attr`` nodes (parameters, buffers) are not activations:
    a stage that needs one simply refers to it again, so they are never live."""
    pos = {n: i for i, n in enumerate(nodes)}
    return {n: max((pos[u] for u in n.users), default=pos[n]) for n in nodes
            if n.op not in ("get_attr", "output")}


def node_macs(gm: fx.GraphModule, node: fx.Node) -> int:
    """Multiply-accumulates of one node for the traced batch (conv, linear, matmul; else 0).

    Element-wise work (batch norm, ReLU, pooling, additions) is left out: it is memory-bound and
    small next to the convolutions, and leaving it out keeps the count comparable to the usual
    "FLOPs" tables of pruning papers.
    """
    out = _shape(node)
    if out is None:
        return 0
    numel = math.prod(out)
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if isinstance(m, nn.modules.conv._ConvNd):
            k = math.prod(m.kernel_size)
            return numel * (m.in_channels // m.groups) * k
        if isinstance(m, nn.Linear):
            return numel * m.in_features
        return 0
    if node.op == "call_function":
        f = node.target
        if f in (torch.nn.functional.conv2d, torch.nn.functional.conv1d, torch.conv2d):
            w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            ws = _shape(w) if isinstance(w, fx.Node) else None
            if ws is None and isinstance(w, fx.Node) and w.op == "get_attr":
                ws = tuple(operator.attrgetter(w.target)(gm).shape)
            return numel * math.prod(ws[1:]) if ws else 0
        if f in (torch.nn.functional.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm):
            a = node.args[0]
            a_shape = _shape(a) if isinstance(a, fx.Node) else None
            return numel * a_shape[-1] if a_shape else 0
    return 0


def peak_activation_bytes(model: nn.Module, example: torch.Tensor) -> int:
    """Largest total size of the activations alive at once during one forward pass, per image.

    A lower bound for the working memory a runtime needs beyond the weights (it may keep more
    buffers around): at each node, the node's output plus every earlier value still to be used.
    """
    gm = trace(model, example)  # always afresh: copied stage graphs carry their own shapes
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last = _last_uses(nodes)
    sizes = {n: math.prod(shape) * n.meta["tensor_meta"].dtype.itemsize
             for n in last if (shape := _shape(n)) is not None}
    peak = 0
    for i in range(len(nodes)):
        peak = max(peak, sum(b for n, b in sizes.items() if pos[n] <= i <= last[n]))
    return int(peak)


# --------------------------------------------------------------------------------------------
# Cut points


def _cut_candidates(gm: fx.GraphModule) -> list[tuple[int, fx.Node]]:
    """(position, the one live tensor) for every position after which exactly one tensor is live
    (:func:`_last_uses`)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    output_pos = next(i for i, n in enumerate(nodes) if n.op == "output")
    last_use = _last_uses(nodes)
    # Sweep: values born at or before i whose last use lies after i (in order of birth).
    births = list(last_use)
    live: set[fx.Node] = set()
    out: list[tuple[int, fx.Node]] = []
    j = 0
    last_compute = max(i for i, n in enumerate(nodes)
                       if n.op not in ("output", "placeholder", "get_attr"))
    for i in range(output_pos):
        while j < len(births) and pos[births[j]] <= i:
            live.add(births[j])
            j += 1
        live = {n for n in live if last_use[n] > i}
        if nodes[i].op in ("placeholder", "get_attr"):
            continue
        if i >= last_compute:  # the last stage must hold at least one node that computes
            break
        if len(live) == 1:
            (v,) = live
            if _shape(v) is not None and v.op != "placeholder":
                out.append((i, v))
    return out


_FUSES_INTO_PREVIOUS = (nn.modules.batchnorm._BatchNorm, nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU,
                        nn.Hardswish, nn.LeakyReLU, nn.Sigmoid, nn.Tanh)


def _splits_fusion(gm: fx.GraphModule, value: fx.Node) -> bool:
    """Is ``value`` a conv / linear / batch-norm / residual-sum output consumed only by a batch
    norm or an activation?"""
    if len(value.users) != 1:
        return False
    if value.op == "call_module":
        if not isinstance(gm.get_submodule(value.target), (nn.modules.conv._ConvNd, nn.Linear,
                                                            nn.modules.batchnorm._BatchNorm)):
            return False
    elif not (value.op == "call_function" and value.target in (operator.add, torch.add)):
        return False  # a residual sum followed by its ReLU also fuses
    (user,) = value.users
    if user.op == "call_module":
        return isinstance(gm.get_submodule(user.target), _FUSES_INTO_PREVIOUS)
    return user.op == "call_function" and user.target in (torch.relu, torch.nn.functional.relu)


def _balanced_cuts(costs: list[int], cand: list[int], k: int) -> list[int]:
    """Choose k-1 of the candidate positions: the largest stage as cheap as possible, and among
    the choices that achieve it the most even one (least sum of squared stage costs). Exact DP.

    ``costs[i]`` is node i's cost; a cut at position p ends a stage after node p.
    """
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    pts = [-1, *cand, len(costs) - 1]  # 0 = the start, 1..m = the candidates, m + 1 = the end
    end = len(pts) - 1

    def seg(a: int, b: int) -> int:  # cost of the stage from after pts[a] to pts[b]
        return prefix[pts[b] + 1] - prefix[pts[a] + 1]

    def solve(combine, limit: float):
        best: dict[tuple[int, int], tuple[float, int]] = {(0, 0): (0, -1)}
        for j in range(1, k + 1):
            ends = [end] if j == k else range(1, end)
            for t in ends:
                for s_ in range(t):
                    prev = best.get((j - 1, s_))
                    c = seg(s_, t)
                    if prev is None or c > limit:
                        continue
                    v = combine(prev[0], c)
                    if (j, t) not in best or v < best[(j, t)][0]:
                        best[(j, t)] = (v, s_)
        if (k, end) not in best:
            raise ValueError("no feasible cut")
        cuts, t = [], end
        for j in range(k, 1, -1):
            t = best[(j, t)][1]
            cuts.append(pts[t])
        return best[(k, end)][0], sorted(cuts)

    worst, _ = solve(max, float("inf"))
    _, cuts = solve(lambda acc, c: acc + c * c, worst)
    return cuts


def plan_stages(gm: fx.GraphModule, k: int) -> tuple[StagePlan, list[int]]:
    """Where to cut traced ``gm`` into ``k`` stages; returns the plan and the cut positions."""
    if k < 1:
        raise SensaiError(f"the number of stages must be at least 1, got {k}")
    nodes = list(gm.graph.nodes)
    costs = [node_macs(gm, n) for n in nodes]
    cands = _cut_candidates(gm)
    max_stages = len(cands) + 1
    if k > max_stages:
        raise SensaiError(f"this model can be cut into at most {max_stages} stages with one tensor "
                          f"between consecutive stages, not {k}")
    # Cutting between a convolution and its batch norm / activation would stop the runtime from
    # fusing them (and penalise the baseline); avoid such cuts when there are enough others.
    preferred = [p for p, v in cands if not _splits_fusion(gm, v)]
    positions = preferred if len(preferred) >= k - 1 else [p for p, _ in cands]
    cuts = _balanced_cuts(costs, positions, k) if k > 1 else []
    bounds = [-1, *cuts, len(nodes) - 1]
    by_pos = dict(cands)
    stage_macs, stage_nodes = [], []
    for a, b in zip(bounds, bounds[1:]):
        stage_macs.append(sum(costs[a + 1:b + 1]))
        stage_nodes.append(sum(1 for n in nodes[a + 1:b + 1]
                               if n.op not in ("placeholder", "output", "get_attr")))
    plan = StagePlan(
        num_stages=k,
        boundaries=tuple(by_pos[c].name for c in cuts),
        boundary_shapes=tuple((1, *_shape(by_pos[c])[1:]) for c in cuts),
        stage_macs=tuple(int(m) for m in stage_macs),  # traced at batch 1: per image
        stage_params=(),
        stage_nodes=tuple(stage_nodes),
        max_stages=max_stages,
        candidates=tuple(v.name for _, v in cands),
    )
    return plan, cuts


# --------------------------------------------------------------------------------------------
# Building the stages


def _build_stage(gm: fx.GraphModule, nodes: list[fx.Node], lo: int, hi: int,
                 inp: fx.Node, out: fx.Node | None, index: int) -> fx.GraphModule:
    """A GraphModule running nodes (lo, hi] with ``inp`` as its input; returns ``out``'s value
    (or the model's own output for the last stage)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    env[inp] = g.placeholder("x", type_expr=torch.Tensor)

    def lookup(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr":  # parameters are shared, not passed between stages
            env[a] = g.node_copy(a, lookup)
            return env[a]
        raise RuntimeError(f"stage {index} needs {a.name}, which is neither its input nor its own")

    for n in nodes[lo + 1:hi + 1]:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            g.output(fx.map_arg(n.args[0], lookup))
            break
        env[n] = g.node_copy(n, lookup)
    else:
        g.output(lookup(out))
    g.lint()
    stage = fx.GraphModule(gm, g, class_name=f"Stage{index}")
    return stage.eval()


def split_model(model: nn.Module, k: int, example: torch.Tensor
                ) -> tuple[list[fx.GraphModule], StagePlan]:
    """Cut ``model`` into ``k`` contiguous stages; ``stages[-1](...stages[0](x))`` == ``model(x)``.

    ``example`` is one input batch (its shapes drive the cost model; batch size does not matter).
    The stages share the model's parameters and are in eval mode.
    """
    gm = trace(model, example)
    plan, cuts = plan_stages(gm, k)
    nodes = list(gm.graph.nodes)
    inp = next(n for n in nodes if n.op == "placeholder")
    bounds = [nodes.index(inp), *cuts, len(nodes) - 1]
    by_name = {n.name: n for n in nodes}
    outs = [*(by_name[name] for name in plan.boundaries), None]  # the last: the model's output
    stages = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        stages.append(_build_stage(gm, nodes, a, b, inp, outs[i], i))
        inp = outs[i]
    params = tuple(sum(p.numel() for p in s.parameters()) for s in stages)
    plan = StagePlan(**{**plan.__dict__, "stage_params": params})
    log.info("cut %s into %d stages (MACs per stage: %s)", type(model).__name__, k,
             ", ".join(f"{m:,}" for m in plan.stage_macs))
    return stages, plan


# --------------------------------------------------------------------------------------------
# ONNX


def export_stage_onnx(module: nn.Module, example: torch.Tensor, path: str | Path, *,
                      opset: int = DEFAULT_OPSET, atol: float = 1e-4) -> float:
    """Write a stage (or any one-input module) to ONNX with a dynamic batch axis, atomically.

    ``example`` is a real input batch of the module (for a stage: the previous stage's output on
    real images); the file is run with ONNX Runtime and compared with torch on it before it is
    kept (:func:`sensai.export.check_onnx`), as :mod:`sensai.export` does for subnets, whose
    :func:`~sensai.export.export_onnx` expects (C, H, W) images: a stage may start after a
    flatten, and may hold no parameter at all.  Returns the max absolute difference.
    """
    module = module.eval()
    example = example.detach().to("cpu", torch.float32)
    with atomic_path(path) as tmp, torch.no_grad():
        torch_export(module, example[:1].clone(), tmp, opset)  # clone: stages may start in place
        return check_onnx(tmp, module, example, atol=atol)

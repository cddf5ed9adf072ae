"""A device's runner: every subnet placed on one device, computed in one call per batch.

In sensAI the subnets of one device run side by side on it, so the unit of work is the device,
not the subnet: a request costs each device it reaches one launch, one copy in, one wait and one
copy out, however many of its subnets that device holds.  :func:`build_device` makes the one
call of the device's recipes:

* ONNX Runtime (CPUs): :func:`merge_branches` joins the subnets' graphs into one model with one
  input and one output per subnet, run by one session whose intra-op threads (the device's
  cores; ONNX Runtime's, not Python's: no interpreter lock, no thread hand-off per subnet)
  compute each branch in turn; a subset of the outputs computes only their branches (copies
  hedged apart from the own groups).
* torch (CUDA graphs or eager): :func:`branches`, one module running every subnet on its own
  CUDA stream, forked from and joined back into the calling stream, the scores concatenated, so
  one captured graph per batch bucket holds them all: one copy in, one replay, one copy out.
* the sim runtime: :class:`SimDevice`, one simulated launch for all of its subnets.

A device of recipes that cannot share a call (mixed runtimes, a baseline's plain runners, the
tests' stand-ins) is :class:`EachRunner`: each subnet launched in turn, one wait for all.

Every device answers :meth:`launch(parts, groups) <DeviceRunner.launch>` with a launch whose
``result(g)`` is group ``g``'s rows (or raises that group's error) and whose ``inner`` are the
runner launches :func:`~.runners.wait_all` waits for; a launch never raises.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

from sensai.errors import CheckpointError, SensaiError

from .runners import Computed, OrtRunner, Runner, RunnerSpec, launch, torch_runner, wait_all
from .sim import SimRunner, sim_scores

log = logging.getLogger(__name__)


class DeviceLaunch:
    """One call of a device on some groups: ``inner``, the runner launches it made; ``pick(g)``
    group ``g``'s rows out of them."""

    __slots__ = ("inner", "picks")

    def __init__(self, inner: list, picks: Mapping[int, tuple[int, object]]):
        self.inner = inner
        self.picks = picks  # group -> (index into inner, how its rows are cut out: a slice, a key)

    @property
    def computed(self) -> bool:
        """Whether every launch computed as it was made (CPUs): then the call took its time."""
        return all(type(one).waits is None for one in self.inner)

    def result(self, g: int) -> np.ndarray:
        i, cut = self.picks[g]
        out = self.inner[i].result()
        if cut is None:
            return out
        if isinstance(cut, slice):
            return out[:, cut]
        return out[cut]


def wait_devices(launches: Sequence[DeviceLaunch]) -> None:
    """Wait once for every one of ``launches`` (see :func:`~.runners.wait_all`)."""
    wait_all([one for d in launches for one in d.inner])


class DeviceRunner:
    """The subnets of one device (``groups``, each ``widths[g]`` scores per row) in one call."""

    runtime = "?"
    overlaps = False  # whether a launch returns before its device is done (GPUs, sim)

    def __init__(self, groups: Sequence[int], widths: Mapping[int, int], *, device: str,
                 name: str):
        self.groups = tuple(groups)
        self.widths = dict(widths)
        self.device, self.name = device, name

    def launch(self, parts: Sequence[np.ndarray], groups: Sequence[int]) -> DeviceLaunch:
        raise NotImplementedError

    def run(self, x: np.ndarray, groups: Sequence[int] | None = None) -> dict[int, np.ndarray]:
        """Every group of ``groups`` (default: all) on ``x``, waited for."""
        groups = self.groups if groups is None else tuple(groups)
        one = self.launch((x,), groups)
        wait_devices((one,))
        return {g: one.result(g) for g in groups}

    def describe(self) -> dict:
        return {"kind": type(self).__name__, "groups": list(self.groups),
                "runtime": self.runtime, "device": self.device}


class EachRunner(DeviceRunner):
    """Each group's own runner, launched in turn (every launch before the one wait)."""

    def __init__(self, runners: Mapping[int, Runner], widths: Mapping[int, int] | None = None):
        self.runners = dict(runners)
        first = next(iter(self.runners.values()), None)
        super().__init__(list(self.runners), widths or {}, device=getattr(first, "device", "cpu"),
                         name="+".join(getattr(r, "name", "?") for r in self.runners.values()))
        self.runtime = getattr(first, "runtime", "?")
        self.overlaps = bool(self.runners) and all(getattr(r, "overlaps", False)
                                                   for r in self.runners.values())

    def launch(self, parts: Sequence[np.ndarray], groups: Sequence[int]) -> DeviceLaunch:
        return DeviceLaunch([launch(self.runners[g], parts) for g in groups],
                            {g: (i, None) for i, g in enumerate(groups)})


class SharedRunner(DeviceRunner):
    """One runner whose rows hold every group's scores side by side (``columns[g]``); it
    computes them all whatever the groups asked (a GPU runs the branches in parallel anyway)."""

    def __init__(self, runner: Runner, groups: Sequence[int], widths: Mapping[int, int],
                 columns: Mapping[int, slice]):
        super().__init__(groups, widths, device=runner.device, name=runner.name)
        self.runner = runner
        self.columns = dict(columns)
        self.runtime = runner.runtime
        self.overlaps = bool(getattr(runner, "overlaps", False))

    def launch(self, parts: Sequence[np.ndarray], groups: Sequence[int]) -> DeviceLaunch:
        return DeviceLaunch([launch(self.runner, parts)],
                            {g: (0, self.columns[g]) for g in groups})


class SimDevice(SharedRunner):
    """The sim runtime's device: one simulated launch for every subnet on it, each group's rows
    what :func:`~.sim.sim_scores` answers for it alone (the tests' reference)."""

    def __init__(self, specs: Mapping[int, RunnerSpec]):
        first = next(iter(specs.values()))
        widths = {g: max(1, s.num_outputs) for g, s in specs.items()}
        runner = SimRunner(input_shape=first.input_shape, num_outputs=max(widths.values()),
                           launch_ms=first.sim_launch_ms, name=device_name(specs),
                           device=first.device, batch_rows=first.batch_rows)
        super().__init__(runner, list(specs), widths,
                         {g: slice(0, w) for g, w in widths.items()})


class OrtDevice(DeviceRunner):
    """One ONNX Runtime session of every subnet's graph (:func:`merge_branches`), an output per
    group; a call computes only the branches of the groups it asks for."""

    runtime = "onnx"

    def __init__(self, specs: Mapping[int, RunnerSpec], *, cores: int = 1):
        first = next(iter(specs.values()))
        widths = {g: s.num_outputs for g, s in specs.items()}
        super().__init__(list(specs), widths, device=first.device, name=device_name(specs))
        if len(specs) == 1:
            model, outputs = first.onnx_bytes(), None
        else:
            model, outputs = merge_branches({g: s.onnx_bytes() for g, s in specs.items()})
        # The device's cores as intra-op threads, every branch in turn: they share each
        # operator's work, where ONNX Runtime's parallel executor (a branch per core) overlaps
        # whole branches at a scheduling cost that a device's few cores do not win back
        # (BENCHMARKS.md, "One device's executor").
        self.runner = OrtRunner(model, threads=max(first.threads, cores), device=first.device,
                                name=self.name,
                                num_outputs=(first.num_outputs or None) if len(specs) == 1
                                else None)
        names = self.runner.output_names
        self.outputs = {g: names[i] for i, g in enumerate(specs)} if outputs is None else outputs
        shapes = {o.name: o.shape for o in self.runner.session.get_outputs()}
        for g, s in specs.items():  # refused at load, not on every request
            shape = shapes.get(self.outputs[g])
            width = shape[-1] if shape else None
            if s.num_outputs and isinstance(width, int) and width != s.num_outputs:
                raise CheckpointError(f"{s.onnx_path or s.name} gives {width} outputs per "
                                      f"image, the manifest says {s.num_outputs}")

    def launch(self, parts: Sequence[np.ndarray], groups: Sequence[int]) -> DeviceLaunch:
        try:
            x = parts[0] if len(parts) == 1 else np.concatenate(parts)
            names = [self.outputs[g] for g in groups]
            outs = self.runner.run_outputs(x, names)
            one = Computed(dict(zip(groups, outs)))
        except Exception as e:  # a failing call is its requests' failure, not the worker's
            one = Computed(error=e)
        return DeviceLaunch([one], {g: (0, g) for g in groups})


def device_name(specs: Mapping[int, RunnerSpec]) -> str:
    return "+".join(s.name for s in specs.values())


def merge_branches(models: Mapping[int, bytes]) -> tuple[bytes, dict[int, str]]:
    """One ONNX model of several subnets' graphs side by side: the first's input fed to every
    branch, each branch's output kept (group -> its output's name).  Names are prefixed per
    branch so that nothing of one collides with another's."""
    import onnx
    from onnx import compose, helper

    loaded = {g: onnx.load_from_string(b) for g, b in models.items()}
    first = next(iter(loaded.values()))
    shared = first.graph.input[0]
    nodes, inits, infos, outputs, names = [], [], [], [], {}
    opsets: dict[str, int] = {}
    for g, m in loaded.items():
        if len(m.graph.input) != 1 or len(m.graph.output) != 1:
            raise CheckpointError(f"a subnet's ONNX graph has {len(m.graph.input)} inputs and "
                                  f"{len(m.graph.output)} outputs; expected one of each")
        m = compose.add_prefix(m, prefix=f"g{g}.")
        own = m.graph.input[0].name
        for node in m.graph.node:
            for i, name in enumerate(node.input):
                if name == own:
                    node.input[i] = shared.name
        for op in m.opset_import:
            opsets[op.domain] = max(opsets.get(op.domain, 0), op.version)
        nodes += m.graph.node
        inits += m.graph.initializer
        infos += m.graph.value_info
        outputs.append(m.graph.output[0])
        names[g] = m.graph.output[0].name
    graph = helper.make_graph(nodes, "device", [shared], outputs, initializer=inits,
                              value_info=infos)
    merged = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v)
                                                     for d, v in opsets.items()])
    merged.ir_version = max(m.ir_version for m in loaded.values())
    return merged.SerializeToString(), names


def torch_device(specs: Mapping[int, RunnerSpec]) -> SharedRunner:
    """Every subnet of the recipes as one torch module (:func:`branches`), run as the runtime
    asks (CUDA graphs: one graph per bucket holding every branch)."""
    import torch

    first = next(iter(specs.values()))
    models = [s.torch_model() for s in specs.values()]
    widths = {g: s.num_outputs for g, s in specs.items()}
    if first.device == "cpu":
        torch.set_num_threads(max(1, first.threads))  # as a lone subnet's runner does
    module = branches(models, torch.device(first.device))
    runner = torch_runner(module, device=first.device, runtime=first.runtime,
                          name=device_name(specs), input_shape=first.input_shape,
                          batch_rows=first.batch_rows, gpu_wait=first.gpu_wait)
    at, columns = 0, {}
    for g, w in widths.items():
        columns[g] = slice(at, at + w)
        at += w
    return SharedRunner(runner, list(specs), widths, columns)


def branches(models, device):
    """A :class:`Branches` module of ``models`` on ``device`` (the class is made where torch is
    imported: ONNX-only workers never import it)."""
    import torch

    class Branches(torch.nn.Module):
        """Several networks on one input, their scores side by side; on a CUDA device each on a
        stream of its own, forked from and joined back into the calling stream (which is what a
        CUDA graph captured around it then replays, in parallel)."""

        def __init__(self, models, device):
            super().__init__()
            self.nets = torch.nn.ModuleList(models)
            self.streams = ([torch.cuda.Stream(device) for _ in models]
                            if device.type == "cuda" and len(models) > 1 else None)

        def forward(self, x):
            if self.streams is None:
                return torch.cat([net(x).float().reshape(len(x), -1) for net in self.nets], 1)
            caller = torch.cuda.current_stream(x.device)
            outs = []
            for net, stream in zip(self.nets, self.streams):
                stream.wait_stream(caller)
                with torch.cuda.stream(stream):
                    outs.append(net(x).float().reshape(len(x), -1))
            for stream in self.streams:
                caller.wait_stream(stream)
            return torch.cat(outs, 1)

    return Branches(models, device)


def build_device(hosted: Sequence[tuple[int, RunnerSpec]], *, cores: int = 1) -> DeviceRunner:
    """The one-call runner of the (group, recipe) pairs one device hosts; ``cores``: the CPU
    cores the device has (its executor's threads).  Recipes that cannot share a call (mixed
    runtimes or devices, a baseline's modules) are computed one after the other."""
    if not hosted:
        raise SensaiError("a device needs at least one subnet")
    specs = dict(hosted)
    kinds = {(s.resolved_runtime(), s.device) for s in specs.values()}
    runtime = next(iter(kinds))[0]
    if len(kinds) > 1 or any(s.module is not None for s in specs.values()):
        device: DeviceRunner = EachRunner({g: s.build() for g, s in specs.items()},
                                          {g: s.num_outputs for g, s in specs.items()})
    elif runtime == "sim":
        device = SimDevice(specs)
    elif runtime == "onnx":
        device = OrtDevice(specs, cores=cores)
    else:
        device = torch_device(specs)
    if next(iter(specs.values())).warmup:
        # The first call allocates buffers (and compiles kernels on GPUs); done now, so the
        # first request does not pay for it.
        device.run(np.zeros((1, *next(iter(specs.values())).input_shape), dtype=np.float32))
    return device


def as_device(runners) -> DeviceRunner:
    """A worker's runners as one device: a :class:`DeviceRunner` as it is, a mapping of group ->
    runner (a baseline's, the tests' stand-ins) as :class:`EachRunner`."""
    return runners if isinstance(runners, DeviceRunner) else EachRunner(runners)


def reference_scores(specs: Mapping[int, RunnerSpec], x: np.ndarray) -> dict[int, np.ndarray]:
    """Each subnet alone on ``x``, one call each (the tests' and benchmark's reference)."""
    out = {}
    for g, s in specs.items():
        if s.resolved_runtime() == "sim":
            out[g] = sim_scores(x, max(1, s.num_outputs))
        else:
            out[g] = np.asarray(s.build().run(x), dtype=np.float32)
    return out

"""Runners: one network on one device, called with a numpy batch, answering numpy.

Everything that executes a subnet, a model-parallel stage or a whole model for serving or the
benchmark goes through a runner, so the strategies compare like with like.

* :class:`OrtRunner` - ONNX Runtime; CPU by default (faster than torch eager at batch 1 on small
  CNNs, see BENCHMARKS.md), CUDA execution provider on a GPU when that provider is installed.
* :class:`TorchRunner` - torch eager.
* :class:`~sensai.serving.workers.graphs.GraphRunner` - torch replayed from CUDA graphs: the default
  on CUDA devices, falling back to eager (with a warning) where a network cannot be captured.
* :class:`~sensai.serving.workers.sim.SimRunner` - a simulated GPU (``--runtime sim``): a fixed
  time per launch whatever the rows, for measuring the serving path without one.

Besides ``run``, a runner may :meth:`~Runner.launch` a batch given as the requests' parts and
return before its device is done (CUDA graphs, the simulated GPU); :func:`launch` gives every
runner that interface (the others compute then and there), and :func:`wait_all` waits once for
a batch's launches on all of a device's runners.

A :class:`RunnerSpec` is the picklable recipe of one runner (for worker processes and Ray actors):
it is built where the runner will live, and checks the file it loads against the manifest's hash
there.  The device is picked at run time; nothing calls ``.cuda()`` directly.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from sensai.artifact import Artifact, verify_bytes, verify_file
from sensai.errors import CheckpointError, SensaiError, first_line
from sensai.models import device_for_worker, is_factory_path

from ..core.errors import GraphCaptureError
from ..core.settings import RUNTIMES, SIM_LAUNCH_MS, default_batch_rows
from .graphs import GraphRunner, buckets_up_to
from .sim import SimRunner

log = logging.getLogger(__name__)



class Computed:
    """A launch that computed as it was made: its output, or the error it raised."""

    __slots__ = ("out", "error")
    waits = None

    def __init__(self, out: np.ndarray | None = None, error: Exception | None = None):
        self.out, self.error = out, error

    def result(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        return self.out


def launch(runner: "Runner", parts: Sequence[np.ndarray]):
    """``runner`` started on ``parts`` stacked in order: a launch whose ``result()`` is the
    output (or raises the runner's error).  A runner's own ``launch`` may return before the
    device is done; a runner without one computes now."""
    own = getattr(runner, "launch", None)
    try:
        if own is not None:
            return own(parts)
        return Computed(runner.run(parts[0] if len(parts) == 1 else np.concatenate(parts)))
    except Exception as e:  # a subnet failing is its requests' failure, not the worker's
        return Computed(error=e)


def wait_all(launches) -> None:
    """Wait for every one of ``launches``: once per kind of device (see :func:`launch`)."""
    kinds: dict = {}
    for one in launches:
        waits = type(one).waits
        if waits is not None:
            kinds.setdefault(waits, []).append(one)
    for waits, those in kinds.items():
        waits(those)


def resolve_runtime(runtime: str, device: str, *, has_onnx: bool = True) -> str:
    """``auto``: ONNX Runtime on CPUs (where an ONNX file exists), CUDA graphs on GPUs, torch
    eager otherwise; an explicit runtime as given."""
    if runtime != "auto":
        return runtime
    if str(device).startswith("cuda"):
        return "cuda-graph"
    return "onnx" if has_onnx else "torch"


def torch_runner(model, *, device: str, runtime: str, name: str, input_shape: Sequence[int],
                 batch_rows: int = 1, gpu_wait: str = "spin") -> "Runner":
    """The torch network as the runtime asks: CUDA graphs, one per batch-size bucket up to
    ``batch_rows`` (``auto`` on a GPU falls back to eager, with a warning, when capture fails;
    an explicit ``cuda-graph`` fails instead) or eager."""
    chosen = resolve_runtime(runtime, device, has_onnx=False)
    if chosen != "cuda-graph":
        return TorchRunner(model, device=device, name=name)
    try:
        return GraphRunner(model, device=device, input_shape=input_shape, name=name,
                           buckets=buckets_up_to(batch_rows), wait=gpu_wait)
    except GraphCaptureError as e:
        if runtime == "cuda-graph":
            raise CheckpointError(f"{e}; use --runtime torch") from None
        log.warning("%s; running it eagerly", e)
        return TorchRunner(model, device=device, name=name)


class Runner(Protocol):
    name: str
    device: str
    runtime: str

    def run(self, x: np.ndarray) -> np.ndarray: ...

    # Optional (see :func:`launch`): ``launch(parts)`` -> an object with ``result()``, whose
    # class's ``waits(launches)`` waits for several at once.


class OrtRunner:
    runtime = "onnx"

    def __init__(self, onnx: str | Path | bytes, *, threads: int = 1, device: str = "cpu",
                 name: str | None = None, num_outputs: int | None = None):
        import onnxruntime as ort  # only the onnx runtime needs it

        opts = ort.SessionOptions()
        # One intra-op thread by default: intra-op threads of several sessions on few cores
        # only fight each other; a device's one session gets the device's cores.
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers: list = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise CheckpointError("device is CUDA but onnxruntime has no "
                                      "CUDAExecutionProvider (install onnxruntime-gpu or use the "
                                      "torch runtime)")
            index = int(device.split(":")[1]) if ":" in device else 0
            providers = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        what = name or (f"{len(onnx)} bytes of ONNX" if isinstance(onnx, bytes) else onnx)
        try:
            self.session = ort.InferenceSession(onnx if isinstance(onnx, bytes) else str(onnx),
                                                sess_options=opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own types for unreadable graphs
            raise CheckpointError(f"onnxruntime cannot load {what}: "
                                  f"{first_line(e)}") from None
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]
        out = self.session.get_outputs()[0]
        self.output_name = out.name
        width = out.shape[-1] if out.shape else None
        if num_outputs is not None and isinstance(width, int) and width != num_outputs:
            raise CheckpointError(f"{what} gives {width} outputs per image, the manifest "
                                  f"says {num_outputs}")
        self.name = name or (Path(onnx).stem if not isinstance(onnx, bytes) else "onnx")
        self.device = device

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run([self.output_name], {self.input_name: x})[0]

    def run_outputs(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        """The outputs ``names`` on ``x``: only the nodes they need are computed."""
        return self.session.run(list(names), {self.input_name: x})


class TorchRunner:
    runtime = "torch"

    def __init__(self, model, *, device: str = "cpu", name: str = "model"):
        import torch

        self._torch = torch
        self.device = device
        dev = torch.device(device)
        self.model = model.eval().to(dev)
        self.name = name
        # Its own stream, as the graph runner has: workers sharing a GPU overlap, not queue.
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def run(self, x: np.ndarray) -> np.ndarray:
        torch = self._torch
        if not x.flags.writeable:
            x = np.array(x)  # arrays from Ray or shared buffers are read-only; torch wants its own
        with torch.inference_mode():
            if self.stream is None:
                return self.model(torch.from_numpy(x)).float().numpy()
            with torch.cuda.stream(self.stream):
                out = self.model(torch.from_numpy(x).to(self.device, non_blocking=True))
                # .cpu() waits for this stream, so the caller's clock covers the computation.
                return out.float().cpu().numpy()


@dataclass(frozen=True)
class RunnerSpec:
    """Everything needed to build one subnet's runner, picklable.

    ``runtime="auto"``: ONNX Runtime when the device is a CPU and an ONNX file exists, CUDA
    graphs on GPUs, torch eager otherwise (see :func:`resolve_runtime`).  The torch network is
    rebuilt from its safetensors weights - nothing is unpickled; an architecture given as
    ``package.module:factory`` is imported only with ``trust_code``.  Or it is ``module``, a
    torch module run as it is (the benchmark's pipeline stages, which have no weights file of
    their own): such a recipe serves thread workers only, since a module is copied, never
    pickled.
    """

    name: str
    input_shape: tuple[int, ...]
    device: str = "cpu"
    runtime: str = "auto"
    threads: int = 1
    onnx_path: str | None = None
    onnx_sha256: str | None = None
    arch: str | None = None
    num_outputs: int = 0
    in_channels: int = 0
    weights_path: str | None = None
    weights_sha256: str | None = None
    trust_code: bool = False
    warmup: bool = True
    batch_rows: int = 1  # the most rows its worker batches (CUDA graphs: one per bucket)
    gpu_wait: str = "spin"  # how the host waits for a CUDA graph: spin or sleep
    sim_launch_ms: float = SIM_LAUNCH_MS  # the simulated GPU's time per launch
    # The files' contents (bytes, or Ray object refs to them) for workers that may not see the
    # artifact's directory, e.g. Ray actors on other nodes; checked against the hashes there.
    onnx_blob: Any = None
    weights_blob: Any = None
    module: Any = None

    def resolved_runtime(self) -> str:
        return resolve_runtime(self.runtime, self.device, has_onnx=bool(self.onnx_path))

    def build(self) -> Runner:
        if self.resolved_runtime() == "sim":
            runner: Runner = SimRunner(input_shape=self.input_shape, num_outputs=self.num_outputs,
                                       launch_ms=self.sim_launch_ms, name=self.name,
                                       device=self.device, batch_rows=self.batch_rows)
        elif self.resolved_runtime() == "onnx":
            if not self.onnx_path:
                raise CheckpointError(f"{self.name} has no ONNX file; use the torch runtime")
            runner = OrtRunner(self.onnx_bytes(), threads=self.threads, device=self.device,
                               name=self.name, num_outputs=self.num_outputs or None)
        else:
            # torch only on this branch: ONNX-only workers never import it.
            import torch

            if self.device == "cpu":
                # Several CPU workers in one process share torch's intra-op pool; keep it small
                # so they do not oversubscribe the cores.
                torch.set_num_threads(max(1, self.threads))
            runner = torch_runner(self.torch_model(), device=self.device, runtime=self.runtime,
                                  name=self.name, input_shape=self.input_shape,
                                  batch_rows=self.batch_rows, gpu_wait=self.gpu_wait)
        if self.warmup:
            # The first run allocates buffers (and compiles kernels on GPUs); do it now so the
            # first request does not pay for it.
            runner.run(np.zeros((1, *self.input_shape), dtype=np.float32))
        return runner

    def onnx_bytes(self) -> bytes:
        """The subnet's ONNX graph, read once and checked against its hash (shipped or from its
        file)."""
        if not self.onnx_path:
            raise CheckpointError(f"{self.name} has no ONNX file; use the torch runtime")
        if self.onnx_blob is not None:
            return verify_bytes(fetch(self.onnx_blob), self.onnx_sha256,
                                f"ONNX file of {self.name} ({self.onnx_path})")
        if not self.onnx_sha256:
            raise CheckpointError(f"ONNX file {self.onnx_path} has no sha256 in the manifest; "
                                  "refusing to load what cannot be checked")
        path = Path(self.onnx_path)
        if not path.is_file():
            raise CheckpointError(f"ONNX file {path} does not exist")
        return verify_bytes(path.read_bytes(), self.onnx_sha256, f"ONNX file {path}")

    def torch_model(self):
        """The torch network: a copy of ``module`` (the worker's own), or rebuilt from the
        weights, checked against their hash first."""
        if self.module is not None:
            return copy.deepcopy(self.module)
        from sensai.checkpoint import build_from_weights, load_weights

        if not (self.arch and self.weights_path):
            raise CheckpointError(f"{self.name} has no weights to build a torch runner from")
        if self.weights_blob is not None:
            from safetensors.torch import load as load_safetensors

            data = verify_bytes(fetch(self.weights_blob), self.weights_sha256,
                                f"weights of {self.name} ({self.weights_path})")
            state = load_safetensors(data)
        else:
            path = verify_file(Path(self.weights_path), self.weights_sha256, "weights file")
            state = load_weights(path, self.weights_sha256)
        return build_from_weights(self.arch, self.num_outputs, self.in_channels, state,
                                  f"weights of {self.name} ({self.weights_path})",
                                  trust_code=self.trust_code)

    def shipped(self, put) -> "RunnerSpec":
        """This spec with its files' contents attached (``put``: e.g. ``ray.put``), read and
        checked here first."""
        onnx = weights = None
        if self.onnx_path:
            onnx = put(verify_file(Path(self.onnx_path), self.onnx_sha256,
                                   "ONNX file").read_bytes())
        if self.weights_path and Path(self.weights_path).is_file():
            weights = put(verify_file(Path(self.weights_path), self.weights_sha256,
                                      "weights file").read_bytes())
        return replace(self, onnx_blob=onnx, weights_blob=weights)

    def describe(self) -> dict:
        d = {k: v for k, v in fields_of(self).items() if k in ("name", "device", "threads")}
        d["runtime"] = self.resolved_runtime()
        return d


def fields_of(spec: RunnerSpec) -> dict:
    return {k: getattr(spec, k) for k in spec.__dataclass_fields__}


def fetch(blob) -> bytes:
    """A shipped file's bytes: as given, or from Ray's object store (on a Ray worker)."""
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return bytes(blob)
    import ray  # only Ray ships object refs

    return ray.get(blob)


def runner_specs(artifact: Artifact, *, device: str = "auto", runtime: str = "auto",
                 threads: int = 1, trust_code: bool = False, batch_rows: int | None = 1,
                 gpu_wait: str = "spin", sim_launch_ms: float = SIM_LAUNCH_MS) -> list[RunnerSpec]:
    """One :class:`RunnerSpec` per subnet of an artifact, devices round robin over GPUs.
    ``batch_rows``: the most rows a batch of its worker holds (None: the default of its device,
    :func:`~sensai.serving.core.settings.default_batch_rows`).

    Refuses now, with one line, what would fail later: an unknown runtime, a missing file, and
    an architecture that names code when the torch runtime would import it without consent."""
    if runtime not in RUNTIMES:
        raise SensaiError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    m = artifact.manifest
    specs = []
    if runtime == "cuda-graph" and not str(device).startswith("cuda") and device != "auto":
        raise SensaiError(f"the cuda-graph runtime needs a CUDA device, not {device!r}")
    for s in artifact.subnets:
        spec = RunnerSpec(
            name=s.name, input_shape=tuple(m.dataset.input_shape),
            device=str(device_for_worker(s.index, device)), runtime=runtime, threads=threads,
            onnx_path=str(s.onnx) if s.onnx else None, onnx_sha256=s.onnx_sha256, arch=m.model,
            num_outputs=s.num_outputs, in_channels=m.in_channels, weights_path=str(s.weights),
            weights_sha256=s.weights_sha256, trust_code=trust_code, gpu_wait=gpu_wait,
            sim_launch_ms=sim_launch_ms)
        chosen = spec.resolved_runtime()
        spec = replace(spec, batch_rows=batch_rows or default_batch_rows(spec.device, chosen))
        if chosen == "sim":
            pass  # a simulated GPU reads no file
        elif chosen == "onnx":
            if not (s.onnx and s.onnx.is_file()):
                raise CheckpointError(f"ONNX file {s.onnx} of {s.name} does not exist")
        else:
            if not s.weights.is_file():
                raise CheckpointError(f"weights file {s.weights} of {s.name} does not exist")
            if is_factory_path(m.model) and not trust_code:
                raise CheckpointError(
                    f"the manifest's architecture {m.model!r} is code the torch runtime would "
                    "import; pass --trust-model-code (a command without that flag: set "
                    "SENSAI_TRUST_MODEL_CODE=1) if you trust this artifact, or use the onnx "
                    "runtime")
        specs.append(spec)
    return specs

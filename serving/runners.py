"""Runners: one network on one device, called with a numpy batch, answering numpy.

Everything that executes a subnet, a model-parallel stage or a whole model for serving or the
benchmark goes through a runner, so the strategies compare like with like.

* :class:`OrtRunner` - ONNX Runtime; CPU by default (1.5-3x faster than torch eager at batch 1 on
  small CNNs), CUDA execution provider on a GPU when that provider is installed.
* :class:`TorchRunner` - torch eager, for GPUs without onnxruntime-gpu.

The device is picked at run time by :func:`make_runner`; nothing calls ``.cuda()`` directly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


class Runner(Protocol):
    name: str
    device: str

    def run(self, x: np.ndarray) -> np.ndarray: ...


class OrtRunner:
    def __init__(self, onnx_path: str | Path, *, threads: int = 1, device: str = "cpu",
                 name: str | None = None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # One thread per worker: parallelism comes from running workers side by side, and
        # intra-op threads of several sessions on few cores only fight each other.
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers: list = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("device is CUDA but onnxruntime has no CUDAExecutionProvider "
                                   "(install onnxruntime-gpu or use the torch runtime)")
            index = int(device.split(":")[1]) if ":" in device else 0
            providers = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=providers)
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.name = name or Path(onnx_path).stem
        self.device = device

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run([self.output_name], {self.input_name: x})[0]


class TorchRunner:
    def __init__(self, model, *, device: str = "cpu", name: str = "model"):
        import torch

        self._torch = torch
        self.device = device
        self.model = model.eval().to(torch.device(device))
        self.name = name

    def run(self, x: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            out = self.model(torch.from_numpy(x).to(self.device, non_blocking=True))
        return out.float().cpu().numpy()


def make_runner(*, onnx_path: str | Path | None = None, model=None, device: str = "cpu",
                threads: int = 1, runtime: str = "auto", name: str | None = None) -> Runner:
    """ONNX Runtime when an ONNX file is given and the runtime can use ``device``; else torch."""
    if runtime not in ("auto", "onnx", "torch"):
        raise ValueError(f"unknown runtime {runtime!r}")
    if runtime in ("auto", "onnx") and onnx_path is not None:
        try:
            return OrtRunner(onnx_path, threads=threads, device=device, name=name)
        except RuntimeError as e:
            if runtime == "onnx" or model is None:
                raise
            log.info("falling back to torch for %s: %s", name or onnx_path, e)
    if model is None:
        raise ValueError("a torch model is needed for the torch runtime")
    return TorchRunner(model, device=device, name=name or "model")

"""A Triton Inference Server model repository for an artifact (``sensai export-triton``).

:func:`export_triton_repo` writes one Triton model per subnet (``sensai_subnet_00`` ...), each
``config.pbtxt`` + ``1/model.onnx``; where the ONNX batch axis is dynamic the model batches,
with Triton's dynamic batcher on.  ``backend="onnxruntime"`` is the normal choice for a Triton
container; ``backend="python"`` adds a ``1/model.py`` that runs the same ONNX file with ONNX
Runtime inside Triton's Python backend - for servers that ship only that backend, like the
``tritonserver`` binary inside the ``nvidia-pytriton`` wheel.  Every ONNX file is checked against
the manifest's hash (and must lie inside the artifact) before it is copied.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sensai.artifact import load_artifact, subnet_name, verify_file
from sensai.errors import CheckpointError, SensaiError
from sensai.fsutil import check_out_dir, overlap, sha256_file

log = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "python")
INSTANCE_KINDS = ("auto", "cpu", "gpu")
MODEL_PREFIX = "sensai_"

_ONNX_TO_TRITON = {1: "TYPE_FP32", 10: "TYPE_FP16", 11: "TYPE_FP64", 6: "TYPE_INT32",
                   7: "TYPE_INT64", 2: "TYPE_UINT8", 3: "TYPE_INT8", 9: "TYPE_BOOL"}

# Runs the exported ONNX file with ONNX Runtime inside Triton's Python backend.
PYTHON_MODEL = '''\
"""sensai subnet for Triton's Python backend: ONNX Runtime on the model.onnx beside this file."""

import ctypes
import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class _Capsule:
    """Hands a DLPack capsule to numpy.from_dlpack (legacy, unversioned protocol)."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, *args, **kwargs):
        if kwargs.get("max_version") is not None:
            raise TypeError("only the legacy DLPack capsule is available")
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _as_numpy(tensor):
    # The stub's as_numpy() is compiled against one NumPy ABI and returns wrong values under the
    # other (NumPy 2 with the nvidia-pytriton stub); DLPack works with both.
    try:
        return np.from_dlpack(_Capsule(tensor.to_dlpack()))
    except Exception:
        return tensor.as_numpy()


_USED = ctypes.c_char_p(b"used_dltensor")  # kept alive: the capsule keeps a pointer to it
ctypes.pythonapi.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_numpy(name, arr):
    # Same ABI problem in the other direction (an ndarray arrives empty): hand the stub a DLPack
    # capsule.  The stub takes ownership and renames it "used_dlpack"; give it the name NumPy's
    # capsule destructor expects for a consumed capsule, or it reports an error at collection.
    capsule = arr.__dlpack__()
    tensor = pb_utils.Tensor.from_dlpack(name, capsule)
    ctypes.pythonapi.PyCapsule_SetName(capsule, _USED)
    return tensor


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        here = os.path.join(args["model_repository"], args["model_version"])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(params.get("intra_op_threads", "1"))
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if args.get("model_instance_kind") == "GPU" and \\
                "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider",
                                 {"device_id": int(args["model_instance_device_id"])}))
        self.session = ort.InferenceSession(os.path.join(here, "model.onnx"), opts,
                                            providers=providers)
        self.input_name = config["input"][0]["name"]
        self.output_name = config["output"][0]["name"]

    def run(self, x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        return self.session.run([self.output_name], {self.input_name: x})[0]

    def execute(self, requests):
        xs = [_as_numpy(pb_utils.get_input_tensor_by_name(r, self.input_name)) for r in requests]
        ys = None
        # Triton's dynamic batcher hands over the requests it batched: one run for all of them
        # when their inputs stack; else, or when that run fails, one run per request, so that
        # only a request that fails alone fails.
        stackable = len(xs) > 1 and all(x.ndim >= 1 for x in xs) and len(
            {(x.shape[1:], x.dtype) for x in xs}) == 1
        if stackable:
            sizes = [len(x) for x in xs]
            try:
                y = self.run(np.concatenate(xs))
                if len(y) == sum(sizes):
                    ys = np.split(y, np.cumsum(sizes)[:-1])
            except Exception:
                ys = None
        responses = []
        for i, x in enumerate(xs):
            try:
                y = ys[i] if ys is not None else self.run(x)
                out = _from_numpy(self.output_name, np.ascontiguousarray(y, dtype=np.float32))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as e:  # one bad request must not take the model down
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses
'''


def triton_model_name(index: int, prefix: str = MODEL_PREFIX) -> str:
    return f"{prefix}{subnet_name(index)}"


@dataclass
class _TensorInfo:
    name: str
    data_type: str
    dims: list[int]  # -1 for a dynamic dimension
    elem_type: int


def _onnx_io(path: Path) -> tuple[list[_TensorInfo], list[_TensorInfo]]:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise CheckpointError(f"cannot read ONNX file {path}: {e}") from None
    inits = {i.name for i in model.graph.initializer}

    def info(v) -> _TensorInfo:
        t = v.type.tensor_type
        if t.elem_type not in _ONNX_TO_TRITON:
            raise CheckpointError(f"{path}: tensor {v.name!r} has an ONNX type Triton export "
                                  f"does not handle ({t.elem_type})")
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        return _TensorInfo(v.name, _ONNX_TO_TRITON[t.elem_type], dims, t.elem_type)

    ins = [info(v) for v in model.graph.input if v.name not in inits]
    outs = [info(v) for v in model.graph.output]
    if len(ins) != 1 or len(outs) != 1:
        raise CheckpointError(f"{path}: a subnet must have one input and one output, found "
                              f"{len(ins)} and {len(outs)}")
    return ins, outs


def _pbtxt_tensor(t: _TensorInfo, batched: bool) -> str:
    dims = t.dims[1:] if batched else t.dims
    return (f'  {{\n    name: "{t.name}"\n    data_type: {t.data_type}\n'
            f'    dims: [ {", ".join(str(d) for d in dims)} ]\n  }}')


def model_config(name: str, backend: str, inp: _TensorInfo, out: _TensorInfo, *,
                 max_batch_size: int, instance_kind: str, gpu: int | None,
                 threads: int = 1) -> str:
    """The ``config.pbtxt`` of one subnet model (protobuf text format)."""
    batched = max_batch_size > 0
    lines = [f'name: "{name}"', f'backend: "{backend}"', f"max_batch_size: {max_batch_size}",
             "input [", _pbtxt_tensor(inp, batched), "]",
             "output [", _pbtxt_tensor(out, batched), "]"]
    kind = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}[instance_kind]
    group = f"  {{\n    count: 1\n    kind: {kind}"
    if gpu is not None:
        group += f"\n    gpus: [ {gpu} ]"
    lines += ["instance_group [", group + "\n  }", "]"]
    if batched:
        # Triton's dynamic batcher: requests queued for the model run as one batch; by default
        # it batches only what is queued already, never delaying a request alone.
        lines += ["dynamic_batching { }"]
    if backend == "python":
        lines += ["parameters [", '  {\n    key: "intra_op_threads"\n'
                  f'    value: {{ string_value: "{max(1, threads)}" }}\n  }}', "]"]
    else:
        # One intra-op thread per instance: subnets run side by side, like the local pool.
        lines += ["parameters [", '  {\n    key: "intra_op_thread_count"\n'
                  f'    value: {{ string_value: "{max(1, threads)}" }}\n  }}', "]"]
    return "\n".join(lines) + "\n"


def write_model(repo: str | Path, name: str, onnx: str | Path, *, backend: str,
                max_batch_size: int = 64, instance_kind: str = "auto", gpu: int | None = None,
                threads: int = 1, num_outputs: int | None = None,
                sha256: str | None = None) -> None:
    """One Triton model ``repo/name`` (``config.pbtxt`` + ``1/model.onnx``, and ``1/model.py``
    for the Python backend) running the ONNX file ``onnx`` - a subnet, or any one-input
    one-output model such as the original one ``sensai bench --peers triton`` serves.
    ``sha256``: the copy must have this hash; ``num_outputs``: the output's width."""
    mdir = Path(repo) / name
    (mdir / "1").mkdir(parents=True)
    copy = mdir / "1" / "model.onnx"
    shutil.copyfile(onnx, copy)
    if sha256 is not None and sha256_file(copy) != sha256:  # replaced while we copied it
        raise CheckpointError(f"ONNX file {onnx} changed while it was exported")
    ins, outs = _onnx_io(copy)
    inp, o = ins[0], outs[0]
    if max_batch_size > 0 and (not inp.dims or inp.dims[0] != -1 or not o.dims
                               or o.dims[0] != -1):
        log.warning("%s: ONNX batch dimension is fixed; exporting without batching", name)
        max_batch_size = 0
    if num_outputs is not None and o.dims and o.dims[-1] not in (-1, num_outputs):
        raise CheckpointError(f"{name}: ONNX output has {o.dims[-1]} values, the manifest "
                              f"says {num_outputs}")
    kind = "gpu" if gpu is not None else instance_kind
    if backend == "python":
        (mdir / "1" / "model.py").write_text(PYTHON_MODEL, encoding="utf-8")
    (mdir / "config.pbtxt").write_text(
        model_config(name, backend, inp, o, max_batch_size=max_batch_size, instance_kind=kind,
                     gpu=gpu, threads=threads), encoding="utf-8")


def check_replaceable(out: Path, artifact_root: Path, overwrite: bool) -> None:
    """What ``--overwrite`` may replace: a Triton model repository (every entry a model folder
    with its config.pbtxt), never the artifact it is made from nor any other folder's files."""
    if not overwrite:
        raise SensaiError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    if overlap(out, artifact_root):
        raise SensaiError(f"--out {out} holds the artifact itself, or lies in it: write the "
                          "repository to another folder")
    foreign = sorted(p.name for p in out.iterdir()
                     if not (p.is_dir() and (p / "config.pbtxt").is_file()))
    if foreign:
        raise SensaiError(f"--overwrite replaces a Triton model repository only, and {out} "
                          f"holds {foreign[0]!r}, which is no model of one: choose another "
                          "--out, or empty it first")


def export_triton_repo(artifact_dir: str | Path, out_dir: str | Path, *,
                       backend: str = "onnxruntime", max_batch_size: int = 64,
                       instance_kind: str = "auto", gpus: int = 0, threads: int = 1,
                       prefix: str = MODEL_PREFIX, overwrite: bool = False) -> list[str]:
    """Write a Triton model repository for an artifact; returns the model names (subnet order).

    ``gpus > 0`` pins subnet ``i`` to GPU ``i % gpus`` (``KIND_GPU``), like the local pool's round
    robin; otherwise ``instance_kind`` decides (``auto``: Triton's choice).  The repository is
    built in a temporary directory and renamed into place, so a failed export leaves nothing.
    """
    if backend not in BACKENDS:
        raise SensaiError(f"unknown Triton backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if instance_kind not in INSTANCE_KINDS:
        raise SensaiError(f"unknown instance kind {instance_kind!r}; choose one of "
                          f"{', '.join(INSTANCE_KINDS)}")
    if not 0 <= max_batch_size < 2**31 or gpus < 0:  # Triton's max_batch_size is an int32
        raise SensaiError("--max-batch-size must be from 0 to 2147483647 and --gpus >= 0")
    if threads < 1:
        raise SensaiError(f"--threads must be at least 1, got {threads}")
    out = check_out_dir(out_dir, "model repository")
    artifact = load_artifact(artifact_dir)
    if out.exists() and any(out.iterdir()):
        check_replaceable(out, artifact.root, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    names = []
    try:
        for s in artifact.subnets:
            if s.onnx is None:
                raise CheckpointError(f"subnet {s.index} has no ONNX file in {artifact.root}; "
                                      "re-run decompose with ONNX export")
            name = triton_model_name(s.index, prefix)
            verify_file(s.onnx, s.onnx_sha256, "ONNX file")
            write_model(tmp, name, s.onnx, backend=backend, max_batch_size=max_batch_size,
                        instance_kind=instance_kind, gpu=s.index % gpus if gpus > 0 else None,
                        threads=threads, num_outputs=s.num_outputs, sha256=s.onnx_sha256)
            names.append(name)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the repository from a non-root server
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("Triton repository with %d %s models -> %s", len(names), backend, out)
    return names

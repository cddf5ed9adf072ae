"""Triton Inference Server: export an artifact as a model repository, run it, call it.

* :func:`export_triton_repo` writes one Triton model per subnet (``sensai_subnet_00`` ...), each
  ``config.pbtxt`` + ``1/model.onnx``.  ``backend="onnxruntime"`` is the normal choice for a
  Triton container; ``backend="python"`` adds a ``1/model.py`` that runs the same ONNX file with
  ONNX Runtime inside Triton's Python backend - for servers that ship only that backend, like the
  ``tritonserver`` binary inside the ``nvidia-pytriton`` wheel.
* :class:`TritonPool` is a subnet pool whose subnets live in a Triton server, reached over HTTP
  with ``tritonclient.http.aio`` (binary tensors); the gateway fans out and merges as usual.
* :func:`find_tritonserver` / :class:`TritonServerProcess` locate and run a ``tritonserver``
  binary (``$SENSAI_TRITONSERVER``, ``tritonserver`` on ``PATH``, or the one in an installed or
  ``pip install --target`` unpacked ``nvidia-pytriton``, see ``$SENSAI_PYTRITON_DIR``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from sensai.errors import CheckpointError, SensaiError

from .predictor import ClassParallelPredictor, SubnetFailed, subnet_name

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

    def execute(self, requests):
        responses = []
        for request in requests:
            x = _as_numpy(pb_utils.get_input_tensor_by_name(request, self.input_name))
            try:
                x = np.ascontiguousarray(x, dtype=np.float32)
                y = self.session.run([self.output_name], {self.input_name: x})[0]
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
    if backend == "python":
        lines += ["parameters [", '  {\n    key: "intra_op_threads"\n'
                  f'    value: {{ string_value: "{max(1, threads)}" }}\n  }}', "]"]
    else:
        # One intra-op thread per instance: subnets run side by side, like the local pool.
        lines += ["parameters [", '  {\n    key: "intra_op_thread_count"\n'
                  f'    value: {{ string_value: "{max(1, threads)}" }}\n  }}', "]"]
    return "\n".join(lines) + "\n"


def export_triton_repo(artifact_dir: str | Path, out_dir: str | Path, *,
                       backend: str = "onnxruntime", max_batch_size: int = 64,
                       instance_kind: str = "auto", gpus: int = 0, threads: int = 1,
                       prefix: str = MODEL_PREFIX, overwrite: bool = False) -> list[str]:
    """Write a Triton model repository for an artifact; returns the model names (subnet order).

    ``gpus > 0`` pins subnet ``i`` to GPU ``i % gpus`` (``KIND_GPU``), like the local pool's round
    robin; otherwise ``instance_kind`` decides (``auto``: Triton's choice).  The repository is
    built in a temporary directory and renamed into place, so a failed export leaves nothing.
    """
    from sensai.manifest import load_manifest

    if backend not in BACKENDS:
        raise SensaiError(f"unknown Triton backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if instance_kind not in INSTANCE_KINDS:
        raise SensaiError(f"unknown instance kind {instance_kind!r}; choose one of "
                          f"{', '.join(INSTANCE_KINDS)}")
    if max_batch_size < 0 or gpus < 0:
        raise SensaiError("--max-batch and --gpus must be >= 0")
    art, out = Path(artifact_dir), Path(out_dir)
    manifest = load_manifest(art)
    if not manifest.subnets:
        raise CheckpointError(f"manifest in {art} lists no subnets")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise SensaiError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    names = []
    try:
        for s in manifest.subnets:
            if not s.onnx or not (art / s.onnx).is_file():
                raise CheckpointError(f"subnet {s.index} has no ONNX file in {art}; re-run "
                                      "decompose with ONNX export")
            ins, outs = _onnx_io(art / s.onnx)
            inp, o = ins[0], outs[0]
            mbs = max_batch_size
            if mbs > 0 and (not inp.dims or inp.dims[0] != -1 or not o.dims or o.dims[0] != -1):
                log.warning("subnet %d: ONNX batch dimension is fixed; exporting without batching",
                            s.index)
                mbs = 0
            if o.dims and o.dims[-1] not in (-1, s.num_outputs):
                raise CheckpointError(f"subnet {s.index}: ONNX output has {o.dims[-1]} values, "
                                      f"the manifest says {s.num_outputs}")
            name = triton_model_name(s.index, prefix)
            kind, gpu = instance_kind, None
            if gpus > 0:
                kind, gpu = "gpu", s.index % gpus
            mdir = tmp / name
            (mdir / "1").mkdir(parents=True)
            shutil.copyfile(art / s.onnx, mdir / "1" / "model.onnx")
            if backend == "python":
                (mdir / "1" / "model.py").write_text(PYTHON_MODEL, encoding="utf-8")
            (mdir / "config.pbtxt").write_text(
                model_config(name, backend, inp, o, max_batch_size=mbs, instance_kind=kind,
                             gpu=gpu, threads=threads), encoding="utf-8")
            names.append(name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("Triton repository with %d %s models -> %s", len(names), backend, out)
    return names


# --------------------------------------------------------------------------------------------
# The pool


class TritonPool:
    """Subnets served by a Triton server (HTTP, binary tensors, one aiohttp session per loop)."""

    def __init__(self, url: str, model_names: Sequence[str], *, timeout_s: float = 5.0,
                 connect_timeout_s: float = 30.0):
        import tritonclient.http as httpclient

        self.url = url.removeprefix("http://").rstrip("/")
        self.model_names = list(model_names)
        self.names = [subnet_name(i) for i in range(len(self.model_names))]
        self.timeout_s = timeout_s
        self._httpclient = httpclient
        self._aio = None
        # Metadata once, synchronously, before serving: names and shapes of every model's tensors.
        client = httpclient.InferenceServerClient(self.url, connection_timeout=connect_timeout_s,
                                                  network_timeout=connect_timeout_s)
        self.io: list[tuple[str, str]] = []
        try:
            for m in self.model_names:
                try:
                    ready = client.is_model_ready(m)
                except Exception as e:
                    raise SensaiError(f"cannot reach Triton at {self.url}: {e}") from None
                if not ready:
                    raise SensaiError(f"Triton at {self.url} has no ready model {m!r}")
                meta = client.get_model_metadata(m)
                self.io.append((meta["inputs"][0]["name"], meta["outputs"][0]["name"]))
        finally:
            client.close()

    def _client(self):
        if self._aio is None:
            import tritonclient.http.aio as aioclient

            self._aio = aioclient.InferenceServerClient(self.url, conn_timeout=self.timeout_s)
        return self._aio

    async def run(self, index: int, x: np.ndarray) -> np.ndarray:
        from tritonclient.utils import InferenceServerException

        http = self._httpclient
        in_name, out_name = self.io[index]
        inp = http.InferInput(in_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        try:
            res = await self._client().infer(self.model_names[index], [inp],
                                             outputs=[http.InferRequestedOutput(out_name, binary_data=True)])
        except InferenceServerException as e:
            raise SubnetFailed(f"{self.names[index]} (Triton model {self.model_names[index]}) "
                               f"failed: {e.message()}", subnet=self.names[index]) from None
        except OSError as e:  # connection refused / reset: the server went away
            raise SubnetFailed(f"{self.names[index]}: Triton at {self.url} unreachable: {e}",
                               subnet=self.names[index]) from None
        return res.as_numpy(out_name)

    def is_ready(self) -> bool:
        client = self._httpclient.InferenceServerClient(self.url, connection_timeout=2.0,
                                                        network_timeout=2.0)
        try:
            return all(client.is_model_ready(m) for m in self.model_names)
        finally:
            client.close()

    def describe(self) -> dict:
        return {"kind": "triton", "url": self.url, "models": self.model_names}

    async def close(self) -> None:
        if self._aio is not None:
            await self._aio.close()
            self._aio = None


def triton_predictor(artifact_dir: str | Path, url: str, *, name: str = "sensai",
                     deadline_s: float = 5.0, prefix: str = MODEL_PREFIX) -> ClassParallelPredictor:
    from sensai.manifest import load_manifest

    manifest = load_manifest(artifact_dir)
    if not manifest.subnets:
        raise CheckpointError(f"manifest in {artifact_dir} lists no subnets")
    pool = TritonPool(url, [triton_model_name(s.index, prefix) for s in manifest.subnets],
                      timeout_s=deadline_s)
    predictor = ClassParallelPredictor(pool, manifest, name=name, deadline_s=deadline_s,
                                       backend="triton")
    predictor.is_ready = pool.is_ready  # type: ignore[attr-defined]  # /v2/health/ready probe
    return predictor


# --------------------------------------------------------------------------------------------
# Running a tritonserver


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None: the binary's default (/opt/tritonserver/backends)
    lib_dirs: list[Path] = field(default_factory=list)
    stub: Path | None = None  # Python backend stub for this interpreter (pytriton layout)
    source: str = ""

    def backends(self) -> list[str]:
        d = self.backend_dir or self.binary.parent.parent / "backends"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def _pytriton_roots() -> list[Path]:
    roots = []
    env = os.environ.get("SENSAI_PYTRITON_DIR")
    if env:
        roots.append(Path(env) / "pytriton" if (Path(env) / "pytriton").is_dir() else Path(env))
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
        if spec and spec.submodule_search_locations:
            roots.extend(Path(p) for p in spec.submodule_search_locations)
    except (ImportError, ValueError):
        pass
    # deploy/setup.sh unpacks the wheel inside the virtual environment.
    roots.append(Path(sys.prefix) / "triton" / "pytriton")
    roots.append(Path.home() / ".cache" / "sensai" / "pytriton" / "pytriton")
    return roots


def find_tritonserver() -> TritonInstall | None:
    """A runnable ``tritonserver``, or None (callers say why and how to get one)."""
    env = os.environ.get("SENSAI_TRITONSERVER")
    if env and Path(env).is_file():
        return TritonInstall(Path(env), None, source="$SENSAI_TRITONSERVER")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, source="PATH")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for root in _pytriton_roots():
        ts = root / "tritonserver"
        binary = ts / "bin" / "tritonserver"
        stub = ts / "python_backend_stubs" / version / "triton_python_backend_stub"
        if binary.is_file():
            libs = [p for p in (root.parent / "nvidia_pytriton.libs",) if p.is_dir()]
            return TritonInstall(binary, ts / "backends", libs, stub if stub.is_file() else None,
                                 source=f"nvidia-pytriton at {root}")
    return None


TRITON_HINT = ("no tritonserver found: use a Triton container, put tritonserver on PATH, set "
               "SENSAI_TRITONSERVER, or unpack the nvidia-pytriton wheel with "
               "'pip install --no-deps --target ~/.cache/sensai/pytriton nvidia-pytriton'")


class TritonServerProcess:
    """A ``tritonserver`` child process serving ``repo``; ``with`` it or call start()/stop()."""

    def __init__(self, repo: str | Path, *, http_port: int, grpc_port: int, metrics_port: int,
                 install: TritonInstall | None = None, host: str = "127.0.0.1",
                 log_path: str | Path | None = None, startup_timeout_s: float = 120.0):
        self.repo = Path(repo)
        self.install = install or find_tritonserver()
        if self.install is None:
            raise SensaiError(TRITON_HINT)
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.startup_timeout_s = startup_timeout_s
        self._workdir = Path(tempfile.mkdtemp(prefix="sensai-triton-"))
        self.log_path = Path(log_path) if log_path else self._workdir / "tritonserver.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{self.host}:{self.http_port}"

    def _backend_dir(self) -> Path | None:
        inst = self.install
        if inst.stub is None or inst.backend_dir is None:
            return inst.backend_dir
        # pytriton layout: the Python backend expects its stub beside libtriton_python.so, and the
        # wheel ships one stub per Python version - assemble a backend directory for ours.
        bdir = self._workdir / "backends"
        for b in inst.backend_dir.iterdir():
            if b.is_dir():
                shutil.copytree(b, bdir / b.name, symlinks=True)
        shutil.copy2(inst.stub, bdir / "python" / "triton_python_backend_stub")
        return bdir

    def _env(self) -> dict[str, str]:
        env = os.environ.copy()
        libs = [str(p) for p in self.install.lib_dirs]
        if self.install.stub is not None:
            # The stub embeds this interpreter: its own libpython must be found first.
            libdir = sysconfig.get_config_var("LIBDIR")
            if libdir:
                libs.insert(0, libdir)
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        # model.py imports numpy and onnxruntime from this environment.
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p and Path(p).is_dir()])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def command(self) -> list[str]:
        cmd = [str(self.install.binary), f"--model-repository={self.repo}",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               "--strict-readiness=true", "--exit-on-error=true", "--log-verbose=0"]
        bdir = self._backend_dir()
        if bdir is not None:
            cmd.append(f"--backend-directory={bdir}")
        return cmd

    def start(self) -> "TritonServerProcess":
        import httpx

        cmd = self.command()
        log.info("starting %s", " ".join(cmd))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self._env(), start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SensaiError(f"tritonserver exited with code {self.proc.returncode}: "
                                  f"{self.log_tail()}")
            try:
                if httpx.get(f"http://{self.url}/v2/health/ready", timeout=1.0).status_code == 200:
                    log.info("tritonserver ready at %s", self.url)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SensaiError(f"tritonserver not ready after {self.startup_timeout_s:.0f} s: "
                          f"{self.log_tail()}")

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self._workdir / "backends", ignore_errors=True)

    def __enter__(self) -> "TritonServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

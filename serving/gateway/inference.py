"""What the gateway's protocols share: the gateway's state and the one path from a checked input
to a prediction, whichever protocol carried it.

The HTTP routes (:mod:`sensai.serving.gateway.app`) and the gRPC service
(:mod:`sensai.serving.gateway.grpc_server`) each parse their own messages and turn errors into their
own status codes; everything in between - admission for the predictor, the deadline, non-finite
scores, the metrics of a prediction or an error, the Open Inference Protocol's model checks and
metadata - is here, once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import numpy as np

from ..core.contract import Prediction
from ..core.errors import (InputError, ModelNotFound, Overloaded, ServingError, SubnetFailed,
                           SubnetTimeout)
from ..core.settings import GatewaySettings
from ..core.wakeup import CoresAwake
from . import oip
from .admission import Admission, Ticket
from .metrics import GatewayMetrics
from .model_table import ModelVersion
from .served import ServedModels
from .shared_memory import SharedRef, SystemSharedMemory
from .statistics import RequestClock

log = logging.getLogger(__name__)

# v2 bodies above this are parsed in a thread, not on the event loop (the same bound for typed
# gRPC contents, counted in 4-byte elements).
INLINE_PARSE_BYTES = 64 * 1024


@dataclass
class Gateway:
    """The served models and what guards them all: settings, metrics, admission."""

    models: ServedModels
    settings: GatewaySettings
    metrics: GatewayMetrics
    admission: Admission
    version: str
    shared_memory: SystemSharedMemory
    cores_awake: CoresAwake | None = None  # held from startup to shutdown


async def predict(gw: Gateway, mv: ModelVersion, x: np.ndarray, allow_partial: bool,
                  deadline: float, request_id: str, ticket: Ticket,
                  clock: RequestClock) -> Prediction:
    """The one path from a checked input batch to a prediction by model version ``mv`` (held
    by the caller), for every route; ``ticket``: the request's admission, with its place at the
    predictor; ``clock``: the request's marks for the statistics, stamped here."""
    adm = gw.admission
    gw.metrics.waiting.set(adm.waiting)
    clock.input_end = time.perf_counter_ns()
    async with adm.prediction(ticket, deadline):
        clock.queue_end = time.perf_counter_ns()
        if deadline <= asyncio.get_running_loop().time():
            raise SubnetTimeout("the request's deadline passed before its subnets were asked")
        try:
            pred = await mv.predictor.predict(x, allow_partial=allow_partial, deadline=deadline)
        except (SubnetFailed, SubnetTimeout) as e:
            if e.subnet:
                kind = "timeout" if isinstance(e, SubnetTimeout) else "failed"
                gw.metrics.child(gw.metrics.subnet_errors, mv.name, mv.version, e.subnet,
                                 kind).inc()
                log.warning("request %s (model %s version %s): %s", request_id, mv.name,
                            mv.version, e)
            raise
        finally:
            clock.infer_end = time.perf_counter_ns()
    if not np.isfinite(pred.scores).all():
        raise InputError("the input drives the network out of float range (non-finite "
                         "scores): send normalized pixels")
    gw.metrics.observe_prediction(mv.name, mv.version, pred.timings_ms, x.shape[0])
    return pred


async def v2_infer(gw: Gateway, mv: ModelVersion, req: oip.InferRequest, deadline: float,
                   request_id: str, ticket: Ticket, clock: RequestClock
                   ) -> tuple[Prediction, list[tuple[str, np.ndarray, bool]]]:
    """A parsed KServe v2 request -> its prediction and requested outputs (HTTP and gRPC);
    a failure is counted in the version's statistics here, a success by the caller once its
    answer is encoded (:func:`answered`)."""
    try:
        await read_shared_inputs(gw, req)
        x = oip.input_batch(req, mv.spec, gw.settings.max_request_rows)
        pred = await predict(gw, mv, x, oip.allow_partial(req), deadline, request_id, ticket,
                             clock)
        outputs = oip.infer_outputs(req, pred.scores, mv.spec.classes, pred.covered_classes)
        for name, arr, where in outputs:
            if isinstance(where, SharedRef):  # a few hundred bytes at most: inline
                gw.shared_memory.write(where, oip.tensor_bytes(arr), f"output {name!r}")
        return pred, outputs
    except BaseException:
        gw.metrics.stats.failure(mv.name, mv.version, clock)
        raise


async def read_shared_inputs(gw: Gateway, req: oip.InferRequest) -> None:
    """The request's inputs that name a shared-memory region, read from it (a large one in a
    thread, as a large body is parsed)."""
    for t in req.inputs:
        if t.shared is None:
            continue
        dt = oip.DTYPES[t.datatype]
        need = oip.num_elements(t.shape) * dt.itemsize
        where = f"input {t.name!r}"
        if need <= INLINE_PARSE_BYTES:
            data = gw.shared_memory.read(t.shared, need, where)
        else:
            data = await asyncio.to_thread(gw.shared_memory.read, t.shared, need, where)
        t.array = np.frombuffer(data, dt).reshape(t.shape)


def answered(gw: Gateway, mv: ModelVersion, rows: int, pred: Prediction,
             clock: RequestClock) -> None:
    """A request's success in its version's statistics, once its answer is built."""
    gw.metrics.stats.success(mv.name, mv.version, rows, clock, pred.timings_ms)


def count_error(gw: Gateway, exc: ServingError) -> None:
    """The metrics of a request turned away (HTTP and gRPC alike)."""
    if isinstance(exc, Overloaded):
        gw.metrics.child(gw.metrics.rejected, exc.reason).inc()
    elif exc.status == 408:
        gw.metrics.child(gw.metrics.rejected, "slow_body").inc()


def version_ready(mv: ModelVersion) -> bool:
    try:
        return bool(mv.predictor.is_ready())
    except Exception:  # a probe that fails means "not ready", not an error
        return False


def server_ready(gw: Gateway) -> bool:
    """Whether every served model's current version would answer in full (and one is served)."""
    names = gw.models.names()
    try:
        routed = [gw.models.route(n) for n in names]
    except ServingError:
        return False
    return bool(routed) and all(version_ready(mv) for mv in routed)


# Triton's names for the protocol's extensions this gateway implements (HTTP and gRPC alike).
EXTENSIONS = ("classification", "model_configuration", "binary_tensor_data", "parameters",
              "statistics", "system_shared_memory")


def v2_server_metadata(gw: Gateway) -> dict:
    repository = ["model_repository"] if gw.settings.model_control != "none" else []
    return {"name": "sensai", "version": gw.version,
            "extensions": [*EXTENSIONS, *repository]}


def statistics(gw: Gateway, name: str | None = None, version: str | None = None) -> dict:
    """Triton's statistics answer: every version of every model (no ``name``), of one model, or
    one version; an unknown model or version is a 404 with its reason."""
    table = gw.models.models
    if version and not name:  # gRPC's message can carry a version alone; it names no model
        raise InputError(f"statistics of version {version!r} need the model's name")
    if not name:
        keys = [(m, v) for m in gw.models.names() for v in sorted(table[m], key=int)]
    elif name not in table:
        raise ModelNotFound(f"unknown model {name!r}; this server serves "
                            f"{', '.join(repr(n) for n in gw.models.names()) or 'no model'}")
    elif version:
        if version not in table[name]:
            raise ModelNotFound(f"model {name!r} has no version {version!r} (loaded: "
                                f"{', '.join(sorted(table[name], key=int)) or 'none'})")
        keys = [(name, version)]
    else:
        keys = [(name, v) for v in sorted(table[name], key=int)]
    return gw.metrics.stats.answer(keys)


def model_parameters(spec) -> dict:
    """What the model metadata adds to its tensors: the preprocessing as a sentence for a
    reader and as values for a client that normalises a tensor - (pixel * input_scale -
    input_mean[c]) / input_std[c], channels first - and the class names."""
    return {"preprocessing": f"uint8 pixels / 255, minus mean {list(spec.mean)}, divided by "
                             f"std {list(spec.std)}",
            "input_scale": 1.0 / 255.0, "input_mean": list(spec.mean),
            "input_std": list(spec.std), "input_layout": "NCHW", "classes": list(spec.classes)}


def v2_model_metadata(gw: Gateway, mv: ModelVersion) -> dict:
    spec = mv.spec
    return {
        "name": mv.name,
        "versions": gw.models.ready_versions(mv.name),
        "platform": "sensai",
        "inputs": [{"name": oip.INPUT_NAME, "datatype": "FP32",
                    "shape": [-1, *spec.input_shape]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, spec.num_classes]},
                    {"name": "class_index", "datatype": "INT64", "shape": [-1]}],
        "parameters": model_parameters(spec),
    }


def v2_model_config(gw: Gateway, mv: ModelVersion) -> dict:
    """The model's configuration in Triton's form (its model configuration extension, what
    ``tritonclient``'s ``get_model_config`` reads, over HTTP and gRPC alike): the tensors
    without their batch dimension, and the metadata's parameters as Triton's string
    parameters - gRPC's ``ModelMetadata`` has no field for them, so this is where a gRPC client
    finds the preprocessing's values."""
    spec = mv.spec
    return {
        "name": mv.name,
        "platform": "sensai",
        "max_batch_size": gw.settings.max_request_rows,
        "input": [{"name": oip.INPUT_NAME, "data_type": "TYPE_FP32", "format": "FORMAT_NCHW",
                   "dims": list(spec.input_shape)}],
        "output": [{"name": "scores", "data_type": "TYPE_FP32", "dims": [spec.num_classes]},
                   {"name": "class_index", "data_type": "TYPE_INT64", "dims": [1],
                    "reshape": {"shape": []}}],
        # Triton's parameters are strings: numbers as JSON text.
        "parameters": {k: {"string_value": v if isinstance(v, str) else json.dumps(v)}
                       for k, v in model_parameters(spec).items()},
    }

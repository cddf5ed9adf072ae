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
from dataclasses import dataclass

import numpy as np

from ..core.contract import Prediction
from ..core.errors import InputError, Overloaded, ServingError, SubnetFailed, SubnetTimeout
from ..core.settings import GatewaySettings
from ..core.wakeup import CoresAwake
from . import oip
from .admission import Admission, Ticket
from .metrics import GatewayMetrics
from .model_table import ModelVersion
from .served import ServedModels

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
    cores_awake: CoresAwake | None = None  # held from startup to shutdown


async def predict(gw: Gateway, mv: ModelVersion, x: np.ndarray, allow_partial: bool,
                  deadline: float, request_id: str, ticket: Ticket) -> Prediction:
    """The one path from a checked input batch to a prediction by model version ``mv`` (held
    by the caller), for every route; ``ticket``: the request's admission, with its place at the
    predictor."""
    adm = gw.admission
    gw.metrics.waiting.set(adm.waiting)
    async with adm.prediction(ticket, deadline):
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
    if not np.isfinite(pred.scores).all():
        raise InputError("the input drives the network out of float range (non-finite "
                         "scores): send normalized pixels")
    gw.metrics.observe_prediction(mv.name, mv.version, pred.timings_ms, x.shape[0])
    return pred


async def v2_infer(gw: Gateway, mv: ModelVersion, req: oip.InferRequest, deadline: float,
                   request_id: str, ticket: Ticket
                   ) -> tuple[Prediction, list[tuple[str, np.ndarray, bool]]]:
    """A parsed KServe v2 request -> its prediction and requested outputs (HTTP and gRPC)."""
    x = oip.input_batch(req, mv.spec, gw.settings.max_batch)
    pred = await predict(gw, mv, x, oip.allow_partial(req), deadline, request_id, ticket)
    return pred, oip.infer_outputs(req, pred.scores, mv.spec.classes, pred.covered_classes)


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


def v2_server_metadata(gw: Gateway) -> dict:
    return {"name": "sensai", "version": gw.version, "extensions": ["classification"]}


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
        "max_batch_size": gw.settings.max_batch,
        "input": [{"name": oip.INPUT_NAME, "data_type": "TYPE_FP32", "format": "FORMAT_NCHW",
                   "dims": list(spec.input_shape)}],
        "output": [{"name": "scores", "data_type": "TYPE_FP32", "dims": [spec.num_classes]},
                   {"name": "class_index", "data_type": "TYPE_INT64", "dims": [1],
                    "reshape": {"shape": []}}],
        # Triton's parameters are strings: numbers as JSON text.
        "parameters": {k: {"string_value": v if isinstance(v, str) else json.dumps(v)}
                       for k, v in model_parameters(spec).items()},
    }

"""What the gateway's protocols share: the gateway's state and the one path from a checked input
to a prediction, whichever protocol carried it.

The HTTP routes (:mod:`sensai.serving.app`) and the gRPC service
(:mod:`sensai.serving.grpc_server`) each parse their own messages and turn errors into their own
status codes; everything in between - admission for the predictor, the deadline, non-finite
scores, the metrics of a prediction or an error, the Open Inference Protocol's model checks and
metadata - is here, once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from . import oip
from .admission import Admission
from .contract import Prediction, Predictor
from .errors import InputError, ModelNotFound, Overloaded, ServingError, SubnetFailed, SubnetTimeout
from .metrics import GatewayMetrics
from .settings import GatewaySettings
from .wakeup import CoresAwake

log = logging.getLogger(__name__)

MODEL_VERSION = "1"
# v2 bodies above this are parsed in a thread, not on the event loop (the same bound for typed
# gRPC contents, counted in 4-byte elements).
INLINE_PARSE_BYTES = 64 * 1024


@dataclass
class Gateway:
    """One served predictor and what guards it: settings, metrics, admission."""

    predictor: Predictor
    settings: GatewaySettings
    metrics: GatewayMetrics
    admission: Admission
    version: str
    max_pixels: int
    max_decoded_bytes: int
    cores_awake: CoresAwake | None = None  # held from startup to shutdown


async def predict(gw: Gateway, x: np.ndarray, allow_partial: bool, deadline: float
                  ) -> Prediction:
    """The one path from a checked input batch to a prediction, for every route."""
    adm = gw.admission
    gw.metrics.waiting.set(adm.waiting)
    async with adm.slot(adm.predicting, deadline, "prediction"):
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise SubnetTimeout("the request's deadline passed before its subnets were asked")
        pred = await gw.predictor.predict(x, allow_partial=allow_partial, timeout_s=left)
    if not np.isfinite(pred.scores).all():
        raise InputError("the input drives the network out of float range (non-finite "
                         "scores): send normalized pixels")
    gw.metrics.observe_prediction(pred.timings_ms, x.shape[0])
    return pred


async def v2_infer(gw: Gateway, req: oip.InferRequest, deadline: float
                   ) -> tuple[Prediction, list[tuple[str, np.ndarray, bool]]]:
    """A parsed KServe v2 request -> its prediction and requested outputs (HTTP and gRPC)."""
    x = oip.input_batch(req, gw.predictor.spec, gw.settings.max_batch)
    pred = await predict(gw, x, oip.allow_partial(req), deadline)
    return pred, oip.infer_outputs(req, pred.scores, gw.predictor.spec.classes,
                                   pred.covered_classes)


def count_error(gw: Gateway, exc: ServingError, request_id: str) -> None:
    """The metrics and log line of a request that ended in ``exc`` (HTTP and gRPC alike)."""
    if isinstance(exc, (SubnetFailed, SubnetTimeout)) and exc.subnet:
        gw.metrics.subnet_errors.labels(exc.subnet, "timeout" if isinstance(exc, SubnetTimeout)
                                        else "failed").inc()
        log.warning("request %s: %s", request_id, exc)
    if isinstance(exc, Overloaded):
        gw.metrics.rejected.labels(exc.reason).inc()
    elif exc.status == 408:
        gw.metrics.rejected.labels("slow_body").inc()


def check_model(gw: Gateway, model_name: str, version: str | None) -> None:
    if model_name != gw.predictor.name:
        raise ModelNotFound(f"unknown model {model_name!r}; this server serves "
                            f"{gw.predictor.name!r}")
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model {model_name!r} has no version {version!r} "
                            f"(versions: {MODEL_VERSION})")


def predictor_ready(gw: Gateway) -> bool:
    try:
        return bool(gw.predictor.is_ready())
    except Exception:  # a probe that fails means "not ready", not an error
        return False


def v2_server_metadata(gw: Gateway) -> dict:
    return {"name": "sensai", "version": gw.version, "extensions": ["classification"]}


def v2_model_metadata(gw: Gateway) -> dict:
    spec = gw.predictor.spec
    return {
        "name": gw.predictor.name,
        "versions": [MODEL_VERSION],
        "platform": "sensai",
        "inputs": [{"name": oip.INPUT_NAME, "datatype": "FP32",
                    "shape": [-1, *spec.input_shape]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, spec.num_classes]},
                    {"name": "class_index", "datatype": "INT64", "shape": [-1]}],
        "parameters": {"preprocessing": f"uint8 pixels / 255, minus mean {list(spec.mean)}, "
                                         f"divided by std {list(spec.std)}",
                       "classes": list(spec.classes)},
    }

"""The HTTP gateway: one image in, N-way prediction out, for any :class:`Predictor`.

Routes
* ``POST /v1/predict`` - an image (multipart field ``image`` or the raw body), ``?top_k=``,
  ``?allow_partial=``;
* Open Inference Protocol (KServe v2): ``/v2``, ``/v2/health/{live,ready}``,
  ``/v2/models/{m}[/versions/{v}]``, ``.../ready``, ``.../infer`` (FP32 ``[B, C, H, W]`` tensor of
  *normalized* input, JSON or binary) - so ``tritonclient.http`` can call the gateway directly;
* ``GET /v1/models`` (what is served, where every worker runs), ``GET /metrics`` (Prometheus).

With ``settings.grpc_port`` set, the app's lifespan also serves the Open Inference Protocol over
gRPC (:mod:`sensai.serving.grpc_server`) on the same event loop, predictor and admission, through
the same helpers (:func:`v2_infer`, :func:`predict`, :func:`check_model`...).

Every error is JSON ``{"error", "status", "request_id", "subnet", "missing_classes"}`` with a
4xx/5xx status; library code raises :class:`sensai.errors.SensaiError` subclasses and only the
handlers here turn them into HTTP.  The work a request may cause is bounded
(:mod:`sensai.serving.admission`); nothing slow or unbounded runs on the event loop, so health
checks answer whatever the other requests are doing.  The two prediction routes build their JSON
themselves (FastAPI's response-model validation costs more than the rest of the request path) and
read their own parameters (so does FastAPI's per-request parameter solving).
(No ``from __future__ import annotations`` here: FastAPI must see the route annotations, which
refer to per-app values, as objects.)
"""

import asyncio
import json
import logging
import os
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from sensai.errors import SensaiError
from sensai.merge import ranking

from . import oip
from .admission import Admission
from .contract import Prediction, Predictor
from .errors import (InputError, ModelNotFound, Overloaded, PayloadTooLarge, ServingError,
                     SubnetFailed, SubnetTimeout)
from .imaging import decode_image, image_to_input, open_image
from .metrics import GatewayMetrics
from .schemas import ERROR_RESPONSES, ErrorResponse, ModelInfo, PredictResponse
from .settings import GatewaySettings
from .wakeup import CoresAwake, keep_cores_awake

log = logging.getLogger(__name__)

MODEL_VERSION = "1"
# Images at most this big are decoded on the event loop (~0.2 ms, less than a thread hop); the
# header's size and PNG's text chunks are bounded, so this work is too.
INLINE_DECODE_BYTES = 64 * 1024
INLINE_DECODE_PIXELS = 128 * 128
# v2 JSON bodies above this are parsed in a thread: 8 MB of JSON takes a few hundred ms.
INLINE_PARSE_BYTES = 64 * 1024
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Answered whatever the load: never queued, never turned away.
UNGATED = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})


@dataclass
class Gateway:
    predictor: Predictor
    settings: GatewaySettings
    metrics: GatewayMetrics
    admission: Admission
    version: str
    max_pixels: int
    max_decoded_bytes: int
    cores_awake: CoresAwake | None = None  # held from startup to shutdown


# Dependencies are async: FastAPI runs a sync dependency in its thread pool, a hop per request.
async def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


# The two prediction routes take only the Request and read their parameters themselves:
# FastAPI's per-request parameter solving cost more than parsing a v2 request and encoding its
# answer.  The models below validate them (pydantic, as FastAPI would, so the same 422s) and
# document them in the OpenAPI schema.

def predict_query(num_classes: int) -> type[BaseModel]:
    class PredictQuery(BaseModel):
        model_config = ConfigDict(extra="ignore")
        top_k: int | None = Field(None, ge=1, le=num_classes, description="how many classes")
        allow_partial: bool = Field(
            False, description="when some classes have no live subnet copy, answer over the "
                               "others (flagged degraded) instead of 503/504")
    return PredictQuery


class ModelPath(BaseModel):
    model_name: str


class ModelVersionPath(ModelPath):
    version: str


class VersionQuery(BaseModel):  # the unversioned infer route also takes ?version=
    version: str | None = None


def query_params(request: Request, model: type[BaseModel], default: BaseModel) -> BaseModel:
    """The request's query parameters as ``model`` (``default`` when there are none), or the
    422 FastAPI gives for a declared parameter."""
    if not request.scope.get("query_string"):
        return default
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("query", *err["loc"])}
                                      for err in e.errors()]) from None


def openapi_parameters(*models: tuple[type[BaseModel], str]) -> dict:
    """``openapi_extra`` that documents each ``(model, where)``'s fields as ``where`` (query,
    path) parameters."""
    params = []
    for model, where in models:
        schema = model.model_json_schema()
        required = set(schema.get("required", ()))
        params += [{"name": name, "in": where, "required": name in required, "schema": prop,
                    **({"description": prop["description"]} if "description" in prop else {})}
                   for name, prop in schema["properties"].items()]
    return {"parameters": params}


# --------------------------------------------------------------------------------------------
# Pure ASGI middleware: request id, admission, body size limit, metrics (BaseHTTPMiddleware
# would add a task and a copy per request on the hot path).


# One encoder (json.dumps with any non-default argument builds a new one per call).
JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def json_bytes(obj) -> bytes:
    return JSON.encode(obj).encode()


class GatewayMiddleware:
    def __init__(self, app, gateway: Gateway):
        self.app = app
        self.gw = gateway

    async def _reply(self, send, status: int, message: str, rid: str, extra=()) -> None:
        body = json_bytes({"error": message, "status": status, "request_id": rid,
                           "subnet": None, "missing_classes": None})  # ErrorResponse's shape
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-request-id", rid.encode()), *extra]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gw, metrics = self.gw, self.gw.metrics
        limit = gw.settings.max_body_bytes
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = rid if REQUEST_ID.match(rid) else os.urandom(16).hex()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
        # The deadline covers the whole request: body, decoding, waiting (also the wait for the
        # event loop before this line, estimated by its lag), the subnets.
        state["deadline"] = (asyncio.get_running_loop().time() + gw.settings.deadline_s
                             - gw.admission.lag)
        gated = scope.get("path") not in UNGATED
        if gated and not gw.admission.admit():
            reason, why = gw.admission.refusal()
            metrics.rejected.labels(reason).inc()
            metrics.child(metrics.requests, "unadmitted", scope.get("method", ""), "503").inc()
            await self._reply(send, 503, why, rid, [(b"retry-after", b"1")])
            return
        status_box = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [
                    (b"x-request-id", rid.encode())]
            await send(message)

        metrics.inflight.inc()
        try:
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                state["error_reason"] = "PayloadTooLarge"
                await self._reply(send_wrapper, 413, f"request body is {int(length):,} bytes; "
                                  f"the limit is {limit:,} (set SENSAI_MAX_BODY_BYTES)", rid,
                                  [(b"connection", b"close")])
                return
            received = [0]
            waiting_body = [False]

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request":
                    received[0] += len(message.get("body", b""))
                    if received[0] > limit:
                        raise PayloadTooLarge(f"request body is over the limit of {limit:,} bytes "
                                              "(set SENSAI_MAX_BODY_BYTES)")
                    more = message.get("more_body", False)
                    if more and not waiting_body[0] and gated:
                        gw.admission.start_receiving()
                        waiting_body[0] = True
                    elif not more and waiting_body[0]:
                        gw.admission.done_receiving()
                        waiting_body[0] = False
                return message

            try:
                await self.app(scope, receive_limited, send_wrapper)
            finally:
                if waiting_body[0]:
                    gw.admission.done_receiving()
        finally:
            if gated:
                gw.admission.release()
            metrics.inflight.dec()
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            status = status_box[0]
            metrics.observe_request(path, scope.get("method", ""), str(status),
                                    time.perf_counter() - t0)
            if status >= 400:
                metrics.errors.labels(path, str(status), state.get("error_reason", "http")).inc()


# --------------------------------------------------------------------------------------------
# Errors, translated here and nowhere else


def _error(request: Request, status: int, message: str, reason: str,
           subnet: str | None = None, headers: dict | None = None,
           missing_classes: list[str] | None = None) -> JSONResponse:
    request.state.error_reason = reason
    rid = getattr(request.state, "request_id", None)
    body = ErrorResponse(error=message, status=status, request_id=rid, subnet=subnet,
                         missing_classes=missing_classes)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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


def _install_error_handlers(app: FastAPI, gw: Gateway) -> None:
    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError):
        count_error(gw, exc, getattr(request.state, "request_id", "?"))
        headers = ({"Retry-After": f"{max(1, round(exc.retry_after))}"}
                   if exc.retry_after is not None else None)
        return _error(request, exc.status, str(exc), type(exc).__name__, exc.subnet,
                      headers=headers, missing_classes=exc.missing_classes)

    @app.exception_handler(SensaiError)
    async def _sensai_error(request: Request, exc: SensaiError):
        return _error(request, 400, str(exc), type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:3]:
            loc = " ".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg')}")
        return _error(request, 422, "; ".join(parts) or "invalid request", "validation")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(request, exc.status_code, str(exc.detail), "http",
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("request %s failed", getattr(request.state, "request_id", "?"))
        return _error(request, 500, f"internal error ({type(exc).__name__}); see the server log",
                      "internal")


# --------------------------------------------------------------------------------------------
# The request path


async def read_body(request: Request, gw: Gateway, *, image: bool) -> bytes:
    """The request body (an image's bytes when ``image``: multipart field or raw body), within
    the body time limit and a receiving slot."""
    async with gw.admission.body(request.state.deadline):
        ctype = request.headers.get("content-type", "").lower() if image else ""
        if ctype.startswith("multipart/form-data"):
            try:
                form = await request.form(max_files=1, max_fields=8)
            except StarletteHTTPException as e:  # starlette reports multipart syntax errors so
                raise InputError(f"malformed multipart body: {e.detail}") from None
            try:
                field = form.get("image")
                if field is None:
                    raise InputError("multipart body has no 'image' field")
                if isinstance(field, UploadFile):
                    return await field.read()
                return field.encode()
            finally:
                await form.close()
        if ctype.startswith("application/x-www-form-urlencoded"):
            raise InputError("send the image as multipart/form-data (field 'image') or as the "
                             "raw body, not as a url-encoded form", status=415)
        return await request.body()


async def decode(gw: Gateway, data: bytes, deadline: float) -> np.ndarray:
    """Image bytes -> the model's input; a thumbnail inline, anything larger in a thread, at
    most one per core at a time."""
    spec, limit, max_bytes = gw.predictor.spec, gw.max_pixels, gw.max_decoded_bytes
    if len(data) <= INLINE_DECODE_BYTES:
        img = open_image(data, limit, max_bytes)  # the header only: bounded by the byte count
        if img.size[0] * img.size[1] <= INLINE_DECODE_PIXELS:
            return image_to_input(img, spec)
        img.close()
    async with gw.admission.slot(gw.admission.decoding, deadline, "image decoding"):
        return await run_in_threadpool(decode_image, data, spec, limit, max_bytes)


async def predict(gw: Gateway, x: np.ndarray, allow_partial: bool, deadline: float
                  ) -> Prediction:
    """The one path from a checked input batch to a prediction, for /v1 and /v2 alike."""
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


def top_k_rows(scores: np.ndarray, k: int, classes, covered: list[int] | None = None
               ) -> list[dict]:
    """The k best classes of one row as ``{"index", "label", "score"}``, best first; a degraded
    answer ranks only the ``covered`` classes (the others have no score at all)."""
    if covered is not None:
        ranked = np.full_like(scores, -np.inf)
        ranked[:, covered] = scores[:, covered]
        k = min(k, len(covered))
    else:
        ranked = scores
    row = scores[0].tolist()  # Python floats at once: numpy scalars cost more one by one
    return [{"index": i, "label": classes[i], "score": row[i]}
            for i in ranking(ranked, k)[0].tolist()]


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
    except Exception:  # a probe that fails means "not ready", not a 500
        return False


def create_app(predictor: Predictor, settings: GatewaySettings | None = None, *,
               close_predictor: bool = True) -> FastAPI:
    """The gateway for ``predictor``; ``close_predictor``: close it when the app shuts down."""
    settings = settings or GatewaySettings()
    try:
        version = package_version("sensai")
    except PackageNotFoundError:
        version = "0"
    admission = Admission(max_requests=settings.max_requests,
                          max_predictions=settings.max_predictions,
                          body_timeout_s=settings.body_timeout_s, deadline_s=settings.deadline_s,
                          max_lag_s=settings.max_loop_lag_s)
    gw = Gateway(predictor, settings, GatewayMetrics(), admission, version,
                 settings.image_pixels(predictor.spec.input_shape),
                 settings.decoded_bytes(predictor.spec.input_shape))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc = None
        admission.start()
        try:
            try:
                gw.cores_awake = keep_cores_awake(settings.keep_cores_awake)
            except SensaiError as e:
                app.state.startup_error = e  # uvicorn only logs it; `sensai serve` says it
                raise
            if settings.grpc_port is not None:
                from .grpc_server import GrpcServer  # grpc and tritonclient: only when asked

                try:
                    grpc = app.state.grpc = await GrpcServer(gw).start(settings.host,
                                                                        settings.grpc_port)
                except BaseException as e:
                    app.state.startup_error = e  # uvicorn only logs it; `sensai serve` says it
                    raise
            yield
        finally:
            await admission.stop()
            if gw.cores_awake is not None:
                gw.cores_awake.release()
            if grpc is not None:
                await grpc.stop()
            if close_predictor:
                await predictor.close()

    app = FastAPI(title="sensai gateway", version=version, lifespan=lifespan,
                  description="Class-parallel CNN inference (sensAI)", responses=ERROR_RESPONSES)
    app.state.gateway = gw
    app.add_middleware(GatewayMiddleware, gateway=gw)
    _install_error_handlers(app, gw)
    classes = predictor.spec.classes

    # The prediction routes first: a request is matched against the routes in order.
    PredictQuery = predict_query(len(classes))
    no_query = PredictQuery()

    @app.post("/v1/predict", response_model=None,
              responses={200: {"model": PredictResponse, "description": "the prediction"}},
              openapi_extra=openapi_parameters((PredictQuery, "query")))
    async def predict_image(request: Request) -> Response:
        t0 = time.perf_counter()
        query = query_params(request, PredictQuery, no_query)
        deadline = request.state.deadline
        x = await decode(gw, await read_body(request, gw, image=True), deadline)
        t1 = time.perf_counter()
        pred = await predict(gw, x, query.allow_partial, deadline)
        rows = top_k_rows(pred.scores,
                          query.top_k or min(gw.settings.default_top_k, len(classes)),
                          classes, pred.covered_classes)
        timings = dict(pred.timings_ms)
        timings["decode"] = round((t1 - t0) * 1e3, 3)
        timings["request"] = round((time.perf_counter() - t0) * 1e3, 3)
        best = rows[0]
        body = {"request_id": request.state.request_id, "model": gw.predictor.name,
                "label": best["label"], "index": best["index"], "score": best["score"],
                "predictions": rows, "timings_ms": timings, "degraded": pred.degraded,
                "covered_classes": pred.covered_classes,
                "missing_classes": pred.missing_classes,
                "answered_by": pred.answered_by or None}
        return Response(json_bytes(body), media_type="application/json")

    @app.post("/v2/models/{model_name}/infer",
              openapi_extra=openapi_parameters((ModelPath, "path"), (VersionQuery, "query")))
    @app.post("/v2/models/{model_name}/versions/{version}/infer",
              openapi_extra=openapi_parameters((ModelVersionPath, "path")))
    async def infer(request: Request):
        path = request.path_params
        model_name, version = path["model_name"], path.get("version")
        if "version" not in path and request.scope.get("query_string"):
            version = request.query_params.get("version")
        check_model(gw, model_name, version)
        deadline = request.state.deadline
        body = await read_body(request, gw, image=False)
        encoding = request.headers.get("content-encoding")
        args = (body, encoding, gw.settings.max_body_bytes,
                request.headers.get(oip.HEADER_LENGTH))
        # A compressed body's parse cost is that of what it expands to: never inline.
        if len(body) <= INLINE_PARSE_BYTES and not encoding:
            req = oip.decode_request(*args)
        else:
            async with gw.admission.slot(gw.admission.decoding, deadline, "request parsing"):
                req = await run_in_threadpool(oip.decode_request, *args)
        pred, outputs = await v2_infer(gw, req, deadline)
        content, headers, media = oip.encode_infer_response(
            model_name=gw.predictor.name, model_version=version or MODEL_VERSION,
            request_id=req.id, outputs=outputs, parameters=oip.response_parameters(pred))
        return Response(content, headers=headers, media_type=media)

    @app.get("/", include_in_schema=False)
    async def index(gw: GatewayDep) -> dict:
        return {"name": "sensai", "model": gw.predictor.name, "predict": "/v1/predict",
                "kserve_v2": f"/v2/models/{gw.predictor.name}", "metrics": "/metrics",
                "docs": "/docs"}

    @app.get("/v1/models", response_model=ModelInfo)
    async def model_info(gw: GatewayDep):
        spec = gw.predictor.spec
        return ModelInfo(name=gw.predictor.name, dataset=spec.name, classes=list(spec.classes),
                         input_shape=list(spec.input_shape), mean=list(spec.mean),
                         std=list(spec.std), predictor=gw.predictor.describe(),
                         cores_awake=gw.cores_awake.describe() if gw.cores_awake else None)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(gw: GatewayDep):
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    # ---- Open Inference Protocol (KServe v2) ------------------------------------------------

    @app.get("/v2")
    async def server_metadata(gw: GatewayDep):
        return v2_server_metadata(gw)

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready(request: Request, gw: GatewayDep):
        if not await run_in_threadpool(predictor_ready, gw):
            return _error(request, 503, "not ready", "not_ready")
        return {"ready": True}

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{version}")
    async def model_metadata(gw: GatewayDep, model_name: str, version: str | None = None):
        check_model(gw, model_name, version)
        return v2_model_metadata(gw)

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(request: Request, gw: GatewayDep, model_name: str,
                          version: str | None = None):
        check_model(gw, model_name, version)
        if not await run_in_threadpool(predictor_ready, gw):
            return _error(request, 503, f"model {model_name!r} is not ready", "not_ready")
        return {"name": model_name, "ready": True}

    return app

"""The HTTP gateway: one image in, N-way prediction out, for any :class:`Predictor`.

Routes
* ``POST /v1/predict`` - an image (multipart field ``image`` or the raw body), ``?top_k=``,
  ``?allow_partial=``;
* Open Inference Protocol (KServe v2): ``/v2``, ``/v2/health/{live,ready}``,
  ``/v2/models/{m}[/versions/{v}]``, ``.../ready``, ``.../infer`` (FP32 ``[B, C, H, W]`` tensor of
  *normalized* input, JSON or binary) - so ``tritonclient.http`` can call the gateway directly;
* ``GET /v1/models`` (what is served, where every worker runs), ``GET /metrics`` (Prometheus).

With ``settings.grpc_port`` set, the app's lifespan also serves the Open Inference Protocol over
gRPC (:mod:`sensai.serving.gateway.grpc_server`) on the same event loop, predictor and admission;
both go through :mod:`sensai.serving.gateway.inference` from a parsed input to a prediction.

Every error is JSON ``{"error", "status", "request_id", "subnet", "missing_classes"}`` with a
4xx/5xx status; library code raises :class:`sensai.errors.SensaiError` subclasses and only the
handlers here (and :mod:`sensai.serving.gateway.middleware`'s early 413 and 503) turn them into
HTTP.  The work a request may cause is bounded (:mod:`sensai.serving.gateway.admission`); nothing
slow or unbounded runs on the event loop, so health checks answer whatever the other requests are
doing.  The two prediction routes build their JSON themselves (FastAPI's response-model validation
costs more than the rest of the request path) and read their own parameters (so does FastAPI's
per-request parameter solving). (No ``from __future__ import annotations`` here: FastAPI must see
the route annotations, which refer to per-app values, as objects.)
"""

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
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

from ..core.contract import Predictor
from ..core.errors import InputError, ServingError
from ..core.settings import GatewaySettings
from ..core.wakeup import keep_cores_awake
from . import heap, oip
from .admission import Admission
from .imaging import decode_image, image_to_input, open_image
from .inference import (INLINE_PARSE_BYTES, Gateway, count_error, predict, server_ready, v2_infer,
                        v2_model_metadata, v2_server_metadata, version_ready)
from .middleware import GatewayMiddleware
from .repository_api import repository_routes
from .schemas import ERROR_RESPONSES, ErrorResponse, ModelInfo, PredictResponse, VersionInfo
from .served import ModelVersion, ServedModels
from .server import EmbeddedServer
from .wire import json_bytes

log = logging.getLogger(__name__)

# Images at most this big are decoded on the event loop (cheaper than a hop to a thread); the
# header's size and PNG's text chunks are bounded, so this work is too.
INLINE_DECODE_BYTES = 64 * 1024
INLINE_DECODE_PIXELS = 128 * 128


# Dependencies are async: FastAPI runs a sync dependency in its thread pool, a hop per request.
async def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


# The two prediction routes take only the Request and read their parameters themselves:
# FastAPI's per-request parameter solving cost more than parsing a v2 request and encoding its
# answer.  The models below validate them (pydantic, as FastAPI would, so the same 422s) and
# document them in the OpenAPI schema.

class PredictQuery(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    top_k: int | None = Field(None, ge=1, description="how many classes (at most the model's)")
    allow_partial: bool = Field(
        False, description="when some classes have no live subnet copy, answer over the "
                           "others (flagged degraded) instead of 503/504")
    model: str | None = Field(None, description="the model (default: the server's default "
                                                "model, or its only one)")
    version: str | None = Field(None, description="the model's version (default: its highest "
                                                  "ready version)")


NO_QUERY = PredictQuery()


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
# Errors as HTTP answers, translated here (the middleware sends its own early 413 and 503)


def _error(request: Request, status: int, message: str, reason: str,
           subnet: str | None = None, headers: dict | None = None,
           missing_classes: list[str] | None = None) -> JSONResponse:
    request.state.error_reason = reason
    rid = getattr(request.state, "request_id", None)
    body = ErrorResponse(error=message, status=status, request_id=rid, subnet=subnet,
                         missing_classes=missing_classes)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI, gw: Gateway) -> None:
    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError):
        count_error(gw, exc)
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


async def decode(gw: Gateway, mv: ModelVersion, data: bytes, deadline: float) -> np.ndarray:
    """Image bytes -> the input of model version ``mv``; a thumbnail inline, anything larger
    in a thread, at most one per core at a time."""
    spec, limit, max_bytes = mv.spec, mv.max_pixels, mv.max_decoded_bytes
    if len(data) <= INLINE_DECODE_BYTES:
        img = open_image(data, limit, max_bytes)  # the header only: bounded by the byte count
        if img.size[0] * img.size[1] <= INLINE_DECODE_PIXELS:
            return image_to_input(img, spec)
        img.close()
    async with gw.admission.slot(gw.admission.decoding, deadline, "image decoding"):
        return await run_in_threadpool(decode_image, data, spec, limit, max_bytes)


def version_info(mv: ModelVersion) -> VersionInfo:
    spec = mv.spec
    return VersionInfo(name=mv.name, version=mv.version, state=mv.state, dataset=spec.name,
                       classes=list(spec.classes), input_shape=list(spec.input_shape),
                       mean=list(spec.mean), std=list(spec.std),
                       predictor=mv.predictor.describe())


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


def create_app(served: Predictor | ServedModels, settings: GatewaySettings | None = None, *,
               close_predictor: bool = True, own_port: bool = False,
               shared_ports: bool = False, line: int | None = None) -> FastAPI:
    """The gateway for one predictor (served as version 1 of its name) or for a table of
    models; ``close_predictor``: close what it serves when the app shuts down; ``own_port``:
    its lifespan also serves it on ``settings.host:port`` (:class:`~.server.EmbeddedServer`,
    for a host such as Serve's ingress replica, which runs the app behind a proxy);
    ``shared_ports``: one of several gateway processes of a server, so its gRPC port is shared
    with theirs (SO_REUSEPORT); ``line``: how many requests may wait for the predictor (see
    :class:`~.limit.AdaptiveLimit`; default: as many as it holds)."""
    settings = settings or GatewaySettings()
    models = served if isinstance(served, ServedModels) else ServedModels.of(served, settings)
    try:
        version = package_version("sensai")
    except PackageNotFoundError:
        version = "0"
    admission = Admission(settings, line=line)
    gw = Gateway(models, settings, models.metrics, admission, version)
    # Read when scraped: the limit changes once a window at most, not with every request.
    models.metrics.follow(models.metrics.predictor_limit, lambda: admission.predictor.limit)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc = poller = http = None
        admission.start()
        collector = heap.CollectorWatch(gw.metrics.gc_full)
        collector.start()
        try:
            try:
                gw.cores_awake = keep_cores_awake(settings.keep_cores_awake)
                await models.start()
                if settings.model_control == "poll":
                    poller = asyncio.create_task(models.poll_forever(settings.repository_poll_s))
            except SensaiError as e:
                app.state.startup_error = e  # uvicorn only logs it; `sensai serve` says it
                raise
            if settings.grpc_port is not None:
                from .grpc_server import GrpcServer  # grpc and tritonclient: only when asked

                try:
                    grpc = app.state.grpc = await GrpcServer(gw).start(
                        settings.host, settings.grpc_port, shared=shared_ports)
                except BaseException as e:
                    app.state.startup_error = e  # uvicorn only logs it; `sensai serve` says it
                    raise
            if own_port:
                http = app.state.http = await EmbeddedServer(app, settings.host,
                                                             settings.port).start()
            yield
        finally:
            if http is not None:  # first: no new request while the rest stops
                await http.stop()
            if poller is not None:
                poller.cancel()
            await admission.stop()
            collector.stop()
            if gw.cores_awake is not None:
                gw.cores_awake.release()
            if grpc is not None:
                await grpc.stop()
            if close_predictor:
                await models.close()

    app = FastAPI(title="sensai gateway", version=version, lifespan=lifespan,
                  description="Class-parallel CNN inference (sensAI)", responses=ERROR_RESPONSES)
    app.state.gateway = gw
    app.add_middleware(GatewayMiddleware, gateway=gw)
    _install_error_handlers(app, gw)

    # The prediction routes first: a request is matched against the routes in order.
    @app.post("/v1/predict", response_model=None,
              responses={200: {"model": PredictResponse, "description": "the prediction"}},
              openapi_extra=openapi_parameters((PredictQuery, "query")))
    async def predict_image(request: Request) -> Response:
        t0 = time.perf_counter()
        query = query_params(request, PredictQuery, NO_QUERY)
        deadline = request.state.deadline
        models.route(query.model, query.version)  # an unknown model is told before its upload
        data = await read_body(request, gw, image=True)
        async with models.hold(query.model, query.version) as mv:
            classes = mv.spec.classes
            if query.top_k is not None and query.top_k > len(classes):
                raise InputError(f"query top_k: at most {len(classes)}, the classes of model "
                                 f"{mv.name!r}", status=422)
            x = await decode(gw, mv, data, deadline)
            t1 = time.perf_counter()
            pred = await predict(gw, mv, x, query.allow_partial, deadline,
                                 request.state.request_id, request.state.ticket)
        rows = top_k_rows(pred.scores,
                          query.top_k or min(gw.settings.default_top_k, len(classes)),
                          classes, pred.covered_classes)
        timings = dict(pred.timings_ms)
        timings["decode"] = round((t1 - t0) * 1e3, 3)
        timings["request"] = round((time.perf_counter() - t0) * 1e3, 3)
        best = rows[0]
        body = {"request_id": request.state.request_id, "model": mv.name,
                "model_version": mv.version,
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
        models.route(model_name, version)  # an unknown model is told before its body
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
        async with models.hold(model_name, version) as mv:
            pred, outputs = await v2_infer(gw, mv, req, deadline, request.state.request_id,
                                           request.state.ticket)
        content, headers, media = oip.encode_infer_response(
            model_name=mv.name, model_version=mv.version, request_id=req.id, outputs=outputs,
            parameters=oip.response_parameters(pred))
        return Response(content, headers=headers, media_type=media)

    @app.get("/", include_in_schema=False)
    async def index(gw: GatewayDep) -> dict:
        name = gw.models.default_name()
        return {"name": "sensai", "model": name, "models": gw.models.names(),
                "predict": "/v1/predict", "kserve_v2": f"/v2/models/{name or '{model}'}",
                "metrics": "/metrics", "docs": "/docs"}

    @app.get("/v1/models", response_model=ModelInfo)
    async def model_info(gw: GatewayDep):
        served = [version_info(mv) for name in gw.models.names()
                  for mv in gw.models.models[name].values()]
        try:
            default = version_info(gw.models.route(None)).model_dump()
        except ServingError:
            default = {}
        return ModelInfo(**default, models=served, pid=os.getpid(),
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
        if not await run_in_threadpool(server_ready, gw):
            return _error(request, 503, "not ready", "not_ready")
        return {"ready": True}

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{version}")
    async def model_metadata(gw: GatewayDep, model_name: str, version: str | None = None):
        return v2_model_metadata(gw, gw.models.route(model_name, version))

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(request: Request, gw: GatewayDep, model_name: str,
                          version: str | None = None):
        mv = gw.models.route(model_name, version)
        if not await run_in_threadpool(version_ready, mv):
            return _error(request, 503, f"model {model_name!r} is not ready", "not_ready")
        return {"name": model_name, "version": mv.version, "ready": True}

    app.include_router(repository_routes())
    return app

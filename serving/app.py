"""The HTTP gateway: one image in, N-way prediction out, for any :class:`Predictor`.

Routes
* ``POST /v1/predict`` - an image (multipart field ``image`` or the raw body), ``?top_k=``;
* Open Inference Protocol (KServe v2): ``/v2``, ``/v2/health/{live,ready}``,
  ``/v2/models/{m}[/versions/{v}]``, ``.../ready``, ``.../infer`` (FP32 ``[B, C, H, W]`` tensor of
  *normalized* input, JSON or binary) - so ``tritonclient.http`` can call the gateway directly;
* ``GET /v1/models`` (what is served), ``GET /metrics`` (Prometheus).

Every error is JSON ``{"error", "status", "request_id", "subnet"}`` with a 4xx/5xx status; library
code raises :class:`sensai.errors.SensaiError` subclasses and only this module turns them into HTTP.
Nothing blocking runs on the event loop: image decoding goes to a worker thread, the predictor is
async.  (No ``from __future__ import annotations`` here: FastAPI must see the route annotations,
which refer to per-app values, as objects.)
"""

import json
import logging
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from sensai.errors import SensaiError

from . import oip
from .imaging import decode_image, image_to_input, open_image
from .metrics import GatewayMetrics
from .predictor import (InputError, ModelNotFound, PayloadTooLarge, Predictor, ServingError,
                        SubnetFailed, SubnetTimeout, check_batch, top_k_rows)
from .schemas import ERROR_RESPONSES, ClassScore, ErrorResponse, ModelInfo, PredictResponse
from .settings import GatewaySettings

log = logging.getLogger(__name__)

MODEL_VERSION = "1"
INPUT_NAME = "input"
OUTPUTS = ("scores", "class_index")
# Images at most this big (bytes, and pixels by their header) are decoded on the event loop.
_INLINE_DECODE_BYTES = 64 * 1024
_INLINE_DECODE_PIXELS = 128 * 128
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass
class Gateway:
    predictor: Predictor
    settings: GatewaySettings
    metrics: GatewayMetrics
    version: str


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


def _request_id(request: Request) -> str:
    return request.state.request_id


RequestId = Annotated[str, Depends(_request_id)]


# --------------------------------------------------------------------------------------------
# Pure ASGI middleware: request id, body size limit, metrics (BaseHTTPMiddleware would add a
# task and a copy per request on the hot path).


class GatewayMiddleware:
    def __init__(self, app, gateway: Gateway):
        self.app = app
        self.gw = gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gw, metrics = self.gw, self.gw.metrics
        limit = gw.settings.max_body_bytes
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
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
            too_big = None
            if length is not None:
                try:
                    if int(length) > limit:
                        too_big = f"request body is {int(length):,} bytes; the limit is {limit:,}"
                except ValueError:
                    too_big = None
            if too_big is not None:
                state["error_reason"] = "PayloadTooLarge"
                body = ErrorResponse(error=too_big + " (set SENSAI_MAX_BODY_BYTES)", status=413,
                                     request_id=rid).model_dump_json().encode()
                await send_wrapper({"type": "http.response.start", "status": 413, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send_wrapper({"type": "http.response.body", "body": body})
                return
            received = [0]

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request":
                    received[0] += len(message.get("body", b""))
                    if received[0] > limit:
                        raise PayloadTooLarge(f"request body is over the limit of {limit:,} bytes "
                                              "(set SENSAI_MAX_BODY_BYTES)")
                return message

            await self.app(scope, receive_limited, send_wrapper)
        finally:
            metrics.inflight.dec()
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            status = status_box[0]
            metrics.requests.labels(path, scope.get("method", ""), str(status)).inc()
            metrics.request_seconds.labels(path).observe(time.perf_counter() - t0)
            if status >= 400:
                metrics.errors.labels(path, str(status), state.get("error_reason", "http")).inc()


# --------------------------------------------------------------------------------------------


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
        if isinstance(exc, (SubnetFailed, SubnetTimeout)) and exc.subnet:
            gw.metrics.subnet_errors.labels(exc.subnet, "timeout" if isinstance(exc, SubnetTimeout)
                                            else "failed").inc()
            log.warning("request %s: %s", getattr(request.state, "request_id", "?"), exc)
        return _error(request, exc.status, str(exc), type(exc).__name__, exc.subnet,
                      missing_classes=getattr(exc, "missing_classes", None))

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


async def _read_image_bytes(request: Request) -> bytes:
    ctype = request.headers.get("content-type", "").lower()
    if ctype.startswith("multipart/form-data"):
        from starlette.datastructures import UploadFile

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
        raise InputError("send the image as multipart/form-data (field 'image') or as the raw "
                         "body, not as a url-encoded form", status=415)
    return await request.body()


def _model_metadata(gw: Gateway) -> dict:
    spec = gw.predictor.spec
    return {
        "name": gw.predictor.name,
        "versions": [MODEL_VERSION],
        "platform": "sensai",
        "inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": [-1, *spec.input_shape]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, spec.num_classes]},
                    {"name": "class_index", "datatype": "INT64", "shape": [-1]}],
        "parameters": {"preprocessing": f"uint8 pixels / 255, minus mean {list(spec.mean)}, "
                                         f"divided by std {list(spec.std)}",
                       "classes": list(spec.classes)},
    }


def _check_model(gw: Gateway, model_name: str, version: str | None) -> None:
    if model_name != gw.predictor.name:
        raise ModelNotFound(f"unknown model {model_name!r}; this server serves "
                            f"{gw.predictor.name!r}")
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model {model_name!r} has no version {version!r} "
                            f"(versions: {MODEL_VERSION})")


def _ready(gw: Gateway) -> bool:
    probe = getattr(gw.predictor, "is_ready", None)
    try:
        return bool(probe()) if callable(probe) else True
    except Exception:  # a probe that fails means "not ready", not a 500
        return False


def create_app(predictor: Predictor, settings: GatewaySettings | None = None, *,
               close_predictor: bool = True) -> FastAPI:
    """The gateway for ``predictor``; ``close_predictor``: close it when the app shuts down."""
    settings = settings or GatewaySettings()
    try:
        from importlib.metadata import version as _pkg_version

        version = _pkg_version("sensai")
    except Exception:
        version = "0"
    gw = Gateway(predictor, settings, GatewayMetrics(), version)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if close_predictor:
            await predictor.close()

    app = FastAPI(title="sensai gateway", version=version, lifespan=lifespan,
                  description="Class-parallel CNN inference (sensAI)", responses=ERROR_RESPONSES)
    app.state.gateway = gw
    app.add_middleware(GatewayMiddleware, gateway=gw)
    _install_error_handlers(app, gw)
    classes = predictor.spec.classes

    @app.get("/", include_in_schema=False)
    async def index(gw: GatewayDep) -> dict:
        return {"name": "sensai", "model": gw.predictor.name, "predict": "/v1/predict",
                "kserve_v2": f"/v2/models/{gw.predictor.name}", "metrics": "/metrics",
                "docs": "/docs"}

    @app.post("/v1/predict", response_model=PredictResponse)
    async def predict(request: Request, gw: GatewayDep, rid: RequestId,
                      top_k: Annotated[int | None, Query(ge=1, le=len(classes),
                                                         description="how many classes")] = None,
                      allow_partial: Annotated[bool, Query(
                          description="redundant serving: when some classes have no live "
                                      "subnet copy, answer over the others (flagged degraded) "
                                      "instead of 503/504")] = False):
        t0 = time.perf_counter()
        data = await _read_image_bytes(request)
        spec, max_pixels = gw.predictor.spec, gw.settings.max_image_pixels
        if len(data) <= _INLINE_DECODE_BYTES:
            img = open_image(data, max_pixels)  # the header only: bounded by the byte limit
            if img.size[0] * img.size[1] <= _INLINE_DECODE_PIXELS:
                # A thumbnail decodes in ~0.2 ms, less than the hop to a worker thread costs.
                x = image_to_input(img, spec)
            else:
                x = await run_in_threadpool(image_to_input, img, spec)
        else:  # large: everything off the event loop
            x = await run_in_threadpool(decode_image, data, spec, max_pixels)
        t1 = time.perf_counter()
        pred, covered = await _predict(gw, x, allow_partial)
        gw.metrics.observe_prediction(pred.timings_ms, 1)
        k = top_k or min(gw.settings.default_top_k, len(classes))
        if covered is not None:
            # Only classes that were answered may be listed; the others have no score at all.
            rows = [r for r in top_k_rows(pred.scores, len(classes), classes)[0]
                    if r["index"] in set(covered)][:k]
        else:
            rows = top_k_rows(pred.scores, k, classes)[0]
        timings = dict(pred.timings_ms)
        timings["decode"] = round((t1 - t0) * 1e3, 3)
        timings["request"] = round((time.perf_counter() - t0) * 1e3, 3)
        best = rows[0]
        return PredictResponse(request_id=rid, model=gw.predictor.name, label=best["label"],
                               index=best["index"], score=best["score"],
                               predictions=[ClassScore(**r) for r in rows], timings_ms=timings,
                               degraded=bool(getattr(pred, "degraded", False)),
                               covered_classes=covered,
                               missing_classes=getattr(pred, "missing_classes", None),
                               answered_by=getattr(pred, "answered_by", None) or None)

    @app.get("/v1/models", response_model=ModelInfo)
    async def model_info(gw: GatewayDep):
        spec = gw.predictor.spec
        return ModelInfo(name=gw.predictor.name, dataset=spec.name, classes=list(spec.classes),
                         input_shape=list(spec.input_shape), mean=list(spec.mean),
                         std=list(spec.std), predictor=gw.predictor.describe())

    @app.get("/metrics", include_in_schema=False)
    async def metrics(gw: GatewayDep):
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    # ---- Open Inference Protocol (KServe v2) ------------------------------------------------

    @app.get("/v2")
    async def server_metadata(gw: GatewayDep):
        return {"name": "sensai", "version": gw.version, "extensions": ["classification"]}

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready(request: Request, gw: GatewayDep):
        if not await run_in_threadpool(_ready, gw):
            return _error(request, 503, "not ready", "not_ready")
        return {"ready": True}

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{version}")
    async def model_metadata(gw: GatewayDep, model_name: str, version: str | None = None):
        _check_model(gw, model_name, version)
        return _model_metadata(gw)

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(request: Request, gw: GatewayDep, model_name: str,
                          version: str | None = None):
        _check_model(gw, model_name, version)
        if not await run_in_threadpool(_ready, gw):
            return _error(request, 503, f"model {model_name!r} is not ready", "not_ready")
        return {"name": model_name, "ready": True}

    @app.post("/v2/models/{model_name}/infer")
    @app.post("/v2/models/{model_name}/versions/{version}/infer")
    async def infer(request: Request, gw: GatewayDep, model_name: str, version: str | None = None):
        _check_model(gw, model_name, version)
        body = await request.body()
        body = oip.decode_content(body, request.headers.get("content-encoding"),
                                  gw.settings.max_body_bytes)
        req = oip.parse_infer_request(body, request.headers.get(oip.HEADER_LENGTH))
        x = _infer_input(req, gw)
        allow_partial = req.parameters.get("allow_partial", False)
        if not isinstance(allow_partial, bool):
            raise InputError("parameters.allow_partial must be true or false, got "
                             f"{allow_partial!r}")
        pred, covered = await _predict(gw, x, allow_partial)
        gw.metrics.observe_prediction(pred.timings_ms, x.shape[0])
        params: dict[str, Any] = {"timings_ms": json.dumps(pred.timings_ms)}
        # Scores of unanswered classes are 0; rankings must never name them.
        outputs = _infer_outputs(req, pred.scores, classes, covered=covered)
        if covered is not None:
            params.update(degraded=True, covered_classes=json.dumps(covered),
                          missing_classes=json.dumps(pred.missing_classes))
        content, headers, media = oip.encode_infer_response(
            model_name=gw.predictor.name, model_version=version or MODEL_VERSION,
            request_id=req.id, outputs=outputs, parameters=params)
        return Response(content, headers=headers, media_type=media)

    return app


async def _predict(gw: Gateway, x: np.ndarray, allow_partial: bool):
    """The prediction, and the classes it covers when it is a degraded partial answer (else
    None).  Predictors without partial answers answer in full or fail, whatever is allowed."""
    if allow_partial and getattr(gw.predictor, "supports_partial", False):
        pred = await gw.predictor.predict(x, allow_partial=True)
    else:
        pred = await gw.predictor.predict(x)
    covered = getattr(pred, "covered_classes", None) if getattr(pred, "degraded", False) else None
    return pred, covered


def _infer_input(req: oip.InferRequest, gw: Gateway) -> np.ndarray:
    spec = gw.predictor.spec
    if len(req.inputs) != 1:
        raise InputError(f"model takes exactly one input {INPUT_NAME!r}, got {len(req.inputs)}")
    t = req.inputs[0]
    if t.name != INPUT_NAME:
        raise InputError(f"unknown input {t.name!r}; the model's input is {INPUT_NAME!r}")
    if t.datatype != "FP32":
        raise InputError(f"input {INPUT_NAME!r} must be FP32, got {t.datatype}")
    want = list(spec.input_shape)
    if len(t.shape) != 4 or t.shape[1:] != want:
        raise InputError(f"input {INPUT_NAME!r} must have shape [batch, "
                         f"{', '.join(map(str, want))}], got {t.shape}")
    return check_batch(t.array, spec, gw.settings.max_batch)


def _infer_outputs(req: oip.InferRequest, scores: np.ndarray, classes,
                   covered: list[int] | None = None) -> list[tuple[str, np.ndarray, bool]]:
    ranked = scores
    if covered is not None:  # a degraded answer: rank only the classes that were answered
        ranked = np.full_like(scores, -np.inf)
        ranked[:, covered] = scores[:, covered]
    wanted = req.outputs if req.outputs is not None else [oip.RequestedOutput(n) for n in OUTPUTS]
    if not wanted:
        raise InputError("'outputs' is empty: ask for 'scores' and/or 'class_index'")
    out = []
    for o in wanted:
        if o.name not in OUTPUTS:
            raise InputError(f"unknown output {o.name!r}; outputs are {', '.join(OUTPUTS)}")
        binary = req.binary_output if o.binary is None else o.binary
        if o.classification:
            k = o.classification if covered is None else min(o.classification, len(covered))
            arr = oip.classification(ranked, k, classes)
        elif o.name == "scores":
            arr = scores.astype(np.float32, copy=False)
        else:
            arr = ranked.argmax(axis=1).astype(np.int64)
        out.append((o.name, arr, binary))
    return out


class BackgroundServer:
    """A gateway app under uvicorn in a background thread (tests, benchmarks, notebooks).

    ``port=0`` lets the OS pick a free port; :attr:`url` is known once :meth:`start` returns.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", startup_timeout_s: float = 60.0):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                     lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self.server.run, name="sensai-gateway",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise SensaiError(f"the gateway failed to start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise SensaiError(f"the gateway did not start within {self.startup_timeout_s} s")
            time.sleep(0.02)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

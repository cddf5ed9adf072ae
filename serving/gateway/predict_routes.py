"""The prediction routes: ``POST /v1/predict`` (an image) and ``POST
/v2/models/{model_name}[/versions/{version}]/infer`` (KServe v2 tensors).

They are most of what the gateway answers, so they cost as little as the gateway can make them:
each reads its own parameters and builds its own JSON (FastAPI's per-request parameter solving
and response-model validation cost more than the rest of the request), and
:class:`PredictRoutes` dispatches them itself from the gateway's middleware
(:class:`~.middleware.GatewayMiddleware`), past Starlette's router and exception middleware:
the same endpoint functions, errors translated by the same rules
(:class:`~.http_errors.ErrorTranslator`).  This is their one way in, whichever HTTP server runs
the app: uvicorn's httptools protocol reaches the middleware on a lean cycle
(:mod:`~.lean_cycle`), its h11 protocol and Serve's proxy through FastAPI's stack.  They are
registered with FastAPI too, but only so that its OpenAPI document describes them and the
metrics name their routes: the middleware answers them before FastAPI's router sees them."""

from __future__ import annotations

import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from sensai.merge import ranking

from ..core.errors import InputError
from . import oip
from .http_errors import ErrorTranslator
from .imaging import decode_image, image_to_input, open_image
from .inference import INLINE_PARSE_BYTES, Gateway, answered, predict, v2_infer
from .schemas import PredictResponse
from .model_table import ModelVersion
from .statistics import RequestClock
from .wire import PREDICT, json_bytes

# Images at most this big are decoded on the event loop (cheaper than a hop to a thread); the
# header's size and PNG's text chunks are bounded, so this work is too.
INLINE_DECODE_BYTES = 64 * 1024
INLINE_DECODE_PIXELS = 128 * 128

INFER = "/v2/models/{model_name}/infer"
INFER_VERSION = "/v2/models/{model_name}/versions/{version}/infer"
JSON_TYPE = "application/json"
MATCHED = "sensai.prediction_route"  # the scope's key for match's answer
DEFAULT_TOP_K = 5  # classes in an answer whose request names no top_k


class PredictQuery(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    top_k: int | None = Field(None, ge=1, description="how many classes (at most the model's; "
                                                       f"default {DEFAULT_TOP_K})")
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


def text_field_bytes(text: str) -> bytes:
    """The bytes of a multipart field sent without a filename (``curl -F "image=<FILE"``), which
    Starlette hands over as text: decoded as UTF-8 where the bytes are valid UTF-8, else as
    Latin-1.  An image is binary (PNG and JPEG open with bytes that are no UTF-8), so the Latin-1
    bytes are taken where they are not valid UTF-8 themselves."""
    try:
        raw = text.encode("latin-1")
        raw.decode("utf-8")
    except UnicodeEncodeError:  # a character above U+00FF: it was UTF-8
        return text.encode("utf-8")
    except UnicodeDecodeError:  # no UTF-8, so Starlette fell back to Latin-1
        return raw
    return text.encode("utf-8")


async def read_body(request: Request, gw: Gateway, *, image: bool) -> bytes:
    """The request body (an image's bytes when ``image``: multipart field or raw body), within
    the body time limit and a receiving slot."""
    if image and (enc := request.headers.get("content-encoding", "").strip().lower()) not in (
            "", "identity"):
        # An image is compressed already; the v2 route's gzip/deflate is for tensors.
        raise InputError(f"unsupported Content-Encoding {enc!r} for an image: send its bytes as "
                         "they are (PNG and JPEG are compressed already)", status=415)
    async with gw.admission.body(request.state.deadline):
        ctype = request.headers.get("content-type", "").lower() if image else ""
        if ctype.startswith("multipart/form-data"):
            try:
                form = await request.form(max_files=1, max_fields=8)
            # Starlette raises its parser's own exception (limits, syntax) where the scope has no
            # app (the protocol-level path), an HTTPException where it has one.
            except (StarletteHTTPException, MultiPartException) as e:
                why = e.detail if isinstance(e, StarletteHTTPException) else e.message
                raise InputError(f"malformed multipart body: {why}") from None
            try:
                field = form.get("image")
                if field is None:
                    raise InputError("multipart body has no 'image' field")
                if isinstance(field, UploadFile):
                    return await field.read()
                return text_field_bytes(field)
            finally:
                await form.close()
        if ctype.startswith("application/x-www-form-urlencoded"):
            raise InputError("send the image as multipart/form-data (field 'image') or as the "
                             "raw body, not as a url-encoded form", status=415)
        return await request.body()


async def decode(gw: Gateway, mv: ModelVersion, data: bytes, deadline: float) -> np.ndarray:
    """Image bytes -> the input of model version ``mv``; a thumbnail inline, anything larger
    in a thread, at most one per core at a time."""
    spec, limit = mv.spec, mv.max_pixels
    if len(data) <= INLINE_DECODE_BYTES:
        img = open_image(data, limit)  # the header only: bounded by the byte count
        if img.size[0] * img.size[1] <= INLINE_DECODE_PIXELS:
            return image_to_input(img, spec)
        img.close()
    async with gw.admission.slot(gw.admission.decoding, deadline, "image decoding"):
        return await run_in_threadpool(decode_image, data, spec, limit)


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


class PredictRoutes:
    """The prediction routes of gateway ``gw``: their endpoints, their registration with
    FastAPI, and their own dispatch (:meth:`match`, :meth:`dispatch`)."""

    def __init__(self, gw: Gateway, errors: ErrorTranslator):
        self.gw = gw
        self.errors = errors
        self.routes: dict[str, object] = {}  # path template -> FastAPI's route (metrics label)

    # -- the endpoints

    async def predict_image(self, request: Request) -> Response:
        gw = self.gw
        models = gw.models
        t0 = time.perf_counter()
        query = query_params(request, PredictQuery, NO_QUERY)
        state = request.state
        deadline = state.deadline
        models.route(query.model, query.version)  # an unknown model is told before its upload
        data = await read_body(request, gw, image=True)
        clock = RequestClock()
        async with models.hold(query.model, query.version) as mv:
            try:
                classes = mv.spec.classes
                if query.top_k is not None and query.top_k > len(classes):
                    raise InputError(f"query top_k: at most {len(classes)}, the classes of "
                                     f"model {mv.name!r}", status=422)
                x = await decode(gw, mv, data, deadline)
                t1 = time.perf_counter()
                pred = await predict(gw, mv, x, query.allow_partial, deadline,
                                     state.request_id, state.ticket, clock)
            except BaseException:
                gw.metrics.stats.failure(mv.name, mv.version, clock)
                raise
        rows = top_k_rows(pred.scores,
                          query.top_k or min(DEFAULT_TOP_K, len(classes)),
                          classes, pred.covered_classes)
        timings = dict(pred.timings_ms)
        timings["decode"] = round((t1 - t0) * 1e3, 3)
        timings["request"] = round((time.perf_counter() - t0) * 1e3, 3)
        best = rows[0]
        body = {"request_id": state.request_id, "model": mv.name,
                "model_version": mv.version,
                "label": best["label"], "index": best["index"], "score": best["score"],
                "predictions": rows, "timings_ms": timings, "degraded": pred.degraded,
                "covered_classes": pred.covered_classes,
                "missing_classes": pred.missing_classes,
                "answered_by": pred.answered_by or None}
        response = Response(json_bytes(body), media_type=JSON_TYPE)
        answered(gw, mv, 1, pred, clock)
        return response

    async def infer(self, request: Request) -> Response:
        gw = self.gw
        path = request.path_params
        model_name, version = path["model_name"], path.get("version")
        if "version" not in path and request.scope.get("query_string"):
            version = request.query_params.get("version")
        gw.models.route(model_name, version)  # an unknown model is told before its body
        state = request.state
        deadline = state.deadline
        body = await read_body(request, gw, image=False)
        clock = RequestClock()
        headers = request.headers
        encoding = headers.get("content-encoding")
        if len(lengths := headers.getlist(oip.HEADER_LENGTH)) > 1:  # which one was meant?
            raise InputError(f"the request has {len(lengths)} {oip.HEADER_LENGTH} headers; "
                             "send one")
        args = (body, encoding, gw.settings.max_body_bytes, headers.get(oip.HEADER_LENGTH))
        # A compressed body's parse cost is that of what it expands to: never inline.
        if len(body) <= INLINE_PARSE_BYTES and not encoding:
            req = oip.decode_request(*args)
        else:
            async with gw.admission.slot(gw.admission.decoding, deadline, "request parsing"):
                req = await run_in_threadpool(oip.decode_request, *args)
        async with gw.models.hold(model_name, version) as mv:
            pred, outputs = await v2_infer(gw, mv, req, deadline, state.request_id,
                                           state.ticket, clock)
        content, out_headers, media = oip.encode_infer_response(
            model_name=mv.name, model_version=mv.version, request_id=req.id, outputs=outputs,
            parameters=oip.response_parameters(pred))
        answered(gw, mv, len(pred.scores), pred, clock)
        return Response(content, headers=out_headers, media_type=media)

    # -- FastAPI's view of them (the OpenAPI document, the route names of the metrics)

    def register(self, app: FastAPI) -> None:
        """Add the routes to ``app``, first: a request is matched against the routes in
        order."""
        async def predict_image(request: Request) -> Response:
            return await self.predict_image(request)

        async def infer(request: Request) -> Response:
            return await self.infer(request)

        app.add_api_route(PREDICT, predict_image, methods=["POST"], response_model=None,
                          responses={200: {"model": PredictResponse,
                                           "description": "the prediction"}},
                          openapi_extra=openapi_parameters((PredictQuery, "query")))
        app.add_api_route(INFER, infer, methods=["POST"], openapi_extra=openapi_parameters(
            (ModelPath, "path"), (VersionQuery, "query")))
        app.add_api_route(INFER_VERSION, infer, methods=["POST"],
                          openapi_extra=openapi_parameters((ModelVersionPath, "path")))
        self.routes = {r.path: r for r in app.router.routes
                       if getattr(r, "path", None) in (PREDICT, INFER, INFER_VERSION)}

    # -- the gateway's own dispatch

    def match(self, scope) -> tuple | None:
        """``(endpoint, route, path parameters)`` for a request to a prediction route, as
        Starlette's router would match it; None for any other request (FastAPI's).  Found once
        per request and kept in its scope: the HTTP protocol asks before the middleware does."""
        try:
            return scope[MATCHED]
        except KeyError:
            found = scope[MATCHED] = self.find(scope)
            return found

    def find(self, scope) -> tuple | None:
        if scope["method"] != "POST":
            return None  # FastAPI answers other methods (405 with Allow)
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # as Starlette's router sees it
            path = path[len(root):]
        if path == PREDICT:
            return self.predict_image, self.routes.get(PREDICT), {}
        if not path.startswith("/v2/models/") or not path.endswith("/infer"):
            return None
        parts = path.split("/")  # "", "v2", "models", name, ["versions", version,] "infer"
        if len(parts) == 5 and parts[3]:
            return self.infer, self.routes.get(INFER), {"model_name": parts[3]}
        if len(parts) == 7 and parts[3] and parts[4] == "versions" and parts[5]:
            return (self.infer, self.routes.get(INFER_VERSION),
                    {"model_name": parts[3], "version": parts[5]})
        return None

    async def dispatch(self, scope, receive, send, endpoint, route, params: dict) -> None:
        """Run ``endpoint`` for the request and send its answer (or its error's)."""
        scope["route"], scope["path_params"] = route, params
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            response = self.errors(request, exc)
        await response(scope, receive, send)

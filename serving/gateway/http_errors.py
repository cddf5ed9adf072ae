"""Errors as HTTP answers: the one translation, for the routes FastAPI dispatches (its exception
handlers) and for the prediction routes the gateway dispatches itself
(:class:`~.predict_routes.PredictRoutes`).  Library code raises
:class:`sensai.errors.SensaiError` subclasses; only this module (and the middleware's early 413
and 503) turns them into JSON ``{"error", "status", "request_id", "subnet",
"missing_classes"}``."""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sensai.errors import SensaiError

from ..core.errors import ServingError
from .inference import Gateway, count_error
from .schemas import ErrorResponse

log = logging.getLogger(__name__)


def error_response(request: Request, status: int, message: str, reason: str,
                   subnet: str | None = None, headers: dict | None = None,
                   missing_classes: list[str] | None = None) -> JSONResponse:
    """The gateway's JSON error; ``reason`` labels it in the metrics."""
    request.state.error_reason = reason
    rid = getattr(request.state, "request_id", None)
    body = ErrorResponse(error=message, status=status, request_id=rid, subnet=subnet,
                         missing_classes=missing_classes)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:3]:
        loc = " ".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


class ErrorTranslator:
    """Exception -> the gateway's HTTP answer, by the most specific class that has a rule."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self.rules: dict[type, Callable[[Request, Exception], JSONResponse]] = {
            ServingError: self.serving, SensaiError: self.sensai,
            RequestValidationError: self.validation, StarletteHTTPException: self.http,
            ClientDisconnect: self.gone, Exception: self.internal}

    def __call__(self, request: Request, exc: Exception) -> JSONResponse:
        for cls in type(exc).__mro__:
            rule = self.rules.get(cls)
            if rule is not None:
                return rule(request, exc)
        raise exc  # a BaseException that is not an Exception (cancellation): not an answer

    def serving(self, request: Request, exc: ServingError) -> JSONResponse:
        count_error(self.gw, exc)
        headers = ({"Retry-After": f"{max(1, round(exc.retry_after))}"}
                   if exc.retry_after is not None else None)
        return error_response(request, exc.status, str(exc), type(exc).__name__, exc.subnet,
                              headers=headers, missing_classes=exc.missing_classes)

    def sensai(self, request: Request, exc: SensaiError) -> JSONResponse:
        return error_response(request, 400, str(exc), type(exc).__name__)

    def validation(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, 422, validation_message(exc), "validation")

    def http(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail), "http",
                              headers=getattr(exc, "headers", None))

    def gone(self, request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client closed the connection before its body was in: no one reads this answer,
        # and a client's leaving is no server fault to log (499, as nginx counts it).
        return error_response(request, 499, "the client closed the connection before its "
                              "request body arrived", "ClientDisconnect")

    def internal(self, request: Request, exc: Exception) -> JSONResponse:
        log.error("request %s failed", getattr(request.state, "request_id", "?"),
                  exc_info=exc)
        return error_response(request, 500, f"internal error ({type(exc).__name__}); see the "
                              "server log", "internal")

    def install(self, app: FastAPI) -> None:
        """Make these FastAPI's exception handlers."""
        for cls in self.rules:
            app.add_exception_handler(cls, self.handler)

    async def handler(self, request: Request, exc: Exception) -> JSONResponse:
        return self(request, exc)

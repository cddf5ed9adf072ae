"""The HTTP gateway: one image in, N-way prediction out, for any :class:`Predictor`.

Routes
* ``POST /v1/predict`` - an image (multipart field ``image`` or the raw body), ``?top_k=``,
  ``?allow_partial=``;
* Open Inference Protocol (KServe v2): ``/v2``, ``/v2/health/{live,ready}``,
  ``/v2/models/{m}[/versions/{v}]``, ``.../ready``, ``.../infer`` (FP32 ``[B, C, H, W]`` tensor of
  *normalized* input, JSON or binary) - so ``tritonclient.http`` can call the gateway directly;
* ``GET /v1/models`` (what is served, where every worker runs), ``GET /metrics`` (Prometheus);
* the KServe v2 repository extension (``/v2/repository/...``).

:func:`create_app` only assembles: the prediction routes
(:mod:`~sensai.serving.gateway.predict_routes`, always dispatched by the gateway's middleware
itself),
the others (:mod:`~.control_routes`, :mod:`~.repository_api`), the middleware that admits, limits
and measures every request (:mod:`~.middleware`), the one translation of errors into HTTP
answers (:mod:`~.http_errors`) and what runs beside the requests (:mod:`~.lifespan`).  With
``settings.grpc_port`` set, the lifespan also serves the Open Inference Protocol over gRPC
(:mod:`sensai.serving.gateway.grpc_server`) on the same event loop, predictor and admission; both
go through :mod:`sensai.serving.gateway.inference` from a parsed input to a prediction.  The work a
request may cause is bounded (:mod:`sensai.serving.gateway.admission`); nothing slow or unbounded
runs on the event loop, so health checks answer whatever the other requests are doing.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import FastAPI
from starlette.middleware.errors import ServerErrorMiddleware

from ..core.contract import Predictor
from ..core.settings import GatewaySettings
from .admission import Admission
from .control_routes import add_control_routes
from .http_errors import ErrorTranslator
from .inference import Gateway
from .lean_cycle import LeanRoutes
from .lifespan import gateway_lifespan
from .middleware import GatewayMiddleware
from .predict_routes import PredictRoutes
from .repository_api import add_repository_routes
from .schemas import ERROR_RESPONSES
from .served import ServedModels
from .shared_memory import SystemSharedMemory


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
    shared = models.metrics.shared_dir  # several gateway processes: their regions are shared
    shm = SystemSharedMemory(os.path.join(os.path.dirname(shared), "shm") if shared else None,
                             max_tensor_bytes=settings.max_body_bytes)
    gw = Gateway(models, settings, models.metrics, admission, version, shm)
    # Read when scraped: the limit changes once a window at most, not with every request.
    models.metrics.follow(models.metrics.predictor_limit, lambda: admission.predictor.limit)

    app = FastAPI(title="sensai gateway", version=version, responses=ERROR_RESPONSES,
                  description="Class-parallel CNN inference (sensAI)",
                  lifespan=gateway_lifespan(gw, close_predictor=close_predictor,
                                            own_port=own_port, shared_ports=shared_ports))
    app.state.gateway = gw
    errors = ErrorTranslator(gw)
    errors.install(app)
    predictions = PredictRoutes(gw, errors)
    predictions.register(app)
    app.add_middleware(GatewayMiddleware, gateway=gw, predictions=predictions)
    # What the HTTP protocol runs for a prediction, past FastAPI's stack: the same middleware,
    # inside the error middleware FastAPI would have put around it.
    app.state.lean = LeanRoutes(predictions.match, ServerErrorMiddleware(
        GatewayMiddleware(app, gw, predictions), handler=errors.handler))
    add_control_routes(app)
    add_repository_routes(app)
    return app

"""The gateway's routes other than predictions, dispatched by FastAPI: what is served
(``GET /``, ``GET /v1/models``), ``GET /metrics`` (Prometheus), and the Open Inference
Protocol's server and model metadata and health (``/v2``, ``/v2/health/{live,ready}``,
``/v2/models/{m}[/versions/{v}]``, ``.../ready``), and Triton's model configuration
(``.../config``), statistics (``/v2/models[/{m}[/versions/{v}]]/stats``) and system shared
memory (``/v2/systemsharedmemory/...``)."""

from __future__ import annotations

import os
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from ..core.errors import ServingError
from .http_errors import error_response
from .inference import (Gateway, server_ready, statistics, v2_model_config, v2_model_metadata,
                        v2_server_metadata, version_ready)
from .schemas import ModelInfo, VersionInfo
from .model_table import ModelVersion
from .repository_api import json_body


# Dependencies are async: FastAPI runs a sync dependency in its thread pool, a hop per request.
async def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


def version_info(mv: ModelVersion) -> VersionInfo:
    spec = mv.spec
    return VersionInfo(name=mv.name, version=mv.version, state=mv.state, dataset=spec.name,
                       classes=list(spec.classes), input_shape=list(spec.input_shape),
                       mean=list(spec.mean), std=list(spec.std),
                       predictor=mv.predictor.describe())


def add_control_routes(app: FastAPI) -> None:
    """Add the routes to ``app`` itself: an included router would be matched as a nested
    router, a cost on every request to every route."""

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
                         cores_awake=gw.cores_awake.describe() if gw.cores_awake else None,
                         settings=gw.settings.changed())

    @app.get("/metrics", include_in_schema=False)
    async def metrics(gw: GatewayDep):
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    @app.get("/v2")
    async def server_metadata(gw: GatewayDep):
        return v2_server_metadata(gw)

    add_shared_memory_routes(app)

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready(request: Request, gw: GatewayDep):
        if not await run_in_threadpool(server_ready, gw):
            return error_response(request, 503, "not ready", "not_ready")
        return {"ready": True}

    # Before the model metadata: "/v2/models/stats" would be a model named "stats".
    @app.get("/v2/models/stats")
    @app.get("/v2/models/{model_name}/stats")
    @app.get("/v2/models/{model_name}/versions/{version}/stats")
    async def model_statistics(gw: GatewayDep, model_name: str | None = None,
                               version: str | None = None):
        # Where several gateway processes serve, the answer reads their files: off the loop.
        return await run_in_threadpool(statistics, gw, model_name, version)

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{version}")
    async def model_metadata(gw: GatewayDep, model_name: str, version: str | None = None):
        return v2_model_metadata(gw, gw.models.route(model_name, version))

    @app.get("/v2/models/{model_name}/config")
    @app.get("/v2/models/{model_name}/versions/{version}/config")
    async def model_config(gw: GatewayDep, model_name: str, version: str | None = None):
        return v2_model_config(gw, gw.models.route(model_name, version))

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(request: Request, gw: GatewayDep, model_name: str,
                          version: str | None = None):
        mv = gw.models.route(model_name, version)
        if not await run_in_threadpool(version_ready, mv):
            return error_response(request, 503, f"model {model_name!r} is not ready",
                                  "not_ready")
        return {"name": model_name, "version": mv.version, "ready": True}


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "100" is not a byte count
    key: str
    offset: int = 0
    byte_size: int


SHM = "/v2/systemsharedmemory"


def add_shared_memory_routes(app: FastAPI) -> None:
    """Triton's system shared-memory extension (:mod:`~.shared_memory`)."""

    @app.get(SHM + "/status")
    @app.get(SHM + "/region/{name}/status")
    async def shm_status(gw: GatewayDep, name: str | None = None) -> list[dict]:
        return gw.shared_memory.status(name)

    @app.post(SHM + "/region/{name}/register")
    async def shm_register(request: Request, gw: GatewayDep, name: str) -> dict:
        body = await json_body(request, RegisterRequest)
        gw.shared_memory.register(name, body.key, body.offset, body.byte_size,
                                  client=request.client.host if request.client else None)
        return {}

    @app.post(SHM + "/unregister")
    @app.post(SHM + "/region/{name}/unregister")
    async def shm_unregister(gw: GatewayDep, name: str | None = None) -> dict:
        gw.shared_memory.unregister(name)
        return {}

    # No CUDA region can be registered (its register route does not exist), so these have
    # nothing to list or let go: clients that clean up every kind (perf_analyzer) must not fail.
    @app.get("/v2/cudasharedmemory/status")
    async def cuda_shm_status() -> list[dict]:
        return []

    @app.post("/v2/cudasharedmemory/unregister")
    @app.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_shm_unregister(name: str | None = None) -> dict:
        return {}

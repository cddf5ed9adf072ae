"""What the gateway runs from its startup to its shutdown, beside the requests: the admission's
clock, the collector watch, the cores kept awake, the models (loaded, and polled for changes),
the gRPC server and, for a host that runs the app behind a proxy, the app on its own port."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from sensai.errors import SensaiError

from ..core.wakeup import keep_cores_awake
from . import heap
from .inference import Gateway
from .server import EmbeddedServer


def gateway_lifespan(gw: Gateway, *, close_predictor: bool, own_port: bool,
                     shared_ports: bool):
    """FastAPI's ``lifespan`` for gateway ``gw`` (see
    :func:`~sensai.serving.gateway.app.create_app` for the options)."""
    settings, models, admission = gw.settings, gw.models, gw.admission

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
                if settings.model_control_kind == "poll":
                    poller = asyncio.create_task(models.poll_forever(settings.repository_poll_s))
            except SensaiError as e:
                app.state.startup_error = e  # uvicorn only logs it; `sensai serve` says it
                raise
            if settings.grpc_port is not None:
                from .grpc_server import GrpcServer  # grpc and tritonclient: only when asked

                try:
                    grpc = app.state.grpc = await GrpcServer(gw).start(
                        settings.host, settings.grpc_port, shared=shared_ports)
                    # Port 0 was the kernel's choice: /v1/models says where clients connect.
                    gw.settings = settings.model_copy(update={"grpc_port": grpc.port})
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
            gw.shared_memory.close()

    return lifespan

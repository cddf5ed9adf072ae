"""The KServe v2 repository extension over HTTP, and who may use it (gRPC asks the same).

``POST /v2/repository/index`` (body ``{"ready": bool}`` optional), ``POST
/v2/repository/models/{name}/load`` and ``.../unload`` (bodies optional, no parameters), as
Triton has them: a load returns once the versions the model's policy picks are ready and the
others are drained and unloaded; an unload once the requests holding the model are done.

The API is off unless ``model_control`` is ``explicit`` or ``poll`` (poll: index only, the
files decide).  With ``repository_token`` set it asks for ``Authorization: Bearer <token>``;
without one it answers loopback clients only, so turning it on never opens it to the network
by itself.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from sensai.net import is_loopback

from ..core.errors import Forbidden, InputError, Unauthorized
from ..core.settings import GatewaySettings

PREFIX = "/v2/repository"
LOOPBACK_HINT = "set SENSAI_REPOSITORY_TOKEN (or --repository-token-file) to allow others"


def check_access(settings: GatewaySettings, *, client: str | None, authorization: str | None,
                 changes: bool) -> None:
    """Raise unless ``client`` (its address) may call the repository API: ``changes``, a load
    or unload (refused in poll mode, where the files decide)."""
    if settings.model_control == "none":
        raise Forbidden("the model repository API is off (start the gateway with "
                        "--model-control explicit or poll)")
    if changes and settings.model_control_kind == "poll":
        raise Forbidden("the repository is polled (--model-control poll): change its files, "
                        "not the API")
    token = settings.repository_token
    if token is not None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  token.encode()):
            raise Unauthorized("the repository API needs 'Authorization: Bearer <token>'")
    elif not is_loopback(client):
        raise Forbidden(f"the repository API answers loopback clients only; {LOOPBACK_HINT}")


# Strict: a string is not taken for a flag or a count ("yes" for true, "100" for 100).
class IndexRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ready: bool = False


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    parameters: dict[str, object] = {}


async def json_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON body as ``model`` (empty: its defaults), read within the body time
    limit as a prediction's is: a body that never ends is answered 408, not waited for."""
    async with request.app.state.gateway.admission.body(request.state.deadline):
        raw = await request.body()
    try:
        return model.model_validate_json(raw) if raw.strip() else model()
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise InputError(f"{where}: {first.get('msg')}") from None


def guard(changes: bool):
    """The dependency that checks a route's caller (:func:`check_access`)."""
    async def check(request: Request) -> None:
        check_access(request.app.state.gateway.settings,
                     client=request.client.host if request.client else None,
                     authorization=request.headers.get("authorization"), changes=changes)
    return Depends(check)


def add_repository_routes(app: FastAPI) -> None:
    """Add the routes to ``app`` itself (an included router is matched as a nested router, a
    cost on every request)."""
    tags = ["model repository"]

    @app.post(f"{PREFIX}/index", dependencies=[guard(changes=False)], tags=tags)
    async def index(request: Request) -> list[dict]:
        body = await json_body(request, IndexRequest)
        return request.app.state.gateway.models.index(ready_only=body.ready)

    @app.post(PREFIX + "/models/{model_name}/load", dependencies=[guard(changes=True)],
              tags=tags)
    async def load(request: Request, model_name: str) -> dict:
        body = await json_body(request, ModelRequest)
        if body.parameters:
            raise InputError("load takes no parameters: a new version is a new folder in the "
                             "repository")
        await request.app.state.gateway.models.load(model_name)
        return {}

    @app.post(PREFIX + "/models/{model_name}/unload", dependencies=[guard(changes=True)],
              tags=tags)
    async def unload(request: Request, model_name: str) -> dict:
        await json_body(request, ModelRequest)  # unload_dependents: there are no dependents
        await request.app.state.gateway.models.unload(model_name)
        return {}


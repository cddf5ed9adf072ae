"""The gateway's JSON errors as they go on the wire, and the routes no overload turns away: one
place for the ASGI middleware (:mod:`~sensai.serving.gateway.middleware`) and the HTTP protocol
(:mod:`~sensai.serving.gateway.http_protocol`), which answers before any app runs."""

from __future__ import annotations

import json

# Answered whatever the load: never queued, never turned away.
UNGATED = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
# The repository API too: an operator swapping a model must get through an overload.
UNGATED_PREFIX = "/v2/repository/"

# One encoder (json.dumps with any non-default argument builds a new one per call).
JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def json_bytes(obj) -> bytes:
    return JSON.encode(obj).encode()


def ungated(path: str) -> bool:
    return path in UNGATED or path.startswith(UNGATED_PREFIX)


def error_body(status: int, message: str, rid: str) -> bytes:
    """:class:`~sensai.serving.gateway.schemas.ErrorResponse`'s shape, for an error no route
    raised."""
    return json_bytes({"error": message, "status": status, "request_id": rid,
                       "subnet": None, "missing_classes": None})


async def reply(send, status: int, message: str, rid: str, extra=()) -> None:
    """A JSON error sent before (or instead of) the app."""
    body = error_body(status, message, rid)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *extra]})
    await send({"type": "http.response.body", "body": body})

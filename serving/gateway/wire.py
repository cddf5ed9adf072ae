"""The gateway's errors as they go on the wire, the routes no overload turns away, and request
ids: one place for the ASGI middleware (:mod:`~sensai.serving.gateway.middleware`) and the HTTP
protocol (:mod:`~sensai.serving.gateway.http_protocol`), which answers before any app runs.

Under overload most answers are refusals, so a refusal costs as little as possible: its response
is built once per reason (:class:`Refusals`), only the request id is put in, and a request id is
a process prefix and a counter (no system call, as ``os.urandom`` per request was).
"""

from __future__ import annotations

import itertools
import json
import os
import re

# Answered whatever the load: never queued, never turned away.
UNGATED = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
# The repository API too: an operator swapping a model must get through an overload.
UNGATED_PREFIX = "/v2/repository/"
PREDICT = "/v1/predict"
INFER_SUFFIX = "/infer"  # /v2/models/{m}[/versions/{v}]/infer

# One encoder (json.dumps with any non-default argument builds a new one per call).
JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ID_PREFIX = os.urandom(8).hex()  # this process's, so ids stay unique across gateway processes
_IDS = itertools.count()
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Content Too Large",
           431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
RETRY_AFTER_S = 1
ID_MARK = "<request id>"  # where a prebuilt body takes its request id


def json_bytes(obj) -> bytes:
    return JSON.encode(obj).encode()


# A model's readiness is a health check too (KServe's and Triton's probes ask it).
MODEL_READY = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/ready")


def ungated(path: str) -> bool:
    return (path in UNGATED or path.startswith(UNGATED_PREFIX)
            or MODEL_READY.fullmatch(path) is not None)


def predicts(path: str) -> bool:
    """Whether a request for ``path`` is a prediction (it takes a place at the predictor)."""
    return path == PREDICT or path.endswith(INFER_SUFFIX)


def new_request_id() -> str:
    """A fresh request id: 32 hex characters, unique in this process and almost surely across
    processes."""
    return f"{ID_PREFIX}{next(_IDS) & 0xFFFFFFFFFFFFFFFF:016x}"


def request_id(given: bytes | None) -> str:
    """The client's ``x-request-id`` when it is a sane token, else a fresh one."""
    if given:
        rid = given.decode("latin-1")
        if REQUEST_ID.match(rid):
            return rid
    return new_request_id()


def error_body(status: int, message: str, rid: str) -> bytes:
    """:class:`~sensai.serving.gateway.schemas.ErrorResponse`'s shape, for an error no route
    raised."""
    return json_bytes({"error": message, "status": status, "request_id": rid,
                       "subnet": None, "missing_classes": None})


def error_response(status: int, message: str, rid: str, extra: bytes = b"", *,
                   close: bool = True) -> bytes:
    """A whole HTTP/1.1 response carrying the gateway's JSON error."""
    body = error_body(status, message, rid)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-request-id: %s\r\n%s%s\r\n" % (
                status, REASONS[status], len(body), rid.encode(),
                b"connection: close\r\n" if close else b"", extra)) + body


class Refusals:
    """The gateway's 503 answers, one per reason (``messages``: reason -> the client's message),
    built once: the body around its request id, the head for each length of id."""

    def __init__(self, messages: dict[str, str]):
        self.messages = dict(messages)
        self.bodies: dict[str, tuple[bytes, bytes]] = {}
        for reason, message in self.messages.items():
            before, _, after = error_body(503, message, ID_MARK).partition(ID_MARK.encode())
            self.bodies[reason] = (before, after)  # around the id
        self.retry_after = (b"retry-after", str(RETRY_AFTER_S).encode())

    def body(self, reason: str, rid: str) -> bytes:
        before, after = self.bodies[reason]
        return b"%s%s%s" % (before, rid.encode(), after)

    def response(self, reason: str, rid: str, *, close: bool) -> bytes:
        """The whole HTTP/1.1 response (the protocol's early refusal)."""
        body = self.body(reason, rid)
        return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nx-request-id: %s\r\nretry-after: %d\r\n%s\r\n" % (
                    len(body), rid.encode(), RETRY_AFTER_S,
                    b"connection: close\r\n" if close else b"")) + body

    async def send(self, send, reason: str, rid: str) -> None:
        """The same answer through ASGI (the middleware's refusal)."""
        body = self.body(reason, rid)
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            self.retry_after]})
        await send({"type": "http.response.body", "body": body})


async def reply(send, status: int, message: str, rid: str, extra=()) -> None:
    """A JSON error sent before (or instead of) the app."""
    body = error_body(status, message, rid)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *extra]})
    await send({"type": "http.response.body", "body": body})

"""Every error of the serving layer: those a request can end in, each with the HTTP status the
gateway answers with, and those of loading what is served.

Library code raises these (they are :class:`sensai.errors.SensaiError`\\ s, so the CLI prints them
as one line); only the gateway's edge turns them into JSON bodies.
"""

from __future__ import annotations

from sensai.errors import SensaiError


class ServingError(SensaiError):
    """A request the server cannot answer; ``status`` is the HTTP status the gateway sends.

    ``subnet`` names the subnet that failed or was late, ``missing_classes`` the classes no live
    subnet copy could answer, ``retry_after`` (seconds) is sent as ``Retry-After``.
    """

    status: int = 400

    def __init__(self, message: str, *, status: int | None = None, subnet: str | None = None,
                 missing_classes: list[str] | None = None, retry_after: float | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.subnet = subnet
        self.missing_classes = missing_classes
        self.retry_after = retry_after


class InputError(ServingError):
    """The client's input is wrong (not an image, wrong tensor shape, NaN...): 4xx."""

    status = 400


class PayloadTooLarge(InputError):
    status = 413


class ModelNotFound(ServingError):
    status = 404


class ModelUnavailable(ServingError):
    """The model is known but has no ready version (loading, or unloaded meanwhile)."""

    status = 503


class Unauthorized(ServingError):
    """The repository API asks for a bearer token this request did not bring."""

    status = 401


class Forbidden(ServingError):
    """The repository API answers loopback clients only, and this one is not."""

    status = 403


class SubnetFailed(ServingError):
    """Some classes cannot be answered: their subnet raised or every copy's worker is down."""

    status = 503


class SubnetTimeout(ServingError):
    """Some classes were not answered within the request's deadline."""

    status = 504


class DeadlinePassed(ServingError):
    """An admitted request's deadline passed while it waited its turn (a decoding thread, a
    place in the predictor)."""

    status = 504


class Overloaded(ServingError):
    """The gateway is at its limit of requests in flight and waiting: come back later."""

    status = 503

    def __init__(self, message: str, *, reason: str, retry_after: float = 1.0):
        super().__init__(message, retry_after=retry_after)
        self.reason = reason  # the metrics label: which bound turned the request away


class RequestTimeout(ServingError):
    """The client did not send its request body in time."""

    status = 408


class LoadFailed(SensaiError):
    """A model version could not be loaded; the versions that were serving still are."""


class GraphCaptureError(SensaiError):
    """The network cannot be captured as a CUDA graph (e.g. it syncs with the host)."""

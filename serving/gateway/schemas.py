"""Request and response bodies of the gateway's own API (``/v1``) and of its errors.

The KServe v2 bodies are built in :mod:`.oip` (they include binary framing that a
pydantic model cannot describe).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ClassScore(BaseModel):
    index: int = Field(description="class index in the dataset's order")
    label: str
    score: float = Field(description="merged score; a row of scores sums to 1")


class PredictResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    request_id: str
    model: str
    model_version: str = Field(description="the version of the model that answered")
    label: str = Field(description="top-1 label")
    index: int = Field(description="top-1 class index")
    score: float = Field(description="top-1 score")
    predictions: list[ClassScore] = Field(description="the top_k classes, best first")
    timings_ms: dict[str, float] = Field(
        description="per subnet (as seen by the gateway), merge, predictor total, and the "
                    "whole request including decoding ('request')")
    degraded: bool = Field(False, description="a partial answer (only with allow_partial=true): "
                           "some classes had no live subnet copy, the scores cover only "
                           "covered_classes (0 for the others)")
    covered_classes: list[int] | None = Field(
        None, description="when degraded: the class indices the scores cover")
    missing_classes: list[str] | None = Field(
        None, description="when degraded: the classes that could not be answered")
    answered_by: dict[str, str] | None = Field(
        None, description="redundant serving: the worker whose copy answered each subnet")


class ErrorResponse(BaseModel):
    """Every non-2xx answer; ``error`` is also what KServe v2 clients read."""

    error: str
    status: int
    request_id: str | None = None
    subnet: str | None = Field(None, description="the subnet that failed or timed out")
    missing_classes: list[str] | None = Field(
        None, description="redundant serving: the classes no live subnet copy could answer")


class VersionInfo(BaseModel):
    name: str
    version: str
    state: str = Field(description="READY, or UNLOADING while requests it holds finish")
    dataset: str
    classes: list[str]
    input_shape: list[int]
    mean: list[float]
    std: list[float]
    predictor: dict[str, Any] = Field(description="its workers: where each runs, what it hosts")


class ModelInfo(BaseModel):
    """What is served; the top-level model fields describe the version a request that names no
    model goes to (absent when the server has several models and no default, or none)."""

    name: str | None = None
    version: str | None = None
    dataset: str | None = None
    classes: list[str] | None = None
    input_shape: list[int] | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    predictor: dict[str, Any] | None = None
    models: list[VersionInfo] = Field(description="every loaded version of every model")
    pid: int = Field(description="the id of the process serving these routes (on Ray Serve: "
                                 "the ingress replica's), on the gateway's machine")
    cores_awake: dict[str, Any] | None = Field(
        None, description="whether the gateway holds idle cores out of deep sleep (mode, held, "
                          "latency_us, and why not when it does not)")
    settings: dict[str, Any] | None = Field(
        None, description="the gateway's settings that differ from their defaults (given by "
                          "flags, SENSAI_* variables or a --config file), secrets left out")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc} for code, desc in (
        (400, "malformed input (not an image, truncated, wrong tensor, NaN/inf, out of range)"),
        (404, "unknown model or version, or no version of it ready"),
        (408, "the request body did not arrive within SENSAI_CLIENT_TIMEOUT_S or the request's "
              "deadline, whichever came first"),
        (413, "body over the size limit, or an image over the pixel limit"),
        (415, "unsupported image format or content encoding"),
        (422, "invalid query parameter"),
        (503, "some classes have no live subnet (missing_classes names them), or the gateway "
              "is overloaded (with Retry-After)"),
        (504, "the subnets did not answer within the request's deadline"),
    )
}

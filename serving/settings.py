"""Gateway settings: defaults, overridden by ``SENSAI_*`` environment variables, then by the CLI."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SENSAI_", extra="ignore", frozen=True,
                                      protected_namespaces=())

    model_name: str = Field("sensai", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                            description="name served under the KServe v2 API")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="larger requests get 413")
    max_image_pixels: int = Field(25_000_000, ge=1, description="decoded width x height limit")
    max_batch: int = Field(64, ge=1, description="largest batch accepted by v2 infer")
    deadline_s: float = Field(5.0, gt=0, description="per-request deadline for the subnets")
    threads_per_worker: int = Field(1, ge=1, description="intra-op threads of each subnet runner")
    default_top_k: int = Field(5, ge=1)
    runtime: str = Field("auto", pattern=r"^(auto|onnx|torch)$")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    processes: bool = Field(False, description="local pool: one process per subnet")
    ray_address: str | None = Field(None, description="existing Ray cluster (None: start locally)")
    triton_url: str | None = Field(None, description="host:port of a running Triton HTTP endpoint")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

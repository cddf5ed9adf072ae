"""Gateway settings: defaults, overridden by ``SENSAI_*`` environment variables, then by the CLI."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from .wakeup import MODES

BACKENDS = ("local", "processes", "ray", "triton")


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SENSAI_", extra="ignore", frozen=True,
                                      protected_namespaces=())

    model_name: str = Field("sensai", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                            description="name served under the KServe v2 API")
    backend: str = Field("local", pattern=r"^(local|processes|ray|triton)$",
                         description="where the workers run: local (threads of the gateway), "
                                     "processes, ray (actors), triton")
    redundancy: int = Field(0, ge=0, description="extra copies of every group (cyclic placement)")
    vote: bool = Field(False, description="decide a group by r+1 agreeing of 2r+1 copies")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="larger requests get 413")
    max_image_pixels: int | None = Field(
        None, ge=1, description="width x height limit of an uploaded image (default: 4096 x the "
                                "model's input pixels, between 4 and 25 million)")
    max_decoded_bytes: int | None = Field(
        None, ge=1024, description="memory an uploaded image may take decoded (width x height x "
                                   "bytes per pixel; default: 4 bytes per pixel of the image "
                                   "size limit, an 8-bit RGBA picture of the largest size)")
    max_requests: int = Field(256, ge=1, description="requests in flight (health checks and "
                              "metrics excepted); beyond it: 503 with Retry-After")
    max_predictions: int = Field(32, ge=1, description="requests in the predictor at once; the "
                                 "others wait, up to their deadline")
    body_timeout_s: float = Field(10.0, gt=0, description="a request body must arrive within "
                                  "this long (408)")
    max_loop_lag_s: float | None = Field(
        None, gt=0, description="while the event loop runs this late, new requests get 503 at "
                                "once (default: a quarter of the deadline, at most 0.25 s)")
    max_batch: int = Field(64, ge=1, description="largest batch accepted by v2 infer")
    deadline_s: float = Field(5.0, gt=0, description="deadline of a whole request, from its "
                              "arrival (body, decoding, waiting, the subnets)")
    hang_timeout_s: float | None = Field(
        None, gt=0, description="a worker with work in flight that answers nothing for this long "
                                "is restarted (default: max(10 s, 2 x deadline))")
    threads_per_worker: int = Field(1, ge=1, description="intra-op threads of each subnet runner")
    default_top_k: int = Field(5, ge=1)
    runtime: str = Field("auto", pattern=r"^(auto|onnx|torch)$")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    trust_model_code: bool = Field(False, description="allow the torch runtime to import an "
                                   "architecture the manifest names as package.module:factory")
    ray_address: str | None = Field(None, description="existing Ray cluster (None: start locally)")
    triton_url: str | None = Field(None, description="host:port of a running Triton HTTP endpoint")
    keep_cores_awake: str = Field(
        "auto", pattern=f"^({'|'.join(MODES)})$",
        description="while serving, ask the kernel that idle cores poll instead of sleeping "
                    "deeply (PM QoS, /dev/cpu_dma_latency, root only): auto when this process "
                    "may, on or refuse to start, off")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(None, ge=0, le=65535,
                                  description="also serve KServe v2 over gRPC on this port, same "
                                              "host (None: off; 0: the kernel picks one)")

    def image_pixels(self, input_shape) -> int:
        """The image size limit: as set, or the largest picture worth decoding for a model of
        this input size - 4,096 times its pixels, between 4 and 25 megapixels (a phone photo of
        a shirt for a 28x28 model)."""
        if self.max_image_pixels is not None:
            return self.max_image_pixels
        _, h, w = input_shape
        return int(min(25_000_000, max(4_000_000, 4096 * h * w)))

    def decoded_bytes(self, input_shape) -> int:
        """The decoded-memory limit of one uploaded image: as set, or what the largest allowed
        picture takes as 8-bit RGBA (deeper or larger-per-pixel modes then get fewer pixels)."""
        if self.max_decoded_bytes is not None:
            return self.max_decoded_bytes
        return 4 * self.image_pixels(input_shape)

    def hang_timeout(self) -> float:
        return self.hang_timeout_s or max(10.0, 2 * self.deadline_s)

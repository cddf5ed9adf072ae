"""Gateway settings: defaults, overridden by ``SENSAI_*`` environment variables, then by the CLI.

:class:`GatewaySettings` is the one place each setting has a name, an environment variable
(``SENSAI_`` and the name in capitals) and a default.  ``sensai serve`` builds it from its flags,
the Ray Serve application embeds it in its arguments (:mod:`~sensai.serving.launch.serve_app`), and
:func:`~sensai.serving.launch.build.build_predictor` validates its keywords against it.  Every field
is documented in deploy/README.md ("Settings"; a test keeps the two in step).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sensai.errors import SensaiError

from .repository import VersionPolicy
from .wakeup import MODES

BACKENDS = ("local", "processes", "ray", "triton", "ray-serve")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# How a subnet runs: see serving/workers/runners.py (auto picks per device; sim: a simulated GPU).
MODEL_RUNTIMES = ("auto", "onnx", "torch", "cuda-graph")  # those that compute the model
RUNTIMES = (*MODEL_RUNTIMES, "sim")
GPU_WAITS = ("spin", "sleep")
# The most rows of a worker's batch by default: on a CPU a batch costs in proportion to its rows,
# so a few amortise the per-call overhead; on a GPU (and its simulation) a launch costs about the
# same up to a few hundred rows, so the batch holds whatever waits.
CPU_BATCH_ROWS = 8
GPU_BATCH_ROWS = 128
ENV_PREFIX = "SENSAI_"
# Backends whose workers can run in device processes shared by several gateway processes, and
# the automatic count of those: a gateway process wants a core of its own, the device processes
# and the clients of the machine the rest.
FLEET_BACKENDS = ("local", "processes")
AUTO_GATEWAYS_FROM = 4
AUTO_GATEWAYS_MAX = 8
SECRETS = ("repository_token",)
# A deployment written to a file (``sensai plan``) that ``sensai serve --config`` reads.
CONFIG_KIND = "sensai-serve-config"
CONFIG_SCHEMA = 1


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True,
                                      protected_namespaces=())

    model_name: str = Field("sensai", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                            description="name served under the KServe v2 API")
    backend: str = Field("local", pattern=f"^({'|'.join(BACKENDS)})$",
                         description="where the workers run: local (threads of the gateway), "
                                     "processes, ray (actors), triton, ray-serve (the Ray "
                                     "Serve application, gateway included; sensai serve only)")
    workers: int | None = Field(
        None, ge=1, description="workers, each a device running all of its subnets in one call "
                                "(default: one per group; 1: every subnet in one call of one "
                                "device)")
    redundancy: int = Field(0, ge=0, description="extra copies of every group (cyclic placement)")
    vote: bool = Field(False, description="decide a group by r+1 agreeing of 2r+1 copies")
    hedge_ms: float = Field(0.0, ge=0, description="a worker waits up to this long before "
                            "computing copies, skipped if their group is answered meanwhile")
    restart_delay_s: float = Field(0.0, ge=0, description="wait before restarting a dead worker")
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
    max_predictions: int = Field(32, ge=1, description="most requests in the predictor at once "
                                 "(the adaptive limit's ceiling); as many more may wait, a place "
                                 "reserved at admission, until a line stands; beyond: 503 at "
                                 "admission (ray-serve: shared by its gateway processes)")
    latency_target_s: float | None = Field(
        None, gt=0, description="from a request's first byte to its answer: the predictor's "
                                "limit adapts (AIMD) so that at most 1 request in 20 takes "
                                "longer, and a request that waited longer than this before it "
                                "could be admitted gets 503 (default: a quarter of the "
                                "deadline)")
    body_timeout_s: float = Field(10.0, gt=0, description="a request body must arrive within "
                                  "this long (408)")
    max_header_bytes: int = Field(16384, ge=1024, description="a request head (request line "
                                  "and headers) over this: 431, connection closed")
    head_timeout_s: float = Field(10.0, gt=0, description="a request head must arrive within "
                                  "this long of its first byte or of the connection (408)")
    max_connections: int = Field(1000, ge=1, description="open connections; one more closes "
                                 "the one waiting longest without a complete request head (else "
                                 "the longest idle one), or when all have a request in "
                                 "progress gets 503 with Retry-After")
    max_connections_per_client: int | None = Field(
        None, ge=1, description="open connections of one client address; one more gets 503 "
                                "(default: no bound but max_connections: behind a proxy every "
                                "client has one address)")
    listen_backlog: int | None = Field(
        None, ge=1, description="connections the kernel holds for the gateway before it "
                                "accepts them (default: max_requests: more could not be "
                                "admitted anyway)")
    max_loop_lag_s: float | None = Field(
        None, gt=0, description="while the event loop runs this late, new requests get 503 at "
                                "once (default: a quarter of the deadline, at most 0.25 s)")
    http_fast_path: bool = Field(True, description="the gateway dispatches its prediction "
                                 "routes itself, past FastAPI's router (same answers, less "
                                 "CPU); off: FastAPI dispatches them as every other route")
    max_batch: int = Field(64, ge=1, description="largest batch accepted by v2 infer")
    batch_max_rows: int | None = Field(
        None, ge=1, description="most image rows a worker runs as one batch of each subnet, of "
                                "the requests it finds waiting (1: one request at a time; a "
                                "larger v2 batch still runs whole, alone; default: "
                                f"{CPU_BATCH_ROWS} on CPUs, {GPU_BATCH_ROWS} on GPUs and the "
                                "sim runtime)")
    batch_delay_us: float = Field(0.0, ge=0, description="how long a worker may hold a request "
                                  "back waiting for company (0: it batches only what is queued "
                                  "already, a request alone never waits)")
    batch_overlap: bool = Field(True, description="a worker whose subnets run on a GPU (or "
                                "the sim runtime) launches the next batch of what is queued "
                                "before it answers the batch the device is computing, so the "
                                "host's work overlaps the device's (no effect on CPUs, where a "
                                "launch computes)")
    deadline_s: float = Field(5.0, gt=0, description="deadline of a whole request, from its "
                              "arrival (body, decoding, waiting, the subnets)")
    hang_timeout_s: float | None = Field(
        None, gt=0, description="a worker with work in flight that answers nothing for this long "
                                "is restarted (default: max(10 s, 2 x deadline))")
    threads_per_worker: int = Field(1, ge=1, description="intra-op threads of each subnet runner")
    default_top_k: int = Field(5, ge=1)
    runtime: str = Field("auto", pattern=f"^({'|'.join(RUNTIMES)})$",
                         description="auto: ONNX Runtime on CPUs, CUDA graphs on GPUs")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    gpu_wait: str = Field("spin", pattern=f"^({'|'.join(GPU_WAITS)})$",
                          description="how a worker waits for its GPU's batch: spin (answers "
                                      "sooner, keeps a core busy) or sleep (leaves the core to "
                                      "others); either holds no interpreter lock")
    sim_launch_ms: float = Field(0.3, ge=0, description="--runtime sim: the simulated GPU's time "
                                 "per launch, whatever its rows")
    trust_model_code: bool = Field(False, description="allow the torch runtime to import an "
                                   "architecture the manifest names as package.module:factory")
    ray_address: str | None = Field(None, description="existing Ray cluster (None: start locally)")
    ray_cpus: float | None = Field(None, gt=0, description="CPUs per Ray worker (default: 1, or "
                                   "an even share when the cluster has fewer)")
    gateway_replicas: int | None = Field(
        None, ge=1, description="gateway processes sharing the port; on the processes backend "
                                "(serving one artifact), and on the local backend with more than "
                                "one, each subnet runs in a device process that batches the "
                                "rows of all of them (default: 1 on fewer than 4 cores, else "
                                "half the cores, at most 8; 1 when serving a model "
                                "repository); ray-serve: the Serve application's ingress "
                                "replicas on a node (default 1)")
    device_processes: int | None = Field(
        None, ge=1, description="the device processes the CPU workers share, where the "
                                "subnets run in device processes, the workers round robin "
                                "(default: one per worker; GPUs keep one per GPU; refused "
                                "with redundancy or a vote: a copy is there to outlive its "
                                "primary's process)")
    gateway_cpus: float | None = Field(None, ge=0, description="ray-serve: CPUs per ingress "
                                       "replica (default: 1, or a worker's share when that is "
                                       "less)")
    triton_url: str | None = Field(None, description="host:port of a running Triton HTTP endpoint")
    keep_cores_awake: str = Field(
        "off", pattern=f"^({'|'.join(MODES)})$",
        description="host tuning, opt-in: while serving, ask the kernel that idle cores poll "
                    "instead of sleeping deeply (PM QoS, /dev/cpu_dma_latency, root only): off, "
                    "auto (when this process may), on (or refuse to start)")
    spread_cores: bool = Field(
        False, description="host tuning, opt-in (local backend): move a worker thread to "
                           "another core when it ran a request on the same core as another "
                           "worker of that request (sched_setaffinity)")
    model_control: str = Field(
        "none", pattern="^(none|explicit|poll)$",
        description="a model repository's control API (/v2/repository/...): none (off), "
                    "explicit (index, load, unload), poll (index; the files are watched)")
    repository_poll_s: float = Field(15.0, gt=0, description="model_control poll: how often "
                                     "the repository is looked at")
    version_policy: str = Field("latest:1", description="which versions of each repository "
                                "model are served: latest[:N], all, specific:V[,V...] (a model's "
                                "own sensai-model.json overrides it)")
    repository_token: str | None = Field(
        None, min_length=16, description="a bearer token the repository API then asks for; "
                                         "without one it answers loopback clients only")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(None, ge=0, le=65535,
                                  description="also serve KServe v2 over gRPC on this port, same "
                                              "host (None: off; 0: the kernel picks one)")
    log_level: str = Field("info", pattern=f"^({'|'.join(LOG_LEVELS)})$",
                           description="the HTTP server's log level")

    @field_validator("keep_cores_awake", mode="before")
    @classmethod
    def yaml_on_off(cls, v):
        # YAML 1.1 reads an unquoted on/off as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("version_policy")
    @classmethod
    def known_policy(cls, v: str) -> str:
        try:
            return str(VersionPolicy.parse(v))
        except SensaiError as e:
            raise ValueError(str(e)) from None

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

    def changed(self) -> dict:
        """The settings set to something other than their defaults (what ``/v1/models``
        reports), secrets left out."""
        defaults = type(self).model_fields
        return {f: getattr(self, f) for f in defaults
                if f not in SECRETS and getattr(self, f) != defaults[f].default}

    def first_set(self, fields) -> str | None:
        """The first of ``fields`` set to something other than its default (None: none is)."""
        defaults = type(self).model_fields
        return next((f for f in fields if getattr(self, f) != defaults[f].default), None)

    def gateway_processes(self, cores: int | None = None) -> int:
        """Gateway processes sharing the port: as set, else chosen from ``cores`` (default:
        the cores this process may run on) where the backend runs its workers in device
        processes, else 1."""
        if self.gateway_replicas is not None:
            return self.gateway_replicas
        if self.backend not in FLEET_BACKENDS:
            return 1
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        return 1 if cores < AUTO_GATEWAYS_FROM else min(AUTO_GATEWAYS_MAX, cores // 2)

    def cpu_device_processes(self, workers: int) -> int:
        """How many device processes ``workers`` CPU workers share: one each by default (a lone
        request's subnets side by side, which is what class parallelism is for); fewer where
        set, the workers round robin, each process computing its subnets one after the other
        on one core - where the cores are few, that leaves the gateways theirs under load."""
        if self.device_processes is None:
            return workers
        return min(self.device_processes, workers)

    def backlog(self) -> int:
        return self.listen_backlog if self.listen_backlog is not None else self.max_requests

    def hang_timeout(self) -> float:
        return self.hang_timeout_s or max(10.0, 2 * self.deadline_s)


# What each backend cannot honour, and why: a setting set to anything but its default there is
# refused before anything starts (Ray, Triton, workers), never ignored.
ONE_MODEL_PER_SUBNET = ("Triton runs one model per subnet, and this needs workers that host "
                        "several; use the local, processes or ray backend")
SERVE_ONLY = {"gateway_cpus": "the other backends do not reserve CPUs for a gateway"}
DEVICE_PROCESSES = {"device_processes": "its workers do not run in device processes; use the "
                                        "local or processes backend"}
ONE_GATEWAY = {"gateway_replicas": "each gateway process would start workers of its own; use the "
                                   "local or processes backend, or ray-serve"}
NOT_ON = {
    "local": SERVE_ONLY, "processes": SERVE_ONLY,
    "ray": {**SERVE_ONLY, **ONE_GATEWAY, **DEVICE_PROCESSES},
    "triton": {**SERVE_ONLY, **ONE_GATEWAY, **DEVICE_PROCESSES,
               "redundancy": ONE_MODEL_PER_SUBNET, "vote": ONE_MODEL_PER_SUBNET,
               "hedge_ms": ONE_MODEL_PER_SUBNET},
    "ray-serve": {
        **DEVICE_PROCESSES,
        "grpc_port": "the Serve ingress has no gRPC server",
        "spread_cores": "it moves the local backend's worker threads",
        "restart_delay_s": "Serve restarts replicas itself",
        "hang_timeout_s": "Serve watches and restarts replicas itself",
        "triton_url": "it is the triton backend's",
    },
}
# And what the Serve application honours only on its ingress's own port, not behind Serve's
# proxy.
PROXY_HELD = {
    "max_connections": "connections are held by Serve's HTTP proxy",
    "max_header_bytes": "request heads are read by Serve's HTTP proxy",
    "head_timeout_s": "request heads are read by Serve's HTTP proxy",
}
# The backends whose workers take injected faults (tests, benchmark): Triton owns its model
# instances, and a Serve application's replicas are built from its arguments alone.
FAULTS_ON = ("local", "processes", "ray")


def default_batch_rows(device: str, runtime: str) -> int:
    """The most rows of a batch on ``device`` with (resolved) ``runtime`` by default."""
    gpu_like = str(device).startswith("cuda") or runtime == "sim"
    return GPU_BATCH_ROWS if gpu_like else CPU_BATCH_ROWS


def check_backend(settings: "GatewaySettings", names: Mapping[str, str] | None = None, *,
                  behind_proxy: bool = False) -> None:
    """One line for the first setting ``settings.backend`` cannot honour that is set
    (``names``: field -> the flag it was given by; else its environment variable);
    ``behind_proxy``: the Serve application behind Serve's HTTP proxy."""
    refused = NOT_ON[settings.backend]
    if behind_proxy:
        refused = refused | PROXY_HELD
    field = settings.first_set(refused)
    if field is not None:
        scope = ("applies to --backend ray-serve only" if field in SERVE_ONLY
                 else f"does not apply to --backend {settings.backend}")
        raise SensaiError(f"{setting_name(field, names)} {scope} ({refused[field]})")


def check_faults(settings: "GatewaySettings", faults) -> None:
    """Injected faults (tests, benchmark) only where the backend's workers take them."""
    if faults and settings.backend not in FAULTS_ON:
        raise SensaiError(f"the {settings.backend} backend takes no injected faults")


BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
          "less_than_equal": "<="}


def number(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


def explain(e: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """The first error of ``e`` in one line, the setting called by the name its user knows it by
    (``names``: field -> e.g. its CLI flag; default: the field's own name)."""
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ())]
    field = loc[-1] if loc else ""
    name = (names or {}).get(field) or ".".join(loc)
    ctx = first.get("ctx") or {}
    op = BOUNDS.get(first.get("type", ""))
    if op and ctx:
        return f"{name} must be {op} {number(next(iter(ctx.values())))}, got " \
               f"{number(first.get('input'))}"
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"invalid setting {name}: {msg}" if name else msg


def setting_name(field: str, names: Mapping[str, str] | None = None) -> str:
    """A setting as its user gave it: the flag (``names``: field -> flag), else its environment
    variable."""
    return (names or {}).get(field) or f"{ENV_PREFIX}{field.upper()}"


def load_settings(values: Mapping, names: Mapping[str, str] | None = None) -> GatewaySettings:
    """:class:`GatewaySettings` from ``values`` over the environment's ``SENSAI_*``, checked
    against its backend (:func:`check_backend`), or a one-line :class:`SensaiError` naming the
    setting as ``names`` call it."""
    try:
        settings = GatewaySettings(**values)
    except ValidationError as e:
        raise SensaiError(explain(e, names)) from None
    check_backend(settings, names)
    return settings


def read_config(path: str | Path) -> tuple[dict, dict]:
    """A deployment file's settings (field -> value, checked to be settings; their values are
    checked as the command line's are, by :func:`load_settings`) and what it was measured with
    (``artifact``: path and manifest hash), or a one-line :class:`SensaiError`."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise SensaiError(f"--config {path}: cannot read it ({getattr(e, 'strerror', None) or e})"
                          ) from None
    except ValueError as e:
        raise SensaiError(f"--config {path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != CONFIG_KIND:
        raise SensaiError(f"--config {path}: not a deployment file (kind {CONFIG_KIND!r}, as "
                          "'sensai plan' writes)")
    if doc.get("schema_version") != CONFIG_SCHEMA:
        raise SensaiError(f"--config {path}: schema_version {doc.get('schema_version')!r}, this "
                          f"sensai reads {CONFIG_SCHEMA}")
    settings = doc.get("settings")
    if not isinstance(settings, dict):
        raise SensaiError(f"--config {path}: 'settings' must be an object of setting: value")
    unknown = sorted(set(settings) - set(GatewaySettings.model_fields))
    if unknown:
        raise SensaiError(f"--config {path}: unknown setting {unknown[0]!r} (see "
                          "deploy/README.md, Settings)")
    secret = next((k for k in settings if k in SECRETS), None)
    if secret:
        raise SensaiError(f"--config {path}: {secret} does not belong in a file that is shared; "
                          "use its flag")
    artifact = doc.get("artifact") or {}
    if not isinstance(artifact, dict):
        raise SensaiError(f"--config {path}: 'artifact' must be an object")
    return dict(settings), artifact

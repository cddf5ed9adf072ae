"""Gateway settings: defaults, overridden by ``SENSAI_*`` environment variables, then by the CLI.

:class:`GatewaySettings` is the one place each setting has a name, an environment variable
(``SENSAI_`` and the name in capitals) and a default.  ``sensai serve`` builds it from its flags
and its ``--set KEY=VALUE``, the Ray Serve application embeds it in its arguments
(:mod:`~sensai.serving.launch.serve_app`), and :func:`~sensai.serving.launch.build.build_predictor`
validates its keywords against it.  Every field is documented in deploy/README.md ("Settings and
limits"; a test keeps the two in step).
"""

from __future__ import annotations

import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Mapping

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from sensai.bounds import Bound
from sensai.errors import SensaiError

from .repository import MODEL_NAME_PATTERN, VersionPolicy
from .wakeup import MODES

BACKENDS = ("local", "processes", "ray", "triton", "ray-serve")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# How a subnet runs: see serving/workers/runners.py (auto picks per device; sim: a simulated GPU).
MODEL_RUNTIMES = ("auto", "onnx", "torch", "cuda-graph")  # those that compute the model
RUNTIMES = (*MODEL_RUNTIMES, "sim")
SIM_LAUNCH_MS = 0.3  # the simulated GPU's time per launch where runtime is sim, not sim:MS
MODEL_CONTROLS = ("none", "explicit", "poll")
REPOSITORY_POLL_S = 15.0  # between looks at a polled repository, unless poll:SECONDS
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
HANG_FLOOR_S = 10.0
# A deployment written to a file (``sensai plan``) that ``sensai serve --config`` reads.
CONFIG_KIND = "sensai-serve-config"
CONFIG_SCHEMA = 1


# The settings that take an option or ``OPTION:X``: their options, the one that takes a number,
# its unit, whether it must be > 0 (else >= 0), and its default.
NUMBERED = {"runtime": (RUNTIMES, "sim", "MS", False, SIM_LAUNCH_MS),
            "model_control": (MODEL_CONTROLS, "poll", "SECONDS", True, REPOSITORY_POLL_S)}


def split_numbered(field: str, value: str) -> tuple[str, float]:
    """Setting ``field``'s ``value`` (one of its options, or ``OPTION:X``; see ``NUMBERED``)
    as (the option, X or its default); ValueError says what was expected."""
    options, numbered, unit, positive, default = NUMBERED[field]
    option, colon, text = value.partition(":")
    if option not in options or (colon and option != numbered):
        raise ValueError(f"expected one of {', '.join(options)}, or {numbered}:{unit}; got "
                         f"{value!r}")
    if not colon:
        return option, default
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and (x > 0 if positive else x >= 0)):
        raise ValueError(f"{numbered}:{unit} wants a number {'>' if positive else '>='} 0 after "
                         f"the colon; got {value!r}")
    return option, x


def numbered(field: str) -> AfterValidator:
    """The check of setting ``field``'s OPTION or OPTION:X (:func:`split_numbered`)."""
    def check(v: str) -> str:
        split_numbered(field, v)  # its ValueError says what was expected
        return v
    return AfterValidator(check)


def yaml_on_off(v):
    # YAML 1.1 reads an unquoted on/off as a boolean.
    return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


def known_policy(v: str) -> str:
    try:
        return str(VersionPolicy.parse(v))
    except SensaiError as e:
        raise ValueError(str(e)) from None


def setting(default, help: str, *, flag: str | None = None, short: str | None = None,
            group: str = "server", metavar: str | None = None, default_doc: str | None = None,
            choices: tuple[str, ...] | None = None, **constraints):
    """A settings field and everything said of it, once: its ``help`` (the CLI's and
    deploy/README.md's), the ``flag`` of ``sensai serve`` that sets it (None: ``--set KEY=VALUE``,
    its environment variable and a deployment file), its help ``group``, how its default reads
    (``default_doc``, where the default is derived) and its ``choices``."""
    extra = {"flag": flag, "short": short, "group": group, "metavar": metavar,
             "default_doc": default_doc, "choices": list(choices) if choices else None}
    if choices:
        constraints["pattern"] = f"^({'|'.join(choices)})$"
    return Field(default, description=help, json_schema_extra=extra, **constraints)


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True,
                                      protected_namespaces=())

    # -- the server
    host: str = setting("127.0.0.1", "bind address", flag="--host", metavar="ADDRESS")
    port: int = setting(8000, "HTTP port", flag="--port", metavar="PORT", ge=0, le=65535)
    grpc_port: int | None = setting(
        None, "also serve KServe v2 over gRPC on this port, same host (0: any free port)",
        flag="--grpc-port", metavar="PORT", default_doc="off", ge=0, le=65535)
    model_name: str = setting("sensai", "the model's name under the KServe v2 API",
                              flag="--model-name", metavar="NAME", pattern=MODEL_NAME_PATTERN)
    deadline_s: float = setting(
        5.0, "deadline of a whole request, from its first byte (body, decoding, waiting, the "
             "subnets); a worker holding work that answers nothing for twice this (at least "
             f"{HANG_FLOOR_S:g} s) is ended and restarted", flag="--deadline", metavar="SECONDS",
        gt=0)
    log_level: str = setting("info", "the HTTP server's log level", flag="--log-level",
                             choices=LOG_LEVELS)
    # -- where and how the subnets run
    backend: str = setting(
        "local", "where the workers run: local (threads of the gateway's process), processes "
                 "(device processes), ray (actors on a Ray cluster), triton (a Triton server), "
                 "ray-serve ('sensai serve' only: the Ray Serve application, its gateway a "
                 "Serve replica serving on --host/--port; see \"Ray Serve\")",
        flag="--backend", group="runtime", choices=BACKENDS)
    device: str = setting(
        "auto", "auto or cuda (worker i on GPU i mod n; auto: the CPU without GPUs, cuda: an "
                "error), cpu, cuda:N (every worker on GPU N); on Ray and Ray Serve: auto, cpu "
                "or cuda (a GPU, or a share of one, per worker)", flag="--device",
        group="runtime")
    runtime: Annotated[str, numbered("runtime")] = setting(
        "auto", "auto (ONNX Runtime on CPUs, CUDA graphs on GPUs, eager torch where a network "
                "cannot be captured), onnx, torch (eager), cuda-graph (a capture failure is an "
                "error); sim or sim:MS: a simulated GPU, MS per launch whatever the rows (default "
                f"{SIM_LAUNCH_MS:g} ms), answers that are not the model's, for measuring the "
                "serving path without a GPU (see \"On GPUs\")", flag="--runtime",
        group="runtime", metavar="RUNTIME")
    gpu_wait: str = setting(
        "spin", "how a worker's thread waits for its GPU's batch: spin (answers sooner, keeps "
                "a core busy) or sleep; either way it holds no interpreter lock",
        group="runtime", metavar="MODE", choices=GPU_WAITS)
    threads_per_worker: int = setting(
        1, "intra-op threads of each subnet runner (on Ray: from the worker's CPUs)",
        group="runtime", metavar="N", ge=1)
    trust_model_code: bool = setting(
        False, "let the torch runtime import an architecture the manifest names as "
               "package.module:factory (that runs its code)", flag="--trust-model-code",
        group="runtime")
    # -- placement
    workers: int | None = setting(
        None, "workers, each a device that runs all of its subnets in one call (1: every "
              "subnet in one call; see \"What a device is\")", flag="--workers",
        group="placement", metavar="W", default_doc="one per group", ge=1)
    gateway_replicas: int | None = setting(
        None, "gateway processes sharing the port: on the processes backend (one artifact), "
              "and on the local backend above 1, the subnets run in device processes shared "
              "by all of them (\"Several gateway processes\"); ray-serve: the application's "
              "ingress replicas on a node (\"Ray Serve\"); refused on ray and triton",
        group="placement", metavar="N",
        default_doc="local and processes: 1 on fewer than 4 cores, else half the cores, at "
                    "most 8 (1 for a model repository); ray-serve: 1", ge=1)
    device_processes: int | None = setting(
        None, "the device processes the CPU workers share, round robin, where the subnets run "
              "in device processes (\"Several gateway processes\"): fewer answer more on few "
              "cores, a lone request a little later; GPUs keep one per GPU; below the "
              "workers, refused with redundancy, a vote or injected faults; refused where the "
              "subnets run in none (ray, triton, ray-serve, the local backend with one gateway "
              "process or a model repository)", group="placement", metavar="N",
        default_doc="one per worker", ge=1)
    ray_address: str | None = setting(
        None, "ray and ray-serve backends: the cluster to join (e.g. auto, HEAD:6379)",
        flag="--ray-address", group="placement", metavar="ADDRESS", default_doc="start a local Ray")
    ray_cpus: float | None = setting(
        None, "CPUs per Ray worker actor or Serve worker replica (a Serve ingress replica "
              "takes the same, at most 1)", group="placement", metavar="CPUS",
        default_doc="1, or an even share that fits", gt=0)
    triton_url: str | None = setting(
        None, "triton backend: host:port of a running Triton HTTP endpoint serving 'sensai "
              "export-triton' models", flag="--triton-url", group="placement", metavar="HOST:PORT",
        default_doc="launch tritonserver")
    # -- redundancy
    redundancy: int = setting(
        0, "extra copies of every group: worker w also hosts groups w+1..w+R (mod W), so an "
           "answer does not wait for the slowest worker and survives a dead one",
        flag="--redundancy", short="-r", group="redundancy", metavar="R", ge=0)
    vote: bool = setting(False, "2R+1 copies of every group, a group decided when R+1 agree "
                                "(outvotes up to R wrong copies)", flag="--vote",
                         group="redundancy")
    hedge_ms: float = setting(
        0.0, "a worker waits up to this long before computing copies, skipped if their group "
             "is answered meanwhile", group="redundancy", metavar="MS", ge=0)
    restart_delay_s: float = setting(0.0, "wait before restarting a dead worker",
                                     group="redundancy", metavar="SECONDS", ge=0)
    # -- batching
    batch_max_rows: int | None = setting(
        None, "most image rows of each subnet a worker runs as one batch of the requests it "
              "finds waiting (1: one request at a time; a larger v2 batch still runs whole, "
              "alone); on GPUs the CUDA graphs are captured up to it; see \"Micro-batching\"",
        group="batching", metavar="N",
        default_doc=f"{CPU_BATCH_ROWS} on CPUs, {GPU_BATCH_ROWS} on GPUs and --runtime sim",
        ge=1)
    batch_delay_us: float = setting(
        0.0, "how long a worker may hold a request back waiting for company (0: only what is "
             "queued already is batched, a request alone never waits)",
        group="batching", metavar="US", ge=0)
    # -- limits
    max_request_rows: int = setting(64, "largest batch a KServe v2 request may carry",
                                    group="limits", metavar="N", ge=1)
    max_body_bytes: int = setting(8 << 20, "larger request bodies: 413", group="limits",
                                  metavar="BYTES", default_doc="8 MiB", ge=1024)
    max_image_pixels: int | None = setting(
        None, "width x height limit of an uploaded picture (larger: 413 from its header); it "
              "bounds the memory a picture takes decoded too, at most 4 bytes a pixel",
        group="limits", metavar="PIXELS",
        default_doc="4,096 x the model's input pixels, between 4 and 25 million", ge=1)
    max_requests: int = setting(
        256, "requests in flight (health checks and metrics excepted); beyond: 503 + "
             "Retry-After at once; at most half of them may be waiting for the rest of a body; "
             "the kernel holds as many connections before they are accepted", group="limits",
        metavar="N", ge=1)
    max_predictions: int = setting(
        32, "most requests in the predictor at once, the ceiling of its adaptive limit; as "
            "many more may wait, a place reserved at admission, until a line stands (see "
            "\"Overload\"); beyond: 503 + Retry-After at admission (several gateway processes "
            "share the workers: each holds 1/N of it)", group="limits", metavar="N", ge=1)
    latency_target_s: float | None = setting(
        None, "from a request's first byte to its answer: the predictor's limit adapts so that "
              "at most 1 request in 20 takes longer, and a request that waited longer than "
              "this before it could be admitted is refused; see \"Overload\"", group="limits",
        metavar="SECONDS", default_doc="a quarter of the deadline", gt=0)
    max_loop_lag_s: float | None = setting(
        None, "while the event loop runs this late (measured by a 20 ms timer), new requests "
              "get 503 at once; the lag also counts against every request's deadline",
        group="limits", metavar="SECONDS", default_doc="a quarter of the deadline, at most 0.25 s",
        gt=0)
    client_timeout_s: float = setting(
        10.0, "a request head must arrive within this of its first byte (or of the "
              "connection's opening: 408, connection closed), and its body within this (408)",
        group="limits", metavar="SECONDS", gt=0)
    max_header_bytes: int = setting(
        16384, "a request head (request line and headers) over this: 431, connection closed",
        group="limits", metavar="BYTES", default_doc="16 KiB", ge=1024)
    max_connections: int = setting(
        1000, "open connections; one more closes the connection that has waited longest "
              "without a complete request head (with a 503), else the longest idle kept-alive "
              "one; when every one has a request in progress, the new one gets 503 + "
              "Retry-After and is closed", group="limits", metavar="N", ge=1)
    max_connections_per_client: int | None = setting(
        None, "open connections of one client address; one more gets 503 + Retry-After and is "
              "closed (behind a proxy every client has the proxy's address)", group="limits",
        metavar="N", default_doc="no bound but max_connections", ge=1)
    # -- host tuning
    keep_cores_awake: Annotated[str, BeforeValidator(yaml_on_off)] = setting(
        "off", "host tuning, opt-in: while serving, ask the kernel that idle cores poll "
               "instead of sleeping deeply (PM QoS, /dev/cpu_dma_latency, root only): off, auto "
               "(when this process may), on (or refuse to start); see \"Latency\"",
        group="host tuning", metavar="MODE", choices=MODES)
    spread_cores: bool = setting(
        False, "host tuning, opt-in (local backend): move a worker thread to another core when "
               "it ran a request on the core of another worker of that request "
               "(sched_setaffinity); see \"Latency\"", group="host tuning")
    # -- a model repository
    model_control: Annotated[str, numbered("model_control")] = setting(
        "none", "a model repository's API (/v2/repository/...): none (off), explicit (index, "
                "load, unload), poll or poll:SECONDS (index; the files are watched, a look every "
                f"SECONDS, default {REPOSITORY_POLL_S:g})", flag="--model-control",
        group="model repository", metavar="MODE")
    version_policy: Annotated[str, AfterValidator(known_policy)] = setting(
        "latest:1", "which versions of each repository model are served: latest[:N], all, "
                    "specific:V[,V...] (a model's sensai-model.json overrides it)",
        group="model repository", metavar="POLICY")
    repository_token: str | None = setting(
        None, "a bearer token (16+ characters) the repository API then asks for; 'sensai "
              "serve' reads it from the first line of --repository-token-file",
        group="model repository", default_doc="none: loopback clients only", min_length=16)

    @property
    def runtime_kind(self) -> str:
        """The runtime without its number: ``sim`` for ``sim:0.5``."""
        return split_numbered("runtime", self.runtime)[0]

    @property
    def sim_launch_ms(self) -> float:
        """The simulated GPU's time per launch (``runtime`` sim:MS, or its default)."""
        return split_numbered("runtime", self.runtime)[1]

    @property
    def model_control_kind(self) -> str:
        """The repository API's mode without its number: ``poll`` for ``poll:2``."""
        return split_numbered("model_control", self.model_control)[0]

    @property
    def repository_poll_s(self) -> float:
        """Seconds between looks at a polled repository (``model_control`` poll:SECONDS)."""
        return split_numbered("model_control", self.model_control)[1]

    def image_pixels(self, input_shape) -> int:
        """The image size limit: as set, or the largest picture worth decoding for a model of
        this input size - 4,096 times its pixels, between 4 and 25 megapixels (a phone photo of
        a shirt for a 28x28 model)."""
        if self.max_image_pixels is not None:
            return self.max_image_pixels
        _, h, w = input_shape
        return int(min(25_000_000, max(4_000_000, 4096 * h * w)))

    def changed(self) -> dict:
        """The settings set to something other than their defaults (what ``/v1/models``
        reports), secrets left out."""
        defaults = type(self).model_fields
        return {f: getattr(self, f) for f in defaults
                if f not in SECRETS and getattr(self, f) != defaults[f].default}

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

    def hang_timeout(self) -> float:
        """How long a worker with work in flight may answer nothing before it is ended and
        restarted: twice a request's deadline (by then every request it holds has failed),
        at least long enough that a slow request or a busy host's pause is not taken for a
        hang."""
        return max(HANG_FLOOR_S, 2 * self.deadline_s)


# What each backend cannot honour, and why: a setting set to anything but its default there is
# refused before anything starts (Ray, Triton, workers), never ignored.
ONE_MODEL_PER_SUBNET = ("Triton runs one model per subnet, and this needs workers that host "
                        "several; use the local, processes or ray backend")
DEVICE_PROCESSES = {"device_processes": "its workers do not run in device processes; use the "
                                        "local or processes backend"}
ONE_GATEWAY = {"gateway_replicas": "each gateway process would start workers of its own; use the "
                                   "local or processes backend, or ray-serve"}
NOT_ON = {
    "local": {}, "processes": {},
    "ray": {**ONE_GATEWAY, **DEVICE_PROCESSES},
    "triton": {**ONE_GATEWAY, **DEVICE_PROCESSES,
               "workers": "Triton serves each subnet as a model of its own, one worker per "
                          "group; use the local, processes or ray backend",
               "redundancy": ONE_MODEL_PER_SUBNET, "vote": ONE_MODEL_PER_SUBNET,
               "hedge_ms": ONE_MODEL_PER_SUBNET},
    "ray-serve": {
        **DEVICE_PROCESSES,
        "grpc_port": "the Serve ingress has no gRPC server",
        "spread_cores": "it moves the local backend's worker threads",
        "restart_delay_s": "Serve restarts replicas itself",
        "triton_url": "it is the triton backend's",
    },
}
# And what the Serve application honours only on its ingress's own port, not behind Serve's
# proxy.
PROXY_HELD = {
    "max_connections": "connections are held by Serve's HTTP proxy",
    "max_connections_per_client": "connections are held by Serve's HTTP proxy, the one client "
                                  "the ingress would see",
    "max_header_bytes": "request heads are read by Serve's HTTP proxy",
    "client_timeout_s": "request heads are read by Serve's HTTP proxy, so it would bound "
                        "the bodies only",
}
# The backends whose workers take injected faults (tests, benchmark): Triton owns its model
# instances, and a Serve application's replicas are built from its arguments alone.
FAULTS_ON = ("local", "processes", "ray")


def default_batch_rows(device: str, runtime: str) -> int:
    """The most rows of a batch on ``device`` with (resolved) ``runtime`` by default."""
    gpu_like = str(device).startswith("cuda") or runtime == "sim"
    return GPU_BATCH_ROWS if gpu_like else CPU_BATCH_ROWS


def first_set(settings: GatewaySettings, fields) -> str | None:
    """The first of ``fields`` set to something other than its default (None: none is)."""
    defaults = GatewaySettings.model_fields
    return next((f for f in fields if getattr(settings, f) != defaults[f].default), None)


def check_backend(settings: "GatewaySettings", names: Mapping[str, str] | None = None, *,
                  behind_proxy: bool = False) -> None:
    """One line for the first setting ``settings.backend`` cannot honour that is set
    (``names``: field -> the flag it was given by; else its environment variable);
    ``behind_proxy``: the Serve application behind Serve's HTTP proxy."""
    refused = NOT_ON[settings.backend]
    if behind_proxy:
        refused = refused | PROXY_HELD
    field = first_set(settings, refused)
    if field is not None:
        scope = f"does not apply to --backend {settings.backend}"
        raise SensaiError(f"{setting_name(field, names)} {scope} ({refused[field]})")


def check_faults(settings: "GatewaySettings", faults) -> None:
    """Injected faults (tests, benchmark) only where the backend's workers take them."""
    if faults and settings.backend not in FAULTS_ON:
        raise SensaiError(f"the {settings.backend} backend takes no injected faults")


BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
          "less_than_equal": "<="}


def number(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


def expected(field: str) -> str | None:
    """What setting ``field`` takes, in words ("an integer from 0 to 65535", "one of ...");
    None where its validator says it (or it is no setting)."""
    info = GatewaySettings.model_fields.get(field)
    if info is None:
        return None
    if described(field).get("choices"):
        return f"one of {', '.join(described(field)['choices'])}"
    kind = info.annotation
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    meta = {k: getattr(m, k) for m in info.metadata
            for k in ("ge", "gt", "le", "lt", "min_length", "pattern") if hasattr(m, k)}
    if kind is bool:
        return "true or false"
    if kind in (int, float):
        return Bound(meta.get("ge"), meta.get("gt"), meta.get("le"),
                     meta.get("lt")).describe(kind is int)
    if "min_length" in meta:
        return f"at least {meta['min_length']} characters"
    return f"text matching {meta['pattern']}" if meta.get("pattern") else None


def explain(e: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """The first error of ``e`` in one line, the setting called by the name its user knows it by
    (``names``: field -> e.g. its CLI flag or environment variable; default: the field's own
    name) and what it takes said in words."""
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ())]
    field = loc[0] if loc else ""
    name = (names or {}).get(field) or ".".join(loc)
    ctx = first.get("ctx") or {}
    got = first.get("input")
    op = BOUNDS.get(first.get("type", ""))
    if op and ctx:  # a variable's text as it was written, a number as a number
        return f"{name} must be {op} {number(next(iter(ctx.values())))}, got " \
               f"{got if isinstance(got, str) else number(got)}"
    wanted = expected(field) if first.get("type") != "value_error" else None
    if wanted:
        return f"invalid setting {name}: expected {wanted}" + (
            "" if field in SECRETS else f"; got {number(got)}")
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"invalid setting {name}: {msg}" if name else msg


def setting_name(field: str, names: Mapping[str, str] | None = None) -> str:
    """A setting as its user gave it: its flag or ``--set KEY`` (``names``: field -> that), else
    its environment variable."""
    return (names or {}).get(field) or f"{ENV_PREFIX}{field.upper()}"


def environment(values: Mapping[str, Any]) -> dict[str, str]:
    """Settings (field -> value) as the variables that give them to another process (a switch
    as true / false, as the settings read it)."""
    return {setting_name(k): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in values.items()}


# Variables of settings this version no longer has -> what says the same now.  The settings
# model ignores names it does not know, so a deployment's leftover variable would otherwise be
# dropped without a word.
RETIRED = {
    "SENSAI_HEAD_TIMEOUT_S": "SENSAI_CLIENT_TIMEOUT_S",
    "SENSAI_BODY_TIMEOUT_S": "SENSAI_CLIENT_TIMEOUT_S",
    "SENSAI_MAX_DECODED_BYTES": "SENSAI_MAX_IMAGE_PIXELS (it bounds the decoded memory too)",
    "SENSAI_SIM_LAUNCH_MS": "SENSAI_RUNTIME=sim:MS",
    "SENSAI_REPOSITORY_POLL_S": "SENSAI_MODEL_CONTROL=poll:SECONDS",
    "SENSAI_MAX_BATCH": "SENSAI_MAX_REQUEST_ROWS",
    "SENSAI_HANG_TIMEOUT_S": "SENSAI_DEADLINE_S (a worker is taken for hung after twice the "
                             "deadline, at least 10 s)",
    "SENSAI_LISTEN_BACKLOG": "SENSAI_MAX_REQUESTS (the backlog follows it)",
}


def check_retired(environ: Mapping[str, str]) -> None:
    """A one-line :class:`SensaiError` naming each retired setting's variable set in
    ``environ`` and what replaced it."""
    found = [f"{name} (now {now})" for name, now in RETIRED.items() if name in environ]
    if found:
        raise SensaiError(f"no longer a setting: {'; '.join(found)}")


def load_settings(values: Mapping, names: Mapping[str, str] | None = None) -> GatewaySettings:
    """:class:`GatewaySettings` from ``values`` over the environment's ``SENSAI_*``, checked
    against its backend (:func:`check_backend`), or a one-line :class:`SensaiError` naming the
    setting as its user gave it: one of ``values`` as ``names`` call it (default: its field's
    name), any other by its environment variable (or a retired setting's variable still
    set)."""
    check_retired(os.environ)
    names = {**{f: setting_name(f) for f in GatewaySettings.model_fields},
             **{f: (names or {}).get(f, f) for f in values}}
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


def described(field: str) -> dict:
    """What :func:`setting` declared of ``field`` beside its help: flag, short, group, metavar,
    default_doc, choices."""
    return GatewaySettings.model_fields[field].json_schema_extra or {}


def default_text(field: str) -> str:
    """How ``field``'s default reads to a person."""
    doc = described(field).get("default_doc")
    if doc:
        return doc
    v = GatewaySettings.model_fields[field].default
    if isinstance(v, bool):
        return str(v).lower()
    return "none" if v is None else number(v) if not isinstance(v, str) else v


def settings_table() -> str:
    """deploy/README.md's settings table, made from the declarations (a test keeps the README's
    copy equal to it; ``python -m sensai.serving.core.settings`` prints it)."""
    def code(text: str) -> str:
        return re.sub(r"(?<![\w`-])(--[a-z][a-z0-9-]*)", r"`\1`", text)

    rows = ["| setting (environment variable) | `sensai serve` | default | what |",
            "|---|---|---|---|"]
    for field, info in GatewaySettings.model_fields.items():
        rows.append(f"| `{ENV_PREFIX}{field.upper()}` | {how_set(field)} | "
                    f"{default_text(field)} | {code(info.description or '')} |")
    return "\n".join(rows) + "\n"


def knob_fields() -> list[str]:
    """The settings ``sensai serve`` sets with ``--set KEY=VALUE``: those without a flag of their
    own, secrets excepted (a command line is seen by every user of the machine)."""
    return [f for f in GatewaySettings.model_fields
            if not described(f).get("flag") and f not in SECRETS]


def how_set(field: str) -> str:
    """``field``'s cell of the table's ``sensai serve`` column: its flags, its ``--set`` form,
    or "-" for a secret (its environment variable, or a file a flag names)."""
    d = described(field)
    if d.get("flag"):
        return ", ".join(f"`{f}`" for f in (d["flag"], d.get("short")) if f)
    if field not in knob_fields():
        return "-"
    boolean = GatewaySettings.model_fields[field].annotation is bool
    return f"`--set {field}={d.get('metavar') or ('true' if boolean else 'VALUE')}`"


if __name__ == "__main__":  # pragma: no cover - prints the table for deploy/README.md
    print(settings_table(), end="")

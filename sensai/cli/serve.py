"""``sensai serve``, ``sensai export`` and ``sensai export-triton``.

Every ``sensai`` command, ``--help`` included, builds this module's parsers, so what only a
command needs (the artifact, the predictor, the image decoder, the HTTP client) is imported when
that command runs.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from pathlib import Path

from sensai.errors import SensaiError
from sensai.serving.core.settings import (GatewaySettings, knob_fields, load_settings,
                                          read_config, setting_name)
from sensai.serving.core.wakeup import keep_cores_awake

from .knobs import add_set_flag
from .settings_args import add_setting_flags, setting_flags, setting_knobs

log = logging.getLogger(__name__)

# On Ray, each version of a repository's model may take this part of the cluster's CPUs: a swap
# runs the new version's actors beside the old one's, and actors that do not fit would wait.
REPOSITORY_RAY_SHARE = 0.5


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a decomposition artifact over HTTP (REST + KServe "
                                     "v2) and, with --grpc-port, KServe v2 over gRPC",
                       description="Every option but --inject-delay, --repository-token-file, "
                                   "--config and --set sets the gateway setting of the same "
                                   "meaning, and --set KEY=VALUE any other; a flag wins over "
                                   "--set, --set over --config, --config over the SENSAI_* "
                                   "environment variable, that over the default "
                                   "(deploy/README.md, 'Settings and limits').")
    p.add_argument("artifact", metavar="ARTIFACT_OR_REPOSITORY",
                   help="artifact directory written by 'sensai decompose', or a model repository "
                        "(REPO/<model>/<version>/ each an artifact, see 'sensai export')")
    groups = add_setting_flags(p)
    groups["redundancy"].add_argument(
        "--inject-delay", action="append", default=[], metavar="W=SPEC",
        help="TESTING ONLY: worker W sleeps before each request, e.g. 2=exp:20ms, "
             "1=fixed:50ms@0.1 (10%% of requests)")
    groups["model repository"].add_argument(
        "--repository-token-file", default=None, metavar="FILE",
        help="the repository API then asks for this bearer token (the file's first line); "
             "without one it answers loopback clients only")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a deployment file 'sensai plan' wrote (its chosen settings, for the "
                        "artifact it measured): its settings over the SENSAI_* variables, "
                        "--set and the flags given over both")
    add_set_flag(p, setting_knobs(knob_fields()), "any gateway setting without a flag of its own")
    p.set_defaults(func=cmd_serve, flags=setting_flags(p))
    register_export(sub)


def register_export(sub) -> None:
    """``sensai export`` and ``sensai export-triton``: an artifact into a model repository."""
    p = sub.add_parser("export", help="add an artifact to a model repository as a new version",
                       description="Copy an artifact (each file checked against its hash) into "
                                   "REPOSITORY/MODEL/VERSION in one rename, for `sensai serve "
                                   "REPOSITORY`; a version is never overwritten.")
    p.add_argument("artifact", help="artifact directory")
    p.add_argument("--repository", required=True, help="model repository (created if missing)")
    p.add_argument("--model", required=True, help="the model's name in the repository")
    p.add_argument("--version", type=int, default=None,
                   help="version number (default: one above the model's highest)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("export-triton", help="write a Triton model repository for an artifact")
    p.add_argument("artifact", help="artifact directory")
    p.add_argument("--out", required=True, help="model repository directory to create")
    p.add_argument("--backend", choices=("onnxruntime", "python"), default="onnxruntime",
                   help="Triton backend: onnxruntime (Triton containers) or python (ONNX Runtime "
                        "inside the Python backend, e.g. the nvidia-pytriton tritonserver; "
                        "default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="Triton's max_batch_size (0: no batching; default: %(default)s)")
    p.add_argument("--instance-kind", choices=("auto", "cpu", "gpu"), default="auto",
                   help="where Triton runs each model's instance (auto: Triton's choice; "
                        "default: %(default)s)")
    p.add_argument("--gpus", type=int, default=0,
                   help="pin subnet i to GPU i %% N (KIND_GPU); 0: use --instance-kind "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per model instance (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a Triton model repository already")
    p.set_defaults(func=cmd_export_triton)


def settings_from(args, config: tuple[dict, dict] | None = None) -> GatewaySettings:
    """SENSAI_* environment variables, overridden by a ``--config`` file's settings (``config``:
    what :func:`read_config` made of it, else it is read here), by ``--set KEY=VALUE``, then by
    the flags given."""
    from_file = {}
    if getattr(args, "config", None):
        from_file, _ = config or read_config(args.config)
    given = {**from_file, **(getattr(args, "knobs", None) or {}), **flag_values(args)}
    if getattr(args, "repository_token_file", None):
        given["repository_token"] = read_token(args.repository_token_file)
    return load_settings(given, setting_names(args, from_file))


def flag_values(args) -> dict:
    """The settings given by their own flags (a flag not given is None)."""
    return {f: getattr(args, f) for f in getattr(args, "flags", {})
            if getattr(args, f, None) is not None}


def setting_names(args, from_file=()) -> dict[str, str]:
    """Each setting -> how its user gave it, for one-line errors: its flag, ``--set KEY``, or
    ``--config FILE: KEY`` for one of ``from_file`` set nowhere else on the command line; a
    setting not named here is called by its environment variable."""
    knobs = getattr(args, "knobs", None) or {}
    given = flag_values(args)
    on_line = set(given) | set(knobs)
    return {**{f: flag for f, flag in getattr(args, "flags", {}).items() if f in given},
            **{f: f"--config {args.config}: {f}" for f in from_file if f not in on_line},
            **{k: f"--set {k}" for k in knobs}}


def check_config_artifact(path: str, measured: dict, artifact) -> None:
    """A deployment file (at ``path``, measured with ``measured``: its ``artifact``) serves the
    artifact it was measured with (its manifest's hash), so what is served is what was
    measured."""
    from sensai.fsutil import sha256_file

    want = measured.get("manifest_sha256")
    if want and sha256_file(artifact.root / "manifest.json") != want:
        raise SensaiError(f"--config {path} was measured with {measured.get('path')}, not "
                          f"{artifact.root} (manifest hash differs); run 'sensai plan' on "
                          "this artifact")


def read_token(path: str) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SensaiError(f"--repository-token-file {path}: cannot read it ({e})") from None
    if not lines or len(lines[0].strip()) < 16:
        raise SensaiError(f"--repository-token-file {path}: its first line must hold a token "
                          "of at least 16 characters")
    return lines[0].strip()


def injected_faults(items: list[str], workers: int):
    """``--inject-delay W=SPEC`` as the predictor's injected faults."""
    from sensai.serving.core.faults import Faults, parse_delay

    delays = {}
    for item in items:
        worker, eq, spec = item.partition("=")
        if not eq or not worker.strip().isdigit():
            raise SensaiError(f"--inject-delay wants WORKER=SPEC (e.g. 2=exp:20ms), got {item!r}")
        if int(worker) >= workers:
            raise SensaiError(f"--inject-delay: no worker {int(worker)} (workers are "
                              f"0..{workers - 1})")
        delays[int(worker)] = parse_delay(spec)
    return Faults(delays)


def cmd_serve(args) -> int:
    from sensai.artifact import load_artifact
    from sensai.manifest import refuse_model_dir
    from sensai.serving.core.placement import check_redundancy
    from sensai.serving.engine.plan import worker_count
    from sensai.serving.core.repository import is_repository
    from sensai.serving.gateway.app import create_app
    from sensai.serving.launch.build import build_predictor, launch_triton

    config = read_config(args.config) if args.config else None
    settings = settings_from(args, config)
    names = setting_names(args, config[0] if config else ())
    refuse_model_dir(args.artifact, "an artifact or a model repository")
    if args.config and is_repository(args.artifact):
        raise SensaiError(f"--config {args.config}: a deployment file is measured for one "
                          "artifact, not a model repository")
    if is_repository(args.artifact):
        return serve_repository(args, settings, names)
    if settings.model_control != "none":
        raise SensaiError(f"--model-control {settings.model_control} needs a model repository "
                          "(REPO/<model>/<version>/, see 'sensai export'), not one artifact")
    artifact = load_artifact(args.artifact)  # fails fast with one line
    if args.config:
        check_config_artifact(args.config, config[1], artifact)
    workers = check_redundancy(len(artifact.subnets),
                               worker_count(settings, len(artifact.subnets)),
                               settings.redundancy, settings.vote)
    if settings.backend == "ray-serve":
        return serve_on_ray_serve(args, settings, names)
    faults = injected_faults(args.inject_delay, workers)
    processes = settings.gateway_processes()
    # The processes backend's workers are device processes at any gateway count: read on the
    # gateway's event loop, batched across requests, nothing pickled (worker processes over
    # pipes would cost a thread hop each way and a pickle per run).
    if processes > 1 or settings.backend == "processes":
        # Bound alone first, then let go: the fleet's shared bind (SO_REUSEPORT) would succeed
        # beside another fleet of this user's on the same port, and the kernel would split the
        # connections between the two.
        settings, sock = check_gateway_host(settings, names)
        sock.close()
        return serve_fleet(args, settings, faults, processes, names)
    refuse_device_processes(names, settings, "the local backend with one gateway process runs "
                                             "the subnets in its own threads; use --backend "
                                             "processes")
    settings, sock = check_gateway_host(settings, names)
    server = None
    url = settings.triton_url
    try:
        if settings.backend == "triton" and url is None:
            server = launch_triton(args.artifact, threads=settings.threads_per_worker)
            url = server.url
            print(f"started tritonserver ({server.install.source}, {server.backend} backend) "
                  f"at {url}", file=sys.stderr)
        predictor = build_predictor(args.artifact,
                                    settings.model_copy(update={"triton_url": url}),
                                    faults=faults)
        print(f"serving {args.artifact} ({len(predictor.groups)} subnets on "
              f"{len(predictor.workers)} {predictor.transport.name} workers, redundancy "
              f"{predictor.placement.redundancy}{', vote' if predictor.placement.vote else ''}) "
              f"on {endpoints(settings)}\nplacement:\n{placement_table(predictor.describe())}",
              file=sys.stderr)
        run_gateway(create_app(predictor, settings), settings, sock)
    finally:
        sock.close()
        if server is not None:
            server.stop()
    return 0


def serve_repository(args, settings: GatewaySettings, names: dict[str, str]) -> int:
    """``sensai serve REPO``: every model of a repository, each version with workers of its
    own, loaded before the port opens; with model control, loaded and unloaded while serving
    (``names``: how the user gave each setting, :func:`setting_names`)."""
    from sensai.serving.core.repository import VersionPolicy, model_names
    from sensai.serving.gateway.app import create_app
    from sensai.serving.gateway.served import ServedModels
    from sensai.serving.launch.build import build_predictor

    if settings.backend in ("triton", "ray-serve"):
        raise SensaiError(f"--backend {settings.backend} does not serve a model repository (use "
                          "local, processes or ray; Triton has its own repository, Ray Serve "
                          "updates an application in place)")
    if args.inject_delay:
        raise SensaiError("--inject-delay applies to one artifact, not a repository")
    if (settings.gateway_replicas or 1) > 1:
        raise SensaiError(f"{setting_name('gateway_replicas', names)} "
                          f"{settings.gateway_replicas}: a model repository is served by one "
                          "gateway process")
    if settings.backend != "processes":  # a version's own device processes, or none
        refuse_device_processes(names, settings, "a model repository's workers on the "
                                f"{settings.backend} backend run in no device process; use "
                                "--backend processes")
    repo = Path(args.artifact)
    if not model_names(repo) and settings.model_control_kind == "none":
        raise SensaiError(f"model repository {repo} has no models (folders {repo}/<model>/"
                          "<version>/ holding an artifact; see 'sensai export')")
    settings, sock = check_gateway_host(settings, names)
    own_ray = False
    try:
        if settings.backend == "ray":  # one Ray for every model's workers, not one per version
            from sensai.raycluster import connect

            own_ray = connect(settings.ray_address)
        models = ServedModels(
            settings, repository=repo, policy=VersionPolicy.parse(settings.version_policy),
            loader=lambda name, path: build_predictor(
                path, settings.model_copy(update={"model_name": name}),
                ray_share=REPOSITORY_RAY_SHARE))
        # Its versions load as the server starts: it serves once uvicorn says so.
        print(f"loading model repository {repo} ({settings.version_policy}, model control "
              f"{settings.model_control}) to serve on {endpoints(settings)}", file=sys.stderr)
        run_gateway(create_app(models, settings), settings, sock)
    finally:
        sock.close()
        if own_ray:
            import ray

            ray.shutdown()
    return 0


def refuse_device_processes(names: dict[str, str], settings: GatewaySettings, why: str) -> None:
    """One line when the device processes are set where the subnets run in none (``names``:
    how the user gave each setting)."""
    if settings.device_processes is not None:
        raise SensaiError(f"{setting_name('device_processes', names)} does not apply here "
                          f"({why})")


def serve_fleet(args, settings: GatewaySettings, faults, processes: int,
                names: dict[str, str]) -> int:
    """``processes`` gateway processes on the port over device processes, until SIGINT or
    SIGTERM (``names``: how the user gave each setting)."""
    from sensai.serving.launch.fleet import Fleet
    from sensai.serving.launch.signals import StopSignals

    fleet = Fleet(args.artifact, settings, processes=processes, faults=faults, names=names)
    with StopSignals() as signals:
        try:
            fleet.start()
            print(f"serving {args.artifact} ({len(fleet.plan.placement.hosts)} subnets on "
                  f"{len(fleet.plan.workers)} workers in {len(fleet.devices)} device "
                  f"process{'es' if len(fleet.devices) > 1 else ''}, "
                  f"{processes} gateway process{'es' if processes > 1 else ''}) on "
                  f"{endpoints(fleet.settings)}\nplacement:"
                  f"\n{plan_table(fleet)}", file=sys.stderr)
            threading.Thread(target=fleet.watch, daemon=True, name="sensai-fleet-watch").start()
            signals.wait()
        except KeyboardInterrupt:
            # A supervisor's SIGTERM during start-up asks for the same clean stop as one after
            # it; Ctrl-C stays an interrupt.
            if signals.received != signal.SIGTERM:
                raise
        finally:
            fleet.stop()
    return 0


def plan_table(fleet) -> str:
    return "\n".join(f"  {d.name}: " + ", ".join(spec.name for _, spec in d.hosted)
                     + f"  [device {d.device}]" for d in fleet.device_plans)


def check_gateway_host(settings: GatewaySettings,
                       names: dict[str, str]) -> tuple[GatewaySettings, socket.socket]:
    """What can be refused before any worker starts or anything is said, in one line; then
    :func:`bind_ports`."""
    if settings.keep_cores_awake == "on":
        keep_cores_awake("on").release()
    return bind_ports(settings, names)


def bind_ports(settings: GatewaySettings,
               names: dict[str, str]) -> tuple[GatewaySettings, socket.socket]:
    """The HTTP port bound (returned, not yet listening) and the gRPC port found free, before
    any worker starts or anything is said, or one line naming the address, why, and the
    setting as the user gave it (``names``).  Returns ``settings`` with the ports as bound, a
    port 0 the kernel's choice, so what is announced and reported is where clients connect."""
    from sensai.serving.gateway.server import bind_port

    grpc_port = settings.grpc_port
    # Both probes bind with SO_REUSEADDR before either listens, so one port given twice would
    # pass them, and the gRPC server would then take it from HTTP.
    if grpc_port is not None and grpc_port == settings.port != 0:
        raise SensaiError(f"{names.get('grpc_port', 'grpc_port')} {grpc_port} is "
                          f"{names.get('port', 'port')} too: give HTTP and gRPC a port each")
    sock = bind_port(settings.host, settings.port, names=names)
    if grpc_port is not None:
        try:
            # Closed again: the gRPC server binds it itself when the gateway starts.
            with bind_port(settings.host, grpc_port, field="grpc_port", names=names) as s:
                grpc_port = s.getsockname()[1]
        except SensaiError:
            sock.close()
            raise
    return settings.model_copy(update={"port": sock.getsockname()[1],
                                       "grpc_port": grpc_port}), sock


def endpoints(settings: GatewaySettings) -> str:
    return f"http://{settings.host}:{settings.port}" + (
        f" and gRPC port {settings.grpc_port}" if settings.grpc_port is not None else "")


def run_gateway(app, settings: GatewaySettings, sock: socket.socket) -> None:
    """``app`` under uvicorn on ``sock`` (bound by :func:`check_gateway_host`) until
    SIGINT/SIGTERM; a failed startup is one line."""
    from sensai.serving.gateway.server import run_uvicorn

    try:
        run_uvicorn(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                    sock=sock)
    except SystemExit:  # uvicorn's exit when the app's startup failed
        failed = getattr(app.state, "startup_error", None)
        if failed is None:
            raise
        raise SensaiError(f"the gateway did not start: {failed}") from None


def serve_on_ray_serve(args, settings: GatewaySettings, names: dict[str, str]) -> int:
    """``--backend ray-serve``: the artifact's Ray Serve application until SIGTERM/SIGINT
    (``names``: how the user gave each setting)."""
    from sensai.serving.launch.build import check_backend_installed
    from sensai.serving.launch.serve_run import serve_artifact

    if args.inject_delay:
        raise SensaiError("--inject-delay does not apply to --backend ray-serve (its workers "
                          "are Serve replicas)")
    check_backend_installed(settings.backend)
    if settings.port == 0:
        raise SensaiError(f"--backend ray-serve needs a fixed {setting_name('port', names)} "
                          "(its ingress replicas share it)")
    settings, sock = bind_ports(settings, names)
    sock.close()  # Serve's ingress replicas bind it, shared
    serve_artifact(args.artifact, settings)
    return 0


def placement_table(described: dict) -> str:
    """One line per worker of a predictor's ``describe()``: the subnets it hosts (its copies
    marked) and where it runs."""
    lines = []
    for w in described["workers"]:
        parts = [name + ("" if g in w["primary"] else " (copy)")
                 for g, name in zip(w["groups"], w["subnets"])]
        at = ", ".join(f"{k} {w[k]}" for k in ("device", "node") if w.get(k))
        lines.append(f"  {w['name']}: {', '.join(parts)}" + (f"  [{at}]" if at else ""))
    return "\n".join(lines)


def cmd_export(args) -> int:
    from sensai.serving.core.repository import add_version

    version = add_version(args.repository, args.model, args.artifact, args.version)
    print(f"wrote {Path(args.repository) / args.model / str(version)} (model {args.model!r} "
          f"version {version})")
    return 0


def cmd_export_triton(args) -> int:
    from sensai.serving.launch.triton_repo import export_triton_repo

    names = export_triton_repo(args.artifact, args.out, backend=args.backend,
                               max_batch_size=args.max_batch_size, instance_kind=args.instance_kind,
                               gpus=args.gpus, threads=args.threads, overwrite=args.overwrite)
    print(f"wrote {len(names)} Triton models ({args.backend}) to {args.out}: {', '.join(names)}")
    return 0

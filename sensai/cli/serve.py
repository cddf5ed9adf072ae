"""``sensai serve``, ``sensai export`` and ``sensai export-triton``.

Every ``sensai`` command, ``--help`` included, builds this module's parsers, so what only a
command needs (the artifact, the predictor, the image decoder, the HTTP client) is imported when
that command runs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from pathlib import Path

from sensai.errors import SensaiError
from sensai.serving.core.settings import (BACKENDS, GPU_WAITS, LOG_LEVELS, RUNTIMES,
                                          GatewaySettings, load_settings, read_config,
                                          setting_name)
from sensai.serving.core.wakeup import MODES, keep_cores_awake

log = logging.getLogger(__name__)

# On Ray, each version of a repository's model may take this part of the cluster's CPUs: a swap
# runs the new version's actors beside the old one's, and actors that do not fit would wait.
REPOSITORY_RAY_SHARE = 0.5


# Every flag that sets a GatewaySettings field has that field as its ``dest`` and no default of
# its own (None: not given), so the settings model keeps the one default and SENSAI_* variables
# still apply; ``setting_flags`` reads the flag of each field back from the parser.


def add_runtime_args(p: argparse.ArgumentParser, runtimes=RUNTIMES) -> None:
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="where the workers run: local (threads of this process, the default), "
                        "processes (processes of their own, one per CPU worker), ray (actors "
                        "on a Ray cluster), triton (a Triton server), ray-serve ('sensai "
                        "serve' only: the Ray Serve "
                        "application, its gateway a Serve replica serving on --host/--port)")
    p.add_argument("--processes", action="store_true", help="same as --backend processes")
    p.add_argument("--device", default=None,
                   help="auto (one GPU per worker round robin, else CPU), cpu, cuda:N "
                        "(default: auto)")
    p.add_argument("--runtime", choices=runtimes, default=None,
                   help="auto: ONNX Runtime on CPUs, CUDA graphs on GPUs (torch eager where a "
                        "network cannot be captured); torch: eager"
                        + ("; sim: a simulated GPU, a fixed time per launch whatever the rows "
                           "(--sim-launch-ms), every subnet in one device process, answers "
                           "that are not the model's: for measuring the serving path"
                           if "sim" in runtimes else "") + " (default: auto)")
    if "sim" in runtimes:
        p.add_argument("--sim-launch-ms", dest="sim_launch_ms", type=float, default=None,
                       metavar="MS", help="--runtime sim: time per launch (default: 0.3)")
    p.add_argument("--gpu-wait", dest="gpu_wait", choices=GPU_WAITS, default=None,
                   help="how a worker waits for its GPU's batch: spin (answers sooner, keeps "
                        "a core busy) or sleep (default: spin)")
    p.add_argument("--threads", dest="threads_per_worker", type=int, default=None, metavar="N",
                   help="intra-op threads per subnet (default: 1)")
    p.add_argument("--trust-model-code", action="store_true", default=None,
                   help="let the torch runtime import an architecture the manifest names as "
                        "package.module:factory (that runs its code)")


def add_host_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "host tuning", "Opt-in, off by default: they change the machine, not only this process "
                       "(deploy/README.md, 'Latency').")
    g.add_argument("--keep-cores-awake", choices=MODES, default=None,
                   help="while serving, ask the kernel that idle cores poll instead of sleeping "
                        "deeply (/dev/cpu_dma_latency, root only; each wake-up is on a request's "
                        "path): off (the default), auto (when this process may), on (or refuse "
                        "to start)")
    g.add_argument("--spread-cores", action="store_true", default=None,
                   help="local backend: move a worker thread to another core when it ran a "
                        "request on the core of another worker of that request "
                        "(sched_setaffinity)")


def add_redundancy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "redundancy",
        "Host every group's subnet on several workers (cyclic placement) so an answer does not "
        "wait for the slowest worker and survives a dead one.  Dead or hung workers are "
        "restarted (on Ray, by Ray).")
    g.add_argument("--redundancy", "-r", type=int, default=None, metavar="R",
                   help="extra copies of every group: worker w also hosts groups w+1..w+R "
                        "(mod W) (default: 0)")
    g.add_argument("--workers", type=int, default=None, metavar="W",
                   help="workers (default: G, one per group)")
    g.add_argument("--vote", action="store_true", default=None,
                   help="2R+1 copies per group; a group is answered when R+1 copies agree "
                        "(outvotes up to R wrong copies)")
    g.add_argument("--hedge-ms", type=float, default=None,
                   help="a worker waits up to this long before computing copies, which are "
                        "skipped if their group is answered meanwhile (default: 0)")
    g.add_argument("--restart-delay", dest="restart_delay_s", type=float, default=None,
                   metavar="SECONDS", help="wait before restarting a dead worker (default: 0)")
    g.add_argument("--inject-delay", action="append", default=[], metavar="W=SPEC",
                   help="TESTING ONLY: worker W sleeps before each request, e.g. 2=exp:20ms, "
                        "1=fixed:50ms@0.1 (10%% of requests)")


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a decomposition artifact over HTTP (REST + KServe "
                                     "v2) and, with --grpc-port, KServe v2 over gRPC",
                       description="Every option but --inject-delay and --processes sets the "
                                   "gateway setting of the same meaning; unset options keep "
                                   "the SENSAI_* environment variable, else the default "
                                   "(deploy/README.md, 'Settings').")
    p.add_argument("artifact", metavar="ARTIFACT_OR_REPOSITORY",
                   help="artifact directory written by 'sensai decompose', or a model repository "
                        "(REPO/<model>/<version>/ each an artifact, see 'sensai export')")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve KServe v2 over gRPC on this port, same host (default: off)")
    p.add_argument("--model-name", default=None, help="name under /v2/models (default sensai)")
    p.add_argument("--deadline", dest="deadline_s", type=float, default=None, metavar="SECONDS",
                   help="seconds a request may take, from its arrival (default 5)")
    add_runtime_args(p)
    add_host_args(p)
    add_placement_args(p)
    add_redundancy_args(p)
    add_batching_args(p)
    add_repository_args(p)
    p.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                   help="the HTTP server's log level (default: info)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a deployment file 'sensai plan' wrote (its chosen settings, for the "
                        "artifact it measured): its settings over the SENSAI_* variables, the "
                        "flags given over both")
    p.set_defaults(func=cmd_serve, flags=setting_flags(p))
    register_export(sub)


def add_placement_args(p) -> None:
    """Where the workers and gateway processes run, per backend."""
    p.add_argument("--ray-address", default=None,
                   help="ray and ray-serve backends: existing cluster (e.g. auto, or HEAD:6379); "
                        "default: start a local Ray instance on 127.0.0.1")
    p.add_argument("--ray-cpus", type=float, default=None,
                   help="ray backend: CPUs per worker actor (default: 1, or an even share that "
                        "fits the cluster)")
    p.add_argument("--gateway-replicas", type=int, default=None, metavar="N",
                   help="gateway processes sharing --port; on the processes backend, and on "
                        "the local backend above 1, the subnets run in device processes (one "
                        "per GPU, one per CPU worker) that batch for all of them (default: "
                        "half the cores, at most 8, 1 below 4 cores or for a repository); "
                        "ray-serve: the application's ingress replicas (default: 1)")
    p.add_argument("--device-processes", type=int, default=None, metavar="N",
                   help="where the subnets run in device processes: N of them for the CPU "
                        "workers, round robin, each computing its subnets one after the other "
                        "(more answers per second on few cores, a lone request a little "
                        "later; default: one per worker; GPUs: one per GPU)")
    p.add_argument("--gateway-cpus", type=float, default=None,
                   help="ray-serve backend: CPUs per gateway process (default: 1, or a "
                        "worker's share when that is less)")
    p.add_argument("--triton-url", default=None,
                   help="triton backend: host:port of a running Triton HTTP endpoint serving "
                        "'sensai export-triton' models; default: launch tritonserver if found")


def add_batching_args(p) -> None:
    g = p.add_argument_group(
        "batching", "A worker runs the requests it finds waiting as one batch "
                    "(deploy/README.md, 'Micro-batching').")
    g.add_argument("--batch-max-rows", dest="batch_max_rows", type=int, default=None,
                   metavar="N", help="most image rows of one subnet in one batch (1: no "
                                     "batching; default: 8 on CPUs, 128 on GPUs and --runtime "
                                     "sim)")
    g.add_argument("--batch-delay-us", dest="batch_delay_us", type=float, default=None,
                   metavar="US", help="how long a request may wait for company (default: 0, "
                                      "only what is queued already is batched)")


def add_repository_args(p) -> None:
    g = p.add_argument_group(
        "model repository", "Serving a repository: every model's versions as its version "
                            "policy says; the control API loads, swaps and unloads them "
                            "without a restart (deploy/README.md, 'Model repository').")
    g.add_argument("--model-control", choices=("none", "explicit", "poll"), default=None,
                   help="none: the repository as it was at start (default); explicit: the "
                        "/v2/repository API loads and unloads; poll: the files are watched")
    g.add_argument("--version-policy", default=None, metavar="POLICY",
                   help="latest[:N] (default latest:1), all, or specific:V[,V...]; a model's "
                        "sensai-model.json overrides it")
    g.add_argument("--repository-poll", dest="repository_poll_s", type=float, default=None,
                   metavar="SECONDS", help="--model-control poll: seconds between looks "
                                           "(default 15)")
    g.add_argument("--repository-token-file", default=None, metavar="FILE",
                   help="the repository API then asks for this bearer token (the file's first "
                        "line); without one it answers loopback clients only")


def register_export(sub) -> None:
    """``sensai export`` and ``sensai export-triton``: an artifact into a model repository."""
    p = sub.add_parser("export", help="add an artifact to a model repository as a new version")
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
                        "inside the Python backend, e.g. the nvidia-pytriton tritonserver)")
    p.add_argument("--max-batch", type=int, default=64, help="max_batch_size (0: no batching)")
    p.add_argument("--instance-kind", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--gpus", type=int, default=0,
                   help="pin subnet i to GPU i %% N (KIND_GPU); 0: use --instance-kind")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per model instance")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_export_triton)


def setting_flags(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each settings field that ``p`` has a flag for -> that flag (argparse keeps its actions
    only in ``_actions``)."""
    return {a.dest: a.option_strings[0] for a in p._actions
            if a.option_strings and a.dest in GatewaySettings.model_fields}


def settings_from(args, config: tuple[dict, dict] | None = None) -> GatewaySettings:
    """SENSAI_* environment variables, overridden by a ``--config`` file's settings (``config``:
    what :func:`read_config` made of it, else it is read here), overridden by the flags
    given."""
    flags = getattr(args, "flags", {})
    given = {f: getattr(args, f) for f in flags if getattr(args, f, None) is not None}
    if getattr(args, "config", None):
        from_file, _ = config or read_config(args.config)
        flags = {**flags, **{f: f"--config {args.config}: {f}" for f in from_file
                             if f not in given}}
        given = {**from_file, **given}
    if getattr(args, "repository_token_file", None):
        given["repository_token"] = read_token(args.repository_token_file)
    if getattr(args, "processes", False):
        if given.get("backend", "processes") != "processes":
            raise SensaiError(f"--processes means --backend processes, not {given['backend']}")
        given["backend"] = "processes"
    return load_settings(given, {**flags, "backend": "--backend"})


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
    from sensai.serving.core.placement import check_redundancy
    from sensai.serving.engine.plan import worker_count
    from sensai.serving.core.repository import is_repository
    from sensai.serving.gateway.app import create_app
    from sensai.serving.launch.build import build_predictor, launch_triton

    config = read_config(args.config) if args.config else None
    settings = settings_from(args, config)
    if args.config and is_repository(args.artifact):
        raise SensaiError(f"--config {args.config}: a deployment file is measured for one "
                          "artifact, not a model repository")
    if is_repository(args.artifact):
        return serve_repository(args, settings)
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
        return serve_on_ray_serve(args, settings)
    faults = injected_faults(args.inject_delay, workers)
    check_gateway_host(settings)
    processes = settings.gateway_processes()
    # The processes backend's workers are device processes at any gateway count: read on the
    # gateway's event loop, batched across requests, nothing pickled (worker processes over
    # pipes would cost a thread hop each way and a pickle per run).
    if processes > 1 or settings.backend == "processes":
        return serve_fleet(args, settings, faults, processes)
    refuse_device_processes(args, settings, "the local backend with one gateway process runs "
                                            "the subnets in its own threads; use --backend "
                                            "processes")
    server = None
    url = settings.triton_url
    if settings.backend == "triton" and url is None:
        server = launch_triton(args.artifact, threads=settings.threads_per_worker)
        url = server.url
        print(f"started tritonserver ({server.install.source}, {server.backend} backend) at "
              f"{url}", file=sys.stderr)
    try:
        predictor = build_predictor(args.artifact,
                                    settings.model_copy(update={"triton_url": url}),
                                    faults=faults)
        print(f"serving {args.artifact} ({len(predictor.groups)} subnets on "
              f"{len(predictor.workers)} {predictor.transport.name} workers, redundancy "
              f"{predictor.placement.redundancy}{', vote' if predictor.placement.vote else ''}) "
              f"on {endpoints(settings)}\nplacement:\n{placement_table(predictor.describe())}",
              file=sys.stderr)
        run_gateway(create_app(predictor, settings), settings)
    finally:
        if server is not None:
            server.stop()
    return 0


def serve_repository(args, settings: GatewaySettings) -> int:
    """``sensai serve REPO``: every model of a repository, each version with workers of its
    own, loaded before the port opens; with model control, loaded and unloaded while serving."""
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
        raise SensaiError(f"--gateway-replicas {settings.gateway_replicas}: a model repository "
                          "is served by one gateway process")
    if settings.backend != "processes":  # a version's own device processes, or none
        refuse_device_processes(args, settings, "a model repository's workers on the "
                                f"{settings.backend} backend run in no device process; use "
                                "--backend processes")
    repo = Path(args.artifact)
    if not model_names(repo) and settings.model_control == "none":
        raise SensaiError(f"model repository {repo} has no models (folders {repo}/<model>/"
                          "<version>/ holding an artifact; see 'sensai export')")
    check_gateway_host(settings)
    own_ray = False
    if settings.backend == "ray":  # one Ray for every model's workers, not one per version
        from sensai.raycluster import connect

        own_ray = connect(settings.ray_address)
    try:
        models = ServedModels(
            settings, repository=repo, policy=VersionPolicy.parse(settings.version_policy),
            loader=lambda name, path: build_predictor(
                path, settings.model_copy(update={"model_name": name}),
                ray_share=REPOSITORY_RAY_SHARE))
        print(f"serving model repository {repo} ({settings.version_policy}, model control "
              f"{settings.model_control}) on {endpoints(settings)}", file=sys.stderr)
        run_gateway(create_app(models, settings), settings)
    finally:
        if own_ray:
            import ray

            ray.shutdown()
    return 0


def refuse_device_processes(args, settings: GatewaySettings, why: str) -> None:
    """One line when the device processes are set where the subnets run in none."""
    if settings.device_processes is not None:
        name = setting_name("device_processes", getattr(args, "flags", {}))
        raise SensaiError(f"{name} does not apply here ({why})")


def serve_fleet(args, settings: GatewaySettings, faults, processes: int) -> int:
    """``processes`` gateway processes on the port over device processes, until SIGINT or
    SIGTERM."""
    from sensai.serving.launch.fleet import Fleet
    from sensai.serving.launch.signals import StopSignals

    fleet = Fleet(args.artifact, settings, processes=processes, faults=faults)
    with StopSignals() as signals:
        try:
            fleet.start()
            print(f"serving {args.artifact} ({len(fleet.plan.placement.hosts)} subnets on "
                  f"{len(fleet.plan.workers)} workers in {len(fleet.devices)} device "
                  f"process{'es' if len(fleet.devices) > 1 else ''}, "
                  f"{processes} gateway process{'es' if processes > 1 else ''}) on "
                  f"{endpoints(settings, fleet.port)}\nplacement:"
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


def check_gateway_host(settings: GatewaySettings) -> None:
    """What can be refused before any worker starts, in one line."""
    if settings.grpc_port:
        check_port_free(settings.host, settings.grpc_port, "--grpc-port")
    if settings.keep_cores_awake == "on":
        keep_cores_awake("on").release()


def endpoints(settings: GatewaySettings, port: int | None = None) -> str:
    return f"http://{settings.host}:{settings.port if port is None else port}" + (
        f" and gRPC port {settings.grpc_port}" if settings.grpc_port is not None else "")


def run_gateway(app, settings: GatewaySettings) -> None:
    """``app`` under uvicorn until SIGINT/SIGTERM; a failed startup is one line."""
    from sensai.serving.gateway.server import run_uvicorn

    try:
        run_uvicorn(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    except SystemExit:  # uvicorn's exit when the app's startup failed
        failed = getattr(app.state, "startup_error", None)
        if failed is None:
            raise
        raise SensaiError(f"the gateway did not start: {failed}") from None


def serve_on_ray_serve(args, settings: GatewaySettings) -> int:
    """``--backend ray-serve``: the artifact's Ray Serve application until SIGTERM/SIGINT."""
    from sensai.serving.launch.build import check_backend_installed
    from sensai.serving.launch.serve_run import serve_artifact

    if args.inject_delay:
        raise SensaiError("--inject-delay does not apply to --backend ray-serve (its workers "
                          "are Serve replicas)")
    check_backend_installed(settings.backend)
    if settings.port == 0:
        raise SensaiError("--backend ray-serve needs a fixed --port (its ingress replicas share "
                          "it)")
    check_port_free(settings.host, settings.port, "--port")
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


def check_port_free(host: str, port: int, flag: str) -> None:
    """Fail in one line, before any worker starts, when something listens on ``port``."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as e:
            raise SensaiError(f"{flag} {port}: cannot listen on {host}:{port} "
                              f"({e.strerror or e})") from None


def cmd_export(args) -> int:
    from sensai.serving.core.repository import add_version

    version = add_version(args.repository, args.model, args.artifact, args.version)
    print(f"wrote {Path(args.repository) / args.model / str(version)} (model {args.model!r} "
          f"version {version})")
    return 0


def cmd_export_triton(args) -> int:
    from sensai.serving.launch.triton_repo import export_triton_repo

    names = export_triton_repo(args.artifact, args.out, backend=args.backend,
                               max_batch_size=args.max_batch, instance_kind=args.instance_kind,
                               gpus=args.gpus, threads=args.threads, overwrite=args.overwrite)
    print(f"wrote {len(names)} Triton models ({args.backend}) to {args.out}: {', '.join(names)}")
    return 0

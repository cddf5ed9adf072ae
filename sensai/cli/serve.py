"""``sensai serve``, ``sensai predict`` and ``sensai export-triton``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from pydantic import ValidationError

from sensai.artifact import load_artifact
from sensai.errors import SensaiError
from sensai.merge import top_k
from sensai.serving.build import build_predictor, check_settings, launch_triton
from sensai.serving.faults import parse_delay
from sensai.serving.imaging import decode_image
from sensai.serving.placement import check_redundancy
from sensai.serving.settings import BACKENDS, GatewaySettings
from sensai.serving.wakeup import MODES, keep_cores_awake

log = logging.getLogger(__name__)

WARMUP = 10


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="where the workers run: local (threads of this process, the default), "
                        "processes (one per worker), ray (actors on a Ray cluster), triton (a "
                        "Triton server)")
    p.add_argument("--processes", action="store_true", help="same as --backend processes")
    p.add_argument("--device", default=None,
                   help="auto (one GPU per worker round robin, else CPU), cpu, cuda:N "
                        "(default: auto, or $SENSAI_DEVICE)")
    p.add_argument("--runtime", choices=("auto", "onnx", "torch"), default=None,
                   help="auto: ONNX Runtime on CPU, torch on GPUs (default: auto)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per subnet (1)")
    p.add_argument("--trust-model-code", action="store_true",
                   help="let the torch runtime import an architecture the manifest names as "
                        "package.module:factory (that runs its code)")


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
    g.add_argument("--vote", action="store_true",
                   help="2R+1 copies per group; a group is answered when R+1 copies agree "
                        "(outvotes up to R wrong copies)")
    g.add_argument("--hedge-ms", type=float, default=0.0,
                   help="a worker waits up to this long before computing copies, which are "
                        "skipped if their group is answered meanwhile (default: 0)")
    g.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS",
                   help="wait before restarting a dead worker (default: 0)")
    g.add_argument("--inject-delay", action="append", default=[], metavar="W=SPEC",
                   help="TESTING ONLY: worker W sleeps before each request, e.g. 2=exp:20ms, "
                        "1=fixed:50ms@0.1 (10%% of requests)")


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a decomposition artifact over HTTP (REST + KServe "
                                     "v2) and, with --grpc-port, KServe v2 over gRPC")
    p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve KServe v2 over gRPC on this port, same host (default: off, "
                        "or $SENSAI_GRPC_PORT)")
    p.add_argument("--model-name", default=None, help="name under /v2/models (default sensai)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds a request may wait for the subnets (default 5)")
    add_runtime_args(p)
    p.add_argument("--keep-cores-awake", choices=MODES, default=None,
                   help="while serving, ask the kernel that idle cores poll instead of sleeping "
                        "deeply (/dev/cpu_dma_latency, root only; each wake-up is on a request's "
                        "path): auto (when this process may, the default), on (or refuse to "
                        "start), off")
    p.add_argument("--ray-address", default=None,
                   help="ray backend: existing cluster (e.g. auto, or HEAD:6379); default: start "
                        "a local Ray instance on 127.0.0.1")
    p.add_argument("--ray-cpus", type=float, default=None,
                   help="ray backend: CPUs per worker actor (default: 1, or an even share that "
                        "fits the cluster)")
    p.add_argument("--triton-url", default=None,
                   help="triton backend: host:port of a running Triton HTTP endpoint serving "
                        "'sensai export-triton' models; default: launch tritonserver if found")
    add_redundancy_args(p)
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("predict", help="classify one image with an artifact (or a running server)")
    p.add_argument("artifact", help="artifact directory (ignored with --url)")
    p.add_argument("image", help="PNG or JPEG file")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--url", default=None, help="send to a running gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("--json", action="store_true", help="print the full JSON answer")
    p.add_argument("--repeat", type=int, default=1,
                   help="send the image this many more times (after 10 warm-up requests) and "
                        "print latency percentiles to stderr")
    add_runtime_args(p)
    p.set_defaults(func=cmd_predict)

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


def settings_from(args) -> GatewaySettings:
    """SENSAI_* environment variables, overridden by the flags given."""
    backend = getattr(args, "backend", None)
    if getattr(args, "processes", False):
        if backend not in (None, "processes"):
            raise SensaiError(f"--processes means --backend processes, not {backend}")
        backend = "processes"
    overrides = {k: v for k, v in {
        "host": getattr(args, "host", None), "port": getattr(args, "port", None),
        "grpc_port": getattr(args, "grpc_port", None),
        "model_name": getattr(args, "model_name", None),
        "deadline_s": getattr(args, "deadline", None), "backend": backend,
        "redundancy": getattr(args, "redundancy", None),
        "vote": True if getattr(args, "vote", False) else None,
        "device": args.device, "runtime": args.runtime, "threads_per_worker": args.threads,
        "trust_model_code": True if args.trust_model_code else None,
        "ray_address": getattr(args, "ray_address", None),
        "keep_cores_awake": getattr(args, "keep_cores_awake", None),
        "triton_url": getattr(args, "triton_url", None)}.items() if v is not None}
    try:
        return GatewaySettings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise SensaiError(f"invalid setting {loc}: {first.get('msg')}") from None


def injected_delays(items: list[str], workers: int) -> dict[int, str]:
    delays = {}
    for item in items:
        worker, eq, spec = item.partition("=")
        if not eq or not worker.strip().isdigit():
            raise SensaiError(f"--inject-delay wants WORKER=SPEC (e.g. 2=exp:20ms), got {item!r}")
        if int(worker) >= workers:
            raise SensaiError(f"--inject-delay: no worker {int(worker)} (workers are "
                              f"0..{workers - 1})")
        delays[int(worker)] = str(parse_delay(spec))
    return delays


def cmd_serve(args) -> int:
    from sensai.serving.app import create_app
    from sensai.serving.server import run_uvicorn

    settings = settings_from(args)
    artifact = load_artifact(args.artifact)  # fails fast with one line
    if args.restart_delay < 0:
        raise SensaiError("--restart-delay must be >= 0")
    check_settings(settings.backend, redundancy=settings.redundancy, vote=settings.vote,
                   hedge_ms=args.hedge_ms, ray_cpus=args.ray_cpus)
    workers = check_redundancy(len(artifact.subnets), args.workers, settings.redundancy,
                               settings.vote)
    delays = injected_delays(args.inject_delay, workers)
    if settings.grpc_port:
        check_port_free(settings.host, settings.grpc_port, "--grpc-port")
    if settings.keep_cores_awake == "on":
        keep_cores_awake("on").release()  # refused now, not after the subnets have loaded
    server = None
    url = settings.triton_url
    if settings.backend == "triton" and url is None:
        server = launch_triton(args.artifact, threads=settings.threads_per_worker)
        url = server.url
        print(f"started tritonserver ({server.install.source}, {server.backend} backend) at "
              f"{url}", file=sys.stderr)
    try:
        predictor = build_predictor(
            args.artifact, backend=settings.backend, redundancy=settings.redundancy,
            vote=settings.vote, workers=args.workers, device=settings.device,
            runtime=settings.runtime, threads=settings.threads_per_worker,
            name=settings.model_name, deadline_s=settings.deadline_s, hedge_ms=args.hedge_ms,
            restart_delay_s=args.restart_delay, hang_timeout_s=settings.hang_timeout(),
            delays=delays, ray_address=settings.ray_address, ray_cpus=args.ray_cpus,
            triton_url=url, trust_code=settings.trust_model_code,
            keep_awake=settings.keep_cores_awake)
        print(f"serving {args.artifact} ({len(predictor.groups)} subnets on "
              f"{len(predictor.workers)} {predictor.transport.name} workers, redundancy "
              f"{predictor.placement.redundancy}{', vote' if predictor.placement.vote else ''}) "
              f"on http://{settings.host}:{settings.port}"
              + (f" and gRPC port {settings.grpc_port}" if settings.grpc_port is not None
                 else "") + f"\nplacement:\n{predictor.placement_table()}", file=sys.stderr)
        app = create_app(predictor, settings)
        try:
            run_uvicorn(app, host=settings.host, port=settings.port, log_level=args.log_level)
        except SystemExit:  # uvicorn's exit when the app's startup (the gRPC server) failed
            failed = getattr(app.state, "startup_error", None)
            if failed is None:
                raise
            raise SensaiError(f"the gateway did not start: {failed}") from None
    finally:
        if server is not None:
            server.stop()
    return 0


def check_port_free(host: str, port: int, flag: str) -> None:
    """Fail in one line, before any worker starts, when something listens on ``port``."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as e:
            raise SensaiError(f"{flag} {port}: cannot listen on {host}:{port} "
                              f"({e.strerror or e})") from None


def cmd_predict(args) -> int:
    if args.top_k < 1:
        raise SensaiError("--top-k must be at least 1")
    if args.repeat < 1:
        raise SensaiError("--repeat must be at least 1")
    path = Path(args.image)
    if not path.is_file():
        raise SensaiError(f"image {path} does not exist")
    if args.url:
        return predict_remote(args, path)
    settings = settings_from(args)
    artifact = load_artifact(args.artifact)
    # The image is checked before any subnet is loaded.
    x = decode_image(path.read_bytes(), artifact.spec,
                     settings.image_pixels(artifact.spec.input_shape),
                     settings.decoded_bytes(artifact.spec.input_shape))
    predictor = build_predictor(args.artifact, backend=settings.backend, device=settings.device,
                                runtime=settings.runtime, threads=settings.threads_per_worker,
                                name=settings.model_name, deadline_s=settings.deadline_s,
                                ray_address=settings.ray_address,
                                triton_url=settings.triton_url,
                                trust_code=settings.trust_model_code,
                                keep_awake=settings.keep_cores_awake)

    async def run():
        # Timed (--repeat) as the gateway serves: with the idle cores kept awake when it may.
        awake = None
        try:
            if args.repeat > 1:
                awake = keep_cores_awake(settings.keep_cores_awake)
            runs = args.repeat + WARMUP if args.repeat > 1 else 1
            times = []
            for i in range(runs):
                t0 = time.perf_counter()
                pred = await predictor.predict(x)
                if runs > 1 and i >= WARMUP:
                    times.append((time.perf_counter() - t0) * 1e3)
            if times:
                print_latency(times, "predictor (in process)")
            return pred
        finally:
            if awake is not None:
                awake.release()
            await predictor.close()

    pred = asyncio.run(run())
    classes = artifact.spec.classes
    idx, val = top_k(pred.scores, min(args.top_k, len(classes)))
    rows = [{"index": int(i), "label": classes[int(i)], "score": float(v)}
            for i, v in zip(idx[0], val[0])]
    if args.json:
        timings = {k: round(v, 4) for k, v in pred.timings_ms.items()}
        print(json.dumps({"predictions": rows, "timings_ms": timings}, indent=2))
    else:
        for r in rows:
            print(f"{r['score']:.4f}  {r['index']:>3}  {r['label']}")
    return 0


def predict_remote(args, path: Path) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    url = args.url.rstrip("/") + "/v1/predict"
    data = path.read_bytes()
    times = []
    try:
        with httpx.Client(timeout=60) as client:
            for i in range((args.repeat + WARMUP) if args.repeat > 1 else 1):
                t0 = time.perf_counter()
                r = client.post(url, params={"top_k": args.top_k},
                                files={"image": (path.name, data, "application/octet-stream")})
                if i >= WARMUP:
                    times.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    break
    except httpx.HTTPError as e:
        raise SensaiError(f"cannot reach {url}: {e}") from None
    if times and r.status_code == 200:
        print_latency(times, f"HTTP {url}")
    try:
        body = r.json()
    except ValueError:
        raise SensaiError(f"{url} answered {r.status_code} with a non-JSON body") from None
    if r.status_code != 200:
        raise SensaiError(f"{url} answered {r.status_code}: {body.get('error', body)}")
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        for p in body["predictions"]:
            print(f"{p['score']:.4f}  {p['index']:>3}  {p['label']}")
    return 0


def print_latency(times_ms: list[float], what: str) -> None:
    t = np.asarray(times_ms)
    print(f"{what}: {len(t)} requests, p50 {np.percentile(t, 50):.2f} ms, "
          f"p90 {np.percentile(t, 90):.2f} ms, p99 {np.percentile(t, 99):.2f} ms, "
          f"mean {t.mean():.2f} ms", file=sys.stderr)


def cmd_export_triton(args) -> int:
    from sensai.serving.triton_repo import export_triton_repo

    names = export_triton_repo(args.artifact, args.out, backend=args.backend,
                               max_batch_size=args.max_batch, instance_kind=args.instance_kind,
                               gpus=args.gpus, threads=args.threads, overwrite=args.overwrite)
    print(f"wrote {len(names)} Triton models ({args.backend}) to {args.out}: {', '.join(names)}")
    return 0

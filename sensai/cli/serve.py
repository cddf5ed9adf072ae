"""``sensai serve``, ``sensai predict`` and ``sensai export-triton``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

BACKENDS = ("local", "ray", "triton")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="auto (one GPU per subnet round robin, else CPU), cpu, cuda:N "
                        "(default: auto, or $SENSAI_DEVICE)")
    p.add_argument("--runtime", choices=("auto", "onnx", "torch"), default=None,
                   help="auto: ONNX Runtime on CPU, torch on GPUs (default: auto)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per subnet (1)")
    p.add_argument("--processes", action="store_true",
                   help="local backend: one worker process per subnet instead of a thread")


def _add_redundancy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "redundancy (local and ray backends)",
        "Host every group's subnet on several workers (cyclic placement) so an answer does not "
        "wait for the slowest worker and survives a dead one (serving.robust).  Local backend: "
        "worker processes restarted by the gateway; ray backend: Ray actors restarted by Ray.")
    g.add_argument("--redundancy", "-r", type=int, default=None, metavar="R",
                   help="extra copies of every group: worker w also hosts groups w+1..w+R "
                        "(mod W); 0 = one process per group, no copies")
    g.add_argument("--workers", type=int, default=None, metavar="W",
                   help="worker processes or Ray actors (default: G, one per group)")
    g.add_argument("--vote", action="store_true",
                   help="2R+1 copies per group; a group is answered when R+1 copies agree "
                        "(outvotes up to R wrong copies)")
    g.add_argument("--hedge-ms", type=float, default=0.0,
                   help="a worker waits up to this long before computing copies, which are "
                        "skipped if their group is answered meanwhile (default: 0)")
    g.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS",
                   help="wait before restarting a dead worker (ray backend: before taking "
                        "back the actor Ray restarted) (default: 0)")
    g.add_argument("--inject-delay", action="append", default=[], metavar="W=SPEC",
                   help="TESTING ONLY: worker W sleeps before each request, e.g. 2=exp:20ms, "
                        "1=fixed:50ms@0.1 (10%% of requests)")


def _robust_options(args, groups: int) -> dict:
    """Validate the redundancy flags before any worker starts; kwargs for robust_predictor."""
    from sensai.errors import SensaiError

    from sensai.serving.robust import check_robust_args, parse_delay

    if args.redundancy is None:
        extra = [f for f, on in (("--vote", args.vote), ("--workers", args.workers is not None),
                                 ("--hedge-ms", args.hedge_ms), ("--inject-delay",
                                                                 args.inject_delay),
                                 ("--restart-delay", args.restart_delay)) if on]
        if extra:
            raise SensaiError(f"{', '.join(extra)} only apply with --redundancy")
        return {}
    if args.backend not in ("local", "ray"):
        raise SensaiError(f"--redundancy works with the local and ray backends, not "
                          f"--backend {args.backend}")
    if args.hedge_ms < 0 or args.restart_delay < 0:
        raise SensaiError("--hedge-ms and --restart-delay must be >= 0")
    w = check_robust_args(groups, args.workers, args.redundancy, args.vote)
    delays = {}
    for item in args.inject_delay:
        worker, eq, spec = item.partition("=")
        if not eq or not worker.strip().isdigit():
            raise SensaiError(f"--inject-delay wants WORKER=SPEC (e.g. 2=exp:20ms), got {item!r}")
        if int(worker) >= w:
            raise SensaiError(f"--inject-delay: no worker {int(worker)} (workers are 0..{w - 1})")
        delays[int(worker)] = str(parse_delay(spec))
    opts = {"redundancy": args.redundancy, "workers": args.workers, "vote": args.vote,
            "hedge_ms": args.hedge_ms, "restart_delay_s": args.restart_delay, "delays": delays,
            "backend": args.backend}
    if args.backend == "ray" and getattr(args, "ray_cpus", None) is not None:
        opts["ray_cpus"] = args.ray_cpus
    return opts


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a decomposition artifact over HTTP (REST + KServe v2)")
    p.add_argument("artifact", help="artifact directory written by 'sensai decompose'")
    p.add_argument("--backend", choices=BACKENDS, default="local",
                   help="where the subnets run: local workers, Ray Serve, or a Triton server")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--model-name", default=None, help="name under /v2/models (default sensai)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds a request may wait for the subnets (default 5)")
    _add_runtime_args(p)
    p.add_argument("--ray-address", default=None,
                   help="ray backend: existing cluster (e.g. ray://head:10001 or auto); "
                        "default: start a local Ray instance")
    p.add_argument("--ray-cpus", type=float, default=None,
                   help="ray backend: CPUs per subnet replica (default: 1 or an even share)")
    p.add_argument("--triton-url", default=None,
                   help="triton backend: host:port of a running Triton HTTP endpoint serving "
                        "'sensai export-triton' models; default: launch tritonserver if found")
    _add_redundancy_args(p)
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
    _add_runtime_args(p)
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


def _settings(args, **extra):
    from pydantic import ValidationError

    from sensai.errors import SensaiError

    from sensai.serving.settings import GatewaySettings

    overrides = {k: v for k, v in {
        "host": getattr(args, "host", None), "port": getattr(args, "port", None),
        "model_name": getattr(args, "model_name", None), "deadline_s": getattr(args, "deadline", None),
        "device": args.device, "runtime": args.runtime, "threads_per_worker": args.threads,
        "processes": True if args.processes else None,
        "ray_address": getattr(args, "ray_address", None),
        "triton_url": getattr(args, "triton_url", None), **extra}.items() if v is not None}
    try:
        return GatewaySettings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise SensaiError(f"invalid setting {loc}: {first.get('msg')}") from None


def _check_artifact(path: str) -> None:
    from sensai.manifest import load_manifest

    load_manifest(path)  # fails fast with a one-line message


def _group_count(path: str) -> int:
    from sensai.manifest import load_manifest

    return len(load_manifest(path).groups)


def _run_uvicorn(app, settings, log_level: str = "info") -> None:
    """uvicorn in this process; it handles SIGINT/SIGTERM and runs the app's shutdown."""
    import uvicorn

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=10)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal against the
    # handlers that were installed before it; these make that a normal exit (status 0).
    stopped = []
    old = {s: signal.signal(s, lambda signum, frame: stopped.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stopped:
        log.info("stopped by %s", signal.Signals(stopped[0]).name)


def _wait_for_signal() -> None:
    stop = threading.Event()

    def handler(signum, frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def cmd_serve(args) -> int:
    from sensai.errors import SensaiError

    from sensai.serving.app import create_app

    settings = _settings(args)
    _check_artifact(args.artifact)
    robust = _robust_options(args, _group_count(args.artifact))
    if robust:
        if args.processes:
            raise SensaiError("--redundancy always runs its own workers (processes or Ray "
                              "actors); drop --processes")
        from sensai.serving.robust import robust_predictor

        if robust["backend"] == "ray":
            robust["ray_address"] = settings.ray_address
        predictor = robust_predictor(args.artifact, device=settings.device,
                                     runtime=settings.runtime,
                                     threads=settings.threads_per_worker,
                                     name=settings.model_name, deadline_s=settings.deadline_s,
                                     **robust)
        what = "Ray actors (restarted by Ray)" if predictor.backend == "ray" else \
            "worker processes"
        print(f"serving {args.artifact} ({len(predictor.groups)} subnets on "
              f"{len(predictor.workers)} {what}, redundancy {predictor.redundancy}"
              f"{', vote' if predictor.vote else ''}) on http://{settings.host}:{settings.port}\n"
              f"placement:\n{predictor.placement_table()}", file=sys.stderr)
        _run_uvicorn(create_app(predictor, settings), settings, args.log_level)
        return 0
    if args.backend == "local":
        from sensai.serving.pools import local_predictor

        predictor = local_predictor(args.artifact, device=settings.device, runtime=settings.runtime,
                                    threads=settings.threads_per_worker,
                                    processes=settings.processes, name=settings.model_name,
                                    deadline_s=settings.deadline_s)
        print(f"serving {args.artifact} ({len(predictor.pool.names)} subnets, local) on "
              f"http://{settings.host}:{settings.port}", file=sys.stderr)
        _run_uvicorn(create_app(predictor, settings), settings, args.log_level)
        return 0
    if args.backend == "triton":
        return _serve_triton(args, settings)
    if args.processes:
        raise SensaiError("--processes applies to the local backend only")
    return _serve_ray(args, settings)


def _serve_triton(args, settings) -> int:
    import socket
    import tempfile

    from sensai.serving.app import create_app
    from sensai.serving.triton import TritonServerProcess, export_triton_repo, find_tritonserver, triton_predictor

    server = None
    url = settings.triton_url
    if url is None:
        from sensai.errors import SensaiError

        from sensai.serving.triton import TRITON_HINT

        install = find_tritonserver()
        if install is None:
            raise SensaiError(TRITON_HINT + ", or pass --triton-url")
        backend = "onnxruntime" if "onnxruntime" in install.backends() or not install.backends() \
            else "python"
        repo = Path(tempfile.mkdtemp(prefix="sensai-triton-repo-")) / "models"
        export_triton_repo(args.artifact, repo, backend=backend,
                           threads=settings.threads_per_worker)
        ports = []
        for _ in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        server = TritonServerProcess(repo, http_port=ports[0], grpc_port=ports[1],
                                     metrics_port=ports[2], install=install).start()
        url = server.url
        print(f"started tritonserver ({install.source}, {backend} backend) at {url}; log: "
              f"{server.log_path}", file=sys.stderr)
    try:
        predictor = triton_predictor(args.artifact, url, name=settings.model_name,
                                     deadline_s=settings.deadline_s)
        print(f"serving {args.artifact} via Triton at {url} on "
              f"http://{settings.host}:{settings.port}", file=sys.stderr)
        _run_uvicorn(create_app(predictor, settings), settings, args.log_level)
    finally:
        if server is not None:
            server.stop()
    return 0


def _serve_ray(args, settings) -> int:
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from sensai.serving.ray_app import APP_NAME, build_app

    own_cluster = settings.ray_address is None
    ray.init(address=settings.ray_address, include_dashboard=False if own_cluster else None,
             namespace="serve")
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        app_args = {"artifact": str(Path(args.artifact).resolve()), "runtime": settings.runtime,
                    "settings": settings.model_dump(include={"model_name", "deadline_s",
                                                             "max_body_bytes", "max_image_pixels",
                                                             "max_batch", "threads_per_worker",
                                                             "default_top_k"})}
        if args.ray_cpus is not None:
            app_args["subnet_cpus"] = args.ray_cpus
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"serving {args.artifact} on Ray Serve at http://{settings.host}:{settings.port} "
              "(Ctrl-C to stop)", file=sys.stderr)
        _wait_for_signal()
    finally:
        try:
            if own_cluster:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0


def cmd_predict(args) -> int:
    import asyncio

    from sensai.errors import SensaiError

    if args.top_k < 1:
        raise SensaiError("--top-k must be at least 1")
    if args.repeat < 1:
        raise SensaiError("--repeat must be at least 1")
    path = Path(args.image)
    if not path.is_file():
        raise SensaiError(f"image {path} does not exist")
    if args.url:
        return _predict_remote(args, path)
    settings = _settings(args)
    from sensai.manifest import load_manifest
    from sensai.merge import top_k

    from sensai.serving.imaging import decode_image
    from sensai.serving.pools import local_predictor

    # The image is checked before any subnet is loaded.
    spec = load_manifest(args.artifact).dataset.to_spec()
    x = decode_image(path.read_bytes(), spec, settings.max_image_pixels)
    predictor = local_predictor(args.artifact, device=settings.device, runtime=settings.runtime,
                                threads=settings.threads_per_worker, processes=settings.processes,
                                name=settings.model_name, deadline_s=settings.deadline_s)

    async def run():
        try:
            runs = args.repeat + WARMUP if args.repeat > 1 else 1
            times = []
            for i in range(runs):
                t0 = time.perf_counter()
                pred = await predictor.predict(x)
                if runs > 1 and i >= WARMUP:
                    times.append((time.perf_counter() - t0) * 1e3)
            if times:
                _print_latency(times, "predictor (in process)")
            return pred
        finally:
            await predictor.close()

    pred = asyncio.run(run())
    classes = predictor.spec.classes
    idx, val = top_k(pred.scores, min(args.top_k, len(classes)))
    rows = [{"index": int(i), "label": classes[int(i)], "score": float(v)}
            for i, v in zip(idx[0], val[0])]
    if args.json:
        print(json.dumps({"predictions": rows, "timings_ms": pred.timings_ms}, indent=2))
    else:
        for r in rows:
            print(f"{r['score']:.4f}  {r['index']:>3}  {r['label']}")
    return 0


def _predict_remote(args, path: Path) -> int:
    import httpx

    from sensai.errors import SensaiError

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
        _print_latency(times, f"HTTP {url}")
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


WARMUP = 10


def _print_latency(times_ms: list[float], what: str) -> None:
    import numpy as np

    t = np.asarray(times_ms)
    print(f"{what}: {len(t)} requests, p50 {np.percentile(t, 50):.2f} ms, "
          f"p90 {np.percentile(t, 90):.2f} ms, p99 {np.percentile(t, 99):.2f} ms, "
          f"mean {t.mean():.2f} ms", file=sys.stderr)


def cmd_export_triton(args) -> int:
    from sensai.serving.triton import export_triton_repo

    names = export_triton_repo(args.artifact, args.out, backend=args.backend,
                               max_batch_size=args.max_batch, instance_kind=args.instance_kind,
                               gpus=args.gpus, threads=args.threads, overwrite=args.overwrite)
    print(f"wrote {len(names)} Triton models ({args.backend}) to {args.out}: {', '.join(names)}")
    return 0

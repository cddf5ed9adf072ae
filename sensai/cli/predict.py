"""``sensai predict``: classify one image with an artifact in process, or send it to a running
gateway; ``--repeat`` times it as ``sensai bench`` does (its warm-up first), so this command's
arguments are added only when it is used (the benchmark's vocabulary is read then)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from sensai.errors import SensaiError
from sensai.serving.core.settings import MODEL_RUNTIMES
from sensai.serving.core.wakeup import keep_cores_awake

from .serve import settings_from
from .settings_args import add_setting_flags, setting_flags

# The settings a prediction in this process takes flags for: where and how the subnets run.  The
# in-process tuning (threads, host tunings) comes from the SENSAI_* variables, as for the gateway.
PREDICT_SETTINGS = ("backend", "device", "runtime", "trust_model_code")


def register(sub) -> None:
    sub.add_parser("predict", help="classify one image with an artifact (or a running server)",
                   arguments=add_predict_args)


def add_predict_args(p) -> None:
    from sensai.bench.names import WARMUP

    p.add_argument("artifact", help="artifact directory (ignored with --url)")
    p.add_argument("image", help="PNG or JPEG file")
    p.add_argument("--top-k", type=int, default=None,
                   help="classes to show (default: 5, or every class of a smaller model, as the "
                        "gateway answers)")
    p.add_argument("--url", default=None,
                   help="send to a running gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("--json", action="store_true", help="print the full JSON answer")
    p.add_argument("--repeat", type=int, default=1,
                   help=f"send the image this many more times (after {WARMUP} warm-up requests, "
                        "as sensai bench) and print latency percentiles to stderr")
    add_setting_flags(p, PREDICT_SETTINGS, choices={"runtime": MODEL_RUNTIMES})
    p.set_defaults(func=cmd_predict, flags=setting_flags(p), warmup=WARMUP)


def cmd_predict(args) -> int:
    if args.top_k is not None and args.top_k < 1:
        raise SensaiError("--top-k must be at least 1")
    if args.repeat < 1:
        raise SensaiError("--repeat must be at least 1")
    path = Path(args.image)
    if path.is_dir():
        raise SensaiError(f"image {path} is a directory; give one image file")
    if not path.is_file():
        raise SensaiError(f"image {path} does not exist")
    if not path.stat().st_size:
        raise SensaiError(f"image {path} is empty (0 bytes)")
    if args.url:
        return predict_remote(args, path)
    from sensai.artifact import load_artifact
    from sensai.merge import top_k
    from sensai.serving.gateway.imaging import decode_image
    from sensai.serving.gateway.predict_routes import DEFAULT_TOP_K
    from sensai.serving.launch.build import build_predictor

    settings = settings_from(args)
    artifact = load_artifact(args.artifact)
    classes = artifact.spec.classes
    if args.top_k is not None and args.top_k > len(classes):  # as the gateway refuses it
        raise SensaiError(f"--top-k: at most {len(classes)}, the classes of the model")
    k = args.top_k or min(DEFAULT_TOP_K, len(classes))
    # The image is checked before any subnet is loaded.
    x = decode_image(path.read_bytes(), artifact.spec,
                     settings.image_pixels(artifact.spec.input_shape))
    predictor = build_predictor(args.artifact, settings)

    async def run():
        # Timed (--repeat) as the gateway serves: with the host tunings the gateway would use.
        awake = None
        try:
            if args.repeat > 1:
                awake = keep_cores_awake(settings.keep_cores_awake)
            runs = args.repeat + args.warmup if args.repeat > 1 else 1
            times = []
            for i in range(runs):
                t0 = time.perf_counter()
                pred = await predictor.predict(x)
                if runs > 1 and i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            if times:
                print_latency(times, "predictor (in process)")
            return pred
        finally:
            if awake is not None:
                awake.release()
            await predictor.close()

    pred = asyncio.run(run())
    idx, val = top_k(pred.scores, k)
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
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    url = args.url.rstrip("/") + "/v1/predict"
    data = path.read_bytes()
    times = []
    try:
        with httpx.Client(timeout=60) as client:
            for i in range((args.repeat + args.warmup) if args.repeat > 1 else 1):
                t0 = time.perf_counter()
                r = client.post(url, params={"top_k": args.top_k} if args.top_k else {},
                                files={"image": (path.name, data, "application/octet-stream")})
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    break
    except httpx.InvalidURL as e:
        raise SensaiError(f"--url {args.url} is no URL: {e}") from None
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
    import numpy as np

    t = np.asarray(times_ms)
    print(f"{what}: {len(t)} requests, p50 {np.percentile(t, 50):.2f} ms, "
          f"p90 {np.percentile(t, 90):.2f} ms, p99 {np.percentile(t, 99):.2f} ms, "
          f"mean {t.mean():.2f} ms", file=sys.stderr)

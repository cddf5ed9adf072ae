"""The original model on plain Ray Serve: the ``ray-serve`` peer of ``sensai bench --peers``.

What a user picking Ray Serve instead of sensai runs, as in Ray's docs: one deployment whose
``__call__`` takes the HTTP request from Serve's proxy.  It answers the benchmark client's KServe v2
request (``POST /v2/models/<model>/infer``) with the class (``class_index``) and the replica's own
timings, and the bare request the client times before each one (``GET /v2/health/live``) with 200.
The request is parsed by the gateway's parser
(:func:`~sensai.serving.gateway.oip.parse_infer_request`) and the model run by the workers' runner
(:class:`~sensai.serving.workers.runners.OrtRunner`, ``threads`` intra-op threads), so the peer
differs from sensai in the serving framework only.

:func:`serve_original` runs it as sensai's own Serve application is run
(:func:`~sensai.serving.launch.serve_run.launch`): on the Ray instance this process is connected to
(else a new local one), its proxy on 127.0.0.1; the
:class:`~sensai.serving.launch.serve_run.ServeRun` it returns stops it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sensai.errors import first_line
from sensai.serving.gateway.oip import HEADER_LENGTH, parse_infer_request
from sensai.serving.launch.serve_run import ServeRun, launch
from sensai.serving.workers.runners import OrtRunner

APP = "sensai-bench-peer"
LIVE = "/v2/health/live"


@serve.deployment(max_ongoing_requests=64)
class OriginalModel:
    """The ONNX model behind one HTTP route (any path ending in ``/infer``) and the health
    check."""

    def __init__(self, onnx_path: str, threads: int, model: str):
        self.runner = OrtRunner(onnx_path, threads=threads, name=model)
        self.model = model

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET":
            return Response(status_code=200 if request.url.path == LIVE else 404)
        if not request.url.path.endswith("/infer"):
            return Response(status_code=404)
        body = await request.body()
        t0 = time.perf_counter()
        try:
            req = parse_infer_request(body, request.headers.get(HEADER_LENGTH))
            x = np.ascontiguousarray(req.inputs[0].array, dtype=np.float32)
            t1 = time.perf_counter()
            scores = self.runner.run(x)
            t2 = time.perf_counter()
        except Exception as e:  # bad request, or a shape the model does not take
            return JSONResponse({"error": first_line(e)}, status_code=400)
        index = [int(k) for k in np.argmax(scores, axis=1)]
        timings = {"compute": (t2 - t1) * 1e3, "total": (time.perf_counter() - t0) * 1e3}
        return JSONResponse({
            "model_name": self.model,
            "outputs": [{"name": "class_index", "datatype": "INT64", "shape": [len(index)],
                         "data": index}],
            "parameters": {"timings_ms": json.dumps(timings)}})


def serve_original(onnx: Path, *, threads: int, model: str, port: int,
                   startup_timeout_s: float = 180.0) -> ServeRun:
    """Serve ``onnx`` as ``model`` behind Serve's proxy at ``http://127.0.0.1:port``; returns
    once it answers.  The replica asks for no CPU, so it is placed whatever the run's other
    Ray workers hold."""
    return launch(lambda: (APP, OriginalModel.options(ray_actor_options={"num_cpus": 0}).bind(
        str(Path(onnx).resolve()), threads, model)), host="127.0.0.1", port=port,
        ready_path=LIVE, startup_timeout_s=startup_timeout_s)

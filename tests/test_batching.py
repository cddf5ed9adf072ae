"""Micro-batching in the workers: the requests a worker finds waiting run as one batch.

The in-worker loop is tested directly on the real ONNX subnets of ``tiny_artifact`` (runs put on
its queue before it starts, so what it batches is known); then the real predictor on every
transport (threads, processes, Ray actors) with many concurrent requests on real Fashion-MNIST
test images, and the gateway's KServe v2 batches over real HTTP.  A request alone is never held
back waiting for company: checked with the workers' own counters, never with a clock.
"""

from __future__ import annotations

import asyncio
import json
import queue

import httpx
import numpy as np
import pytest

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.errors import SensaiError
from sensai.serving.core.errors import SubnetFailed, SubnetTimeout
from sensai.serving.core.messages import Batching, Done, Output, Run, RunFailed, Skip
from sensai.serving.core.settings import GatewaySettings, load_settings
from sensai.serving.launch.build import build_predictor
from sensai.serving.launch.triton_repo import export_triton_repo
from sensai.serving.workers.loop import Stop, WorkerCore, per_request
from sensai.serving.workers.runners import runner_specs
from tests.helpers import (local_ray, offline_scores, predict_all, sample_images, serve_queued,
                           start_gateway, wait_until)

N = 20  # two images per class
# Answers after a trip through processes or Ray, batched or not, match offline evaluation (torch)
# to float noise.
ATOL = 1e-4


@pytest.fixture(scope="module")
def images(fmnist_test, fmnist_spec, tiny_artifact):
    """N real test images: normalized inputs and offline evaluation's scores."""
    _, u8, _ = sample_images(fmnist_test, N, seed=5)
    assert len(u8) == N
    return {"x": normalize(u8, fmnist_spec).numpy(),
            "offline": offline_scores(tiny_artifact, u8, fmnist_spec)}


# --------------------------------------------------------------------------------------------
# The in-worker loop


class Recorded:
    """A real runner, and the rows of every call it gets; ``refuse``: a row value it fails on
    (a runtime failing on one request's input)."""

    def __init__(self, runner, refuse: float | None = None):
        self.runner, self.refuse, self.calls = runner, refuse, []
        self.name, self.device, self.runtime = runner.name, runner.device, runner.runtime

    def run(self, x):
        self.calls.append(len(x))
        if self.refuse is not None and (x == self.refuse).any():
            raise ValueError("refused a row")
        return self.runner.run(x)


@pytest.fixture(scope="module")
def runners(tiny_artifact):
    specs = runner_specs(load_artifact(tiny_artifact), device="cpu", runtime="onnx")
    return {g: specs[g].build() for g in (0, 1)}


def outputs_of(events, req):
    return {e.group: e.output for e in events if type(e) is Output and e.req == req}


def test_queued_runs_are_stacked_and_each_gets_its_own_rows(runners, images):
    x = images["x"]
    rec = {g: Recorded(r) for g, r in runners.items()}
    core = WorkerCore(rec, batching=Batching(max_rows=4))
    runs = [Run(1, x[0:1], (0, 1), 2), Run(2, x[1:4], (0, 1), 2),  # a v2 batch of three rows
            Run(3, x[4:5], (0, 1), 2), Run(4, x[5:6], (0, 1), 2),
            Run(5, x[6:12], (0, 1), 2)]  # more rows than a batch: alone and whole
    events = serve_queued(core, runs)
    # Runs 1+2 fill a batch; 3+4 the next; 5 alone - each group once per batch.
    assert rec[0].calls == rec[1].calls == [4, 2, 6]
    for run in runs:
        got = outputs_of(events, run.req)
        for g in (0, 1):
            assert got[g].shape[0] == len(run.x)
            np.testing.assert_allclose(got[g], runners[g].run(run.x), atol=1e-5)
    done = [e for e in events if type(e) is Done]
    assert [d.req for d in done] == [1, 2, 3, 4, 5] and all(d.skipped == 0 for d in done)
    # A request's Done comes after its own outputs.
    assert all(events.index(d) > max(i for i, e in enumerate(events)
                                      if type(e) is Output and e.req == d.req) for d in done)
    c = core.counts
    assert (c.batches, c.requests, c.largest, c.held) == (3, 5, 2, 0)
    assert done[-1].counts == c


def test_skipped_malformed_and_failing_requests_leave_their_batch_mates_unharmed(runners,
                                                                                 images):
    x = images["x"]
    bad = x[3:4].copy()
    bad[0, 0, 0, 0] = 7.0  # the runtime below fails on this request's input only
    rec = {g: Recorded(r, refuse=7.0) for g, r in runners.items()}
    core = WorkerCore(rec, batching=Batching(max_rows=8))
    core.skip(Skip(2, None))  # answered elsewhere, cancelled or expired before it ran
    runs = [Run(1, x[0:1], (0, 1), 2), Run(2, x[1:2], (0, 1), 2), Run(3, bad, (0, 1), 2),
            Run(4, x[4:5], (0, 1), 2),
            Run(5, x[5:6, :, :27, :27], (0, 1), 2),  # a wrong shape: cannot be stacked
            Run(6, x[6:7], (0, 1), 2)]
    events = serve_queued(core, runs)
    # One batch: 1, 3, 4 and 6 without the skipped 2 stacked, 5 (rows of another shape) in a
    # call of its own; the stack fails on 3, so its requests run again one by one.
    assert rec[0].calls == [4, 1, 1, 1, 1, 1]
    for req, i in ((1, 0), (4, 4), (6, 6)):
        got = outputs_of(events, req)
        for g in (0, 1):
            np.testing.assert_allclose(got[g], runners[g].run(x[i:i + 1]), atol=1e-5)
    failed = {(e.req, e.group): e.error for e in events if type(e) is RunFailed}
    assert set(failed) == {(3, 0), (3, 1), (5, 0), (5, 1)}
    assert "refused a row" in failed[3, 0] and "refused" not in failed[5, 0]
    assert not outputs_of(events, 2)
    assert {e.req: e.skipped for e in events if type(e) is Done} == \
        {1: 0, 2: 2, 3: 0, 4: 0, 5: 0, 6: 0}
    assert core.counts.largest == 6 and core.counts.held == 0
    assert core.group_counts[0].largest == 4  # the stack of 1, 3, 4 and 6


def test_a_lone_run_waits_for_company_only_when_a_delay_is_set(runners, images):
    x = images["x"]
    core = WorkerCore(runners)  # the default: no delay
    serve_queued(core, [Run(1, x[0:1], (0, 1), 2)])
    assert (core.counts.batches, core.counts.held) == (1, 0)
    core = WorkerCore(runners, batching=Batching(max_rows=8, delay_us=1000))
    q = queue.SimpleQueue()
    q.put(Run(1, x[0:1], (0, 1), 2))
    events = []
    batch, held, ahead = core.gather(q.get(), q)
    assert (len(batch), held, ahead) == (1, 1, None)  # it waited, and nobody came
    q.put(Run(2, x[1:2], (0, 1), 2))
    q.put(Stop())
    core.run(batch, per_request(events.append))
    core.serve(q, per_request(events.append))
    assert [e.req for e in events if type(e) is Done] == [1, 2]


# --------------------------------------------------------------------------------------------
# The predictor on every transport


@pytest.fixture(scope="module")
def ray_instance():
    with local_ray(num_cpus=2):
        yield


def make(tiny_artifact, backend, request, **kw):
    if backend == "ray":
        request.getfixturevalue("ray_instance")
        kw.setdefault("ray_cpus", 0.3)
    return build_predictor(tiny_artifact,
                           GatewaySettings(backend=backend, device="cpu", deadline_s=30, **kw))


def batching(pred, requests: int) -> dict:
    """The workers' batching counters once every worker has reported its part of ``requests``
    requests (a request's answer can come before the worker's last word on it)."""
    wait_until(lambda: pred.pool.counters()["batching"]["requests"] == 5 * requests, 30,
               "the workers' counters")
    return pred.pool.counters()["batching"]


def gather(pred, xs, **kw):
    async def go():
        return await asyncio.gather(*[pred.predict(x[None], **kw) for x in xs],
                                    return_exceptions=True)

    return asyncio.run(go())


@pytest.mark.parametrize("backend", ["local", "processes",
                                     pytest.param("ray", marks=pytest.mark.slow)])
def test_concurrent_requests_are_batched_and_answer_as_alone(backend, tiny_artifact, images,
                                                             request):
    pred = make(tiny_artifact, backend, request)
    try:
        alone = predict_all(pred, images["x"])
        c = batching(pred, N)
        # One request at a time: every batch of one, none held back.
        assert c["batches"] == c["requests"] == 5 * N and c["largest"] == 1 and c["held"] == 0
        # Whether requests queue up is the scheduler's call: a few rounds of all at once.
        for rounds in range(1, 6):
            together = gather(pred, list(images["x"]) * 2)
            for i, p in enumerate(together):
                np.testing.assert_allclose(p.scores, alone[i % N].scores, atol=1e-5)
                np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=ATOL)
            c = batching(pred, N + 2 * N * rounds)
            if c["largest"] > 1:
                break
        assert c["largest"] > 1 and c["batches"] < c["requests"], c
        assert c["held"] == 0  # without a delay nobody waits for company
        per_worker = [w["batching"] for w in pred.describe()["workers"]]
        assert sum(w["requests"] for w in per_worker) == c["requests"]
        assert pred.describe()["batching"] == {"max_rows": 8, "delay_us": 0.0}
    finally:
        pred.shutdown()


def test_a_failing_or_expiring_request_fails_alone(tiny_artifact, images, request):
    # A delay long enough that everything sent at once shares batches.
    pred = make(tiny_artifact, "local", request, batch_max_rows=64, batch_delay_us=200_000)
    try:
        xs = [x[None] for x in images["x"]]
        wrong = images["x"][:1, :, :27, :27]

        async def go():
            calls = [pred.predict(x) for x in xs[:8]]
            calls.append(pred.predict(wrong))
            now = asyncio.get_running_loop().time()
            calls.append(pred.predict(xs[8], deadline=now))  # expires as it is sent
            calls += [pred.predict(x) for x in xs[9:16]]
            return await asyncio.gather(*calls, return_exceptions=True)

        res = asyncio.run(go())
        assert isinstance(res[8], SubnetFailed), res[8]
        assert isinstance(res[9], SubnetTimeout), res[9]
        good = res[:8] + res[10:]
        for i, p in zip([*range(8), *range(9, 16)], good):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
        # A subnet counts the requests it computed: the 15 good ones always; the expired one,
        # and the one that failed (its other subnets are told to skip it), only where the skip
        # came too late.
        wait_until(lambda: pred.pool.counters()["batching"]["requests"] >= 5 * 15, 30,
                   "the workers' counters")
        c = pred.pool.counters()["batching"]
        assert 5 * 15 <= c["requests"] <= 5 * 17
        assert c["largest"] > 1 and c["held"] > 0  # they did share batches
    finally:
        pred.shutdown()


def test_hedged_copies_are_still_skipped_per_request_inside_batches(tiny_artifact, images,
                                                                    request):
    """A 2 s hedge with no straggler: each batch's copies wait for their groups' answers, which
    come, so no copy is ever computed - one subnet run per group and request."""
    # A delay long enough that everything sent at once shares batches.
    pred = make(tiny_artifact, "local", request, redundancy=1, hedge_ms=2000,
                batch_max_rows=64, batch_delay_us=200_000)
    try:
        res = gather(pred, images["x"])
        for i, p in enumerate(res):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
        assert batching(pred, N)["largest"] > 1
        assert pred.pool.counters()["runs"] == 5 * N
    finally:
        pred.shutdown()


# --------------------------------------------------------------------------------------------
# KServe v2 batches over real HTTP


def v2_body(x: np.ndarray) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "scores"}]}).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


@pytest.mark.slow
def test_v2_batches_go_through_whole_and_share_worker_batches(tiny_artifact, images):
    # A delay long enough that the requests posted at once share the workers' batches.
    server = start_gateway(build_predictor(tiny_artifact, GatewaySettings(
        device="cpu", batch_max_rows=8, batch_delay_us=300_000)))
    x, offline = images["x"], images["offline"]
    cuts = [(0, 3), (3, 4), (4, 6), (6, 16), (16, 17), (17, 20)]  # (6, 16): more than 8 rows

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def post(a, b):
                body, headers = v2_body(np.ascontiguousarray(x[a:b]))
                return await c.post("/v2/models/sensai/infer", content=body, headers=headers)

            return await asyncio.gather(*[post(a, b) for a, b in cuts])

    try:
        for (a, b), r in zip(cuts, asyncio.run(go())):
            assert r.status_code == 200, r.text
            out = {o["name"]: o for o in r.json()["outputs"]}["scores"]
            assert out["shape"] == [b - a, 10]
            np.testing.assert_allclose(np.array(out["data"]).reshape(b - a, 10), offline[a:b],
                                       atol=ATOL)
        def counters():
            workers = httpx.get(f"{server.url}/v1/models").json()["predictor"]["workers"]
            return [w["batching"] for w in workers]

        wait_until(lambda: all(b["requests"] == len(cuts) for b in counters()), 30,
                   "the workers' counters")
        assert max(b["largest"] for b in counters()) > 1
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# Settings and the Triton repository


def test_batch_settings_are_validated_and_reported(tiny_artifact):
    with pytest.raises(SensaiError, match="batch_max_rows must be >= 1"):
        load_settings({"device": "cpu", "batch_max_rows": 0})
    with pytest.raises(SensaiError, match="batch_delay_us must be >= 0"):
        load_settings({"device": "cpu", "batch_delay_us": -1})
    pred = build_predictor(tiny_artifact, GatewaySettings(device="cpu", batch_max_rows=1))
    try:
        assert pred.describe()["batching"] == {"max_rows": 1, "delay_us": 0.0}
        assert all(w["batching"]["max_rows"] == 1 for w in pred.describe()["workers"])
    finally:
        pred.shutdown()


def test_the_triton_repository_turns_on_the_dynamic_batcher(tiny_artifact, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    def config(out, name):
        return text_format.Parse((out / name / "config.pbtxt").read_text(),
                                 model_config_pb2.ModelConfig())

    for backend in ("onnxruntime", "python"):
        out = tmp_path / backend
        for name in export_triton_repo(tiny_artifact, out, backend=backend, max_batch_size=32):
            cfg = config(out, name)
            assert cfg.max_batch_size == 32 and cfg.HasField("dynamic_batching")
            assert cfg.dynamic_batching.max_queue_delay_microseconds == 0  # never delays
    out = tmp_path / "unbatched"
    names = export_triton_repo(tiny_artifact, out, max_batch_size=0)
    assert not config(out, names[0]).HasField("dynamic_batching")

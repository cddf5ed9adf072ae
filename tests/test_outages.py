"""Workers that die or hang, on every backend (worker threads, worker processes, Ray actors):
the same tests, parametrised over the backends, through the real gateway on 127.0.0.1 with the
real ONNX subnets of ``tiny_artifact`` and real Fashion-MNIST images.

* without redundancy a dead worker's classes get a JSON 503 naming them (or a flagged partial
  answer when asked for), readiness turns false, and the worker comes back;
* with redundancy a killed worker loses no request and rejoins;
* a hung worker (alive, answering nothing) is ended and restarted by the watchdog, readiness
  follows, and ``sensai serve`` still exits promptly on SIGTERM;
* a killed worker process with requests in flight is restarted exactly once and every failed
  request gets a JSON 503.
No timing thresholds on the answers: only the order of events is asserted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import numpy as np
import pytest

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor
from tests.helpers import (free_port, local_ray, offline_scores, png, sample_images, server_process,
                           start_gateway, stop_server, wait_for_server, wait_until)

pytestmark = pytest.mark.slow  # workers are started, killed and restarted for real

N = 6
BACKENDS = ("local", "processes", "ray")


@pytest.fixture(scope="module")
def images(fmnist_test, fmnist_spec, tiny_artifact):
    _, u8, _ = sample_images(fmnist_test, N, seed=5)
    return {"x": normalize(u8, fmnist_spec).numpy(), "png": [png(u8[i]) for i in range(N)],
            "offline": offline_scores(tiny_artifact, u8, fmnist_spec)}


@pytest.fixture(scope="module")
def lost(tiny_artifact, fmnist_spec):
    """Worker 1 hosts group 1 (r = 0): the classes lost with it, and every group."""
    groups = load_artifact(tiny_artifact).groups
    return groups, [fmnist_spec.classes[c] for c in groups[1]]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    if request.param == "ray":
        with local_ray(num_cpus=2):
            yield "ray"
    else:
        yield request.param


def make(tiny_artifact, backend, **kw):
    if backend == "ray":
        kw.setdefault("ray_cpus", 0.15)
    return build_predictor(tiny_artifact, GatewaySettings(backend=backend, device="cpu", **kw))


def test_r0_dead_worker_gives_503_naming_classes_then_recovers(backend, tiny_artifact, images,
                                                               lost):
    groups, lost_names = lost
    # The restart delay keeps the outage open long enough to look at it.
    pred = make(tiny_artifact, backend, deadline_s=30, restart_delay_s=4.0)
    server = start_gateway(pred, deadline_s=30)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            info = c.get("/v1/models").json()["predictor"]
            assert info["redundancy"] == 0 and info["placement"] == [[0], [1], [2], [3], [4]]
            r = c.post("/v1/predict", content=images["png"][0])
            assert r.status_code == 200, r.text
            assert r.json()["degraded"] is False
            assert r.json()["answered_by"]["subnet_01"] == "worker_01"

            pred.pool.kill(1)
            wait_until(lambda: pred.pool.states()[1] != "up", 60, "the death to be noticed")
            r = c.post("/v1/predict", content=images["png"][0])
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/json")
            err = r.json()
            assert err["missing_classes"] == lost_names and err["subnet"] == "subnet_01"
            assert all(name in err["error"] for name in lost_names) and "worker_01" in err["error"]
            assert c.get("/v2/health/ready").status_code == 503

            r = c.post("/v1/predict", params={"allow_partial": "true", "top_k": 10},
                       content=images["png"][0])
            assert r.status_code == 200, r.text
            part = r.json()
            assert part["degraded"] is True and part["missing_classes"] == lost_names
            covered = [k for g in (0, 2, 3, 4) for k in groups[g]]
            assert sorted(part["covered_classes"]) == sorted(covered)
            assert {p["index"] for p in part["predictions"]} == set(covered)
            assert sum(p["score"] for p in part["predictions"]) == pytest.approx(1, abs=1e-4)
            assert "subnet_01" not in part["answered_by"]

            # The same over KServe v2: 503 by default, a flagged partial answer when asked.
            x = images["x"][:1]
            v2 = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                              "data": x.ravel().tolist()}],
                  "outputs": [{"name": "scores"}, {"name": "class_index"},
                              {"name": "scores", "parameters": {"classification": 10}}]}
            r = c.post("/v2/models/sensai/infer", json=v2)
            assert r.status_code == 503 and r.json()["missing_classes"] == lost_names, r.text
            r = c.post("/v2/models/sensai/infer", json={**v2, "parameters": {"allow_partial": 1}})
            assert r.status_code == 400 and "allow_partial" in r.json()["error"]
            r = c.post("/v2/models/sensai/infer",
                       json={**v2, "parameters": {"allow_partial": True}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["parameters"]["degraded"] is True
            assert json.loads(body["parameters"]["missing_classes"]) == lost_names
            assert sorted(json.loads(body["parameters"]["covered_classes"])) == sorted(covered)
            scores, index, ranking = body["outputs"]
            assert index["data"][0] in covered
            assert all(scores["data"][k] == 0 for k in groups[1])
            assert {int(e.split(":")[1]) for e in ranking["data"]} == set(covered)

            assert pred.pool.wait_until_up(1, 120)
            assert c.get("/v2/health/ready").status_code == 200
            for i in range(3):
                r = c.post("/v1/predict", content=images["png"][i])
                assert r.status_code == 200, r.text
                assert r.json()["degraded"] is False
                assert r.json()["answered_by"]["subnet_01"] == "worker_01"
                assert r.json()["index"] == int(np.argmax(images["offline"][i]))
            w = pred.describe()["workers"][1]
            assert w["deaths"] == 1 and w["restarts"] == 1
    finally:
        server.stop()


def test_r1_killed_worker_loses_no_request_and_rejoins(backend, tiny_artifact, images):
    pred = make(tiny_artifact, backend, redundancy=1, deadline_s=30, restart_delay_s=1.0)
    victim = pred.workers[3]
    old_pid = victim.handle.pid
    seen = []

    async def stream():
        # Paced requests from before the kill until N requests after the worker is back up.
        i, saw_down, back_at = 0, False, None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (back_at is None or i < back_at + N):
            before = victim.state.value
            task = asyncio.ensure_future(pred.predict(images["x"][i % N][None]))
            if i == 3:
                await asyncio.sleep(0)  # dispatched to every worker; now one dies
                pred.pool.kill(3)
            p = await task
            after = victim.state.value
            seen.append((before, after, p))
            saw_down = saw_down or "up" not in (before, after)
            if saw_down and back_at is None and after == "up":
                back_at = i
            i += 1
            await asyncio.sleep(0.02)

    try:
        asyncio.run(stream())
        for i, (_, _, p) in enumerate(seen):
            assert not p.degraded
            np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=1e-4)
        # Requests went out while it was down, and its group was answered by the copy.
        during = [p for before, after, p in seen if before != "up" and after != "up"]
        assert during, "the killed worker was never seen down"
        assert all(p.answered_by["subnet_03"] == "worker_02" for p in during)
        assert pred.pool.wait_until_up(3, 120), pred.describe()["workers"][3]
        w = pred.describe()["workers"][3]
        assert w["deaths"] == 1 and w["restarts"] == 1
        if backend != "local":
            assert w["pid"] != old_pid  # a new process (Ray: the same actor, restarted)
        runs0 = victim.runs
        async def again():
            return [await pred.predict(x[None]) for x in images["x"]]
        for i, p in enumerate(asyncio.run(again())):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=1e-4)
        wait_until(lambda: victim.runs > runs0, 30, "the restarted worker to compute")
    finally:
        pred.shutdown()


def test_hung_worker_is_restarted_and_readiness_follows(backend, tiny_artifact, images):
    """Worker 1 gets stuck (alive, answering nothing): the request fails at its deadline, the
    watchdog ends and restarts the worker, readiness is false meanwhile, then all is well."""
    # The deadline (1 s) passes before the watchdog gives up on the worker (twice the
    # deadline, at least 10 s).
    pred = make(tiny_artifact, backend, deadline_s=1.0, restart_delay_s=2.0)
    assert pred.plan.settings.hang_timeout() == 10.0
    server = start_gateway(pred, deadline_s=1.0)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            generation = pred.workers[1].handle.generation
            pred.pool.inject(1, delay="hang")
            r = c.post("/v1/predict", content=images["png"][0])
            assert r.status_code == 504, r.text
            assert r.json()["subnet"] == "subnet_01" and "deadline" in r.json()["error"]
            wait_until(lambda: pred.pool.states()[1] != "up", 60, "the hang to be noticed")
            assert c.get("/v2/health/ready").status_code == 503
            pred.pool.inject(1, delay=None)  # the restarted worker is healthy
            assert pred.pool.wait_until_up(1, 120)
            assert pred.workers[1].handle.generation > generation
            assert c.get("/v2/health/ready").status_code == 200
            r = c.post("/v1/predict", content=images["png"][1])
            assert r.status_code == 200, r.text
            assert r.json()["index"] == int(np.argmax(images["offline"][1]))
            w = pred.describe()["workers"][1]
            assert w["restarts"] == 1 and w["deaths"] == 1
    finally:
        server.stop()


def test_sigterm_exits_within_the_grace_period_with_a_hung_worker(backend, tiny_artifact,
                                                                  images):
    port = free_port()
    argv = [sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--backend", backend,
            "--port", str(port), "--device", "cpu", "--deadline", "1", "--inject-delay",
            "1=hang", "--log-level", "warning"]
    if backend == "ray":
        import ray

        argv += ["--ray-address", ray.get_runtime_context().gcs_address, "--set", "ray_cpus=0.1"]
    with server_process(argv) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=180)
        r = httpx.post(f"{url}/v1/predict", content=images["png"][0], timeout=30)
        assert r.status_code == 504, r.text
        # uvicorn's grace period is 10 s and every worker stop waits at most 5 s.
        assert stop_server(proc, timeout_s=30) == 0, proc.stderr.read().decode()[-2000:]


def test_killed_worker_process_with_5_requests_in_flight(tiny_artifact, images):
    """Five requests wait on worker 1 when its process is SIGKILLed: exactly one restart, and
    every request that fails gets a JSON 503 naming the lost classes (never a 500 or text)."""
    pred = build_predictor(tiny_artifact,
                           GatewaySettings(backend="processes", device="cpu", deadline_s=30))
    server = start_gateway(pred, deadline_s=30)
    try:
        pred.pool.inject(1, delay="fixed:2s")  # the five requests queue on worker 1

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                tasks = [asyncio.ensure_future(c.post("/v1/predict", content=images["png"][i]))
                         for i in range(5)]
                await asyncio.to_thread(wait_until, lambda: len(pred.workers[1].pending) == 5,
                                        30, "five requests in flight on worker 1")
                pred.pool.kill(1)
                return await asyncio.gather(*tasks)

        responses = asyncio.run(burst())
        pred.pool.inject(1, delay=None)
        assert [r.status_code for r in responses] == [503] * 5
        for r in responses:
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["subnet"] == "subnet_01" and r.json()["missing_classes"]
        assert pred.pool.wait_until_up(1, 120)
        time.sleep(1.0)  # any second restart would have begun by now
        w = pred.describe()["workers"][1]
        assert w["deaths"] == 1 and w["restarts"] == 1
        r = httpx.post(f"{server.url}/v1/predict", content=images["png"][0], timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()

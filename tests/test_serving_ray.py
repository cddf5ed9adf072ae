"""Ray Serve: deploy/ray-serve.yaml deployed with the real ``serve run`` CLI onto a real local
Ray instance, then called over HTTP on 127.0.0.1 - predictions equal offline evaluation's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.errors import SensaiError
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.serve_app import RayAppArgs, build_app, worker_plan
from tests.helpers import free_port, local_ray, offline_scores, png, sample_images, wait_until

ROOT = Path(__file__).resolve().parents[1]
RAY_SERVE_YAML = ROOT / "deploy" / "ray-serve.yaml"
KUBERAY_YAML = ROOT / "deploy" / "kuberay-rayservice.yaml"


def test_deploy_configs_follow_ray_serve_schema():
    import ray
    from ray.serve.schema import ServeDeploySchema

    local = ServeDeploySchema.model_validate(yaml.safe_load(RAY_SERVE_YAML.read_text()))
    kuberay = next(yaml.safe_load_all(KUBERAY_YAML.read_text()))
    assert kuberay["apiVersion"] == "ray.io/v1" and kuberay["kind"] == "RayService"
    assert kuberay["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    k8s = ServeDeploySchema.model_validate(yaml.safe_load(kuberay["spec"]["serveConfigV2"]))
    for cfg in (local, k8s):
        (app,) = cfg.applications
        assert app.import_path == "sensai.serving.launch.serve_app:build_app"
        RayAppArgs(**app.args)  # the args the builder will receive are valid


def test_kuberay_exposes_only_the_serving_port():
    docs = list(yaml.safe_load_all(KUBERAY_YAML.read_text()))
    service, policy = docs
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports == {"serve": 8000}
    label = {"app.kubernetes.io/part-of": "sensai"}
    # The policy selects a label the pods really carry (head and every worker group).
    assert head["metadata"]["labels"] == label
    assert all(w["template"]["metadata"]["labels"] == label for w in cluster["workerGroupSpecs"])
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["podSelector"]["matchLabels"] == label
    open_rule, internal_rule, operator_rule = policy["spec"]["ingress"]
    assert open_rule == {"ports": [{"port": 8000}]}  # the only port open to everyone
    assert "ports" not in internal_rule and internal_rule["from"] == [{"podSelector": {
        "matchLabels": label}}]
    # The operator reaches the dashboard (serveConfigV2 goes through it), and nothing else.
    assert [p["port"] for p in operator_rule["ports"]] == [8265, 52365]
    assert operator_rule["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kuberay-operator"}


def test_build_app_rejects_bad_args(tiny_artifact, tmp_path):
    with pytest.raises(SensaiError, match="artifact"):
        build_app({})
    with pytest.raises(SensaiError, match="colour"):
        build_app({"artifact": str(tiny_artifact), "colour": "red"})
    with pytest.raises(SensaiError, match="auto, cpu or cuda"):
        build_app({"artifact": str(tiny_artifact), "settings": {"device": "mps"}})
    with pytest.raises(SensaiError, match="settings.ray_cpus"):
        build_app({"artifact": str(tiny_artifact), "settings": {"ray_cpus": 0}})
    with pytest.raises(SensaiError, match="unknown setting 'redundnacy'"):  # not ignored
        build_app({"artifact": str(tiny_artifact), "settings": {"redundnacy": 1}})
    with pytest.raises(SensaiError, match="does not exist"):
        build_app({"artifact": str(tmp_path / "none")})
    with pytest.raises(SensaiError, match="deadline_s"):
        build_app({"artifact": str(tiny_artifact), "settings": {"deadline_s": -1}})
    with pytest.raises(SensaiError, match="r\\+1 = 6"):
        build_app({"artifact": str(tiny_artifact), "settings": {"redundancy": 5}})
    # The gateway's connection limits hold on the ingress's own port, not behind Serve's proxy.
    for name in ("max_connections", "max_connections_per_client"):
        with pytest.raises(SensaiError, match=f"SENSAI_{name.upper()} does not apply .* proxy"):
            build_app({"artifact": str(tiny_artifact), "settings": {name: 10}})
    build_app({"artifact": str(tiny_artifact), "own_port": True,
               "settings": {"max_connections": 10}})
    with pytest.raises(SensaiError, match="grpc_port|GRPC_PORT"):
        build_app({"artifact": str(tiny_artifact), "own_port": True,
                   "settings": {"grpc_port": 9001}})


def bound(app):
    """The deployment an application binds (Serve has no public accessor for it) and its
    constructor's arguments."""
    d = app._bound_deployment
    return d, d.init_args


def test_the_settings_reach_the_serve_apps_workers_and_ingress(tiny_artifact):
    """Settings given under ``args.settings`` are the ones the Serve application runs with:
    redundancy 1 places every group on two worker deployments, and the ingress plans the same
    placement from its bound arguments; the host tuning reaches every worker replica; the
    ingress takes as many requests as the gateway admits (it refuses the rest itself)."""
    app = build_app({"artifact": str(tiny_artifact),
                     "settings": {"redundancy": 1, "deadline_s": 7, "ray_cpus": 0.5,
                                  "keep_cores_awake": "auto", "gateway_replicas": 3}})
    ingress, (workers, artifact, settings, own_port) = bound(app)
    # An ingress replica takes a worker's CPUs, at most one.
    assert ingress.num_replicas == 3 and ingress.ray_actor_options["num_cpus"] == 0.5
    assert own_port is False  # only through Serve's proxy unless asked
    assert ingress.name == "ServeIngress"
    # Three gateway processes share the workers: each admits a third of max_predictions.
    assert settings["max_predictions"] == 11
    assert ingress.max_ongoing_requests == 2 * 11 + 8 and ingress.max_queued_requests == 16
    assert not ingress.logging_config["enable_access_log"]  # the gateway's metrics count
    assert settings["redundancy"] == 1 and settings["deadline_s"] == 7
    hosted = []
    for w, worker in enumerate(workers):
        d, (name, specs, seed, keep_awake) = bound(worker)
        assert name == d.name == f"worker_{w:02d}" and keep_awake == "auto"
        assert d.ray_actor_options["num_cpus"] == 0.5
        hosted.append([g for g, _ in specs])
    assert hosted == [[w, (w + 1) % 5] for w in range(5)]  # cyclic, r = 1
    # The ingress plans its predictor by the same rule from its own bound arguments.
    plan = worker_plan(load_artifact(artifact), GatewaySettings(**settings))
    assert plan.placement.redundancy == 1 and [list(h) for h in plan.placement.workers] == hosted
    assert [list(w.groups) for w in plan.workers] == hosted and len(plan.workers) == 5
    assert plan.settings.keep_cores_awake == "auto" and plan.hang_timeout_s is None


@pytest.fixture(scope="module")
def ray_app_urls(tiny_artifact, tmp_path_factory):
    """Ray on 2 CPUs; the YAML (artifact and ports filled in, redundancy 1, two ingress
    replicas) deployed with `serve run`: the application's URL through Serve's proxy, and on
    the ingress replicas' own port."""
    from ray import serve

    port, own = free_port(), free_port()
    cfg = yaml.safe_load(RAY_SERVE_YAML.read_text())
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    args = cfg["applications"][0]["args"]
    assert args["own_port"] is True
    args["artifact"] = str(tiny_artifact)
    # A worker may die (redundancy 1); two gateway processes share the own port.
    args["settings"] |= {"redundancy": 1, "host": "127.0.0.1", "port": own,
                         "gateway_replicas": 2}
    config = tmp_path_factory.mktemp("ray") / "ray-serve.yaml"
    config.write_text(yaml.safe_dump(cfg))

    with local_ray(num_cpus=2) as gcs:
        serve_cli = Path(sys.executable).parent / "serve"
        proc = subprocess.run([str(serve_cli), "run", "--address", gcs, "--non-blocking",
                               str(config)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"Serve app not ready: {serve.status()}"
                time.sleep(1)
            yield {"proxy": url, "own port": f"http://127.0.0.1:{own}"}
        finally:
            serve.shutdown()


@pytest.fixture(scope="module")
def ray_gateway(ray_app_urls):
    return ray_app_urls["proxy"]


ROUTES = ["proxy", "own port"]


def test_the_ingress_replicas_share_their_own_port(ray_app_urls):
    """Two ingress replicas, two processes, listen on the same port (SO_REUSEPORT): new
    connections reach both, each with its own predictor over the same worker replicas."""
    pids, predictors = set(), set()
    for _ in range(24):  # a new connection each time: the kernel picks the replica
        info = httpx.get(f"{ray_app_urls['own port']}/v1/models", timeout=30).json()
        pids.add(info["pid"])
        predictors.add(tuple(str(w["channel"]) for w in info["predictor"]["workers"]))
        assert all(w["state"] == "up" for w in info["predictor"]["workers"])
    assert len(pids) == 2 and len(predictors) == 2, (pids, predictors)


@pytest.mark.parametrize("route", ROUTES)
def test_ray_http_predictions_equal_offline(ray_app_urls, route, tiny_artifact, fmnist_test,
                                            fmnist_spec):
    _, images, _ = sample_images(fmnist_test, 10)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    with httpx.Client(base_url=ray_app_urls[route], timeout=60) as c:
        for i in range(len(images)):
            r = c.post("/v1/predict", params={"top_k": 10},
                       files={"image": ("x.png", png(images[i]), "image/png")})
            assert r.status_code == 200, r.text
            got = {p["index"]: p["score"] for p in r.json()["predictions"]}
            np.testing.assert_allclose([got[k] for k in range(10)], expected[i], atol=2e-5)
            assert {f"subnet_{k:02d}" for k in range(5)} <= set(r.json()["timings_ms"])
        info = c.get("/v1/models").json()["predictor"]
        assert info["backend"] == "ray-serve" and len(info["workers"]) == 5
        assert info["transport"]["deployments"] == 5
        assert all(w["state"] == "up" for w in info["workers"])


def post_images(url: str, images, concurrency: int, *, seconds: float = 0.0
                ) -> list[tuple[int, int, dict]]:
    """``images`` as PNG uploads with ``concurrency`` in flight (again and again for
    ``seconds``, else once each): (image, status, JSON answer) per request."""
    import asyncio
    import itertools

    bodies = [png(im) for im in images]

    async def run():
        got = []
        jobs = itertools.count() if seconds else iter(range(len(bodies)))
        end = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            async def loop():
                for j in jobs:
                    if seconds and time.monotonic() > end:
                        return
                    i = j % len(bodies)
                    r = await c.post("/v1/predict", params={"top_k": 10}, content=bodies[i])
                    got.append((i, r.status_code, r.json()))
            await asyncio.gather(*(loop() for _ in range(concurrency)))
        return got

    return asyncio.run(run())


def assert_offline(got, expected) -> None:
    for i, status, body in got:
        assert status == 200, body
        scores = {p["index"]: p["score"] for p in body["predictions"]}
        np.testing.assert_allclose([scores[k] for k in range(10)], expected[i], atol=2e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_ray_serve_answers_16_concurrent_requests_as_offline(ray_app_urls, route, tiny_artifact,
                                                             fmnist_test, fmnist_spec):
    """16 requests in flight at once through Serve's proxy or the ingress's own port, the
    ingress and the workers' sockets: every answer is offline evaluation's, and the workers
    batched some of them."""
    url = ray_app_urls[route]
    _, images, _ = sample_images(fmnist_test, 32)
    got = post_images(url, images, 16)
    assert len(got) == len(images) >= 16
    assert_offline(got, offline_scores(tiny_artifact, images, fmnist_spec))
    workers = httpx.get(f"{url}/v1/models", timeout=30).json()["predictor"]["workers"]
    assert all(w["transport"] == "ray-serve" and w["channel"] for w in workers)
    assert sum(w["batching"]["batches"] for w in workers) > 0


def workers_of(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["predictor"]["workers"]


@pytest.mark.parametrize("route", ROUTES)
def test_ray_serve_worker_replica_killed_under_load_costs_no_request(
        ray_app_urls, route, tiny_artifact, fmnist_test, fmnist_spec):
    """Redundancy 1: a worker replica SIGKILLed while 4 requests are always in flight (through
    either route) costs none of them (each group has a copy elsewhere); Serve starts a new
    replica and the ingress reconnects to it over a new socket."""
    import signal
    import threading

    ray_gateway = ray_app_urls[route]

    _, images, _ = sample_images(fmnist_test, 8)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    before = workers_of(ray_gateway)[0]
    assert before["state"] == "up" and before["pid"]
    result = {}
    load = threading.Thread(target=lambda: result.update(
        got=post_images(ray_gateway, images, 4, seconds=6)))
    load.start()
    time.sleep(2)
    os.kill(before["pid"], signal.SIGKILL)
    load.join()
    assert len(result["got"]) > 8
    assert_offline(result["got"], expected)  # every request answered, and right

    def rejoined():
        w = workers_of(ray_gateway)[0]
        return w["state"] == "up" and w["pid"] != before["pid"] and w["restarts"] >= 1

    wait_until(rejoined, 120, "worker_00 back on a new replica")
    after = workers_of(ray_gateway)[0]
    assert after["deaths"] >= 1 and after["channel"] != before["channel"]
    assert_offline(post_images(ray_gateway, images, 1), expected)


@pytest.mark.parametrize("route", ROUTES)
def test_ray_serve_overload_is_answered_200_or_503(ray_app_urls, route, fmnist_test):
    """Far more requests at once than the gateway admits: each is answered, 200 or a 503 with
    Retry-After and a JSON reason; none waits in an unbounded queue, none fails otherwise."""
    import asyncio

    ray_gateway = ray_app_urls[route]

    _, images, _ = sample_images(fmnist_test, 1)
    body = png(images[0])

    async def flood():
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=ray_gateway, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(c.post("/v1/predict", content=body)
                                          for _ in range(400)))

    answers = asyncio.run(flood())
    assert {r.status_code for r in answers} <= {200, 503}
    for r in answers:
        if r.status_code == 503:
            assert r.headers.get("retry-after"), r.headers
    assert httpx.get(f"{ray_gateway}/v2/health/live", timeout=30).status_code == 200


def test_ray_kserve_v2_and_bad_input(ray_gateway, tiny_artifact, fmnist_test, fmnist_spec):
    import tritonclient.http as tc

    _, images, _ = sample_images(fmnist_test, 3)
    x = normalize(images, fmnist_spec).numpy()
    client = tc.InferenceServerClient(ray_gateway.removeprefix("http://"))
    try:
        assert client.is_model_ready("sensai")
        inp = tc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        got = client.infer("sensai", [inp]).as_numpy("scores")
        np.testing.assert_allclose(got, offline_scores(tiny_artifact, images, fmnist_spec),
                                   atol=2e-5)
    finally:
        client.close()
    with httpx.Client(base_url=ray_gateway, timeout=60) as c:
        r = c.post("/v1/predict", content=b"GIF89a broken")
        assert r.status_code in (400, 415) and "image" in r.json()["error"]
        bad = x.copy()
        bad[0, 0, 0, 0] = np.nan
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(bad.shape),
                            "data": bad.ravel().tolist()}]}
        r = c.post("/v2/models/sensai/infer", content=json.dumps(body))
        assert r.status_code == 400 and "NaN" in r.json()["error"]
        r = c.post("/v2/models/other/infer", content=json.dumps(body))
        assert r.status_code == 404 and "unknown model" in r.json()["error"]
        r = c.post("/v1/predict", content=png(images[0]))
        assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.parametrize("cpus", [1, 2])
def test_sensai_serve_backend_ray_starts_with_default_flags_on_1_and_2_cpus(
        cpus, tiny_artifact, fmnist_test, fmnist_spec):
    """`sensai serve ART --backend ray` with no resource flags on a Ray instance of 1 or 2 CPUs
    (five worker actors): every worker gets a share that fits, the gateway becomes ready and
    answers as offline evaluation does, and SIGTERM stops it."""
    import signal

    from tests.helpers import wait_for_server

    _, images, _ = sample_images(fmnist_test, 3)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    with local_ray(num_cpus=cpus) as gcs:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                                 "--backend", "ray", "--ray-address", gcs, "--port", str(port),
                                 "--log-level", "warning"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_server(proc, url, timeout_s=240)
            with httpx.Client(base_url=url, timeout=60) as c:
                assert c.get("/v2/health/ready").status_code == 200
                for i in range(len(images)):
                    r = c.post("/v1/predict", params={"top_k": 10}, content=png(images[i]))
                    assert r.status_code == 200, r.text
                    got = {p["index"]: p["score"] for p in r.json()["predictions"]}
                    np.testing.assert_allclose([got[k] for k in range(10)], expected[i],
                                               atol=2e-5)
                workers = c.get("/v1/models").json()["predictor"]["workers"]
            assert len(workers) == 5 and all(w["state"] == "up" for w in workers)
            assert sum(w["resources"]["num_cpus"] for w in workers) <= cpus + 1e-9
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_serve_worker_that_cannot_read_the_artifact_names_its_node(tiny_artifact, tmp_path):
    """A Serve replica on a node where the artifact's path holds no file refuses to start with
    an error that names the worker, its node id and its address."""
    import shutil
    from dataclasses import asdict

    from sensai.artifact import load_artifact
    from sensai.serving.launch.serve_app import SubnetWorker
    from sensai.serving.workers.runners import runner_specs

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    spec = runner_specs(load_artifact(art), device="cpu")[0]
    shutil.rmtree(art)  # this "node" has no copy of the artifact
    with local_ray(num_cpus=1):
        import ray

        node = ray.get_runtime_context().get_node_id()
        with pytest.raises(SensaiError) as e:
            SubnetWorker.func_or_class("worker_00", [(0, asdict(spec))], 0)
    assert f"worker_00 on node {node} (127.0.0.1)" in str(e.value), str(e.value)



PLACE_NOTHING = """
import time
from ray import serve
from sensai.errors import SensaiError
from sensai.serving.launch.serve_run import deploy
from tests.helpers import local_ray

@serve.deployment(ray_actor_options={"num_cpus": 2})
class TooBig:
    def __call__(self, request):
        return "never"

with local_ray(num_cpus=1):
    serve.start(proxy_location="Disabled")
    t0 = time.monotonic()
    try:
        deploy(TooBig.bind(), "toobig", 3.0)
    except SensaiError as e:
        print("REFUSED", round(time.monotonic() - t0), e)
    serve.shutdown()
"""


def test_an_application_the_cluster_cannot_place_is_refused_after_the_timeout():
    """``serve.run`` waits for every replica however long: one asking for more CPUs than any
    node has would hang ``sensai serve`` for ever; it is refused, saying what Serve says.  In
    a process of its own: the abandoned ``serve.run`` thread must not outlive it."""
    proc = subprocess.run([sys.executable, "-c", PLACE_NOTHING], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REFUSED")), "")
    assert "not running after 3 s (" in line and "TooBig" in line, proc.stdout + proc.stderr
    assert int(line.split()[1]) < 30

"""Ray Serve: deploy/ray-serve.yaml deployed with the real ``serve run`` CLI onto a real local
Ray instance, then called over HTTP on 127.0.0.1 - predictions equal offline evaluation's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from sensai.data import normalize
from sensai.errors import SensaiError
from sensai.serving.ray_app import RayAppArgs, build_app
from tests.helpers import free_port, local_ray, offline_scores, png, sample_images

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
        assert app.import_path == "sensai.serving.ray_app:build_app"
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
    with pytest.raises(SensaiError, match="does not exist"):
        build_app({"artifact": str(tmp_path / "none")})
    with pytest.raises(SensaiError, match="deadline_s"):
        build_app({"artifact": str(tiny_artifact), "settings": {"deadline_s": -1}})
    with pytest.raises(SensaiError, match="r\\+1 = 6"):
        build_app({"artifact": str(tiny_artifact), "settings": {"redundancy": 5}})


def bound(app):
    """The deployment an application binds (Serve has no public accessor for it) and its
    constructor's arguments."""
    d = app._bound_deployment
    return d, d.init_args


def test_the_settings_reach_the_serve_apps_workers_and_ingress(tiny_artifact):
    """Settings given under ``args.settings`` are the ones the Serve application runs with:
    redundancy 1 places every group on two worker deployments, and the ingress that Serve
    would build from its bound arguments runs its predictor with that placement; the host
    tuning reaches every worker replica."""
    app = build_app({"artifact": str(tiny_artifact),
                     "settings": {"redundancy": 1, "deadline_s": 7, "ray_cpus": 0.5,
                                  "keep_cores_awake": "auto"}})
    ingress, (workers, artifact, settings) = bound(app)
    assert ingress.name == "ServeIngress"
    assert settings["redundancy"] == 1 and settings["deadline_s"] == 7
    hosted = []
    for w, worker in enumerate(workers):
        d, (name, specs, seed, keep_awake) = bound(worker)
        assert name == d.name == f"worker_{w:02d}" and keep_awake == "auto"
        assert d.ray_actor_options["num_cpus"] == 0.5
        hosted.append([g for g, _ in specs])
    assert hosted == [[w, (w + 1) % 5] for w in range(5)]  # cyclic, r = 1
    # The ingress's own constructor (beneath Serve's ASGI wrapper) on its bound arguments, as a
    # replica runs it; its handles are never called here.
    cls = next(c for c in ingress.func_or_class.__mro__
               if "__serve_build_asgi_app__" in vars(c))
    replica = cls.__new__(cls)
    cls.__init__(replica, workers, artifact, settings)
    try:
        p = replica.predictor
        assert p.placement.redundancy == 1 and [list(h) for h in p.placement.workers] == hosted
        assert p.deadline_s == 7 and replica.settings.keep_cores_awake == "auto"
    finally:
        p.shutdown()


@pytest.fixture(scope="module")
def ray_gateway(tiny_artifact, tmp_path_factory):
    """Ray on 2 CPUs; the YAML (artifact and port filled in) deployed with `serve run`."""
    from ray import serve

    port = free_port()
    cfg = yaml.safe_load(RAY_SERVE_YAML.read_text())
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    cfg["applications"][0]["args"]["artifact"] = str(tiny_artifact)
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
            yield url
        finally:
            serve.shutdown()


def test_ray_http_predictions_equal_offline(ray_gateway, tiny_artifact, fmnist_test, fmnist_spec):
    _, images, _ = sample_images(fmnist_test, 10)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    with httpx.Client(base_url=ray_gateway, timeout=60) as c:
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
    from sensai.serving.ray_app import SubnetWorker
    from sensai.serving.runners import runner_specs

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

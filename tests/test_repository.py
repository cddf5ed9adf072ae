"""The model repository: versions loaded, swapped and unloaded while the gateway serves, over
real HTTP and gRPC on 127.0.0.1, with every answer checked against offline evaluation of the
version it names."""

from __future__ import annotations

import gc
import json
import re
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from sensai.errors import SensaiError
from sensai.serving.core.faults import Faults
from sensai.serving.core.repository import VersionPolicy, add_version, versions
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.gateway.app import create_app
from sensai.serving.gateway.repository_api import check_access
from sensai.serving.gateway.served import ServedModels
from sensai.serving.gateway.server import BackgroundServer
from sensai.serving.launch.build import build_predictor

from .helpers import (free_port, offline_scores, png, sample_images, server_process, stop_server,
                      wait_for_server, wait_until)

MODEL = "fmnist"


def gateway(repo: Path, *, delays=None, **settings) -> BackgroundServer:
    s = GatewaySettings(**{"model_control": "explicit", "deadline_s": 10, **settings})

    def loader(name, path):
        return build_predictor(path, GatewaySettings(backend="local", device="cpu",
                                                     model_name=name, deadline_s=s.deadline_s),
                               faults=Faults.of(delays=delays))

    models = ServedModels(s, loader=loader, repository=repo,
                          policy=VersionPolicy.parse(s.version_policy))
    return BackgroundServer(create_app(models, s))  # started by `with`


@pytest.fixture(scope="module")
def images(fmnist_test):
    _, xs, _ = sample_images(fmnist_test, 8)
    return xs


@pytest.fixture(scope="module")
def expected(tiny_artifact, tiny_artifact_g2, images, fmnist_spec):
    """Offline evaluation's scores of each artifact, by its folder."""
    return {a: offline_scores(a, images, fmnist_spec) for a in (tiny_artifact, tiny_artifact_g2)}


def scores_of(body: dict) -> np.ndarray:
    row = np.zeros(len(body["predictions"]))
    for p in body["predictions"]:
        row[p["index"]] = p["score"]
    return row


def test_a_swap_under_load_loses_no_request_and_each_answer_is_its_versions(
        tmp_path, tiny_artifact, tiny_artifact_g2, images, expected):
    """Four clients send real images while versions 2 (G=2) and 3 (G=5) are swapped in: no
    error, each client sees the versions in order, every answer equals offline evaluation of
    the version it names, and only the last version is left loaded."""
    repo = tmp_path / "repo"
    source = {1: tiny_artifact}
    add_version(repo, MODEL, tiny_artifact)
    pngs = [png(x) for x in images]
    with gateway(repo) as server:
        stop, answers, errors = threading.Event(), [], []

        def client(k: int) -> list[tuple[str, int, dict]]:
            seen = []
            with httpx.Client(base_url=server.url, timeout=30) as c:
                i = k
                while not stop.is_set():
                    r = c.post("/v1/predict", params={"top_k": 10}, content=pngs[i % len(pngs)])
                    if r.status_code != 200:
                        errors.append((r.status_code, r.text))
                    else:
                        seen.append((r.json()["model_version"], i % len(pngs), r.json()))
                    i += 1
            return seen

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client, k) for k in range(4)]
            for version, artifact in ((2, tiny_artifact_g2), (3, tiny_artifact)):
                time.sleep(0.5)
                assert add_version(repo, MODEL, artifact) == version
                source[version] = artifact
                r = httpx.post(f"{server.url}/v2/repository/models/{MODEL}/load", json={},
                               timeout=60)
                assert r.status_code == 200, r.text
            time.sleep(0.5)
            stop.set()
            per_client = [f.result() for f in futures]
        index = httpx.post(f"{server.url}/v2/repository/index", json={}).json()
        info = httpx.get(f"{server.url}/v1/models").json()
    assert errors == []
    for seen in per_client:
        order = [int(v) for v, _, _ in seen]
        assert order == sorted(order), "a client saw an older version after a newer one"
        answers += seen
    assert {v for v, _, _ in answers} == {"1", "2", "3"}
    for version, i, body in answers:
        np.testing.assert_allclose(scores_of(body), expected[source[int(version)]][i],
                                   atol=1e-4, err_msg=f"version {version}, image {i}")
    assert index == [{"name": MODEL, "version": "3", "state": "READY", "reason": ""}]
    assert [(m["name"], m["version"]) for m in info["models"]] == [(MODEL, "3")]
    assert (info["name"], info["version"]) == (MODEL, "3")


def test_a_corrupt_version_is_refused_and_the_old_one_keeps_serving(tmp_path, tiny_artifact,
                                                                     images):
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    bad = repo / MODEL / "2"
    shutil.copytree(repo / MODEL / "1", bad)
    onnx = next((bad / "subnets").glob("*.onnx"))
    data = bytearray(onnx.read_bytes())
    data[-100] ^= 0xFF
    onnx.write_bytes(bytes(data))
    shutil.move(bad, tmp_path / "held")
    with gateway(repo) as server:
        shutil.move(tmp_path / "held", bad)  # as a bad upload would arrive, while serving
        r = httpx.post(f"{server.url}/v2/repository/models/{MODEL}/load", timeout=60)
        assert r.status_code == 400
        assert "sha256" in r.json()["error"] and "version 2" in r.json()["error"]
        r = httpx.post(f"{server.url}/v1/predict", content=png(images[0]))
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        index = httpx.post(f"{server.url}/v2/repository/index").json()
        assert [(m["version"], m["state"]) for m in index] == [("1", "READY"),
                                                               ("2", "UNAVAILABLE")]
        assert "sha256" in index[1]["reason"]


# uvicorn ends its thread with SystemExit when the app's startup fails: that is the point here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_start_with_a_corrupt_version_fails_in_one_line(tmp_path, tiny_artifact):
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    onnx = next((repo / MODEL / "1" / "subnets").glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-10])
    with pytest.raises(SensaiError, match="failed to start|did not start"):
        with gateway(repo):
            pass


def test_unloading_a_model_drains_the_requests_it_holds(tmp_path, tiny_artifact, images):
    """Requests in flight when the unload arrives are all answered by the model; the unload
    returns after them, and later requests are told the model is gone (404)."""
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    with gateway(repo, delays={0: "fixed:400ms"}) as server:
        url = server.url
        with ThreadPoolExecutor(5) as pool:
            inflight = [pool.submit(httpx.post, f"{url}/v1/predict", content=png(x), timeout=30)
                        for x in images[:4]]
            time.sleep(0.15)  # the four are inside the predictor, held by the model
            t0 = time.monotonic()
            unload = pool.submit(httpx.post, f"{url}/v2/repository/models/{MODEL}/unload",
                                 timeout=30)
            answers = [f.result() for f in inflight]
            r = unload.result()
            took = time.monotonic() - t0
        assert [a.status_code for a in answers] == [200] * 4
        assert r.status_code == 200 and took >= 0.2
        after = httpx.post(f"{url}/v1/predict", content=png(images[0]))
        assert after.status_code == 404 and "no model" in after.json()["error"]
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        with ThreadPoolExecutor(1) as pool:  # warming the slow version takes a while
            load = pool.submit(httpx.post, f"{url}/v2/repository/models/{MODEL}/load",
                               timeout=60)
            wait_until(lambda: httpx.post(f"{url}/v2/repository/index").json()[0]["state"]
                       == "LOADING", 30, "the index to say LOADING")
            assert load.result().status_code == 200
        assert httpx.post(f"{url}/v2/repository/index").json()[0]["state"] == "READY"
        assert httpx.post(f"{url}/v1/predict", content=png(images[0])).status_code == 200


def test_a_version_let_go_is_collected_though_the_heap_was_frozen(tmp_path, tiny_artifact,
                                                                  images):
    """The gateway freezes its heap once a version is loaded, so collections skip it; an unload
    gives it back to the collector first, so a version whose objects hold each other (a cycle
    only the collector frees) is freed, not kept for good."""
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    held = []
    s = GatewaySettings(model_control="explicit", deadline_s=10)

    def loader(name, path):
        predictor = build_predictor(path, GatewaySettings(backend="local", device="cpu",
                                                          model_name=name, deadline_s=s.deadline_s))
        predictor.itself = predictor
        held.append(weakref.ref(predictor))
        return predictor

    def full_collections() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r"^sensai_gc_full_collection_seconds_count (\S+)$", text,
                               re.M).group(1))

    models = ServedModels(s, loader=loader, repository=repo)
    with BackgroundServer(create_app(models, s)) as server:
        assert gc.get_freeze_count() > 0
        collected = full_collections()
        assert collected >= 1  # the one before freezing, timed into the gateway's metrics
        assert httpx.post(f"{server.url}/v1/predict", content=png(images[0])).status_code == 200
        r = httpx.post(f"{server.url}/v2/repository/models/{MODEL}/unload", timeout=30)
        assert r.status_code == 200
        assert len(held) == 1
        wait_until(lambda: held[0]() is None, 10, "the unloaded version to be freed")
        assert full_collections() > collected


def test_the_api_is_refused_when_model_control_is_off_or_the_caller_is_not_allowed(
        tmp_path, tiny_artifact):
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    with gateway(repo, model_control="none") as server:
        for path in ("index", f"models/{MODEL}/load", f"models/{MODEL}/unload"):
            r = httpx.post(f"{server.url}/v2/repository/{path}")
            assert r.status_code == 403 and "--model-control" in r.json()["error"]
    token = "s3cret-token-0123456789"
    with gateway(repo, repository_token=token) as server:
        r = httpx.post(f"{server.url}/v2/repository/index")
        assert r.status_code == 401 and "Bearer" in r.json()["error"]
        r = httpx.post(f"{server.url}/v2/repository/index",
                       headers={"Authorization": "Bearer wrong-token-0123456789"})
        assert r.status_code == 401
        r = httpx.post(f"{server.url}/v2/repository/index",
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()[0]["state"] == "READY"
        # A model's name is a folder of the repository, never its parent (a version folder
        # beside the repository, which ".." would otherwise load) or itself.
        shutil.copytree(repo / MODEL / "1", tmp_path / "1")
        for name in ("%2e%2e", "%2e"):
            r = httpx.post(f"{server.url}/v2/repository/models/{name}/load",
                           headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 400 and "not starting with '.'" in r.json()["error"], r.text
    settings = GatewaySettings(model_control="explicit")
    check_access(settings, client="127.0.0.1", authorization=None, changes=True)
    check_access(settings, client="::1", authorization=None, changes=True)
    with pytest.raises(SensaiError, match="loopback clients only"):
        check_access(settings, client="10.1.2.3", authorization=None, changes=False)


def test_poll_mode_follows_the_files(tmp_path, tiny_artifact, tiny_artifact_g2, images):
    """A new version folder is served, a removed model is unloaded; the load API is refused."""
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    with gateway(repo, model_control="poll:0.2") as server:
        url = server.url
        r = httpx.post(f"{url}/v2/repository/models/{MODEL}/load")
        assert r.status_code == 403 and "polled" in r.json()["error"]
        add_version(repo, MODEL, tiny_artifact_g2)

        def version() -> str | None:
            r = httpx.post(f"{url}/v1/predict", content=png(images[0]))
            return r.json().get("model_version") if r.status_code == 200 else None
        wait_until(lambda: version() == "2", 30, "version 2 to be served")
        shutil.rmtree(repo / MODEL)
        wait_until(lambda: httpx.post(f"{url}/v2/repository/index").json()
                   == [], 30, "the model to be unloaded")
        assert httpx.post(f"{url}/v1/predict", content=png(images[0])).status_code == 404


def test_two_models_are_served_side_by_side(tmp_path, tiny_artifact, tiny_artifact_g2, images,
                                            expected):
    repo = tmp_path / "repo"
    add_version(repo, "g5", tiny_artifact)
    add_version(repo, "g2", tiny_artifact_g2)
    (repo / "g2" / "sensai-model.json").write_text(json.dumps({"version_policy": "all"}))
    add_version(repo, "g2", tiny_artifact_g2)
    with gateway(repo) as server:
        url = server.url
        r = httpx.post(f"{url}/v1/predict", content=png(images[0]))
        assert r.status_code == 400 and "g2, g5" in r.json()["error"]
        for name, artifact in (("g5", tiny_artifact), ("g2", tiny_artifact_g2)):
            r = httpx.post(f"{url}/v1/predict", params={"model": name, "top_k": 10},
                           content=png(images[1]))
            assert r.json()["model"] == name
            np.testing.assert_allclose(scores_of(r.json()), expected[artifact][1], atol=1e-4)
        r = httpx.post(f"{url}/v1/predict", params={"model": "g2", "version": "1"},
                       content=png(images[1]))
        assert r.json()["model_version"] == "1"
        meta = httpx.get(f"{url}/v2/models/g2").json()
        assert meta["versions"] == ["1", "2"]
        info = httpx.get(f"{url}/v1/models").json()
        assert info["name"] is None
        assert [(m["name"], m["version"]) for m in info["models"]] == [("g2", "1"), ("g2", "2"),
                                                                         ("g5", "1")]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'sensai_model_ready{model="g2",version="2"} 1.0' in metrics
        assert 'sensai_images_total{model="g5",version="1"} 1.0' in metrics


def test_the_repository_api_over_grpc_and_tritonclient_http(tmp_path, tiny_artifact,
                                                            tiny_artifact_g2, images):
    """Triton's own clients drive the repository: index, load, unload, and each inference names
    the version that answered."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from sensai.data import normalize

    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    with gateway(repo, grpc_port=0) as server:
        port = server.server.config.app.state.grpc.port
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        h = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        x = normalize(images[:1], load_spec(tiny_artifact)).numpy()

        def infer_version() -> str:
            inp = grpcclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            return g.infer(MODEL, [inp]).get_response().model_version

        assert infer_version() == "1"
        assert [(m.name, m.version, m.state) for m in g.get_model_repository_index().models] \
            == [(MODEL, "1", "READY")]
        add_version(repo, MODEL, tiny_artifact_g2)
        g.load_model(MODEL)
        assert infer_version() == "2"
        assert h.get_model_repository_index() == [
            {"name": MODEL, "version": "2", "state": "READY", "reason": ""}]
        h.unload_model(MODEL)
        with pytest.raises(InferenceServerException, match="no model"):
            infer_version()
        h.load_model(MODEL)
        assert h.is_model_ready(MODEL, "2")
        g.unload_model(MODEL)
        assert not h.is_server_ready()
        g.close()
        h.close()


def load_spec(artifact):
    from sensai.artifact import load_artifact

    return load_artifact(artifact).spec


def test_the_cli_serves_and_exports_a_repository(tmp_path, tiny_artifact, images):
    """``sensai export`` writes versions; ``sensai serve REPO`` serves the latest, with its API
    behind a token; what cannot work is refused in one line."""
    repo = tmp_path / "repo"
    sensai = [sys.executable, "-m", "sensai"]
    import subprocess

    out = subprocess.run([*sensai, "export", str(tiny_artifact), "--repository", str(repo),
                          "--model", MODEL], capture_output=True, text=True)
    assert out.returncode == 0 and f"{MODEL}/1" in out.stdout
    out = subprocess.run([*sensai, "export", str(tiny_artifact), "--repository", str(repo),
                          "--model", MODEL, "--version", "1"], capture_output=True, text=True)
    assert out.returncode != 0 and "exists already" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([*sensai, "serve", str(tiny_artifact), "--model-control", "explicit"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "needs a model repository" in out.stderr
    add_version(repo, MODEL, tiny_artifact)
    assert sorted(versions(repo, MODEL)) == [1, 2]
    out = subprocess.run([*sensai, "serve", str(repo), "--backend", "local",
                          "--set", "device_processes=1"], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "sensai serve: error: --set device_processes does not apply here (a model repository's "
        "workers on the local backend run in no device process; use --backend processes)"]
    token = tmp_path / "token"
    token.write_text("a-token-of-enough-length\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*sensai, "serve", str(repo), "--port", str(port), "--device", "cpu",
            "--model-control", "explicit", "--repository-token-file", str(token),
            "--backend", "processes", "--set", "device_processes=1"]
    with server_process(argv) as proc:
        wait_for_server(proc, url, timeout_s=60)
        r = httpx.post(f"{url}/v1/predict", content=png(images[0]))
        assert (r.json()["model"], r.json()["model_version"]) == (MODEL, "2")
        # The version's workers: device processes of its own, reached as sensai serve's are.
        predictor = httpx.get(f"{url}/v1/models").json()["predictor"]
        assert predictor["transport"] == {"kind": "processes", "device_processes": 1}
        assert {w["transport"] for w in predictor["workers"]} == {"devices"}
        assert len({w["pid"] for w in predictor["workers"]}) == 1
        assert httpx.post(f"{url}/v2/repository/index").status_code == 401
        r = httpx.post(f"{url}/v2/repository/models/{MODEL}/unload",
                       headers={"Authorization": "Bearer a-token-of-enough-length"})
        assert r.status_code == 200
        assert stop_server(proc) == 0


@pytest.mark.parametrize("argv, fragment", [
    (["--repository", "{tmp}/afile"],
     "cannot write to model repository {tmp}/afile: it is a file, not a directory"),
    (["--repository", "{tmp}/afile/repo"],
     "cannot write to model repository {tmp}/afile/repo: {tmp}/afile is a file, not a "
     "directory"),
    (["--repository", "{tmp}/repo", "--version", "-1"],
     "version must be a positive integer of at most 18 digits (a version folder the server "
     "reads), got -1"),
    (["--repository", "{tmp}/repo", "--version", "0"], "version must be a positive integer"),
    (["--repository", "{tmp}/repo", "--model", "afile"],
     "cannot write to model folder {tmp}/repo/afile: it is a file, not a directory"),
    (["--repository", "{tmp}/repo", "--model", ".."], "model name '..'"),
    (["--repository", "{tmp}/repo", "--version", "1" + "0" * 18], "at most 18 digits"),
    (["--repository", "{tmp}/repo", "--model", "."], "not starting with '.'"),
])
def test_a_refused_export_is_one_line_and_creates_nothing(tmp_path, tiny_artifact, capsys,
                                                          argv, fragment):
    from sensai.cli import main

    (tmp_path / "afile").touch()
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "afile").touch()
    assert main(["export", str(tiny_artifact), "--model", MODEL,
                 *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment.format(tmp=tmp_path) in err[0], err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "afile", "repo", "repo/afile"]


def test_a_repository_on_ray_actors_swaps_under_load(tmp_path, tiny_artifact, tiny_artifact_g2,
                                                     images, expected):
    """``sensai serve REPO --backend ray``: one Ray for every version's actors (the CLI's, so
    unloading a version does not take Ray down with it); a swap under load loses nothing.  The
    new version's actors start beside the old one's: each version is sized to half the CPUs."""
    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sensai", "serve", str(repo), "--port", str(port),
            "--backend", "ray", "--model-control", "explicit", "--log-level", "warning"]
    pngs = [png(x) for x in images]
    with server_process(argv) as proc:
        wait_for_server(proc, url, timeout_s=120)
        stop, seen, errors = threading.Event(), [], []

        def client() -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                i = 0
                while not stop.is_set():
                    r = c.post("/v1/predict", params={"top_k": 10}, content=pngs[i % len(pngs)])
                    if r.status_code == 200:
                        seen.append((r.json()["model_version"], i % len(pngs), r.json()))
                    else:
                        errors.append((r.status_code, r.text))
                    i += 1

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        add_version(repo, MODEL, tiny_artifact_g2)
        r = httpx.post(f"{url}/v2/repository/models/{MODEL}/load", timeout=120)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        assert r.status_code == 200, r.text
        info = httpx.get(f"{url}/v1/models").json()
        assert errors == []
        assert {v for v, _, _ in seen} == {"1", "2"}
        source = {"1": tiny_artifact, "2": tiny_artifact_g2}
        for version, i, body in seen:
            np.testing.assert_allclose(scores_of(body), expected[source[version]][i], atol=1e-4)
        assert [m["version"] for m in info["models"]] == ["2"]
        assert info["predictor"]["backend"] == "ray" and len(info["predictor"]["workers"]) == 2
        assert httpx.post(f"{url}/v1/predict", content=pngs[0]).json()["model_version"] == "2"
        assert stop_server(proc) == 0


def test_statistics_are_kept_per_version_and_start_again_for_a_version_reloaded(
        tmp_path, tiny_artifact, tiny_artifact_g2, images):
    """Triton's statistics, through tritonclient, count each version's own requests; an
    unloaded version's counters go with it."""
    import tritonclient.http as httpclient

    repo = tmp_path / "repo"
    add_version(repo, MODEL, tiny_artifact)
    (repo / MODEL / "sensai-model.json").write_text(json.dumps({"version_policy": "all"}))
    add_version(repo, MODEL, tiny_artifact_g2)
    with gateway(repo) as server:
        h = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        for version, n in (("1", 3), ("2", 1)):
            for _ in range(n):
                r = httpx.post(f"{server.url}/v1/predict", params={"model": MODEL,
                                                                   "version": version},
                               content=png(images[0]))
                assert r.status_code == 200
        r = httpx.post(f"{server.url}/v2/models/{MODEL}/versions/2/infer",
                       json={"inputs": [{"name": "input", "datatype": "FP32",
                                         "shape": [1, 1, 27, 28], "data": [0.0] * 756}]})
        assert r.status_code == 400 and "shape" in r.json()["error"]
        rows = {s["version"]: s for s in h.get_inference_statistics(MODEL)["model_stats"]}
        assert sorted(rows) == ["1", "2"]
        stats = {v: (s["inference_stats"]["success"]["count"],
                     s["inference_stats"]["fail"]["count"]) for v, s in rows.items()}
        assert stats == {"1": (3, 0), "2": (1, 1)}
        assert rows["1"]["inference_stats"]["compute_infer"]["ns"] > 0
        one = h.get_inference_statistics(MODEL, "2")["model_stats"]
        assert [s["version"] for s in one] == ["2"]
        h.unload_model(MODEL)
        assert h.get_inference_statistics()["model_stats"] == []
        h.load_model(MODEL)
        rows = {s["version"]: s for s in h.get_inference_statistics(MODEL)["model_stats"]}
        assert all(s["inference_stats"]["success"]["count"] == 0 for s in rows.values())
        h.close()


def test_an_export_into_or_around_its_artifact_is_refused(tmp_path, tiny_artifact, capsys):
    from sensai.cli import main

    before = sorted(p.name for p in tiny_artifact.iterdir())
    for repo, model in ((tiny_artifact, "x"), (tiny_artifact.parent, tiny_artifact.name)):
        assert main(["export", str(tiny_artifact), "--repository", str(repo),
                     "--model", model]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "overlap" in err[0], err
    assert sorted(p.name for p in tiny_artifact.iterdir()) == before

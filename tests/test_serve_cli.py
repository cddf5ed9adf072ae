"""``sensai serve ART --backend ray-serve``: the real CLI running the Ray Serve application on a
real local Ray instance, its ingress replica serving on 127.0.0.1 itself (no Serve proxy), called
over HTTP with real images - answers equal offline evaluation at concurrency 1 and 16, the
gateway's settings reach the application (its connection limits too), a second start on the same
cluster is refused, and SIGTERM stops it all with exit status 0.  Settings the Serve application
cannot honour are refused in one line before anything starts; so is a port that cannot be bound,
on every backend, and a port 0 is announced and reported as the port the kernel chose."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from sensai.bench.machine import descendant_pids
from tests.helpers import (free_port, local_ray, offline_scores, png, process_name, running,
                           sample_images, stop_server, wait_for_server, wait_until)

MODEL = "tiny"


@pytest.fixture(scope="module")
def serve_cli(tiny_artifact):
    """``sensai serve --backend ray-serve`` on a Ray instance of this test process (so the test
    can look at Serve's state), with two settings from the environment."""
    with local_ray(num_cpus=2) as gcs:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--backend",
             "ray-serve", "--ray-address", gcs, "--port", str(port), "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=os.environ | {"SENSAI_MODEL_NAME": MODEL, "SENSAI_MAX_REQUEST_ROWS": "3",
                            "SENSAI_DEADLINE_S": "30", "SENSAI_MAX_HEADER_BYTES": "4096"})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_server(proc, url, timeout_s=300)
            yield proc, url, gcs
        finally:  # Serve's actors end with this Ray instance
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def predict(url: str, image) -> dict:
    r = httpx.post(f"{url}/v1/predict", params={"top_k": 10}, content=png(image), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_equal_offline_evaluation_one_at_a_time_and_16_at_once(
        serve_cli, tiny_artifact, fmnist_test, fmnist_spec):
    _, url, _ = serve_cli
    _, images, _ = sample_images(fmnist_test, 16)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    n = len(images)

    def scores(body: dict) -> list[float]:
        got = {p["index"]: p["score"] for p in body["predictions"]}
        return [got[k] for k in range(10)]

    for i in range(4):
        np.testing.assert_allclose(scores(predict(url, images[i])), expected[i], atol=2e-5)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: predict(url, images[i % n]), range(16)))
    np.testing.assert_allclose([scores(a) for a in answers],
                               [expected[i % n] for i in range(16)], atol=2e-5)


def test_the_environment_settings_reach_the_application_and_its_ingress_serves(serve_cli,
                                                                             fmnist_test):
    """SENSAI_MODEL_NAME, SENSAI_MAX_REQUEST_ROWS and SENSAI_MAX_HEADER_BYTES, read by the CLI,
    are the Serve application's; the routes are served by the Serve ingress replica, a process
    of the Ray instance, not by the CLI, on its own port: Serve runs no HTTP proxy, and a head
    over the gateway's limit gets the gateway's 431."""
    proc, url, _ = serve_cli
    assert "SERVE_PROXY_ACTOR" not in " ".join(serve_actors())
    r = httpx.get(f"{url}/v2/health/live", headers={"x-big": "a" * 8192}, timeout=30)
    assert r.status_code == 431
    info = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert info["name"] == MODEL and info["predictor"]["backend"] == "ray-serve"
    assert httpx.get(f"{url}/v2/models/{MODEL}/ready", timeout=30).status_code == 200
    _, images, _ = sample_images(fmnist_test, 1)
    r = httpx.post(f"{url}/v1/predict", content=png(images[0]), timeout=60)
    assert r.status_code == 200 and len(r.json()["predictions"]) == 5
    x = np.zeros((4, 1, 28, 28), np.float32)  # a batch over SENSAI_MAX_REQUEST_ROWS
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", timeout=60, json={"inputs": [
        {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
    assert r.status_code == 400 and "between 1 and 3" in r.json()["error"]
    assert info["pid"] != proc.pid and info["pid"] != os.getpid()
    with open(f"/proc/{info['pid']}/cmdline", "rb") as f:
        assert b"ServeReplica" in f.read()


def test_a_second_start_on_a_cluster_that_runs_serve_is_refused(serve_cli, tiny_artifact):
    _, _, gcs = serve_cli
    r = subprocess.run([sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--backend",
                        "ray-serve", "--ray-address", gcs, "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("sensai serve: error: Ray Serve already runs on this Ray cluster")
    assert "Traceback" not in r.stderr


def serve_actors() -> list[str]:
    """The names of Serve's actors on this test's Ray instance (its controller, proxy and the
    application's replicas)."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_")]


def test_sigterm_stops_the_application_and_exits_0(serve_cli):
    """Last of the module: it ends the server."""
    proc, url, _ = serve_cli
    actors = serve_actors()
    assert "SERVE_CONTROLLER_ACTOR" in actors
    assert any(a.startswith("SERVE_REPLICA::sensai#ServeIngress") for a in actors), actors
    ingress = httpx.get(f"{url}/v1/models", timeout=30).json()["pid"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    wait_until(lambda: not serve_actors(), 60, "Serve's actors to end")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/v2/health/live", timeout=5)
    wait_until(lambda: not os.path.exists(f"/proc/{ingress}"), 60, "the ingress replica to end")
    err = proc.stderr.read().decode()
    assert f"on {url}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, env, fragment", [
    (["--set", "gateway_replicas=2", "--backend", "ray"], {},
     "--set gateway_replicas does not apply to --backend ray"),
    (["--set", "gateway_replicas=2", "--backend", "triton"], {},
     "--set gateway_replicas does not apply to --backend triton"),
    (["--workers", "1", "--backend", "triton"], {},
     "--workers does not apply to --backend triton (Triton serves each subnet as a model of "
     "its own, one worker per group"),
    (["--set", "device_processes=2", "--backend", "ray"], {},
     "--set device_processes does not apply to --backend ray"),
    ([], {"SENSAI_DEVICE_PROCESSES": "2", "SENSAI_BACKEND": "triton"},
     "SENSAI_DEVICE_PROCESSES does not apply to --backend triton"),
    (["--set", "device_processes=2", "--set", "gateway_replicas=1"], {},
     "--set device_processes does not apply here (the local backend with one gateway process "
     "runs the subnets in its own threads; use --backend processes)"),
    ([], {"SENSAI_DEVICE_PROCESSES": "2", "SENSAI_GATEWAY_REPLICAS": "1"},
     "SENSAI_DEVICE_PROCESSES does not apply here (the local backend"),
    (["--set", "device_processes=1", "--backend", "processes", "--redundancy", "1", "--port",
      "0"], {}, "(--set device_processes) 1 with copies of the groups: a copy is there to "
                "outlive its primary's process"),
    (["--set", "device_processes=1", "--backend", "processes", "--inject-delay",
      "0=fixed:5ms", "--port", "0"], {}, "(--set device_processes) 1 with injected faults")])
def test_gateway_settings_a_backend_cannot_honour_are_refused(tiny_artifact, capsys, monkeypatch,
                                                              argv, env, fragment):
    """CPUs reserved per gateway are the Serve application's; several gateway processes need
    workers they can share (device processes, or Serve's replicas), and only device processes
    can be counted: the other backends refuse in one line."""
    from sensai.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", str(tiny_artifact), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, env, fragment", [
    (["--grpc-port", "9001"], {}, "--grpc-port does not apply to --backend ray-serve"),
    (["--set", "spread_cores=true"], {},
     "--set spread_cores does not apply to --backend ray-serve"),
    (["--set", "restart_delay_s=1"], {},
     "--set restart_delay_s does not apply to --backend ray-serve"),
    ([], {"SENSAI_RESTART_DELAY_S": "1"},
     "SENSAI_RESTART_DELAY_S does not apply to --backend ray-serve"),
    (["--inject-delay", "0=fixed:5ms"], {}, "--inject-delay does not apply"),
    (["--port", "0"], {}, "--backend ray-serve needs a fixed --port"),
    (["--triton-url", "127.0.0.1:1"], {}, "--triton-url does not apply"),
    (["--set", "device_processes=1"], {},
     "--set device_processes does not apply to --backend ray-serve"),
])
def test_what_the_serve_application_cannot_honour_is_refused_in_one_line(
        tiny_artifact, capsys, monkeypatch, argv, env, fragment):
    from sensai.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", str(tiny_artifact), "--backend", "ray-serve", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("sensai serve: error:")


def test_predict_refuses_the_ray_serve_backend_in_one_line(tiny_artifact, fmnist_test, tmp_path,
                                                           capsys):
    from sensai.cli import main

    _, images, _ = sample_images(fmnist_test, 1)
    image = tmp_path / "x.png"
    image.write_bytes(png(images[0]))
    assert main(["predict", str(tiny_artifact), str(image), "--backend", "ray-serve"]) == 2
    err = capsys.readouterr().err
    assert "sensai serve ART --backend ray-serve" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("signum, ends", [(signal.SIGTERM, "returns"), (signal.SIGINT, "interrupted")])
def test_a_signal_during_start_up_stops_it_cleanly(monkeypatch, signum, ends):
    """The ingress's port answers before start-up returns, so a supervisor may send SIGTERM
    then: the same clean stop as after start-up (exit 0), while Ctrl-C stays an interrupt; a
    second signal during the clean-up does not break it off."""
    from sensai.serving.core.settings import GatewaySettings
    from sensai.serving.launch import serve_run

    stopped = []

    class StartingRun:
        name = "sensai"

        def __init__(self, address, *, serve_stop_s):
            assert serve_stop_s == serve_run.SERVE_STOP_S

        def serve(self, artifact, settings, *, startup_timeout_s):
            os.kill(os.getpid(), signum)
            time.sleep(30)  # the signal's handler breaks this off
            raise AssertionError("start-up went on after the signal")

        def stop(self):
            os.kill(os.getpid(), signum)  # ignored: the clean-up runs to its end
            time.sleep(0.2)
            stopped.append(True)
            return True  # stopped in time

    monkeypatch.setattr(serve_run, "ServeRun", StartingRun)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    if ends == "returns":
        serve_run.serve_artifact("ART", GatewaySettings(backend="ray-serve"))
    else:
        with pytest.raises(KeyboardInterrupt):
            serve_run.serve_artifact("ART", GatewaySettings(backend="ray-serve"))
    assert stopped == [True] and time.monotonic() - t0 < 10
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_a_signal_to_its_whole_process_group_stops_it_cleanly(tiny_artifact, fmnist_test):
    """A supervisor that signals the whole process group (systemd stopping a unit, ``kill --
    -PGID``) stops the processes of a Ray instance sensai started with sensai's own: Serve's
    shutdown would wait a minute for them and Ray end the process with status 1.  Serve gets
    SERVE_STOP_S on such an instance; then the process ends at once with status 0, and the Ray
    instance's processes end with it."""
    from sensai.serving.launch.serve_run import SERVE_STOP_S

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--backend", "ray-serve",
         "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env=os.environ | {"SENSAI_MODEL_NAME": MODEL})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=300)
        _, images, _ = sample_images(fmnist_test, 1)
        predict(url, images[0])
        raylets = [pid for pid in descendant_pids(proc.pid) if process_name(pid) == "raylet"]
        assert raylets
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=SERVE_STOP_S + 30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert f"Ray Serve did not stop within {SERVE_STOP_S:g} s" in err.decode()
    assert took < 50  # Ray's own wait for its GCS is 60 s
    wait_until(lambda: not any(running(pid) for pid in raylets), 30, "the raylet to end")


@pytest.mark.parametrize("argv, env, fragment", [
    (["--port", "{busy}"], {},
     "--port {busy}: cannot listen on 127.0.0.1:{busy} (Address already in use)"),
    ([], {"SENSAI_PORT": "{busy}"},
     "SENSAI_PORT {busy}: cannot listen on 127.0.0.1:{busy} (Address already in use)"),
    (["--port", "{busy}", "--set", "gateway_replicas=2"], {},
     "--port {busy}: cannot listen on 127.0.0.1:{busy} (Address already in use)"),
    (["--port", "{busy}", "--backend", "ray-serve"], {},
     "--port {busy}: cannot listen on 127.0.0.1:{busy} (Address already in use)"),
    (["--port", "0", "--grpc-port", "{busy}"], {},
     "--grpc-port {busy}: cannot listen on 127.0.0.1:{busy} (Address already in use)"),
    (["--host", "999.1.1.1", "--port", "0"], {},
     "--host 999.1.1.1: cannot listen on 999.1.1.1:0 ("),
    (["--port", "0", "--set", "gateway_replicas=2"], {"SENSAI_HOST": "999.1.1.1"},
     "SENSAI_HOST 999.1.1.1: cannot listen on 999.1.1.1:0 ("),
], ids=["busy", "busy-variable", "busy-two-gateways", "busy-ray-serve", "busy-grpc", "bad-host",
        "bad-host-variable"])
def test_a_port_that_cannot_be_bound_is_refused_in_one_line_before_anything_is_said(
        tiny_artifact, capsys, monkeypatch, argv, env, fragment):
    """The port is bound (or, where other processes bind it, checked) before any worker starts
    and before the banner: a busy port or a host that is not this machine's is one line naming
    the setting as it was given, exit 2 - never the banner then uvicorn's own error."""
    from sensai.cli import main

    with socket.socket() as held:  # another server on the port
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        for k, v in env.items():
            monkeypatch.setenv(k, v.format(busy=busy))
        assert main(["serve", str(tiny_artifact), "--log-level", "warning",
                     *(a.format(busy=busy) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sensai serve: error: {fragment.format(busy=busy)}"), err
    assert len(err.strip().splitlines()) == 1 and "serving" not in err


@pytest.mark.parametrize("argv", [[], ["--set", "gateway_replicas=2"]],
                         ids=["one-gateway", "two-gateways"])
def test_port_0_is_announced_and_reported_as_the_port_the_kernel_chose(tiny_artifact, tmp_path,
                                                                        argv):
    """``--port 0 --grpc-port 0``: the banner and ``/v1/models`` say the ports clients connect
    to (every gateway process of a server on the same gRPC port), not 0."""
    import tritonclient.grpc as tc

    log = tmp_path / "stderr.txt"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--port", "0",
             "--grpc-port", "0", "--device", "cpu", "--log-level", "warning", *argv],
            stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: proc.poll() is not None or "serving " in log.read_text(), 120,
                   "the banner")
        assert proc.poll() is None, log.read_text()[-3000:]
        banner = re.search(r"on http://127\.0\.0\.1:(\d+) and gRPC port (\d+)\n",
                           log.read_text())
        port, grpc_port = int(banner[1]), int(banner[2])
        assert port and grpc_port
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: ready(url), 60, "the gateway to answer")
        settings = httpx.get(f"{url}/v1/models", timeout=10).json()["settings"]
        assert (settings["port"], settings["grpc_port"]) == (port, grpc_port)
        client = tc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert client.is_server_ready()
        client.close()
        assert stop_server(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_repository_that_cannot_start_is_one_line_without_a_traceback(tmp_path, tiny_artifact):
    """What the gateway finds wrong only as it starts (a model folder with no version) is said
    in one line, uvicorn's traceback of the failed startup held back."""
    (tmp_path / "repo" / "m").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "sensai", "serve", str(tmp_path / "repo"),
                           "--port", "0", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x.lower()]
    assert line.startswith("sensai serve: error: ") and "model 'm' has no version" in line
    assert "model 'm': model 'm'" not in line
    # Nothing claimed it served before it failed.
    assert "serving" not in proc.stderr and "loading model repository" in proc.stderr


def test_one_port_for_http_and_grpc_is_refused(tiny_artifact):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                           "--port", str(port), "--grpc-port", str(port)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"--grpc-port {port} is --port too" in proc.stderr.strip().splitlines()[-1]


def test_set_help_fits_the_terminal_and_names_every_setting(capsys):
    from sensai.cli import main
    from sensai.cli.knobs import LINE_WIDTH

    with pytest.raises(SystemExit) as e:
        main(["serve", "--set", "help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    # A default said in words (gateway_replicas') is wrapped like the meanings.
    assert max(map(len, out.splitlines())) <= LINE_WIDTH
    assert "gateway_replicas=local and processes: 1 on fewer than 4 cores" in out


def test_a_stop_drains_a_request_for_as_long_as_its_deadline(tiny_artifact, fmnist_test):
    """A request still computing when SIGTERM comes is answered within its deadline, even where
    the deadline is longer than uvicorn's usual drain (10 s): never cut off with a plain 500."""
    from tests.helpers import server_process

    port = free_port()
    argv = [sys.executable, "-m", "sensai", "serve", str(tiny_artifact), "--port", str(port),
            "--device", "cpu", "--deadline", "14", "--inject-delay", "0=fixed:11500ms",
            "--log-level", "warning"]
    _, images, _ = sample_images(fmnist_test, 1)
    with server_process(argv) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/v1/predict", content=png(images[0]),
                                 timeout=60)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            r = answer.result()
        assert r.status_code == 200, r.text
        assert proc.wait(60) == 0

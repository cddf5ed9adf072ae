"""``sensai serve ART --set gateway_replicas=2``: two gateway processes sharing one port over
device processes, all real (the CLI, spawned processes, HTTP on 127.0.0.1, real images).  Every
answer equals offline evaluation whichever gateway took it; rows from both gateways are batched
together in one device process; a killed gateway process costs only its own requests and comes
back; a killed device process is started again and the gateways reconnect; ``/metrics`` from either
gateway counts the requests of both; the gateways import no torch; a device process hangs up on a
gateway that breaks the slots' bounds and serves the others; a v2 batch larger than a slot
travels inline and is answered right; gRPC on the shared port; by default no request is held back
for company; ``--backend processes`` with one gateway process is this server too."""

from __future__ import annotations

import json
import mmap
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
from sensai.data import normalize
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.fleet import Fleet
from sensai.serving.workers import devicewire as w
from tests.helpers import (free_port, offline_scores, png, running, sample_images,
                           server_process, stop_server, wait_for_server, wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tiny_artifact_g2):
    """The CLI with two gateway processes; a worker holds a request up to 20 ms for company, so
    concurrent requests from both gateways meet in one batch."""
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "SENSAI_DEADLINE_S": "20", "SENSAI_BATCH_DELAY_US": "20000"}
    with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact_g2),
                         "--set", "gateway_replicas=2", "--device", "cpu", "--port", str(port),
                         "--grpc-port", str(grpc_port), "--log-level", "warning"],
                        env=env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=180)
        yield proc, url, grpc_port
        assert stop_server(proc) == 0
        err = proc.stderr.read().decode()
        assert "2 gateway processes" in err and "Traceback" not in err, err[-3000:]
        # What the gateway processes log is formatted as the parent's (a killed device process
        # is said so, its restart too).
        lost = [x for x in err.splitlines() if "lost its device process" in x]
        assert all(re.match(r"\d\d:\d\d:\d\d (WARNING|ERROR) sensai\.", x) for x in lost), lost
        if lost:
            assert re.search(r"\d\d:\d\d:\d\d INFO sensai\.\S+: worker_\d+ rejoined", err), \
                err[-3000:]


def fresh(url: str, method: str, path: str, **kw) -> httpx.Response:
    """One request on a connection of its own (the kernel picks the gateway per connection)."""
    with httpx.Client(timeout=60) as c:
        return c.request(method, f"{url}{path}", **kw)


def gateway_pids(url: str, n: int = 40) -> set[int]:
    return {fresh(url, "GET", "/v1/models").json()["pid"] for _ in range(n)}


def device_pids(url: str) -> set[int]:
    info = fresh(url, "GET", "/v1/models").json()
    return {wk["pid"] for wk in info["predictor"]["workers"]}


def predict(url: str, image) -> tuple[int, dict]:
    r = fresh(url, "POST", "/v1/predict", params={"top_k": 10}, content=png(image))
    return r.status_code, r.json()


def scores(body: dict) -> np.ndarray:
    out = np.zeros(len(body["predictions"]), dtype=np.float32)
    for p in body["predictions"]:
        out[p["index"]] = p["score"]
    return out


def test_both_gateways_answer_as_offline_evaluation_and_batch_together(
        fleet, tiny_artifact_g2, fmnist_test, fmnist_spec):
    _, url, _ = fleet
    _, images, _ = sample_images(fmnist_test, 16)
    expected = offline_scores(tiny_artifact_g2, images, fmnist_spec)
    pids = gateway_pids(url)
    assert len(pids) == 2  # both processes take connections on the one port
    transport = fresh(url, "GET", "/v1/models").json()["predictor"]["transport"]
    assert transport["gateway_processes"] == 2 and transport["device_processes"] == 2
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda img: predict(url, img), images))
    for (status, body), want in zip(answers, expected):
        assert status == 200, body
        np.testing.assert_allclose(scores(body), want, atol=1e-4)
    # A device process counts its batches over every gateway (each gateway knows the counts as
    # of its own last request there): some held rows of both.
    views = [fresh(url, "GET", "/v1/models").json()["predictor"]["workers"] for _ in range(20)]
    assert any(wk["batching"]["mixed"] > 0 for v in views for wk in v), views[0]
    for worker in range(2):
        assert max(v[worker]["batching"]["largest"] for v in views) > 1


def test_both_gateways_serve_kserve_v2_over_grpc_on_one_port(fleet, tiny_artifact_g2,
                                                            fmnist_test, fmnist_spec):
    import tritonclient.grpc as grpcclient

    _, _, grpc_port = fleet
    _, images, _ = sample_images(fmnist_test, 4)
    x = normalize(images, fmnist_spec).numpy().astype(np.float32)
    expected = offline_scores(tiny_artifact_g2, images, fmnist_spec)
    for _ in range(6):  # a channel each: the kernel spreads them over both processes
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("sensai", [tensor])
        name = result.get_response().outputs[0].name
        np.testing.assert_allclose(result.as_numpy(name), expected, atol=1e-4)
        client.close()


def test_the_gateways_import_no_torch(fleet):
    _, url, _ = fleet
    for pid in gateway_pids(url):
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps and "onnxruntime" not in maps
    for pid in device_pids(url):
        assert "onnxruntime" in open(f"/proc/{pid}/maps").read()


def test_metrics_from_either_gateway_add_up_over_both(fleet, fmnist_test):
    _, url, _ = fleet
    _, images, _ = sample_images(fmnist_test, 4)

    def predicted() -> float:
        text = fresh(url, "GET", "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sensai_requests_total{")
                   and 'route="/v1/predict"' in line and 'status="200"' in line)

    before = predicted()
    for _ in range(5):
        for img in images:
            assert predict(url, img)[0] == 200
    for _ in range(6):  # whichever process answers the scrape counts all 20
        assert predicted() == before + 20


def test_statistics_and_shared_memory_regions_are_the_whole_servers(fleet, tiny_artifact_g2,
                                                                    fmnist_test, fmnist_spec):
    """Triton's statistics from either gateway process count the requests of both, and a
    region registered through one is used through the other (a connection each: the kernel
    spreads them)."""
    import tritonclient.utils.shared_memory as shm

    _, url, _ = fleet
    _, images, _ = sample_images(fmnist_test, 1)
    x = normalize(images, fmnist_spec).numpy().astype(np.float32)
    expected = offline_scores(tiny_artifact_g2, images, fmnist_spec)

    def successes() -> int:
        stats = fresh(url, "GET", "/v2/models/sensai/stats").json()["model_stats"][0]
        return stats["inference_stats"]["success"]["count"]

    before = successes()
    for _ in range(10):
        assert predict(url, images[0])[0] == 200
    for _ in range(6):
        assert successes() == before + 10

    key = f"/sensai_fleet_{os.getpid()}"
    handle = shm.create_shared_memory_region("fleet", key, x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        r = fresh(url, "POST", "/v2/systemsharedmemory/region/fleet/register",
                  json={"key": key, "byte_size": x.nbytes})
        assert r.status_code == 200, r.text
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                            "parameters": {"shared_memory_region": "fleet",
                                           "shared_memory_byte_size": x.nbytes}}],
                "outputs": [{"name": "scores"}]}
        for _ in range(12):
            r = fresh(url, "POST", "/v2/models/sensai/infer", json=body)
            assert r.status_code == 200, r.text
            got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(1, -1)
            np.testing.assert_allclose(got, expected, atol=1e-4)
        assert fresh(url, "POST", "/v2/systemsharedmemory/unregister").status_code == 200
        for _ in range(6):  # gone for every process
            r = fresh(url, "POST", "/v2/models/sensai/infer", json=body)
            assert r.status_code == 400 and "unknown shared memory region" in r.json()["error"]
    finally:
        shm.destroy_shared_memory_region(handle)


def test_a_killed_gateway_costs_only_its_own_requests_and_comes_back(fleet, fmnist_test):
    _, url, _ = fleet
    _, images, _ = sample_images(fmnist_test, 1)
    victim = min(gateway_pids(url))
    os.kill(victim, signal.SIGKILL)
    # The other process answers meanwhile: a connection the kernel gave the dead one is refused
    # at connect (nothing was sent on it), so a client retries only those.
    ok = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status, _ = predict(url, images[0])
        except httpx.ConnectError:
            continue
        assert status == 200
        ok += 1
        pids = gateway_pids(url, 10)
        if victim not in pids and len(pids) == 2:
            break
    assert ok > 0
    wait_until(lambda: len(gateway_pids(url, 20) - {victim}) == 2, 60,
               "a new gateway process on the port")


def test_a_killed_device_process_is_started_again(fleet, fmnist_test):
    _, url, _ = fleet
    _, images, _ = sample_images(fmnist_test, 1)
    victim = min(device_pids(url))
    os.kill(victim, signal.SIGKILL)

    def recovered() -> bool:
        try:
            return (victim not in device_pids(url) and all(
                predict(url, images[0])[0] == 200 for _ in range(4)))
        except httpx.HTTPError:
            return False

    wait_until(recovered, 90, "the device process to be started again", period_s=0.5)
    for wk in fresh(url, "GET", "/v1/models").json()["predictor"]["workers"]:
        assert wk["state"] == "up"


def test_a_v2_batch_larger_than_a_slot_is_answered_right(fleet, tiny_artifact_g2, fmnist_test,
                                                          fmnist_spec):
    _, url, _ = fleet
    _, images, _ = sample_images(fmnist_test, 12)
    x = normalize(images, fmnist_spec).numpy().astype(np.float32)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.reshape(-1).tolist()}]}
    r = fresh(url, "POST", "/v2/models/sensai/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    np.testing.assert_allclose(got, offline_scores(tiny_artifact_g2, images, fmnist_spec),
                               atol=1e-4)


def hello(sock: socket.socket, slots: int) -> None:
    fd = os.memfd_create("test-slots")
    os.ftruncate(fd, slots * 28 * 28 * 4)
    socket.send_fds(sock, [w.control(w.HELLO, {"slots": slots, "slot_rows": 1,
                                               "row_shape": [1, 28, 28],
                                               "slot_bytes": 28 * 28 * 4})], [fd])
    os.close(fd)
    kind, _ = w.read_frame(sock.makefile("rb"))
    assert kind == w.READY


@pytest.mark.parametrize("slot, rows", [(5, 1), (0, 2), (-1, 3)])
def test_a_device_process_hangs_up_on_a_run_outside_its_slots(fleet, fmnist_test, slot, rows):
    """Slot 5 of 2, two rows in a one-row slot, inline rows that are not there: the device
    process ends that connection, reads nothing outside the mapping, and serves the gateways."""
    _, url, _ = fleet
    address = fresh(url, "GET", "/v1/models").json()["predictor"]["workers"][0]["device_process"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address)
        hello(sock, 2)
        sock.sendall(w.frame(w.RUN, w.RUN_HEAD.pack(1, slot, rows, 0.0, 1, 1),
                             w.groups_bytes((0,))))
        sock.settimeout(30)
        assert sock.recv(1) == b""  # hung up on, nothing answered
    _, images, _ = sample_images(fmnist_test, 1)
    assert predict(url, images[0])[0] == 200


def test_a_hello_that_claims_more_slots_than_mapped_is_refused(fleet):
    _, url, _ = fleet
    address = fresh(url, "GET", "/v1/models").json()["predictor"]["workers"][0]["device_process"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address)
        fd = os.memfd_create("test-slots")
        os.ftruncate(fd, mmap.PAGESIZE)  # far less than 1,000 slots
        socket.send_fds(sock, [w.control(w.HELLO, {"slots": 1000, "slot_rows": 1,
                                                   "row_shape": [1, 28, 28],
                                                   "slot_bytes": 28 * 28 * 4})], [fd])
        os.close(fd)
        sock.settimeout(30)
        assert sock.recv(1) == b""
    assert json.loads(fresh(url, "GET", "/v2/health/ready").text or "{}") is not None


def test_by_default_a_request_is_never_held_back_for_company(tiny_artifact_g2, fmnist_test):
    """The fleet in process, its defaults: one request at a time over two gateway processes,
    and no device process ever held one back waiting for others (``held`` stays 0) - only what
    is already waiting is batched."""
    _, images, _ = sample_images(fmnist_test, 8)
    with Fleet(tiny_artifact_g2, GatewaySettings(port=0, device="cpu", log_level="warning"),
               processes=2) as server:
        for img in images:
            assert predict(server.url, img)[0] == 200
        # A gateway knows a device process's counters as of the last request it sent there:
        # the one that took the last request knows every one of them.
        views = [fresh(server.url, "GET", "/v1/models").json()["predictor"]["workers"]
                 for _ in range(20)]
        for worker in range(2):
            assert max(v[worker]["batching"]["requests"] for v in views) == len(images)
        assert all(wk["batching"]["held"] == 0 for v in views for wk in v)
        assert {m["role"] for m in server.describe()["processes"]} == {"gateway", "device"}
    assert all(m.process.exitcode is not None for m in server.members())


@pytest.mark.parametrize("shared", [None, 1])
def test_the_processes_backend_serves_one_gateway_over_device_processes(tiny_artifact_g2,
                                                                        fmnist_test, fmnist_spec,
                                                                        shared):
    """``sensai serve ART --backend processes`` with one gateway process is this server too:
    the answers of offline evaluation from a gateway process that is neither the CLI's process
    nor a worker's, over a device process per worker that it reads on its event loop - or,
    with ``--set device_processes=1``, one that hosts both subnets."""
    port = free_port()
    _, images, _ = sample_images(fmnist_test, 8)
    expected = offline_scores(tiny_artifact_g2, images, fmnist_spec)
    devices = shared or 2
    argv = [] if shared is None else ["--set", f"device_processes={shared}"]
    with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact_g2),
                         "--backend", "processes", "--set", "gateway_replicas=1", "--device", "cpu",
                         *argv, "--port", str(port), "--log-level", "warning"]) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=180)
        info = fresh(url, "GET", "/v1/models").json()
        transport = info["predictor"]["transport"]
        assert transport["kind"] == "devices", transport
        assert transport["gateway_processes"] == 1 and transport["device_processes"] == devices
        workers = [wk["pid"] for wk in info["predictor"]["workers"]]
        assert len(workers) == 2 and len(set(workers)) == devices
        assert info["pid"] not in set(workers) | {proc.pid}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda img: predict(url, img), images))
        for (status, body), want in zip(answers, expected):
            assert status == 200, body
            np.testing.assert_allclose(scores(body), want, atol=1e-4)
        assert stop_server(proc) == 0
        err = proc.stderr.read().decode()
    plural = "es" if devices > 1 else ""
    assert f"{devices} device process{plural}, 1 gateway process)" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("how", ["again and again", "to the group"])
def test_a_supervisors_sigterm_stops_it_cleanly(tiny_artifact_g2, fmnist_test, how):
    """A supervisor may signal the main process more than once (``timeout`` and ``pkill``
    signal it and then its group): a SIGTERM during another's handler must not wait on a lock
    the main thread holds.  Or it signals the whole group (systemd, ``kill -- -PGID``): the
    children end cleanly before the parent has seen its own signal, and are not started
    again; a request in flight then is answered (the device processes compute on until the
    gateways have drained).  Either way the server stops with status 0, its processes gone,
    nothing said of restarts."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sensai", "serve", str(tiny_artifact_g2), "--backend",
         "processes", "--set", "gateway_replicas=1", "--device", "cpu", "--port", str(port),
         "--log-level", "warning", "--inject-delay", "0=fixed:500ms"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=180)
        _, images, _ = sample_images(fmnist_test, 1)
        assert predict(url, images[0])[0] == 200
        children = descendant_pids(proc.pid)
        assert children
        if how == "to the group":
            with ThreadPoolExecutor(1) as pool:
                in_flight = pool.submit(predict, url, images[0])
                time.sleep(0.2)  # sent, and computing behind the injected delay
                os.killpg(proc.pid, signal.SIGTERM)
                status, body = in_flight.result(timeout=60)
            assert status == 200, body
        else:
            # SIGTERM after SIGTERM for 0.1 s: some land while the handler of another runs.
            until = time.monotonic() + 0.1
            while time.monotonic() < until and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.decode()
    assert proc.returncode == 0, text[-2000:]
    assert "Traceback" not in text and "again" not in text, text[-2000:]
    wait_until(lambda: not any(running(pid) for pid in children), 30, "its processes to end")

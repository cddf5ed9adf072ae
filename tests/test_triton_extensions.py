"""Triton's extensions as Triton's own clients use them: statistics, system shared memory, gRPC
streaming and the server's list of extensions (``serving/gateway/statistics.py``,
``shared_memory.py``, ``grpc_server.py``).

Real servers on 127.0.0.1 (the gateway under uvicorn with gRPC on its loop), the real ONNX subnets
of ``tiny_artifact``, real Fashion-MNIST images, ``tritonclient.http`` / ``tritonclient.grpc``
and their shared-memory utilities: answers must equal offline evaluation's, counts must equal
what was sent.  No timing is asserted beyond "more than zero".
"""

from __future__ import annotations

import os
import queue
import uuid

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as gc
import tritonclient.http as hc
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from sensai.data import normalize
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor
from tests.helpers import offline_scores, png, sample_images, serve_with_grpc

EXPECTED_EXTENSIONS = {"classification", "model_configuration", "binary_tensor_data",
                       "parameters", "statistics", "system_shared_memory"}


@pytest.fixture(scope="module")
def server(tiny_artifact):
    s, target = serve_with_grpc(build_predictor(tiny_artifact, GatewaySettings(device="cpu")),
                                max_request_rows=16, max_loop_lag_s=5.0)
    yield s, target
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    c = hc.InferenceServerClient(server[0].url.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_client(server):
    c = gc.InferenceServerClient(server[1])
    yield c
    c.close()


@pytest.fixture(scope="module")
def batch(fmnist_test, fmnist_spec, tiny_artifact):
    _, images, _ = sample_images(fmnist_test, 4)
    return (normalize(images, fmnist_spec).numpy(), offline_scores(tiny_artifact, images,
                                                                   fmnist_spec), images)


@pytest.fixture
def segments():
    """Shared-memory segments made as a client makes them, destroyed after the test."""
    made = []

    def make(byte_size: int):
        key = f"/sensai_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key.strip("/"), key, byte_size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def v2_input(module, x: np.ndarray):
    return module.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)


def refusal(fn, *args, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn(*args, **kw)
    return e.value


# -------------------------------------------------------------------------------------------
# the server's extensions


def test_the_server_names_every_extension_it_implements(server, grpc_client):
    assert set(httpx.get(f"{server[0].url}/v2").json()["extensions"]) == EXPECTED_EXTENSIONS
    meta = grpc_client.get_server_metadata(as_json=True)
    assert set(meta["extensions"]) == EXPECTED_EXTENSIONS


def test_cuda_shared_memory_has_no_region_to_list_or_let_go_over_http(server, http):
    assert http.get_cuda_shared_memory_status() == []
    http.unregister_cuda_shared_memory()
    r = httpx.post(f"{server[0].url}/v2/cudasharedmemory/region/r/register",
                   json={"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8})
    assert r.status_code == 404


def test_what_is_not_implemented_is_refused_at_once_over_grpc(server):
    with grpc.insecure_channel(server[1]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for call, msg in ((stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest()),
                          (stub.TraceSetting, pb.TraceSettingRequest())):
            with pytest.raises(grpc.RpcError) as e:
                call(msg, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # No CUDA region can exist: a client cleaning up every kind (perf_analyzer) succeeds.
        assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(),
                                               timeout=10).regions
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=10)


# -------------------------------------------------------------------------------------------
# statistics


def stats_of(answer: dict, version: str = "1") -> dict:
    (row,) = [r for r in answer["model_stats"] if r["version"] == version]
    return row


def count(row: dict, stat: str) -> int:
    return int(row["inference_stats"][stat]["count"])


def test_statistics_count_what_was_sent_and_failed_over_http_and_grpc(server, http, grpc_client,
                                                                       batch):
    x, _, images = batch
    before = stats_of(http.get_inference_statistics("sensai"))
    for rows in (1, 1, 3):  # KServe v2 over HTTP
        http.infer("sensai", [v2_input(hc, x[:rows])])
    grpc_client.infer("sensai", [v2_input(gc, x[:2])])
    assert httpx.post(f"{server[0].url}/v1/predict", content=png(images[0])).status_code == 200
    bad = x[:1].copy()
    bad[0, 0, 0, 0] = np.nan
    for module, client in ((hc, http), (gc, grpc_client)):
        assert "NaN" in refusal(client.infer, "sensai", [v2_input(module, bad)]).message()

    after = stats_of(http.get_inference_statistics("sensai"))
    assert count(after, "success") - count(before, "success") == 5
    assert count(after, "fail") - count(before, "fail") == 2
    assert int(after["inference_count"]) - int(before["inference_count"]) == 1 + 1 + 3 + 2 + 1
    assert int(after["execution_count"]) - int(before["execution_count"]) == 5
    for stat in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert count(after, stat) - count(before, stat) == 5, stat
    for stat in ("success", "fail", "compute_infer", "compute_input"):
        assert int(after["inference_stats"][stat]["ns"]) > int(before["inference_stats"][stat]
                                                               ["ns"]), stat
    # Triton's rule: the phases fit inside the request's time.
    phases = sum(int(after["inference_stats"][s]["ns"]) for s in
                 ("queue", "compute_input", "compute_infer", "compute_output"))
    assert phases <= int(after["inference_stats"]["success"]["ns"])
    sizes = {b["batch_size"]: int(b["compute_infer"]["count"]) for b in after["batch_stats"]}
    assert sizes.get(3, 0) >= 1 and sizes.get(2, 0) >= 1 and sizes[1] >= 3
    assert int(after["last_inference"]) > 0
    split = after["class_parallel"]
    assert split["slowest_subnet"]["count"] - before["class_parallel"]["slowest_subnet"][
        "count"] == 5 and split["slowest_subnet"]["ns"] > 0

    # gRPC's answer is the same counters (less the class-parallel split it has no field for).
    over_grpc = stats_of(grpc_client.get_inference_statistics("sensai", as_json=True))
    assert count(over_grpc, "success") == count(after, "success")
    assert count(over_grpc, "fail") == count(after, "fail")
    assert int(over_grpc["inference_count"]) == int(after["inference_count"])
    everything = http.get_inference_statistics()
    assert [(r["name"], r["version"]) for r in everything["model_stats"]] == [("sensai", "1")]
    assert stats_of(http.get_inference_statistics("sensai", "1"))["name"] == "sensai"


def test_statistics_of_an_unknown_model_or_version_say_so(server, http, grpc_client):
    r = httpx.get(f"{server[0].url}/v2/models/nope/stats")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    r = httpx.get(f"{server[0].url}/v2/models/sensai/versions/7/stats")
    assert r.status_code == 404 and "no version '7'" in r.json()["error"]
    e = refusal(grpc_client.get_inference_statistics, "nope")
    assert e.status() == "StatusCode.NOT_FOUND" and "nope" in e.message()
    # gRPC's request can carry a version without a model name: refused, not ignored.
    e = refusal(grpc_client.get_inference_statistics, "", "1")
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "model's name" in e.message()


# -------------------------------------------------------------------------------------------
# system shared memory


def shm_round_trip(module, client, x, segments, tag: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` in a region, both outputs to another: the scores and classes read back from it."""
    in_bytes, scores_bytes, index_bytes = x.nbytes, len(x) * 10 * 4, len(x) * 8
    key_in, h_in = segments(in_bytes)
    key_out, h_out = segments(64 + scores_bytes + index_bytes)
    shm.set_shared_memory_region(h_in, [x])
    client.register_system_shared_memory(f"{tag}_in", key_in, in_bytes)
    client.register_system_shared_memory(f"{tag}_out", key_out, 64 + scores_bytes + index_bytes)
    inp = module.InferInput("input", list(x.shape), "FP32")
    inp.set_shared_memory(f"{tag}_in", in_bytes)
    outs = [module.InferRequestedOutput("scores"), module.InferRequestedOutput("class_index")]
    outs[0].set_shared_memory(f"{tag}_out", scores_bytes, offset=64)
    outs[1].set_shared_memory(f"{tag}_out", index_bytes, offset=64 + scores_bytes)
    result = client.infer("sensai", [inp], outputs=outs)
    scores_out = result.get_output("scores")
    shape = list(scores_out["shape"] if isinstance(scores_out, dict) else scores_out.shape)
    assert [int(d) for d in shape] == [len(x), 10]
    scores = shm.get_contents_as_numpy(h_out, np.float32, [len(x), 10], offset=64)
    index = shm.get_contents_as_numpy(h_out, np.int64, [len(x)], offset=64 + scores_bytes)
    head = shm.get_contents_as_numpy(h_out, np.uint8, [64])
    assert not head.any(), "bytes before the output's offset were written"
    return scores.copy(), index.copy()


@pytest.mark.parametrize("module", [hc, gc], ids=["http", "grpc"])
def test_a_real_image_round_trips_through_shared_memory(module, http, grpc_client, batch,
                                                        segments):
    x, expected, _ = batch
    client = http if module is hc else grpc_client
    tag = f"rt_{module.__name__.rsplit('.', 1)[-1]}"
    scores, index = shm_round_trip(module, client, x, segments, tag)
    plain = client.infer("sensai", [v2_input(module, x)]).as_numpy("scores")
    np.testing.assert_allclose(scores, plain, atol=1e-6)
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    assert (index == expected.argmax(1)).all()

    status = client.get_system_shared_memory_status(**({"as_json": True} if module is gc
                                                       else {}))
    regions = status["regions"] if module is gc else status
    listed = regions.values() if isinstance(regions, dict) else regions
    assert {r["name"] for r in listed} >= {f"{tag}_in", f"{tag}_out"}
    client.unregister_system_shared_memory(f"{tag}_in")
    inp = module.InferInput("input", list(x.shape), "FP32")
    inp.set_shared_memory(f"{tag}_in", x.nbytes)
    e = refusal(client.infer, "sensai", [inp])
    assert "unknown shared memory region" in e.message()
    client.unregister_system_shared_memory()  # every region
    assert not (client.get_system_shared_memory_status(as_json=True).get("regions")
                if module is gc else client.get_system_shared_memory_status())


def test_every_bad_region_offset_size_and_name_is_refused_with_its_reason(server, http, batch,
                                                                          segments):
    x, _, _ = batch
    one = x[:1]
    key, handle = segments(one.nbytes + 16)
    shm.set_shared_memory_region(handle, [one])
    url = server[0].url

    def register(name: str, **body) -> httpx.Response:
        return httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/register", json=body)

    for name, body, reason in [
            ("a", {"key": "/sensai_no_such_segment", "byte_size": 8}, "unable to open"),
            ("a", {"key": key, "offset": 8, "byte_size": one.nbytes + 16}, "runs past its end"),
            ("a", {"key": key, "byte_size": 0}, "above 0"),
            ("a", {"key": key, "byte_size": -4}, "non-negative"),
            ("a", {"key": "../etc/passwd", "byte_size": 4}, "not a POSIX shared memory name"),
            ("-bad", {"key": key, "byte_size": 4}, "region name"),
            ("a", {"key": key}, "byte_size"),
            ("a", {"key": key, "byte_size": str(one.nbytes)}, "valid integer")]:
        r = register(name, **body)
        assert r.status_code in (400, 404, 422) and reason in r.json()["error"], (body, r.text)
    assert http.get_system_shared_memory_status() == []
    assert register("good", key=key, byte_size=one.nbytes + 16).status_code == 200
    r = register("good", key=key, byte_size=8)
    assert r.status_code == 400 and "already registered" in r.json()["error"]

    def infer_with(byte_size: int, offset: int = 0, out: tuple | None = None) -> str:
        inp = hc.InferInput("input", list(one.shape), "FP32")
        inp.set_shared_memory("good", byte_size, offset)
        outs = None
        if out is not None:
            outs = [hc.InferRequestedOutput("scores")]
            outs[0].set_shared_memory("good", *out)
        return refusal(http.infer, "sensai", [inp], outputs=outs).message()

    assert "needs 3,136 bytes" in infer_with(one.nbytes - 4)
    assert "runs past region" in infer_with(one.nbytes, offset=32)
    assert "too small" in infer_with(one.nbytes, out=(8, 0))
    assert "runs past region" in infer_with(one.nbytes, out=(40, one.nbytes))
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1, 28, 28],
                        "data": one.ravel().tolist(),
                        "parameters": {"shared_memory_region": "good",
                                       "shared_memory_byte_size": one.nbytes}}]}
    r = httpx.post(f"{url}/v2/models/sensai/infer", json=body)
    assert r.status_code == 400 and "both in shared memory and in the request" in r.json()["error"]
    body["inputs"][0].pop("data")
    body["inputs"][0]["parameters"]["shared_memory_byte_size"] = "many"
    r = httpx.post(f"{url}/v2/models/sensai/infer", json=body)
    assert r.status_code == 400 and "non-negative integer" in r.json()["error"]
    # Nothing outside what was asked was written: the input is as the client left it.
    assert (shm.get_contents_as_numpy(handle, np.float32, list(one.shape)) == one).all()
    # And the region still serves.
    inp = hc.InferInput("input", list(one.shape), "FP32").set_shared_memory("good", one.nbytes)
    assert http.infer("sensai", [inp]).as_numpy("scores").shape == (1, 10)
    http.unregister_system_shared_memory("good")
    http.unregister_system_shared_memory("never_registered")  # Triton's rule: not an error
    assert http.get_system_shared_memory_status() == []


def test_a_region_of_a_segment_shrunk_afterwards_fails_its_request_not_the_server(
        server, http, batch, segments):
    x, _, _ = batch
    key, _ = segments(x[:1].nbytes)
    http.register_system_shared_memory("shrunk", key, x[:1].nbytes)
    os.truncate(f"/dev/shm/{key.strip('/')}", 16)
    inp = hc.InferInput("input", [1, 1, 28, 28], "FP32").set_shared_memory("shrunk",
                                                                           x[:1].nbytes)
    assert "shrunk below its region" in refusal(http.infer, "sensai", [inp]).message()
    http.unregister_system_shared_memory("shrunk")
    assert http.is_server_live()


def test_registration_is_for_clients_on_this_host(segments):
    """A client elsewhere shares no memory with the server: its registration is refused (the
    check the routes make with the connection's address; no test may send from another)."""
    from sensai.serving.core.errors import Forbidden
    from sensai.serving.gateway.shared_memory import SystemSharedMemory

    key, _ = segments(64)
    regions = SystemSharedMemory(max_tensor_bytes=1024)
    try:
        with pytest.raises(Forbidden, match="clients on this host"):
            regions.register("far", key, 0, 64, client="192.0.2.7")
        assert regions.status() == []
        regions.register("near", key, 0, 64, client="127.0.0.1")
        assert [r["name"] for r in regions.status()] == ["near"]
    finally:
        regions.close()
    assert regions.status() == []


def test_registrations_are_bounded_and_can_all_be_let_go(segments, monkeypatch):
    """Each registration holds a file open: past the bound one more is refused with its reason,
    and letting every region go still works (a client cannot take every descriptor)."""
    from sensai.serving.core.errors import InputError
    from sensai.serving.gateway import shared_memory

    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 3)
    key, _ = segments(64)
    regions = shared_memory.SystemSharedMemory(max_tensor_bytes=1024)
    try:
        for i in range(3):
            regions.register(f"r{i}", key, 0, 64, client="127.0.0.1")
        with pytest.raises(InputError, match="3 shared memory regions are registered"):
            regions.register("r3", key, 0, 64, client="127.0.0.1")
        regions.unregister()
        assert regions.status() == [] and not regions.regions
        regions.register("r3", key, 0, 64, client="127.0.0.1")
    finally:
        regions.close()


# -------------------------------------------------------------------------------------------
# gRPC streaming


def test_a_stream_answers_each_request_and_a_bad_one_as_an_error(grpc_client, batch):
    x, expected, _ = batch
    answers: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: answers.put((result, error)),
                             stream_timeout=60)
    try:
        for k in range(3):
            grpc_client.async_stream_infer("sensai", [v2_input(gc, x[k:k + 1])],
                                           request_id=f"good-{k}")
        bad = x[:1].copy()
        bad[0, 0, 0, 0] = np.inf
        grpc_client.async_stream_infer("sensai", [v2_input(gc, bad)], request_id="bad")
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        grpc_client.stop_stream()
    errors = [e for r, e in got if e is not None]
    assert len(errors) == 1 and "infinite" in errors[0].message()
    for result, _ in (g for g in got if g[1] is None):
        k = int(result.get_response().id.split("-")[1])
        np.testing.assert_allclose(result.as_numpy("scores")[0], expected[k], atol=1e-4)
    assert sorted(r.get_response().id for r, e in got if e is None) == ["good-0", "good-1",
                                                                        "good-2"]

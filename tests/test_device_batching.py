"""Several subnets in one device process, as on one GPU: each subnet computed once per batch for
every request that needs it, whatever order their runs came in and from whichever gateway.

The in-worker loop is driven directly with the simulated GPU (:class:`SimRunner`: a fixed time per
launch whatever the rows, the wait holding no interpreter lock) and with real ONNX subnets; then a
real server - two gateway processes over one device process that hosts both subnets - answers 64
requests in flight over HTTP on 127.0.0.1, every answer checked against offline evaluation, its
batching read from its own counters.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from sensai.artifact import load_artifact
from sensai.bench.harness import offline_reference
from sensai.data import normalize
from sensai.serving.core.messages import Batching, Done, Output, Run, RunFailed
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.fleet import Fleet
from sensai.serving.workers.loop import Stop, WorkerCore, per_request
from sensai.serving.workers.runners import runner_specs
from sensai.serving.workers.sim import SimRunner, sim_scores
from tests.helpers import offline_scores, png, sample_images, serve_queued, wait_until

SHAPE = (1, 28, 28)


def sims(launch_ms: float, groups=(0, 1), outputs: int = 6) -> dict[int, SimRunner]:
    return {g: SimRunner(input_shape=SHAPE, num_outputs=outputs, launch_ms=launch_ms,
                         name=f"subnet_{g:02d}", batch_rows=8) for g in groups}


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, *SHAPE)).astype(np.float32)


def interleaved(x: np.ndarray) -> list[Run]:
    """Each request's run for subnet 0, then for subnet 1, request after request: what a device
    process hosting two workers' subnets gets from a gateway."""
    return [Run(2 * i + g, x[i:i + 1], (g,), 1) for i in range(len(x)) for g in (0, 1)]


def test_interleaved_runs_of_two_subnets_batch_per_subnet():
    x = rows(6)
    core = WorkerCore(sims(0.0), batching=Batching(max_rows=8))
    events = serve_queued(core, interleaved(x))
    # One batch: each subnet launched once for the six rows that need it.
    assert core.counts.batches == 1 and core.counts.requests == 12
    for g in (0, 1):
        c = core.group_counts[g]
        assert (c.batches, c.requests, c.rows, c.largest) == (1, 6, 6, 6)
    outs = {(e.req, e.group): e.output for e in events if type(e) is Output}
    for i in range(6):
        for g in (0, 1):
            np.testing.assert_array_equal(outs[2 * i + g, g], sim_scores(x[i:i + 1], 6))
    dones = [e for e in events if type(e) is Done]
    assert sorted(d.req for d in dones) == list(range(12))
    # Each Done carries its own subnet's counters.
    assert {d.counts.rows for d in dones} == {6}


def test_a_subnet_is_capped_at_max_rows_and_the_rest_waits_for_the_next_batch():
    core = WorkerCore(sims(0.0), batching=Batching(max_rows=4))
    serve_queued(core, interleaved(rows(10)))
    for g in (0, 1):
        c = core.group_counts[g]
        assert (c.batches, c.rows, c.largest) == (3, 10, 4)  # 4 + 4 + 2 rows


def test_two_subnets_launched_together_take_one_launch_not_two():
    """The simulated GPU, 300 ms a launch: a batch of both subnets is done in about one launch's
    time (each launched before either is waited for), where one after the other takes two."""
    x = rows(4)
    core = WorkerCore(sims(300.0), batching=Batching(max_rows=8))
    t0 = time.perf_counter()
    events = serve_queued(core, interleaved(x))
    took = time.perf_counter() - t0
    assert 0.3 <= took < 0.55, took
    assert all(0.3 * 1e3 <= e.ms < 0.55 * 1e3 for e in events if type(e) is Output)
    one_by_one = sims(300.0)
    t0 = time.perf_counter()
    for g in (0, 1):
        one_by_one[g].run(x)
    assert time.perf_counter() - t0 >= 0.6


def test_the_next_batch_gathers_while_the_device_computes():
    """Runs that arrive while a batch's launch is under way (the waiting thread holds no
    interpreter lock, so they are read meanwhile) all go in the next batch."""
    x = rows(11)
    core = WorkerCore(sims(200.0), batching=Batching(max_rows=16))
    q = queue.SimpleQueue()
    q.put(Run(0, x[0:1], (0,), 1))
    events = []
    loop = threading.Thread(target=core.serve, args=(q, per_request(events.append)))
    loop.start()
    time.sleep(0.05)  # the first launch is under way
    spins = 0
    t_end = time.perf_counter() + 0.1
    while time.perf_counter() < t_end:  # pure Python while the device "computes"
        spins += 1
    for i in range(1, 11):
        q.put(Run(i, x[i:i + 1], (0,), 1))
    q.put(Stop())
    loop.join(5)
    assert spins > 10_000  # this thread ran meanwhile: the wait held no interpreter lock
    c = core.group_counts[0]
    assert (c.batches, c.requests, c.largest) == (2, 11, 10)
    assert core.counts.held == 0  # nobody was held back for company


class Recorded(SimRunner):
    """A simulated subnet that writes each launch into a shared log, beside the answers."""

    def __init__(self, log: list, **kw):
        super().__init__(**kw)
        self.log = log

    def launch(self, parts):
        self.log.append(("launch", self.name, round(float(parts[0][0].ravel()[0]), 4)))
        return super().launch(parts)


def recorded_core(log: list, launch_ms: float, overlap: bool, broken: set = frozenset()):
    runners = {}
    for g in (0, 1):
        r = Recorded(log, input_shape=SHAPE, num_outputs=6, launch_ms=launch_ms,
                     name=f"subnet_{g:02d}", batch_rows=8)
        if g in broken:
            def fail(parts, r=r):
                r.log.append(("launch", r.name, None))
                raise RuntimeError(f"{r.name} failed")
            r.launch = fail
        r.overlaps = overlap  # a device whose launch computes (a CPU's) is never overlapped
        runners[g] = r
    return WorkerCore(runners, batching=Batching(max_rows=1))


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_batch_is_launched_while_the_device_computes_the_one_in_flight(overlap):
    """Four requests queued, one row of each subnet per batch, on the simulated GPU: with
    overlap (always, on GPUs) every batch after the first is launched before the batch in
    flight is answered, so the host's work for one runs while the device computes the other;
    on a device whose launch computes, one batch at a time.  Either way each request gets exactly its own rows back,
    and its Done after them."""
    x = rows(4)
    log: list = []
    core = recorded_core(log, 5.0, overlap)
    assert core.overlap is overlap
    q = queue.SimpleQueue()
    for r in [*interleaved(x), Stop()]:
        q.put(r)
    events = []

    def emit(e):  # in the log as it happens, between the launches
        events.append(e)
        log.append((type(e).__name__, e.req))

    core.serve(q, per_request(emit))
    launches = [i for i, e in enumerate(log) if e[0] == "launch"]
    first_answer = {}
    for i, e in enumerate(log):
        if e[0] == "Output":
            first_answer.setdefault(e[1] // 2, i)
    assert len(launches) == 8  # 4 batches, both subnets each
    for k in range(1, 4):  # batch k's launches against batch k-1's first answer
        launched_k = launches[2 * k]
        assert (launched_k < first_answer[k - 1]) is overlap, log
    outs = {(e.req, e.group): e.output for e in events if type(e) is Output}
    for i in range(4):
        for g in (0, 1):
            np.testing.assert_array_equal(outs[2 * i + g, g], sim_scores(x[i:i + 1], 6))
    for req in range(8):
        kinds = [type(e).__name__ for e in events if e.req == req]
        assert kinds == ["Output", "Done"], (req, kinds)


def test_overlap_keeps_failures_to_their_own_subnet_and_a_stop_answers_the_batch_in_flight():
    """Subnet 1 fails every launch: subnet 0's answers come as ever, subnet 1's requests each
    fail alone; the Stop behind the last run still gets the batch in flight answered first.
    A runner that computes as it launches (ONNX Runtime on a CPU) is never overlapped."""
    x = rows(3)
    log: list = []
    core = recorded_core(log, 2.0, True, broken={1})
    events = serve_queued(core, interleaved(x))
    by_req = {}
    for e in events:
        by_req.setdefault(e.req, []).append(type(e).__name__)
    for i in range(3):
        assert by_req[2 * i] == ["Output", "Done"]
        assert by_req[2 * i + 1] == ["RunFailed", "Done"], by_req
    failed = [e for e in events if type(e) is RunFailed]
    assert all("subnet_01 failed" in e.error for e in failed)
    outs = {e.req: e.output for e in events if type(e) is Output}
    for i in range(3):
        np.testing.assert_array_equal(outs[2 * i], sim_scores(x[i:i + 1], 6))


def test_a_batch_in_flight_is_not_kept_waiting_while_the_next_waits_for_company():
    """A worker that may hold a request 2 s for company does so only with nothing in flight:
    the run gathered while a batch is in flight goes as it is, and the batch in flight is
    answered within its launch's time, not the company's."""
    x = rows(3)
    core = WorkerCore(sims(5.0, groups=(0,)), batching=Batching(max_rows=2, delay_us=2e6))
    q = queue.SimpleQueue()
    q.put(Run(0, x[:2], (0,), 1))  # a full batch: it goes at once
    q.put(Run(1, x[2:], (0,), 1))  # the next batch, room for company, gathered with 0 in flight
    answered = {}
    t0 = time.perf_counter()

    def emit(e):
        if type(e) is Output:
            answered[e.req] = time.perf_counter() - t0

    loop = threading.Thread(target=core.serve, args=(q, per_request(emit)))
    loop.start()
    wait_until(lambda: len(answered) == 2, 10, "both answers")
    q.put(Stop())
    loop.join(5)
    assert answered[0] < 1.0 and answered[1] < 1.0, answered


def test_the_simulated_gpu_holds_its_staging_buffer_until_the_launch_is_done():
    """As the CUDA-graph runner's pinned buffers: a second launch before the first is read
    waits for the first (which is then read), and each launch answers its own rows."""
    r = sims(50.0, groups=(0,))[0]
    x = rows(2)
    t0 = time.perf_counter()
    first = r.launch((x[:1],))
    assert not first.waited
    second = r.launch((x[1:],))
    assert first.waited and time.perf_counter() - t0 >= 0.05
    np.testing.assert_array_equal(first.result(), sim_scores(x[:1], 6))
    np.testing.assert_array_equal(second.result(), sim_scores(x[1:], 6))


def test_cpu_runners_are_never_overlapped(tiny_artifact):
    specs = runner_specs(load_artifact(tiny_artifact), device="cpu", runtime="onnx")
    core = WorkerCore({i: s.build() for i, s in enumerate(specs)}, batching=Batching())
    assert core.overlap is False
    assert WorkerCore(sims(0.0), batching=Batching()).overlap is True


def test_one_subnet_failing_fails_only_its_own_answers(tiny_artifact):
    """A device's subnet 1 fails; subnet 0's answers to the same requests, in the same batch,
    come as if nothing happened."""
    spec = runner_specs(load_artifact(tiny_artifact), device="cpu", runtime="onnx")[0]
    real = spec.build()

    class Broken:
        name, device, runtime = "subnet_01", "cpu", "onnx"

        def run(self, x):
            raise RuntimeError("device lost")

    x = rows(5)
    core = WorkerCore({0: real, 1: Broken()}, batching=Batching(max_rows=8))
    events = serve_queued(core, interleaved(x))
    outs = {e.req: e.output for e in events if type(e) is Output}
    failed = {e.req: e.error for e in events if type(e) is RunFailed}
    assert sorted(outs) == [0, 2, 4, 6, 8] and sorted(failed) == [1, 3, 5, 7, 9]
    assert all("device lost" in why for why in failed.values())
    for i in range(5):
        np.testing.assert_allclose(outs[2 * i], real.run(x[i:i + 1]), atol=1e-5)
    assert core.group_counts[0].largest == 5


# --------------------------------------------------------------------------------------------
# A server: two gateway processes over one device process that hosts every subnet


def many(url: str, images, concurrency: int) -> list[tuple[int, dict]]:
    """Every image once, ``concurrency`` in flight, each on a connection of its own (the kernel
    spreads them over the gateway processes)."""
    def one(img):
        with httpx.Client(timeout=60) as c:
            r = c.post(f"{url}/v1/predict", params={"top_k": 10}, content=png(img))
            return r.status_code, r.json()

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, images))


def scores(body: dict) -> np.ndarray:
    out = np.zeros(len(body["predictions"]), dtype=np.float32)
    for p in body["predictions"]:
        out[p["index"]] = p["score"]
    return out


def counters(url: str) -> dict[str, dict]:
    """Each worker's batching, the largest figure any gateway knows."""
    best: dict[str, dict] = {}
    for _ in range(20):
        with httpx.Client(timeout=30) as c:
            for w in c.get(f"{url}/v1/models").json()["predictor"]["workers"]:
                seen = best.setdefault(w["name"], dict(w["batching"], pid=w["pid"]))
                for k in ("batches", "requests", "rows", "largest", "held", "mixed"):
                    seen[k] = max(seen[k], w["batching"][k])
    return best


@pytest.mark.slow
def test_two_gateways_over_one_device_process_answer_as_offline_evaluation(
        tiny_artifact, fmnist_test, fmnist_spec):
    """Every CPU worker in one device process (``device_processes=1``), as on one GPU; killed,
    it takes every worker down and brings them all back, answering as before."""
    _, images, _ = sample_images(fmnist_test, 64, seed=3)
    expected = offline_scores(tiny_artifact, images, fmnist_spec)
    settings = GatewaySettings(port=0, device="cpu", log_level="warning", deadline_s=30,
                               device_processes=1)
    with Fleet(tiny_artifact, settings, processes=2) as server:
        devices = [m for m in server.describe()["processes"] if m["role"] == "device"]
        assert len(devices) == 1  # all five subnets in one device process
        for rounds in range(4):
            answers = many(server.url, list(images) * 2, 64)
            for i, (status, body) in enumerate(answers):
                assert status == 200, body
                np.testing.assert_allclose(scores(body), expected[i % len(images)], atol=1e-4)
            got = counters(server.url)
            if all(c["rows"] > c["batches"] for c in got.values()):
                break
        assert len({c["pid"] for c in got.values()}) == 1
        # Every subnet ran more rows than batches: batched across requests and gateways, though
        # each request's runs for the five subnets arrived one after another.
        for name, c in got.items():
            assert c["rows"] > c["batches"] and c["largest"] > 1, (name, c)
        assert max(c["mixed"] for c in got.values()) > 0  # rows of both gateways in one batch
        assert all(c["held"] == 0 for c in got.values())  # no request waited for company
        assert all(c["max_rows"] == 8 for c in got.values())  # the CPU default
        victim = devices[0]["pid"]
        os.kill(victim, signal.SIGKILL)

        def back() -> bool:
            with httpx.Client(timeout=30) as c:
                workers = c.get(f"{server.url}/v1/models").json()["predictor"]["workers"]
            return all(w["state"] == "up" and w["pid"] != victim for w in workers)

        wait_until(back, 90, "every worker back in a new device process", period_s=0.5)
        pids = {w["pid"] for w in httpx.get(f"{server.url}/v1/models").json()["predictor"][
            "workers"]}
        assert len(pids) == 1 and victim not in pids
        for i, (status, body) in enumerate(many(server.url, images[:8], 8)):
            assert status == 200, body
            np.testing.assert_allclose(scores(body), expected[i], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("gateways", [1, 2])
def test_the_sim_runtime_puts_every_subnet_in_one_device_process(tiny_artifact_g2, fmnist_test,
                                                                 fmnist_spec, gateways):
    """``--runtime sim`` as a GPU's stand-in: one device process for both subnets, the GPU's
    batch size, answers the simulation's own; a request alone is answered without waiting for
    company - behind two gateway processes, and behind one (``--backend processes`` on a
    small host)."""
    _, images, _ = sample_images(fmnist_test, 8, seed=4)
    settings = GatewaySettings(port=0, backend="processes", device="cpu", runtime="sim:1",
                               log_level="warning")
    art = load_artifact(tiny_artifact_g2)
    with Fleet(tiny_artifact_g2, settings, processes=gateways) as server:
        devices = [m for m in server.describe()["processes"] if m["role"] == "device"]
        assert len(devices) == 1
        for img in images:  # one at a time
            status, body = many(server.url, [img], 1)[0]
            assert status == 200
            x = normalize(img[None], fmnist_spec).numpy()
            want = offline_reference(art, [x], runtime="sim")[0]
            np.testing.assert_allclose(scores(body), want, atol=1e-5)
        got = counters(server.url)
        assert all(c["max_rows"] == 128 and c["held"] == 0 for c in got.values())
        assert all(c["requests"] == len(images) for c in got.values())

"""Robust class parallelism on Ray (``robust_predictor(..., backend="ray")``): the workers are Ray
actors on a real local Ray instance, running the real ONNX subnets of ``tiny_artifact`` on real
Fashion-MNIST test images; a killed actor is restarted by Ray itself (``max_restarts=-1``) and
taken back by the predictor; the r = 0 outage is seen through the real gateway on 127.0.0.1.
No timing thresholds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from sensai.errors import SensaiError
from sensai.serving.robust import ray_actor_options
# The same images (and helpers) as the local backend's tests: both must answer like offline.
from tests.test_robust import (_predict_all, check_r0_outage_over_http,  # noqa: F401
                               check_straggler_is_overtaken, images)
from tests.test_serving_local import free_port, wait_for_server

pytestmark = pytest.mark.slow  # one Ray instance and ~15 actor starts: about a minute

N = 8
# Two predictors of 5 actors (and the CLI's) must fit the 2 CPUs of the test's Ray instance.
ACTOR_CPUS = 0.15


def test_ray_actor_resources_follow_the_cluster():
    assert ray_actor_options(5, 2, 0) == ({"num_cpus": 0.33}, 1)  # an even share with the gateway
    assert ray_actor_options(5, 16, 0) == ({"num_cpus": 1.0}, 1)
    assert ray_actor_options(2, 16, 0, cpus=4) == ({"num_cpus": 4.0}, 4)  # 4 ORT threads
    opts, threads = ray_actor_options(5, 16, 8)
    assert opts == {"num_cpus": 1.0, "num_gpus": 1.0} and threads == 1
    assert ray_actor_options(5, 16, 2)[0]["num_gpus"] == 0.4  # fewer GPUs than workers: shared
    assert "num_gpus" not in ray_actor_options(5, 16, 8, device="cpu")[0]
    for kwargs, fragment in (({"cpus": 1.0}, "do not fit"), ({"device": "cuda"}, "no GPU"),
                             ({"device": "mps"}, "auto, cpu or cuda"), ({"cpus": 0}, "> 0")):
        with pytest.raises(SensaiError, match=fragment):
            ray_actor_options(5, 2, 0, **kwargs)


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance of 2 CPUs for this module only (other modules start their own)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def r1(ray_instance, tiny_artifact):
    """Redundancy 1 on W = G = 5 Ray actors; a restarted actor is taken back after 1 s, which
    leaves a window in which its groups are served by their copies only."""
    from sensai.serving.robust import robust_predictor

    pred = robust_predictor(tiny_artifact, redundancy=1, backend="ray", device="cpu",
                            deadline_s=30, ray_cpus=ACTOR_CPUS, restart_delay_s=1.0)
    yield pred
    pred.shutdown()


def test_ray_r1_answers_equal_offline_evaluation(r1, images):
    d = r1.describe()
    assert d["backend"] == "ray" and d["redundancy"] == 1
    assert d["placement"] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0]]
    workers = d["workers"]
    assert [w["state"] for w in workers] == ["up"] * 5
    # Five actors, five processes of Ray's, none of them this one.
    assert len({w["actor_id"] for w in workers}) == 5
    assert len({w["pid"] for w in workers}) == 5 and os.getpid() not in {w["pid"] for w in workers}
    assert all(w["device"] == "cpu" and w["runtime"] == "onnx" for w in workers)
    assert workers[0]["resources"] == {"num_cpus": ACTOR_CPUS}
    preds = _predict_all(r1, images["x"])
    for i, p in enumerate(preds):
        assert not p.degraded
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=1e-4)
        for g in range(5):
            assert p.answered_by[f"subnet_{g:02d}"] in (f"worker_{g:02d}",
                                                        f"worker_{(g - 1) % 5:02d}")

    async def concurrent():
        return await asyncio.gather(*[r1.predict(x) for x in images["x"] * 2])

    for i, p in enumerate(asyncio.run(concurrent())):
        np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=1e-4)
    batch = asyncio.run(r1.predict(np.concatenate(images["x"])))
    np.testing.assert_allclose(batch.scores, images["offline"], atol=1e-4)
    assert "worker_00: subnet_00, subnet_01 (copy)" in r1.placement_table()


def test_ray_straggler_is_overtaken_by_its_copy(r1, images):
    """Fault injection reaches the actor: the copy overtakes the delayed worker."""
    check_straggler_is_overtaken(r1, images, atol=1e-4)


def test_ray_vote_mode_outvotes_a_corrupting_actor(ray_instance, tiny_artifact, images):
    from sensai.serving.robust import robust_predictor

    pred = robust_predictor(tiny_artifact, redundancy=1, vote=True, corrupt=[2], backend="ray",
                            device="cpu", deadline_s=30, ray_cpus=ACTOR_CPUS)
    try:
        d = pred.describe()
        assert d["copies_per_group"] == 3 and d["agreeing_copies_needed"] == 2
        assert d["workers"][2]["injected_corruption"]
        preds = _predict_all(pred, images["x"])
        for i, p in enumerate(preds):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=1e-4)
            assert "worker_02" not in p.answered_by.values()
        assert pred.describe()["workers"][2]["outvoted"] > 0
    finally:
        pred.shutdown()


def test_ray_restarts_a_killed_actor_and_no_request_is_lost(r1, images):
    victim = r1.workers[3]
    old_pid, actor_id = victim.pid, victim.actor_id
    seen: list[tuple[str, str, object]] = []

    async def stream():
        # Paced requests from before the kill until N requests after the actor is back up.
        i, saw_down, back_at = 0, False, None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (back_at is None or i < back_at + N):
            before = victim.state
            task = asyncio.ensure_future(r1.predict(images["x"][i % N]))
            if i == 3:
                await asyncio.sleep(0)  # dispatched to every actor; now one is killed
                assert r1.kill_worker(3) == old_pid
            p = await task
            after = victim.state
            seen.append((before, after, p))
            saw_down = saw_down or "up" not in (before, after)
            if saw_down and back_at is None and after == "up":
                back_at = i
            i += 1
            await asyncio.sleep(0.02)

    asyncio.run(stream())
    for i, (_, _, p) in enumerate(seen):
        assert not p.degraded
        np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=1e-4)
    # The death was detected: requests went out while the actor was down (marked so before and
    # after them), and its group was answered by the copy on worker 2.
    during = [p for before, after, p in seen if before != "up" and after != "up"]
    assert during, "the killed actor was never seen down"
    assert all(p.answered_by["subnet_03"] == "worker_02" for p in during)
    assert r1.wait_until_up(3, 120), r1.describe()["workers"][3]
    w = r1.describe()["workers"][3]
    # Ray restarted the same actor in a new process; the predictor took it back.
    assert w["deaths"] == 1 and w["restarts"] == 1
    assert w["actor_id"] == actor_id and w["pid"] != old_pid
    runs0 = victim.runs
    preds = _predict_all(r1, images["x"])
    for i, p in enumerate(preds):
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=1e-4)
    deadline = time.monotonic() + 30
    while victim.runs == runs0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim.runs > runs0  # it computes again
    # Its own group first: the restarted actor answers subnet_03 in some of those requests.
    assert any(p.answered_by["subnet_03"] == "worker_03" for p in preds)


def test_ray_r0_killed_actor_gives_503_naming_its_classes(ray_instance, tiny_artifact, images,
                                                         fmnist_spec):
    from sensai.manifest import load_manifest
    from sensai.serving.robust import robust_predictor

    groups = load_manifest(tiny_artifact).groups
    lost = [fmnist_spec.classes[c] for c in groups[1]]
    # Ray restarts the actor at once; the predictor waits 4 s before taking it back, which
    # keeps the outage open long enough to look at it.
    pred = robust_predictor(tiny_artifact, redundancy=0, backend="ray", device="cpu",
                            deadline_s=30, ray_cpus=ACTOR_CPUS, restart_delay_s=4.0)
    assert pred.describe()["backend"] == "ray"
    check_r0_outage_over_http(pred, images, groups, lost, kill_wait_s=60)


# --------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("argv,fragment", [
    (["--backend", "triton", "--redundancy", "1"], "local and ray backends, not --backend triton"),
    (["--backend", "ray", "--redundancy", "1", "--ray-cpus", "0"], "--ray-cpus must be > 0"),
    (["--backend", "ray", "--redundancy", "5"], "r+1 = 6 copies"),
])
def test_serve_rejects_bad_ray_redundancy_flags_in_one_line(tiny_artifact, capsys, argv,
                                                            fragment):
    from sensai.cli import main

    assert main(["serve", str(tiny_artifact), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_sensai_serve_backend_ray_with_redundancy(ray_instance, tiny_artifact, images):
    """`sensai serve --backend ray --redundancy 1` joins this module's Ray instance, prints the
    placement, answers over HTTP and stops cleanly on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                             "--backend", "ray", "--redundancy", "1", "--port", str(port),
                             "--ray-address", ray_instance, "--ray-cpus", "0.1",
                             "--device", "cpu", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=180)
        info = httpx.get(f"{url}/v1/models").json()["predictor"]
        assert info["backend"] == "ray" and info["placement"][4] == [4, 0]
        assert info["workers"][0]["resources"] == {"num_cpus": 0.1}
        r = httpx.post(f"{url}/v1/predict", params={"top_k": 10}, content=images["png"][0],
                       timeout=30)
        assert r.status_code == 200, r.text
        got = {p["index"]: p["score"] for p in r.json()["predictions"]}
        np.testing.assert_allclose([got[k] for k in range(10)], images["offline"][0], atol=1e-4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read().decode()
        assert "Ray actors (restarted by Ray)" in err and "placement:" in err
        assert "worker_04: subnet_04, subnet_00 (copy)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

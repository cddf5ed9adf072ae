"""Robust class parallelism (serving.robust): redundant placement, decoding, failure handling.

Pure parts (placement, decoder, delay specs) are tested directly; the rest with real worker
processes running the real ONNX subnets of ``tiny_artifact`` on real Fashion-MNIST test images,
a real SIGKILL, and the real gateway under uvicorn on 127.0.0.1.  No timing thresholds: a delayed
worker must *lose the race* to its copies, not beat a clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from sensai.errors import SensaiError
from sensai.serving.robust import (CoverageDecoder, check_robust_args, cyclic_placement, group_hosts,
                            parse_delay)
from tests.test_serving_local import (free_port, offline_scores, png, sample_images, start_gateway,
                                     wait_for_server)

N = 8


# --------------------------------------------------------------------------------------------
# Placement


def test_cyclic_placement_worker_w_hosts_groups_w_to_w_plus_r():
    assert cyclic_placement(5, 5, 0) == [[0], [1], [2], [3], [4]]
    assert cyclic_placement(5, 5, 1) == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0]]
    p = cyclic_placement(5, 5, 2)
    assert p == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 0], [4, 0, 1]]
    hosts = group_hosts(p, 5)
    # Group g: primary on worker g, copies on g-1, g-2; always distinct workers.
    assert hosts[0] == [0, 4, 3] and hosts[3] == [3, 2, 1]
    assert all(len(set(h)) == 3 for h in hosts)
    # Fewer workers than groups: each worker hosts several primaries, copies still distinct.
    p = cyclic_placement(5, 2, 1)
    assert sorted(p[0]) == sorted(p[1]) == [0, 1, 2, 3, 4]
    assert all(len(set(h)) == 2 for h in group_hosts(p, 5))


@pytest.mark.parametrize("g,w,r,fragment", [
    (5, 5, 5, "between 0 and workers - 1 = 4"),
    (5, 5, -1, "between 0 and"),
    (5, 0, 0, "at least one worker"),
    (2, 3, 0, "without a subnet"),
    (5, 5, 1.5, "integer"),
])
def test_cyclic_placement_rejects_impossible_settings(g, w, r, fragment):
    with pytest.raises(SensaiError, match=fragment):
        cyclic_placement(g, w, r)


def test_robust_args_vote_needs_2r_plus_1_workers():
    assert check_robust_args(5, None, 2, True) == 5  # 5 copies on 5 workers
    with pytest.raises(SensaiError, match="2r\\+1 = 7"):
        check_robust_args(5, None, 3, True)
    with pytest.raises(SensaiError, match="--vote needs --redundancy >= 1"):
        check_robust_args(5, None, 0, True)
    with pytest.raises(SensaiError, match="r\\+1 = 6"):
        check_robust_args(5, None, 5, False)
    assert check_robust_args(5, 3, 2, False) == 3


# --------------------------------------------------------------------------------------------
# Decoder


def test_decoder_first_arrival_wins_and_later_copies_are_dropped():
    hosts = group_hosts(cyclic_placement(3, 3, 1), 3)  # g on [g, g-1]
    dec = CoverageDecoder(hosts)
    a, b = np.array([[1.0, 2.0]]), np.array([[9.0, 9.0]])
    assert dec.add(0, 2, a)  # the copy on worker 2 arrives first: it decides group 0
    assert not dec.add(0, 0, b)  # the primary, later: dropped
    assert dec.dropped == 1 and dec.decided[0].worker == 2 and dec.decided[0].output is a
    assert not dec.complete and not dec.finished(False)
    assert not dec.add(1, 2, a)  # worker 2 does not host group 1: ignored
    dec.add(1, 1, a)
    dec.add(2, 2, a)
    assert dec.complete and dec.finished(False) and dec.undecided() == []


def test_decoder_knows_when_coverage_is_out_of_reach():
    hosts = group_hosts(cyclic_placement(3, 3, 0), 3)
    dec = CoverageDecoder(hosts)
    assert dec.lose(1, reason="worker_01 is down") == [1]
    assert dec.blocked and dec.unreachable() == [1]
    assert dec.finished(allow_partial=False)  # a full answer is impossible: fail now
    assert not dec.finished(allow_partial=True)  # a partial one waits for groups 0 and 2
    dec.add(0, 0, np.zeros((1, 3)))
    dec.add(2, 2, np.zeros((1, 3)))
    assert dec.settled and dec.finished(True) and dec.undecided() == [1]
    assert dec.lost_reasons[1] == ["worker_01 is down"]
    # With a copy, losing one worker blocks nothing.
    dec = CoverageDecoder(group_hosts(cyclic_placement(3, 3, 1), 3))
    assert dec.lose(1) == [] and not dec.blocked


def test_decoder_loses_only_the_named_workers_copies():
    hosts = group_hosts(cyclic_placement(3, 3, 1), 3)
    assert hosts == [[0, 2], [1, 0], [2, 1]]
    dec = CoverageDecoder(hosts)
    assert dec.lose(1) == []  # groups 1 and 2 keep their copies on workers 0 and 2
    assert dec.lose(0) == [1]  # group 1 was on workers 1 and 0: both gone
    assert dec.waiting_on(0) == [2] and dec.waiting_on(2) == [2]
    assert dec.lose(2, group=0, reason="subnet_00 raised") == [0]
    assert dec.waiting_on(2) == [2]


def test_decoder_vote_outvotes_a_wrong_copy():
    hosts = [[0, 1, 2]]  # one group, three copies: a majority of 2 decides
    good, bad = np.array([[0.5, -1.0, 2.0]]), np.array([[5.0, 5.0, -5.0]])
    dec = CoverageDecoder(hosts, need=2)
    assert not dec.add(0, 1, bad)  # the wrong copy arrives first and alone
    assert not dec.add(0, 0, good + 1e-7)  # one good copy: 1 vs 1, undecided
    assert dec.add(0, 2, good)  # second good copy: decided, the wrong one outvoted
    d = dec.decided[0]
    assert d.voters == [0, 2] and d.outvoted == [1]
    np.testing.assert_allclose(d.output, good, atol=1e-6)
    # Two copies disagreeing and the third lost: no majority is possible any more.
    dec = CoverageDecoder(hosts, need=2)
    dec.add(0, 0, good)
    dec.add(0, 1, bad)
    assert dec.lose(2) == [0] and dec.blocked


def test_parse_delay_specs():
    import random

    rng = random.Random(0)
    assert parse_delay("fixed:50ms").sample(rng) == pytest.approx(0.05)
    assert parse_delay("fixed:0.2s").a == pytest.approx(0.2)
    assert parse_delay("fixed:30").a == pytest.approx(0.03)  # bare numbers are ms
    e = parse_delay("exp:20ms")
    samples = [e.sample(rng) for _ in range(4000)]
    assert min(samples) >= 0 and 0.015 < np.mean(samples) < 0.025
    u = parse_delay("uniform:10ms-30ms")
    assert all(0.01 <= u.sample(rng) <= 0.03 for _ in range(100))
    p = parse_delay("fixed:100ms@0.1")
    hits = sum(p.sample(rng) > 0 for _ in range(4000))
    assert 250 < hits < 550 and p.mean() == pytest.approx(0.01)
    for bad in ("", "50ms", "gauss:1ms", "fixed:abc", "uniform:5ms", "uniform:9ms-1ms",
                "fixed:5ms@0", "fixed:5ms@x"):
        with pytest.raises(SensaiError):
            parse_delay(bad)


# --------------------------------------------------------------------------------------------
# Real worker processes


@pytest.fixture(scope="module")
def images(fmnist_test, fmnist_spec, tiny_artifact):
    """N real test images: normalized inputs, PNGs, and offline evaluation's scores."""
    from sensai.data import normalize

    _, u8, _ = sample_images(fmnist_test, N, seed=3)
    xs = [normalize(u8[i:i + 1], fmnist_spec).numpy() for i in range(N)]
    return {"x": xs, "png": [png(u8[i]) for i in range(N)],
            "offline": offline_scores(tiny_artifact, u8, fmnist_spec)}


@pytest.fixture(scope="module")
def r1(tiny_artifact):
    """Redundancy 1 on W = G = 5 worker processes."""
    from sensai.serving.robust import robust_predictor

    pred = robust_predictor(tiny_artifact, redundancy=1, device="cpu", deadline_s=30)
    yield pred
    pred.shutdown()


def _predict_all(pred, xs, **kw):
    async def go():
        return [await pred.predict(x, **kw) for x in xs]

    return asyncio.run(go())


def test_r1_answers_equal_offline_and_follow_the_placement(r1, images):
    d = r1.describe()
    assert d["strategy"] == "class-parallel-robust" and d["redundancy"] == 1
    assert d["placement"] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0]]
    assert [w["state"] for w in d["workers"]] == ["up"] * 5
    assert len({w["pid"] for w in d["workers"]}) == 5 and os.getpid() not in \
        {w["pid"] for w in d["workers"]}
    preds = _predict_all(r1, images["x"])
    for i, p in enumerate(preds):
        assert not p.degraded
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=2e-5)
        for g in range(5):
            # Whoever answered subnet g hosts it: its primary (worker g) or the copy (g-1).
            assert p.answered_by[f"subnet_{g:02d}"] in (f"worker_{g:02d}",
                                                        f"worker_{(g - 1) % 5:02d}")


def test_concurrent_requests_are_decoded_independently(r1, images):
    async def go():
        return await asyncio.gather(*[r1.predict(x) for x in images["x"] * 2])

    preds = asyncio.run(go())
    for i, p in enumerate(preds):
        np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=2e-5)
    # A batch goes through the same path (KServe v2 sends several rows at once).
    batch = asyncio.run(r1.predict(np.concatenate(images["x"])))
    np.testing.assert_allclose(batch.scores, images["offline"], atol=2e-5)


def check_straggler_is_overtaken(r1, images, *, atol: float) -> None:
    """Worker 2 sleeps 300 ms before every request: subnet_02 is answered by worker 1's copy
    in most requests, and the answers are the no-straggler answers (any backend)."""
    r1.inject(2, delay="fixed:300ms")
    try:
        preds = _predict_all(r1, images["x"])
    finally:
        r1.inject(2, delay=None)
    by = [p.answered_by["subnet_02"] for p in preds]
    assert by.count("worker_01") > len(by) / 2, by
    for i, p in enumerate(preds):
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=atol)


def test_straggler_is_overtaken_by_its_copy(r1, images):
    check_straggler_is_overtaken(r1, images, atol=2e-5)
    assert r1.describe()["workers"][2].get("injected_delay") is None


def test_killed_worker_with_r1_loses_no_request_and_rejoins(r1, images):
    victim = r1.workers[3]
    old_pid = victim.pid

    async def go():
        out = []
        for i, x in enumerate(images["x"] * 2):
            task = asyncio.ensure_future(r1.predict(x))
            if i == 2:
                await asyncio.sleep(0)  # dispatched to every worker; now one dies mid-request
                os.kill(old_pid, signal.SIGKILL)
            out.append(await task)
        return out

    preds = asyncio.run(go())
    assert len(preds) == 2 * N
    for i, p in enumerate(preds):
        assert not p.degraded
        np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=2e-5)
    assert r1.wait_until_up(3, 120), r1.describe()["workers"][3]
    w = r1.describe()["workers"][3]
    assert w["restarts"] == 1 and w["deaths"] == 1 and w["pid"] != old_pid
    runs0 = victim.runs
    preds = _predict_all(r1, images["x"])  # it serves again
    for i, p in enumerate(preds):
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=2e-5)
    deadline = time.monotonic() + 30
    while victim.runs == runs0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim.runs > runs0


def test_vote_mode_outvotes_a_corrupting_worker(tiny_artifact, images):
    from sensai.serving.robust import robust_predictor

    pred = robust_predictor(tiny_artifact, redundancy=1, vote=True, corrupt=[2], device="cpu",
                            deadline_s=30)
    try:
        d = pred.describe()
        assert d["vote"] and d["copies_per_group"] == 3 and d["agreeing_copies_needed"] == 2
        assert d["workers"][2]["injected_corruption"]
        preds = _predict_all(pred, images["x"])
        for i, p in enumerate(preds):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=2e-5)
            assert "worker_02" not in p.answered_by.values()
        # Its copies did arrive before some decisions, and lost the vote.
        assert pred.describe()["workers"][2]["outvoted"] > 0
    finally:
        pred.shutdown()


# --------------------------------------------------------------------------------------------
# Over HTTP: r = 0 and a dead worker


def check_r0_outage_over_http(pred, images, groups, lost, *, kill_wait_s: float = 30) -> None:
    """With r = 0, kill worker 1 behind a real gateway: 503 naming its classes, not ready, a
    degraded partial answer over the other groups when asked for, then recovery (any backend)."""
    server = start_gateway(pred, deadline_s=30)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            info = c.get("/v1/models").json()["predictor"]
            assert info["redundancy"] == 0 and info["placement"] == [[0], [1], [2], [3], [4]]
            r = c.post("/v1/predict", content=images["png"][0])
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["degraded"] is False and body["answered_by"]["subnet_01"] == "worker_01"

            pred.kill_worker(1)
            deadline = time.monotonic() + kill_wait_s
            while pred.worker_states()[1] == "up":  # until the death is noticed
                assert time.monotonic() < deadline, "the killed worker was never marked down"
                time.sleep(0.01)
            r = c.post("/v1/predict", content=images["png"][0])
            assert r.status_code == 503, r.text
            err = r.json()
            assert err["missing_classes"] == lost and err["subnet"] == "subnet_01"
            assert all(name in err["error"] for name in lost) and "worker_01" in err["error"]
            assert c.get("/v2/health/ready").status_code == 503

            r = c.post("/v1/predict", params={"allow_partial": "true", "top_k": 10},
                       content=images["png"][0])
            assert r.status_code == 200, r.text
            part = r.json()
            assert part["degraded"] is True and part["missing_classes"] == lost
            covered = [c_ for g in (0, 2, 3, 4) for c_ in groups[g]]
            assert sorted(part["covered_classes"]) == sorted(covered)
            assert {p["index"] for p in part["predictions"]} == set(covered)
            assert sum(p["score"] for p in part["predictions"]) == pytest.approx(1, abs=1e-4)
            assert "subnet_01" not in part["answered_by"]

            # The same over KServe v2: 503 by default, a flagged partial answer when asked.
            x = images["x"][0]
            v2 = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                              "data": x.ravel().tolist()}],
                  "outputs": [{"name": "scores"}, {"name": "class_index"},
                              {"name": "scores", "parameters": {"classification": 10}}]}
            r = c.post("/v2/models/sensai/infer", json=v2)
            assert r.status_code == 503 and r.json()["missing_classes"] == lost, r.text
            r = c.post("/v2/models/sensai/infer", json={**v2, "parameters": {"allow_partial": 1}})
            assert r.status_code == 400 and "allow_partial" in r.json()["error"]
            r = c.post("/v2/models/sensai/infer",
                       json={**v2, "parameters": {"allow_partial": True}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["parameters"]["degraded"] is True
            assert json.loads(body["parameters"]["missing_classes"]) == lost
            assert sorted(json.loads(body["parameters"]["covered_classes"])) == sorted(covered)
            scores, index, ranking = body["outputs"]
            assert index["data"][0] in covered
            assert all(scores["data"][c_] == 0 for c_ in groups[1])
            assert [int(e.split(":")[1]) for e in ranking["data"]] and \
                {int(e.split(":")[1]) for e in ranking["data"]} == set(covered)

            assert pred.wait_until_up(1, 120)
            assert c.get("/v2/health/ready").status_code == 200
            for i in range(3):
                r = c.post("/v1/predict", content=images["png"][i])
                assert r.status_code == 200, r.text
                assert r.json()["degraded"] is False
                assert r.json()["answered_by"]["subnet_01"] == "worker_01"
                assert r.json()["index"] == int(np.argmax(images["offline"][i]))
    finally:
        server.stop()


def test_r0_dead_worker_gives_503_naming_classes_or_a_degraded_answer(tiny_artifact, images,
                                                                      fmnist_spec):
    from sensai.manifest import load_manifest
    from sensai.serving.robust import robust_predictor

    groups = load_manifest(tiny_artifact).groups
    lost = [fmnist_spec.classes[c] for c in groups[1]]
    # A restart delay keeps the outage open long enough to look at it.
    pred = robust_predictor(tiny_artifact, redundancy=0, device="cpu", deadline_s=30,
                            restart_delay_s=4.0)
    check_r0_outage_over_http(pred, images, groups, lost)


# --------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("argv,fragment", [
    (["--redundancy", "5"], "r+1 = 6 copies"),
    (["--redundancy", "2", "--vote", "--workers", "4"], "2r+1 = 5"),
    (["--vote"], "only apply with --redundancy"),
    (["--redundancy", "1", "--backend", "triton"], "local and ray backends"),
    (["--redundancy", "1", "--inject-delay", "9=fixed:5ms"], "no worker 9"),
    (["--redundancy", "1", "--inject-delay", "1=sometimes"], "bad delay"),
])
def test_serve_rejects_bad_redundancy_flags_before_loading(tiny_artifact, capsys, argv, fragment):
    from sensai.cli import main

    assert main(["serve", str(tiny_artifact), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_bench_robust_rejects_bad_arguments(tiny_artifact, tmp_path, capsys):
    from sensai.cli import main

    for argv, fragment in ((["--straggler", "7"], "worker index 0..4"),
                           (["--delay", "soon"], "bad delay"),
                           (["--redundancy", "5"], "r+1 = 6"),
                           (["--kill-at", "1.5"], "--kill-at")):
        assert main(["bench-robust", str(tiny_artifact), "--out", str(tmp_path / "o"),
                     *argv]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err


@pytest.mark.slow
def test_sensai_serve_with_redundancy_shows_placement_and_answers(tiny_artifact, images):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                             "--redundancy", "1", "--port", str(port), "--device", "cpu",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        info = httpx.get(f"{url}/v1/models").json()["predictor"]
        assert info["redundancy"] == 1 and info["placement"][4] == [4, 0]
        r = httpx.post(f"{url}/v1/predict", content=images["png"][0], timeout=30)
        assert r.status_code == 200, r.text
        assert set(r.json()["answered_by"]) == {f"subnet_{g:02d}" for g in range(5)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read().decode()
        assert "placement:" in err and "worker_04: subnet_04, subnet_00 (copy)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_bench_robust_reports_straggler_and_failure(tiny_artifact, tmp_path):
    import json

    from sensai.serving.bench_robust import run_robust_bench

    out = tmp_path / "robust"
    res = run_robust_bench(tiny_artifact, out, redundancies=(0, 1), images=20, warmup=2,
                           rounds=2, delay="fixed:100ms", straggler=2, victim=1, kill_at=0.25,
                           restart_delay_s=2.0, progress=False)
    for f in ("robust.json", "robust.md", "robust.png"):
        assert (out / f).stat().st_size > 0
    assert json.loads((out / "robust.json").read_text())["kind"] == "sensai-bench-robust"
    r0, r1 = res["configs"]["r=0"]["scenarios"], res["configs"]["r=1"]["scenarios"]
    for per in (r0, r1):
        assert all(s["wrong"] == 0 for s in per.values())
        assert per["none"]["errors"] == 0 and per["straggler"]["errors"] == 0
        assert per["failure"]["rejoined"] and per["failure"]["after_rejoin"]["errors"] == 0
    # r = 0: the dead worker's classes cannot be answered during the outage.
    assert r0["failure"]["errors"] >= 1
    assert r0["straggler"]["straggler_answered_share"] == 1.0
    # r = 1: every request answered, the straggler's group mostly by its copy.
    assert r1["failure"]["errors"] == 0
    assert r1["failure"]["answered"] == r1["failure"]["requests"] == 20
    assert r1["straggler"]["straggler_answered_share"] <= 0.5
    assert r0["none"]["subnet_runs_per_request"] == 5.0
    assert 5.0 <= r1["none"]["subnet_runs_per_request"] <= 10.0
    md = (out / "robust.md").read_text()
    assert "| r=1 | failure |" in md

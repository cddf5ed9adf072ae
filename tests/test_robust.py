"""Redundant class parallelism: placement, decoding, and the predictor's answers with copies.

Pure parts (placement, decoder, delay specs) are tested directly; the rest with the real
predictor on every backend (worker threads, worker processes, Ray actors on a local Ray
instance), running the real ONNX subnets of ``tiny_artifact`` on real Fashion-MNIST test images.
No timing thresholds: a delayed worker must *lose the race* to its copies, not beat a clock.
Outages (dead and hung workers) are in test_outages.py.
"""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import numpy as np
import pytest

from sensai.cli.serve import placement_table
from sensai.data import normalize
from sensai.errors import SensaiError
from sensai.serving.core.faults import Faults, parse_delay
from sensai.serving.core.placement import check_redundancy, cyclic_placement, group_hosts
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.engine.decoder import CoverageDecoder
from sensai.serving.launch.build import build_predictor
from tests.helpers import (free_port, local_ray, offline_scores, png, predict_all, sample_images,
                           server_process, stop_server, wait_for_server, wait_until)

N = 8
BACKENDS = ("local", "processes", "ray")
# Ray tests: answers match ONNX Runtime in this process to float noise after a trip through Ray.
ATOL = 1e-4


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
    (2, 4, 1, "leave 1 worker\\(s\\) without a subnet; use at most 3 workers"),
    (5, 10**9, 0, "use at most 5 workers"),  # refused at once, nothing built for each
    (5, 5, 1.5, "integer"),
])
def test_cyclic_placement_rejects_impossible_settings(g, w, r, fragment):
    with pytest.raises(SensaiError, match=fragment):
        cyclic_placement(g, w, r)


def test_redundancy_args_vote_needs_2r_plus_1_workers():
    assert check_redundancy(5, None, 2, True) == 5  # 5 copies on 5 workers
    with pytest.raises(SensaiError, match="2r\\+1 = 7"):
        check_redundancy(5, None, 3, True)
    with pytest.raises(SensaiError, match="--vote needs --redundancy >= 1"):
        check_redundancy(5, None, 0, True)
    with pytest.raises(SensaiError, match="r\\+1 = 6"):
        check_redundancy(5, None, 5, False)
    assert check_redundancy(5, 3, 2, False) == 3


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
# The predictor with copies, on every backend


@pytest.fixture(scope="module")
def images(fmnist_test, fmnist_spec, tiny_artifact):
    """N real test images: normalized inputs, PNGs, and offline evaluation's scores."""
    _, u8, _ = sample_images(fmnist_test, N, seed=3)
    return {"x": normalize(u8, fmnist_spec).numpy(), "png": [png(u8[i]) for i in range(N)],
            "offline": offline_scores(tiny_artifact, u8, fmnist_spec)}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """The backend name; for ray, a local Ray instance for the tests using it."""
    if request.param == "ray":
        with local_ray(num_cpus=2):
            yield "ray"
    else:
        yield request.param


def make(tiny_artifact, backend, corrupt=(), **kw):
    if backend == "ray":
        kw.setdefault("ray_cpus", 0.15)  # two predictors of 5 actors fit 2 CPUs
    return build_predictor(tiny_artifact,
                           GatewaySettings(backend=backend, device="cpu", deadline_s=30, **kw),
                           faults=Faults.of(corrupt=corrupt))


@pytest.fixture(scope="module")
def r1(backend, tiny_artifact):
    """Redundancy 1 on W = G = 5 workers."""
    pred = make(tiny_artifact, backend, redundancy=1)
    yield pred
    pred.shutdown()


def test_r1_answers_equal_offline_and_follow_the_placement(r1, backend, images):
    d = r1.describe()
    assert d["strategy"] == "class-parallel" and d["redundancy"] == 1
    assert d["backend"] == backend
    assert d["placement"] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0]]
    workers = d["workers"]
    assert [w["state"] for w in workers] == ["up"] * 5
    assert all(w["device"] == "cpu" and w["runtime"] == "onnx" for w in workers)
    if backend != "local":  # five processes of their own, none of them this one
        assert len({w["pid"] for w in workers}) == 5 and os.getpid() not in \
            {w["pid"] for w in workers}
    preds = predict_all(r1, images["x"])
    for i, p in enumerate(preds):
        assert not p.degraded
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
        for g in range(5):
            # Whoever answered subnet g hosts it: its primary (worker g) or the copy (g-1).
            assert p.answered_by[f"subnet_{g:02d}"] in (f"worker_{g:02d}",
                                                        f"worker_{(g - 1) % 5:02d}")
    assert "worker_00: subnet_00, subnet_01 (copy)" in placement_table(r1.describe())


def test_concurrent_requests_are_decoded_independently(r1, images):
    async def go():
        return await asyncio.gather(*[r1.predict(x[None]) for x in list(images["x"]) * 2])

    for i, p in enumerate(asyncio.run(go())):
        np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=ATOL)
    # A batch goes through the same path (KServe v2 sends several rows at once).
    batch = asyncio.run(r1.predict(images["x"]))
    np.testing.assert_allclose(batch.scores, images["offline"], atol=ATOL)


def test_straggler_is_overtaken_by_its_copy(r1, images):
    """Worker 2 sleeps 300 ms before every request: subnet_02 is answered by worker 1's copy in
    most requests, and the answers are the no-straggler answers."""
    r1.pool.inject(2, delay="fixed:300ms")
    try:
        assert r1.describe()["workers"][2]["injected_delay"] == "fixed:300ms"
        preds = predict_all(r1, images["x"])
    finally:
        r1.pool.inject(2, delay=None)
    by = [p.answered_by["subnet_02"] for p in preds]
    assert by.count("worker_01") > len(by) / 2, by
    for i, p in enumerate(preds):
        np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
    assert r1.describe()["workers"][2].get("injected_delay") is None


def test_r2_answers_with_two_workers_dead(backend, tiny_artifact, images):
    """r = 2: every group on three workers; with two neighbouring workers killed (and kept down
    by a long restart delay) every group still has a copy up, so every answer is whole and equal
    to offline evaluation."""
    pred = make(tiny_artifact, backend, redundancy=2, restart_delay_s=60.0)
    try:
        assert pred.describe()["placement"] == [[w, (w + 1) % 5, (w + 2) % 5] for w in range(5)]
        pred.pool.kill(1)
        pred.pool.kill(2)
        wait_until(lambda: [s != "up" for s in pred.pool.states()[1:3]] == [True, True], 60,
                   "both deaths to be noticed")
        preds = predict_all(pred, images["x"])
        for i, p in enumerate(preds):
            assert not p.degraded
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
            assert not {"worker_01", "worker_02"} & set(p.answered_by.values())
        # Subnet 02 lives on workers 0, 1 and 2: only worker 0 is left to answer it.
        assert {p.answered_by["subnet_02"] for p in preds} == {"worker_00"}
    finally:
        pred.shutdown()


def test_vote_mode_outvotes_a_corrupting_worker(backend, tiny_artifact, images):
    pred = make(tiny_artifact, backend, redundancy=1, vote=True, corrupt=[2])
    try:
        d = pred.describe()
        assert d["vote"] and d["copies_per_group"] == 3 and d["agreeing_copies_needed"] == 2
        assert d["workers"][2]["injected_corruption"]
        preds = predict_all(pred, images["x"])
        for i, p in enumerate(preds):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
            assert "worker_02" not in p.answered_by.values()
        # Its copies did arrive before some decisions, and lost the vote.
        assert pred.describe()["workers"][2]["outvoted"] > 0
    finally:
        pred.shutdown()


def test_hedged_copies_are_skipped_when_their_group_is_answered(backend, tiny_artifact,
                                                                images):
    """With a 2 s hedge and no straggler, the primaries answer first and the copies are never
    computed: one subnet run per group and request."""
    pred = make(tiny_artifact, backend, redundancy=1, hedge_ms=2000)
    try:
        preds = predict_all(pred, images["x"])
        for i, p in enumerate(preds):
            np.testing.assert_allclose(p.scores[0], images["offline"][i], atol=ATOL)
            assert all(p.answered_by[f"subnet_{g:02d}"] == f"worker_{g:02d}" for g in range(5))
        c = pred.pool.counters()
        assert c["runs"] == 5 * N
    finally:
        pred.shutdown()


# --------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("argv,fragment", [
    (["--redundancy", "5"], "r+1 = 6 copies"),
    (["--redundancy", "2", "--vote", "--workers", "4"], "2r+1 = 5"),
    (["--vote"], "--vote needs --redundancy >= 1"),
    (["--redundancy", "1", "--backend", "triton"], "Triton runs one model per subnet"),
    (["--redundancy", "1", "--inject-delay", "9=fixed:5ms"], "no worker 9"),
    (["--redundancy", "1", "--inject-delay", "1=sometimes"], "bad delay"),
])
def test_serve_rejects_bad_redundancy_flags_before_loading(tiny_artifact, capsys, argv, fragment):
    from sensai.cli import main

    assert main(["serve", str(tiny_artifact), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


@pytest.mark.slow
def test_sensai_serve_with_redundancy_shows_placement_and_answers(tiny_artifact, images):
    port = free_port()
    with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                         "--redundancy", "1", "--port", str(port), "--device", "cpu",
                         "--log-level", "warning"]) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        info = httpx.get(f"{url}/v1/models").json()["predictor"]
        assert info["redundancy"] == 1 and info["placement"][4] == [4, 0]
        r = httpx.post(f"{url}/v1/predict", content=images["png"][0], timeout=30)
        assert r.status_code == 200, r.text
        assert set(r.json()["answered_by"]) == {f"subnet_{g:02d}" for g in range(5)}
        assert stop_server(proc) == 0
        err = proc.stderr.read().decode()
        assert "placement:" in err and "worker_04: subnet_04, subnet_00 (copy)" in err

"""A Ray cluster of several nodes on 127.0.0.1 (``ray.cluster_utils.Cluster``: each node its own
raylet and object store), started by the tests and torn down afterwards.

* the workers are spread over the nodes, the copies of every group on distinct nodes, and the
  predictions equal offline evaluation's;
* the artifact's files travel through Ray: workers need no shared filesystem;
* a node lost with r = 1 loses no request, readiness holds (every group has a copy), and its
  actors are placed again once a node has room;
* a node lost with r = 0 gives a 503 naming the classes, until the actor is back;
* the Ray Serve application spreads its worker deployments the same way, and /v1/models names
  each worker's node;
* ``bench-robust``'s node-loss scenario kills a worker node's raylet: with r = 1 no request is
  lost and the lost workers are placed again on the other nodes.
No timing thresholds: only the order of events is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

from sensai.data import normalize
from sensai.serving.core.errors import SubnetFailed
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor
from tests.helpers import free_port, offline_scores, png, sample_images, start_gateway, wait_until

pytestmark = pytest.mark.slow

# Fast node-death detection, so a lost node is noticed in seconds rather than half a minute.
SYSTEM_CONFIG = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                 "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}
N = 6


@pytest.fixture(scope="module")
def images(fmnist_test, fmnist_spec, tiny_artifact):
    _, u8, _ = sample_images(fmnist_test, N, seed=9)
    return {"x": normalize(u8, fmnist_spec).numpy(), "png": [png(u8[i]) for i in range(N)],
            "offline": offline_scores(tiny_artifact, u8, fmnist_spec)}


@contextmanager
def loopback_cluster(cpus: int = 1):
    """A head node and two worker nodes of ``cpus`` CPUs each, on 127.0.0.1; this process
    connects.  Yields the cluster and its two worker nodes."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    for attempt in (1, 2):
        # Ray gives a raylet a fixed 30 s to register; on a loaded 2-core machine, right after
        # the previous test's cluster went down, that is sometimes too short: start over once.
        c = Cluster()
        try:
            c.add_node(num_cpus=cpus, node_ip_address="127.0.0.1", include_dashboard=False,
                       _system_config=SYSTEM_CONFIG)
            workers = [c.add_node(num_cpus=cpus, node_ip_address="127.0.0.1") for _ in range(2)]
            c.wait_for_nodes()
            break
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def cluster():
    """A cluster of the test's own (one that loses a node)."""
    with loopback_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def intact_cluster():
    """One cluster for the tests that lose no node, at the end of this module."""
    with loopback_cluster() as c:
        yield c


def node_of_workers(pred) -> list[str]:
    return [w["node"] for w in pred.describe()["workers"]]


def stream(pred, images, seconds_after: float, event, *, allow_partial: bool = False):
    """Paced requests; ``event()`` runs after the third; goes on ``seconds_after`` more seconds.
    Returns (answers or errors, in order)."""
    async def go():
        out, i, t_event = [], 0, None
        while t_event is None or time.monotonic() - t_event < seconds_after:
            try:
                out.append(await pred.predict(images["x"][i % N][None],
                                              allow_partial=allow_partial))
            except SubnetFailed as e:
                out.append(e)
            if i == 2:
                await asyncio.to_thread(event)
                t_event = time.monotonic()
            i += 1
            await asyncio.sleep(0.05)
        return out

    return asyncio.run(go())


def test_a_lost_node_with_r1_loses_no_request(cluster, tiny_artifact, images):
    c, workers = cluster
    pred = build_predictor(tiny_artifact, GatewaySettings(backend="ray", redundancy=1,
                                                          device="cpu", deadline_s=60))
    try:
        victim = workers[0]
        on_victim = [i for i, n in enumerate(node_of_workers(pred)) if n == victim.node_id]
        assert on_victim
        answers = stream(pred, images, 8.0, lambda: c.remove_node(victim, allow_graceful=False))
        assert all(not isinstance(a, Exception) for a in answers), answers
        for i, p in enumerate(answers):
            assert not p.degraded
            np.testing.assert_allclose(p.scores[0], images["offline"][i % N], atol=1e-4)
        # Every group still has a live copy: ready, while the lost actors wait for room.
        wait_until(lambda: all(pred.pool.states()[w] != "up" for w in on_victim), 60,
                   "the lost node's workers to be marked down")
        assert pred.is_ready()
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # room to place them again
        for w in on_victim:
            assert pred.pool.wait_until_up(w, 180), pred.describe()["workers"][w]
        assert victim.node_id not in node_of_workers(pred) and pred.is_ready()
        out = asyncio.run(pred.predict(images["x"]))
        np.testing.assert_allclose(out.scores, images["offline"], atol=1e-4)
    finally:
        pred.shutdown()


def test_a_lost_node_with_r0_gives_503_naming_classes_then_recovers(cluster, tiny_artifact,
                                                                    images, fmnist_spec):
    """Over HTTP: once the lost node's workers are seen down, a JSON 503 names (only) their
    classes, readiness is false, allow_partial gets a flagged answer; when a node with room
    joins, they are placed again and all is well."""
    c, workers = cluster
    pred = build_predictor(tiny_artifact,
                           GatewaySettings(backend="ray", device="cpu", deadline_s=60))
    server = start_gateway(pred, deadline_s=60)
    try:
        victim = workers[1]
        lost = [i for i, n in enumerate(node_of_workers(pred)) if n == victim.node_id]
        assert lost
        names = {fmnist_spec.classes[k] for w in lost for k in pred.groups[w]}
        with httpx.Client(base_url=server.url, timeout=120) as h:
            assert h.get("/v2/health/ready").status_code == 200
            c.remove_node(victim, allow_graceful=False)
            wait_until(lambda: any(pred.pool.states()[w] != "up" for w in lost), 120,
                       "the lost node's workers to be seen down")
            r = h.post("/v1/predict", content=images["png"][0])
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/json")
            err = r.json()
            assert err["missing_classes"] and set(err["missing_classes"]) <= names, err
            assert h.get("/v2/health/ready").status_code == 503
            r = h.post("/v1/predict", params={"allow_partial": "true"},
                       content=images["png"][0])
            assert r.status_code == 200, r.text
            part = r.json()
            assert part["degraded"] and set(part["missing_classes"]) <= names, part
            c.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # room to place them again
            for w in lost:
                assert pred.pool.wait_until_up(w, 180), pred.describe()["workers"][w]
            assert h.get("/v2/health/ready").status_code == 200
            for i in range(N):
                r = h.post("/v1/predict", params={"top_k": 10}, content=images["png"][i])
                assert r.status_code == 200 and not r.json()["degraded"], r.text
                got = {p["index"]: p["score"] for p in r.json()["predictions"]}
                np.testing.assert_allclose([got[k] for k in range(10)], images["offline"][i],
                                           atol=2e-5)
    finally:
        server.stop()


def test_retraining_spreads_over_nodes_and_survives_a_lost_node(trained_model_dir, tmp_path):
    """Decomposition's retraining tasks on a cluster whose head has no CPU for tasks: the two
    subnets start on the two worker nodes; one node is lost while both run; its subnet is
    retrained again on the other node and the artifact is complete."""
    import threading

    import ray
    from ray.cluster_utils import Cluster

    from sensai.manifest import load_manifest
    from sensai.pruning.decompose import DecomposeConfig, decompose
    from tests.conftest import TINY_DECOMPOSE

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "_system_config": SYSTEM_CONFIG})
    lost, kept = (c.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(2))
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    try:
        config = DecomposeConfig(**{**TINY_DECOMPOSE, "samples_per_subnet": 3000})
        result: dict = {}

        def run():
            try:
                result["manifest"] = decompose(trained_model_dir, tmp_path / "art", groups=2,
                                               config=config, device="cpu", workers=2,
                                               eval_limit=200)
            except BaseException as e:  # reported by the assertion below
                result["error"] = e

        t = threading.Thread(target=run)
        t.start()
        # Both CPUs busy: one retraining task on each worker node.
        wait_until(lambda: ray.available_resources().get("CPU", 0) == 0 or not t.is_alive(),
                   600, "both retraining tasks to run")
        assert t.is_alive(), result
        c.remove_node(lost)
        t.join(900)
        assert not t.is_alive() and "error" not in result, result
    finally:
        ray.shutdown()
        c.shutdown()
    m = load_manifest(tmp_path / "art")
    assert len(m.subnets) == 2 and m.retrain["ray"] is True
    nodes = {m.retrain["subnets"][str(s.index)]["node"] for s in m.subnets}
    assert nodes == {kept.node_id}, nodes  # the lost node's subnet was done again elsewhere


def test_bench_robust_node_loss_with_r1_loses_no_request(tiny_artifact, tmp_path):
    """`bench-robust --scenarios node-loss` kills the raylet of a worker node while paced
    requests flow: with r = 1 none fails, and the lost workers come back on the other nodes."""
    from sensai.bench.options import RobustOptions
    from sensai.bench.robust import run_robust_bench
    from sensai.serving.core.placement import Placement, spread

    node_of, _ = spread(Placement.cyclic(5, None, 1), 3)  # node 0 is the head
    victim = next(w for w, n in enumerate(node_of) if n != 0)
    with loopback_cluster(cpus=3) as (c, workers):  # room to place a lost node's workers again
        result = run_robust_bench(tiny_artifact, tmp_path / "robust", RobustOptions(
            redundancies=(1,), scenarios=("node-loss",), backend="ray", ray_address=c.address,
            images=40, warmup=2, victim=victim, kill_at=0.2, interval_ms=50,
            rejoin_timeout_s=120, progress=False))
    rep = result["configs"]["r=1"]["scenarios"]["node-loss"]
    assert rep["errors"] == 0 and rep["wrong"] == 0 and rep["answered"] == 40, rep
    assert rep["node"] in {n.node_id for n in workers}
    assert f"worker_{victim:02d}" in rep["workers_on_node"]
    assert rep["rejoined"] and rep["after_rejoin"]["errors"] == 0
    assert rep["node"] not in rep["nodes_after"]  # placed again on the nodes that are left
    md = (tmp_path / "robust" / "robust.md").read_text()
    assert "Node loss: the raylet" in md and "lost; outage" in md


def test_bench_robust_refuses_node_loss_where_it_cannot_kill_a_node(tiny_artifact, tmp_path):
    from sensai.bench.options import RobustOptions
    from sensai.bench.robust import run_robust_bench
    from sensai.errors import SensaiError

    with pytest.raises(SensaiError, match="--backend ray"):
        run_robust_bench(tiny_artifact, tmp_path / "a",
                         RobustOptions(scenarios=("node-loss",), progress=False))
    with pytest.raises(SensaiError, match="one configuration"):
        run_robust_bench(tiny_artifact, tmp_path / "b", RobustOptions(
            redundancies=(0, 1), backend="ray", scenarios=("node-loss",), progress=False))


# The tests below lose no node: they share one cluster, and each leaves it as it found it.  They
# come last, so that no other cluster runs beside it.


def test_workers_spread_over_nodes_with_copies_apart(intact_cluster, tiny_artifact, images):
    pred = build_predictor(tiny_artifact, GatewaySettings(
        backend="ray", redundancy=1, device="cpu", deadline_s=60, keep_cores_awake="auto"))
    try:
        d = pred.describe()
        nodes = node_of_workers(pred)
        assert len(set(nodes)) == 3, nodes  # every node hosts workers
        for g, hosts in enumerate(d["hosts"]):
            assert len({nodes[w] for w in hosts}) == len(hosts), (g, hosts, nodes)
        assert all(w["node"] == w["node_planned"] for w in d["workers"])
        assert all(w["node_address"] == "127.0.0.1" for w in d["workers"])
        # Asked to (auto), each actor keeps its own node's idle cores awake when it may.
        may_hold = os.access("/dev/cpu_dma_latency", os.R_OK | os.W_OK)
        assert all(w["cores_awake"] is may_hold for w in d["workers"])
        preds = asyncio.run(pred.predict(images["x"]))
        np.testing.assert_allclose(preds.scores, images["offline"], atol=1e-4)
    finally:
        pred.shutdown()


def test_workers_need_no_shared_filesystem(intact_cluster, tiny_artifact, tmp_path, images):
    """The artifact is read here and shipped through Ray: after its directory is gone, a worker
    that Ray restarts loads its subnets again and answers."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    pred = build_predictor(art, GatewaySettings(backend="ray", device="cpu", deadline_s=60))
    try:
        # Not asked (the default): no actor touches its node's idle cores.
        assert all(w["cores_awake"] is False for w in pred.describe()["workers"])
        shutil.rmtree(art)
        old = pred.workers[2].handle.pid
        pred.pool.kill(2)
        wait_until(lambda: pred.workers[2].restarts >= 1 and pred.pool.states()[2] == "up",
                   180, "the killed worker to be restarted")
        assert pred.workers[2].handle.pid != old
        out = asyncio.run(pred.predict(images["x"]))
        np.testing.assert_allclose(out.scores, images["offline"], atol=1e-4)
    finally:
        pred.shutdown()


def test_bench_robust_reports_each_workers_node(intact_cluster, tiny_artifact, tmp_path):
    """`sensai bench-robust --backend ray --ray-address ADDR` on the cluster: the report names
    the node of every worker, and the copies of each group sit on distinct nodes."""
    from sensai.cli import main

    c, _ = intact_cluster
    out = tmp_path / "robust"
    assert main(["bench-robust", str(tiny_artifact), "--out", str(out), "--backend", "ray",
                 "--ray-address", c.address, "--redundancy", "1", "--scenarios", "none",
                 "--images", "6", "--set", "warmup=1", "--set", "rounds=1"]) == 0
    result = json.loads((out / "robust.json").read_text())
    assert result["settings"]["ray_address"] == c.address
    nodes = result["worker_nodes"]["r=1"]
    assert len(set(nodes)) == 3 and None not in nodes
    copies: dict[int, set] = {}
    for w, hosted in enumerate(result["placement"]["r=1"]):
        for group in hosted:
            copies.setdefault(group, set()).add(nodes[w])
    assert all(len(v) == 2 for v in copies.values()), copies
    assert "Workers' nodes" in (out / "robust.md").read_text()


def test_serve_app_spreads_worker_deployments_with_copies_apart(intact_cluster, tiny_artifact,
                                                               images):
    """The Serve application (`serve run` / KubeRay) on the 3-node cluster, r = 1: every node
    hosts worker replicas, a group's two copies are on distinct nodes, answers equal offline
    evaluation, and /v1/models says which node hosts which worker."""
    from ray import serve

    from sensai.serving.launch.serve_app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"artifact": str(tiny_artifact), "settings": {"redundancy": 1}}),
                  name="sensai", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200,
                   300, "the Serve app to be ready")
        with httpx.Client(base_url=url, timeout=60) as c:
            for i in range(N):
                r = c.post("/v1/predict", params={"top_k": 10}, content=images["png"][i])
                assert r.status_code == 200, r.text
                got = {p["index"]: p["score"] for p in r.json()["predictions"]}
                np.testing.assert_allclose([got[k] for k in range(10)], images["offline"][i],
                                           atol=2e-5)
            info = c.get("/v1/models").json()["predictor"]
        nodes = [w["node"] for w in info["workers"]]
        assert None not in nodes and len(set(nodes)) == 3, nodes
        for g, hosts in enumerate(info["hosts"]):
            assert len({nodes[w] for w in hosts}) == len(hosts), (g, hosts, nodes)
    finally:
        serve.shutdown()

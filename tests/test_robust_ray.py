"""What only the Ray backend has: actor resources that fit any cluster, starting with default
flags on 1 and 2 CPUs, and ``sensai serve --backend ray`` as a real process.  The predictor's
behaviour on Ray (copies, stragglers, votes, outages) is tested with the other backends in
test_robust.py and test_outages.py.
"""

from __future__ import annotations

import socket
import sys

import httpx
import numpy as np
import pytest

from sensai.errors import SensaiError
from sensai.serving.transports.ray_actors import actor_resources
from tests.helpers import (free_port, local_ray, offline_scores, png, sample_images, server_process,
                           stop_server, wait_for_server)

pytestmark = pytest.mark.slow  # Ray instances and actor starts


def test_ray_actor_resources_always_fit_the_cluster():
    assert actor_resources(5, 16, 0) == ({"num_cpus": 1.0}, 1)
    # Fewer CPUs than actors: an even share that adds up to no more than the cluster has
    # (3 x round(2/3, 2) = 2.01 CPUs would never be scheduled).
    for workers, cpus in ((3, 2), (5, 2), (2, 1), (10, 2), (7, 3)):
        opts, threads = actor_resources(workers, cpus, 0)
        assert workers * opts["num_cpus"] <= cpus and threads == 1, (workers, cpus, opts)
    assert actor_resources(2, 16, 0, cpus=4) == ({"num_cpus": 4.0}, 4)  # 4 ORT threads
    opts, threads = actor_resources(5, 16, 8)
    assert opts == {"num_cpus": 1.0, "num_gpus": 1.0} and threads == 1
    assert actor_resources(5, 16, 2)[0]["num_gpus"] == 0.33  # 3 share the busiest GPU
    assert "num_gpus" not in actor_resources(5, 16, 8, device="cpu")[0]
    for kwargs, fragment in (({"cpus": 1.0}, "do not fit"), ({"device": "cuda"}, "no GPU"),
                             ({"device": "mps"}, "auto, cpu or cuda"), ({"cpus": 0}, "> 0")):
        with pytest.raises(SensaiError, match=fragment):
            actor_resources(5, 2, 0, **kwargs)


@pytest.mark.parametrize("argv,fragment", [
    (["--backend", "ray", "--redundancy", "1", "--set", "ray_cpus=0"],
     "--set ray_cpus must be > 0"),
    (["--backend", "ray", "--redundancy", "5"], "r+1 = 6 copies"),
])
def test_serve_rejects_bad_ray_flags_in_one_line(tiny_artifact, capsys, argv, fragment):
    from sensai.cli import main

    assert main(["serve", str(tiny_artifact), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_sensai_serve_backend_ray_with_redundancy(tiny_artifact, fmnist_test, fmnist_spec):
    """`sensai serve --backend ray --redundancy 1` joins a running Ray instance, prints the
    placement, answers over HTTP like offline evaluation (through each actor's socket, closed
    to anyone else) and stops cleanly on SIGTERM."""
    _, u8, _ = sample_images(fmnist_test, 1)
    expected = offline_scores(tiny_artifact, u8, fmnist_spec)[0]
    port = free_port()
    with local_ray(num_cpus=2) as address:
        with server_process([sys.executable, "-m", "sensai", "serve", str(tiny_artifact),
                             "--backend", "ray", "--redundancy", "1", "--port", str(port),
                             "--ray-address", address, "--set", "ray_cpus=0.1",
                             "--device", "cpu", "--log-level", "warning"]) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_for_server(proc, url, timeout_s=180)
            info = httpx.get(f"{url}/v1/models").json()["predictor"]
            assert info["backend"] == "ray" and info["placement"][4] == [4, 0]
            assert info["workers"][0]["resources"] == {"num_cpus": 0.1}
            # Requests reach each actor over its own socket on the node's Ray address, which
            # took the gateway and nobody after it.
            for w in info["workers"]:
                host, _, wport = w["channel"].rpartition(":")
                assert host == "127.0.0.1"
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((host, int(wport)), timeout=5).close()
            r = httpx.post(f"{url}/v1/predict", params={"top_k": 10}, content=png(u8[0]),
                           timeout=30)
            assert r.status_code == 200, r.text
            got = {p["index"]: p["score"] for p in r.json()["predictions"]}
            np.testing.assert_allclose([got[k] for k in range(10)], expected, atol=1e-4)
            assert stop_server(proc) == 0
            err = proc.stderr.read().decode()
            assert "5 ray workers" in err and "placement:" in err
            assert "worker_04: subnet_04, subnet_00 (copy)" in err

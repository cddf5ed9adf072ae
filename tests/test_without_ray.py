"""A machine with the gateway's own dependencies but neither Ray nor tritonclient: the real
command line, in interpreters where both cannot be imported, decomposes (retraining in process),
serves on the local backend, predicts and benches; each option that needs what is missing stops
in one line.

The blocker is a ``sitecustomize`` that marks both packages absent in ``sys.modules``, so that
``import ray`` raises ModuleNotFoundError and ``importlib.util.find_spec("ray")`` answers None,
as they do where the package is not installed; the processes the commands start inherit it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from sensai.manifest import load_manifest
from tests.helpers import (free_port, png, sample_images, server_process, stop_server,
                           wait_for_server)

BLOCKED = ("ray", "tritonclient")
MISSING_RAY = "needs Ray, which is not installed here (pip install 'ray[serve]')"
MISSING_TRITONCLIENT = ("needs tritonclient, which is not installed here "
                        "(pip install 'tritonclient[http]')")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of a machine without Ray and tritonclient."""
    site = tmp_path_factory.mktemp("noray")
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in BLOCKED))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    # The blocker works: what a missing package looks like.
    check = ("import importlib.util, sys\n"
             f"for m in {BLOCKED!r}:\n"
             "    assert importlib.util.find_spec(m) is None, m\n"
             "    try:\n"
             "        __import__(m)\n"
             "    except ModuleNotFoundError:\n"
             "        pass\n"
             "    else:\n"
             "        sys.exit(m + ' imported')\n")
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=60)
    return env


def sensai(env, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sensai", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def decomposed(env, trained_model_dir, tmp_path_factory):
    """``sensai decompose`` G=2 without --no-ray, on tiny settings: (artifact, process)."""
    art = tmp_path_factory.mktemp("noray-art") / "art"
    proc = sensai(env, "decompose", "--model-dir", trained_model_dir, "--groups", 2,
                  "--out", art, "--set", "features_per_class=10", "--set", "stats_per_class=10",
                  "--samples-per-subnet", 128, "--set", "batch_size=64", "--retrain-epochs", 1,
                  "--set", "eval_limit=100", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return art, proc


def test_decompose_retrains_in_process_when_ray_is_not_installed(decomposed):
    art, proc = decomposed
    assert "Traceback" not in proc.stderr
    assert "Ray is not installed: retraining the subnets one after another in this process" \
        in proc.stderr
    assert "decomposed fmnist_cnn into 2 subnets" in proc.stdout
    m = load_manifest(art)
    assert m.retrain["ray"] is False and len(m.subnets) == 2
    for s in m.subnets:
        assert m.retrain["subnets"][str(s.index)]["samples"] > 0  # really retrained
        assert (art / s.onnx).is_file()


def top_label(stdout: str) -> str:
    """The label of ``sensai predict``'s last line ("score  index  label"; a label may hold
    spaces, as "Ankle boot" does)."""
    return stdout.strip().splitlines()[-1].split(None, 2)[2]


@pytest.mark.slow
def test_serve_local_and_predict_answer_a_real_image(env, decomposed, fmnist_test, tmp_path):
    """``sensai serve --backend local`` answers a PNG over HTTP; ``sensai predict`` gives the same
    top class through it (--url) and in process."""
    art, _ = decomposed
    _, images, _ = sample_images(fmnist_test, 1)
    image = tmp_path / "image.png"
    image.write_bytes(png(images[0]))
    port = free_port()
    with server_process([sys.executable, "-m", "sensai", "serve", str(art), "--backend",
                         "local", "--port", str(port), "--device", "cpu",
                         "--log-level", "warning"], env=env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        r = httpx.post(f"{url}/v1/predict", files={"image": ("image.png", image.read_bytes())},
                       timeout=30)
        assert r.status_code == 200, r.text
        label = r.json()["label"]
        remote = sensai(env, "predict", art, image, "--url", url, "--top-k", 1)
        assert remote.returncode == 0, remote.stderr[-3000:]
        assert top_label(remote.stdout) == label
        assert stop_server(proc) == 0, proc.stderr.read().decode()[-3000:]
    local = sensai(env, "predict", art, image, "--top-k", 1, "--device", "cpu")
    assert local.returncode == 0, local.stderr[-3000:]
    assert top_label(local.stdout) == label
    assert "Traceback" not in local.stderr + remote.stderr


@pytest.mark.slow
def test_bench_runs_in_process_and_over_http_and_skips_the_ray_serve_peer(env, decomposed,
                                                                         tmp_path):
    art, _ = decomposed
    out = tmp_path / "bench"
    proc = sensai(env, "bench", art, "--out", out, "--strategies", "single", "class-parallel",
                  "--transports", "inprocess", "http", "http-v2", "--peers", "ray-serve",
                  "--set", "warmup=2", "--set", "rounds=1", "--images", 4, "--requests", 4,
                  "--concurrency", 2, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    result = json.loads((out / "bench.json").read_text())
    for strategy in ("single", "class-parallel"):
        timed = result["strategies"][strategy]["transports"]
        assert set(timed) == {"inprocess", "http", "http-v2"}
        assert all(t["latency_ms"]["n"] > 0 for t in timed.values())
    assert MISSING_RAY in result["peers"]["ray-serve"]["skipped"]


@pytest.mark.parametrize("args, message", [
    (["decompose", "--model-dir", "{model}", "--groups", "2", "--out", "{tmp}/art",
      "--ray-address", "127.0.0.1:6379"], "retraining on the Ray cluster at 127.0.0.1:6379 "
     + MISSING_RAY),
    (["serve", "{art}", "--backend", "ray"], "--backend ray " + MISSING_RAY),
    (["serve", "{art}", "--backend", "triton"], "--backend triton " + MISSING_TRITONCLIENT),
    (["bench", "{art}", "--out", "{tmp}/b", "--backend", "local", "ray"],
     "--backend ray " + MISSING_RAY),
    (["bench", "{art}", "--out", "{tmp}/b", "--backend", "triton"],
     "--backend triton " + MISSING_TRITONCLIENT),
], ids=["decompose-ray-address", "serve-ray", "serve-triton", "bench-ray", "bench-triton"])
def test_an_option_that_needs_ray_or_tritonclient_says_so_in_one_line(
        env, decomposed, trained_model_dir, tmp_path, args, message):
    art, _ = decomposed
    args = [a.format(model=trained_model_dir, art=art, tmp=tmp_path) for a in args]
    proc = sensai(env, *args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"sensai {args[0]}: error: {message}"]
    assert not (tmp_path / "art").exists() and not (tmp_path / "b").exists()  # nothing started

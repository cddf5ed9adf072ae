"""``sensai serve`` itself as a pool of the benchmarks: ``sensai bench-load --sweep --backend
ray-serve`` and ``sensai bench --backend local ray-serve`` on a tiny artifact, each starting the
real ``sensai serve --backend ray-serve`` (its own local Ray instance on 127.0.0.1) and driving
it with real images over HTTP; ``sensai bench --backend local processes`` likewise starts the
real ``sensai serve --backend processes`` (a gateway process over device processes).  Only the
shape of the outputs and the answers are checked, never a timing (the CPU is shared)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_load_sweep_measures_the_serve_application(tiny_artifact, tmp_path):
    """Every answer agrees with offline evaluation; the overload is answered, each request with
    a 200 or a 503 (the ingress's own admission); the memory sampled is the Serve ingress
    replica's, not the CLI's; the gateway stops with exit status 0."""
    from sensai.bench.load_run import run_load
    from sensai.bench.options import LoadOptions, LoadPlan

    out = tmp_path / "sweep"
    options = LoadOptions(backend="ray-serve", deadline_s=20.0, images=12, progress=False,
                          command="test", env={"SENSAI_MAX_REQUESTS": "32"})
    run_load(tiny_artifact, out, options,
             LoadPlan(sweep=True, configs=("class-parallel",), levels=(1, 4), level_seconds=1.0,
                      warmup_seconds=0.5, overload_seconds=2.0))
    result = json.loads((out / "load.json").read_text())
    assert result["settings"]["backend"] == "ray-serve"
    c = result["configs"]["class-parallel"]
    assert [r["concurrency"] for r in c["levels"]] == [1, 4]
    for r in [*c["levels"], c["noop"]]:
        assert r["ok"] == r["requests"] > 0 and r["wrong"] == 0 and r["errors"] == 0
    overload = c["overload"]
    assert overload["requests"] > 0 and overload["no_answer"] == 0, overload["failures"]
    assert set(overload["status_counts"]) <= {"200", "503"} and overload["wrong"] == 0
    server = c["server"]
    assert "--backend ray-serve" in server["command"] and server["exit_code"] == 0
    sampled = server["sampled"]
    assert sampled["pid"] != sampled["tree_of"] and "Serve ingress replica" in sampled["process"]
    assert "Ray Serve application 'sensai'" in (out / "gateway-class-parallel.log").read_text()


def bench_beside_local(artifact, tmp_path, backend: str) -> tuple[dict, dict, dict]:
    """``sensai bench``'s class parallel on the local pool and on ``backend`` (a ``sensai
    serve`` the run starts), each timed over http-v2 on the same images: bench.json, and the
    two strategies, once checked for what every such server shares - the same answers as the
    local pool, timed over HTTP only, and not in process, which bench.json and bench.md say."""
    from sensai.bench.latency import run_bench
    from sensai.bench.options import BenchOptions

    out = tmp_path / "bench"
    run_bench(artifact, out, BenchOptions(
        strategies=("class-parallel",), transports=("inprocess", "http-v2"),
        backends=("local", backend), images=8, warmup=2, rounds=2, concurrency=2, requests=8,
        isolated_images=0, progress=False, command="test"))
    result = json.loads((out / "bench.json").read_text())
    local, served = (result["strategies"][k] for k in ("class-parallel",
                                                       f"class-parallel@{backend}"))
    assert list(local["transports"]) == ["inprocess", "http-v2"]
    assert list(served["transports"]) == ["http-v2"]
    assert set(served["untimed_transports"]) == {"inprocess"}
    rep = served["transports"]["http-v2"]
    assert rep["predictions"] == local["transports"]["http-v2"]["predictions"]
    assert len(rep["floors_ms"]) == len(rep["latencies_ms"]) == result["settings"]["images"]
    assert rep["throughput"]["answered"] == 8
    assert served["backend"] == backend
    assert f"--backend {backend}" in served["gateway"]["command"]
    assert f"class parallel (sensAI, {backend} pool) not timed in process" in \
        (out / "bench.md").read_text()
    return result, local, served


@pytest.mark.slow
def test_bench_times_the_serve_application_over_http_beside_the_local_pool(tiny_artifact,
                                                                           tmp_path):
    """class-parallel@ray-serve: timed over http-v2 against its ingress's bare route, its
    answers those of the local pool on the same images, its p50 judged against the local
    pool's (the target); in process it is not timed, and bench.json and bench.md say why."""
    result, local, serve = bench_beside_local(tiny_artifact, tmp_path, "ray-serve")
    assert "Serve ingress" in serve["untimed_transports"]["inprocess"]
    assert len(serve["per_worker"]) == 5
    checks = {c["name"]: c for s in result["targets"]["sets"] for c in s["checks"]}
    target = checks["ray_serve_vs_local_pool"]
    p50 = [r["transports"]["http-v2"]["latency_ms"]["p50"] for r in (serve, local)]
    assert target["limit"] == 2.0 and target["value"] == pytest.approx(p50[0] / p50[1], abs=1e-4)


@pytest.mark.slow
def test_bench_times_the_processes_server_over_http_beside_the_local_pool(tiny_artifact_g2,
                                                                          tmp_path):
    """class-parallel@processes is what ``sensai serve --backend processes`` serves: that
    server, started by the run, a gateway process over device processes; timed over HTTP with
    the local pool's answers on the same images; not in process, and bench.json and bench.md
    say why."""
    _, _, served = bench_beside_local(tiny_artifact_g2, tmp_path, "processes")
    assert "device processes" in served["untimed_transports"]["inprocess"]
    assert len(served["per_worker"]) == 2
    log = (tmp_path / "bench" / "gateway-class-parallel@processes.log").read_text()
    assert "2 subnets on 2 workers in 2 device processes, " in log

"""``sensai bench-robust --backend ray-serve``: each redundancy is the real Ray Serve application
on a real local Ray instance, called over HTTP from the benchmark's client process; a worker
replica's process is SIGKILLed with requests in flight.  r = 1 loses no request and answers as
offline evaluation does; r = 0 loses the requests that need the dead worker; both get a new
replica that serves again.  No timing is asserted (the CPU is shared)."""

from __future__ import annotations

import json

from sensai.cli import main


def test_bench_robust_refuses_what_the_serve_application_cannot_take(tiny_artifact_g2, tmp_path,
                                                                      capsys):
    for argv, fragment in (
            (["--scenarios", "straggler"], "straggler scenario does not apply to --backend "
                                           "ray-serve"),
            (["--set", "restart_delay_s=1"], "--set restart_delay_s does not apply to --backend "
                                              "ray-serve"),
            (["--scenarios", "node-loss"], "use --backend ray"),
            (["--set", "deadline_s=0"], "--set deadline_s must be > 0")):
        assert main(["bench-robust", str(tiny_artifact_g2), "--out", str(tmp_path / "o"),
                     "--backend", "ray-serve", *argv]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything was started or written


def test_bench_robust_on_ray_serve_r1_loses_no_request_to_a_killed_replica(tiny_artifact_g2,
                                                                            tmp_path):
    out = tmp_path / "robust"
    assert main(["bench-robust", str(tiny_artifact_g2), "--out", str(out), "--backend",
                 "ray-serve", "--redundancy", "0", "1", "--scenarios", "none", "failure",
                 "--images", "20", "--set", "warmup=4", "--set", "victim=1"]) == 0
    res = json.loads((out / "robust.json").read_text())
    st = res["settings"]
    assert st["backend"] == "ray-serve" and st["transport"] == "http-v2"
    assert st["concurrency"] >= 2 and st["images"] == 20  # requests in flight
    assert res["placement"] == {"r=0": [[0], [1]], "r=1": [[0, 1], [1, 0]]}
    assert {t["kind"] for t in res["worker_transport"].values()} == {"ray-serve"}
    r0, r1 = (res["configs"][k]["scenarios"] for k in ("r=0", "r=1"))
    for per in (r0, r1):
        assert set(per) == {"none", "failure"}
        none, fail = per["none"], per["failure"]
        assert none["answered"] == none["requests"] == 20
        assert none["errors"] == none["wrong"] == 0 and none["latency_ms"]["p50"] > 0
        # The victim's replica was killed with requests in flight, Serve replaced it, and the
        # new replica served requests answered as offline evaluation answers them.
        assert fail["victim"] == "worker_01" and fail["in_flight_at_kill"] >= 1
        assert fail["restarted"] and fail["rejoined"]
        assert fail["replica_pid_after"] not in (None, fail["killed_pid"])
        assert 0 < fail["outage_s"] < fail["serving_again_s"]
        after = fail["after_rejoin"]
        assert after["requests"] >= 20 and after["errors"] == after["wrong"] == 0
        assert after["victim_subnet_runs"] >= 20
        assert fail["wrong"] == 0
    # r = 1: every group has a copy on the other worker, so the kill costs no request.
    assert r1["failure"]["errors"] == r1["failure"]["errors_during_outage"] == 0
    assert r1["failure"]["answered"] == r1["failure"]["requests"] > 20
    # r = 0: worker_01's group has no other copy, so requests fail until it is back.
    assert r0["failure"]["errors"] >= r0["failure"]["errors_during_outage"] >= 1
    assert r0["failure"]["latency_ms"]["p99"] is not None
    assert r0["none"]["subnet_runs_per_request"] == 2.0  # G runs per request at r = 0
    # Each configuration was `sensai serve` in a process of its own, stopped cleanly after.
    for key, r in (("r=0", 0), ("r=1", 1)):
        gw = res["serve"][key]["gateway"]
        assert "serve" in gw["argv"] and "--backend ray-serve" in gw["command"]
        assert gw["env"]["SENSAI_REDUNDANCY"] == str(r)
        assert gw["exit_code"] == 0
        assert (out / f"serve-{key}.log").exists()
    md = (out / "robust.md").read_text()
    assert "| r=1 | failure | " in md and "worker deployments of the Ray Serve application" in md
    assert (out / "robust.png").stat().st_size > 0

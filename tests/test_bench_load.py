"""``sensai bench-load`` on a tiny artifact: a short soak and overload of a real ``sensai serve``
process over real HTTP on 127.0.0.1, from real client processes.

Only the shape of the outputs is checked - json keys, markdown tables, the plot, RSS samples in
time order, status codes, the gateway process gone afterwards - never a timing or a target (the
CPU is shared); and that bad arguments are refused in one line before anything starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

PHASE_KEYS = {"start_s", "seconds", "duration_s", "requests", "status_counts", "ok", "errors",
              "not_200_or_503", "no_answer", "failures", "wrong", "throughput_rps",
              "latency_ms", "latency_ok_ms", "latency_rejected_ms", "timeline", "server"}
TARGETS = ["soak_errors", "soak_rss_growth", "lean_gateway_rss", "overload_only_200_503", "overload_admitted_p99",
           "healthy_after_overload"]


@pytest.fixture(scope="module")
def load_run(tiny_artifact, tmp_path_factory):
    from sensai.bench.load_run import run_load
    from sensai.bench.options import LoadOptions, LoadPlan

    out = tmp_path_factory.mktemp("load_out")
    # A small gateway (16 requests in flight, 2 in the predictor), so the overload meets its
    # limits with few connections.
    options = LoadOptions(deadline_s=2.0, clients=2, images=12, progress=False, command="test",
                          env={"SENSAI_MAX_REQUESTS": "16", "SENSAI_MAX_PREDICTIONS": "2"})
    plan = LoadPlan(concurrency=2, warmup_seconds=0.5, soak_seconds=3.0, overload_seconds=2.0,
                    sample_seconds=0.5, burst_seconds=2.0, burst_concurrency=6)
    result = run_load(tiny_artifact, out, options, plan)
    return out, result


def test_outputs_are_written_and_well_formed(load_run):
    from PIL import Image

    out, result = load_run
    on_disk = json.loads((out / "load.json").read_text())
    assert on_disk["kind"] == "sensai-bench-load" and on_disk["command"] == "test"
    for key in ("settings", "machine", "gateway", "rss", "phases", "health_after", "burst",
                "targets", "offline_top1", "seconds"):
        assert key in on_disk, key
    st = on_disk["settings"]
    assert st["concurrency"] == 2 and st["clients"] == 2 and st["soak_s"] == 3.0
    assert st["gateway"]["deadline_s"] == 2.0 and st["gateway"]["max_requests"] == 16
    assert st["gateway_env"] == {"SENSAI_MAX_REQUESTS": "16", "SENSAI_MAX_PREDICTIONS": "2"}
    assert on_disk["gateway"]["argv"][2:4] == ["sensai", "serve"]
    assert "--deadline 2" in on_disk["gateway"]["command"]
    # The local gateway serves its routes itself: its memory is the one sampled.
    assert on_disk["gateway"]["serving_pid"] == on_disk["gateway"]["pid"]
    assert on_disk["rss"]["sampled"]["process"] == "the sensai serve process"
    assert on_disk["machine"]["load_average"] and on_disk["machine"]["load_average_end"]
    assert set(on_disk["phases"]) == {"warmup", "soak", "overload"}
    for name, phase in on_disk["phases"].items():
        assert PHASE_KEYS <= set(phase), name
        assert phase["requests"] == sum(phase["status_counts"].values()) > 0
        assert phase["timeline"] and all(b["seconds"] > 0 for b in phase["timeline"])
        assert sum(b["answered"] for b in phase["timeline"]) == phase["requests"]
        assert sum(b["sent"] for b in phase["timeline"]) == phase["requests"]
        g = phase["gateway_cpu"]  # the gateway's threads, its busiest at most one core
        assert 0 < g["busiest_thread_cores"] <= g["process_cores"] and \
            g["busiest_thread_cores"] <= 1.05, (name, g)
    over = on_disk["phases"]["overload"]
    assert {"target_rate_rps", "offered_rate_rps", "send_lag_ms", "connections_allowed",
            "connections_opened"} <= set(over)
    assert over["target_rate_rps"] == pytest.approx(
        4.0 * on_disk["phases"]["soak"]["throughput_rps"], rel=0.01)
    assert [c["name"] for c in on_disk["targets"]["checks"]] == TARGETS
    for c in on_disk["targets"]["checks"]:  # reported, never asserted
        assert c["status"] in ("met", "not met", "not measured") and c["rule"]
        if c["name"].startswith("soak"):  # a 3 s soak is not the 10-minute one
            assert c["conditions_met"] is False and "this run: 3 s" in c["conditions"]

    md = (out / "load.md").read_text()
    for text in ("## Targets", "## Phases", "## Gateway memory during the soak",
                 "## Health after the overload", "## A burst of large legal images",
                 "| warm-up | closed loop, 2 in flight |",
                 "| soak | closed loop, 2 in flight |", "| overload | open loop, ",
                 "| gateway process |", "sensai_requests_total", "indicative"):
        assert text in md, text
    with Image.open(out / "load.png") as img:
        assert img.format == "PNG" and img.size[0] > 600 and img.size[1] > 600
    assert (out / "gateway.log").read_text().strip()
    assert not list(out.glob(".*.tmp"))


def test_status_codes_are_200_or_503_and_answers_right(load_run):
    _, result = load_run
    for name, phase in result["phases"].items():
        assert set(phase["status_counts"]) <= {"200", "503"}, (name, phase["status_counts"])
        assert phase["wrong"] == 0 and not phase["failures"]
    assert set(result["phases"]["soak"]["status_counts"]) == {"200"}
    health = result["health_after"]
    assert health["ready_status"] == 200
    assert health["predictions"] == min(20, result["settings"]["images"])


def test_a_burst_of_the_largest_legal_images_is_answered_and_its_peak_memory_reported(
        load_run):
    """The largest picture the gateway's limits allow for a 28x28 model (3.6 Mpx RGBA), six at a
    time: every answer a 200 (right) or a 503, and the gateway's peak memory read."""
    _, result = load_run
    b = result["burst"]
    assert b["concurrency"] == 6 and b["requests"] == sum(b["status_counts"].values()) > 0
    assert set(b["status_counts"]) <= {"200", "503"} and b["wrong"] == 0, b["status_counts"]
    im = b["image"]
    assert im["mode"] == "RGBA" and im["width"] == im["height"] == 1900
    assert im["decoded_bytes"] == 1900 * 1900 * 4 and im["png_bytes"] < 200_000
    assert b["peak_rss_mb"] >= b["rss_before_mb"] > 10
    assert b["all_at_once_mb"] == pytest.approx(6 * im["decoded_bytes"] / 1e6, abs=0.1)


def test_rss_is_sampled_in_time_order(load_run):
    _, result = load_run
    samples = result["rss"]["samples"]
    t = [s["t"] for s in samples]
    assert len(samples) >= 8 and all(a < b for a, b in zip(t, t[1:]))
    assert [s["phase"] for s in samples][0] == "startup"
    assert {"warm-up", "soak", "overload", "after"} <= {s["phase"] for s in samples}
    assert all(s["rss_mb"] > 10 and s["tree_rss_mb"] >= s["rss_mb"] for s in samples)
    growth = result["phases"]["soak"]["rss"]["gateway"]
    soak = [s for s in samples if s["phase"] == "soak"]
    assert growth["samples"] == len(soak) >= 3
    assert growth["baseline_mb"] == soak[0]["rss_mb"]
    assert growth["growth_mb"] == pytest.approx(
        growth["last_window_mean_mb"] - growth["baseline_mb"], abs=0.02)


def test_the_gateway_process_is_gone(load_run):
    _, result = load_run
    pid = result["gateway"]["pid"]
    assert result["gateway"]["exit_code"] == 0  # SIGTERM: drained and stopped
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pid, 0)
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--concurrency", "0"], "--concurrency must be an integer from 1 to 1000"),
    (["--set", "clients=3", "--concurrency", "2"], "--set clients=3 must not exceed"),
    (["--set", "soak_seconds=0"], "--set soak_seconds must be a number > 0"),
    (["--set", "overload_factor=-1"], "--set overload_factor must be a number > 0"),
    (["--set", "warmup_seconds=nan"], "--set warmup_seconds must be a number >= 0"),
    (["--env", "FOO=1"], "--env FOO: not a gateway setting"),
    (["--env", "SENSAI_PORT=9000"], "set by the benchmark itself"),
    (["--env", "SENSAI_MAX_REQUESTS"], "--env wants NAME=VALUE"),
    (["--env", "SENSAI_MAX_REQUESTS=0"], "invalid gateway setting max_requests"),
    (["--env", "SENSAI_DEADLINE_S=0"], "invalid gateway setting deadline_s"),
    (["--env", "SENSAI_DEADLINE_S=soon"], "--env SENSAI_DEADLINE_S=soon: not a number"),
    (["--set", "overload_connections=100000000"], "ulimit -n"),
])
def test_bad_arguments_are_refused_in_one_line(tiny_artifact, tmp_path, capsys, argv, fragment):
    from sensai.cli import main

    out = tmp_path / "o"
    assert main(["bench-load", str(tiny_artifact), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("sensai bench-load: error:")
    assert not out.exists()  # refused before anything was started or written


def test_a_set_key_reaches_the_run_and_the_recorded_command(tiny_artifact, tmp_path,
                                                            monkeypatch):
    """``--set KEY=VALUE`` lands in the plan or the options the run is given, and in the command
    load.json records, which parses back to the same."""
    import sensai.bench.load_run as load
    from sensai.cli import build_parser, main
    from sensai.errors import SensaiError

    seen = {}

    def run(artifact, out, options, plan):
        seen.update(options=options, plan=plan)
        raise SensaiError("measured nothing")

    monkeypatch.setattr(load, "run_load", run)
    argv = ["bench-load", str(tiny_artifact), "--out", str(tmp_path / "o"), "-c", "4",
            "--set", "overload_seconds=0", "--set", "clients=3", "--set", "retry_after=false"]
    assert main(argv) == 2
    plan, options = seen["plan"], seen["options"]
    assert plan.overload_seconds == 0.0 and plan.concurrency == 4 and plan.soak_seconds == 600
    assert options.clients == 3 and options.retry_after is False and options.client_cores == 0
    assert options.command == ("sensai " + " ".join(argv[:4]) + " --concurrency 4 --set "
                               "overload_seconds=0 --set clients=3 --set retry_after=false")
    again = build_parser().parse_args(options.command.split()[1:])
    assert again.knobs == {"overload_seconds": 0.0, "clients": 3, "retry_after": False}


@pytest.mark.parametrize("setting, message", [
    ("overload_secs=0", "--set overload_secs=0: expected KEY=VALUE with KEY one of"),
    ("soak_seconds", "--set soak_seconds: expected KEY=VALUE"),
    ("soak_seconds=soon", "--set soak_seconds=soon: expected a number"),
    ("clients=1.5", "--set clients=1.5: expected an integer"),
    ("retry_after=maybe", "--set retry_after=maybe: expected true or false"),
])
def test_a_bad_set_key_or_value_is_refused_in_one_line(tiny_artifact, tmp_path, capsys, setting,
                                                       message):
    from sensai.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench-load", str(tiny_artifact), "--out", str(tmp_path / "o"), "--set", setting])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # argparse's usage, then the one line that says what is wrong
    assert e.value.code == 2 and last.startswith("sensai bench-load: error: ") and message in last
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_a_missing_artifact_is_refused_in_one_line(tmp_path, capsys):
    from sensai.cli import main

    assert main(["bench-load", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sensai bench-load: error:") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_process_cores_and_its_busiest_thread_are_measured():
    """Two threads of this process spin for 0.4 and 0.2 s of their own CPU time, the second
    ending before the phase does: the busiest thread's CPU is the first's (to the kernel's
    tick), and the process's counts both."""
    import os
    import threading
    import time

    from sensai.bench.load_measures import process_cores
    from sensai.bench.machine import process_cpu_seconds

    spun, stop = threading.Event(), threading.Event()

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def spin_then_stay(seconds: float) -> None:
        spin(seconds)
        spun.set()
        stop.wait()

    before, t0 = process_cpu_seconds(os.getpid()), time.monotonic()
    first = threading.Thread(target=spin_then_stay, args=(0.4,))
    second = threading.Thread(target=spin, args=(0.2,))
    first.start(), second.start()
    second.join()
    assert spun.wait(30)
    elapsed = time.monotonic() - t0
    cores = process_cores(before, process_cpu_seconds(os.getpid()), elapsed)
    stop.set()
    first.join()
    assert 0.38 <= cores["busiest_thread_cores"] * elapsed <= 0.45, cores
    assert cores["process_cores"] * elapsed >= 0.58, cores  # the ended thread's 0.2 s too
    assert cores["busiest_thread_cores"] <= 1.05
    assert process_cpu_seconds(None) is None and process_cores(None, before, 1.0) is None
    # The process's figure read a clock tick before its threads': never below the busiest.
    skewed = process_cores((0.0, {7: 0.0}), (0.98, {7: 0.99}), 1.0)
    assert skewed == {"process_cores": 0.99, "busiest_thread_cores": 0.99}

"""``sensai bench-swap``: the per-swap figures from known per-request records, and a short real
run - a ``sensai serve REPO --model-control explicit`` process over real HTTP on 127.0.0.1, two
versions swapped in under a closed loop from a real client process.

Timings are never asserted (the CPU is shared); what is: no errors, every answer named by a
version the repository served while it was in flight, the new version answering after each
swap, every answer equal to offline evaluation of the version it names, the files written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sensai.bench.swap_report import (lifetimes, misattributed, plot, render_markdown,
                                      render_table, swap_figures)


def records(rows):
    """Per-request records from (sent s, ms, status, version, image, index) rows."""
    t, ms, status, version, image, index = zip(*rows)
    return {"t": np.array(t, dtype=float), "ms": np.array(ms, dtype=float),
            "status": np.array(status), "version": np.array(version, dtype=object),
            "image": np.array(image), "index": np.array(index)}


SWAP = {"swap": 1, "version": "2", "from_version": "1", "artifact": "/a/b", "artifact_name": "b",
        "copy_s": 0.1, "sent_s": 10.0, "returned_s": 12.0, "load_status": 200,
        "load_answer": "{}"}
RSS = [{"t": 9.9, "phase": "before swap 1", "rss_mb": 100.0, "tree_rss_mb": 100.0,
        "processes": 1},
       {"t": 14.0, "phase": "swap 1", "rss_mb": 130.0, "tree_rss_mb": 130.0, "processes": 1},
       {"t": 20.0, "phase": "after swap 1", "rss_mb": 101.0, "tree_rss_mb": 101.0,
        "processes": 1}]


def synthetic():
    rows = [(0.1 * k, 10.0, 200, "1", k % 3, k % 3) for k in range(100)]  # 0 .. 9.9 s
    rows += [(10.0 + 0.1 * k, 50.0, 200, "1", 0, 0) for k in range(10)]  # 10 .. 10.9: old
    rows += [(11.0 + 0.1 * k, 20.0, 200, "2", 1, 1) for k in range(90)]  # 11 .. 19.9: new
    rows += [(11.5, 5.0, 503, "", 0, -1), (12.5, 3000.0, 0, "", 0, -1)]  # two errors
    rows += [(15.0, 10.0, 200, "1", 2, 0)]  # the old version, after it was unloaded: stale
    rows += [(5.0, 10.0, 200, "2", 2, 2)]  # the new version before its load request
    return records(rows)


def test_lifetimes_skip_a_refused_version():
    refused = SWAP | {"swap": 2, "version": "3", "sent_s": 20.0, "returned_s": 20.5,
                      "load_status": 400}
    assert lifetimes("1", [SWAP, refused]) == {"1": (-np.inf, 12.0), "2": (10.0, np.inf)}
    req = records([(21.0, 5.0, 200, "3", 0, 0), (21.0, 5.0, 200, "2", 0, 0)])
    assert misattributed(req, lifetimes("1", [SWAP, refused])) == 1


def test_swap_figures_from_known_records():
    req = synthetic()
    figs = swap_figures(req, first_version="1", swaps=[SWAP], steady_start_s=2.0,
                        rss_samples=RSS, expected={"1": [0, 1, 2], "2": [0, 1, 2]},
                        failures={"TimeoutError": 1})
    run = figs["run"]
    assert run["requests"] == 204 and run["errors"] == 2
    assert run["status_counts"] == {"0": 1, "200": 202, "503": 1}
    assert run["answers_by_version"] == {"1": 111, "2": 91}
    assert run["misattributed"] == 2 and run["failures"] == {"TimeoutError": 1}
    # Old-version answers of image k % 3 with index k % 3 are right; the stale one (image 2,
    # index 0) is wrong; the early "2" answer is right.
    assert run["wrong_by_version"] == {"1": 1, "2": 0}
    assert run["lifetimes_s"] == {"1": [None, 12.0], "2": [10.0, None]}
    steady = run["steady"]
    # Sent from 2.0 s and answered before 10.0 s: 2.0 .. 9.9, and the early answer at 5.0.
    assert steady["window_s"] == [2.0, 10.0] and steady["requests"] == 81
    assert steady["latency_ok_ms"]["p99"] == 10.0

    (s,) = figs["swaps"]
    assert s["window_s"] == [10.0, 13.0] and s["load_s"] == 2.0
    # In flight at some moment of [10, 13]: 10.0 .. 10.9 (old), 11.0 .. 13.0 (new), the
    # errors at 11.5 and 12.5 (answered at 15.5); not 9.9 (answered at 9.91), nor the stale
    # answer sent at 15.
    assert s["answers_by_version"] == {"1": 10, "2": 21}
    assert s["requests"] == 33 and s["errors"] == 2
    assert s["status_counts"] == {"0": 1, "200": 31, "503": 1}
    assert s["misattributed"] == 0
    assert s["first_answer_by_new_s"] == pytest.approx(1.02)
    assert s["last_answer_by_old_s"] == pytest.approx(5.01)  # the stale answer at 15.01
    assert s["latency_ok_ms"]["max"] == 50.0
    assert s["p99_over_steady"] == pytest.approx(s["latency_ok_ms"]["p99"] / 10.0, abs=1e-3)
    assert (s["rss_before_mb"], s["rss_after_mb"]) == (100.0, 101.0)
    assert s["artifact_name"] == "b" and s["load_status"] == 200  # the record is kept


def test_report_renders_the_table_markdown_and_plot(tmp_path):
    from PIL import Image

    req = synthetic()
    result = {
        "model": "fmnist_cnn", "dataset": "fashion-mnist", "command": "sensai bench-swap a b",
        "seconds": 30.0,
        "settings": {"model": "fmnist", "artifacts": ["/x/a", "/x/b"], "after_s": 8.0,
                     "images": 3, "concurrency": 8, "warmup_s": 2.0, "steady_s": 8.0,
                     "swaps": 1, "sample_s": 0.5},
        "machine": {"cpu_model": "cpu", "usable_cores": 2, "load_average": [1, 1, 1],
                    "load_average_end": [1, 1, 1]},
        "gateway": {"command": "sensai serve repo", "pid": 1, "startup_s": 1.0,
                    "exit_code": 0, "log": "/x/gateway.log"},
        "figures": swap_figures(req, first_version="1", swaps=[SWAP], steady_start_s=2.0,
                                rss_samples=RSS),
        "rss": {"samples": RSS},
        "requests": {k: req[k].tolist() for k in ("t", "ms", "status", "version")},
    }
    table = render_table(result)
    assert "1 -> 2 (b)" in table and "v1: 10, v2: 21" in table and "100.0" in table
    assert "2 errors" in table and "2 misattributed" in table
    md = render_markdown(result)
    for text in ("# sensai bench-swap: fmnist_cnn on fashion-mnist", "`sensai bench-swap a b`",
                 "| swap | version | load s |", "| 1 | 1 -> 2 (b) | 2.00 |",
                 "`POST /v2/repository/models/fmnist/load`",
                 "before the first swap 100.0 MB, after the last 101.0 MB"):
        assert text in md, text
    plot(result, tmp_path / "swap.png")
    with Image.open(tmp_path / "swap.png") as img:
        assert img.format == "PNG" and img.size[0] > 600


@pytest.mark.parametrize("argv, fragment", [
    (["--swaps", "0"], "--swaps must be an integer from 1 to 1000"),
    (["--concurrency", "0"], "--concurrency must be an integer from 1 to 1000"),
    (["--set", "steady_seconds=0"], "--set steady_seconds must be a number > 0"),
    (["--set", "after_seconds=-1"], "--set after_seconds must be a number >= 0"),
    (["--model", "../x"], "model name '../x': use 1-64 letters"),
])
def test_bad_arguments_are_refused_in_one_line(tiny_artifact, tmp_path, capsys, argv, fragment):
    from sensai.cli import main

    out = tmp_path / "o"
    assert main(["bench-swap", str(tiny_artifact), str(tiny_artifact), "--out", str(out),
                 *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("sensai bench-swap: error:")
    assert not out.exists()  # refused before anything was started or written


# --------------------------------------------------------------------------------------------
# A real run


@pytest.fixture(scope="module")
def swap_run(tiny_artifact, tiny_artifact_g2, tmp_path_factory):
    """Two decompositions of one model swapped in under load: G=5 as version 1, G=2 as
    version 2, G=5 again as version 3."""
    from sensai.bench.options import SwapOptions
    from sensai.bench.swap import run_swap_bench

    out = tmp_path_factory.mktemp("swap") / "out"
    result = run_swap_bench(tiny_artifact, tiny_artifact_g2, out, SwapOptions(
        model="fmnist", swaps=2, concurrency=4, warmup_seconds=0.5, steady_seconds=2.0,
        after_seconds=2.0, sample_seconds=0.25, images=12, progress=False, command="test"))
    return out, result, Path(tiny_artifact), Path(tiny_artifact_g2)


def test_a_swap_under_load_loses_no_request_and_each_answer_names_a_served_version(swap_run):
    _, result, a, b = swap_run
    run, swaps = result["figures"]["run"], result["figures"]["swaps"]
    assert run["errors"] == 0 and set(run["status_counts"]) == {"200"} and not run["failures"]
    assert [(s["swap"], s["from_version"], s["version"], s["load_status"]) for s in swaps] == \
        [(1, "1", "2", 200), (2, "2", "3", 200)]
    assert [Path(s["artifact"]) for s in swaps] == [b, a]
    # From the raw records, independently of the figures: each version answered only between
    # its load request and the return of the load call that replaced it.
    req = result["requests"]
    assert len(req["t"]) == run["requests"] > 0
    born = {"1": -np.inf, "2": swaps[0]["sent_s"], "3": swaps[1]["sent_s"]}
    gone = {"1": swaps[0]["returned_s"], "2": swaps[1]["returned_s"], "3": np.inf}
    for t, ms, version in zip(req["t"], req["ms"], req["version"]):
        assert version in born, version
        assert t + ms / 1e3 >= born[version] - 1e-3 and t <= gone[version] + 1e-3, (t, version)
    assert run["misattributed"] == 0
    # Every answer agrees with offline evaluation of the artifact of the version it names.
    assert set(run["wrong_by_version"]) == {"1", "2", "3"}
    assert sum(run["wrong_by_version"].values()) == 0
    for s in swaps:
        assert s["errors"] == 0 and s["misattributed"] == 0
        assert s["answers_by_version"].get(s["version"], 0) > 0  # the new version answers
        assert 0 < s["first_answer_by_new_s"] and s["load_s"] > 0
        assert s["rss_before_mb"] > 10 and s["rss_after_mb"] > 10
        assert s["latency_ok_ms"]["n"] > 0
    assert run["steady"]["requests"] > 0 and run["steady"]["errors"] == 0


def test_the_swap_run_writes_its_files_and_stops_its_gateway(swap_run):
    from PIL import Image

    out, result, _, _ = swap_run
    on_disk = json.loads((out / "swap.json").read_text())
    assert on_disk["kind"] == "sensai-bench-swap" and on_disk["command"] == "test"
    assert on_disk["settings"]["swaps"] == 2 and on_disk["settings"]["model"] == "fmnist"
    assert on_disk["figures"] == json.loads(json.dumps(result["figures"]))
    assert "--model-control explicit" in on_disk["gateway"]["command"]
    md = (out / "swap.md").read_text()
    assert "| 1 | 1 -> 2 (fmnist_g2) |" in md and "| 2 | 2 -> 3 (" in md
    with Image.open(out / "swap.png") as img:
        assert img.format == "PNG" and img.size[0] > 600
    assert (out / "gateway.log").exists()
    assert not (out / "repo").exists()  # the repository's copies are removed at the end
    samples = on_disk["rss"]["samples"]
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert {"before swap 1", "after swap 1", "before swap 2", "after swap 2"} <= \
        {s["phase"] for s in samples}
    pid = on_disk["gateway"]["pid"]
    assert on_disk["gateway"]["exit_code"] == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

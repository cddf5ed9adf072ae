"""Every result stored under sensai/bench/results (what BENCHMARKS.md cites) still renders:
a report module that drops a key older results lack would otherwise fail only when someone
re-reads an old run."""

import json
from pathlib import Path

import pytest

from sensai.bench import latency_report, load_report, plan_report, robust_report, swap_report

RESULTS = Path(__file__).resolve().parents[1] / "sensai" / "bench" / "results"
REPORTS = {"sensai-bench": latency_report, "sensai-bench-load": load_report,
           "sensai-bench-load-sweep": load_report, "sensai-bench-swap": swap_report,
           "sensai-bench-robust": robust_report, "sensai-plan": plan_report}
STORED = [p for p in sorted(RESULTS.rglob("*.json"))
          if json.loads(p.read_text()).get("kind") in REPORTS]


def test_there_are_stored_results_of_every_kind():
    kinds = {json.loads(p.read_text())["kind"] for p in STORED}
    assert {"sensai-bench", "sensai-bench-load", "sensai-bench-load-sweep"} <= kinds


@pytest.mark.parametrize("path", STORED, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_stored_result_renders(path):
    result = json.loads(path.read_text())
    report = REPORTS[result["kind"]]
    markdown = report.render_markdown(result)
    assert markdown.startswith("#") and len(markdown.splitlines()) > 5
    assert report.render_table(result).strip()

"""``sensai plan``'s report: plan.md (every measured deployment against the constraints, why
the chosen one won) and plan.png (p99 against throughput of the confirmed ones, the budget
drawn)."""

from __future__ import annotations

from pathlib import Path

from .render import (SHARED_CORES, Col, Table, draw, heading, machine_line, markdown, mark,
                     p50_p99, p99_line, p99_panel, with_p99)


def _latency(m: dict) -> str:
    s = m["summary"]
    return "-" if s.get("error") else p50_p99({"p50": s["p50_ms"], "p99": s["p99_ms"]}, " / ")


MEASURED = Table(
    Col("#", "n"), Col("phase", "phase"), Col("deployment", "label"),
    Col("one image p50 / p99 (ms)", _latency),
    Col("answers/s within budget", "summary.rps_within_budget", 1),
    Col("best answers/s", "summary.best_rps", 1), Col("memory (MB)", "summary.rss_mb", 1),
    Col("meets", "meets"),
    Col("why not", lambda m: m["summary"].get("error") or "; ".join(m["verdict"]["why_not"])
        or "-"))


def measured(result: dict, phase: str | None = None) -> list[dict]:
    """The measured deployments (of ``phase``), each marked chosen (the closest, when none
    meets the constraints), meeting or not."""
    first = "**chosen**" if result["meets"] else "**closest**"
    return [m | {"meets": first if m["n"] == result["chosen"] else
                 "yes" if m["verdict"]["meets"] else "no"}
            for m in result["measured"] if phase in (None, m["phase"])]


def render_table(result: dict) -> str:
    """The confirmed deployments, and why the chosen one won (where none meets the constraints
    the command says why on its own line)."""
    table = MEASURED.text(measured(result, "confirm"))
    return table + "\n\n" + result["why"] if result["meets"] else table


def constraints_text(c: dict) -> str:
    parts = [f"p99 within {c['latency_budget_ms']:g} ms" if c["latency_budget_ms"] else None,
             f"at least {c['min_throughput']:g} answers/s within it" if c["min_throughput"]
             else None,
             f"at most {c['max_memory_mb']:g} MB" if c["max_memory_mb"] else None]
    return ", ".join(p for p in parts if p) or "none"


def render_markdown(result: dict) -> str:
    st = result["settings"]
    c = st["constraints"]
    served = "`sensai serve {} --config {}`".format(
        next(m["artifact"] for m in result["measured"] if m["n"] == result["chosen"]),
        result["deployment"])
    return markdown(
        heading(result, "plan", "run_plan(...)"), machine_line(result),
        f"Constraints: {constraints_text(c)} (memory: the gateway's process tree, resident "
        f"sets summed); objective: {c['objective']}.  Search: {st['search']}, closed loops at "
        f"{', '.join(map(str, st['levels']))} in flight ({st['transport']}), {st['level_s']:g} s "
        f"each, {st['confirm_level_s']:g} s when confirming; every answer checked against "
        "offline evaluation.",
        "## The choice", result["why"] + ".",
        ("It is written to " if result["meets"] else "The closest is written to ")
        + f"`{result['deployment']}`; serve it with {served}.",
        "## Every measured deployment", MEASURED.md(measured(result)),
        "The confirmation (phase `confirm`, longer levels) decides; the search's figures only "
        "steer it.  " + SHARED_CORES)


def plot(result: dict, path: Path) -> None:
    marks = []
    for m in measured(result, "confirm"):
        pts, chosen = with_p99(m["levels"]), m["n"] == result["chosen"]
        if pts:
            marks.append(p99_line(pts, lw=2.5 if chosen else 1.2,
                                  label=(m["meets"].strip("*") + ": " if chosen else "")
                                  + m["label"]))
    budget = result["settings"]["constraints"]["latency_budget_ms"]
    if budget:
        marks.append(mark("axhline", budget, color="crimson", ls="--",
                          label=f"p99 budget {budget:g} ms"))
    levels = ", ".join(map(str, result["settings"]["levels"]))
    draw(path, [p99_panel(f"{result['model']}: the confirmed deployments, p99 against "
                          f"throughput ({levels} in flight)", marks)], (9, 6))

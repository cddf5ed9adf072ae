"""``sensai plan``'s report: plan.md (every measured deployment against the constraints, why
the chosen one won) and plan.png (p99 against throughput of the confirmed ones, the budget
drawn)."""

from __future__ import annotations

from pathlib import Path

from .render import SHARED_CORES, fmt, machine_line, md_table, pyplot, save_p99_plot, text_table

HEADER = ["#", "phase", "deployment", "one image p50 / p99 (ms)", "answers/s within budget",
          "best answers/s", "memory (MB)", "meets", "why not"]


def rows(result: dict) -> list[list[str]]:
    out = []
    for m in result["measured"]:
        s, v = m["summary"], m["verdict"]
        mark = ("**chosen**" if m["n"] == result["chosen"] else
                "yes" if v["meets"] else "no")
        if s.get("error"):
            out.append([str(m["n"]), m["phase"], m["label"], "-", "-", "-", "-", mark,
                        s["error"]])
            continue
        out.append([str(m["n"]), m["phase"], m["label"],
                    f"{fmt(s['p50_ms'])} / {fmt(s['p99_ms'])}", fmt(s["rps_within_budget"], 1),
                    fmt(s["best_rps"], 1), fmt(s["rss_mb"], 1), mark,
                    "; ".join(v["why_not"]) or "-"])
    return out


def render_table(result: dict) -> str:
    confirmed = [r for r, m in zip(rows(result), result["measured"]) if m["phase"] == "confirm"]
    return text_table(HEADER, confirmed) + "\n\n" + result["why"]


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
    lines = [
        f"# sensai plan: {result['model']} on {result['dataset']}", "",
        machine_line(result), "",
        f"Constraints: {constraints_text(c)} (memory: the gateway's process tree, resident "
        f"sets summed); objective: {c['objective']}.  Search: {st['search']}, closed loops at "
        f"{', '.join(map(str, st['levels']))} in flight ({st['transport']}), {st['level_s']:g} s "
        f"each, {st['confirm_level_s']:g} s when confirming; every answer checked against "
        "offline evaluation.", "",
        "## The choice", "", result["why"] + ".", "",
        ("It is written to " if result["meets"] else "The closest is written to ")
        + f"`{result['deployment']}`; serve it with {served}.", "",
        "## Every measured deployment", "",
        md_table(HEADER, rows(result)), "",
        "The confirmation (phase `confirm`, longer levels) decides; the search's figures only "
        "steer it.  " + SHARED_CORES, ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    for m in result["measured"]:
        if m["phase"] != "confirm":
            continue
        pts = [(r["throughput_rps"], r["latency_ok_ms"]["p99"]) for r in m["levels"]
               if (r.get("latency_ok_ms") or {}).get("p99") is not None]
        if not pts:
            continue
        chosen = m["n"] == result["chosen"]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                lw=2.5 if chosen else 1.2,
                label=("chosen: " if chosen else "") + m["label"])
    budget = result["settings"]["constraints"]["latency_budget_ms"]
    if budget:
        ax.axhline(budget, color="crimson", ls="--", label=f"p99 budget {budget:g} ms")
    save_p99_plot(fig, ax, f"{result['model']}: the confirmed deployments, p99 against "
                           f"throughput ({', '.join(map(str, result['settings']['levels']))} "
                           "in flight)", path)

"""Formatting shared by the benchmark reports: numbers, text and markdown tables, box plots."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from sensai.fsutil import atomic_path


def fmt(v, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def status_codes(counts: dict[str, int]) -> str:
    """``{"200": 9, "0": 1}`` -> ``200: 9, no answer: 1`` (0: the request got no answer)."""
    return ", ".join(f"{'no answer' if k == '0' else k}: {v}" for k, v in counts.items()) or "-"


def server_cores(phase: dict) -> str:
    """The server process's cores during a load phase, and its busiest thread's (the event
    loop's, under load)."""
    g = phase.get("gateway_cpu")
    return "-" if g is None else f"{g['process_cores']:.2f} ({g['busiest_thread_cores']:.2f})"


def machine_line(result: dict) -> str:
    """The machine a load run measured on, its load before and after, and the run's length."""
    m = result["machine"]
    return (f"Machine: {m['cpu_model']}, {m['usable_cores']} usable cores; load average "
            f"{m.get('load_average')} at the start, {m.get('load_average_end')} at the end; "
            f"{result.get('seconds')} s in all.")


SHARED_CORES = ("The cores may have been shared with other work while this ran; compare figures "
                "from one run, not across runs.")


def human(n: int | None) -> str:
    """12345678 -> 12.35M."""
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded for a terminal; the first two left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in
                      enumerate(zip(r, widths))) for r in rows]
    return "\n".join([line, sep, *body])


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def pyplot():
    """matplotlib's pyplot on the file-only backend (imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def horizontal_boxplot(ax, data: Sequence[Sequence[float]], labels: Sequence[str],
                       colors: Sequence[str] | None = None) -> None:
    """One horizontal box per sample (whiskers p1-p99), the first at the top."""
    import matplotlib

    if not data:
        return
    # ``orientation`` replaced ``vert`` in matplotlib 3.10.
    horizontal = ({"orientation": "horizontal"}
                  if tuple(int(p) for p in matplotlib.__version__.split(".")[:2]) >= (3, 10)
                  else {"vert": False})
    parts = ax.boxplot(data, showfliers=True, patch_artist=colors is not None, whis=(1, 99),
                       flierprops={"markersize": 2}, **horizontal)
    for patch, c in zip(parts["boxes"], colors or []):
        patch.set_facecolor(c)
        patch.set_alpha(0.6)
    ax.set_yticks(np.arange(1, len(labels) + 1), labels, fontsize=8)
    ax.invert_yaxis()


def save_p99_plot(fig, ax, title: str, path: Path) -> None:
    """A p99-latency-against-throughput plot (load --sweep, plan), its axes labelled, saved."""
    ax.set_yscale("log")
    ax.set_xlabel("throughput (answers 200 per second)")
    ax.set_ylabel("p99 latency (ms, log)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    plt = pyplot()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)

"""The benchmark reports' one engine.  A report is described as data and rendered here: a table
as columns (a header, where each row's cell is, the digits of a float), a document as blocks
(paragraphs, tables, headings, None where a part is absent), a plot as panels of marks (what is
drawn, then how the axes are labelled).  Terminal text, markdown and PNG come from one
description, so the reports differ only in what they say."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from sensai.fsutil import atomic_path

SHARED_CORES = ("The cores may have been shared with other work while this ran; compare figures "
                "from one run, not across runs.")


def fmt(v, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def pct(share: float | None) -> str:
    """0.42 -> ``42 %``."""
    return "-" if share is None else f"{share * 100:.0f} %"


def human(n: int | None) -> str:
    """12345678 -> 12.35M."""
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def status_codes(counts: dict[str, int]) -> str:
    """``{"200": 9, "0": 1}`` -> ``200: 9, no answer: 1`` (0: the request got no answer)."""
    return ", ".join(f"{'no answer' if k == '0' else k}: {v}" for k, v in counts.items()) or "-"


def server_cores(phase: dict) -> str:
    """The server process's cores during a load phase, and its busiest thread's (the event
    loop's, under load)."""
    g = phase.get("gateway_cpu")
    return "-" if g is None else f"{g['process_cores']:.2f} ({g['busiest_thread_cores']:.2f})"


def p50_p99(q: dict | None, sep: str = "/") -> str:
    """A latency's p50 and p99 in ms, ``12.30/45.60`` ("-" where missing)."""
    q = q or {}
    return f"{fmt(q.get('p50'))}{sep}{fmt(q.get('p99'))}"


def one_call_device(one: dict) -> str:
    """Where the one-call reference (:mod:`.one_call`) ran: its kind, runtime, device, cores."""
    cores = f", {one['cores']} core(s)" if one.get("cores") else ""
    return f"{one['kind']}, {one['runtime']} on {one['device']}{cores}"


def dig(row: Any, path: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; None where a step is missing (an older result)."""
    for key in path.split("."):
        if not isinstance(row, Mapping):
            return None
        row = row.get(key)
    return row


# --------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class Col:
    """A column: its header, each row's cell (a dotted path into the row, or a function of it;
    a number is shown with ``nd`` digits, None as "-")."""

    header: str
    cell: str | Callable[[Any], Any]
    nd: int = 2

    def of(self, row: Any) -> str:
        return fmt(dig(row, self.cell) if isinstance(self.cell, str) else self.cell(row), self.nd)


def quantiles(path: str, *qs: str, suffix: str = "") -> list[Col]:
    """A column per quantile ``q`` of a latency at ``path``, headed ``"{q} ms{suffix}"``."""
    return [Col(f"{q} ms{suffix}", f"{path}.{q}") for q in qs]


STATUS_CODES = Col("status codes", lambda r: status_codes(r["status_counts"]))
SERVER_CORES = Col("server cores (busiest thread)", server_cores)
SERVER_CORES_NOTE = ("the serving process's own threads, and in brackets its busiest thread's "
                     "(the event loop under load: near 1.00, one core is its ceiling)")


class Table:
    """Columns, and the rows they make of items: an item is a row to read, or a list of cells
    made already (a row saying why it has no figures), padded with "-"."""

    def __init__(self, *cols: Col):
        self.cols = cols
        self.header = [c.header for c in cols]

    def rows(self, items: Iterable) -> list[list[str]]:
        return [[str(c) for c in it] + ["-"] * (len(self.cols) - len(it)) if isinstance(it, list)
                else [c.of(it) for c in self.cols] for it in items]

    def md(self, items: Iterable) -> str:
        return md_table(self.header, self.rows(items))

    def text(self, items: Iterable) -> str:
        return text_table(self.header, self.rows(items))

    def without(self, header: str) -> Table:
        return Table(*(c for c in self.cols if c.header != header))


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


# --------------------------------------------------------------------------------------------
# Documents


def blocks(*parts: Any) -> list[str]:
    """The blocks of a document in order: nested lists flattened, absent parts (None, "")
    dropped."""
    out = []
    for p in parts:
        if isinstance(p, (list, tuple)):
            out += blocks(*p)
        elif p:
            out.append(p)
    return out


def terminal(*parts: Any) -> str:
    return "\n\n".join(blocks(*parts))


def markdown(*parts: Any) -> str:
    """A markdown document: its blocks separated by blank lines, a newline at the end."""
    return "\n\n".join(blocks(*parts)) + "\n"


def heading(result: dict, tool: str, fallback: str) -> list[str]:
    """A bench report's title and the command that made it."""
    return [f"# sensai {tool}: {result['model']} on {result['dataset']}",
            f"Command: `{result.get('command') or fallback}`"]


def machine_line(result: dict, length: bool = True) -> str:
    """The machine a run measured on, its load before and after, and the run's length."""
    m = result["machine"]
    return (f"Machine: {m['cpu_model']}, {m['usable_cores']} usable cores; load average "
            f"{m.get('load_average')} at the start, {m.get('load_average_end')} at the end"
            + (f"; {result.get('seconds')} s in all." if length else "."))


def gateway_settings(g: dict) -> str:
    """The admission settings every gateway of a load run was started with."""
    t = g.get("latency_target_s")  # absent in older runs
    return (f"deadline {g['deadline_s']:g} s, max_requests {g['max_requests']}, max_predictions "
            f"{g['max_predictions']}, latency target "
            + (f"{t:g} s" if t is not None else "a quarter of the deadline"))


def gateway_text(gw: dict, note: str = "") -> str:
    """The gateway process a run measured, how it started and ended."""
    return (f"Gateway: `{gw['command']}` (pid {gw['pid']}, its own process{note}; ready in "
            f"{gw['startup_s']} s; exit status {gw['exit_code']} after SIGTERM at the end; log "
            f"`{Path(gw['log']).name}`)")


# --------------------------------------------------------------------------------------------
# Plots


def mark(kind: str, *args, **kw) -> tuple:
    """One thing drawn on a panel: an Axes method's name (``plot``, ``bar``, ``axvspan``...) or
    ``box`` (:func:`horizontal_boxplot`) or ``stack`` (:func:`stacked_bars`), and its arguments."""
    return kind, args, kw


@dataclass
class Panel:
    """One axes: its marks, drawn in order, then its scales, labels, ticks, legend and grid."""

    marks: Sequence[tuple] = ()
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    xscale: str = "linear"
    yscale: str = "linear"
    legend: dict | None = None  # the legend's keyword arguments; None: no legend
    grid: dict | None = field(default_factory=lambda: {"alpha": 0.3})
    xticks: tuple | None = None  # (positions, labels)
    yticks: tuple | None = None  # (positions, labels), in small type, the first at the top
    title_size: float | None = None

    def draw(self, ax) -> None:
        # Scales first: setting one resets its axis's ticks, a box plot's labels among them.
        ax.set_xscale(self.xscale)
        ax.set_yscale(self.yscale)
        for kind, args, kw in self.marks:
            if kind in DRAWN_HERE:
                DRAWN_HERE[kind](ax, *args, **kw)
            else:
                getattr(ax, kind)(*args, **kw)
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel(self.ylabel)
        ax.set_title(self.title, **({"fontsize": self.title_size} if self.title_size else {}))
        if self.xticks:
            ax.set_xticks(*self.xticks)
        if self.yticks:
            ax.set_yticks(*self.yticks, fontsize=8)
            ax.invert_yaxis()
        if self.legend is not None:
            ax.legend(**self.legend)
        if self.grid is not None:
            ax.grid(**self.grid)


def p99_panel(title: str, marks: Sequence[tuple]) -> Panel:
    """p99 latency against throughput (load --sweep, plan)."""
    return Panel(marks, title, "throughput (answers 200 per second)", "p99 latency (ms, log)",
                 yscale="log", legend={"fontsize": 8, "loc": "best", "framealpha": 0.6},
                 grid={"alpha": 0.3, "which": "both"})


def with_p99(levels: Iterable[dict]) -> list[dict]:
    return [r for r in levels if dig(r, "latency_ok_ms.p99") is not None]


def p99_line(levels: Sequence[dict], **kw) -> tuple:
    """A line through levels' (:func:`with_p99`) throughput and p99, on a :func:`p99_panel`."""
    return mark("plot", [r["throughput_rps"] for r in levels],
                [r["latency_ok_ms"]["p99"] for r in levels], marker="o", **kw)


def rss_line(samples: Sequence[dict]) -> list[tuple]:
    """The gateway process's sampled RSS over time (none: no line)."""
    return [mark("plot", [s["t"] for s in samples], [s["rss_mb"] for s in samples], marker=".",
                 color="#4C72B0", label="gateway process")] if samples else []


def draw(path: Path, panels: Sequence[Panel], size: tuple[float, float], rows: int = 1,
         cols: int = 1, **subplots) -> None:
    """The panels, row by row, as one PNG at ``path`` (matplotlib imported only now, on its
    file-only backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, **subplots)
    for ax, panel in zip(axes.flat, panels):
        panel.draw(ax)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def horizontal_boxplot(ax, data: Sequence[Sequence[float]], labels: Sequence[str],
                       colors: Sequence[str] | None = None) -> None:
    """One horizontal box per sample, the first at the top; its whiskers reach the farthest
    samples within p1-p99 (matplotlib's rule), which in a small sample fall short of them."""
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


def stacked_bars(ax, at: Sequence[float], layers: Sequence[tuple[Sequence[float], dict]],
                 horizontal: bool = False, **common) -> None:
    """Bars at ``at``, each layer (values, its own keyword arguments) on the ones before."""
    base = np.zeros(len(at))
    for values, kw in layers:
        if horizontal:
            ax.barh(at, values, left=base, **common, **kw)
        else:
            ax.bar(at, values, bottom=base, **common, **kw)
        base = base + np.asarray(values, dtype=float)


DRAWN_HERE = {"box": horizontal_boxplot, "stack": stacked_bars}

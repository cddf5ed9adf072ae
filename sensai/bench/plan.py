"""``sensai plan``: choose the deployment by measurement, under the user's constraints.

Candidates are the given models (a trained model directory becomes the one-group artifact the
gateway serves; each artifact as decomposed) crossed with the settings that move the figures:
how many devices the groups are placed on (``workers``), where they run (``backend``), the
gateway processes and the workers' batch size.  Each candidate is written as the deployment file
``sensai serve ART --config FILE`` reads and served exactly so, in a process of its own, driven
by bench-load's own client processes and levels (:class:`~.load_run.Sweep`), every answer
checked against offline evaluation.  The quick search measures every model's defaults, then
climbs one setting at a time from the best, then measures the top few again for longer (the
confirmation decides); the full search measures every combination before the confirmation.
Outputs: ``plan.json`` (every measured point), ``plan.md``, ``plan.png`` and, when a deployment
meets the constraints, ``deployment.json`` (else ``closest.json``).
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import httpx

from sensai.artifact import Artifact, load_artifact
from sensai.errors import SensaiError
from sensai.fsutil import check_out_dir, sha256_file, write_json_atomic
from sensai.manifest import MANIFEST, load_model_record
from sensai.serving.core.settings import (CONFIG_KIND, CONFIG_SCHEMA, GatewaySettings,
                                          load_settings)

from .harness import checked_dataset, envelope, finish, inputs, load_test_images
from .load import gateway_settings, offline_top1, seconds_bar
from .load_run import Sweep, check_load_settings, server_core_count, sweep_clients
from .load_single import model_dir_as_artifact
from .options import SEARCHES, LoadOptions, LoadPlan, PlanOptions
from .plan_judge import OBJECTIVE_TEXT, Constraints
from .plan_report import plot, render_markdown

CONFIRM = 3  # candidates measured again, beside the chosen model's defaults
CONFIRM_FACTOR = 3  # ... for this many times the level seconds
# A confirmed deployment that beats its model's defaults by less than this is within what two
# runs of one deployment differ by on a shared host: the defaults are kept.
NOISE = 0.05
# Settings the plan's own run fixes (the address) or that are the operator's to give.
NOT_PLANNED = ("host", "port", "grpc_port", "log_level", "model_control", "repository_token")


@dataclass
class Entry:
    """One model the plan serves: its name in the report, the artifact served, its groups, the
    top-1 every answer must equal, its manifest's hash (the deployment file names it)."""

    name: str
    root: Path
    groups: int
    expected: list[int]
    manifest_sha256: str


def axes(groups: int, cores: int) -> dict[str, list]:
    """The values of each planned setting, the default (None) first."""
    workers = [None, 1, *([2] if groups > 3 else [])] if groups > 1 else [None]
    return {"workers": workers, "backend": [None, "processes"],
            "gateway_replicas": [None, *(n for n in (1, 2, 4, 8) if n <= cores)],
            "batch_max_rows": [None, 1, 32]}


def effective(settings: dict[str, Any], groups: int, cores: int) -> tuple:
    """What a candidate's settings amount to (two that differ only in naming a default are
    one candidate)."""
    gs = GatewaySettings(**settings)
    return (gs.workers or groups, gs.backend, gs.gateway_processes(cores), gs.batch_max_rows)


def deployment_doc(artifact: str, manifest_sha256: str, settings: dict[str, Any]
                   ) -> dict[str, Any]:
    """What ``sensai serve ART --config FILE`` reads: every setting the deployment changes, and
    the artifact it is measured with."""
    return {"kind": CONFIG_KIND, "schema_version": CONFIG_SCHEMA,
            "artifact": {"path": artifact, "manifest_sha256": manifest_sha256},
            "settings": settings}


def settings_text(planned: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in planned.items()) or "defaults"


def resolve_models(paths: Sequence[str | Path], out: Path, data_dir: str | None
                   ) -> list[Artifact]:
    """The artifacts to serve: each artifact as it is, each trained model directory as its
    one-group artifact (under ``out/models/``); they must answer the same question.  Every
    model is read and checked (and ``out``, and the test split in ``data_dir``, too) before
    anything is written: a refused plan leaves nothing behind."""
    check_out_dir(out)
    paths = [Path(p) for p in paths]
    read = [load_artifact(p) if (p / MANIFEST).is_file() or not p.is_dir() else None
            for p in paths]
    described = [load_model_record(p) if a is None else a.manifest for p, a in zip(paths, read)]
    first = described[0]
    for path, m in zip(paths[1:], described[1:]):
        if (m.dataset.name, tuple(m.dataset.input_shape), m.num_classes) != (
                first.dataset.name, tuple(first.dataset.input_shape), first.num_classes):
            raise SensaiError(f"{path} answers {m.num_classes} classes of {m.dataset.name} at "
                              f"{list(m.dataset.input_shape)}, {paths[0]} "
                              f"{first.num_classes} of {first.dataset.name} at "
                              f"{list(first.dataset.input_shape)}: a plan compares deployments "
                              "of one model")
    checked_dataset(first.dataset.to_spec(), data_dir)
    return [model_dir_as_artifact(p, out / "models" / f"{i}-{p.name}")[0] if a is None else a
            for i, (p, a) in enumerate(zip(paths, read))]


def entry_names(arts: Sequence[Artifact]) -> list[str]:
    names = []
    for a in arts:
        g = len(a.subnets)
        base = "original" if g == 1 else f"{a.root.name} (G={g})"
        names.append(base if base not in names else f"{base} #{len(names)}")
    return names


class Planner:
    """Measures candidates one after another on the same client processes."""

    def __init__(self, sweep: Sweep, entries: list[Entry], base: dict[str, Any],
                 constraints: Constraints, out: Path, cores: int):
        self.sweep, self.entries, self.base = sweep, entries, base
        self.constraints, self.out, self.cores = constraints, out, cores
        self.level_s = sweep.plan.level_seconds  # the search's; confirming runs longer
        self.measured: list[dict[str, Any]] = []
        self.seen: dict[tuple, dict[str, Any]] = {}  # (entry, effective, confirming) -> it

    def measure(self, entry: Entry, planned: dict[str, Any], phase: str) -> dict[str, Any]:
        planned = {k: v for k, v in planned.items() if v is not None}
        doc = deployment_doc(str(entry.root), entry.manifest_sha256, {**self.base, **planned})
        key = (entry.name, effective(doc["settings"], entry.groups, self.cores),
               phase == "confirm")
        if key in self.seen:
            return self.seen[key]
        n = len(self.measured)
        slug = f"{n:02d}-{re.sub(r'[^A-Za-z0-9]+', '-', entry.name).strip('-')}"
        path = self.out / "candidates" / f"{slug}.json"
        write_json_atomic(path, doc)
        label = f"{entry.name}: {settings_text(planned)}"
        level_s = self.level_s * (CONFIRM_FACTOR if phase == "confirm" else 1)
        rec: dict[str, Any] = {"n": n, "model": entry.name, "artifact": str(entry.root),
                               "manifest_sha256": entry.manifest_sha256,
                               "planned": planned, "settings": doc["settings"],
                               "phase": phase, "level_s": level_s, "config": str(path),
                               "label": label}
        try:
            self.sweep.plan = replace(self.sweep.plan, level_seconds=level_s)
            self.sweep.use(load_settings(doc["settings"]))
            rep = self.sweep.serve(slug, "sensai", entry.root, entry.expected, label=label,
                                   args=["--config", str(path)])
            rec["levels"], rec["server"] = rep["levels"], rep["server"]
            rec["summary"] = self.constraints.summarize(rep["levels"])
        except (SensaiError, OSError, httpx.HTTPError) as e:
            # A deployment that cannot serve here is a measured outcome, not the plan's end.
            rec["levels"], rec["summary"] = [], {"error": " ".join(str(e).split()),
                                                 "p50_ms": None}
        rec["verdict"] = self.constraints.judge(rec["summary"])
        self.report(rec)
        self.measured.append(rec)
        self.seen[key] = rec
        return rec

    def report(self, rec: dict[str, Any]) -> None:
        s, v = rec["summary"], rec["verdict"]
        if s.get("error"):
            line = f"did not serve: {s['error']}"
        else:
            line = (f"one image p50/p99 {s['p50_ms']:.2f}/{s['p99_ms']:.2f} ms, "
                    f"{s['rps_within_budget']:g} answers/s within the budget"
                    + (f", {s['rss_mb']:g} MB" if s["rss_mb"] else "") + ": "
                    + ("meets the constraints" if v["meets"] else "; ".join(v["why_not"])))
        if self.sweep.progress:
            self.sweep.bar.write(f"[{rec['phase']}] {rec['label']}: {line}")

    def ranked(self, phase: str | None = None) -> list[dict[str, Any]]:
        pool = [m for m in self.measured if phase is None or m["phase"] == phase]
        return sorted(pool, key=self.constraints.sort_key)

    def entry(self, name: str) -> Entry:
        return next(e for e in self.entries if e.name == name)

    def quick(self) -> None:
        """Every model's defaults, then one setting at a time from the best (kept when it
        ranks higher)."""
        for e in self.entries:
            self.measure(e, {}, "screen")
        best = self.ranked()[0]
        entry, current = self.entry(best["model"]), dict(best["planned"])
        for name, values in axes(entry.groups, self.cores).items():
            tried = [self.measure(entry, {**current, name: v}, "climb") for v in values
                     if v != current.get(name)]
            top = sorted([best, *tried], key=self.constraints.sort_key)[0]
            if top is not best:
                best, current = top, dict(top["planned"])

    def full(self) -> None:
        """Every model with every combination of the planned settings."""
        for e in self.entries:
            grid = axes(e.groups, self.cores)
            for values in itertools.product(*grid.values()):
                self.measure(e, dict(zip(grid, values)), "grid")

    def confirm(self) -> list[dict[str, Any]]:
        """The top few again, for longer, with the chosen model's defaults: these decide."""
        top = self.ranked()[:CONFIRM]
        picks = [*top, {"model": top[0]["model"], "planned": {}}]
        for m in picks:
            self.measure(self.entry(m["model"]), m["planned"], "confirm")
        return self.ranked("confirm")


def check_plan(paths: Sequence, constraints: Constraints, search: str) -> None:
    if not paths:
        raise SensaiError("give at least one model directory or artifact")
    constraints.check()
    if search not in SEARCHES:
        raise SensaiError(f"--search {search!r}: choose one of {', '.join(SEARCHES)}")


def planned_base(gs: GatewaySettings) -> dict[str, Any]:
    """The settings the operator fixed for every candidate (``--env``, ``SENSAI_*``)."""
    return {k: v for k, v in gs.changed().items() if k not in NOT_PLANNED}


def run_plan(paths: Sequence[str | Path], out_dir: str | Path, constraints: Constraints,
             options: LoadOptions, plan: PlanOptions) -> dict[str, Any]:
    """The plan of ``paths`` (model directories and artifacts) under ``constraints``, searched
    and measured as ``plan`` says; writes plan.json, plan.md, plan.png and deployment.json (or
    closest.json) to ``out_dir`` and returns what plan.json holds (``chosen``: the deployment's
    number among ``measured``, ``meets``: whether it meets the constraints)."""
    # Each candidate is measured as the sweep measures a configuration: its closed loops only.
    phases = LoadPlan(sweep=True, configs=("class-parallel",), levels=tuple(sorted(set(
        plan.levels))), transport=plan.transport, level_seconds=plan.level_seconds,
        warmup_seconds=plan.warmup_seconds, overload_seconds=0.0, bare_route=False)
    check_plan(paths, constraints, plan.search)
    check_load_settings(options, phases)
    gs, _ = gateway_settings(options)
    arts = resolve_models(paths, Path(out_dir), options.data_dir)
    spec, out = inputs(arts[0], options.data_dir, out_dir)
    t_start = time.perf_counter()
    imgs = load_test_images(spec, options.images, options.seed, png=True)
    entries = [Entry(name, a.root, len(a.subnets), offline_top1(a, imgs.xs, gs),
                     sha256_file(a.root / MANIFEST))
               for name, a in zip(entry_names(arts), arts)]
    cores, base = server_core_count(options.client_cores), planned_base(gs)
    settings = {"constraints": asdict(constraints), "search": plan.search,
                "levels": list(phases.levels), "level_s": plan.level_seconds,
                "warmup_s": plan.warmup_seconds, "transport": plan.transport,
                "confirm": CONFIRM, "confirm_level_s": plan.level_seconds * CONFIRM_FACTOR,
                "clients": options.clients, "images": len(imgs), "seed": options.seed,
                "server_cores": cores, "fixed_settings": base,
                "models": [{"name": e.name, "artifact": str(e.root), "groups": e.groups}
                           for e in entries]}
    result = envelope("sensai-plan", command=options.command, artifact=arts[0], spec=spec,
                      settings=settings)
    bar = seconds_bar(options, "sensai plan")
    try:
        with sweep_clients(options, imgs, spec) as procs:
            planner = Planner(Sweep(options, phases, out=out, procs=procs, gs=gs, bar=bar,
                                    usable_cores=result["machine"].get("usable_cores")),
                              entries, base, constraints, out, cores)
            planner.quick() if plan.search == "quick" else planner.full()
            planner.confirm()
    finally:
        bar.close()
    result.update(decide(planner.measured, constraints, out))
    finish(out, "plan", result, t_start, render_markdown, plot)
    return result


def decide(measured: list[dict[str, Any]], constraints: Constraints, out: Path
           ) -> dict[str, Any]:
    """The confirmed ranking's first, written as ``deployment.json`` when it meets the
    constraints, else as ``closest.json``; why it won, against its model's defaults."""
    confirmed = sorted((m for m in measured if m["phase"] == "confirm"),
                       key=constraints.sort_key)
    chosen = confirmed[0]
    defaults = next((m for m in confirmed if m["model"] == chosen["model"]
                     and not m["planned"]), None)
    kept = defaults is not None and defaults is not chosen and constraints.within_noise(
        defaults, chosen, NOISE)
    if kept:  # what the defaults do is what every other host does too
        chosen = defaults
    meets = chosen["verdict"]["meets"]
    doc = deployment_doc(chosen["artifact"], chosen["manifest_sha256"], chosen["settings"]) | {
        "plan": {"constraints": asdict(constraints), "meets": meets,
                 "summary": chosen["summary"], "label": chosen["label"]}}
    target = out / ("deployment.json" if meets else "closest.json")
    other = out / ("closest.json" if meets else "deployment.json")
    other.unlink(missing_ok=True)  # a previous plan's choice no longer stands
    write_json_atomic(target, doc)
    given = constraints.given
    why = (f"{chosen['label']} "
           + (f"meets {given} with " if given else "(no constraint given): ")
           + f"{constraints.objective_value(chosen)}, {OBJECTIVE_TEXT[constraints.objective]} "
           "of the confirmed deployments" if meets else
           f"no measured deployment meets {constraints.describe()}; the closest is "
           f"{chosen['label']} ({'; '.join(chosen['verdict']['why_not'])})")
    if kept:
        why += (f"; its model's defaults, kept: the best measured ("
                f"{constraints.objective_value(confirmed[0])}) was within "
                f"{NOISE:.0%} of them")
    elif defaults is not None and defaults is not chosen:
        why += f"; its model's defaults: {constraints.objective_value(defaults)}"
    return {"measured": measured, "chosen": chosen["n"], "meets": meets,
            "defaults": defaults["n"] if defaults else None, "why": why,
            "deployment": str(target)}

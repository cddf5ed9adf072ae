"""The working directory of one decomposition: where each of its files lives, the checks before
any work is written there (writable, not somebody else's directory, made with the same settings),
and the wall time of each stage over resumed runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sensai.errors import SensaiError
from sensai.fsutil import sha256_file, writable_dir, write_json_atomic
from sensai.manifest import MANIFEST

from .errors import SettingsMismatch

STAGES = ("grouping", "stats", "prune", "retrain", "export", "evaluate", "artifact")


# --------------------------------------------------------------------------------------------
# Artifact layout


class Layout:
    """Where everything of one artifact lives (paths in the manifest are relative to ``root``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.work = self.root / "work"

    manifest = property(lambda self: self.root / MANIFEST)
    grouping_json = property(lambda self: self.root / "grouping.json")
    grouping_png = property(lambda self: self.root / "grouping.png")
    settings = property(lambda self: self.work / "settings.json")
    stages = property(lambda self: self.work / "stages.json")
    evaluation = property(lambda self: self.work / "evaluation.json")
    teacher = property(lambda self: self.work / "teacher_logits.npy")
    report_md = property(lambda self: self.root / "report.md")
    report_json = property(lambda self: self.root / "report.json")
    report_png = property(lambda self: self.root / "report.png")

    def stats(self, g: int) -> Path:
        return self.work / "stats" / f"group_{g:02d}.npz"

    def pruned(self, g: int) -> Path:
        return self.work / "pruned" / f"subnet_{g:02d}.safetensors"

    def pruned_meta(self, g: int) -> Path:
        return self.work / "pruned" / f"subnet_{g:02d}.json"

    def weights_rel(self, g: int) -> str:
        return f"subnets/subnet_{g:02d}.safetensors"

    def onnx_rel(self, g: int) -> str:
        return f"subnets/subnet_{g:02d}.onnx"

    def retrain_meta(self, g: int) -> Path:
        return self.work / "retrain" / f"subnet_{g:02d}.json"

    def export_meta(self, g: int) -> Path:
        return self.work / "export" / f"subnet_{g:02d}.json"

    def ours(self) -> list[Path]:
        """Everything a decomposition writes (and ``force`` removes) - nothing else is touched."""
        return [self.manifest, self.grouping_json, self.grouping_png, self.report_md,
                self.report_json, self.report_png, self.work, self.root / "subnets"]


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def file_ok(path: Path, sha: str | None) -> bool:
    return bool(sha) and path.is_file() and sha256_file(path) == sha


def settings_diff(old: dict, new: dict) -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{key}.{d}" for d in settings_diff(a, b)]
        elif a != b:
            diffs.append(f"{key}: {a!r} -> {b!r}" if not isinstance(a, (dict, list)) else key)
    return diffs


def prepare_out(layout: Layout, fingerprint: dict, force: bool, defaults: dict) -> None:
    """Refuse to mix settings in one artifact; with ``force`` remove only what we wrote.
    ``defaults``: the config's defaults, read for knobs an older artifact does not record."""
    root = layout.root
    writable_dir(root)
    old = read_json(layout.settings)
    if old is not None and isinstance(old.get("config"), dict):
        # Made before a knob existed means made with its default: not other settings.
        old = {**old, "config": {**defaults, **old["config"]}}
    foreign = [p.name for p in root.iterdir() if not p.name.startswith(".write-test-")]
    if old is None and foreign and not force:
        if layout.manifest.exists() or layout.work.exists():
            raise SensaiError(f"{root} holds a decomposition without readable settings "
                              f"(work/settings.json); use --force to start over")
        raise SensaiError(f"output directory {root} is not empty and holds no decomposition; "
                          "choose a new directory (or --force to write into it anyway)")
    if old is not None and old != fingerprint:
        if not force:
            diff = "; ".join(settings_diff(old, fingerprint)[:4])
            raise SettingsMismatch(f"{root} was made with other settings ({diff}); use another "
                                   "--out or --force to start over")
    if force:
        for p in layout.ours():
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    layout.work.mkdir(parents=True, exist_ok=True)
    write_json_atomic(layout.settings, fingerprint)


# --------------------------------------------------------------------------------------------
# Stage timing


class Stages:
    """Wall time per stage, accumulated over runs (a resumed stage adds only its new work)."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, dict] = read_json(path) or {}

    def run(self, name: str, seconds: float, did_work: bool, done: bool = True) -> None:
        entry = self.data.setdefault(name, {"seconds": 0.0, "runs": 0})
        if did_work:
            entry["seconds"] = round(entry["seconds"] + seconds, 3)
            entry["runs"] += 1
        entry["done"] = done
        write_json_atomic(self.path, self.data)

    def seconds(self) -> dict[str, float]:
        return {k: self.data[k]["seconds"] for k in STAGES if k in self.data}

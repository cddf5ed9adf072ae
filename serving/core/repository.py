"""A model repository laid out as Triton's: ``REPO/<model>/<version>/``, each version an artifact.

A model's versions are its folders named by a positive integer that hold a ``manifest.json``; a
folder without one is not a version yet (an artifact being written), so a repository that is
polled never sees half an artifact.  Which versions are served is the model's version policy
(Triton's three): ``latest:N`` (the N highest, the default ``latest:1``), ``all``, or
``specific:1,3``; a model may set its own in ``REPO/<model>/sensai-model.json``
(``{"version_policy": "latest:2"}``).  :func:`add_version` writes an artifact into a repository
as its next version, atomically.  Nothing here loads a network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from sensai.artifact import load_artifact, verify_file
from sensai.errors import SensaiError
from sensai.fsutil import check_out_dir, overlap
from sensai.manifest import MANIFEST as MANIFEST_NAME

# A model's name is a folder of the repository: never "." or ".." (nor any dot name, which
# model_names skips), or a load or an export would reach outside the repository.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$"
MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
VERSION = re.compile(r"^[1-9][0-9]{0,17}$")
MODEL_CONFIG = "sensai-model.json"


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions are served: ``latest`` (the ``count`` highest), ``all``, or
    ``specific`` (``versions``)."""

    kind: str = "latest"
    count: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "VersionPolicy":
        kind, _, arg = str(text).strip().partition(":")
        try:
            if kind == "all" and not arg:
                return cls("all")
            if kind == "latest":
                count = int(arg) if arg else 1
                if count >= 1:
                    return cls("latest", count)
            if kind == "specific" and arg:
                versions = tuple(sorted({int(v) for v in arg.split(",")}))
                if all(v >= 1 for v in versions):
                    return cls("specific", versions=versions)
        except ValueError:
            pass
        raise SensaiError(f"version policy {text!r} is none of latest[:N], all, specific:V[,V...] "
                          "(N, V positive integers)")

    def pick(self, available: Iterable[int]) -> list[int]:
        """The versions of ``available`` this policy serves, lowest first."""
        have = sorted(set(available))
        if self.kind == "all":
            return have
        if self.kind == "latest":
            return have[-self.count:]
        return [v for v in have if v in self.versions]

    def __str__(self) -> str:
        if self.kind == "specific":
            return "specific:" + ",".join(map(str, self.versions))
        return "all" if self.kind == "all" else f"latest:{self.count}"


def is_repository(path: str | Path) -> bool:
    """Whether ``path`` is a folder that is not itself an artifact (so: a repository)."""
    path = Path(path)
    return path.is_dir() and not (path / MANIFEST_NAME).exists()


def check_model_name(name: str) -> str:
    if not MODEL_NAME.match(name):
        raise SensaiError(f"model name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                          "not starting with '.'")
    return name


def model_names(repo: Path) -> list[str]:
    """The models of ``repo``: its folders with a usable name (dot folders are skipped)."""
    if not repo.is_dir():
        raise SensaiError(f"model repository {repo} is not a folder")
    return sorted(p.name for p in repo.iterdir()
                  if p.is_dir() and MODEL_NAME.match(p.name))


def versions(repo: Path, name: str) -> dict[int, Path]:
    """The versions of model ``name``: number -> its artifact folder."""
    folder = repo / name
    if not folder.is_dir():
        return {}
    return {int(p.name): p for p in folder.iterdir()
            if VERSION.match(p.name) and (p / MANIFEST_NAME).is_file()}


def model_policy(repo: Path, name: str, default: VersionPolicy) -> VersionPolicy:
    """The model's own version policy (``sensai-model.json``), else ``default``."""
    path = repo / name / MODEL_CONFIG
    if not path.is_file():
        return default
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SensaiError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict) or set(config) - {"version_policy"}:
        raise SensaiError(f"{path}: expected {{\"version_policy\": \"latest:1\"}}, got "
                          f"{json.dumps(config)[:200]}")
    return VersionPolicy.parse(config.get("version_policy", str(default)))


def stamp(version_dir: Path) -> str:
    """What identifies a version's content: its manifest's sha256 (the manifest holds every
    other file's hash), so a version rewritten in place is seen as changed."""
    try:
        return hashlib.sha256((version_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError:
        return ""


def add_version(repo: str | Path, name: str, artifact_dir: str | Path,
                version: int | None = None) -> int:
    """Copy the artifact at ``artifact_dir`` (its manifest and the files it names, each checked
    against its hash first) into ``repo/name/<version>`` (default: one above the highest), in
    one rename: a poller sees all of it or nothing; a refused export creates nothing.  Returns
    the version."""
    repo, src = Path(repo), Path(artifact_dir)
    check_model_name(name)
    if version is not None and not VERSION.match(str(version)):
        raise SensaiError(f"version must be a positive integer of at most 18 digits (a "
                          f"version folder the server reads), got {version}")
    check_out_dir(repo, "model repository")
    folder = check_out_dir(repo / name, "model folder")
    artifact = load_artifact(src)
    if overlap(folder, artifact.root):
        raise SensaiError(f"model folder {folder} and the artifact {src} overlap: the "
                          "repository goes beside the artifact, not in or around it")
    files = [verify_file(p, sha, "artifact file") for s in artifact.subnets
             for p, sha in ((s.weights, s.weights_sha256), (s.onnx, s.onnx_sha256))
             if p is not None]
    if version is None:
        taken = folder.iterdir() if folder.is_dir() else ()
        version = max((int(p.name) for p in taken if VERSION.match(p.name)), default=0) + 1
    dest = folder / str(version)
    if dest.exists():
        raise SensaiError(f"{dest} exists already: versions are never overwritten (add a new one)")
    folder.mkdir(parents=True, exist_ok=True)  # every check passed: the export starts
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=folder))
    try:
        for path in [artifact.root / MANIFEST_NAME, *files]:
            rel = path.relative_to(artifact.root)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp / rel)
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return version

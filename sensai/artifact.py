"""A decomposition artifact read back from disk, for serving, the benchmark and export.

Every file is reached through the manifest and checked before it is used: its path stays inside
the artifact directory, it exists, and its sha256 matches the manifest (:func:`verify_file`, at the
moment it is read).  The manifest itself is validated on load (class names, groups, hashes).  A
manifest whose architecture is ``package.module:factory`` rebuilds torch subnets only with the
operator's consent (``trust_code``); ONNX files never import anything.  Reading an artifact does
not import torch (only rebuilding torch subnets does), so ONNX-only workers stay light.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .fsutil import sha256_file
from .manifest import DecompositionManifest, load_manifest
from .spec import DatasetSpec


def subnet_name(index: int) -> str:
    return f"subnet_{index:02d}"


def inside(root: Path, rel: str) -> Path:
    """``root / rel`` resolved, refused when it leaves ``root`` (``..``, absolute paths, links)."""
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise CheckpointError(f"manifest in {root} points outside the artifact ({rel})")
    return path


def verify_file(path: Path, sha256: str | None, what: str) -> Path:
    """``path`` if it exists and its sha256 is ``sha256``; refuses a missing or empty hash."""
    if not sha256:
        raise CheckpointError(f"{what} {path} has no sha256 in the manifest; refusing to load "
                              "what cannot be checked")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist")
    if sha256_file(path) != sha256:
        raise CheckpointError(f"{what} {path} does not match its sha256 in the manifest "
                              "(corrupt or replaced)")
    return path


def verify_bytes(data: bytes, sha256: str | None, what: str) -> bytes:
    """A file's content shipped to where it is used (e.g. through Ray to another node), checked
    there against the manifest's sha256 like a file on disk."""
    if not sha256:
        raise CheckpointError(f"{what} has no sha256 in the manifest; refusing to load what "
                              "cannot be checked")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{what} does not match its sha256 in the manifest (corrupt in "
                              "transit or replaced)")
    return data


@dataclass(frozen=True)
class SubnetFiles:
    index: int
    name: str
    classes: tuple[int, ...]
    num_outputs: int
    weights: Path
    weights_sha256: str
    onnx: Path | None
    onnx_sha256: str | None


@dataclass(frozen=True)
class Artifact:
    root: Path
    manifest: DecompositionManifest
    subnets: tuple[SubnetFiles, ...]

    @property
    def spec(self) -> DatasetSpec:
        return self.manifest.dataset.to_spec()

    @property
    def groups(self) -> list[list[int]]:
        return [list(g) for g in self.manifest.groups]

    def load_subnet(self, index: int, device="cpu", *, trust_code: bool = False):
        """Subnet ``index`` as a torch module (weights hash-checked; eval mode)."""
        # torch only here: whoever serves the ONNX files never imports it.
        from .checkpoint import build_from_weights, load_weights

        s = self.subnets[index]
        state = load_weights(verify_file(s.weights, s.weights_sha256, "weights file"),
                             s.weights_sha256)
        return build_from_weights(self.manifest.model, s.num_outputs, self.manifest.in_channels,
                                  state, f"subnet {index} weights ({s.weights})",
                                  trust_code=trust_code).to(device)

    def load_subnets(self, device="cpu", *, trust_code: bool = False) -> list:
        return [self.load_subnet(i, device, trust_code=trust_code)
                for i in range(len(self.subnets))]


def load_artifact(root: str | Path) -> Artifact:
    """The manifest of ``root`` and the checked paths of its subnets' files (nothing else read)."""
    root = Path(root)
    manifest = load_manifest(root)
    if not manifest.subnets:
        raise CheckpointError(f"manifest in {root} lists no subnets (decomposition unfinished?)")
    subnets = tuple(SubnetFiles(
        index=s.index, name=subnet_name(s.index), classes=tuple(s.classes),
        num_outputs=s.num_outputs, weights=inside(root, s.weights),
        weights_sha256=s.weights_sha256, onnx=inside(root, s.onnx) if s.onnx else None,
        onnx_sha256=s.onnx_sha256) for s in manifest.subnets)
    return Artifact(root.resolve(), manifest, subnets)

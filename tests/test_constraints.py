"""deploy/constraints.txt holds what the suite passes with: every distribution installed in the
environment the suite runs in is pinned there at its installed version, so ``deploy/setup.sh``
on a fresh machine installs what was tested (a new release of a dependency cannot change what
the README's two commands give without this test failing first)."""

from __future__ import annotations

import re
import sysconfig
from importlib import metadata
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parents[1] / "deploy" / "constraints.txt"
OWN = {"sensai", "pip", "setuptools", "wheel"}  # the project itself and pip's own tools


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"deploy/constraints.txt: {line!r} is not name==version"
            out[canonical(name)] = version.strip()
    return out


def installed() -> dict[str, str]:
    """What pip installed into the environment: its site-packages only. Ray puts its vendored
    copies (ray/thirdparty_files: psutil, colorama) on sys.path once imported; they are Ray's
    files, not distributions pip could pin."""
    site = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return {canonical(d.metadata["Name"]): d.version
            for d in metadata.distributions(path=sorted(site))}


def test_every_installed_distribution_is_pinned_at_its_version():
    pinned = pins()
    drift = {n: (pinned.get(n), v) for n, v in installed().items()
             if n not in OWN and pinned.get(n) != v}
    assert not drift, ("deploy/constraints.txt differs from the environment as (pinned, "
                       f"installed); regenerate it with pip freeze --exclude-editable: {drift}")
    # What a fresh install's 500s on multipart uploads came from: the web stack is held.
    assert "ray" in installed() and "torch" in installed()  # the scan saw the environment
    for name in ("fastapi", "starlette", "python-multipart", "uvicorn", "torch", "ray"):
        assert name in pinned, name

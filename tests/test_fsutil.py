"""Atomic writes: readable by other users (a serving container runs as another user), and a
failed write leaves the previous file and no temporary file behind."""

from __future__ import annotations

import os
import stat

import pytest

from sensai.errors import SensaiError
from sensai.fsutil import atomic_path, check_out_dir, writable_dir, write_json_atomic


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert mode(tmp_path / "a.json") == 0o644


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_every_artifact_file_follows_the_umask(tiny_artifact):
    umask = os.umask(0)
    os.umask(umask)
    for path in tiny_artifact.rglob("*"):
        if path.is_file():
            assert mode(path) == 0o666 & ~umask, f"{path} is {oct(mode(path))}"


def test_an_output_directory_is_checked_before_anything_is_made(tmp_path):
    """A file at the path, or at a folder above it, is refused in one line; a usable path is
    left unmade by the check and made (with no probe file left) by ``writable_dir``."""
    afile = tmp_path / "afile"
    afile.touch()
    for path, says in ((afile, "it is"), (afile / "a" / "b", f"{afile} is")):
        for check in (check_out_dir, writable_dir):
            with pytest.raises(SensaiError, match=f"cannot write to output directory {path}: "
                                                  f"{says} a file, not a directory"):
                check(path)
    assert check_out_dir(tmp_path / "new" / "out") == tmp_path / "new" / "out"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert writable_dir(tmp_path / "new" / "out").is_dir()
    assert list((tmp_path / "new" / "out").iterdir()) == []


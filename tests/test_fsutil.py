"""Atomic writes: readable by other users (a serving container runs as another user), and a
failed write leaves the previous file and no temporary file behind."""

from __future__ import annotations

import os
import stat

import pytest

from sensai.fsutil import atomic_path, write_json_atomic


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

"""Atomic file writes: a crash or a bad run never leaves a half-written file in place; output
directories checked before anything is written (:func:`check_out_dir`, :func:`writable_dir`).

The data reaches the disk (fsync of the file, then of its directory) before the rename makes it
visible, and the file gets ordinary permissions (0644 less the umask), not mkstemp's 0600: an
artifact written by one user is read by a serving container running as another.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sensai.errors import SensaiError


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path``.

    Same directory so the rename is atomic on POSIX; on failure the temporary file is removed
    and whatever was at ``path`` before is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())
        with open(tmp_path, "rb+") as f:  # whoever wrote it may not have flushed to disk
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (setting it to 0 for
    a moment, the only portable way to read it, races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_out_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """``path`` as a directory to write into, checked without creating anything (so a run
    refused later leaves nothing behind): it, or the nearest of its parents that exists, must
    be a directory this process may write to; one line if not."""
    path = Path(path)
    try:
        for p in (path, *path.parents):
            if not p.exists():
                continue
            if not p.is_dir():
                raise SensaiError(f"cannot write to {what} {path}: "
                                  f"{'it' if p == path else p} is a file, not a directory")
            if not os.access(p, os.W_OK | os.X_OK):
                raise SensaiError(f"cannot write to {what} {path}: {p} is not writable")
            break
    except OSError as e:
        raise SensaiError(f"cannot write to {what} {path}: {e.strerror or e}") from None
    return path


def overlap(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths are one, or one lies inside the other (links resolved): an output
    there would write into, or replace, the input."""
    a, b = Path(a).resolve(), Path(b).resolve()
    return a == b or a in b.parents or b in a.parents


def writable_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """The directory at ``path`` (:func:`check_out_dir`), made if needed and checked writable
    by writing a file in it (one line if not)."""
    out = check_out_dir(path, what)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test-sensai"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SensaiError(f"cannot write to {what} {out}: {e.strerror or e}") from None
    return out


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()

"""Triton's system shared-memory extension: a client on this host hands tensors over in POSIX
shared memory instead of the socket.

The client creates a segment (``shm_open``: ``/dev/shm/<key>``), registers a region of it by
name (``POST /v2/systemsharedmemory/region/{name}/register`` with ``{"key", "offset",
"byte_size"}``, or gRPC ``SystemSharedMemoryRegister``), then names the region in an input's or
a requested output's parameters (``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset``); an input is read from it, an output written to it and answered with
those parameters and no data.  ``.../status`` lists the regions, ``.../unregister`` lets one (or
every one) go and closes its file.

What the server touches is bounded: a region lies within its segment, a tensor within its
region, an input no larger than a request body may be; only a regular file of ``/dev/shm`` is
opened, never through a link.  Registration answers loopback clients only (shared memory is for
this host).  Data moves by ``pread``/``pwrite``, so a segment the client shrinks afterwards fails
that request with a 400 rather than the server with a bus error.

Where several gateway processes serve one port, the registrations are files of the server's
shared folder (each written once, under its name): a region registered through one process is
found by every other, which opens the segment itself on first use and notices an unregistration
(or a new registration under the same name) by the file's identity.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass

from sensai.net import is_loopback

from ..core.errors import Forbidden, InputError

SHM_DIR = "/dev/shm"
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
KEY = re.compile(r"/?[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
EXTENSION = "system_shared_memory"
# Each registration holds a file open in every gateway process that used it: without a bound,
# one client could take every descriptor the process has, and the server could then neither
# open a connection nor list its regions to let them go.
MAX_REGIONS = 1024


@dataclass(frozen=True)
class SharedRef:
    """Where one tensor's bytes are: a registered region, a size and an offset into it."""

    region: str
    byte_size: int
    offset: int = 0

    def parameters(self) -> dict:
        out = {"shared_memory_region": self.region, "shared_memory_byte_size": self.byte_size}
        if self.offset:
            out["shared_memory_offset"] = self.offset
        return out


def shared_ref(params: dict, where: str) -> SharedRef | None:
    """A tensor's shared-memory parameters, checked (None: it names no region)."""
    region = params.get("shared_memory_region")
    if region is None:
        if "shared_memory_byte_size" in params or "shared_memory_offset" in params:
            raise InputError(f"{where}: shared_memory_byte_size/offset need "
                             "shared_memory_region")
        return None
    if not isinstance(region, str) or not region:
        raise InputError(f"{where}: shared_memory_region must be a region's name")
    size, offset = params.get("shared_memory_byte_size"), params.get("shared_memory_offset", 0)
    for label, v in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InputError(f"{where}: {label} must be a non-negative integer, got {v!r}")
    return SharedRef(region, size, offset)


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    ident: tuple  # the registration file's (inode, mtime): a new registration differs

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}


def open_segment(key: str, offset: int, byte_size: int) -> int:
    """The segment ``key``'s file, opened for reading and writing, once it is known to hold
    ``byte_size`` bytes from ``offset``."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise InputError(f"shared memory key {key!r} is not a POSIX shared memory name "
                         "('/name': letters, digits, '_', '.', '-')")
    for label, v in (("offset", offset), ("byte_size", byte_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InputError(f"shared memory {label} must be a non-negative integer, got {v!r}")
    if byte_size == 0:
        raise InputError("shared memory byte_size must be above 0")
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InputError(f"unable to open shared memory key {key!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise InputError(f"shared memory key {key!r} is not a shared memory segment")
        if offset + byte_size > st.st_size:
            raise InputError(f"shared memory key {key!r} has {st.st_size:,} bytes: offset "
                             f"{offset:,} + byte_size {byte_size:,} runs past its end")
    except BaseException:
        os.close(fd)
        raise
    return fd


class SystemSharedMemory:
    """The registered regions (``folder``: where the gateway processes of one server publish
    them; None: a private folder, removed by :meth:`close`)."""

    def __init__(self, folder: str | None = None, *, max_tensor_bytes: int):
        self.own_folder = folder is None
        self.folder = folder  # a private one is made by the first registration
        self.max_tensor_bytes = max_tensor_bytes
        self.regions: dict[str, Region] = {}  # opened by this process

    def path(self, name: str) -> str:
        return os.path.join(self.folder or "/nonexistent", f"{name}.json")

    def home(self) -> str:
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="sensai-shm-")
        os.makedirs(self.folder, exist_ok=True)
        return self.folder

    # -- the extension's calls

    def register(self, name: str, key: str, offset: int, byte_size: int, *,
                 client: str | None) -> None:
        if not is_loopback(client):
            raise Forbidden("system shared memory is for clients on this host (loopback)")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError(f"shared memory region name {name!r}: 1 to 128 letters, digits, "
                             "'_', '.', '-'")
        if len(self.names()) >= MAX_REGIONS:
            raise InputError(f"{MAX_REGIONS} shared memory regions are registered, the most "
                             "this server holds at once: unregister some first")
        fd = open_segment(key, offset, byte_size)
        try:
            tmp = os.path.join(self.home(), f".{name}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump({"name": name, "key": key, "offset": offset,
                           "byte_size": byte_size}, f)
            try:
                os.link(tmp, self.path(name))  # exclusive: one registration per name wins
            except FileExistsError:
                raise InputError(f"shared memory region {name!r} is already registered") from None
            finally:
                os.unlink(tmp)
        except BaseException:
            os.close(fd)
            raise
        st = os.stat(self.path(name))
        self.forget(name)
        self.regions[name] = Region(name, key, offset, byte_size, fd,
                                    (st.st_ino, st.st_mtime_ns))

    def unregister(self, name: str | None = None) -> None:
        """Region ``name`` (None or "": every region) let go; an unknown name is not an error
        (Triton's rule)."""
        names = [name] if name else self.names()
        for n in names:
            if NAME.fullmatch(n or ""):
                try:
                    os.unlink(self.path(n))
                except FileNotFoundError:
                    pass
                self.forget(n)
        self.prune()

    def status(self, name: str | None = None) -> list[dict]:
        self.prune()
        if name:
            return [self.region(name).status()]
        out = []
        for n in self.names():
            try:
                out.append(self.region(n).status())
            except InputError:  # unregistered meanwhile
                continue
        return out

    # -- tensors

    def region(self, name: str) -> Region:
        """The current registration of ``name``, its segment opened by this process."""
        if not NAME.fullmatch(name or ""):
            raise InputError(f"unknown shared memory region {name!r}")
        try:
            st = os.stat(self.path(name))
        except FileNotFoundError:
            self.forget(name)
            raise InputError(f"unknown shared memory region {name!r} (register it first)") \
                from None
        ident = (st.st_ino, st.st_mtime_ns)
        have = self.regions.get(name)
        if have is not None and have.ident == ident:
            return have
        self.forget(name)
        with open(self.path(name)) as f:
            r = json.load(f)
        fd = open_segment(r["key"], r["offset"], r["byte_size"])
        region = self.regions[name] = Region(name, r["key"], r["offset"], r["byte_size"], fd,
                                             ident)
        return region

    def span(self, ref: SharedRef, need: int, where: str, *, exact: bool) -> Region:
        """The region of ``ref``, checked to hold ``need`` bytes (``exact``: ``ref`` must say
        exactly that many; an output's may be larger) within its bounds."""
        if exact and ref.byte_size != need:
            raise InputError(f"{where}: its shape needs {need:,} bytes, shared_memory_byte_size "
                             f"is {ref.byte_size:,}")
        if ref.byte_size < need:
            raise InputError(f"{where}: shared_memory_byte_size {ref.byte_size:,} is too small "
                             f"for its {need:,} bytes")
        if need > self.max_tensor_bytes:
            raise InputError(f"{where}: {need:,} bytes in shared memory; a tensor may have at "
                             f"most {self.max_tensor_bytes:,} (SENSAI_MAX_BODY_BYTES)")
        region = self.region(ref.region)
        if ref.offset + ref.byte_size > region.byte_size:
            raise InputError(f"{where}: offset {ref.offset:,} + byte_size {ref.byte_size:,} runs "
                             f"past region {ref.region!r} ({region.byte_size:,} bytes)")
        return region

    def read(self, ref: SharedRef, need: int, where: str) -> bytes:
        region = self.span(ref, need, where, exact=True)
        data = os.pread(region.fd, need, region.offset + ref.offset)
        if len(data) != need:
            raise InputError(f"{where}: shared memory key {region.key!r} was shrunk below its "
                             "region")
        return data

    def write(self, ref: SharedRef, data: bytes, where: str) -> None:
        region = self.span(ref, len(data), where, exact=False)
        at = region.offset + ref.offset
        if os.fstat(region.fd).st_size < at + len(data):  # pwrite would grow it, not fail
            raise InputError(f"{where}: shared memory key {region.key!r} was shrunk below its "
                             "region")
        os.pwrite(region.fd, data, at)

    # -- housekeeping

    def names(self) -> list[str]:
        if self.folder is None or not os.path.isdir(self.folder):
            return []
        return sorted(f[:-5] for f in os.listdir(self.folder)
                      if f.endswith(".json") and not f.startswith("."))

    def forget(self, name: str) -> None:
        r = self.regions.pop(name, None)
        if r is not None:
            os.close(r.fd)

    def prune(self) -> None:
        """Close what this process opened of regions unregistered through another."""
        for name in list(self.regions):
            if not os.path.exists(self.path(name)):
                self.forget(name)

    def close(self) -> None:
        for name in list(self.regions):
            self.forget(name)
        if self.own_folder and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

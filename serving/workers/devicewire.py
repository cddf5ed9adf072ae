"""The wire between gateway processes and a device process: binary frames on a Unix socket, the
image rows in shared memory.

Each gateway process that talks to a device process opens one connection to it and hands it, with
its first frame (:data:`HELLO`, the file descriptor travelling as ``SCM_RIGHTS``), a memfd of
``slots`` fixed slots, each ``slot_bytes`` long: room for ``slot_rows`` rows of the model's input
shape in float32.  A request's rows go into a free slot of the gateway's and only a small header
crosses the socket (the socket's readiness is the doorbell); a request that does not fit a slot
(a larger v2 batch, another dtype) or finds every slot taken sends its rows inline after the header
instead.  Outputs (a few floats per row) always travel inline, a whole launch's at once: one
:data:`OUTPUTS` frame per subnet and batch carries every request's rows for this gateway, one
:data:`DONES` frame per batch ends them, with each subnet's batching counters.  No frame is
pickled: a frame is ``u32 length | u8 kind | body``, its body fixed fields (:mod:`struct`), arrays
of them, and, for the rare control frames, JSON.

The device process trusts nothing in a frame: a slot index, row count or shape that does not fit
the slots it was handed, or a frame of an unknown kind, ends that connection
(:class:`WireError`), never a read outside the mapping.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import struct
from array import array
from typing import TYPE_CHECKING, BinaryIO, Callable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from ..core.messages import BatchCounts

# Gateway -> device.
HELLO, RUN, SKIP, PING, FAULT = 1, 2, 3, 4, 5
# Device -> gateway.
READY, FAILED, PONG, OUTPUTS, DONES = 10, 12, 14, 15, 16

FRAME = struct.Struct("<IB")  # body length, kind
RUN_HEAD = struct.Struct("<QiIfBB")  # wire id, slot (-1: inline), rows, hedge_s, primaries, groups
SKIP_HEAD = struct.Struct("<QH")  # wire id, groups (EVERY: the whole request)
TOKEN = struct.Struct("<Q")
# Then: wire ids (u64) and rows (u32) of each request, then the stacked rows as an inline array.
OUTPUTS_HEAD = struct.Struct("<HfI")  # group, compute ms, requests
# Then: each group's counters (GROUP_COUNTS), then wire ids (u64) and skipped groups (u32).
DONES_HEAD = struct.Struct("<IHQQ")  # requests, groups, held, mixed
GROUP_COUNTS = struct.Struct("<HQQQQ")  # group, batches, requests, largest, rows
FAILED_HEAD = struct.Struct("<QH")  # wire id, group
EVERY = 0xFFFF
MAX_FRAME = 1 << 30  # a length beyond this is a corrupt stream, not a request
MAX_GROUPS = 4096
# Inline rows: the dtypes a row may have (code -> dtype), and their codes.
DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.uint8),
          3: np.dtype(np.float16), 4: np.dtype(np.int64), 5: np.dtype(np.int32)}
CODES = {dt: code for code, dt in DTYPES.items()}


class WireError(Exception):
    """A frame that breaks the protocol: the connection it came on is ended."""


def frame(kind: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return FRAME.pack(len(body), kind) + body


def read_frame(f: BinaryIO) -> tuple[int, memoryview]:
    """The next frame's kind and body; EOFError when the peer hung up."""
    head = f.read(FRAME.size)
    if len(head) < FRAME.size:
        raise EOFError
    n, kind = FRAME.unpack(head)
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes")
    body = f.read(n)
    if len(body) < n:
        raise EOFError
    return kind, memoryview(body)


def control(kind: int, payload: dict) -> bytes:
    return frame(kind, json.dumps(payload).encode())


def parse_control(body: memoryview) -> dict:
    try:
        out = json.loads(bytes(body))
    except ValueError as e:
        raise WireError(f"unreadable control frame ({e})") from None
    if not isinstance(out, dict):
        raise WireError("a control frame that is not an object")
    return out


def groups_bytes(groups) -> bytes:
    return struct.pack(f"<{len(groups)}H", *groups)


def groups_of(body: memoryview, at: int, n: int) -> tuple[tuple[int, ...], int]:
    end = at + 2 * n
    if n > MAX_GROUPS or end > len(body):
        raise WireError("a frame shorter than its groups")
    return struct.unpack_from(f"<{n}H", body, at), end


def outputs_frame(group: int, ms: float, wires: Sequence[int], sizes: Sequence[int],
                  out: np.ndarray) -> bytes:
    """One launch's rows for the requests ``wires`` of one gateway (``sizes`` rows each)."""
    return frame(OUTPUTS, OUTPUTS_HEAD.pack(group, ms, len(wires)), array("Q", wires).tobytes(),
                 array("I", sizes).tobytes(), array_bytes(out))


def parse_outputs(body: memoryview) -> tuple[int, float, np.ndarray, np.ndarray, np.ndarray]:
    """An :data:`OUTPUTS` frame: group, ms, wire ids, rows per request, and the stacked rows
    (checked against each other)."""
    if len(body) < OUTPUTS_HEAD.size:
        raise WireError("a short outputs frame")
    group, ms, n = OUTPUTS_HEAD.unpack_from(body)
    at = OUTPUTS_HEAD.size
    if at + 12 * n > len(body):
        raise WireError("an outputs frame shorter than its requests")
    wires = np.frombuffer(body, dtype=np.uint64, count=n, offset=at)
    sizes = np.frombuffer(body, dtype=np.uint32, count=n, offset=at + 8 * n)
    out = array_of(body, at + 12 * n)
    if n > 1 and (out.ndim < 1 or int(sizes.sum()) != len(out)):
        raise WireError(f"outputs of {n} requests in {out.shape[:1]} rows")
    return group, ms, wires, sizes, out


def dones_frame(wires: Sequence[int], skipped: Sequence[int],
                counts: Mapping[int, "BatchCounts"]) -> bytes:
    """The end of requests ``wires`` of one gateway, with every subnet's counters (``held``
    and ``mixed`` are the loop's, the same in each)."""
    held, mixed = next(((c.held, c.mixed) for c in counts.values()), (0, 0))
    return frame(DONES, DONES_HEAD.pack(len(wires), len(counts), held, mixed),
                 b"".join(GROUP_COUNTS.pack(g, c.batches, c.requests, c.largest, c.rows)
                          for g, c in counts.items()),
                 array("Q", wires).tobytes(), array("I", skipped).tobytes())


def parse_dones(body: memoryview) -> tuple[np.ndarray, np.ndarray, dict[int, tuple]]:
    """A :data:`DONES` frame: wire ids, skipped groups, and group -> (batches, requests,
    largest, held, mixed, rows)."""
    if len(body) < DONES_HEAD.size:
        raise WireError("a short dones frame")
    n, ngroups, held, mixed = DONES_HEAD.unpack_from(body)
    at = DONES_HEAD.size
    if at + GROUP_COUNTS.size * ngroups + 12 * n != len(body):
        raise WireError(f"a dones frame of {n} requests and {ngroups} groups in {len(body)} "
                        "bytes")
    counts = {}
    for _ in range(ngroups):
        g, batches, requests, largest, rows = GROUP_COUNTS.unpack_from(body, at)
        counts[g] = (batches, requests, largest, held, mixed, rows)
        at += GROUP_COUNTS.size
    wires = np.frombuffer(body, dtype=np.uint64, count=n, offset=at)
    skipped = np.frombuffer(body, dtype=np.uint32, count=n, offset=at + 8 * n)
    return wires, skipped, counts


def array_bytes(x: np.ndarray) -> bytes:
    """``x`` inline: dtype code, ndim, dims, then its bytes (C order)."""
    code = CODES.get(x.dtype)
    if code is None:
        raise TypeError(f"rows of dtype {x.dtype} cannot travel to a device process")
    return (struct.pack(f"<BB{x.ndim}I", code, x.ndim, *x.shape)
            + np.ascontiguousarray(x).tobytes())


def array_of(body: memoryview, at: int) -> np.ndarray:
    """The inline array at ``at`` of ``body`` (a copy of nothing: a view of the frame)."""
    if at + 2 > len(body):
        raise WireError("a frame shorter than its array")
    code, ndim = body[at], body[at + 1]
    dtype = DTYPES.get(code)
    if dtype is None or ndim > 8:
        raise WireError(f"an array of dtype code {code} and {ndim} dimensions")
    dims_end = at + 2 + 4 * ndim
    if dims_end > len(body):
        raise WireError("a frame shorter than its array")
    shape = struct.unpack_from(f"<{ndim}I", body, at + 2)
    n = math.prod(shape) * dtype.itemsize
    if dims_end + n != len(body):
        raise WireError(f"an array of shape {shape} in {len(body) - dims_end} bytes")
    return np.frombuffer(body, dtype=dtype, count=n // dtype.itemsize,
                         offset=dims_end).reshape(shape)


class FrameReader:
    """Whole frames out of a stream socket's bytes as they arrive, parsed in place: each call of
    :meth:`take` reads what is there (never waiting) and hands every complete frame to
    ``handle(kind, body)``; the body is a view of the read buffer, valid only during the call."""

    def __init__(self, size: int = 256 * 1024):
        self.buf = bytearray(size)
        self.have = 0  # bytes of buf read and not yet parsed

    def take(self, sock, handle: Callable[[int, memoryview], None]) -> None:
        """EOFError when the peer hung up; WireError for a corrupt stream."""
        buf = self.buf
        got = sock.recv_into(memoryview(buf)[self.have:], 0, socket.MSG_DONTWAIT)
        if got == 0:
            raise EOFError
        end = self.have + got
        at, view = 0, memoryview(buf)
        head = FRAME.size
        while end - at >= head:
            n, kind = FRAME.unpack_from(buf, at)
            if n > MAX_FRAME:
                raise WireError(f"a frame of {n} bytes")
            if end - at - head < n:
                if head + n > len(buf):  # a frame larger than the buffer: room for it
                    grown = bytearray(head + n)
                    grown[:end - at] = buf[at:end]
                    self.buf, self.have = grown, end - at
                    return
                break
            handle(kind, view[at + head:at + head + n])
            at += head + n
        left = end - at
        if at and left:
            buf[:left] = buf[at:end]
        self.have = left


class Slots:
    """A gateway's slots for one device process: a memfd of ``count`` slots of ``slot_bytes``,
    mapped here (and, through the descriptor, in the device process)."""

    def __init__(self, count: int, slot_rows: int, row_shape: tuple[int, ...]):
        self.count, self.slot_rows, self.row_shape = count, slot_rows, tuple(row_shape)
        self.row_items = int(np.prod(self.row_shape, dtype=np.int64))
        self.slot_bytes = slot_rows * self.row_items * 4
        self.fd = os.memfd_create("sensai-slots", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(1, count * self.slot_bytes))
        self.map = mmap.mmap(self.fd, max(1, count * self.slot_bytes))
        self.free = list(range(count - 1, -1, -1))

    def fits(self, x: np.ndarray) -> bool:
        return (x.dtype == np.float32 and x.ndim == len(self.row_shape) + 1
                and x.shape[1:] == self.row_shape and 0 < len(x) <= self.slot_rows)

    def put(self, slot: int, x: np.ndarray) -> None:
        view = np.frombuffer(self.map, dtype=np.float32, count=x.size,
                             offset=slot * self.slot_bytes)
        view[:] = x.reshape(-1)

    def describe(self) -> dict:
        return {"slots": self.count, "slot_rows": self.slot_rows, "slot_bytes": self.slot_bytes,
                "row_shape": list(self.row_shape)}



class MappedSlots:
    """The device process's view of a gateway's slots: checked against the geometry the gateway
    declared, and every read bounded by it."""

    def __init__(self, fd: int, hello: dict):
        try:
            self.count = int(hello["slots"])
            self.slot_rows = int(hello["slot_rows"])
            self.row_shape = tuple(int(d) for d in hello["row_shape"])
            self.slot_bytes = int(hello["slot_bytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"a hello without its slots' geometry ({e})") from None
        self.row_items = int(np.prod(self.row_shape, dtype=np.int64))
        if (self.count < 0 or self.slot_rows < 1 or any(d < 1 for d in self.row_shape)
                or self.slot_bytes != self.slot_rows * self.row_items * 4):
            raise WireError(f"slots of an impossible geometry {hello}")
        size = os.fstat(fd).st_size
        if size < self.count * self.slot_bytes:
            raise WireError(f"{self.count} slots of {self.slot_bytes} bytes in a mapping of "
                            f"{size}")
        # Writable: a runner may hand the rows to a library that wants a writable buffer.
        self.map = mmap.mmap(fd, max(1, size))
        os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.float32,
                                   count=self.count * self.slot_rows * self.row_items).reshape(
            (self.count, self.slot_rows, *self.row_shape))

    def rows(self, slot: int, n: int) -> np.ndarray:
        """Slot ``slot``'s first ``n`` rows, a view of the shared mapping."""
        if not 0 <= slot < self.count or not 0 < n <= self.slot_rows:
            raise WireError(f"rows {n} of slot {slot}: there are {self.count} slots of "
                            f"{self.slot_rows} rows")
        return self.array[slot, :n]


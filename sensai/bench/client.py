"""The benchmark's HTTP and gRPC client, in its own spawned process.

A client sharing the gateway's process (and GIL) adds its own JSON parsing and socket work to every
measured request, and the two event loops delay each other; a real caller sits on another process or
machine.  The child process imports this module (and the light package ``__init__`` files above
it), nothing heavier, so it starts in well under a second; grpc and tritonclient's service stubs
are imported only when a gRPC request is asked for.  Every HTTP request goes over
:class:`_Connection`, a keep-alive HTTP/1.1 connection on asyncio streams.  Every closed loop
(HTTP load phases, concurrency over HTTP or gRPC, the in-process driver's) is :func:`callers_loop`.

Transports (:data:`.names.TRANSPORTS` but ``inprocess``): ``http`` - the PNG upload to
``/v1/predict``; ``http-v2`` - the KServe v2 binary tensor (JSON header + raw float32 bytes, all
outputs binary); ``grpc`` - KServe v2 ``ModelInfer`` with ``raw_input_contents``.  Every request
is built before its clock starts.  :meth:`HttpClientProcess.timed` also times, just before each
request, the same client's bare request to the same server (``GET /v2/health/live``, gRPC
``ServerLive``): the floor no request on that transport can go below.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import math
import multiprocessing as mp
import os
import struct
import time
from typing import Any, Awaitable, Callable, Sequence
from urllib.parse import urlsplit

PREDICT = "/v1/predict"
HEADERS = {"content-type": "image/png"}
LIVE = "/v2/health/live"
V2_HEADER = "inference-header-content-length"
TIMEOUT_S = 120.0


def _failed(url: str, status: int, body: bytes) -> RuntimeError:
    return RuntimeError(f"server at {url} answered {status}: "
                        f"{body[:200].decode(errors='replace')}")


def _answer(headers: dict[bytes, bytes], body: bytes) -> tuple[int, str | None, dict]:
    """A 200 answer's class, the model version that answered (None when it names none) and the
    server's ``timings_ms`` ({} when it reports none): a JSON answer's ``index``,
    ``model_version`` and ``timings_ms``, or a KServe v2 answer's (JSON alone, or a JSON header
    then each binary output's bytes in order), whose class is its ``class_index`` output (the
    gateway's, and the Ray Serve peer's) or else the argmax of its first output (a model's
    scores, as Triton answers)."""
    length = headers.get(V2_HEADER.encode())
    n = len(body) if length is None else int(length)
    head = json.loads(body if length is None else body[:n])
    if "outputs" not in head:
        return int(head["index"]), head.get("model_version"), head.get("timings_ms") or {}
    offset, pred, first = n, None, None
    for out in head["outputs"]:
        size = (out.get("parameters") or {}).get("binary_data_size")
        if out["name"] == "class_index":
            pred = struct.unpack_from("<q", body, offset)[0] if size is not None else out["data"][0]
        elif first is None and out["datatype"] == "FP32":
            first = (struct.unpack_from(f"<{size // 4}f", body, offset) if size is not None
                     else out["data"])
        offset += size or 0
    if pred is None:
        if not first:
            raise RuntimeError("the server answered neither class_index nor scores")
        pred = max(range(len(first)), key=first.__getitem__)
    timings = (head.get("parameters") or {}).get("timings_ms")
    return int(pred), head.get("model_version"), json.loads(timings) if timings else {}


RETRIES = 5  # times a timed request turned away by the server's admission is sent again
# A timed request waits at most this long before it is sent again: its run is one image at a
# time, and a longer pause only stretches it.
MAX_RETRY_WAIT_S = 1.0


def turned_away(answer) -> float | None:
    """The seconds to wait when ``answer`` (an HTTP answer, or a gRPC call's error) is the
    server's admission turning the request away - HTTP 503 with Retry-After, gRPC UNAVAILABLE
    with a retry-after trailer (1 where its value is no number); None for anything else."""
    if isinstance(answer, tuple):
        status, headers, _ = answer
        value = headers.get(b"retry-after") if status == 503 else None
    else:
        code, trailer = getattr(answer, "code", None), getattr(answer, "trailing_metadata", None)
        value = (dict(trailer() or ()).get("retry-after")
                 if callable(code) and callable(trailer) and code().name == "UNAVAILABLE"
                 else None)
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return 1.0


def _grpc_answer(resp) -> tuple[int, dict]:
    k = [o.name for o in resp.outputs].index("class_index")
    return (int.from_bytes(resp.raw_output_contents[k][:8], "little", signed=True),
            json.loads(resp.parameters["timings_ms"].string_param))


class _Tensors:
    """The normalized images (float32 bytes of shape ``shape``) as ready-to-send requests."""

    def __init__(self, tensors: list[bytes], shape: list[int]):
        self.tensors, self.shape = tensors, shape
        self._grpc: dict[tuple[str, int], Any] = {}

    def v2_body(self, j: int) -> tuple[bytes, dict[str, str]]:
        t = self.tensors[j]
        head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": self.shape,
                                       "parameters": {"binary_data_size": len(t)}}],
                           "parameters": {"binary_data_output": True}},
                          separators=(",", ":")).encode()
        return head + t, {V2_HEADER: str(len(head)), "content-type": "application/octet-stream"}

    def grpc_request(self, model: str, j: int):
        req = self._grpc.get((model, j))
        if req is None:
            from tritonclient.grpc import service_pb2 as pb

            req = self._grpc[(model, j)] = pb.ModelInferRequest(
                model_name=model, raw_input_contents=[self.tensors[j]],
                inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32",
                                                              shape=self.shape)])
        return req


class _Client:
    """Runs in the child: one keep-alive connection per server for sequential requests."""

    def __init__(self, pngs: list[bytes], tensors: list[bytes] | None = None,
                 shape: list[int] | None = None, stop: Callable[[], bool] = lambda: False):
        self.pngs, self.stop = pngs, stop
        self.tensors = _Tensors(tensors or [], shape or [])
        self.conns: dict[str, _Connection] = {}
        self.channels: dict = {}
        # One loop for the process's life: the connections of timed requests outlive each call.
        self.loop = asyncio.new_event_loop()

    def _stub(self, target: str):
        if target not in self.channels:
            import grpc
            from tritonclient.grpc import service_pb2_grpc as pb_grpc

            channel = grpc.insecure_channel(target)
            self.channels[target] = (channel, pb_grpc.GRPCInferenceServiceStub(channel))
        return self.channels[target][1]

    def _calls(self, transport: str, address: str, model: str):
        """(bare request, prepare(image) -> request, send(request) -> answer, parse(answer) ->
        (predicted index, timings)) of one transport, on this client's connection; each a
        blocking call, as a caller timing one request at a time makes it."""
        if transport == "grpc":
            from tritonclient.grpc import service_pb2 as pb

            # The blocking stub: a shorter path than grpc.aio's.
            stub, live = self._stub(address), pb.ServerLiveRequest()
            return (lambda: stub.ServerLive(live, timeout=TIMEOUT_S),
                    lambda j: self.tensors.grpc_request(model, j),
                    lambda req: stub.ModelInfer(req, timeout=TIMEOUT_S), _grpc_answer)
        conn = self.conns.setdefault(address, _Connection(address))
        live, requests = live_request(address), self.requests(address, transport, model)

        def send(request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
            return self.loop.run_until_complete(conn.request(request))

        def bare_http() -> None:
            status, _, body = send(live)
            if status != 200:
                raise _failed(address + LIVE, status, body)

        def parse(answer: tuple[int, dict[bytes, bytes], bytes]) -> tuple[int, dict]:
            status, headers, body = answer
            if status != 200:
                raise _failed(address, status, body)
            index, _, timings = _answer(headers, body)
            return index, timings

        return bare_http, requests.__getitem__, send, parse

    def timed(self, transport: str, address: str, model: str,
                    indices: list[int]) -> list[tuple[float, int, dict, float]]:
        """(latency ms, predicted index, timings, bare request ms) per image: each request just
        after the same client's bare request to the same server.  A request the server's
        admission turns away (its loop fell behind on a busy machine) is sent again after the
        wait it asks for, as a polite caller would, at most :data:`RETRIES` times."""
        bare, prepare, send, parse = self._calls(transport, address, model)
        out = []
        for j in indices:
            request = prepare(j)
            for attempt in range(RETRIES + 1):
                t0 = time.perf_counter()
                bare()
                t1 = time.perf_counter()
                try:
                    answer = send(request)
                except Exception as e:  # gRPC: the refusal is an error with a trailer
                    if attempt == RETRIES or (wait := turned_away(e)) is None:
                        raise
                    time.sleep(min(wait, MAX_RETRY_WAIT_S))
                    continue
                t2 = time.perf_counter()
                if attempt < RETRIES and (wait := turned_away(answer)) is not None:
                    time.sleep(min(wait, MAX_RETRY_WAIT_S))
                    continue
                out.append(((t2 - t1) * 1e3, *parse(answer), (t1 - t0) * 1e3))
                break
        return out

    async def concurrent(self, url: str, n_requests: int, concurrency: int,
                         transport: str = "http", model: str = "sensai") -> dict[str, Any]:
        """``n_requests`` requests from ``concurrency`` callers, a closed loop with a request
        budget (HTTP: a :func:`load_phase`; gRPC: :func:`closed_loop`, the callers sharing one
        channel, which multiplexes them on a connection); a refusal by the server's admission is
        counted in ``shed``, any other failure ends the run."""
        if transport != "grpc":
            out = await load_phase(self.requests(url, transport, model), url, count=n_requests,
                                   concurrency=concurrency, strict=True)
            ok = [ms for ms, status in zip(out["ms"], out["status"]) if status == 200]
            return {"seconds": out["seconds"], "latencies": ok, "shed": len(out["ms"]) - len(ok)}
        import grpc
        from tritonclient.grpc import service_pb2 as pb
        from tritonclient.grpc import service_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def one(j: int) -> bool:
                req = self.tensors.grpc_request(model, j % len(self.tensors.tensors))
                try:
                    _grpc_answer(await stub.ModelInfer(req, timeout=TIMEOUT_S))
                    return True
                except grpc.aio.AioRpcError as e:
                    if turned_away(e) is None:  # else shed by the admission, not a failure
                        raise
                    return False

            await stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT_S)  # connect first
            return await closed_loop(n_requests, concurrency, one)

    async def load(self, url: str, plan: dict[str, Any]) -> dict[str, Any]:
        """One :func:`load_phase` of ``plan``'s keywords, and its ``transport`` and ``model``
        (:meth:`requests`); :meth:`HttpClientProcess.stop_load` ends a closed loop."""
        plan = dict(plan)
        requests = self.requests(url, plan.pop("transport", "http"), plan.pop("model", "sensai"))
        return await load_phase(requests, url, stop=self.stop, **plan)

    def requests(self, url: str, transport: str, model: str) -> list[bytes]:
        """This client's images as whole HTTP/1.1 requests to ``url`` over ``transport``:
        ``http`` (PNG uploads), ``http-v2`` (KServe v2 binary tensors to ``model``), or
        ``live``, the server's bare ``GET /v2/health/live`` (the floor of both)."""
        if transport == "live":
            return [live_request(url)]
        if transport == "http":
            return raw_requests(url, [(PREDICT, HEADERS, p) for p in self.pngs])
        if transport == "http-v2":
            return raw_requests(url, [(f"/v2/models/{model}/infer",
                                       *self.tensors.v2_body(j)[::-1])
                                      for j in range(len(self.tensors.tensors))])
        raise ValueError(f"no HTTP load over {transport!r}")

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        for channel, _ in self.channels.values():
            channel.close()
        self.loop.close()


async def callers_loop(callers: Sequence[Any],
                       one: Callable[[Any, float], Awaitable[tuple[int, float]]], *,
                       until: float = math.inf, count: int | None = None,
                       stop: Callable[[], bool] = lambda: False) -> None:
    """The benchmark's one closed loop (HTTP load phases, HTTP/gRPC concurrency, the in-process
    driver's): each of ``callers`` sends its next request, ``one(caller, start)`` (``start``:
    ``time.monotonic()``), as soon as its last is answered, until ``until`` (a
    ``time.monotonic()``), ``count`` requests in all, or ``stop()`` true.  ``one`` answers
    (status, wait): status 0 (no answer: the server gone?) pauses that caller a moment instead
    of spinning; a wait (a 503's Retry-After, honoured) parks it that long, never past
    ``until``."""
    budget = itertools.count() if count is None else iter(range(count))

    async def caller(c: Any) -> None:
        while ((now := time.monotonic()) < until and not stop()
               and next(budget, None) is not None):
            status, wait = await one(c, now)
            if not status:
                await asyncio.sleep(0.05)
            elif wait:
                await asyncio.sleep(min(wait, max(0.0, until - time.monotonic())))

    await asyncio.gather(*(caller(c) for c in callers))


async def closed_loop(n_requests: int, concurrency: int,
                      one: Callable[[int], Awaitable[bool]]) -> dict[str, Any]:
    """``n_requests`` calls of ``one(j)`` (``j``: 0, 1, ...) from ``concurrency`` callers of
    :func:`callers_loop`: seconds, the answered requests' latencies (ms), and ``shed``, those
    ``one`` says the server turned away (False; the caller sends its next one at once)."""
    numbers, latencies, shed = itertools.count(), [], 0

    async def counted(_caller: int, start: float) -> tuple[int, float]:
        nonlocal shed
        if await one(next(numbers)):
            latencies.append((time.monotonic() - start) * 1e3)
        else:
            shed += 1
        return 1, 0.0

    t0 = time.monotonic()
    await callers_loop(range(concurrency), counted, count=n_requests)
    return {"seconds": time.monotonic() - t0, "latencies": latencies, "shed": shed}


class _Connection:
    """One keep-alive HTTP/1.1 connection to the server at ``url``, on asyncio streams: a small
    fraction of an HTTP library's work per request (whose pool's bookkeeping also grows with the
    requests waiting for a connection, so under overload the client, not the server, would be
    the bottleneck).  An answer's body is framed by Content-Length, by chunks (Ray Serve's
    proxy sends its own errors, a backpressure 503 among them, without a length), or else by
    the server closing the connection.  No answer in ``timeout_s`` raises TimeoutError."""

    def __init__(self, url: str, timeout_s: float = TIMEOUT_S):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        """Send ``data`` (a whole request), read the answer: (status, headers, body)."""
        reused = self.writer is not None
        async with asyncio.timeout(self.timeout_s):
            try:
                return await self._exchange(data)
            except ConnectionError:
                if not reused:
                    raise
                # The server closed this connection while it was idle (keep-alive timeout)
                # before reading the request: send it again on a new one.
                return await self._exchange(data)

    async def _exchange(self, data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(data)
            line = await self.reader.readline()
            if not line:
                raise ConnectionResetError("the server closed the connection")
            status, headers = int(line.split()[1]), {}
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            length = headers.get(b"content-length")
            chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
            if length is not None:
                body = await self.reader.readexactly(int(length))
            elif chunked:
                body = await self._chunks()
            else:
                body = await self.reader.read()
        except BaseException:  # a timeout or an error leaves the stream in an unknown state
            self.close()
            raise
        if ((length is None and not chunked)
                or headers.get(b"connection", b"").lower() == b"close"):
            self.close()
        return status, headers, body

    async def _chunks(self) -> bytes:
        """A chunked body (RFC 9112 7.1), its trailers skipped."""
        parts = []
        while size := int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16):
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)  # the chunk's CRLF
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass
        return b"".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def raw_requests(url: str, items: list[tuple[str, dict[str, str], bytes]]) -> list[bytes]:
    """Each (path, headers, body) as a whole HTTP/1.1 POST to ``url``, built once."""
    return [_request(url, "POST", path, headers | {"Content-Length": len(body)}) + body
            for path, headers, body in items]


def live_request(url: str) -> bytes:
    """The server's bare ``GET /v2/health/live``, as a whole HTTP/1.1 request."""
    return _request(url, "GET", LIVE, {})


def _request(url: str, method: str, path: str, headers: dict[str, Any]) -> bytes:
    parts = urlsplit(url)
    return (f"{method} {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


async def load_phase(requests: list[bytes], url: str, *, seconds: float = math.inf,
                     rate: float = 0.0, **how) -> dict[str, Any]:
    """The load generator: ``requests`` (whole HTTP requests, sent in turn) for ``seconds`` or
    ``count`` requests, closed loop (``concurrency`` requests always in flight) or, given
    ``rate``, open loop (a request every 1/rate s whatever the answers; ``preopen`` connections
    opened first, a new one whenever all are busy, up to ``connections``).  Per request: ``t``,
    when it started (``time.monotonic()``, the same clock in every process; open loop: when it
    was due), ``ms``, its latency from then, and ``status`` (0: no answer, its exception's type
    counted in ``failures``); ``wrong``: 200 answers whose top-1 is not ``expected[image]``;
    open loop: ``lag_ms``, how late each request got a connection and left, and
    ``sent_in_time``, how many left before the end.  ``strict``: an answer other than 200, or a
    503 with Retry-After (the server's admission), raises instead of being counted.
    ``answers``: also per request the ``image`` sent, and of a 200 answer its top-1 ``index``
    and the ``version`` that answered (None otherwise).  ``retry_after``: honour a 503's
    ``Retry-After`` as a polite client does: the connection that got it (a closed loop's caller,
    an open loop's connection) sends nothing more for that long (``parked`` counts them); an
    open loop's request then counts its latency from when it was sent, and one that could not
    be sent before the phase's end is dropped.
    ``stop()`` true ends a closed loop early: each caller sends no more requests once its last
    is answered.  The collector is kept out of the phase (a full collection of this process's
    heap would stall the sending and show as server latency)."""
    return await _LoadPhase(requests, url, **how).run(seconds, rate)


class _LoadPhase:
    """One :func:`load_phase` (``how``: its other keywords): what it sends and checks, its
    connections, and what it records (``out``)."""

    def __init__(self, requests: list[bytes], url: str, *, count: int | None = None,
                 concurrency: int = 0, connections: int = 0, preopen: int = 0,
                 expected: list[int] | None = None, timeout_s: float = TIMEOUT_S, first: int = 0,
                 strict: bool = False, answers: bool = False, retry_after: bool = False,
                 stop: Callable[[], bool] = lambda: False):
        self.requests, self.url, self.expected, self.timeout_s = requests, url, expected, timeout_s
        self.strict, self.answers, self.retry_after, self.stop = strict, answers, retry_after, stop
        self.count, self.connections = count, connections
        self.out: dict[str, Any] = {"t": [], "ms": [], "status": [], "lag_ms": [],
                                    "sent_in_time": 0, "wrong": 0, "failures": {}, "parked": 0}
        if answers:
            self.out |= {"image": [], "index": [], "version": []}
        self.images = itertools.count(first)
        # Opened before the phase starts; an open loop may open more, up to ``connections``.
        self.conns = [_Connection(url, timeout_s)
                      for _ in range(concurrency or preopen or connections)]
        self.free: asyncio.Queue = asyncio.Queue()
        self.end = math.inf

    async def run(self, seconds: float, rate: float) -> dict[str, Any]:
        """The phase, closed loop or (given ``rate``) open; its record."""
        live = live_request(self.url)
        collecting = gc.isenabled()
        try:
            # Open the connections first, so the phase does not pay for TCP set-up.
            await asyncio.gather(*(c.request(live) for c in self.conns))
            gc.collect()
            gc.disable()
            cpu0 = time.process_time()
            t0 = time.monotonic()
            self.end = t0 + seconds
            if rate:
                await self.open_loop(t0, rate)
            else:
                await callers_loop(self.conns, self.one, until=self.end, count=self.count,
                                   stop=self.stop)
        finally:
            if collecting:
                gc.enable()
            for c in self.conns:
                c.close()
        out = self.out
        out["t0"] = t0
        out["seconds"] = time.monotonic() - t0
        out["cpu_s"] = time.process_time() - cpu0  # this client process's own CPU in the phase
        out["connections"] = len(self.conns)
        return out

    async def one(self, conn: _Connection, due: float) -> tuple[int, float]:
        """Send the next request on ``conn``: its status, and how long to wait before the next
        one on it (a 503's Retry-After, when honoured; else 0)."""
        j = next(self.images) % len(self.requests)
        status, index, version, wait = 0, None, None, 0.0
        try:
            status, headers, body = await conn.request(self.requests[j])
            refused = turned_away((status, headers, body))
            if self.retry_after and refused is not None:
                wait = refused
                self.out["parked"] += 1
            if self.strict and status != 200 and refused is None:
                raise _failed(self.url, status, body)
            if status == 200 and (self.expected is not None or self.answers):
                index, version, _ = _answer(headers, body)
                if self.expected is not None and index != self.expected[j]:
                    self.out["wrong"] += 1
        except (OSError, EOFError, TimeoutError) as e:
            if self.strict:
                raise
            self.failed(type(e).__name__)
        except (ValueError, KeyError, TypeError, IndexError):  # not an answer we can read
            if status == 200:
                self.out["wrong"] += 1
            else:
                self.failed("BadResponse")
        self.record(due, status, j, index, version)
        return status, wait

    def failed(self, kind: str) -> None:
        self.out["failures"][kind] = self.out["failures"].get(kind, 0) + 1

    def record(self, due: float, status: int, j: int, index: int | None,
               version: str | None) -> None:
        out = self.out
        out["t"].append(due)
        out["ms"].append((time.monotonic() - due) * 1e3)
        out["status"].append(status)
        if self.answers:
            out["image"].append(j)
            out["index"].append(index)
            out["version"].append(version)

    async def open_loop(self, t0: float, rate: float) -> None:
        for c in self.conns:
            self.free.put_nowait(c)
        tasks: set[asyncio.Task] = set()
        k = 0
        while (due := t0 + k / rate) < self.end:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(self.due_at(due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
        await asyncio.gather(*list(tasks))

    async def due_at(self, due: float) -> None:
        if self.free.empty() and len(self.conns) < self.connections:
            conn = _Connection(self.url, self.timeout_s)
            self.conns.append(conn)
        else:  # queued here when all the connections allowed are busy: counted as lag
            conn = await self.free.get()
        now = time.monotonic()
        # A polite client sends no backlog after the phase.
        if self.retry_after and now >= self.end:
            self.free.put_nowait(conn)
            return
        self.out["lag_ms"].append((now - due) * 1e3)
        self.out["sent_in_time"] += now < self.end
        wait = 0.0
        try:
            # A polite client sends when it may: its latency counts from then (its own waiting
            # is the send lag); else from when the request was due, so a stall of the server that
            # holds the client's connections counts in full.
            wait = (await self.one(conn, now if self.retry_after else due))[1]
        finally:
            if wait:
                asyncio.get_running_loop().call_later(wait, self.free.put_nowait, conn)
            else:
                self.free.put_nowait(conn)


def _serve(conn, stop, pngs: list[bytes], tensors: list[bytes] | None = None,
           shape: list[int] | None = None, cores: list[int] | None = None) -> None:
    """Body of the client process: answer the benchmark's requests until told to close;
    ``stop`` (an event) set ends a closed-loop phase early; ``cores``: the only cores it runs
    on (None: any)."""
    if cores:
        os.sched_setaffinity(0, cores)
    client = _Client(pngs, tensors, shape, stop.is_set)
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "close":
                return
            try:
                if msg[0] not in ("timed", "concurrent", "load"):
                    raise ValueError(f"unknown request {msg[0]!r}")
                answer = getattr(client, msg[0])(*msg[1:])
                if asyncio.iscoroutine(answer):
                    answer = client.loop.run_until_complete(answer)
                conn.send(("ok", answer))
            except Exception as e:  # reported to the benchmark, which raises it there
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except (EOFError, KeyboardInterrupt):
        return
    finally:
        client.close()


class HttpClientProcess:
    """Sends the benchmark's requests from a separate process; blocking calls, so run them in
    a thread from async code.  A failure in the child comes back as :class:`RuntimeError`.
    ``pngs``: the images as PNG (``http``); ``tensors``: the same images normalized, as float32
    bytes of shape ``shape`` (``http-v2``, ``grpc``)."""

    def __init__(self, pngs: list[bytes], tensors: list[bytes] | None = None,
                 shape: list[int] | None = None, *, cores: list[int] | None = None):
        ctx = mp.get_context("spawn")  # never fork a process holding Ray, torch or uvicorn threads
        self._conn, child = ctx.Pipe()
        self._stop = ctx.Event()
        self.process = ctx.Process(target=_serve,
                                   args=(child, self._stop, list(pngs), tensors, shape, cores),
                                   daemon=True, name="sensai-bench-client")
        self.process.start()
        child.close()

    def _ask(self, *msg, timeout_s: float = 3600.0):
        self._conn.send(msg)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the benchmark's HTTP client gave no answer in {timeout_s:.0f} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def timed(self, transport: str, address: str, model: str,
              indices) -> list[tuple[float, int, dict, float]]:
        """One request at a time over ``transport`` to the gateway at ``address`` (a URL, or
        host:port for gRPC) serving ``model``, each just after the bare request: (latency ms,
        predicted index, gateway timings, bare request ms) per image."""
        return self._ask("timed", transport, address, model, [int(j) for j in indices])

    def concurrent(self, url: str, n_requests: int, concurrency: int, transport: str = "http",
                   model: str = "sensai") -> dict[str, Any]:
        """``n_requests`` requests from ``concurrency`` callers: seconds, the answered ones'
        ``latencies`` (ms) and ``shed``, those the server's admission turned away."""
        return self._ask("concurrent", url, int(n_requests), int(concurrency), transport, model)

    def load(self, url: str, **plan) -> dict[str, Any]:
        """One phase of ``sensai bench-load``: :func:`load_phase`'s keywords and answer, and
        ``transport`` and ``model`` (default: PNG uploads).  A closed loop runs until ``seconds``
        have passed or :meth:`stop_load` is called."""
        self._stop.clear()
        return self._ask("load", url, plan, timeout_s=float(plan["seconds"]) + 600.0)

    def stop_load(self) -> None:
        """Ends the closed loop :meth:`load` runs (from another thread): every caller finishes
        its request in flight, then the phase answers."""
        self._stop.set()

    def close(self) -> None:
        try:
            self._conn.send(("close",))
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self._conn.close()

"""The benchmark's HTTP client, in its own spawned process.

A client sharing the gateway's process (and GIL) adds its own JSON parsing and socket work to every
measured request, and the two event loops delay each other; a real caller sits on another process or
machine.  The child process imports this module (and the light package ``__init__`` files above
it) and httpx, nothing heavier, so it starts in well under a second.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

import httpx

PREDICT = "/v1/predict"
HEADERS = {"content-type": "image/png"}


def _parse(resp, url: str) -> tuple[int, dict]:
    if resp.status_code != 200:
        raise RuntimeError(f"gateway at {url} answered {resp.status_code}: {resp.text[:200]}")
    body = resp.json()
    return int(body["index"]), body["timings_ms"]


class _Client:
    """Runs in the child: one keep-alive connection per gateway for sequential requests."""

    def __init__(self, pngs: list[bytes]):
        self.pngs = pngs
        self.clients: dict = {}

    def sequential(self, url: str, indices: list[int]) -> list[tuple[float, int, dict]]:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = httpx.Client(base_url=url, timeout=120.0)
        out = []
        for j in indices:
            t0 = time.perf_counter()
            resp = client.post(PREDICT, content=self.pngs[j], headers=HEADERS)
            ms = (time.perf_counter() - t0) * 1e3
            pred, timings = _parse(resp, url)
            out.append((ms, pred, timings))
        return out

    async def concurrent(self, url: str, n_requests: int, concurrency: int) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
            counter = iter(range(n_requests))
            latencies: list[float] = []

            async def one_client() -> None:
                for j in counter:
                    t0 = time.perf_counter()
                    resp = await client.post(PREDICT, content=self.pngs[j % len(self.pngs)],
                                             headers=HEADERS)
                    _parse(resp, url)
                    latencies.append((time.perf_counter() - t0) * 1e3)

            # Warm the pool's connections so the timed part does not pay for TCP set-up.
            await asyncio.gather(*(client.get("/v2/health/live") for _ in range(concurrency)))
            t0 = time.perf_counter()
            await asyncio.gather(*(one_client() for _ in range(concurrency)))
            return {"seconds": time.perf_counter() - t0, "latencies": latencies}

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def _serve(conn, pngs: list[bytes]) -> None:
    """Body of the client process: answer the benchmark's requests until told to close."""
    client = _Client(pngs)
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "close":
                return
            try:
                if msg[0] == "sequential":
                    conn.send(("ok", client.sequential(msg[1], msg[2])))
                elif msg[0] == "concurrent":
                    conn.send(("ok", asyncio.run(client.concurrent(msg[1], msg[2], msg[3]))))
                else:
                    conn.send(("error", f"unknown request {msg[0]!r}"))
            except Exception as e:  # reported to the benchmark, which raises it there
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except (EOFError, KeyboardInterrupt):
        return
    finally:
        client.close()


class HttpClientProcess:
    """Sends the benchmark's PNG requests from a separate process; blocking calls, so run them in
    a thread from async code.  A failure in the child comes back as :class:`RuntimeError`."""

    def __init__(self, pngs: list[bytes]):
        ctx = mp.get_context("spawn")  # never fork a process holding Ray, torch or uvicorn threads
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, list(pngs)), daemon=True,
                                   name="sensai-bench-client")
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

    def sequential(self, url: str, indices) -> list[tuple[float, int, dict]]:
        """One request at a time: (latency ms, predicted index, gateway timings) per image."""
        return self._ask("sequential", url, [int(j) for j in indices])

    def concurrent(self, url: str, n_requests: int, concurrency: int) -> dict[str, Any]:
        """``n_requests`` requests from ``concurrency`` clients: seconds and per-request latencies."""
        return self._ask("concurrent", url, int(n_requests), int(concurrency))

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

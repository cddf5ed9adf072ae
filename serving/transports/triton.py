"""Subnets served by a Triton Inference Server (``--backend triton``): each subnet is a Triton
model (``sensai export-triton``), reached over HTTP with binary tensors.

A worker here is one Triton model, so it hosts exactly one group and cannot skip, be killed or
restarted from the gateway: Triton owns its instances.  A failed call loses that group's answer
(503 naming its classes); readiness asks the server.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

from sensai.errors import SensaiError

from ..core.messages import Done, Output, Run, RunFailed
from .base import Capabilities, Sink, WorkerHandle


class TritonWorker(WorkerHandle):
    transport = "triton"

    def __init__(self, *args, owner: "Triton", model: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = owner
        self.model = model
        self.io: tuple[str, str] | None = None
        self.tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self.generation += 1

    def wait_ready(self, timeout: float) -> None:
        client = httpclient.InferenceServerClient(self.owner.url, connection_timeout=timeout,
                                                  network_timeout=timeout)
        try:
            try:
                ready = client.is_model_ready(self.model)
            except Exception as e:
                raise SensaiError(f"cannot reach Triton at {self.owner.url}: {e}") from None
            if not ready:
                raise SensaiError(f"Triton at {self.owner.url} has no ready model {self.model!r}")
            meta = client.get_model_metadata(self.model)
            self.io = (meta["inputs"][0]["name"], meta["outputs"][0]["name"])
        finally:
            client.close()

    def send(self, msg) -> None:
        if type(msg) is Run:  # called on the event loop by the predictor
            task = asyncio.get_running_loop().create_task(self._infer(msg, self.generation))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _infer(self, run: Run, gen: int) -> None:
        group = run.groups[0]
        in_name, out_name = self.io
        inp = httpclient.InferInput(in_name, list(run.x.shape), "FP32")
        inp.set_data_from_numpy(run.x, binary_data=True)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            res = await self.owner.client().infer(
                self.model, [inp], outputs=[httpclient.InferRequestedOutput(out_name,
                                                                            binary_data=True)])
            event = Output(run.req, group, res.as_numpy(out_name), (loop.time() - t0) * 1e3)
        except InferenceServerException as e:
            event = RunFailed(run.req, group, f"Triton model {self.model}: {e.message()}")
        except (OSError, asyncio.TimeoutError) as e:  # refused or reset: the server went away
            event = RunFailed(run.req, group, f"Triton at {self.owner.url} unreachable: {e}")
        self.sink.deliver(self.index, gen, event)
        self.sink.deliver(self.index, gen, Done(run.req, 0))

    def probe(self, timeout: float) -> bool:
        return self.owner.model_ready(self.model, timeout)

    def kill(self) -> int | None:
        raise SensaiError("Triton owns its model instances: they cannot be ended from here")

    def stop(self, timeout: float = 5.0) -> None:
        for task in list(self.tasks):
            task.cancel()

    def where(self) -> dict:
        return {"device": "triton", "runtime": "triton", "model": self.model,
                "url": self.owner.url}


class Triton:
    """The Triton transport: subnet ``g`` is the model ``models[g]`` of the server at ``url``
    (``host:port`` of its HTTP endpoint)."""

    name = "triton"
    # The server batches (its dynamic batcher), restarts and owns its model instances.
    capabilities = Capabilities(restart=False, kill=False, batch=False)

    def __init__(self, url: str, models: Sequence[str], *, timeout_s: float):
        self.url = url.removeprefix("http://").rstrip("/")
        self.timeout_s = timeout_s
        self.names = list(models)
        self._clients: dict[asyncio.AbstractEventLoop, aioclient.InferenceServerClient] = {}
        self._keepers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self.models: list[str] = []

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **options
               ) -> TritonWorker:
        model = self.names[groups[0]]
        self.models.append(model)
        return TritonWorker(index, groups, specs, sink, owner=self, model=model, **options)

    def client(self) -> aioclient.InferenceServerClient:
        """One aiohttp session per event loop (the gateway's, or a test's), closed when that
        loop ends if :meth:`close` has not closed it before."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = aioclient.InferenceServerClient(
                self.url, conn_timeout=self.timeout_s)
            keeper = self._keepers[loop] = loop.create_task(self._close_with_loop(client))
            keeper.add_done_callback(lambda _: self._forget(loop, client))
        return client

    def _forget(self, loop, client) -> None:
        if self._clients.get(loop) is client:
            del self._clients[loop]
            self._keepers.pop(loop, None)

    async def _close_with_loop(self, client) -> None:
        # Closes the session when cancelled: by close(), or by the loop's runner when the loop
        # ends first (a gateway stopped before its predictor, as the benchmark's are).
        try:
            await asyncio.Event().wait()
        finally:
            await client.close()

    def model_ready(self, model: str, timeout: float = 2.0) -> bool:
        client = httpclient.InferenceServerClient(self.url, connection_timeout=timeout,
                                                  network_timeout=timeout)
        try:
            return bool(client.is_model_ready(model))
        except Exception:  # unreachable means not ready
            return False
        finally:
            client.close()

    def healthy(self) -> bool:
        return all(self.model_ready(m) for m in self.models)

    def describe(self) -> dict:
        return {"kind": "triton", "url": self.url, "models": list(self.models)}

    def close(self) -> None:
        for loop, keeper in list(self._keepers.items()):
            if loop.is_running():
                loop.call_soon_threadsafe(keeper.cancel)
            elif not loop.is_closed():
                keeper.cancel()
                loop.run_until_complete(asyncio.gather(keeper, return_exceptions=True))
        self._keepers.clear()
        self._clients.clear()

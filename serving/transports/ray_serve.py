"""Workers as Ray Serve deployments (the Serve application of :mod:`sensai.serving.ray_app`,
``serve run deploy/ray-serve.yaml`` or KubeRay's ``RayService``): the ingress holds one
``DeploymentHandle`` per worker deployment, injected by Serve, and calls it from its event loop.

Serve places and restarts the replicas (its health checks); a call that fails marks the worker
down, and the supervisor takes it back once a ping through the handle answers again.  The
replicas run the same worker body as the Ray actor transport, one call per (request, group):
Serve's handles carry each call on its own, so nothing queues in a replica to be batched.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Sequence

from sensai.raycluster import error_text

from ..messages import Done, Failure, Run, Skip
from .base import Capabilities, Sink, WorkerHandle


class ServeWorker(WorkerHandle):
    transport = "ray-serve"

    def __init__(self, *args, handle=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.handle = handle
        self.tasks: set[asyncio.Task] = set()
        self._asking: asyncio.Task | None = None

    def start(self) -> None:
        self.generation += 1
        self.node = self.pid = None  # learnt again from the new replica

    async def _learn_where(self) -> None:
        """Where the replica runs (pid, node, device), for ``/v1/models``: asked once per
        replica, alongside its first request."""
        try:
            info = await self.handle.ping.remote()
        except Exception:
            return
        self.pid, self.device, self.runtime, self.node = (info.pid, info.device, info.runtime,
                                                          info.node)
        self.cores_awake = info.cores_awake

    def wait_ready(self, timeout: float) -> None:
        """Serve starts the replicas itself; requests wait in the handle until one is up."""

    def send(self, msg) -> None:
        kind = type(msg)
        if kind is Run:  # called on the ingress's event loop by the predictor
            loop = asyncio.get_running_loop()
            if self.node is None and self._asking is None:
                self._asking = loop.create_task(self._learn_where())
                self._asking.add_done_callback(lambda _: setattr(self, "_asking", None))
            state = {"left": len(msg.groups), "skipped": 0}
            for j, g in enumerate(msg.groups):
                resp = self.handle.run.remote(msg.req, g, msg.x, len(msg.groups),
                                              j >= msg.primaries, msg.hedge_s)
                task = loop.create_task(self._await(msg.req, g, resp, self.generation, state))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        elif kind is Skip:
            self.handle.skip.remote(msg)
        else:  # Fault
            self.handle.fault.remote(msg)

    async def _await(self, req: int, group: int, resp, gen: int, state: dict) -> None:
        from ray.exceptions import RayActorError

        try:
            res = await resp
        except RayActorError as e:  # the replica died: Serve replaces it
            self.sink.exited(self.index, gen, f"replica died ({error_text(e)})")
            return
        except Exception as e:  # the call failed: this copy is lost, the worker lives
            res = Failure(req, group, error_text(e))
        if res is None:
            state["skipped"] += 1
        else:
            self.sink.deliver(self.index, gen, res)
        state["left"] -= 1
        if state["left"] == 0:
            self.sink.deliver(self.index, gen, Done(req, state["skipped"]))

    def probe(self, timeout: float) -> bool:
        try:  # from the supervisor's thread, never the event loop
            self.handle.ping.remote().result(timeout_s=timeout)
            return True
        except Exception:
            return False

    def kill(self) -> int | None:
        """SIGKILL the replica's process (fault injection: it must run on this machine); Serve
        replaces it."""
        try:
            info = self.handle.ping.remote().result(timeout_s=10)
        except Exception:
            return None
        os.kill(info.pid, signal.SIGKILL)
        return info.pid

    def stop(self, timeout: float = 5.0) -> None:
        for task in list(self.tasks):
            task.cancel()


class ServeHandles:
    """The Ray Serve transport over the injected handles ``handles[w]`` of worker ``w``."""

    name = "ray-serve"
    capabilities = Capabilities(several_groups=True, skip=True, restart=True, kill=True,
                                batch=False)  # one call per (request, group)

    def __init__(self, handles: Sequence):
        self.handles = list(handles)

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **faults
               ) -> ServeWorker:
        return ServeWorker(index, groups, specs, sink, handle=self.handles[index], **faults)

    def healthy(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"kind": "ray-serve", "deployments": len(self.handles)}

    def close(self) -> None:
        pass

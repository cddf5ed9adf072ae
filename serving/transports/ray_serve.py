"""Workers as Ray Serve deployments (the Serve application of
:mod:`sensai.serving.launch.serve_app`, ``serve run deploy/ray-serve.yaml`` or KubeRay's
``RayService``).

Serve places, health-checks and replaces the worker replicas; the requests do not take Serve's
handles.  The ingress learns each worker through the ``DeploymentHandle`` Serve injects, asks
it (through the handle) to open a socket for this ingress, and from then on reaches it exactly
as the Ray actor transport reaches an actor (:class:`~.ray_actors.ChannelWorker`): the same
authenticated socket, messages and in-worker loop, batching included, because a handle call
per (request, group) costs far more than a small subnet's compute.  A replica that dies closes
its socket (or fails its ``watch`` call); the supervisor then asks the handle again, which
waits for the replica Serve starts in its place, and reconnects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
from typing import Sequence

from sensai.errors import SensaiError
from sensai.raycluster import error_text

from .base import Capabilities, Sink
from .ray_actors import ChannelWorker


class ServeWorker(ChannelWorker):
    transport = "ray-serve"

    def __init__(self, *args, handle=None, loop: asyncio.AbstractEventLoop | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.handle = handle
        self.loop = loop

    # A handle is used on the ingress's event loop only (Serve's routers may be bound to it);
    # these are called from the supervisor's threads, and hand the call to that loop.
    def _submit(self, method: str, *args) -> concurrent.futures.Future:
        async def ask():
            return await getattr(self.handle, method).remote(*args)

        return asyncio.run_coroutine_threadsafe(ask(), self.loop)

    def call(self, method: str, *args, timeout: float):
        future = self._submit(method, *args)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def call_async(self, method: str, *args, done) -> None:
        # Cancelled: the ingress is stopping, which is no death of the worker.
        self._submit(method, *args).add_done_callback(
            lambda f: done(None if f.cancelled() else f.exception()))

    def wait_ready(self, timeout: float) -> None:
        """Serve starts the replicas itself (and replaces a dead one): a ping through the
        handle waits until one answers, which it does once it has loaded its subnets."""
        from ray.exceptions import RayError

        deadline = time.monotonic() + timeout
        while True:
            left = self.time_left(deadline, timeout)
            try:
                self.call("ping", timeout=min(left, 5.0))
                break
            except TimeoutError:
                continue
            except RayError:  # the replica died while answering: Serve replaces it
                time.sleep(0.1)
        self.connect_channel(deadline)

    def kill(self) -> int | None:
        """SIGKILL the replica's process (fault injection: it must run on this machine); Serve
        replaces it."""
        pid = self.pid
        if pid is None:
            try:
                pid = self.call("ping", timeout=10).pid
            except Exception as e:
                raise SensaiError(f"{self.name}: no replica to kill ({error_text(e)})") from None
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self, timeout: float = 5.0) -> None:
        """Hang up; the replicas belong to Serve and stay."""
        self._closing.set()
        self.hang_up(self.inc)


class ServeHandles:
    """The Ray Serve transport over the injected handles ``handles[w]`` of worker ``w``."""

    name = "ray-serve"
    capabilities = Capabilities()

    def __init__(self, handles: Sequence, loop: asyncio.AbstractEventLoop):
        self.handles = list(handles)
        self.loop = loop  # the ingress's, where the handles are used
        self.owner = os.urandom(8).hex()  # this ingress replica, to the workers

    def worker(self, index: int, groups: Sequence[int], specs, sink: Sink, **options
               ) -> ServeWorker:
        return ServeWorker(index, groups, specs, sink, handle=self.handles[index],
                           loop=self.loop, owner=self.owner, **options)

    def healthy(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"kind": "ray-serve", "deployments": len(self.handles)}

    def close(self) -> None:
        pass

"""A Ray Serve application run by this process: ``sensai serve ART --backend ray-serve`` (the
application of :mod:`.serve_app`, the one ``serve run deploy/ray-serve.yaml`` and KubeRay run) and
the benchmark's plain Ray Serve peer.

:func:`launch` joins the Ray cluster named (``--ray-address`` / ``RAY_ADDRESS``), else starts a
local instance on 127.0.0.1 (:func:`sensai.raycluster.connect`, as the ``ray`` backend does);
refuses a cluster where Serve already runs (its proxy's address is not ours to choose, its
applications not ours to stop); starts Serve, with its HTTP proxy on the host and port asked or,
for ``sensai serve``'s application (:meth:`ServeRun.serve`, which serves on that address
itself: Serve's proxy would cost every request two more hops), with none; runs the application
at route ``/``; and returns once a route answers 200 there.
:meth:`ServeRun.stop` deletes the application, shuts Serve down, and Ray when :func:`launch`
started or joined it.  Ray is imported only after :func:`~sensai.raycluster.connect` (which must
set Ray's loopback switch before the import).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, NoReturn

from sensai.errors import SensaiError
from sensai.raycluster import connect, error_text

from ..core.settings import GatewaySettings, check_backend
from .child import wait_ready
from .signals import StopSignals

log = logging.getLogger(__name__)

READY = "/v2/health/ready"
STARTUP_TIMEOUT_S = 300.0
# How long ``sensai serve``'s Serve may take to stop on a Ray instance of its own (a few
# seconds while Ray is alive; Ray's shutdown ends the application anyway).
SERVE_STOP_S = 10.0


def deploy(app, name: str, timeout_s: float) -> None:
    """``serve.run`` of ``app``, which waits for every replica however long; refused once
    ``timeout_s`` has passed (a replica the cluster cannot place waits for ever), with what
    Serve says of its deployments."""
    from ray import serve

    failed: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(app, name=name, route_prefix="/")
        except BaseException as e:  # said by the caller's thread
            failed.append(e)

    runner = threading.Thread(target=run, daemon=True, name="sensai-serve-run")
    runner.start()
    runner.join(timeout_s)
    if failed:
        raise failed[0]
    if runner.is_alive():
        app_status = serve.status().applications.get(name)
        said = "; ".join(f"{d}: {getattr(o.status, 'value', o.status)} {o.message}".strip()
                         for d, o in (app_status.deployments.items() if app_status else ())
                         if getattr(o.status, "value", o.status) != "HEALTHY")
        raise SensaiError(f"the Serve application is not running after {timeout_s:g} s"
                          + (f" ({said})" if said else "") + "; a replica the cluster cannot "
                          "place waits for ever: give each fewer CPUs (--set ray_cpus)")


class ServeRun:
    """An application this process runs on Ray Serve: created connected to Ray (a new local
    instance, or the cluster named), :meth:`start` runs the application; its ``url`` and
    :meth:`stop`."""

    def __init__(self, ray_address: str | None = None, *, serve_stop_s: float | None = None):
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        self.own_ray = connect(ray_address)
        self.name, self.url, self.own_serve = "", "", False
        # On a Ray instance of its own, how long Serve may take to stop (None: however long).
        self.serve_stop_s = serve_stop_s
        self.abandoned = False

    def start(self, build: Callable[[], tuple[str, Any]], *, host: str, port: int,
              ready_path: str, proxy: bool = True,
              startup_timeout_s: float = STARTUP_TIMEOUT_S) -> "ServeRun":
        """Run the application that ``build()`` returns with its name at route ``/``, served on
        ``host:port`` by Serve's proxy (``proxy``), or else by the application itself (no
        proxy); returns once ``ready_path`` answers 200 there.  What it started is stopped
        when it fails."""
        from ray import serve

        self.url = f"http://{client_host(host)}:{port}"
        try:
            status = serve.status()
            if status.proxies or status.applications:
                raise SensaiError("Ray Serve already runs on this Ray cluster (stop it with "
                                  "'serve shutdown', or use another cluster)")
            self.own_serve = True
            if proxy:
                serve.start(http_options={"host": host, "port": port})
            else:
                serve.start(proxy_location="Disabled")
            # serve.start sets Serve's logging up anew; serve.run's notices (it "connects to
            # the existing Serve app", whose HTTP options it "will not apply") mislead here.
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
            self.name, app = build()
            deploy(app, self.name, startup_timeout_s)
            wait_ready(self.url + ready_path, startup_timeout_s,
                       what="Ray Serve's proxy" if proxy else "the Serve application")
            return self
        except SensaiError:
            self.stop()
            raise
        except Exception as e:
            self.stop()
            raise SensaiError(f"Ray Serve: {error_text(e)}") from None
        except BaseException:
            self.stop()
            raise

    def serve(self, artifact: str | Path, settings: GatewaySettings, *,
              startup_timeout_s: float = STARTUP_TIMEOUT_S) -> "ServeRun":
        """Run the application ``sensai serve ART --backend ray-serve`` runs: the artifact's
        with ``settings``, its ingress serving on ``settings.host:port`` itself (Serve without
        a proxy)."""
        def build():
            from .serve_app import APP_NAME, build_app  # Ray: imported once connected

            return APP_NAME, build_app({"artifact": str(Path(artifact).resolve()),
                                        "settings": settings.model_dump(), "own_port": True})

        return self.start(build, host=settings.host, port=settings.port, ready_path=READY,
                          proxy=False, startup_timeout_s=startup_timeout_s)

    def stop(self) -> bool:
        """Delete the application, shut Serve down, then Ray when this process started or
        joined it.  False when Serve did not stop within ``serve_stop_s`` on a Ray instance this
        process started: a thread is still inside a Ray call, nothing more is asked of Ray (now
        or by a later call), and the caller must end the process without Ray's own exit
        handlers (see :func:`serve_artifact`)."""
        import ray
        from ray import serve

        def stop_serve() -> None:
            try:
                if self.name:
                    serve.delete(self.name)
                serve.shutdown()
            except Exception as e:  # best effort: Ray itself may already be gone
                log.warning("stopping Ray Serve: %s", error_text(e))

        if self.abandoned:
            return False
        if self.own_serve:
            self.own_serve = False
            if self.serve_stop_s is None or not self.own_ray:  # a cluster's: however long
                stop_serve()
            else:
                stopper = threading.Thread(target=stop_serve, name="sensai-serve-stop",
                                           daemon=True)
                stopper.start()
                stopper.join(self.serve_stop_s)
                if stopper.is_alive():
                    self.abandoned = True
                    return False
        if self.own_ray:
            ray.shutdown()
            self.own_ray = False
        return True


def client_host(host: str) -> str:
    """The address a client on this machine reaches a server bound to ``host`` at."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else "[::1]" if host == "::" else \
        f"[{host}]" if ":" in host else host


def launch(build: Callable[[], tuple[str, Any]], *, host: str, port: int, ready_path: str,
           ray_address: str | None = None,
           startup_timeout_s: float = STARTUP_TIMEOUT_S) -> ServeRun:
    """:class:`ServeRun` of the application ``build()`` returns, behind Serve's proxy (see
    :meth:`ServeRun.start`)."""
    return ServeRun(ray_address).start(build, host=host, port=port, ready_path=ready_path,
                                       startup_timeout_s=startup_timeout_s)


def serve_artifact(artifact: str | Path, settings: GatewaySettings, *,
                   startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """``sensai serve ART --backend ray-serve``: the Serve application of the artifact with
    ``settings``, its ingress on ``settings.host:port`` (no Serve proxy), until SIGTERM or
    SIGINT; then the application, Serve (and Ray, when this process started it) are
    stopped."""
    check_backend(settings)
    run = ServeRun(settings.ray_address, serve_stop_s=SERVE_STOP_S)
    # Installed after Ray's own handlers, which would exit this process halfway through.
    with StopSignals() as signals:
        try:
            run.serve(artifact, settings, startup_timeout_s=startup_timeout_s)
            print(f"serving {artifact} as the Ray Serve application '{run.name}' on "
                  f"http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
            signals.wait()
        except KeyboardInterrupt:
            # The port answers before start-up returns: a SIGTERM then (a supervisor that saw
            # it ready) asks for the same clean stop as one after it; Ctrl-C stays an interrupt.
            if signals.received != signal.SIGTERM:
                raise
        finally:
            if not run.stop():
                exit_without_ray(signals.received, sys.exc_info()[1])


def exit_without_ray(received: int | None, error: BaseException | None) -> NoReturn:
    """End this process at once, with the status ``sensai serve`` would have ended with.

    For a Ray instance whose Serve did not stop in time: a signal to the whole process group
    (systemd stopping a unit, ``kill -- -PGID``) reached that instance's own processes too,
    Serve's calls wait for them, and Ray would end this process with status 1 once it gave up
    on them, from a thread that any later Ray call (``ray.shutdown``, Ray's exit handler)
    races.  The instance's processes share this one's fate: they end with it."""
    log.warning("Ray Serve did not stop within %g s (Ray's own processes were signalled "
                "too?); exiting without it", SERVE_STOP_S)
    status = 0
    if received == signal.SIGINT or isinstance(error, KeyboardInterrupt):
        status = 130
    elif error is not None:
        log.error("%s", error_text(error))
        status = 2 if isinstance(error, SensaiError) else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

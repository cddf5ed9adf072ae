"""The one place sensai connects to Ray (retraining tasks, serving actors, the benchmark).

``connect()`` joins the cluster the operator names (``address``, else ``RAY_ADDRESS``), or starts
a local instance bound to 127.0.0.1, so a machine's Ray ports never face the network unless the
operator runs a cluster on purpose.  Ray 2.60's ``ray start --head`` turns token authentication
on; a client then needs ``RAY_AUTH_MODE=token`` (see deploy/README.md).

Ray's start-up messages need nothing from the user, so they stay out of the console: Ray's own
logging at WARNING and up only, the workers' output in the session's log files
(``log_to_driver``), and the notice that a new local instance uses token authentication (Ray's
secure default, a WARNING in the middle of a command's output) moved to this module's debug log.
"""

from __future__ import annotations

import logging
import os
import re

from .errors import SensaiError
from .net import is_loopback

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Where Ray says which authentication a new local instance got.
AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def connect(address: str | None = None, *, num_cpus: int | None = None,
            namespace: str | None = None, log_to_driver: bool = False) -> bool:
    """Connect this process to Ray; nothing if it is connected already.

    Returns True when this call started or joined Ray (the caller then shuts it down).
    ``num_cpus`` applies to a new local instance only."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None or loopback_address(address):
        # Ray turns a loopback address into the machine's network address before connecting
        # (it assumes a multi-host cluster); this switch, read when Ray is imported, keeps
        # 127.0.0.1 what it says.  It has no effect once Ray is imported.
        os.environ.setdefault(LOOPBACK_SWITCH, "0")
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict = dict(logging_level=logging.WARNING, namespace=namespace,
                        log_to_driver=log_to_driver)
    if address is None:
        kwargs.update(include_dashboard=False, _node_ip_address=LOOPBACK, num_cpus=num_cpus)
    # Only a new local instance announces its (default) authentication; setting RAY_AUTH_MODE
    # ourselves would silence it too, but Ray reads that once per process and may have already.
    notices = logging.getLogger(AUTH_NOTICE_LOGGER)
    notices.addFilter(_to_debug_log)
    try:
        # "local": a new instance even when another Ray runs on this machine (ray.init(None)
        # would silently join the last cluster started here, e.g. a `ray start` left running).
        ray.init(address=address or "local", **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SensaiError(f"cannot connect to Ray at {address or 'a new local instance'}: "
                          f"{error_text(e)}") from None
    finally:
        notices.removeFilter(_to_debug_log)
    return True


def _to_debug_log(record: logging.LogRecord) -> bool:
    """A logging filter: Ray's record goes to this module's debug log instead of Ray's console
    handler."""
    log.debug("ray: %s", record.getMessage())
    return False


def loopback_address(address: str) -> bool:
    """Whether a Ray address (``[scheme://]host:port``) names this machine's loopback."""
    return is_loopback(address.split("://")[-1].rsplit(":", 1)[0])


def error_text(e: BaseException) -> str:
    """One line for a Ray error: what the remote code raised, else Ray's reason."""
    def lines(x) -> list[str]:
        return [ln.strip() for ln in _ANSI.sub("", str(x)).splitlines() if ln.strip()]

    cause = getattr(e, "cause", None)  # RayTaskError: the exception raised remotely
    if isinstance(cause, Exception):
        first = lines(cause)
        text = f"{type(cause).__name__}: {first[0]}" if first else type(cause).__name__
    elif getattr(e, "actor_init_failed", False) and lines(e):
        # The constructor raised: Ray's message ends with the remote traceback's last line.
        text = f"loading failed: {lines(e)[-1]}"
    else:
        first = lines(e)
        text = f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def alive_nodes() -> list[dict]:
    """The cluster's live nodes, head first then by address: id, address, CPUs, GPUs."""
    import ray

    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        out.append({"id": n["NodeID"], "address": n.get("NodeManagerAddress"),
                    "head": "node:__internal_head__" in res,
                    "cpus": float(res.get("CPU", 0)), "gpus": float(res.get("GPU", 0))})
    return sorted(out, key=lambda n: (not n["head"], n["address"] or "", n["id"]))


def cluster_resources() -> tuple[float, float]:
    """(CPUs, GPUs) of the connected cluster."""
    import ray

    res = ray.cluster_resources()
    return float(res.get("CPU", 0)), float(res.get("GPU", 0))


def share(total: float, parts: int) -> float:
    """An even share of ``total`` for ``parts`` claimants that always fits: Ray adds up
    fractional resources, and 3 x round(2/3, 2) = 2.01 > 2 never schedules."""
    return max(0.01, int(total / parts * 100) / 100)


def local_raylet_pid(node_id: str) -> int | None:
    """The pid of node ``node_id``'s raylet when it runs on this machine (a loopback cluster),
    else None; read from ``/proc`` (Linux)."""
    want = f"--node_id={node_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"/raylet") and want in argv:
            return int(entry)
    return None

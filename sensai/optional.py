"""Libraries that only some options need: Ray (retraining on a cluster, the ray backend, the Ray
Serve peer) and tritonclient (the triton backend).

Training, in-process retraining and the local and processes backends run without them, so a
machine may lack them (a GPU box without Ray's large wheel, say).  An option that needs one
asks :func:`require` before any long work, so the operator reads one line instead of a
traceback from deep inside a run.
"""

from __future__ import annotations

import importlib.util

from .errors import SensaiError

INSTALL = {"ray": "pip install 'ray[serve]'",
           "tritonclient": "pip install 'tritonclient[http]'"}
LABEL = {"ray": "Ray", "tritonclient": "tritonclient"}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it (Ray takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a finder that refuses the name
        return False


def missing(module: str, needed_by: str) -> str | None:
    """Why ``needed_by`` cannot run here (one line), or None when ``module`` is installed."""
    if installed(module):
        return None
    return (f"{needed_by} needs {LABEL.get(module, module)}, which is not installed here "
            f"({INSTALL.get(module, f'pip install {module}')})")


def require(module: str, needed_by: str) -> None:
    """Raise :func:`missing`'s line as a :class:`SensaiError` when ``module`` is not installed."""
    why = missing(module, needed_by)
    if why is not None:
        raise SensaiError(why)

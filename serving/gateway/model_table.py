"""The gateway's table of models -> versions, and where a request goes.

Every loaded version has a predictor (workers) of its own.  A request holds the version it was
routed to (:meth:`ModelTable.hold`) until it is answered, so an unload closes a version only
once the requests holding it are done.  An unversioned request goes to the model's highest ready
version (Triton's rule).  State names are Triton's (``READY``, ``LOADING``, ``UNLOADING``,
``UNAVAILABLE``).  What changes the table - loading, draining, unloading, polling a repository -
is :class:`~.served.ServedModels`'s.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..core.contract import Predictor
from ..core.errors import InputError, ModelNotFound, ModelUnavailable
from ..core.settings import GatewaySettings
from .metrics import GatewayMetrics

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"


@dataclass(eq=False)
class ModelVersion:
    """One loaded version: its predictor and the requests holding it."""

    name: str
    version: str
    predictor: Predictor
    max_pixels: int
    stamp: str = ""
    state: str = READY
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def spec(self):
        return self.predictor.spec


class ModelTable:
    """The models served, by name and version, each model's highest ready version, and the
    routing of a request to one of them."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics | None = None):
        self.settings = settings
        self.metrics = metrics or GatewayMetrics(settings.max_request_rows)  # the gateway's, which serves these models
        self.models: dict[str, dict[str, ModelVersion]] = {}
        self.latest: dict[str, ModelVersion] = {}  # each model's highest ready version

    def version_of(self, name: str, version: str, predictor: Predictor,
                   stamp: str = "") -> ModelVersion:
        shape = predictor.spec.input_shape
        return ModelVersion(name, version, predictor, self.settings.image_pixels(shape), stamp)

    def add(self, mv: ModelVersion) -> None:
        self.models.setdefault(mv.name, {})[mv.version] = mv
        self.metrics.model_ready(mv.name, mv.version, mv.state == READY)
        self.pick_latest(mv.name)

    def pick_latest(self, name: str) -> None:
        """Keep ``latest[name]``, where an unversioned request goes, in step with the table:
        every change of a version's presence or state ends here, so routing never sorts."""
        ready = self.ready_versions(name)
        if ready:
            self.latest[name] = self.models[name][ready[-1]]
        else:
            self.latest.pop(name, None)

    def names(self) -> list[str]:
        return sorted(n for n, vs in self.models.items() if vs)

    def default_name(self) -> str | None:
        """The model a request that names none goes to: ``settings.model_name`` when served,
        else the only model, else none."""
        names = self.names()
        if self.settings.model_name in names:
            return self.settings.model_name
        return names[0] if len(names) == 1 else None

    def ready_versions(self, name: str) -> list[str]:
        return sorted((v for v, mv in self.models.get(name, {}).items() if mv.state == READY),
                      key=int)

    def route(self, name: str | None, version: str | None = None) -> ModelVersion:
        """The ready version a request for ``name`` (None: the default model) and ``version``
        (None: the highest ready) goes to."""
        if name is None:
            name = self.default_name()
            if name is None:
                if not self.names():
                    raise ModelNotFound("this server serves no model now (unloaded)")
                raise InputError(f"this server serves several models ({', '.join(self.names())}"
                                 "): name one (/v1/predict?model=NAME)")
        versions = self.models.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model {name!r}; this server serves "
                                f"{', '.join(repr(n) for n in self.names()) or 'no model'}")
        if version is None:
            latest = self.latest.get(name)
            if latest is None:
                raise ModelUnavailable(f"model {name!r} has no ready version", retry_after=1.0)
            return latest
        mv = versions.get(version)
        if mv is None or mv.state != READY:
            raise ModelNotFound(f"model {name!r} has no version {version!r} ready (ready: "
                                f"{', '.join(self.ready_versions(name)) or 'none'})")
        return mv

    @asynccontextmanager
    async def hold(self, name: str | None, version: str | None = None
                   ) -> AsyncIterator[ModelVersion]:
        """The routed version, held (not closed by an unload) until the block ends."""
        mv = self.route(name, version)
        mv.inflight += 1
        mv.idle.clear()
        try:
            yield mv
        finally:
            mv.inflight -= 1
            if mv.inflight == 0:
                mv.idle.set()

    def current(self, mv: ModelVersion) -> bool:
        return self.models.get(mv.name, {}).get(mv.version) is mv

"""The models a gateway serves and their lifecycle: load, drain, unload, poll.

Loading builds a new version's predictor in a thread, checks its files against the manifest's
hashes and warms it with a few predictions before any request is routed to it; a version that
fails is recorded (the index says why) and whatever was serving keeps serving.  Unloading takes a
version out of routing at once and closes its predictor only when the requests holding it are
done (each is bounded by its deadline).  So a swap - the new version ready, then the old one
unloaded - loses no request.  The table itself and the routing are
:class:`~.model_table.ModelTable`'s.

With a repository (:mod:`~sensai.serving.core.repository`), :meth:`ServedModels.load` brings a
model to what its folder and version policy say; :meth:`ServedModels.poll` does that for every
model whose folder changed.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sensai.errors import SensaiError

from ..core import repository as repo_layout
from ..core.contract import Predictor
from ..core.errors import LoadFailed, ModelNotFound
from ..core.repository import VersionPolicy
from ..core.settings import GatewaySettings
from . import heap
from .metrics import GatewayMetrics
from .model_table import LOADING, READY, UNAVAILABLE, UNLOADING, ModelTable, ModelVersion

log = logging.getLogger(__name__)

SINGLE_VERSION = "1"
# Predictions a new version makes before it is routed to: the first calls of a runner pay for
# its lazy set-up, which should not land on a client.
WARMUP_PREDICTIONS = 3
# How long after an unload its memory is freed: long enough for the calls that retired it to
# return (their frames hold it), short next to how often models change.
LET_GO_AFTER_S = 0.1
# How long past its deadline a request may still hold a version being unloaded.
DRAIN_GRACE_S = 1.0

Loader = Callable[[str, Path], Predictor]  # (model name, artifact folder) -> predictor; blocks


@dataclass
class FailedVersion:
    """A version that failed to load, kept for the index until its files change."""

    stamp: str
    reason: str


class ServedModels(ModelTable):
    """The gateway's models and what changes them (see the module's docstring).

    ``loader`` builds a predictor for an artifact folder (needed to load anything); with
    ``repository`` set, :meth:`start` loads every model of it."""

    def __init__(self, settings: GatewaySettings, *, loader: Loader | None = None,
                 repository: str | Path | None = None, policy: VersionPolicy = VersionPolicy(),
                 metrics: GatewayMetrics | None = None):
        super().__init__(settings, metrics)
        self.loader = loader
        self.repository = Path(repository) if repository is not None else None
        self.policy = policy
        self.failures: dict[tuple[str, str], FailedVersion] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.loading: set[tuple[str, str]] = set()  # (name, version) being built or warmed
        self.letting_go: asyncio.Task | None = None  # see let_go_soon

    @classmethod
    def of(cls, predictor: Predictor, settings: GatewaySettings) -> "ServedModels":
        """One predictor served as version 1 of its name, as ``sensai serve ART`` does."""
        served = cls(settings)
        served.add(served.version_of(predictor.name, SINGLE_VERSION, predictor))
        return served

    def index(self, ready_only: bool = False) -> list[dict]:
        """Every model of the repository (or served) with each version's state, as the KServe
        repository extension's index."""
        rows = []
        names = {n for n, versions in self.models.items() if versions}
        if self.repository is not None and self.repository.is_dir():
            names |= set(repo_layout.model_names(self.repository))
        for name in sorted(names):
            versions = self.models.get(name, {})
            for v in sorted(versions, key=int):
                rows.append({"name": name, "version": v, "state": versions[v].state,
                             "reason": ""})
            for n, v in sorted(self.loading):
                if n == name and v not in versions:
                    rows.append({"name": name, "version": v, "state": LOADING, "reason": ""})
            for (n, v), f in sorted(self.failures.items()):
                if n == name and v not in versions and (n, v) not in self.loading:
                    rows.append({"name": name, "version": v, "state": UNAVAILABLE,
                                 "reason": f.reason})
            if not versions and not any(n == name for n, _ in [*self.failures, *self.loading]):
                rows.append({"name": name, "version": "", "state": UNAVAILABLE,
                             "reason": "unloaded"})
        return [r for r in rows if r["state"] == READY] if ready_only else rows

    # ---- lifecycle ----------------------------------------------------------------------------

    def lock(self, name: str) -> asyncio.Lock:
        return self.locks.setdefault(name, asyncio.Lock())

    async def start(self) -> None:
        """Load every model of the repository; a model that fails stops the start (one line).
        Each load settles the heap (:func:`heap.settle`); one artifact served as it is, built
        before, is settled here."""
        if self.repository is None:
            heap.settle()
            return
        for name in repo_layout.model_names(self.repository):
            try:
                await self.load(name)
            except SensaiError as e:
                said = str(e).startswith(f"model {name!r}")  # named already: not twice
                raise SensaiError(str(e) if said else f"model {name!r}: {e}") from None

    async def load(self, name: str) -> list[str]:
        """Bring model ``name`` to what its repository folder and version policy say: load the
        versions it picks that are not served (or whose files changed), then unload the others
        once drained.  Returns the versions now ready.  A version that fails raises
        :class:`LoadFailed` and leaves what was serving in place."""
        if self.repository is None or self.loader is None:
            raise SensaiError("this gateway serves one artifact, not a model repository")
        repo_layout.check_model_name(name)
        async with self.lock(name):
            found = repo_layout.versions(self.repository, name)
            if not found:
                raise ModelNotFound(f"model {name!r} has no version in {self.repository} "
                                    "(folders REPO/<name>/<number>/ holding an artifact)")
            policy = repo_layout.model_policy(self.repository, name, self.policy)
            wanted = {str(v): found[v] for v in policy.pick(found)}
            if not wanted:
                raise LoadFailed(f"version policy {policy} picks none of model {name!r}'s "
                                 f"versions ({', '.join(map(str, sorted(found)))})")
            served = self.models.get(name, {})
            errors = []
            for version, path in sorted(wanted.items(), key=lambda kv: int(kv[0])):
                current = served.get(version)
                stamp = repo_layout.stamp(path)
                if current is not None and current.state == READY and current.stamp == stamp:
                    continue
                try:
                    await self.load_version(name, version, path, stamp)
                except LoadFailed as e:
                    errors.append(str(e))
            ready = set(self.ready_versions(name))
            if errors and not ready & set(wanted):
                raise LoadFailed("; ".join(errors))  # nothing the policy wants loaded: keep all
            stale = [mv for v, mv in self.models.get(name, {}).items()
                     if v not in wanted and mv.state == READY]
            await asyncio.gather(*(self.retire(mv) for mv in stale))
            if errors:
                raise LoadFailed("; ".join(errors))
            return self.ready_versions(name)

    async def load_version(self, name: str, version: str, path: Path, stamp: str) -> None:
        key = (name, version)
        t0 = time.perf_counter()
        log.info("loading model %s version %s from %s", name, version, path)
        self.loading.add(key)
        try:
            try:
                predictor = await asyncio.to_thread(self.loader, name, path)
            except Exception as e:
                return self.fail(key, stamp, e)
            mv = self.version_of(name, version, predictor, stamp)
            try:
                await self.warm(mv)
            except Exception as e:
                await predictor.close()
                return self.fail(key, stamp, e)
        finally:
            self.loading.discard(key)
        self.failures.pop(key, None)
        old = self.models.get(name, {}).get(version)
        self.add(mv)  # routable from here on
        if old is not None:  # the same version number with new files: the old one drains
            await self.retire(old)
        heap.settle()
        log.info("model %s version %s ready in %.1f s", name, version, time.perf_counter() - t0)

    def fail(self, key: tuple[str, str], stamp: str, e: Exception) -> None:
        reason = str(e) if isinstance(e, SensaiError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, SensaiError):
            log.exception("model %s version %s failed to load", *key)
        self.failures[key] = FailedVersion(stamp, reason)
        raise LoadFailed(f"version {key[1]}: {reason}")

    async def warm(self, mv: ModelVersion) -> None:
        x = np.zeros((1, *mv.spec.input_shape), np.float32)
        for _ in range(WARMUP_PREDICTIONS):
            await mv.predictor.predict(x)

    async def unload(self, name: str) -> None:
        """Unload every version of ``name``; returns once the requests holding them are done."""
        async with self.lock(name):
            versions = self.models.get(name)
            if not versions:
                raise ModelNotFound(f"model {name!r} is not loaded")
            await asyncio.gather(*(self.retire(mv) for mv in list(versions.values())))

    async def retire(self, mv: ModelVersion) -> None:
        """Take ``mv`` out of routing now; close it once no request holds it."""
        mv.state = UNLOADING
        if self.current(mv):
            self.metrics.model_ready(mv.name, mv.version, False)
            self.pick_latest(mv.name)
        try:
            await asyncio.wait_for(mv.idle.wait(), self.settings.deadline_s + DRAIN_GRACE_S)
        except TimeoutError:
            log.warning("model %s version %s: %d requests still held it past their deadline",
                        mv.name, mv.version, mv.inflight)
        if self.current(mv):  # not replaced by new files under the same number meanwhile
            del self.models[mv.name][mv.version]
            self.metrics.forget_model(mv.name, mv.version)
        await mv.predictor.close()
        log.info("model %s version %s unloaded", mv.name, mv.version)
        self.let_go_soon()

    def let_go_soon(self) -> None:
        """Free what retired versions held, shortly: once the calls that let them go have
        returned and dropped them, the heap is settled (:func:`heap.settle`: it collects a version
        whose objects hold each other, which a frozen heap would keep for good) and the memory
        given back to the system.  One pending at a time: a swap retires several at once."""
        if self.letting_go is None or self.letting_go.done():
            self.letting_go = asyncio.create_task(self.let_go())

    async def let_go(self) -> None:
        await asyncio.sleep(LET_GO_AFTER_S)
        heap.settle()
        await asyncio.to_thread(give_back_memory)

    async def poll(self) -> None:
        """One look at the repository: (re)load each model whose versions or files changed,
        unload each model whose folder is gone.  Failures are logged and kept for the index."""
        assert self.repository is not None
        present = set(repo_layout.model_names(self.repository))
        for name in sorted(present | set(self.models)):
            try:
                if name not in present:
                    self.failures = {k: f for k, f in self.failures.items() if k[0] != name}
                    if self.models.get(name):
                        await self.unload(name)
                elif self.changed(name):
                    await self.load(name)
            except SensaiError as e:
                log.warning("model %s: %s", name, e)
            except OSError as e:  # files moved under the scan: the next look sees them settled
                log.warning("model %s: %s", name, e)

    def changed(self, name: str) -> bool:
        """Whether model ``name``'s folder asks for other versions or files than it serves (a
        version that failed counts as served until its files change)."""
        found = repo_layout.versions(self.repository, name)
        try:
            policy = repo_layout.model_policy(self.repository, name, self.policy)
        except SensaiError:
            return True  # load() says what is wrong
        want = {str(v): repo_layout.stamp(found[v]) for v in policy.pick(found)}
        have = {v: mv.stamp for v, mv in self.models.get(name, {}).items() if mv.state == READY}
        have |= {v: f.stamp for (n, v), f in self.failures.items() if n == name and v in want}
        return want != have

    async def poll_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.poll()
            except Exception:  # a repository that vanished for a moment must not end polling
                log.exception("polling the model repository %s failed", self.repository)

    async def close(self) -> None:
        """Close every version's predictor (the server is stopping: nothing drains)."""
        if self.letting_go is not None:
            self.letting_go.cancel()
        for versions in list(self.models.values()):
            for mv in list(versions.values()):
                await mv.predictor.close()
        self.models.clear()
        self.latest.clear()


def give_back_memory() -> None:
    """Return the freed memory of an unloaded predictor to the system: glibc keeps freed heap
    in its arenas otherwise, and the gateway's resident set would stay at its swap peak.
    (No gc.collect() here: from a thread it ran finalizers of native objects off their own
    threads.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim

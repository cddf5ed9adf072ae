"""Fault injection, for tests and the benchmark (off by default): a worker can be told to sleep
before each request (a delay distribution, :func:`parse_delay`) or to answer wrong outputs
(:func:`corrupt_output`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from sensai.errors import SensaiError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s)?\s*$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}


def _duration(text: str, spec: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise SensaiError(f"bad duration {text!r} in delay {spec!r} (e.g. 20ms, 0.5s)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class DelaySpec:
    """A delay distribution: ``fixed`` (a), ``exp`` (mean a), ``uniform`` (a..b), applied to a
    fraction ``prob`` of requests; or ``hang``: the worker gets stuck on its next request, as if
    a runner never returned (nothing but ending the worker frees it)."""

    kind: str
    a: float
    b: float = 0.0
    prob: float = 1.0
    text: str = ""

    @property
    def hangs(self) -> bool:
        return self.kind == "hang"

    def sample(self, rng: random.Random) -> float:
        if self.kind == "hang":
            return float("inf")
        if self.prob < 1.0 and rng.random() >= self.prob:
            return 0.0
        if self.kind == "fixed":
            return self.a
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return rng.uniform(self.a, self.b)

    def mean(self) -> float:
        if self.kind == "hang":
            return float("inf")
        base = {"fixed": self.a, "exp": self.a, "uniform": (self.a + self.b) / 2}[self.kind]
        return base * self.prob

    def __str__(self) -> str:
        return self.text


def parse_delay(text: str) -> DelaySpec:
    """``fixed:T`` (always T), ``exp:T`` (exponential, mean T), ``uniform:T1-T2``, each
    optionally ``@p`` (only a fraction p of requests is delayed); T is a number with ``us``,
    ``ms`` or ``s``, and a bare number is milliseconds.  ``hang``: stuck for good (tests of the
    hang watchdog)."""
    if not isinstance(text, str) or not text.strip():
        raise SensaiError("empty delay spec; use e.g. fixed:50ms, exp:20ms, uniform:10ms-80ms")
    spec = text.strip()
    if spec == "hang":
        return DelaySpec("hang", float("inf"), text=spec)
    body, _, prob_text = spec.partition("@")
    prob = 1.0
    if prob_text:
        try:
            prob = float(prob_text)
        except ValueError:
            prob = -1.0
        if not 0.0 < prob <= 1.0:
            raise SensaiError(f"bad probability {prob_text!r} in delay {spec!r} (0 < p <= 1)")
    kind, sep, arg = body.partition(":")
    kind = kind.strip().lower()
    if not sep:
        raise SensaiError(f"bad delay {spec!r}; use fixed:50ms, exp:20ms or uniform:10ms-80ms")
    if kind in ("fixed", "exp"):
        return DelaySpec(kind, _duration(arg, spec), prob=prob, text=spec)
    if kind == "uniform":
        lo, dash, hi = arg.partition("-")
        if not dash:
            raise SensaiError(f"uniform delay needs a range, e.g. uniform:10ms-80ms, got {spec!r}")
        a, b = _duration(lo, spec), _duration(hi, spec)
        if b < a:
            raise SensaiError(f"uniform delay {spec!r}: the upper bound is below the lower one")
        return DelaySpec(kind, a, b, prob=prob, text=spec)
    raise SensaiError(f"unknown delay distribution {kind!r} in {spec!r}; use fixed, exp or uniform")


@dataclass(frozen=True)
class Faults:
    """The faults injected into a predictor's workers: worker -> its delay, and the workers
    whose outputs are corrupted.  None by default."""

    delays: Mapping[int, DelaySpec] = field(default_factory=dict)
    corrupt: frozenset[int] = frozenset()

    @classmethod
    def of(cls, delays: Mapping[int, DelaySpec | str] | None = None,
           corrupt: Iterable[int] = ()) -> "Faults":
        """From delays given as :class:`DelaySpec` or as text (:func:`parse_delay`)."""
        return cls({int(w): parse_delay(d) if isinstance(d, str) else d
                    for w, d in (delays or {}).items()}, frozenset(int(w) for w in corrupt))

    def __bool__(self) -> bool:
        return bool(self.delays or self.corrupt)

    def check(self, workers: int) -> None:
        """Every worker named exists (there are ``workers``)."""
        for w in [*self.delays, *self.corrupt]:
            if not 0 <= w < workers:
                raise SensaiError(f"no worker {w}: workers are 0..{workers - 1}")


def corrupt_output(out: np.ndarray) -> np.ndarray:
    """What a worker told to misbehave answers: its logits negated and shifted (argmaxes flip)."""
    return (-3.0 * np.asarray(out, dtype=np.float32) + 1.0).astype(np.float32)

"""What the gateway serves: a :class:`Predictor` turns a normalized batch into N-way class scores.

The gateway knows nothing else about where the networks run.  Class parallelism is
:class:`sensai.serving.engine.predictor.ClassParallelPredictor`; the benchmark's baselines implement
the same protocol and are served by the same gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from sensai.spec import DatasetSpec


@dataclass
class Prediction:
    """Scores ``[B, N]`` (rows sum to 1) and where the time went.

    A *degraded* answer (only when the caller allowed partial answers) covers only
    ``covered_classes``: the other classes score 0 and are named in ``missing_classes``.
    ``answered_by`` says which worker's copy answered each subnet.
    """

    scores: np.ndarray
    timings_ms: dict[str, float] = field(default_factory=dict)
    degraded: bool = False
    covered_classes: list[int] | None = None
    missing_classes: list[str] | None = None
    answered_by: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Predictor(Protocol):
    spec: "DatasetSpec"
    name: str

    async def predict(self, x: np.ndarray, *, allow_partial: bool = False,
                      deadline: float | None = None) -> Prediction:
        """Scores for a normalized float32 batch ``[B, C, H, W]``.  Raises
        :class:`~sensai.serving.core.errors.ServingError` subclasses.  ``allow_partial``: a
        predictor that cannot answer some classes may answer for the others (``degraded``)
        instead of failing; predictors without that ability answer in full or fail.
        ``deadline``: when the request must be answered, in the running event loop's time
        (``loop.time()``); None: the settings' deadline from now."""
        ...

    def is_ready(self) -> bool:
        """Whether a request now would be answered in full (cheap; may be called often)."""
        ...

    def describe(self) -> dict: ...

    async def close(self) -> None: ...

"""The one rule that turns G subnets' outputs into N-way class scores.

Offline evaluation, the HTTP gateway and the benchmark all call :func:`merge_outputs`, so a
prediction cannot differ between them.

* All subnets single-class (binary heads, one logit each): stack the G logits and softmax across
  them - each logit says "how much this image is my class", and the softmax makes them compete.
* Groups (k+1 logits, index 0 = "not one of mine"): softmax within each subnet, drop column 0, put
  each remaining column at its class index.  The scores are then divided by their sum so a row reads
  as a distribution; that does not change the ranking.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def merge_outputs(outputs: Sequence[np.ndarray], groups: Sequence[Sequence[int]],
                  num_classes: int) -> np.ndarray:
    """``outputs[g]`` is subnet g's raw output ``[B, 1]`` (binary) or ``[B, k_g + 1]`` (group).

    Returns float32 scores ``[B, num_classes]`` whose rows sum to 1; top-1 is the argmax.
    """
    if len(outputs) != len(groups) or not groups:
        raise ValueError(f"{len(outputs)} subnet outputs for {len(groups)} groups")
    outs = [np.asarray(o, dtype=np.float64) for o in outputs]
    outs = [o[:, None] if o.ndim == 1 else o for o in outs]
    batch = outs[0].shape[0]
    if any(o.ndim != 2 or o.shape[0] != batch for o in outs):
        raise ValueError("every subnet output must be [batch, outputs] with the same batch size")
    binary = all(len(g) == 1 for g in groups) and all(o.shape[1] == 1 for o in outs)
    scores = np.zeros((batch, num_classes), dtype=np.float64)
    if binary:
        probs = _softmax(np.concatenate(outs, axis=1), axis=1)
        for j, g in enumerate(groups):
            scores[:, g[0]] = probs[:, j]
        return scores.astype(np.float32)
    for o, g in zip(outs, groups):
        if o.shape[1] != len(g) + 1:
            raise ValueError(f"a subnet for {len(g)} classes must give {len(g) + 1} outputs, "
                             f"got {o.shape[1]}")
        scores[:, list(g)] = _softmax(o, axis=1)[:, 1:]
    total = scores.sum(axis=1, keepdims=True)
    return (scores / np.where(total > 0, total, 1.0)).astype(np.float32)


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and scores of the k best classes per row, best first."""
    k = max(1, min(k, scores.shape[1]))
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(scores, idx, axis=1)

"""The one rule that turns G subnets' outputs into N-way class scores.

Offline evaluation, the HTTP gateway and the benchmark all merge through :class:`Merger`, so
they apply the same rule.  One image (a request) goes through :meth:`Merger.one`'s Python
arithmetic, a batch through numpy; their scores agree to float32 rounding, which
tests/test_merge.py checks on random layouts and outputs.

* All subnets single-class (binary heads, one logit each): stack the G logits and softmax across
  them - each logit says "how much this image is my class", and the softmax makes them compete.
* Groups (k+1 logits, index 0 = "not one of mine"): softmax within each subnet, drop column 0, put
  each remaining column at its class index.  The scores are then divided by their sum so a row reads
  as a distribution; that does not change the ranking.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import chain
from operator import itemgetter
from typing import Sequence

import numpy as np


class Merger:
    """The merge for one layout of subnet outputs, its index arrays computed once (it runs on
    every request).  ``widths[g]``: subnet g's outputs per image (1 for a binary head, k + 1 for
    a group of k)."""

    def __init__(self, groups: Sequence[Sequence[int]], widths: Sequence[int], num_classes: int):
        if len(widths) != len(groups) or not groups:
            raise ValueError(f"{len(widths)} subnet outputs for {len(groups)} groups")
        for k, (g, w) in enumerate(zip(groups, widths)):
            if w != len(g) + 1 and not (w == 1 and len(g) == 1):
                raise ValueError(f"a subnet for {len(g)} classes must give {len(g) + 1} "
                                 f"outputs, got {w}")
            if not g or min(g) < 0 or max(g) >= num_classes:
                raise ValueError(f"group {k} must name classes in 0..{num_classes - 1}")
        self.num_classes = int(num_classes)
        self.widths = tuple(int(w) for w in widths)
        self.classes = np.asarray([c for g in groups for c in g], dtype=np.intp)
        self.binary = all(w == 1 for w in widths) and all(len(g) == 1 for g in groups)
        self.starts = np.cumsum((0,) + self.widths[:-1]).astype(np.intp)
        self.segment = np.repeat(np.arange(len(self.widths), dtype=np.intp), self.widths)
        self.keep = np.asarray([i for s, w in zip(self.starts, self.widths)
                                for i in range(s + 1, s + w)], dtype=np.intp)
        # When the subnets cover every class (any full answer), the scores are one gather, no
        # zeroed array filled in: each class's column of the outputs (batches), and one call
        # that puts the kept columns in class order (one image, see :meth:`combine`).
        covers_all = len(self.classes) == self.num_classes and \
            np.array_equal(np.sort(self.classes), np.arange(self.num_classes))
        self.order = None
        if covers_all and not self.binary:
            self.order = np.empty(self.num_classes, dtype=np.intp)
            self.order[self.classes] = self.keep
        self.class_list = self.classes.tolist()
        self.gather = None
        if covers_all and self.num_classes > 1:  # itemgetter of one index returns no tuple
            self.gather = itemgetter(*np.argsort(self.classes).tolist())

    def __call__(self, outputs: Sequence[np.ndarray],
                 parts: Sequence[list[float] | None] | None = None) -> np.ndarray:
        """Scores ``[B, N]`` of the subnets' outputs, in this layout's order.  One image goes
        through :meth:`one`; ``parts``: the :meth:`part` of some of its outputs worked out
        already (None where not)."""
        if outputs[0].shape[0] == 1:
            return self.one(outputs, parts)
        # As few and as cheap numpy calls as the rule allows (take, not fancy indexing), and
        # this runs for every request.
        z = np.concatenate(outputs, axis=1, dtype=np.float64)
        if self.binary:  # the G logits compete in one softmax
            scores = np.zeros((z.shape[0], self.num_classes), dtype=np.float64)
            e = np.exp(z - z.max(axis=1, keepdims=True))
            scores[:, self.classes] = e / e.sum(axis=1, keepdims=True)
            return scores.astype(np.float32)
        # Softmax within each subnet's segment of columns, then drop each "not mine" column.
        e = np.exp(z - np.maximum.reduceat(z, self.starts, axis=1).take(self.segment, axis=1))
        p = e / np.add.reduceat(e, self.starts, axis=1).take(self.segment, axis=1)
        if self.order is not None:
            scores = p.take(self.order, axis=1)
        else:
            scores = np.zeros((z.shape[0], self.num_classes), dtype=np.float64)
            scores[:, self.classes] = p[:, self.keep]
        total = np.add.reduce(scores, axis=1, keepdims=True)
        return (scores / np.where(total > 0, total, 1.0)).astype(np.float32)

    def one(self, outputs: Sequence[np.ndarray],
            parts: Sequence[list[float] | None] | None = None) -> np.ndarray:
        """The same rule for one image, in float64 Python arithmetic: a request holds one image,
        and on one row a dozen numpy calls cost far more than their arithmetic.  The scores
        match the batch path's to float32 rounding (summation order and ``exp`` differ in the
        last bits of float64)."""
        if parts is None:
            return self.combine([self.part(o) for o in outputs])
        return self.combine([self.part(o) if p is None else p for o, p in zip(outputs, parts)])

    def part(self, output: np.ndarray) -> list[float]:
        """What one subnet's output ``[1, width]`` contributes on its own - its logit (binary
        heads), or the softmax over its segment without "not mine" - so a predictor can work it
        out as soon as that subnet answers, while the others still compute."""
        row = output.ravel().tolist()
        if self.binary:
            return row
        exp = math.exp
        m = max(row)
        e = [exp(v - m) for v in row]
        s = sum(e)
        return [v / s for v in e[1:]]

    def combine(self, parts: Sequence[list[float]]) -> np.ndarray:
        """Scores ``[1, N]`` from every group's :meth:`part`."""
        # C-level flattening and gathering rather than comprehensions: this runs right after the
        # event loop wakes, in a cold cache, where every interpreted loop costs.
        flat = list(chain.from_iterable(parts))  # each kept column, in ``classes`` order
        if self.binary:  # the G logits compete in one softmax
            exp = math.exp
            m = max(flat)
            e = [exp(v - m) for v in flat]
            s = sum(e)
            flat = [v / s for v in e]
        if self.gather is not None:
            scores = self.gather(flat)
        else:
            scores = [0.0] * self.num_classes
            for i, c in enumerate(self.class_list):
                scores[c] = flat[i]
        if self.binary:
            return np.array([scores], dtype=np.float32)
        total = sum(scores)
        total = total if total > 0 else 1.0
        return np.array([[v / total for v in scores]], dtype=np.float32)


@lru_cache(maxsize=256)
def merger(groups: tuple[tuple[int, ...], ...], widths: tuple[int, ...],
           num_classes: int) -> Merger:
    return Merger(groups, widths, num_classes)


def merge_outputs(outputs: Sequence[np.ndarray], groups: Sequence[Sequence[int]],
                  num_classes: int) -> np.ndarray:
    """``outputs[g]`` is subnet g's raw output ``[B, 1]`` (binary) or ``[B, k_g + 1]`` (group).

    Returns float32 scores ``[B, num_classes]`` whose rows sum to 1; top-1 is the argmax.
    ``groups`` may be a subset of the decomposition's groups (a partial answer): classes of the
    missing groups score 0.
    """
    if len(outputs) != len(groups) or not groups:
        raise ValueError(f"{len(outputs)} subnet outputs for {len(groups)} groups")
    outs = [o[:, None] if o.ndim == 1 else o for o in map(np.asarray, outputs)]
    batch = outs[0].shape[0]
    if any(o.ndim != 2 or o.shape[0] != batch for o in outs):
        raise ValueError("every subnet output must be [batch, outputs] with the same batch size")
    return merger(tuple(tuple(int(c) for c in g) for g in groups),
                  tuple(o.shape[1] for o in outs), int(num_classes))(outs)


def ranking(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best classes per row, best first (ties: the lower index first)."""
    k = max(1, min(k, scores.shape[1]))
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and scores of the k best classes per row, best first."""
    idx = ranking(scores, k)
    return idx, np.take_along_axis(scores, idx, axis=1)

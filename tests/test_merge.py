"""merge_outputs: the one rule turning subnet outputs into N-way scores, on known tensors."""

from __future__ import annotations

import numpy as np
import pytest

from sensai.merge import merge_outputs, top_k


def softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def test_binary_subnets_softmax_across_subnets():
    # Three single-class subnets, one logit each; class order is not subnet order.
    groups = [[2], [0], [1]]
    logits = np.array([[3.0, 0.0, -1.0], [-2.0, 1.0, 0.5]], dtype=np.float32)
    outputs = [logits[:, j:j + 1] for j in range(3)]
    scores = merge_outputs(outputs, groups, 3)
    want_by_subnet = softmax(logits.astype(np.float64), axis=1)
    want = np.zeros_like(want_by_subnet)
    for j, g in enumerate(groups):
        want[:, g[0]] = want_by_subnet[:, j]
    assert scores.dtype == np.float32 and scores.shape == (2, 3)
    np.testing.assert_allclose(scores, want, rtol=1e-6)
    np.testing.assert_allclose(scores.sum(1), 1.0, rtol=1e-6)
    assert list(scores.argmax(1)) == [2, 0]
    # 1-D outputs are read as one logit per image.
    np.testing.assert_allclose(merge_outputs([o[:, 0] for o in outputs], groups, 3), want, rtol=1e-6)


def test_grouped_subnets_softmax_within_drop_not_mine_and_place_by_class():
    groups = [[1, 3], [0, 2, 4]]
    a = np.array([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])          # [not mine, class 1, class 3]
    b = np.array([[1.0, 0.0, 0.5, -1.0], [-3.0, 0.0, 4.0, 1.0]])  # [not mine, class 0, 2, 4]
    scores = merge_outputs([a, b], groups, 5)
    pa, pb = softmax(a, 1), softmax(b, 1)
    raw = np.zeros((2, 5))
    raw[:, [1, 3]] = pa[:, 1:]
    raw[:, [0, 2, 4]] = pb[:, 1:]
    want = raw / raw.sum(1, keepdims=True)
    np.testing.assert_allclose(scores, want, rtol=1e-5)
    np.testing.assert_allclose(scores.sum(1), 1.0, rtol=1e-5)
    # Row 0: subnet a is confident about class 1; row 1: subnet a says "not mine", b says class 2.
    assert list(scores.argmax(1)) == [1, 2]


def test_group_of_one_class_inside_a_grouped_decomposition():
    # G=2 of 3 classes: one subnet has a single class but still a k+1 = 2 logit head.
    groups = [[0, 2], [1]]
    a = np.array([[0.0, 0.0, 3.0]])
    b = np.array([[2.0, -2.0]])
    scores = merge_outputs([a, b], groups, 3)
    assert scores.shape == (1, 3) and scores.argmax(1)[0] == 2
    assert scores[0, 1] < scores[0, 0] < scores[0, 2]


def test_top_k_orders_best_first():
    scores = np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], dtype=np.float32)
    idx, val = top_k(scores, 2)
    assert idx.tolist() == [[1, 2], [0, 2]]
    np.testing.assert_allclose(val, [[0.6, 0.3], [0.5, 0.3]])
    assert top_k(scores, 10)[0].shape == (2, 3)


def test_single_group_holding_every_class():
    out = np.array([[9.0, 1.0, 2.0], [0.0, 3.0, -1.0]])  # G=1: "not mine" never wins a class
    scores = merge_outputs([out], [[0, 1]], 2)
    np.testing.assert_allclose(scores.sum(1), 1.0, rtol=1e-6)
    assert list(scores.argmax(1)) == [1, 0]


@pytest.mark.parametrize("outputs, groups, n", [
    ([np.zeros((2, 4))], [[0, 1]], 2),                         # k=2 needs 3 outputs, not 4
    ([np.zeros((2, 2)), np.zeros((2, 2))], [[0, 1], [2]], 3),  # first subnet needs 3 outputs
    ([np.zeros((2, 1)), np.zeros((3, 1))], [[0], [1]], 2),     # batch sizes differ
    ([np.zeros((2, 1))], [[0], [1]], 2),                       # fewer outputs than groups
    ([np.zeros((2, 2, 1)), np.zeros((2, 2, 1))], [[0], [1]], 2),  # not [batch, outputs]
])
def test_mismatched_shapes_raise(outputs, groups, n):
    with pytest.raises(ValueError):
        merge_outputs(outputs, groups, n)

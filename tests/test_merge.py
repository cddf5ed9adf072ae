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


LAYOUTS = [  # (groups, num_classes): binary heads, groups, a group of one, a partial answer
    ([[2], [0], [1]], 3),
    ([[1, 3], [0, 2, 4]], 5),
    ([[0, 2], [1]], 3),
    ([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], 10),
    ([[3, 7], [0, 9, 4]], 10),  # some classes answered by no subnet
    ([[4], [1]], 6),
]


@pytest.mark.parametrize("groups, n", LAYOUTS)
def test_one_image_path_matches_the_batch_path(groups, n):
    """A request's single image goes through Merger.one (Python floats); a batch through numpy.
    Same rule: the scores agree to float32 rounding and rank the classes the same way."""
    rng = np.random.default_rng(len(groups) * 31 + n)
    widths = [1 if len(g) == 1 and all(len(h) == 1 for h in groups) else len(g) + 1
              for g in groups]
    batch = [(rng.standard_normal((400, w)) * rng.choice([0.1, 3.0, 40.0])).astype(np.float32)
             for w in widths]
    batch[0][:5] = 0.0  # exact ties inside a row
    together = merge_outputs(batch, groups, n)
    for i in range(len(together)):
        one = merge_outputs([o[i:i + 1] for o in batch], groups, n)
        assert one.dtype == np.float32 and one.shape == (1, n)
        np.testing.assert_allclose(one[0], together[i], rtol=2e-7, atol=1e-30)
        assert top_k(one, n)[0].tolist() == top_k(together[i:i + 1], n)[0].tolist()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_image_path_treats_non_finite_logits_as_the_batch_path(bad):
    """NaN and +inf give non-finite scores, which the gateway refuses (4xx); -inf is a
    probability of 0.  The one-image path must neither hide nor invent them."""
    a = np.array([[0.0, bad, 1.0]], dtype=np.float32)
    b = np.array([[1.0, 0.5]], dtype=np.float32)
    with np.errstate(invalid="ignore"):
        together = merge_outputs([np.repeat(a, 2, 0), np.repeat(b, 2, 0)], [[0, 2], [1]], 3)
    one = merge_outputs([a, b], [[0, 2], [1]], 3)
    assert np.isfinite(one).all() == np.isfinite(together[:1]).all() == (bad == -np.inf)
    if bad == -np.inf:
        np.testing.assert_allclose(one, together[:1], rtol=2e-7)

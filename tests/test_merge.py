"""merge_outputs: the one rule turning subnet outputs into N-way scores, on known tensors; and
its two implementations (numpy for batches, Python floats for one image) agreeing on random
layouts and outputs."""

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


def random_layout(rng) -> tuple[list[list[int]], list[int], int]:
    """A random decomposition's layout: (groups, widths, N) - binary heads or groups of k classes
    with k + 1 outputs (groups of one included), sometimes covering only some classes (a
    partial answer)."""
    n = int(rng.integers(1, 14))
    classes = rng.permutation(n)
    if n > 1 and rng.random() < 0.3:
        classes = classes[:int(rng.integers(1, n))]
    if rng.random() < 0.35:
        return [[int(c)] for c in classes], [1] * len(classes), n
    cuts = np.sort(rng.choice(np.arange(1, len(classes)), size=int(rng.integers(0, len(classes))),
                              replace=False)) if len(classes) > 1 else []
    groups = [[int(c) for c in part] for part in np.split(classes, cuts)]
    return groups, [len(g) + 1 for g in groups], n


def random_outputs(rng, widths: list[int], rows: int) -> list[np.ndarray]:
    """Logits at scales from flat to saturating, with exact ties: repeated columns, constant
    rows, and values rounded onto a coarse grid."""
    scale = rng.choice([1e-3, 0.3, 3.0, 40.0, 300.0])
    outs = [(rng.standard_normal((rows, w)) * scale).astype(np.float32) for w in widths]
    z = np.concatenate(outs, axis=1)
    if z.shape[1] > 1:
        z[:, rng.integers(0, z.shape[1])] = z[:, rng.integers(0, z.shape[1])]
    z[rng.random(rows) < 0.1] = rng.standard_normal()
    coarse = rng.random(rows) < 0.2
    z[coarse] = np.round(z[coarse])
    return np.split(z, np.cumsum(widths)[:-1], axis=1)


def the_rule(outputs: list[np.ndarray], groups: list[list[int]], n: int) -> np.ndarray:
    """The module docstring's rule, written as plainly as possible (float64)."""
    z = [o.astype(np.float64) for o in outputs]
    scores = np.zeros((len(z[0]), n))
    if all(o.shape[1] == 1 for o in z):
        scores[:, [g[0] for g in groups]] = softmax(np.concatenate(z, axis=1), axis=1)
        return scores
    for g, o in zip(groups, z):
        scores[:, g] = softmax(o, axis=1)[:, 1:]
    total = scores.sum(axis=1, keepdims=True)
    return scores / np.where(total > 0, total, 1.0)


def test_both_paths_are_the_rule_on_random_layouts_and_outputs():
    """Property: for any layout and any logits, the batch path is the rule, and Merger.one (per
    image, Python floats, what a request goes through) gives the batch path's float32 scores to
    within one rounding, with an order of classes the batch path's scores agree with."""
    rng = np.random.default_rng(2021)
    for case in range(300):
        groups, widths, n = random_layout(rng)
        outputs = random_outputs(rng, widths, rows=24)
        together = merge_outputs(outputs, groups, n)
        assert together.shape == (24, n) and together.dtype == np.float32
        np.testing.assert_allclose(together, the_rule(outputs, groups, n), rtol=1e-6,
                                   atol=1e-37, err_msg=f"case {case}: groups {groups}, N {n}")
        for i in range(24):
            one = merge_outputs([o[i:i + 1] for o in outputs], groups, n)
            where = f"case {case}: groups {groups}, N {n}, row {i}"
            np.testing.assert_allclose(one[0], together[i], rtol=2.4e-7, atol=1e-37,
                                       err_msg=where)
            # Best first by one path is best first by the other, up to that rounding.
            order = top_k(one, n)[0][0]
            ranked = together[i][order].astype(np.float64)
            assert (ranked[1:] <= ranked[:-1] * (1 + 4.8e-7) + 1e-37).all(), where

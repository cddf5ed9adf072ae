"""ONNX export of a pruned subnet: dynamic batch, atomic, onnxruntime == torch to 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def pruned_subnet(trained_model_dir, fmnist_spec):
    """A really trained fmnist_cnn, pruned to half its channels with a 3-class group head."""
    from sensai.checkpoint import build_from_weights, load_trained_model
    from sensai.pruning.prune import find_prunable, make_head, prune_model

    model, record = load_trained_model(trained_model_dir)
    example = torch.zeros(1, *fmnist_spec.input_shape)
    layers = find_prunable(model, example)
    rng = np.random.default_rng(0)
    keep = {layer.conv: np.sort(rng.choice(layer.channels, layer.channels // 2, replace=False))
            for layer in layers}
    sub = make_head(prune_model(model, keep, example), [1, 4, 7], binary=False, seed=0).eval()
    assert sum(p.numel() for p in sub.parameters()) < record.params / 3
    # The subnet must also survive the trip through its state dict (how artifacts store it).
    rebuilt = build_from_weights(record.model, 4, record.in_channels, sub.state_dict(), "test")
    return rebuilt


def real_batch(fmnist_test, fmnist_spec, n):
    from sensai.data import normalize

    return normalize(fmnist_test.images[:n], fmnist_spec)


def test_export_matches_torch_on_real_images_with_dynamic_batch(pruned_subnet, fmnist_spec,
                                                                fmnist_test, tmp_path):
    import onnx
    import onnxruntime as ort

    from sensai.export import INPUT_NAME, export_onnx

    path = tmp_path / "subnet.onnx"
    err = export_onnx(pruned_subnet, fmnist_spec.input_shape, path,
                      check_batch=real_batch(fmnist_test, fmnist_spec, 32))
    assert path.is_file() and err <= 1e-4
    onnx.checker.check_model(onnx.load(str(path)))
    assert [p.name for p in tmp_path.iterdir()] == ["subnet.onnx"]  # no temporary left behind

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 7, 64):  # batch sizes other than the one exported with
        x = real_batch(fmnist_test, fmnist_spec, n)
        got = session.run(None, {INPUT_NAME: x.numpy()})[0]
        with torch.no_grad():
            want = pruned_subnet(x).numpy()
        assert got.shape == (n, 4)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_check_onnx_rejects_a_file_that_computes_something_else(pruned_subnet, fmnist_spec,
                                                                 fmnist_test, tmp_path):
    import copy

    from sensai.errors import ExportError
    from sensai.export import check_onnx, export_onnx

    path = tmp_path / "subnet.onnx"
    batch = real_batch(fmnist_test, fmnist_spec, 16)
    export_onnx(pruned_subnet, fmnist_spec.input_shape, path, check_batch=batch)
    other = copy.deepcopy(pruned_subnet)
    with torch.no_grad():
        other.classifier.bias.add_(0.5)
    with pytest.raises(ExportError, match="differ"):
        check_onnx(path, other, batch)


def test_export_refuses_bad_shapes_and_leaves_no_file(pruned_subnet, tmp_path):
    from sensai.errors import ExportError
    from sensai.export import export_onnx

    with pytest.raises(ExportError):
        export_onnx(pruned_subnet, (1, 28), tmp_path / "a.onnx")
    with pytest.raises(ExportError):
        export_onnx(pruned_subnet, (1, 28, 28), tmp_path / "b.onnx",
                    check_batch=torch.zeros(2, 3, 28, 28))
    assert list(tmp_path.iterdir()) == []


def test_the_check_scales_with_the_outputs_size(tmp_path):
    """Logits in the thousands differ by float32 rounding alone far above 1e-4 between two
    correct runtimes: the check bounds the difference relative to the largest output, and still
    refuses a graph that computes something else at that size."""
    import copy

    from sensai.errors import ExportError
    from sensai.export import check_onnx, export_onnx

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 26 * 26, 10))
    with torch.no_grad():
        net[3].weight.mul_(3e3)
    batch = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "big.onnx"
    err = export_onnx(net, (1, 28, 28), path, check_batch=batch)
    with torch.no_grad():
        largest = float(net(batch).abs().max())
    assert largest > 1e3 and err <= 1e-4 * largest
    other = copy.deepcopy(net)
    with torch.no_grad():
        other[3].bias.add_(largest * 1e-3)
    with pytest.raises(ExportError, match="differ by .* x max\\(1, largest"):
        check_onnx(path, other, batch)

import pytest
import torch
from torch import nn

from sensai.errors import SensaiError, UnknownModelError
from sensai.models import (DEFAULT_MODEL, classifier_layer, count_params, create_model,
                           device_for_worker, list_models, select_device)


def test_registry_lists_the_promised_models():
    have = set(list_models())
    assert {DEFAULT_MODEL, "vgg11_bn", "vgg16_bn", "vgg19_bn", "resnet20", "resnet56", "resnet110",
            "resnet164", "resnet18", "mobilenet_v2"} <= have


@pytest.mark.parametrize("name", list_models())
@pytest.mark.parametrize("in_channels,size", [(1, 28), (3, 32)])
def test_forward_backward_on_cpu(name, in_channels, size):
    torch.manual_seed(0)
    model = create_model(name, num_classes=7, in_channels=in_channels)
    x = torch.randn(2, in_channels, size, size)
    out = model(x)
    assert out.shape == (2, 7)
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)


@pytest.mark.parametrize("name", list_models())
def test_every_activation_is_its_own_relu_module(name):
    """Pruning hooks need one nn.ReLU per activation site: a module called twice would mix channels."""
    model = create_model(name, num_classes=10, in_channels=1)
    calls: dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
             for n, m in model.named_modules() if isinstance(m, nn.ReLU)]
    model.eval()(torch.randn(1, 1, 28, 28))
    for h in hooks:
        h.remove()
    assert calls, "no nn.ReLU modules"
    assert max(calls.values()) == 1, {k: v for k, v in calls.items() if v > 1}
    assert not any(isinstance(m, nn.ReLU6) for m in model.modules())


def test_classifier_layer_is_the_output_head():
    model = create_model("vgg11_bn", 10, 3)
    name, head = classifier_layer(model)
    assert isinstance(head, nn.Linear) and head.out_features == 10 and name == "classifier"


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError) as e:
        create_model("vgg17", 10, 3)
    assert "vgg16_bn" in str(e.value) and "fmnist_cnn" in str(e.value)


def test_user_factory_path():
    model = create_model("tests.user_models:tiny_net", 4, 1, trust_code=True)
    assert model(torch.randn(1, 1, 28, 28)).shape == (1, 4)
    with pytest.raises(UnknownModelError, match="cannot import"):
        create_model("tests.user_models:nope", 4, 1, trust_code=True)
    with pytest.raises(UnknownModelError, match="--trust-model-code"):
        create_model("tests.user_models:tiny_net", 4, 1)  # importing runs code: consent first


def test_default_model_is_small():
    assert count_params(create_model(DEFAULT_MODEL, 10, 1)) < 300_000


def test_device_selection_on_this_machine():
    assert select_device("cpu").type == "cpu"
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device("auto").type == want
    if not torch.cuda.is_available():
        with pytest.raises(SensaiError, match="no CUDA"):
            select_device("cuda:0")
        assert device_for_worker(3) == "cpu"


def test_worker_devices_agree_with_torch():
    """``auto`` worker devices answered from the driver's files are the ones torch would pick,
    and a GPU torch sees is never hidden by that shortcut."""
    from sensai.models import gpu_possible

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert gpu_possible() or n == 0
    for i in range(5):
        assert device_for_worker(i) == (f"cuda:{i % n}" if n else "cpu")
        assert device_for_worker(i, "cpu") == "cpu"
    with pytest.raises(SensaiError, match="unknown device"):
        device_for_worker(0, "tpu")

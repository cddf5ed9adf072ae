"""The built-in architectures of the model registry (:mod:`sensai.models`).

Every factory takes ``num_classes`` and ``in_channels`` and returns a network whose activations are
separate ``nn.ReLU`` modules (never a functional relu, never one module reused twice), because the
pruning stage records per-channel activation statistics with forward hooks on those modules.
Importing this module registers them; :mod:`sensai.models` does so the first time a caller builds
or lists models, so what never builds a network never imports torch.
"""

from __future__ import annotations

from torch import nn

from .registry import register_model


def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True)]


# --------------------------------------------------------------------------------------------
# Small default CNN


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, widths=(32, 64, 128)):
        super().__init__()
        a, b, c = widths
        self.features = nn.Sequential(
            *_conv_bn_relu(in_channels, a), *_conv_bn_relu(a, a), nn.MaxPool2d(2, ceil_mode=True),
            *_conv_bn_relu(a, b), *_conv_bn_relu(b, b), nn.MaxPool2d(2, ceil_mode=True),
            *_conv_bn_relu(b, c), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


@register_model
def fmnist_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """Small 5-conv CNN with batch norm (0.14M params): the fastest to train and decompose."""
    return SmallCNN(num_classes, in_channels)


# --------------------------------------------------------------------------------------------
# CIFAR-style VGG with batch norm

_VGG_CFG = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, cfg, num_classes: int, in_channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for v in cfg:
            if v == "M":
                # ceil_mode keeps 28x28 inputs alive through five poolings (28-14-7-4-2-1).
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            else:
                layers += _conv_bn_relu(c, v)
                c = v
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def _vgg(depth: int):
    def factory(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
        return VGG(_VGG_CFG[depth], num_classes, in_channels)

    factory.__doc__ = f"CIFAR-style VGG-{depth} with batch norm (sensAI's VGG family)."
    return factory


register_model(_vgg(11), name="vgg11_bn")
register_model(_vgg(16), name="vgg16_bn")
register_model(_vgg(19), name="vgg19_bn")


# --------------------------------------------------------------------------------------------
# CIFAR ResNets (He et al. 2016): basic blocks for 20/56/110, pre-activation bottleneck for 164


class CifarBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class CifarBottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu3 = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, block, blocks_per_stage: int, num_classes: int, in_channels: int,
                 widths=(16, 32, 64)):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        expansion = getattr(block, "expansion", 1)
        c = widths[0]
        stages = []
        for i, w in enumerate(widths):
            layers = []
            for j in range(blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(block(c, w, stride))
                c = w * expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.flatten(self.pool(x)))


def _cifar_resnet(depth: int):
    bottleneck = depth == 164
    n = (depth - 2) // 9 if bottleneck else (depth - 2) // 6

    def factory(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
        block = CifarBottleneck if bottleneck else CifarBasicBlock
        return CifarResNet(block, n, num_classes, in_channels)

    kind = "bottleneck" if bottleneck else "basic"
    factory.__doc__ = f"CIFAR ResNet-{depth} ({kind} blocks, {n} per stage)."
    return factory


for _d in (20, 56, 110, 164):
    register_model(_cifar_resnet(_d), name=f"resnet{_d}")


# --------------------------------------------------------------------------------------------
# torchvision ResNet-18 and MobileNetV2, adapted to 28-32 px inputs (built by
# sensai.architectures_tv, imported on first use: torchvision's models take seconds to import)


@register_model
def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision ResNet-18, 3x3 stride-1 stem without max-pool for 28-32 px inputs."""
    from .architectures_tv import ResNet18Small

    return ResNet18Small(num_classes, in_channels)


@register_model
def mobilenet_v2(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision MobileNetV2 (width 1.0), stride-1 stem for 28-32 px inputs, ReLU activations."""
    from .architectures_tv import mobilenet_v2_small

    return mobilenet_v2_small(num_classes, in_channels)

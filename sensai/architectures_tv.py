"""torchvision's ResNet-18 and MobileNetV2, adapted to 28-32 px inputs, for the registry
(:mod:`sensai.architectures` registers them).  A module of their own because importing
torchvision's models takes seconds (it pulls in torch._dynamo): only a process that builds one of
these two pays for it."""

from __future__ import annotations

from torch import nn
from torchvision.models import mobilenet_v2 as tv_mobilenet_v2
from torchvision.models import resnet18 as tv_resnet18
from torchvision.models.resnet import BasicBlock


class SplitReluBasicBlock(BasicBlock):
    """torchvision's BasicBlock calls one ReLU module twice; give each call its own module.

    Parameter names are unchanged, so torchvision ResNet-18 weights still load (but conv1).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class ResNet18Small(nn.Module):
    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        net = tv_resnet18(num_classes=num_classes)
        # Small inputs: 3x3 stride-1 stem and no max-pool, as in the usual CIFAR adaptation.
        net.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        for stage in (net.layer1, net.layer2, net.layer3, net.layer4):
            for i, blk in enumerate(stage):
                new = SplitReluBasicBlock(blk.conv1.in_channels, blk.conv1.out_channels,
                                           stride=blk.stride, downsample=blk.downsample)
                new.load_state_dict(blk.state_dict())
                stage[i] = new
        self.net = net
        self.flatten = nn.Flatten()

    def forward(self, x):
        n = self.net
        x = n.relu(n.bn1(n.conv1(x)))
        x = n.layer4(n.layer3(n.layer2(n.layer1(x))))
        return n.fc(self.flatten(n.avgpool(x)))


def mobilenet_v2_small(num_classes: int, in_channels: int) -> nn.Module:
    """torchvision MobileNetV2 (width 1.0), stride-1 stem for 28-32 px inputs, ReLU activations."""
    net = tv_mobilenet_v2(num_classes=num_classes)
    first = net.features[0][0]
    net.features[0][0] = nn.Conv2d(in_channels, first.out_channels, 3, 1, 1, bias=False)
    # ReLU instead of ReLU6 so every activation is an nn.ReLU the pruning hooks understand.
    for parent in net.modules():
        for cname, child in parent.named_children():
            if isinstance(child, nn.ReLU6):
                setattr(parent, cname, nn.ReLU(inplace=True))
    return net

"""ResNet-18 (BasicBlock) and ResNet-50 (Bottleneck) with BatchNorm and skip connections."""

from __future__ import annotations

from torch import Tensor, nn

# Below this image side the ImageNet stem (7x7/2 conv + max-pool) is replaced by a 3x3/1 conv.
SMALL_IMAGE_SIZE = 64
STAGE_STRIDES = (1, 2, 2, 2)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; output = relu(block(x) + shortcut(x))."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4); output = relu(block(x) + shortcut(x))."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)
        self.relu3 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.shortcut(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Identity, or a strided 1x1 conv + BN when the shape changes."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class ResNet(nn.Module):
    """Stem, four stages of residual blocks, global average pool, Linear classifier."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        blocks_per_stage: tuple[int, int, int, int],
        width: int,
        image_size: int,
        num_classes: int,
        in_channels: int,
    ) -> None:
        super().__init__()
        if image_size >= SMALL_IMAGE_SIZE:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
            )
        stages: list[nn.Module] = []
        channels_in = width
        for stage_id, (num_blocks, stride) in enumerate(zip(blocks_per_stage, STAGE_STRIDES)):
            channels = width * 2**stage_id
            blocks: list[nn.Module] = []
            for block_id in range(num_blocks):
                blocks.append(block(channels_in, channels, stride if block_id == 0 else 1))
                channels_in = channels * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels_in, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.pool(x)))


def resnet18(width: int = 64, image_size: int = 224, num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet-18: BasicBlocks [2,2,2,2], base width `width`; small images get a 3x3 stem."""
    return ResNet(BasicBlock, (2, 2, 2, 2), width, image_size, num_classes, in_channels)


def resnet50(width: int = 64, image_size: int = 224, num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet-50: Bottlenecks [3,4,6,3], base width `width`; small images get a 3x3 stem."""
    return ResNet(Bottleneck, (3, 4, 6, 3), width, image_size, num_classes, in_channels)

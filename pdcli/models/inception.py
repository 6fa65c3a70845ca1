"""A small Inception network: blocks of four parallel branches concatenated along the channels.

Its graph branches inside every block, so a cut between two branches carries several tensors
at once (the block's input, still owed to the later branches, beside the finished branches'
outputs): the model that exercises multi-tensor stage boundaries end to end.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# Below this image side the stem is one 3x3/1 conv; from it on, a 7x7/2 conv and a 3x3/2 max-pool.
SMALL_IMAGE_SIZE = 64


class ConvBN(nn.Sequential):
    """Conv (no bias), BatchNorm, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        )


class InceptionBlock(nn.Module):
    """Four branches on the same input, concatenated: 1x1; 1x1 then 3x3; 1x1 then two 3x3
    (a factorized 5x5) and 3x3 average pool then 1x1, as Inception-v3. Output: 4 x `branch_channels`."""

    def __init__(self, in_channels: int, branch_channels: int) -> None:
        super().__init__()
        reduced = max(branch_channels // 2, 1)
        self.branch1x1 = ConvBN(in_channels, branch_channels, 1)
        self.branch3x3 = nn.Sequential(ConvBN(in_channels, reduced, 1), ConvBN(reduced, branch_channels, 3))
        self.branch5x5 = nn.Sequential(
            ConvBN(in_channels, reduced, 1), ConvBN(reduced, branch_channels, 3), ConvBN(branch_channels, branch_channels, 3)
        )
        self.branch_pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), ConvBN(in_channels, branch_channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        branches = [self.branch1x1(x), self.branch3x3(x), self.branch5x5(x), self.branch_pool(x)]
        return torch.cat(branches, dim=1)


class Inception(nn.Module):
    """Stem, `num_blocks` Inception blocks (a 2x2 max-pool halves the image after the first
    half of them, where the branches widen from width/2 to width), global average pool,
    Linear classifier."""

    def __init__(self, width: int, num_blocks: int, image_size: int, num_classes: int, in_channels: int) -> None:
        super().__init__()
        if image_size >= SMALL_IMAGE_SIZE:
            self.stem = nn.Sequential(ConvBN(in_channels, width, 7, stride=2), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            self.stem = nn.Sequential(ConvBN(in_channels, width, 3))
        blocks: list[nn.Module] = []
        channels = width
        for block_id in range(num_blocks):
            if block_id == num_blocks // 2:
                blocks.append(nn.MaxPool2d(2))
            branch_channels = max(width // 2, 1) if block_id < num_blocks // 2 else width
            blocks.append(InceptionBlock(channels, branch_channels))
            channels = 4 * branch_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        return self.fc(self.flatten(self.pool(self.blocks(self.stem(images)))))


def inception(
    width: int = 32, num_blocks: int = 4, image_size: int = 224, num_classes: int = 1000, in_channels: int = 3
) -> Inception:
    """Inception-style net: `num_blocks` four-branch blocks (1x1, 3x3, two 3x3, pool) joined by concatenation."""
    if width < 1 or num_blocks < 1:
        raise ValueError(f"inception needs width >= 1 and num_blocks >= 1, got width={width}, num_blocks={num_blocks}")
    if image_size < 2:
        raise ValueError(f"inception image_size must be at least 2 (one 2x2 max-pool), got {image_size}")
    return Inception(width, num_blocks, image_size, num_classes, in_channels)

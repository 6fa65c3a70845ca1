"""VGG-16: 13 3x3 convolutions in 5 pooled stages, then 3 fully connected layers."""

from __future__ import annotations

from torch import Tensor, nn

from pdcli.models.init import init_relu_net

# Output channels of the 13 convolutions at width 1.0; "M" is a 2x2 max-pool.
VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)
NUM_POOLS = 5


class VGG(nn.Module):
    """Convolutional features, flatten, classifier (Linear-ReLU-Linear-ReLU-Linear)."""

    def __init__(self, features: nn.Sequential, classifier: nn.Sequential) -> None:
        super().__init__()
        self.features = features
        self.flatten = nn.Flatten()
        self.classifier = classifier
        init_relu_net(self)

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.flatten(self.features(images)))


def vgg16(
    width: float = 1.0,
    image_size: int = 224,
    num_classes: int = 1000,
    in_channels: int = 3,
    fc_hidden: int = 4096,
    batch_norm: bool = False,
    dropout: float = 0.0,
) -> VGG:
    """VGG-16 (13 conv + 3 fc); channels scaled by `width`, image side a multiple of 32."""
    if image_size % 2**NUM_POOLS:
        raise ValueError(f"vgg16 image_size must be a multiple of 32, got {image_size}")
    layers: list[nn.Module] = []
    channels = in_channels
    for item in VGG16_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        out_channels = max(1, int(round(int(item) * width)))
        layers.append(nn.Conv2d(channels, out_channels, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out_channels))
        layers.append(nn.ReLU())
        channels = out_channels
    side = image_size // 2**NUM_POOLS
    head: list[nn.Module] = [nn.Linear(channels * side * side, fc_hidden), nn.ReLU()]
    if dropout > 0:
        head.append(nn.Dropout(dropout))
    head += [nn.Linear(fc_hidden, fc_hidden), nn.ReLU()]
    if dropout > 0:
        head.append(nn.Dropout(dropout))
    head.append(nn.Linear(fc_hidden, num_classes))
    return VGG(nn.Sequential(*layers), nn.Sequential(*head))

"""AlexNet: 5 convolutions with 3 max-pools, then 3 fully connected layers."""

from __future__ import annotations

from torch import nn

from pdcli.models.vgg import VGG

# Below this image side the 11x11/stride-4 stem would shrink the image to nothing.
SMALL_IMAGE_SIZE = 64


def _conv_out(side: int, kernel: int, stride: int, padding: int) -> int:
    return (side + 2 * padding - kernel) // stride + 1


class AlexNet(VGG):
    """VGG's frame (features, flatten, classifier, the same init) around AlexNet's layers; its
    own class so that profiles and traces name the model AlexNet."""


def alexnet(
    width: float = 1.0,
    image_size: int = 224,
    num_classes: int = 1000,
    in_channels: int = 3,
    fc_hidden: int = 4096,
    dropout: float = 0.0,
) -> AlexNet:
    """AlexNet (5 conv + 3 fc); images under 64 px get a 3x3/stride-1 stem instead of 11x11/4."""

    def ch(n: int) -> int:
        return max(1, int(round(n * width)))

    if image_size >= SMALL_IMAGE_SIZE:
        stem = (11, 4, 2)
    else:
        stem = (3, 1, 1)
    side = _conv_out(image_size, *stem)
    side = _conv_out(side, 3, 2, 0)  # pool
    side = _conv_out(side, 3, 2, 0)  # pool
    side = _conv_out(side, 3, 2, 0)  # pool
    if side < 1:
        raise ValueError(f"alexnet image_size {image_size} is too small (features vanish)")
    c1, c2, c3, c4, c5 = ch(64), ch(192), ch(384), ch(256), ch(256)
    features = nn.Sequential(
        nn.Conv2d(in_channels, c1, kernel_size=stem[0], stride=stem[1], padding=stem[2]),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(c1, c2, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(c2, c3, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c3, c4, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c4, c5, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
    )
    head: list[nn.Module] = []
    if dropout > 0:
        head.append(nn.Dropout(dropout))
    head += [nn.Linear(c5 * side * side, fc_hidden), nn.ReLU()]
    if dropout > 0:
        head.append(nn.Dropout(dropout))
    head += [nn.Linear(fc_hidden, fc_hidden), nn.ReLU(), nn.Linear(fc_hidden, num_classes)]
    return AlexNet(features, nn.Sequential(*head))

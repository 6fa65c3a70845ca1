"""Weight init for plain ReLU nets (no BatchNorm), so a deep VGG/AlexNet starts to learn."""

from __future__ import annotations

from torch import nn

CLASSIFIER_INIT_STD = 0.01


def init_relu_net(model: nn.Module) -> None:
    """He (fan-in) normal init for every conv and hidden linear layer, zero biases.

    The last linear layer (the classifier) starts small (std 0.01), so the first
    logits are near zero and the first loss near log(num_classes).

    PyTorch's default init shrinks the signal by about sqrt(3) per ReLU layer; after the
    13 convolutions of VGG-16 the logits barely depend on the input and SGD stalls.
    """
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for layer in layers:
        nn.init.kaiming_normal_(layer.weight, mode="fan_in", nonlinearity="relu")
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)
    if layers and isinstance(layers[-1], nn.Linear):
        nn.init.normal_(layers[-1].weight, std=CLASSIFIER_INIT_STD)

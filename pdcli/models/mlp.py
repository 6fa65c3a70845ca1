"""A deep multi-layer perceptron: the smallest model worth pipelining."""

from __future__ import annotations

from torch import nn

from pdcli.models.init import init_relu_net


def mlp(
    in_features: int = 64, hidden: int = 128, num_layers: int = 8, num_classes: int = 10
) -> nn.Sequential:
    """MLP: flatten, `num_layers` Linear+ReLU layers of width `hidden`, a Linear classifier."""
    if num_layers < 1:
        raise ValueError(f"mlp needs num_layers >= 1, got {num_layers}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(num_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    model = nn.Sequential(*layers)
    init_relu_net(model)  # PyTorch's default init starves a deep ReLU stack: loss stays at log(10)
    return model

"""The demo's models. Each is a class, and a file in configs/model/ that names it with `_target_`.

A model's settings are its constructor's type-annotated parameters: `model.dropout=abc` or a
misspelt `model.hiden_sizes` is refused before the run starts (components.py). `input_shape` and
`num_classes` come from the data, to a constructor that asks for them.

Build the whole model in the constructor, any new head or frozen layer included: the runner moves
the model to the device right after building it, and a submodule created after that move would
stay on the CPU (the placement audit would stop the run and name it).
"""

import math

from torch import nn


class MLP(nn.Module):
    """Flattens each sample and passes it through `hidden_sizes` ReLU layers."""

    def __init__(self, input_shape: list[int], num_classes: int, hidden_sizes: list[int], dropout: float = 0.0) -> None:
        super().__init__()
        if any(size < 1 for size in hidden_sizes):
            raise ValueError(f"hidden_sizes={hidden_sizes} must hold sizes of at least 1")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden_sizes:
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(dropout)]
            width = size
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, inputs):
        return self.head(self.body(inputs))


class CNN(nn.Module):
    """3x3 convolutions over images shaped (channels, height, width), each block halving the height
    and width, then a linear head. `trainer.channels_last=true` lays its activations out NHWC."""

    def __init__(self, input_shape: list[int], num_classes: int, channels: list[int], dropout: float = 0.0) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"needs images shaped (channels, height, width); the data gives {tuple(input_shape)}")
        width, height = input_shape[2] >> len(channels), input_shape[1] >> len(channels)
        if min(width, height) < 1 or any(size < 1 for size in channels):
            raise ValueError(
                f"channels={channels} gives {len(channels)} blocks that each halve the {tuple(input_shape[1:])} "
                f"images, which leaves nothing; use fewer blocks, each of at least 1 channel"
            )
        layers: list[nn.Module] = []
        depth = input_shape[0]
        for size in channels:
            layers += [nn.Conv2d(depth, size, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            depth = size
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(depth * height * width, num_classes))

    def forward(self, inputs):
        return self.head(self.body(inputs))

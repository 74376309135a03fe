"""The demo model. Replace or extend `build_model`; keep every structural change inside it.

The runner moves the model to the device right after `build_model` returns. A submodule created
after that move (a new classifier head for fine-tuning, say) would stay on the CPU; the
placement audit would then stop the run and name it.
"""

from torch import nn

from .config import ModelConfig
from .errors import RunError


class MLP(nn.Module):
    def __init__(self, num_features: int, hidden_sizes: list[int], num_classes: int, dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for size in hidden_sizes:
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(dropout)]
            width = size
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, inputs):
        return self.head(self.body(inputs))


def build_model(cfg: ModelConfig, num_features: int, num_classes: int) -> nn.Module:
    if cfg.name != "mlp":
        raise RunError(f"model.name={cfg.name!r} has no builder; add one in model.py (see the README)")
    return MLP(num_features, list(cfg.hidden_sizes), num_classes, cfg.dropout)

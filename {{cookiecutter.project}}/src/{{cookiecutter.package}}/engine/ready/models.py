"""The ready models. Each is a class, and a file in configs/model/ that names it with `_target_`.

A model's settings are its constructor's type-annotated parameters: `model.dropout=abc` or a
misspelt `model.hiden_sizes` is refused before the run starts (components.py). The data's facts
(`input_shape` and `num_classes` of the digits, `vocab_size` and `block_size` of a text, and
`num_classes` and `pad` of labelled texts) come from the data, to a constructor that asks for them
by name.

Build the whole model in the constructor, any new head or frozen layer included: the runner moves
the model to the device right after building it, and a submodule created after that move would
stay on the CPU (the placement audit would stop the run and name it).
"""

import math

import torch
from torch import nn
from torch.nn import functional


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


class GPT(nn.Module):
    """A small GPT-style language model: token and position embeddings, `depth` transformer blocks
    of causal self-attention, and a head that gives the logits of the next token at each position,
    shaped (batch, sequence, vocab_size). Under strategy=fsdp, `strategy.blocks=[Block]` shards
    each block as a unit.

    Given `num_classes` (a classification data's fact, as the digits give it to MLP), the same body
    is a classifier: its `features` are pooled over each text's tokens (`pooling`: their `mean`, or
    the `last` token's, which have seen the whole text through the causal attention), and the head
    maps them to logits shaped (batch, num_classes). Every other weight keeps its name, so a
    language model's checkpoint loads into the classifier with `init.ignore=[head.*]`. Texts
    shorter than the block end in `pad` tokens (a data's fact), which the pooling leaves out; the
    causal attention keeps them from the features of the tokens before them."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        dropout: float = 0.0,
        num_classes: int | None = None,
        pooling: str = "mean",
        pad: int | None = None,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling} is none of {', '.join(POOLINGS)}")
        self.pooling, self.pad = pooling, pad
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.classifies = num_classes is not None
        self.head = nn.Linear(width, num_classes) if self.classifies else nn.Linear(width, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        features = self.features(tokens)
        return self.head(self.pool(features, tokens) if self.classifies else features)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """The body's output at each position, normed: (batch, sequence, width)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.norm(self.blocks(self.tokens(tokens) + self.positions(positions)))

    def pool(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One vector per text, (batch, width), from the features of its tokens, padding left out."""
        real = tokens != self.pad if self.pad is not None else torch.ones_like(tokens, dtype=torch.bool)
        if self.pooling == "mean":
            weights = real.unsqueeze(-1).to(features.dtype)
            return (features * weights).sum(1) / weights.sum(1).clamp(min=1)
        last = real.sum(1).clamp(min=1) - 1  # a text's tokens come first, its padding after them
        return features[torch.arange(len(features), device=features.device), last]


POOLINGS = ("mean", "last")


class Block(nn.Module):
    """Pre-norm causal self-attention, then a two-layer MLP, each added to its input."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (batch, heads, length, width per head) each, as scaled_dot_product_attention takes them
        query, key, value = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        attended = functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True)
        return self.projection(attended.transpose(1, 2).reshape(batch, length, width))

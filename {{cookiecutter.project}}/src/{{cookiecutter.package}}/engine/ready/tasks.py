"""The task: what a batch holds for the model, and how the model's outputs become the loss and
the metrics' inputs. It is the one place where the recipe meets the structure of a batch, so that
classification, a regression over dict batches or a language model is a `task` option (a class
that configs/task/ names with `_target_`), never an edit of the recipe.

The recipe moves each batch to the device whole (a tuple or a dict of tensors, nested as the
loader collates the samples) and then, in training and validation alike:

    inputs, targets = task.split(batch)
    outputs = model(inputs)
    loss, count = task.loss(criterion, outputs, targets)  # a mean over `count` units
    metric.update(outputs, targets)                       # for each metric, in validation

`count` is what the loss averages over (samples, or tokens): validation weights each batch's loss
by it, so `val/loss` is the mean per unit whatever the batches hold, and throughput is logged in
the task's `unit` (`train/samples_per_s`, `train/tokens_per_s`). A task whose model computes its
own loss, or needs several inputs, is a small subclass of `Supervised` (docs/your-code.md).
"""

from typing import Any

import torch
from torch import nn


class Supervised:
    """A batch holds the model's inputs under the key (or position) `inputs` and the targets under
    `targets`: a pair `(inputs, targets)` by default, or a dict such as `{"x": ..., "y": ...}`
    with `task.inputs=x task.targets=y`. The loss compares the model's outputs with the targets
    and is the mean over the batch's samples. Classification and regression alike."""

    unit = "samples"

    def __init__(self, inputs: int | str = 0, targets: int | str = 1) -> None:
        self.inputs, self.targets = inputs, targets

    def split(self, batch: Any) -> tuple[Any, Any]:
        """The model's inputs and the targets of one batch."""
        return batch[self.inputs], batch[self.targets]

    def loss(self, criterion: nn.Module, outputs: Any, targets: Any) -> tuple[torch.Tensor, int | torch.Tensor]:
        """The loss of one batch, and the number of units it is the mean over."""
        return criterion(outputs, targets), len(targets)


class NextToken(Supervised):
    """A language model: `inputs` are token ids shaped (batch, sequence), the model's outputs are
    logits shaped (batch, sequence, vocabulary), and `targets` the next token at each position.
    The loss is the criterion over every position (cross-entropy expects the vocabulary as its
    second dimension, so positions are laid out as rows), the mean per token; positions whose
    target is the criterion's `ignore_index` (padding) count for nothing. Metrics see the outputs
    and targets as the model gave them (the ready Perplexity, like torchmetrics', takes exactly those)."""

    unit = "tokens"

    def loss(self, criterion: nn.Module, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        loss = criterion(outputs.flatten(0, -2), targets.flatten())
        ignored = getattr(criterion, "ignore_index", None)
        return loss, targets.numel() if ignored is None else (targets != ignored).sum()

"""Learning-rate schedules, the components of the `scheduler` group: each a function of the
optimizer and its settings, returning a schedule that is a pure function of the step, so that a
resume recomputes it (the engine's param_groups.py keeps the configured hyperparameters on restore).

Optimizers need no code here: configs/optimizer/ names torch's own with `_target_`, and the run
gives them the model's parameters once they are on the device.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def constant(optimizer: torch.optim.Optimizer, warmup_steps: int = 0) -> LambdaLR:
    """`optimizer.lr` throughout, after a linear warm-up."""
    return _schedule(optimizer, warmup_steps, lambda progress: 1.0)


def cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """A linear warm-up, then a cosine decay to `min_lr_ratio` of `optimizer.lr` at `total_steps`,
    and that floor after it."""
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be from 0 to 1")
    if total_steps < 0:
        raise ValueError(f"total_steps={total_steps} must not be negative")
    span = max(total_steps - warmup_steps, 1)
    return _schedule(
        optimizer,
        warmup_steps,
        lambda after: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(after / span, 1.0))),
    )


def _schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, decay) -> LambdaLR:
    """A multiplier of the lr that is a pure function of the step, so a resume recomputes it."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must not be negative")
    return LambdaLR(
        optimizer, lambda step: (step + 1) / warmup_steps if step < warmup_steps else decay(step - warmup_steps)
    )

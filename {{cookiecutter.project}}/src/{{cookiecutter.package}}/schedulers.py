"""Learning-rate schedules, the components of the `scheduler` group, and how a restore keeps the
configured hyperparameters: the config decides hyperparameters, the checkpoint carries state.

Optimizers need no code here: configs/optimizer/ names torch's own with `_target_`, and the run
gives them the model's parameters once they are on the device.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from .param_groups import MULTIPLIER


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


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The configured hyperparameters of each param group, taken before a restore replaces them."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def keep_configured(optimizer: torch.optim.Optimizer, scheduler: LRScheduler, configured: list[dict]) -> None:
    """After a restore: this run's hyperparameters again, and the lr of this run's schedule at the
    restored step.

    `Optimizer.load_state_dict` brings back the saved lr, weight decay and flags: without this, a
    changed `optimizer.lr` on resume would be reported but silently ignored. A schedule that is not
    a function of the step (not a LambdaLR) keeps the restored lr.
    """
    for group, wanted in zip(optimizer.param_groups, configured, strict=True):
        if not isinstance(scheduler, LambdaLR) and group.get(MULTIPLIER, 1.0) != wanted.get(MULTIPLIER, 1.0):
            group["lr"] *= wanted[MULTIPLIER] / group[MULTIPLIER]  # a new multiple of a restored lr
        group.update({key: value for key, value in wanted.items() if key != "lr"})
    if not isinstance(scheduler, LambdaLR):
        return
    scheduler.base_lrs = [wanted["initial_lr"] for wanted in configured]
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base_lr * factor(scheduler.last_epoch)

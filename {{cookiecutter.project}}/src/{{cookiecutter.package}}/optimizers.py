"""Optimizer and learning-rate schedule, built from config on parameters that are already on
their device, and restored so that the config decides hyperparameters and the checkpoint
carries state."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from .config import OptimizerConfig, SchedulerConfig
from .errors import RunError


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "adamw":
        betas = tuple(cfg.betas or (0.9, 0.999))
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=betas, fused=cfg.fused)
    if cfg.name == "sgd":
        momentum = cfg.momentum or 0.0
        return torch.optim.SGD(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=momentum, nesterov=cfg.nesterov and momentum > 0
        )
    raise RunError(f"optimizer.name={cfg.name!r} has no builder; use optimizer=adamw or optimizer=sgd")


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LambdaLR:
    """A multiplier of `optimizer.lr` that is a pure function of the step: linear warm-up, then
    constant or a cosine decay to `min_lr_ratio` at `total_steps`, and that floor after it."""
    if cfg.name not in ("constant", "cosine"):
        raise RunError(f"scheduler.name={cfg.name!r} has no builder; use scheduler=constant or scheduler=cosine")
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.name == "constant":
            return 1.0
        progress = min((step - warmup) / max(cfg.total_steps - warmup, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def restore_optimization(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, saved: dict) -> None:
    """Loads optimizer and scheduler state, then re-applies this run's hyperparameters.

    `Optimizer.load_state_dict` would otherwise bring back the saved lr, weight decay and flags,
    and a changed `optimizer.lr` on resume would be reported but silently ignored. It also casts
    the saved state to the device of the parameters *now*, which is why this runs after the move.
    """
    configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    scheduler.base_lrs = [group["initial_lr"] for group in configured]
    schedule = zip(optimizer.param_groups, configured, scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    for group, wanted, base_lr, factor in schedule:
        group.update({key: value for key, value in wanted.items() if key != "lr"})
        group["lr"] = base_lr * factor(scheduler.last_epoch)

"""Which parameters train, and at which multiple of the learning rate: `init.freeze` and
`optimizer.lr_multipliers`, applied to the model's parameters by name (fnmatch globs, in which `*`
also crosses dots: `body.*` is every parameter under `body`).

A frozen parameter gets `requires_grad=False` and stays out of the optimizer, so it holds no
optimizer state. Each glob of `lr_multipliers` makes a parameter group, named after the glob, at
that multiple of `optimizer.lr`; the schedule scales every group alike, and each group's lr is
logged as `train/lr/<group>`, beside `train/lr`, the configured lr as the schedule sets it. The
groups are made from the config at every start, a resume included, so that the restored optimizer
state meets the same groups. After the first step, every parameter that trains must be in the
optimizer: one built later (in a model's `forward`) stops the run. A restore keeps the configured
hyperparameters: the config decides them, the checkpoint carries state (`keep_configured`).
"""

import fnmatch
import math
import re

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from . import components
from .errors import RunError, listed

MULTIPLIER = "lr_multiplier"  # kept in each param group, and so in its state_dict
NAME = "name"


def matching(names: list[str], glob: str) -> list[str]:
    return [name for name in names if fnmatch.fnmatchcase(name, glob)]


def freeze(model: nn.Module, globs: list[str]) -> None:
    """Stops the parameters that `globs` match from training. A glob that matches none is refused:
    a misspelt one would leave the layers it meant training."""
    names = [name for name, _ in model.named_parameters()]
    frozen = set()
    for glob in globs:
        if not (found := matching(names, glob)):
            raise RunError(
                f"init.freeze: {glob} matches no parameter of the model (it has {listed(names)}); fix the glob"
            )
        frozen.update(found)
    for name, parameter in model.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer `cfg` (the optimizer group) names, over the model's parameters that train:
    one group per glob of `cfg.lr_multipliers` (the first glob that matches a parameter takes it),
    at its multiple of the configured lr, then the rest at the configured lr."""
    given = cfg.get("lr_multipliers")
    multipliers = OmegaConf.to_container(given) if isinstance(given, DictConfig) else {}
    training = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    names = [name for name, _ in training]
    taken: dict[str, str] = {}  # parameter name -> the glob that took it
    for glob, multiplier in multipliers.items():
        if not (isinstance(multiplier, int | float) and math.isfinite(multiplier) and multiplier > 0):
            raise RunError(
                f"optimizer.lr_multipliers: {glob}: {multiplier} must be a positive number; to stop parameters "
                f"from training, use init.freeze=[{glob}]"
            )
        found = [name for name in matching(names, glob) if name not in taken]
        if not found:
            raise RunError(
                f"optimizer.lr_multipliers: {glob} matches no parameter that trains and no earlier glob took "
                f"(it has {listed(names)}); fix the glob"
            )
        taken.update(dict.fromkeys(found, glob))
    rest = [parameter for name, parameter in training if name not in taken]
    groups = [{"params": rest, NAME: "rest", MULTIPLIER: 1.0}] if rest else []
    groups += [
        {
            "params": [parameter for name, parameter in training if taken.get(name) == glob],
            NAME: group_name(glob),
            MULTIPLIER: float(multiplier),
        }
        for glob, multiplier in multipliers.items()
    ]
    if not groups:
        raise RunError("every parameter of the model is frozen (init.freeze): nothing would train; freeze fewer")
    named = [group[NAME] for group in groups]
    if clash := next((name for name in named if named.count(name) > 1), None):
        raise RunError(
            f"optimizer.lr_multipliers: two groups would both be logged as train/lr/{clash}; give the globs "
            f"distinct names"
        )
    optimizer = components.build("optimizer", cfg, params=groups)
    for group in optimizer.param_groups:  # before the scheduler records each group's initial lr
        if group[MULTIPLIER] != 1.0:  # an lr of None (a relative-step optimizer) stays None
            group["lr"] = group["lr"] * group[MULTIPLIER]
    return optimizer


def check_optimized(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Stops the run, naming each parameter that trains but that the optimizer does not hold: one
    made after the optimizer was (a layer a model builds in `forward` on first use) would get
    gradients at every step and never change. Run once, after the first step: by then such a layer exists."""
    held = {parameter for group in optimizer.param_groups for parameter in group["params"]}
    missed = [name for name, parameter in model.named_parameters() if parameter.requires_grad and parameter not in held]
    if missed:
        raise RunError(
            f"{len(missed)} parameter(s) of the model train but are not in the optimizer, and would never change: "
            f"{listed([f'model.{name}' for name in missed])}; they were built after it, e.g. in the model's forward: "
            f"build every layer in the model's __init__"
        )


def group_name(glob: str) -> str:
    """The glob as an MLflow metric name can hold it: `body.*` is `body`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", re.sub(r"\.?\*+$", "", glob)) or "all"


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """`train/lr`, the configured lr as the schedule sets it now, and, where any group has a
    multiple of it of its own, `train/lr/<group>` for each."""
    groups = optimizer.param_groups
    rates = {"train/lr": float(groups[0]["lr"]) / groups[0][MULTIPLIER]}
    if any(group[MULTIPLIER] != 1.0 for group in groups) or len(groups) > 1:
        rates.update({f"train/lr/{group[NAME]}": float(group["lr"]) for group in groups})
    return rates


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

"""Whether a checkpoint can continue this run, and what a resume changes: a checkpoint of another
run, optimizer or model is refused in one line naming the mismatch; changed settings (a new
device, a new lr) are allowed and said."""

import logging

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..errors import RunError, listed, shown, typed
from ..provenance import flat_params, flatten
from .schema import Checkpoint

log = logging.getLogger(__name__)

# Not settings of the run: what names it, and the experiment it stays in whatever the config now says.
UNREPORTED = ("resume", "standby", "mlflow.run_name", "mlflow.experiment_name")


def check_fits(saved: Checkpoint, cfg: DictConfig, model: nn.Module) -> None:
    """Fails, naming the mismatch, when the checkpoint cannot belong to this run, optimizer or model."""
    check_same_run(saved, cfg.name)
    before, now = saved.setting("optimizer", "_target_"), cfg.optimizer._target_
    if before != now:
        raise RunError(
            f"the checkpoint was trained with optimizer {shown(before)}, this run asks for {now}; resume with the "
            f"optimizer it was trained with, or start a new run with name=<new name>"
        )
    check_same_groups(saved, cfg)
    check_model_fits(model, saved_shapes(saved), changed(saved, cfg, "model"))


def check_same_run(saved: Checkpoint, name: str) -> None:
    """A resume continues the run that wrote the checkpoint, under its own name: the same
    checkpoints and MLflow run carried on by two names would be two lines of one history."""
    saved_name = saved.run_name or name
    if saved_name != name:  # read from the checkpoint: data from anywhere, pasted into a command
        raise RunError(
            f"{saved.path} is a checkpoint of the run {shown(saved_name)!r}, not of {name!r}; continue that run with "
            f"name={typed(saved_name)} resume=last, or drop resume= and start this one from its weights with "
            f"init.checkpoint={typed(saved.path)}"
        )


def check_same_groups(saved: Checkpoint, cfg: DictConfig) -> None:
    """The optimizer's state is kept by parameter group, and the groups are made by these globs: a
    resume that changes them would give each parameter another's state."""
    grouping = {
        "init.freeze": (sorted(saved.setting("init", "freeze") or []), sorted(cfg.init.freeze)),  # in any order
        "optimizer.lr_multipliers": (
            list(saved.setting("optimizer", "lr_multipliers") or {}),
            list(cfg.optimizer.get("lr_multipliers") or {}),
        ),
    }
    for key, (before, now) in grouping.items():
        if before != now:
            raise RunError(
                f"the checkpoint was trained with the {key} globs {shown(before)}, this run asks for {now}, and its "
                f"optimizer state is grouped by them; resume with the same globs, or start a new run from its weights "
                f"with name=<new name> init.checkpoint={typed(saved.path)}"
            )


def saved_shapes(saved: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The checkpoint's model tensors and their whole shapes."""
    if saved.sharded:
        from .sharded import shapes  # torch.distributed.checkpoint only where a folder is read

        return shapes(saved.path)
    return {key: tuple(value.shape) for key, value in saved.part("model").items()}


def check_model_fits(model: nn.Module, saved: dict[str, tuple[int, ...]], settings: list[str]) -> None:
    """Refuses a model whose tensors do not meet the checkpoint's, naming them, and the model
    `settings` that this run changes (a resume takes the others from the checkpoint)."""
    if problems := mismatches(shapes_of(model), saved)[0]:
        fix = (
            f"this run changes {listed(settings)}: resume without {'it' if len(settings) == 1 else 'them'}"
            if settings
            else "resume with the model settings it was trained with"
        )
        raise RunError(
            f"the checkpoint does not fit this model ({problems}); {fix}, or start a new run with name=<new name>"
        )


def changed(saved: Checkpoint, cfg: DictConfig, group: str) -> list[str]:
    """The settings of `group` that differ from the checkpoint's, as `key before -> now`."""
    before = flatten(saved.config.get(group) or {}, f"{group}.")
    now = flatten(OmegaConf.to_container(cfg[group], resolve=True), f"{group}.")
    return [
        f"{key} {before.get(key)} -> {now.get(key)}"
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
    ]


def shapes_of(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's tensors and their whole shapes (of a sharded one too)."""
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def mismatches(
    built: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], ignored: frozenset[str] = frozenset()
) -> tuple[str, list[str]]:
    """The keys, but `ignored`, that do not meet their twin in name and shape: said by kind (empty
    when all fit), and listed."""
    missing = sorted(built.keys() - saved.keys() - ignored)
    unexpected = sorted(saved.keys() - built.keys() - ignored)
    reshaped = sorted(key for key in (built.keys() & saved.keys()) - ignored if built[key] != saved[key])
    problems = [f"missing from the checkpoint: {listed(missing)}"] if missing else []
    problems += [f"not in this model: {listed(unexpected)}"] if unexpected else []
    if reshaped:
        shapes = [f"{key} {saved[key]} in the checkpoint vs {built[key]} now" for key in reshaped]
        problems.append(f"shape mismatch: {listed(shapes, between='; ')}")
    return " | ".join(problems), missing + unexpected + reshaped


def report_changes(saved: Checkpoint, cfg: DictConfig, device: torch.device) -> None:
    """Settings that differ from the checkpoint's: allowed (a new device, a new lr), and said.
    The device is compared as resolved, not as its config group: device=auto that finds the same
    cpu changes nothing."""
    before = {**flatten(saved.config), "device": saved.device_type}
    after = {**flat_params(cfg), "device": device.type}
    changed = {
        key: f"{before.get(key)} -> {value}"
        for key, value in after.items()
        if key not in UNREPORTED and not key.startswith("device.") and before.get(key) != value
    }
    if changed:
        said = ", ".join(f"{key} {change}" for key, change in changed.items())
        log.info(shown(f"resuming with changed settings: {said}"))  # the checkpoint's values: data from anywhere


def report_lr_move(saved: Checkpoint, before: float, now: float, cfg: DictConfig) -> None:
    """A resume that moves the learning rate says so, with the way to keep the old schedule: a
    longer trainer.max_steps stretches the default schedule, and the lr jumps up mid-decay."""
    if now == before:
        return
    horizon, wanted = saved.setting("scheduler", "total_steps"), cfg.scheduler.get("total_steps")
    keep = (
        f" (scheduler.total_steps {shown(horizon)} -> {wanted}; to keep the schedule the run was trained on, resume "
        f"with scheduler.total_steps={typed(horizon)})"
        if horizon != wanted
        else ""
    )
    log.info(f"the learning rate at step {saved.step} moves from {before:.4g} to {now:.4g} on resume{keep}")

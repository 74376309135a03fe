"""Whether a checkpoint can continue this run, and what a resume changes: a checkpoint of another
run, optimizer or model is refused in one line naming the mismatch; changed settings (a new
device, a new lr) are allowed and said."""

import logging

import torch
from omegaconf import DictConfig
from torch import nn

from ..errors import RunError
from ..provenance import flat_params, flatten
from .schema import Checkpoint

log = logging.getLogger(__name__)


def check_fits(saved: Checkpoint, cfg: DictConfig, model: nn.Module) -> None:
    """Fails, naming the mismatch, when the checkpoint cannot belong to this run, optimizer or model."""
    check_same_run(saved, cfg.name)
    before, now = saved.setting("optimizer", "_target_"), cfg.optimizer._target_
    if before != now:
        raise RunError(
            f"the checkpoint was trained with optimizer {before}, this run asks for {now}; resume with the "
            f"optimizer it was trained with, or start a new run with name=<new name>"
        )
    check_model_fits(model, saved_shapes(saved))


def check_same_run(saved: Checkpoint, name: str) -> None:
    """A resume continues the run that wrote the checkpoint, under its own name: the same
    checkpoints and MLflow run carried on by two names would be two lines of one history."""
    saved_name = saved.run_name or name
    if saved_name != name:
        raise RunError(
            f"{saved.path} is a checkpoint of the run {saved_name!r}, not of {name!r}; continue that run with "
            f"name={saved_name} resume=last; a new run that starts from its weights is fine-tuning, not a resume"
        )


def saved_shapes(saved: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The checkpoint's model tensors and their whole shapes."""
    if saved.sharded:
        from .sharded import shapes  # torch.distributed.checkpoint only where a folder is read

        return shapes(saved.path)
    return {key: tuple(value.shape) for key, value in saved.part("model").items()}


def check_model_fits(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    current = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    missing = sorted(current.keys() - saved.keys())
    unexpected = sorted(saved.keys() - current.keys())
    reshaped = [
        f"{key} {saved[key]} in the checkpoint vs {current[key]} now"
        for key in sorted(current.keys() & saved.keys())
        if saved[key] != current[key]
    ]
    problems = [f"missing from the checkpoint: {', '.join(missing)}"] if missing else []
    problems += [f"not in this model: {', '.join(unexpected)}"] if unexpected else []
    problems += [f"shape mismatch: {'; '.join(reshaped)}"] if reshaped else []
    if problems:
        raise RunError(
            f"the checkpoint does not fit this model ({' | '.join(problems)}); resume with the model "
            f"settings it was trained with, or start a new run with name=<new name>"
        )


def report_changes(saved: Checkpoint, cfg: DictConfig, device: torch.device) -> None:
    """Settings that differ from the checkpoint's: allowed (a new device, a new lr), and said.
    The device is compared as resolved, not as its config group: device=auto that finds the same
    cpu changes nothing."""
    before = {**flatten(saved.config), "device": saved.device_type}
    after = {**flat_params(cfg), "device": device.type}
    changed = {
        key: f"{before.get(key)} -> {value}"
        for key, value in after.items()
        if key not in ("resume", "mlflow.run_name") and not key.startswith("device.") and before.get(key) != value
    }
    if changed:
        log.info("resuming with changed settings: " + ", ".join(f"{key} {change}" for key, change in changed.items()))


def report_lr_move(saved: Checkpoint, before: float, now: float, cfg: DictConfig) -> None:
    """A resume that moves the learning rate says so, with the way to keep the old schedule: a
    longer trainer.max_steps stretches the default schedule, and the lr jumps up mid-decay."""
    if now == before:
        return
    horizon, wanted = saved.setting("scheduler", "total_steps"), cfg.scheduler.get("total_steps")
    keep = (
        f" (scheduler.total_steps {horizon} -> {wanted}; to keep the schedule the run was trained on, resume "
        f"with scheduler.total_steps={horizon})"
        if horizon != wanted
        else ""
    )
    log.info(f"the learning rate at step {saved.step} moves from {before:.4g} to {now:.4g} on resume{keep}")

"""A run's state in a checkpoint: saved whole, checked against the run that restores it, and
restored part by part in the order checkpoints.PARTS declares."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf
from torch import nn

from . import checkpoints
from .checkpoints import CheckpointError
from .continuity import amp_setting
from .devices import describe
from .errors import RunError
from .optimizers import hyperparameters, keep_configured
from .provenance import flat_params, flatten, library_versions

if TYPE_CHECKING:
    from .train import Run

log = logging.getLogger(__name__)


def save(run: Run) -> Path:
    """Writes a checkpoint of everything needed to continue exactly, and logs the probe's loss
    measured for it as `checkpoint/loss`."""
    state = {
        "format_version": checkpoints.FORMAT_VERSION,
        "step": run.step,
        "config": OmegaConf.to_container(run.cfg, resolve=True),
        "device": {"type": run.device.type, "name": describe(run.device)},
        "amp": amp_setting(run.cfg),
        "versions": library_versions(),
        **{name: getattr(run, name).state_dict() for name in checkpoints.PARTS},
    }
    # Built on every rank (the random state is gathered from all), written by rank 0 alone.
    path = run.world.on_main(lambda: checkpoints.save(state, run.home, run.step, run.cfg.checkpoint.keep_last))
    run.tracker.log_metrics({"checkpoint/loss": run.probe.loss}, run.step)
    run.tracker.flush()  # what the checkpoint proves is in MLflow before the process can die
    return path


def restore(run: Run, saved: dict) -> None:
    """Loads a checkpoint into parts that are already on their device, after checking that it can
    belong to this model and optimizer; the config's hyperparameters stay this run's."""
    check_fits(run, saved)
    report_changes(saved, run)
    configured = hyperparameters(run.optimizer)
    for name in checkpoints.PARTS:
        try:
            getattr(run, name).load_state_dict(saved[name])
        except (KeyError, ValueError, TypeError, IndexError) as error:
            raise CheckpointError(
                f"the checkpoint's {name} does not load ({error}); resume from another checkpoint, "
                f"or start a new run with name=<new name>"
            ) from None
    keep_configured(run.optimizer, run.scheduler, configured)
    report_lr_move(saved, run)
    run.step = saved["step"]


def check_fits(run: Run, saved: dict) -> None:
    """Fails, naming the mismatch, when the checkpoint cannot belong to this optimizer or model."""
    before, now = saved["config"]["optimizer"].get("_target_"), run.cfg.optimizer._target_
    if before != now:
        raise RunError(
            f"the checkpoint was trained with optimizer {before}, this run asks for {now}; resume with the "
            f"optimizer it was trained with, or start a new run with name=<new name>"
        )
    check_model_fits(run.model, saved["model"])


def check_model_fits(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    missing = sorted(current.keys() - saved.keys())
    unexpected = sorted(saved.keys() - current.keys())
    reshaped = [
        f"{key} {tuple(saved[key].shape)} in the checkpoint vs {tuple(current[key].shape)} now"
        for key in sorted(current.keys() & saved.keys())
        if saved[key].shape != current[key].shape
    ]
    problems = [f"missing from the checkpoint: {', '.join(missing)}"] if missing else []
    problems += [f"not in this model: {', '.join(unexpected)}"] if unexpected else []
    problems += [f"shape mismatch: {'; '.join(reshaped)}"] if reshaped else []
    if problems:
        raise RunError(
            f"the checkpoint does not fit this model ({' | '.join(problems)}); resume with the model "
            f"settings it was trained with, or start a new run with name=<new name>"
        )


def report_changes(saved: dict, run: Run) -> None:
    """Settings that differ from the checkpoint's: allowed (a new device, a new lr), and said.
    The device is compared as resolved, not as its config group: device=auto that finds the same
    cpu changes nothing."""
    before = {**flatten(saved["config"]), "device": saved["device"]["type"]}
    after = {**flat_params(run.cfg), "device": run.device.type}
    changed = {
        key: f"{before.get(key)} -> {value}"
        for key, value in after.items()
        if key != "resume" and not key.startswith("device.") and before.get(key) != value
    }
    if changed:
        log.info("resuming with changed settings: " + ", ".join(f"{key} {change}" for key, change in changed.items()))


def report_lr_move(saved: dict, run: Run) -> None:
    """A resume that moves the learning rate says so, with the way to keep the old schedule: a
    longer trainer.max_steps stretches the default schedule, and the lr jumps up mid-decay."""
    before, now = saved["optimizer"]["param_groups"][0]["lr"], run.optimizer.param_groups[0]["lr"]
    if now == before:
        return
    horizon, wanted = saved["config"]["scheduler"].get("total_steps"), run.cfg.scheduler.get("total_steps")
    keep = (
        f" (scheduler.total_steps {horizon} -> {wanted}; to keep the schedule the run was trained on, resume "
        f"with scheduler.total_steps={horizon})"
        if horizon != wanted
        else ""
    )
    log.info(f"the learning rate at step {saved['step']} moves from {before:.4g} to {now:.4g} on resume{keep}")

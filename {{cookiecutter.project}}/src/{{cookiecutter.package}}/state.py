"""A run's state in a checkpoint: saved whole, checked against the run that restores it, and
restored part by part in the order checkpoints.PARTS declares."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf
from torch import nn

from . import checkpoints
from .checkpoints import CheckpointError, SaveError
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
    measured for it as `checkpoint/loss`. Sharded (strategy=fsdp): a folder, in which every
    process writes its shards of the model and optimizer, and rank 0 the rest."""
    state = capture(run)
    if not run.world.sharded:
        return run.world.on_main(lambda: write(run, state))
    path = save_sharded(run, state)
    log_saved(run, state)
    return path


def capture(run: Run) -> dict:
    """The run's state as a checkpoint holds it (under strategy=fsdp, less the shards), on every
    process: the random state is gathered from all. Its tensors are the run's own, not copies."""
    in_shards = checkpoints.IN_SHARDS if run.world.sharded else ()
    return {
        "format_version": checkpoints.FORMAT_VERSION,
        "step": run.step,
        "config": OmegaConf.to_container(run.cfg, resolve=True),
        "device": {"type": run.device.type, "name": describe(run.device)},
        "amp": amp_setting(run.cfg),
        "versions": library_versions(),
        **{name: getattr(run, name).state_dict() for name in checkpoints.PARTS if name not in in_shards},
    }


def write(run: Run, state: dict) -> Path:
    """Writes a captured state as the one-file checkpoint of its step (rank 0 alone), then logs
    its `checkpoint/loss`: from the training thread, or from async_save.py's writer."""
    path = checkpoints.save(state, run.home, state["step"], run.cfg.checkpoint.keep_last)
    log_saved(run, state)
    return path


def log_saved(run: Run, state: dict) -> None:
    run.tracker.log_metrics({"checkpoint/loss": state["probe"]["loss"]}, state["step"])
    run.tracker.flush()  # what the checkpoint proves is in MLflow before the process can die


def save_sharded(run: Run, state: dict) -> Path:
    """The shards into a folder under a temporary name, then rank 0 completes it: until then no
    resume can pick it, so a process that dies mid-save leaves the previous checkpoint the newest."""
    from . import sharded  # torch.distributed.checkpoint: 1 s of start-up that a one-file run never uses

    home, step = run.home, run.step
    temporary = run.world.broadcast(checkpoints.temporary_folder(home, step) if run.world.is_main else None)
    try:
        files = sharded.write(run.model, run.optimizer, temporary, run.world)
    except sharded.WriteFailed as failure:  # on every process alike
        run.world.on_main(lambda: checkpoints.discard(temporary))
        raise SaveError(f"could not write the shards of step {step} to {temporary} ({failure})") from None
    return run.world.on_main(
        lambda: checkpoints.save_folder({**state, "shards": files}, temporary, home, step, run.cfg.checkpoint.keep_last)
    )


def restore(run: Run, path: Path, saved: dict) -> None:
    """Loads a checkpoint into parts that are already on their device, after checking that it can
    belong to this model and optimizer; the config's hyperparameters stay this run's. A sharded
    checkpoint loads on any number of processes; a one-file checkpoint into a sharded model too."""
    check_fits(run, path, saved)
    report_changes(saved, run)
    configured = hyperparameters(run.optimizer)
    loaded_already = checkpoints.IN_SHARDS if "shards" in saved or run.world.sharded else ()
    if loaded_already:
        read_shards(run, path, saved)
    for name in checkpoints.PARTS:
        if name in loaded_already:
            continue
        try:
            getattr(run, name).load_state_dict(saved[name])
        except (KeyError, ValueError, TypeError, IndexError) as error:
            raise CheckpointError(
                f"the checkpoint's {name} does not load ({error}); resume from another checkpoint, "
                f"or start a new run with name=<new name>"
            ) from None
    saved_lr = run.optimizer.param_groups[0]["lr"]
    keep_configured(run.optimizer, run.scheduler, configured)
    report_lr_move(saved, saved_lr, run)
    run.step = saved["step"]


def read_shards(run: Run, path: Path, saved: dict) -> None:
    """The model and optimizer of a sharded checkpoint, each process reading what it holds now;
    or of a one-file checkpoint, into a sharded model."""
    from . import sharded

    if "shards" not in saved:
        sharded.read_whole(run.model, run.optimizer, saved["model"], saved["optimizer"])
        return
    try:
        sharded.read(run.model, run.optimizer, path)
    except sharded.Refused as refusal:
        raise CheckpointError(f"{path} was refused: {refusal}; load only checkpoints this project wrote") from None


def check_fits(run: Run, path: Path, saved: dict) -> None:
    """Fails, naming the mismatch, when the checkpoint cannot belong to this run, optimizer or model."""
    check_same_run(run.cfg.name, path, saved)
    before, now = saved["config"]["optimizer"].get("_target_"), run.cfg.optimizer._target_
    if before != now:
        raise RunError(
            f"the checkpoint was trained with optimizer {before}, this run asks for {now}; resume with the "
            f"optimizer it was trained with, or start a new run with name=<new name>"
        )
    if "shards" in saved:
        from . import sharded

        saved_shapes = sharded.shapes(path)
    else:
        saved_shapes = {key: tuple(value.shape) for key, value in saved["model"].items()}
    check_model_fits(run.model, saved_shapes)


def check_same_run(name: str, path: Path, saved: dict) -> None:
    """A resume continues the run that wrote the checkpoint, under its own name: the same
    checkpoints and MLflow run carried on by two names would be two lines of one history."""
    saved_name = saved["config"].get("name", name)
    if saved_name != name:
        raise RunError(
            f"{path} is a checkpoint of the run {saved_name!r}, not of {name!r}; continue that run with "
            f"name={saved_name} resume=last; a new run that starts from its weights is fine-tuning, not a resume"
        )


def check_model_fits(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    """`saved`: the checkpoint's model tensors and their shapes (whole, for sharded ones)."""
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


def report_changes(saved: dict, run: Run) -> None:
    """Settings that differ from the checkpoint's: allowed (a new device, a new lr), and said.
    The device is compared as resolved, not as its config group: device=auto that finds the same
    cpu changes nothing."""
    before = {**flatten(saved["config"]), "device": saved["device"]["type"]}
    after = {**flat_params(run.cfg), "device": run.device.type}
    changed = {
        key: f"{before.get(key)} -> {value}"
        for key, value in after.items()
        if key not in ("resume", "mlflow.run_name") and not key.startswith("device.") and before.get(key) != value
    }
    if changed:
        log.info("resuming with changed settings: " + ", ".join(f"{key} {change}" for key, change in changed.items()))


def report_lr_move(saved: dict, before: float, run: Run) -> None:
    """A resume that moves the learning rate says so, with the way to keep the old schedule: a
    longer trainer.max_steps stretches the default schedule, and the lr jumps up mid-decay."""
    now = run.optimizer.param_groups[0]["lr"]
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

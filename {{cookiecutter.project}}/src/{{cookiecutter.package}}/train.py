"""The training recipe, top to bottom: claim, build, place, restore, audit, check, train, save.

The order in `train` and `build_restore_and_train` is the point of this file. Each numbered step says why it stands where it
does; moving one is how the failures this project exists to prevent come back.
"""

import logging
import math
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import TensorDataset
from tqdm import tqdm

from . import checkpoints
from .checkpoints import SaveError
from .config import Config, check_values
from .data import Position, batches, build_data, build_loader
from .devices import audit_placement, describe, resolve_device, set_cpu_threads
from .divergence import Divergence, nonfinite_weights
from .errors import RunError
from .model import build_model
from .optimizers import build_optimizer, build_scheduler, restore_optimization
from .precision import autocast, build_scaler
from .precision import describe as describe_amp
from .preemption import Preemption
from .seeding import capture_rng, restore_rng, seed_everything
from .sweeps import Job, current_job
from .tracking import Tracker, check_tracking_uri

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What a training step touches and a checkpoint saves, assembled by `train` in recipe order."""

    cfg: Config
    device: torch.device
    home: Path  # where this run's checkpoints live
    model: nn.Module
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    tracker: Tracker


@dataclass
class Probe:
    """A fixed batch of validation samples: its loss at save and at resume proves continuity."""

    indices: torch.Tensor
    inputs: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, dataset: TensorDataset, indices: torch.Tensor) -> "Probe":
        inputs, targets = dataset.tensors
        return cls(indices, inputs[indices], targets[indices])


def main(cfg: DictConfig) -> dict | float | None:
    """The entry point of run.py: a problem the user can fix prints as one line, no traceback.
    In a sweep, a failing job fails alone, and a job's value is its final val/loss (sweeps.py)."""
    job = current_job()
    if job is not None:
        return job.run(train, cfg)
    try:
        return train(cfg)
    except RunError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def train(cfg: Config, job: Job | None = None) -> dict:
    """Trains, or continues the run `resume=` names, to `trainer.max_steps`; returns the final
    metrics, the continuity verdict and the MLflow run id."""
    check_values(cfg)
    seed_everything(cfg.seed)

    # 1. The device first: a missing accelerator fails here, before anything is built.
    device = resolve_device(cfg.device)
    set_cpu_threads(cfg.device)
    log.info(f"device: {describe(device)}; amp: {describe_amp(cfg.amp)}")
    if cfg.mlflow.enabled:
        check_tracking_uri(cfg.mlflow)

    # 2. The checkpoint home, held until the run ends: a second run on the same experiment, or a
    #    folder that cannot take checkpoints, stops here, not at a save hours later.
    home = Path(cfg.checkpoint.dir) / job.key if job else Path(cfg.checkpoint.dir)  # each sweep job has its own
    with checkpoints.claim(home):
        if cfg.resume is None and checkpoints.has_checkpoints(home):
            raise RunError(
                f"{home} already holds checkpoints of experiment {cfg.experiment!r}; continue them with "
                f"resume=last, or start a separate run with experiment=<new name> (or checkpoint.dir=<path>)"
            )
        return build_restore_and_train(home, cfg, device, job)


def build_restore_and_train(home: Path, cfg: Config, device: torch.device, job: Job | None) -> dict:
    """Steps 3 to 10 of the recipe, in a checkpoint home that this run holds."""
    # 3. The whole model, with any structural change (a new head, frozen layers) made inside
    #    build_model: the move below carries only the submodules that exist at that moment.
    data = build_data(cfg.data)
    model = build_model(cfg.model, data.num_features, data.num_classes)

    # 4. Model and criterion to the device.
    model.to(device, memory_format=torch.channels_last if cfg.trainer.channels_last else torch.preserve_format)
    criterion = nn.CrossEntropyLoss().to(device)

    # 5. Optimizer, scheduler and scaler, built on parameters that are already placed.
    optimizer = build_optimizer(cfg.optimizer, model)
    scheduler = build_scheduler(cfg.scheduler, optimizer)
    scaler = build_scaler(cfg.amp, device)
    parent_run_id, run_name = (job.parent_run_id, job.key) if job else (None, None)
    tracker = Tracker(cfg.mlflow, home, parent_run_id, run_name)
    run = Run(cfg, device, home, model, criterion, optimizer, scheduler, scaler, tracker)

    # 6. Restore, after the move: Optimizer.load_state_dict casts the saved state to the device
    #    of the parameters as they are *now*. Loaded before the move, it would stay on the CPU
    #    and the first step would fail with "Expected all tensors to be on the same device".
    found = checkpoints.find(cfg.resume, home)
    position, step = Position(), 0
    probe = Probe.of(data.val, torch.arange(min(cfg.checkpoint.continuity.probe_size, len(data.val))))
    if found is not None:
        resumed_from, saved = found
        restore(run, saved)
        position, step = Position(**saved["data_position"]), saved["step"]
        probe = Probe.of(data.val, check_probe_fits(saved["probe"]["indices"], len(data.val)))
        if (folder := checkpoints.set_aside_newer(home, step)) is not None:
            log.info(f"resuming from step {step}: the newer checkpoints of {home} are moved to {folder}")

    # 7. Optimize for the device after the restore, so that it starts from the restored state.
{%- if cookiecutter.ipex %}
    #    IPEX rewrites model and optimizer from what they hold; what it returns replaces them.
    if cfg.device.ipex:
        from .ipex import ipex_optimize  # only here: IPEX pins torch 2.8, most runs never load it

        run.model, run.optimizer = ipex_optimize(run.model, run.optimizer, cfg.amp)
{%- endif %}
    if cfg.trainer.compile:
        run.model.compile()  # in place: state_dict keys stay those of the plain model

    # 8. Audit: every parameter, buffer, optimizer state tensor and the scaler on the device.
    audit_placement(device, run.model, run.optimizer, run.scaler)

    # 9. One MLflow run across resumes; then the continuity check: the probe loss now must
    #    match the probe loss stored at save. Signals wait for a checkpoint from here on.
    trainer, status = cfg.trainer, "FAILED"
    with Preemption() as preemption:
        record = (flat_params(cfg), comparison_tags(cfg, device), OmegaConf.to_yaml(cfg, resolve=True))
        if found is None:
            run.tracker.start(*record)
        else:
            run.tracker.reattach(saved.get("mlflow_run_id"), *record, checkpoint=str(resumed_from))
        try:
            continuity = check_continuity(run, saved, probe, step) if found is not None else "fresh"

            # 10. Train; save on schedule, on SIGTERM/SIGINT, and at the end. A save that fails
            #     (a full disk) costs a warning and is tried again at the next save point; a loss
            #     that is not finite stops the run before it can save (divergence.py).
            stream = batches(build_loader(data.train, cfg.data, cfg.device, cfg.seed), position)
            saver = Saver(run, probe, resumed_from if found is not None else None)
            divergence = Divergence(trainer, scaled=run.scaler.is_enabled())
            first_step, started, samples = step, time.perf_counter(), 0
            window_start, window_steps, window_samples = started, 0, 0
            with tqdm(total=trainer.max_steps, initial=step, disable=None, desc="train") as bar:
                while step < trainer.max_steps and preemption.received is None:
                    micro_batches = [next(stream) for _ in range(trainer.grad_accum_steps)]
                    loss = train_step(run, micro_batches)
                    step += 1
                    divergence.watch(step, loss)
                    batch_samples = sum(len(targets) for _, targets in micro_batches)
                    samples += batch_samples
                    window_steps += 1
                    window_samples += batch_samples
                    bar.update()
                    if step % trainer.log_every_n_steps == 0:
                        divergence.check(saver.on_disk())
                        seconds = time.perf_counter() - window_start
                        metrics = {
                            "train/loss": loss.item(),
                            "train/lr": run.optimizer.param_groups[0]["lr"],
                            "train/samples_per_s": window_samples / seconds,
                            "train/step_time_ms": 1000 * seconds / window_steps,
                        }
                        run.tracker.log_metrics(metrics, step)
                        bar.set_postfix(
                            loss=f"{metrics['train/loss']:.4f}", samples_s=f"{window_samples / seconds:.0f}"
                        )
                        window_start, window_steps, window_samples = time.perf_counter(), 0, 0
                    if step % trainer.val_every_n_steps == 0 and step < trainer.max_steps:
                        run.tracker.log_metrics(evaluate(run, data.val), step)
                    if step % cfg.checkpoint.every_n_steps == 0:
                        divergence.check(saver.on_disk())
                        saver.try_save(position, step)
            seconds = time.perf_counter() - started
            trained = step > first_step
            throughput = {"train/steps_per_s": (step - first_step) / seconds, "train/samples_per_s": samples / seconds}
            divergence.check(saver.on_disk())
            val = evaluate(run, data.val)
            run.tracker.log_metrics(val, step)
            saver.final(position, step)
            stopped = (
                preemption.received if step < trainer.max_steps else None
            )  # a signal after the last step stops nothing
            status = "KILLED" if stopped else "FINISHED"
        finally:
            run.tracker.finish(status)

    newest = checkpoints.path_of(home, step)
    if stopped:
        log.info(f"stopped at step {step} by {stopped.name}; saved {newest}; continue with resume=last")
        raise SystemExit(128 + stopped)
    log.info(
        f"finished at step {step}: val/loss {val['val/loss']:.4f}, val/accuracy {val['val/accuracy']:.4f}; "
        f"checkpoint {newest}; MLflow run {run.tracker.run_id or 'off'}"
    )
    # A run resumed at its last step trains nothing: no training loss or throughput to report.
    training = {"train/loss": loss.item(), **throughput} if trained else {}
    return {**training, **val, "continuity": continuity, "step": step, "run_id": run.tracker.run_id}


def train_step(run: Run, micro_batches: list[list[torch.Tensor]]) -> torch.Tensor:
    """One optimizer step over `trainer.grad_accum_steps` batches; returns their mean loss."""
    total = torch.zeros((), device=run.device)
    for inputs, targets in micro_batches:
        with autocast(run.cfg.amp, run.device):
            loss = run.criterion(run.model(to_device(inputs, run)), to_device(targets, run)) / len(micro_batches)
        run.scaler.scale(loss).backward()  # scale, unscale_ and step pass through when the scaler is off
        total += loss.detach()
    # Asked for by on_nonfinite=skip_step, at the price of one host sync a step: no update from
    # a non-finite loss. The schedule still advances, so the lr stays a function of the step.
    if run.cfg.trainer.on_nonfinite == "skip_step" and not torch.isfinite(total):
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        return total
    if run.cfg.trainer.grad_clip is not None:
        run.scaler.unscale_(run.optimizer)  # clip the true gradients, not the fp16-scaled ones
        nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.trainer.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return total


def to_device(tensor: torch.Tensor, run: Run) -> torch.Tensor:
    channels_last = run.cfg.trainer.channels_last and tensor.dim() == 4
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    return tensor.to(run.device, non_blocking=run.cfg.device.non_blocking, memory_format=memory_format)


@torch.no_grad()
def evaluate(run: Run, dataset: TensorDataset, batch_size: int = 512) -> dict[str, float]:
    """Validation loss and accuracy. Draws no random numbers, so it cannot perturb a resume."""
    run.model.eval()
    total_loss, correct = 0.0, 0
    inputs, targets = dataset.tensors
    for start in range(0, len(inputs), batch_size):
        x, y = inputs[start : start + batch_size].to(run.device), targets[start : start + batch_size].to(run.device)
        with autocast(run.cfg.amp, run.device):
            logits = run.model(x)
        total_loss += run.criterion(logits.float(), y).item() * len(y)
        correct += (logits.argmax(dim=1) == y).sum().item()
    run.model.train()
    return {"val/loss": total_loss / len(inputs), "val/accuracy": correct / len(inputs)}


@torch.no_grad()
def probe_loss(run: Run, probe: Probe) -> float:
    run.model.eval()
    with autocast(run.cfg.amp, run.device):
        logits = run.model(probe.inputs.to(run.device))
    run.model.train()
    return run.criterion(logits.float(), probe.targets.to(run.device)).item()


class Saver:
    """The loop's checkpoints: which is the newest on disk, and saves that fail without ending
    the run (until the last one)."""

    def __init__(self, run: Run, probe: Probe, newest: Path | None) -> None:
        self.run, self.probe = run, probe
        self.newest = newest  # this run's newest checkpoint on disk, or the one it resumed from
        self.failed: SaveError | None = None

    def try_save(self, position: Position, step: int) -> None:
        """Saves; a save that fails warns once and leaves training going, to try again next time."""
        try:
            self._save(position, step)
        except SaveError as error:
            if self.failed is None:
                log.warning(f"{error}; training goes on and tries again at the next save; {self.on_disk()}")
            self.failed = error
            return
        if self.failed is not None:
            log.warning(f"saving works again: step {step} is saved")
            self.failed = None

    def final(self, position: Position, step: int) -> None:
        """The save at the end (or at a signal), which must succeed or the run fails."""
        if self.newest == checkpoints.path_of(self.run.home, step):
            return
        try:
            self._save(position, step)
        except SaveError as error:
            raise RunError(
                f"{error}, so step {step} is not saved; {self.on_disk()}; free space or fix the folder, "
                f"then continue with resume=last"
            ) from None

    def on_disk(self) -> str:
        return f"the newest checkpoint on disk is {self.newest}" if self.newest else "no checkpoint is on disk"

    def _save(self, position: Position, step: int) -> None:
        # A model that no longer computes numbers stays broken whatever follows: saved, it would
        # become resume=last and push the good checkpoints out. This RunError ends the run.
        loss = probe_loss(self.run, self.probe)
        broken = nonfinite_weights(self.run.model) + ([] if math.isfinite(loss) else [f"probe loss {loss}"])
        if broken:
            raise RunError(
                f"the model is no longer finite at step {step} ({', '.join(broken[:3])}"
                f"{', ...' if len(broken) > 3 else ''}): nothing is saved; {self.on_disk()}; continue from it "
                f"with resume=last and a lower optimizer.lr"
            )
        self.newest = save(self.run, position, step, self.probe, loss)


def save(run: Run, position: Position, step: int, probe: Probe, loss: float) -> Path:
    """Writes a checkpoint of everything needed to continue exactly, with the probe's `loss`, and
    logs that as `checkpoint/loss`."""
    state = {
        "format_version": checkpoints.FORMAT_VERSION,
        "step": step,
        "data_position": asdict(position),
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "optimizer_name": run.cfg.optimizer.name,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),  # {} when the scaler is off
        "rng": capture_rng(run.device),
        "probe": {"indices": probe.indices, "loss": loss},
        "mlflow_run_id": run.tracker.run_id,
        "config": OmegaConf.to_container(run.cfg, resolve=True),
        "device": {"type": run.device.type, "name": describe(run.device)},
        "amp": amp_setting(run.cfg),
        "versions": library_versions(),
    }
    path = checkpoints.save(state, run.home, step, run.cfg.checkpoint.keep_last)
    run.tracker.log_metrics({"checkpoint/loss": loss}, step)
    run.tracker.flush()  # what the checkpoint proves is in MLflow before the process can die
    return path


def restore(run: Run, saved: dict) -> None:
    """Loads a checkpoint into parts that are already on their device; fails, naming the
    mismatch, when the checkpoint cannot belong to this model or optimizer."""
    if saved["optimizer_name"] != run.cfg.optimizer.name:
        raise RunError(
            f"the checkpoint was trained with optimizer={saved['optimizer_name']}, this run asks for "
            f"optimizer={run.cfg.optimizer.name}; resume with optimizer={saved['optimizer_name']}, "
            f"or start a new run with experiment=<new name>"
        )
    check_model_fits(run.model, saved["model"])
    report_changes(saved, run)
    run.model.load_state_dict(saved["model"])
    restore_optimization(run.optimizer, run.scheduler, saved)
    report_lr_move(saved, run)
    if run.scaler.is_enabled() and saved["scaler"]:
        run.scaler.load_state_dict(saved["scaler"])
    elif run.scaler.is_enabled():
        log.info("the checkpoint has no GradScaler state (amp was not fp16): starting a fresh GradScaler")
    elif saved["scaler"]:
        log.info("amp is no longer fp16: the checkpoint's GradScaler state is not needed and is skipped")
    restore_rng(saved["rng"], run.device)  # last: nothing after it may draw random numbers


def check_probe_fits(indices: torch.Tensor, available: int) -> torch.Tensor:
    if len(indices) and int(indices.max()) >= available:
        raise RunError(
            f"the checkpoint's continuity probe uses validation sample {int(indices.max())}, but this data has "
            f"{available}; resume with the data settings it was trained with, or start a new run with "
            f"experiment=<new name>"
        )
    return indices


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
            f"settings it was trained with, or start a new run with experiment=<new name>"
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
    horizon = saved["config"]["scheduler"].get("total_steps", saved["config"]["trainer"]["max_steps"])
    keep = (
        f" (scheduler.total_steps {horizon} -> {run.cfg.scheduler.total_steps}; to keep the schedule the "
        f"run was trained on, resume with scheduler.total_steps={horizon})"
        if horizon != run.cfg.scheduler.total_steps
        else ""
    )
    log.info(f"the learning rate at step {saved['step']} moves from {before:.4g} to {now:.4g} on resume{keep}")


def check_continuity(run: Run, saved: dict, probe: Probe, step: int) -> str:
    """Compares the probe loss now with the one stored at save: exactly, on the same device type
    and AMP setting; within `checkpoint.continuity.rtol` when either changed."""
    settings = run.cfg.checkpoint.continuity
    before, now = saved["probe"]["loss"], probe_loss(run, probe)
    same_setup = saved["device"]["type"] == run.device.type and saved["amp"] == amp_setting(run.cfg)
    ok = now == before if same_setup else abs(now - before) <= settings.rtol * abs(before)
    # NaN equals nothing, itself included: a NaN loss at save can prove neither continuity nor a
    # break (a finite one at save and NaN now is a break).
    verdict = "ok" if ok else "nonfinite" if not math.isfinite(before) else "mismatch"
    run.tracker.log_metrics({"resume/loss": now, "resume/loss_delta": abs(now - before)}, step)
    run.tracker.set_tags({"continuity": verdict})
    line = f"resumed at step {step} on {run.device}: loss at save {before:.4f}, loss now {now:.4f} ({verdict})"
    if ok:
        log.info(line)
        return verdict
    if verdict == "nonfinite":
        log.warning(f"{line}: a loss that is not a number cannot show whether the restore is faithful")
        return verdict
    tolerance = "exact match expected on the same device and dtype" if same_setup else f"rtol {settings.rtol}"
    if settings.on_mismatch == "error":
        raise RunError(f"{line}: {tolerance}; the restore is not faithful")
    log.warning(f"{line}: {tolerance}")
    return verdict


def amp_setting(cfg: Config) -> dict:
    return {"enabled": cfg.amp.enabled, "dtype": cfg.amp.dtype}


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def flat_params(cfg: Config) -> dict[str, str]:
    return flatten(OmegaConf.to_container(cfg, resolve=True))


def comparison_tags(cfg: Config, device: torch.device) -> dict[str, str]:
    """What the MLflow UI needs to compare runs: where and how each one really ran."""
    tags = {
        "device": str(device),
        "device.type": device.type,
        "device.index": str(device.index if device.index is not None else 0),
        "device.name": describe(device),
        "amp": cfg.amp.dtype if cfg.amp.enabled else "off",
        "torch": str(torch.__version__),
{%- if cookiecutter.ipex %}
        "ipex": str(cfg.device.ipex).lower(),
{%- endif %}
    }
    commit = git_commit()
    return {**tags, "mlflow.source.git.commit": commit} if commit else tags


def git_commit() -> str | None:
    """The commit of the project being run, when it is a git checkout: what exactly ran."""
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def library_versions() -> dict[str, str]:
    # str(): torch.__version__ is a TorchVersion, which weights_only loading refuses.
    return {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": np.__version__}

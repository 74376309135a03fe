"""The proof that a resume continued the run: the loss on a fixed probe of validation samples,
stored in each checkpoint and measured again after the restore, must match.

The probe is evaluated as validation is (evaluation.py), in one batch and whole in every process,
so its loss at save and at resume is computed the same way whatever the batch size and the number
of processes.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, Subset

from .data import evaluation_loader, global_batch
from .errors import RunError
from .evaluation import evaluate

if TYPE_CHECKING:
    from .train import Run

log = logging.getLogger(__name__)


class Probe:
    """A fixed `Subset` of the validation set, and its loss at the last save. A checkpoint part
    (state_dict, load_state_dict): a resume measures the same samples the save measured."""

    def __init__(self, val: Dataset, size: int) -> None:
        self.val = val
        self.indices = torch.arange(min(size, len(val)))
        self.loss: float | None = None  # at the last save
        self.saved_loss: float | None = None  # in the checkpoint this run resumed from

    def measure(self, run: Run) -> float:
        loader = evaluation_loader(Subset(self.val, self.indices.tolist()), len(self.indices), 0, run.cfg.device)
        return evaluate(run, loader, shared=False)["val/loss"]

    def state_dict(self) -> dict:
        return {"indices": self.indices, "loss": self.loss}

    def load_state_dict(self, state: dict) -> None:
        indices, loss = state["indices"], state["loss"]
        if not torch.is_tensor(indices) or not isinstance(loss, float):
            raise ValueError("a probe is a tensor of indices and a float loss")
        if len(indices) and int(indices.max()) >= len(self.val):
            raise RunError(
                f"the checkpoint's continuity probe uses validation sample {int(indices.max())}, but this data has "
                f"{len(self.val)}; resume with the data settings it was trained with, or start a new run with "
                f"name=<new name>"
            )
        self.indices, self.saved_loss = indices, loss


def check(run: Run, saved: dict, step: int) -> str:
    """Compares the probe loss now with the one stored at save: exactly, on the same device type
    and AMP setting; within `checkpoint.continuity.rtol` when either changed. Returns the verdict:
    ok, mismatch, or nonfinite when the loss at save was not a number."""
    settings = run.cfg.checkpoint.continuity
    before, now = run.probe.saved_loss, run.probe.measure(run)
    same_setup = saved["device"]["type"] == run.device.type and saved["amp"] == amp_setting(run.cfg)
    ok = now == before if same_setup else abs(now - before) <= settings.rtol * abs(before)
    # NaN equals nothing, itself included: a NaN loss at save can prove neither continuity nor a
    # break (a finite one at save and NaN now is a break).
    verdict = "ok" if ok else "nonfinite" if not math.isfinite(before) else "mismatch"
    run.tracker.log_metrics({"resume/loss": now, "resume/loss_delta": abs(now - before)}, step)
    run.tracker.set_tags({"continuity": verdict})
    line = f"resumed at step {step} on {run.device}: loss at save {before:.4f}, loss now {now:.4f} ({verdict})"
    line += batch_change(saved, run)
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


def amp_setting(cfg) -> dict:
    return {"enabled": cfg.amp.enabled, "dtype": cfg.amp.dtype}


def batch_change(saved: dict, run: Run) -> str:
    """What the resume does to the global batch (samples per optimizer step): nothing, or a clause
    with the settings that keep it. Not a break in continuity, whatever the number of processes
    (the probe is evaluated whole), but the steps after it train on another batch."""
    before, now = global_batch(saved["config"], len(saved["rng"]["ranks"])), global_batch(run.cfg, run.world.size)
    if before == now:
        return ""
    keep = [
        f"{key}={before * value // now}"
        for key, value in (
            ("data.batch_size", run.cfg.data.batch_size),
            ("trainer.grad_accum_steps", run.cfg.trainer.grad_accum_steps),
        )
        if before * value % now == 0
    ]
    saved_processes = len(saved["rng"]["ranks"])
    processes = f" ({saved_processes} -> {run.world.size} processes)" if saved_processes != run.world.size else ""
    return f"; the global batch changes from {before} to {now} samples a step{processes}" + (
        f": resume with {' or '.join(keep)} to keep it" if keep else ""
    )

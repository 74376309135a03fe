"""The proof that a resume continued the run: the loss on the probe's fixed validation samples
(probe.py), measured before each save and stored in the checkpoint, must match after the restore.
A model whose loss or weights are no longer finite is not saved at all."""

import logging
import math

from .checkpoint.schema import Checkpoint
from .data.loaders import global_batch
from .errors import RunError
from .lifecycle.divergence import nonfinite_weights
from .parts import Run
from .precision import setting
from .validation import evaluate

log = logging.getLogger(__name__)


def measure(run: Run) -> float:
    """The probe's loss now, evaluated as validation is (validation.py)."""
    return evaluate(run, run.probe.loader(run.cfg.device), shared=False)["val/loss"]


def unsaveable(run: Run) -> list[str]:
    """Measures the probe's loss for the checkpoint about to be saved, and returns why the run's
    state must not be saved: the weights or the probe loss that are no longer finite (each process
    sees its own shards under fsdp; all must stop together)."""
    loss = measure(run)
    weights = list(dict.fromkeys(name for names in run.world.gather(nonfinite_weights(run.model)) for name in names))
    broken = weights + ([] if math.isfinite(loss) else [f"probe loss {loss}"])
    if not broken:
        run.probe.loss = loss
    return broken


def check(run: Run, saved: Checkpoint) -> str:
    """Compares the probe loss now with the one stored at save: exactly, on the same device type
    and AMP setting; within `checkpoint.continuity.rtol` when either changed (or the checkpoint's probe
    loss was measured by an earlier evaluation, probe.py). Returns the verdict:
    ok, mismatch, or nonfinite when the loss at save was not a number."""
    settings = run.cfg.checkpoint.continuity
    before, now, step = run.probe.saved_loss, measure(run), saved.step
    same_setup = saved.device_type == run.device.type and saved.amp == setting(run.cfg.amp) and run.probe.measured_alike
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


def batch_change(saved: Checkpoint, run: Run) -> str:
    """What the resume does to the global batch (samples per optimizer step): nothing, or a clause
    with the settings that keep it. Not a break in continuity, whatever the number of processes
    (the probe is evaluated whole), but the steps after it train on another batch."""
    before, now = global_batch(saved.config, saved.processes), global_batch(run.cfg, run.world.size)
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
    processes = f" ({saved.processes} -> {run.world.size} processes)" if saved.processes != run.world.size else ""
    return f"; the global batch changes from {before} to {now} samples a step{processes}" + (
        f": resume with {' or '.join(keep)} to keep it" if keep else ""
    )

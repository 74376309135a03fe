"""One optimizer step: the recipe's innermost loop, over `trainer.grad_accum_steps` batches, under
autocast and the GradScaler, with the gradients averaged over the processes by the strategy."""

import contextlib

import torch
from torch import nn

from .devices import is_dtensor
from .parts import Run
from .precision import autocast


def train_step(run: Run, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor | None, int | torch.Tensor]:
    """One optimizer step over `trainer.grad_accum_steps` batches; returns their mean loss over
    all processes, the norm of the gradients before clipping, measured for a step that will be
    logged or clipped (else None, as for a step skipped), and the units (samples, tokens) this
    process trained on."""
    total, counted = None, 0
    for number, batch in enumerate(micro_batches, start=1):
        inputs, targets = run.task.split(run.place(batch))
        with run.strategy.holding_gradients(run.wrapped) if number < len(micro_batches) else contextlib.nullcontext():
            with autocast(run.amp, run.device):
                loss, count = run.task.loss(run.criterion, run.wrapped(inputs), targets)
            counted += count
            if len(micro_batches) > 1:  # the step's loss is their mean; a division by 1 would still cost an op
                loss = loss / len(micro_batches)
            run.scaler.scale(loss).backward()  # scale, unscale_ and step pass through when the scaler is off
        total = loss.detach().float() if total is None else total + loss.detach()  # float32 whatever autocast chose
    # The mean over the processes, as their gradients are: a loss that is not finite on one of
    # them is seen by all, and all skip the same steps.
    total = run.world.mean(total)
    # Asked for by on_nonfinite=skip_step, at the price of one host sync a step: no update from
    # a non-finite loss. The schedule still advances, so the lr stays a function of the step.
    if run.trainer.on_nonfinite == "skip_step" and not torch.isfinite(total):
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        return total, None, counted
    norm = None
    if (run.step + 1) % run.trainer.log_every_n_steps == 0 or run.trainer.grad_clip is not None:
        run.scaler.unscale_(run.optimizer)  # the true gradients, not the fp16-scaled ones
        norm = gradient_norm(run.model, run.trainer.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return total, norm, counted


def gradient_norm(model: nn.Module, clip: float | None) -> torch.Tensor:
    """The norm of all the model's gradients as one vector, on every process (under fsdp each
    holds a shard of them); with `clip`, the gradients are scaled down to that norm at most."""
    norm = nn.utils.get_total_norm([parameter.grad for parameter in model.parameters() if parameter.grad is not None])
    if clip is not None:
        nn.utils.clip_grads_with_norm_(model.parameters(), clip, norm)
    return norm.full_tensor() if is_dtensor(norm) else norm

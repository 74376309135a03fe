"""Validation: the loss and the metrics over a dataset, placed as training places its batches
(`channels_last`, `non_blocking`). It draws no random numbers, so it cannot perturb a resume.

Metrics have torchmetrics' interface (update per batch, compute at the end, which sums every
process's share once training runs on several): the ready ones (ready/metrics.py) or torchmetrics'
own.
"""

from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from . import components
from .errors import RunError, first_line
from .parts import Evaluable, Metric
from .precision import autocast
from .ready.metrics import Sum


def build_metrics(cfg: DictConfig, facts: dict[str, Any], device: torch.device) -> dict[str, Metric]:
    """The `metrics` group, each logged as `val/<name>`, on the device."""
    return {name: components.build(f"metrics.{name}", node, **facts).to(device) for name, node in cfg.items()}


@torch.no_grad()
def evaluate(run: Evaluable, loader: DataLoader, shared: bool = True, split: str = "val") -> dict[str, float]:
    """`<split>/loss`, the mean loss per unit the task counts (sample, token), and `<split>/<name>`
    for each metric. `shared`: each process holds a share of the samples, and the results combine
    all shares (a collective step); otherwise only the loss, over this process's loader alone."""
    run.model.eval()
    # Two sums, the loss weighted by its units and the units, so that the mean is per unit, not
    # one of batch means. A NaN stays in them: a NaN loss must show.
    total, units = (Sum(sync_on_compute=shared).to(run.device) for _ in range(2))
    metrics = run.metrics if shared else {}
    for batch, counted in in_step(loader, run, shared):
        inputs, targets = run.task.split(run.place(batch))
        with autocast(run.amp, run.device):
            outputs = run.model(inputs)
        if not counted:
            continue
        outputs = in_float32(outputs)
        loss, count = run.task.loss(run.criterion, outputs, targets)
        # A batch with nothing to count (all padding) has a NaN mean: it adds nothing, not NaN.
        total.update(torch.where(count > 0, loss * count, 0.0) if torch.is_tensor(count) else loss * count)
        units.update(count)
        for metric in metrics.values():
            metric.update(outputs, targets)
    run.model.train()
    results = {f"{split}/loss": (total.compute() / units.compute()).item()}
    for name, metric in metrics.items():
        results[f"{split}/{name}"] = metric.compute().item()
        metric.reset()
    return results


@torch.no_grad()
def check_wiring(run: Evaluable) -> None:
    """One validation batch through the task, the model, the loss and every metric (its value
    too: one number), on the run's device, before the first step (of a resumed run too): a component
    that does not fit the others stops the run here, in one line naming it and the shapes, not at a
    validation hours later. The metrics are left as they were built.
    Every process checks its own batch, and all stop if one finds a problem."""
    batch = next(iter(run.val_loader), None)
    # A share too small for one batch leaves the check to the first validation: under fsdp a
    # forward needs every process.
    if not all(run.world.gather(batch is not None)):
        return
    problem = wiring_problem(run, run.place(batch))
    problems = [found for found in run.world.gather(problem) if found is not None]
    if problems:
        raise RunError(problems[0])


def wiring_problem(run: Evaluable, batch: Any) -> str | None:
    """What does not fit in the data -> task -> model -> loss -> metrics chain for one batch, or None."""
    cfg, failures = run.cfg, (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError)
    try:
        inputs, targets = run.task.split(batch)
    except failures as error:
        keys = f"; its keys: {', '.join(map(str, batch))}, so set task.inputs=<key> task.targets=<key>"
        return (
            f"task ({cfg.task._target_}) cannot split the data's batch {shape(batch)}: {first_line(error)}"
            f"{keys if isinstance(batch, dict) else ''}"
        )
    run.model.eval()
    try:
        with autocast(run.amp, run.device):
            try:
                outputs = run.model(inputs)
            except failures as error:
                return (
                    f"model ({cfg.model._target_}) cannot take the data's inputs {shape(inputs)}: {first_line(error)}"
                )
        outputs = in_float32(outputs)
        fit = f"the model's outputs {shape(outputs)} and the data's targets {shape(targets)}"
        try:
            loss, _ = run.task.loss(run.criterion, outputs, targets)
        except failures as error:
            return (
                f"loss ({cfg.loss._target_}) does not fit {fit}: {first_line(error)}; the task ({cfg.task._target_}) "
                f"applies it to them"
            )
        if loss.ndim != 0:
            return f"loss ({cfg.loss._target_}) gives a tensor {shape(loss)} for {fit}; it must give one number"
        for name, metric in run.metrics.items():
            try:
                # Called, not update() then compute(): the call gives this batch's value without
                # compute()'s sync across processes, which one that stopped above would never join.
                value = metric(outputs, targets)
            except failures as error:
                return f"metrics.{name} ({cfg.metrics[name]._target_}) does not fit {fit}: {first_line(error)}"
            finally:
                metric.reset()
            if not (isinstance(value, torch.Tensor) and value.numel() == 1):
                return (
                    f"metrics.{name} ({cfg.metrics[name]._target_}) computes {shape(value)}, not the one number "
                    f"val/{name} must be; use a metric that gives one (per-class scores: average=macro), or drop it: "
                    f"~metrics.{name}"
                )
        return None
    finally:
        run.model.train()


def in_float32(outputs: Any) -> Any:
    """The model's outputs for the loss and the metrics, in float32 whatever autocast computed (a
    task whose model returns a structure converts it itself)."""
    return outputs.float() if isinstance(outputs, torch.Tensor) and outputs.is_floating_point() else outputs


def shape(value: Any) -> str:
    """A tensor's shape and dtype, or those of each tensor in a batch's structure."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {shape(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(shape(item) for item in value) + ")"
    return type(value).__name__


def in_step(loader: DataLoader, run: Evaluable, shared: bool) -> Iterator[tuple[Any, bool]]:
    """The loader's batches, each with True: it counts; then, where each forward is a collective
    step (strategy=fsdp gathers parameters from every process), the last batch again with False,
    until this process has run as many forwards as the process whose share of the samples has the
    most batches."""
    count, batch = 0, None
    for batch in loader:
        count += 1
        yield batch, True
    if run.strategy.collective_forward and shared:
        missing = run.world.max(count) - count
        if missing and batch is None:
            raise RunError(
                f"this process's share of the validation set is empty, and under strategy={run.cfg.strategy.type} "
                f"every process takes part in each forward; give validation at least {run.world.size} samples"
            )
        for _ in range(missing):
            yield batch, False

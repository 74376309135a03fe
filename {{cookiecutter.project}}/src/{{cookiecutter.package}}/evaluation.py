"""Validation: the loss and the metrics over a dataset, placed as training places its batches
(`channels_last`, `non_blocking`). It draws no random numbers, so it cannot perturb a resume.

Metrics are torchmetrics objects (update per batch, compute at the end), so that they reduce
across processes once training runs on several.
"""

from collections.abc import Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric

from . import components
from .errors import RunError, first_line
from .parts import Run
from .precision import autocast


def build_metrics(cfg: DictConfig, num_classes: int, device: torch.device) -> dict[str, Metric]:
    """The `metrics` group, each logged as `val/<name>`, on the device."""
    return {name: components.build("metrics", node, num_classes=num_classes).to(device) for name, node in cfg.items()}


@torch.no_grad()
def evaluate(run: Run, loader: DataLoader, shared: bool = True) -> dict[str, float]:
    """`val/loss`, the mean loss per sample, and `val/<name>` for each metric. `shared`: each
    process holds a share of the samples, and the results combine all shares (a collective step);
    otherwise only the loss, over this process's loader alone."""
    run.model.eval()
    # NaN kept, not dropped with a warning (torchmetrics' default): a NaN loss must show.
    loss = MeanMetric(nan_strategy="disable", sync_on_compute=shared).to(run.device)
    metrics = run.metrics if shared else {}
    for inputs, targets in in_step(loader, run, shared):
        inputs, targets = run.place(inputs), run.place(targets)
        with autocast(run.amp, run.device):
            outputs = run.model(inputs)
        if not len(targets):
            continue
        outputs = outputs.float()
        loss.update(run.criterion(outputs, targets), weight=len(targets))
        for metric in metrics.values():
            metric.update(outputs, targets)
    run.model.train()
    results = {"val/loss": loss.compute().item()}
    for name, metric in metrics.items():
        results[f"val/{name}"] = metric.compute().item()
        metric.reset()
    return results


@torch.no_grad()
def check_wiring(run: Run) -> None:
    """One validation batch through the model, the loss and every metric, on the run's device,
    before the first step (of a resumed run too): a component that does not fit the others stops
    the run here, in one line naming it and the shapes, not at a validation hours later. Every
    process checks its own batch, and all stop if one finds a problem."""
    batch = next(iter(run.val_loader), None)
    # A share too small for one batch leaves the check to the first validation: under fsdp a
    # forward needs every process.
    if not all(run.world.gather(batch is not None)):
        return
    inputs, targets = batch
    problem = wiring_problem(run, run.place(inputs), run.place(targets))
    problems = [found for found in run.world.gather(problem) if found is not None]
    if problems:
        raise RunError(problems[0])


def wiring_problem(run: Run, inputs: torch.Tensor, targets: torch.Tensor) -> str | None:
    """What does not fit in the data -> model -> loss -> metrics chain for one batch, or None."""
    cfg, failures = run.cfg, (RuntimeError, ValueError, TypeError, IndexError)
    run.model.eval()
    try:
        with autocast(run.amp, run.device):
            try:
                outputs = run.model(inputs)
            except failures as error:
                return (
                    f"model ({cfg.model._target_}) cannot take the data's inputs {shape(inputs)}: {first_line(error)}"
                )
        outputs = outputs.float()
        fit = f"the model's outputs {shape(outputs)} and the data's targets {shape(targets)}"
        try:
            loss = run.criterion(outputs, targets)
        except failures as error:
            return f"loss ({cfg.loss._target_}) does not fit {fit}: {first_line(error)}"
        if loss.ndim != 0:
            return f"loss ({cfg.loss._target_}) gives a tensor {shape(loss)} for {fit}; it must give one number"
        for name, metric in run.metrics.items():
            try:
                metric.update(outputs, targets)
            except failures as error:
                return f"metrics.{name} ({cfg.metrics[name]._target_}) does not fit {fit}: {first_line(error)}"
            finally:
                metric.reset()
        return None
    finally:
        run.model.train()


def shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def in_step(loader: DataLoader, run: Run, shared: bool) -> Iterator[list[torch.Tensor]]:
    """The loader's batches; then, where each forward is a collective step (strategy=fsdp gathers
    parameters from every process), empty batches until this process has run as many forwards as
    the process whose share of the samples has the most batches."""
    count = 0
    for batch in loader:
        count += 1
        yield batch
    if run.strategy.collective_forward and shared:
        for _ in range(run.world.max(count) - count):
            yield [tensor[:0] for tensor in batch]

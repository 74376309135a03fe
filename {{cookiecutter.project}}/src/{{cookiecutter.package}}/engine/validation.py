"""Validation: the loss and the metrics over a dataset, placed as training places its batches
(`channels_last`, `non_blocking`). It draws no random numbers, so it cannot perturb a resume, and
a stop reaches it within a batch (`stop`): it is left unfinished, and owed to the resumed run.

Metrics have torchmetrics' interface (update per batch, compute at the end, which sums every
process's share once training runs on several): the ready ones (ready/metrics.py) or torchmetrics'
own.
"""

from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from . import components
from .config import TrainerConfig
from .errors import RunError, first_line
from .parts import Evaluable, Metric, Run
from .precision import autocast
from .ready.metrics import Sum


def build_metrics(cfg: DictConfig, facts: dict[str, Any], device: torch.device) -> dict[str, Metric]:
    """The `metrics` group, each logged as `val/<name>`, on the device."""
    return {name: components.build(f"metrics.{name}", node, **facts).to(device) for name, node in cfg.items()}


def scheduled(trainer: TrainerConfig, step: int) -> bool:
    """Whether trainer.val_every_n_steps validates at `step` (the last step is the end's to validate)."""
    return step % trainer.val_every_n_steps == 0 and step < trainer.max_steps


def validate(
    run: Run, loss: float | None, stop: Callable[[], bool] | None = None, judged: bool = False
) -> dict[str, float] | None:
    """The validation metrics at this step, logged, with the step's training loss (which
    optimized_metric may name), kept by the monitor, and, `judged` (a scheduled validation), judged
    by it for early stopping. A step is validated once: the save at the last step, an early stop and
    the end share one validation. None where `stop` cut it short: the monitor then owes it, and the
    resumed run does it first (its time is validation's all the same)."""
    if run.monitor.latest is None or run.monitor.latest[0] != run.step:
        with run.clock.during("validation"):
            val = evaluate(run, run.val_loader, stop=stop)
        if val is None:
            run.monitor.abandoned(run.step, loss)
            return None
        run.tracker.log_metrics(val, run.step)
        run.monitor.validated(run.step, val if loss is None else {**val, "train/loss": loss})
        run.callbacks.call("on_validation_end", run, run.monitor.latest[1])
        if judged:
            run.monitor.observe()
    return run.monitor.latest[1]


class Abandoned(Exception):
    """A stop came before the validation's end (`in_step`)."""


@torch.no_grad()
def evaluate(
    run: Evaluable,
    loader: DataLoader,
    shared: bool = True,
    split: str = "val",
    stop: Callable[[], bool] | None = None,
) -> dict[str, float] | None:
    """`<split>/loss`, the mean loss per unit the task counts (sample, token), and `<split>/<name>`
    for each metric. `shared`: each process holds a share of the samples, and the results combine
    all shares (a collective step); otherwise only the loss, over this process's loader alone.
    `stop` is asked before each batch: None once it says so, the metrics as they were before."""
    run.model.eval()
    # Two sums, the loss weighted by its units and the units, so that the mean is per unit, not
    # one of batch means. A NaN stays in them: a NaN loss must show.
    total, units = (Sum(sync_on_compute=shared).to(run.device) for _ in range(2))
    metrics = run.metrics if shared else {}
    try:
        for batch, counted in in_step(loader, run, shared, stop):
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
    except Abandoned:
        for metric in metrics.values():  # the next validation starts from nothing, as this one did
            metric.reset()
        return None
    finally:
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


def in_step(
    loader: DataLoader, run: Evaluable, shared: bool, stop: Callable[[], bool] | None = None
) -> Iterator[tuple[Any, bool]]:
    """The loader's batches, each with True: it counts; then, where each forward is a collective
    step (strategy=fsdp gathers parameters from every process), the last batch again with False,
    until this process has run as many forwards as the process whose share of the samples has the
    most batches. `stop` (a collective step too) is asked before each of as many batches on every
    process, a share with fewer asking it on; Abandoned once it says so."""
    mine, batch = len(loader), None
    collective = run.strategy.collective_forward and shared
    rounds = run.world.max(mine) if collective or stop is not None else mine
    if collective and rounds > mine == 0:
        raise RunError(
            f"this process's share of the validation set is empty, and under strategy={run.cfg.strategy.type} "
            f"every process takes part in each forward; give validation at least {run.world.size} samples"
        )
    with closing(iter(loader)) as batches:  # its workers end with it, however it ends (data/workers.py)
        for index in range(rounds):
            if stop is not None and stop():
                raise Abandoned
            if index < mine:
                batch = next(batches)
                yield batch, True
            elif collective:
                yield batch, False

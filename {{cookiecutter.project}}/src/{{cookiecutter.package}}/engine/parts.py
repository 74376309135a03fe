"""What a training step touches and a checkpoint saves: the parts of a run, assembled by the
recipe (train.py) in its order, and read by validation and the continuity check; and the part of
them that a validation alone needs (eval.py)."""

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from .config import AmpConfig, Config, TrainerConfig
from .data.contract import Data
from .data.position import Position
from .devices import to_device
from .distributed import World
from .lifecycle.goodput import Clock
from .monitor import Monitor
from .precision import Scaler
from .probe import Probe
from .seeding import RandomState
from .strategies import Single
from .tracking.tracker import Tracker


class Task(Protocol):
    """What a `task` component is to the recipe (tasks.py holds the examples, and says more)."""

    unit: str  # what the loss is a mean over, and throughput counts: samples, tokens

    def split(self, batch: Any) -> tuple[Any, Any]: ...

    def loss(self, criterion: nn.Module, outputs: Any, targets: Any) -> tuple[torch.Tensor, int | torch.Tensor]: ...


class Metric(Protocol):
    """What a `metrics` component is to validation: torchmetrics' interface, which the ready ones
    (ready/metrics.py) have too; a call gives one batch's value without a collective step."""

    def update(self, outputs: Any, targets: Any) -> None: ...

    def compute(self) -> torch.Tensor: ...

    def reset(self) -> None: ...

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor: ...


@dataclass
class Evaluable:
    """What a validation touches: the model built and placed, the task, loss and metrics that judge
    it, and this process's share of the validation set. eval.py builds these alone; a Run adds the
    rest of training to them."""

    cfg: Config
    world: World  # this process among the job's, and its device
    strategy: Single  # how the model is spread over the processes
    data: Data
    task: Task  # what a batch holds for the model, and how its outputs become the loss
    val_loader: DataLoader  # this process's share of the validation set
    model: nn.Module  # what is saved, evaluated and audited (under fsdp, sharded in place)
    criterion: nn.Module
    metrics: dict[str, Metric]
    # The settings every step reads, copied out of `cfg` as plain objects: a step read about
    # twenty of them from the DictConfig, at several microseconds each (bench/step_overhead.py).
    trainer: TrainerConfig = field(init=False)
    amp: AmpConfig = field(init=False)
    non_blocking: bool = field(init=False)  # device.non_blocking

    def __post_init__(self) -> None:
        self.trainer, self.amp = OmegaConf.to_object(self.cfg.trainer), OmegaConf.to_object(self.cfg.amp)
        self.non_blocking = self.cfg.device.non_blocking

    @property
    def device(self) -> torch.device:
        return self.world.device

    def place(self, batch: Any) -> Any:
        return to_device(batch, self.device, self.non_blocking, self.trainer.channels_last)


@dataclass
class Run(Evaluable):
    wrapped: nn.Module  # what training calls: the model in DistributedDataParallel, or the model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Scaler
    position: Position  # in the training data
    probe: Probe
    tracker: Tracker
    monitor: Monitor  # optimized_metric's best value, and early stopping
    rng: RandomState
    callbacks: Any  # yours, called at the recipe's points: hooks.Callbacks, whose hooks get this run
    clock: Clock  # where this leg's time goes: the run's goodput
    step: int = 0  # optimizer steps taken

    def checkpointed(self) -> dict[str, Any]:
        """What a checkpoint holds, in the order a restore loads it: the model before the optimizer,
        whose state follows the parameters' device, and the random state last, so that nothing
        after it draws."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "data": self.data,  # what the data was (its shards'), checked before the position in it is restored
            "position": self.position,
            "probe": self.probe,
            "tracker": self.tracker,
            "monitor": self.monitor,
            "callbacks": self.callbacks,
            "rng": self.rng,
        }

    @classmethod
    def around(cls, built: Evaluable, **training: Any) -> "Run":
        """A run of the parts `built` and those that train them."""
        return cls(**{part.name: getattr(built, part.name) for part in fields(Evaluable) if part.init}, **training)

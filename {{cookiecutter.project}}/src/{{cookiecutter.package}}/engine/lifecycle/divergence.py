"""What a run does when its loss stops being a number, so that a diverging run can never save
NaN weights over, or prune away, the good checkpoints before it.

`trainer.on_nonfinite` chooses: `stop` ends the run before its next save, `skip_step` drops the
update of a step whose loss is not finite, `warn` only says so. A step whose update was dropped
(by `skip_step`, or by the GradScaler under fp16, which skips any step with non-finite gradients)
changes no weight, so it is tolerated up to `trainer.nonfinite_patience` steps in a row.
Whatever the policy, weights or a probe loss that are no longer finite are never saved (train.py).
"""

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from ..config import TrainerConfig
from ..devices import is_dtensor
from ..errors import RunError

log = logging.getLogger(__name__)


class Divergence:
    """Watches each step's loss without a host sync; `check` reads them all at once, at the
    points where the run syncs anyway (logging, saving, the end)."""

    def __init__(self, cfg: TrainerConfig, scaled: bool) -> None:
        self.policy, self.patience = cfg.on_nonfinite, cfg.nonfinite_patience
        # Where a non-finite step updates nothing, and by what.
        self.dropped_by = (
            "the GradScaler" if scaled else "trainer.on_nonfinite=skip_step" if self.policy == "skip_step" else None
        )
        self._watched: list[tuple[int, torch.Tensor]] = []
        self._streak: list[int] = []  # the steps of the current run of non-finite losses

    def watch(self, step: int, loss: torch.Tensor) -> None:
        self._watched.append((step, loss))

    def check(self, standing: Callable[[str], str]) -> None:
        """Raises RunError, naming the step and `standing(fix)` (the newest checkpoint, and how to go
        on from it with that fix), when the run
        must stop before it saves again; otherwise warns, once a streak of non-finite steps."""
        if not self._watched:
            return
        steps = [step for step, _ in self._watched]
        losses = torch.stack([loss for _, loss in self._watched]).float().tolist()
        self._watched.clear()
        for step, loss in zip(steps, losses, strict=True):
            if math.isfinite(loss):
                self._streak.clear()
                continue
            self._streak.append(step)
            if self.dropped_by is None and self.policy == "stop":
                raise RunError(
                    f"the loss is {loss} at step {step}: the run stops unsaved; {standing('a lower optimizer.lr')}, "
                    f"or choose trainer.on_nonfinite=skip_step"
                )
            if self.dropped_by is not None and len(self._streak) > self.patience:
                raise RunError(
                    f"the loss was not finite for {len(self._streak)} steps in a row (steps {self._streak[0]} to "
                    f"{step}), more than trainer.nonfinite_patience={self.patience}: the run stops unsaved; "
                    f"{standing('a lower optimizer.lr')}"
                )
            if len(self._streak) == 1:
                dropped = f"{self.dropped_by} dropped its update" if self.dropped_by else "trainer.on_nonfinite=warn"
                log.warning(f"the loss is {loss} at step {step}; {dropped}, and training goes on")


def nonfinite_weights(model: nn.Module) -> list[str]:
    """The parameters and buffers holding a NaN or an infinity, by name (one host sync); of a
    sharded model, in this process's shards."""
    tensors = [
        (name, tensor.to_local() if is_dtensor(tensor) else tensor)
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point()
    ]
    if not tensors:
        return []
    finite = torch.stack([tensor.isfinite().all() for _, tensor in tensors]).tolist()
    return [name for (name, _), ok in zip(tensors, finite, strict=True) if not ok]

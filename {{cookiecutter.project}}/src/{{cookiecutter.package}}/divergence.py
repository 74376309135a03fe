"""What a run does when its loss stops being a number, so that a diverging run can never save
NaN weights over, or prune away, the good checkpoints before it.

`trainer.on_nonfinite` chooses: `stop` ends the run before its next save, `skip_step` drops the
update of a step whose loss is not finite, `warn` only says so. A step whose update was dropped
(by `skip_step`, or by the GradScaler under fp16, which skips any step with non-finite gradients)
changes no weight, so it is tolerated up to `trainer.nonfinite_patience` steps in a row.
"""

import logging
import math

import torch
from torch import nn

from .config import TrainerConfig

log = logging.getLogger(__name__)


class Divergence:
    """Watches each step's loss without a host sync; `check` reads them all at once, at the
    points where the run syncs anyway (logging, saving, the end)."""

    def __init__(self, cfg: TrainerConfig, scaled: bool) -> None:
        self.policy, self.patience = cfg.on_nonfinite, cfg.nonfinite_patience
        self.absorbed = scaled or self.policy == "skip_step"  # a non-finite step updates nothing
        self._watched: list[tuple[int, torch.Tensor]] = []
        self._streak: list[int] = []  # the steps of the current run of non-finite losses

    def watch(self, step: int, loss: torch.Tensor) -> None:
        self._watched.append((step, loss))

    def check(self) -> str | None:
        """Why the run must stop, or None; warns under `on_nonfinite=warn`."""
        if not self._watched:
            return None
        steps = [step for step, _ in self._watched]
        losses = torch.stack([loss for _, loss in self._watched]).float().tolist()
        self._watched.clear()
        bad = []
        for step, loss in zip(steps, losses, strict=True):
            if math.isfinite(loss):
                self._streak.clear()
                continue
            bad.append((step, loss))
            self._streak.append(step)
            if self.absorbed and len(self._streak) > self.patience:
                return (
                    f"the loss was not finite for {len(self._streak)} steps in a row "
                    f"(steps {self._streak[0]} to {step}), more than trainer.nonfinite_patience={self.patience}"
                )
            if not self.absorbed and self.policy == "stop":
                return f"the loss is {loss} at step {step}"
        if bad and self.policy == "warn":
            log.warning(
                f"the loss is not finite at {len(bad)} step(s) from step {bad[0][0]} ({bad[0][1]}); "
                f"trainer.on_nonfinite=warn: training goes on"
            )
        return None


def nonfinite_weights(model: nn.Module) -> list[str]:
    """The parameters and buffers holding a NaN or an infinity, by name (one host sync)."""
    tensors = [(name, tensor) for name, tensor in model.state_dict().items() if tensor.is_floating_point()]
    if not tensors:
        return []
    finite = torch.stack([tensor.isfinite().all() for _, tensor in tensors]).tolist()
    return [name for (name, _), ok in zip(tensors, finite, strict=True) if not ok]

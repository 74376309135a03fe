"""The continuity probe: a fixed set of validation samples, whose loss each checkpoint stores
(`checkpoint/loss`) and a resume measures again (continuity.py)."""

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from .config import DeviceConfig
from .data.loaders import evaluation_loader
from .errors import RunError


class Probe:
    """A fixed `Subset` of the validation set, the batch size it is evaluated in, and its loss at
    the last save. A checkpoint part (state_dict, load_state_dict): a resume measures the same
    samples in the same batches as the save did, whatever `data.batch_size` it runs with."""

    def __init__(self, val: Dataset, size: int, batch_size: int) -> None:
        self.val = val
        self.indices = torch.arange(min(size, len(val)))
        # A batch of training's size costs no more memory than a training step: the probe's
        # samples in one batch could cost more than any step (long sequences, large outputs).
        self.batch_size = batch_size
        self.loss: float | None = None  # at the last save
        self.saved_loss: float | None = None  # in the checkpoint this run resumed from
        self.measured_alike = True  # whether saved_loss was computed as this run computes the loss

    def loader(self, device: DeviceConfig) -> DataLoader:
        """The probe's samples, in the same batches in every process: its loss at save and at
        resume is computed the same way whatever the number of processes."""
        return evaluation_loader(Subset(self.val, self.indices.tolist()), self.batch_size, 0, device)

    def state_dict(self) -> dict:
        return {"indices": self.indices, "loss": self.loss, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        indices, loss = state["indices"], state["loss"]
        # A checkpoint that names no batch size evaluated its probe in one batch, and as a mean of
        # batch means: its loss may differ from this evaluation's in the last bits.
        batch_size = state.get("batch_size", max(len(indices), 1))
        self.measured_alike = "batch_size" in state
        if not torch.is_tensor(indices) or not isinstance(loss, float) or type(batch_size) is not int:
            raise ValueError("a probe is a tensor of indices, a float loss and an integer batch size")
        if len(indices) and int(indices.max()) >= len(self.val):
            raise RunError(
                f"the checkpoint's continuity probe uses validation sample {int(indices.max())}, but this data has "
                f"{len(self.val)}; resume with the data settings it was trained with, or start a new run with "
                f"name=<new name>"
            )
        self.indices, self.saved_loss, self.batch_size = indices, loss, batch_size

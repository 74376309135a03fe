"""The ready metrics (Accuracy, Perplexity), each picked by a file of configs/metrics/, and the Sum
that validation's loss is made of. They compute what torchmetrics' MulticlassAccuracy(average="micro"),
Perplexity and SumMetric compute, in the same dtypes, without importing torchmetrics: its
`__init__` loads scipy.signal and matplotlib, a second of every start of a run whose metrics are
these. A torchmetrics metric named in configs/metrics/ works as well: these have its interface.

Each keeps its running sums in one tensor; `compute()` adds them up over the processes (one
all_reduce, a collective step) where torch.distributed is initialized, so that the value covers
every process's share of the validation set.
"""

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist


class Summed(ABC):
    """A metric of running sums: `update` adds a batch's (`counted`), `compute()` gives the value
    of all of them (`value`); a call gives one batch's value alone, without the collective step,
    and adds it to the sums as well (torchmetrics' forward)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, sync_on_compute: bool = True) -> None:
        self.sums = torch.zeros(shape, dtype=dtype)
        self.sync_on_compute = sync_on_compute

    @abstractmethod
    def counted(self, *batch: torch.Tensor) -> torch.Tensor:
        """What one batch adds to the sums."""

    @abstractmethod
    def value(self, sums: torch.Tensor) -> torch.Tensor:
        """The metric, from sums."""

    def update(self, *batch: torch.Tensor) -> None:
        self.sums += self.counted(*batch)

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        counted = self.counted(*batch).to(self.sums.dtype)
        self.sums += counted
        return self.value(counted)

    def compute(self) -> torch.Tensor:
        sums = self.sums
        if self.sync_on_compute and dist.is_available() and dist.is_initialized():
            sums = sums.clone()  # the process's own sums stay its own, as torchmetrics' do
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        return self.value(sums)

    def reset(self) -> None:
        self.sums.zero_()

    def to(self, device: torch.device | str) -> "Summed":
        self.sums = self.sums.to(device)
        return self


class Sum(Summed):
    """The sum of the values given, in the default float dtype. A NaN is kept, never dropped: a NaN
    loss must show. `sync_on_compute=False`: this process's sum alone, and no collective step."""

    def __init__(self, sync_on_compute: bool = True) -> None:
        super().__init__((), torch.get_default_dtype(), sync_on_compute)

    def counted(self, value: float | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(value, dtype=self.sums.dtype, device=self.sums.device).sum()

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        return sums


class Accuracy(Summed):
    """The fraction of samples whose highest logit is their class: outputs are logits shaped
    (batch, num_classes, ...), targets class indices shaped (batch, ...); 0 before any sample."""

    def __init__(self, num_classes: int, average: str = "micro") -> None:
        if not (isinstance(num_classes, int) and num_classes >= 2):
            raise ValueError(f"num_classes={num_classes!r} must be an integer of at least 2")
        if average != "micro":
            raise ValueError(
                f"average={average!r}: this Accuracy counts samples (micro); per-class averages are "
                f"torchmetrics.classification.MulticlassAccuracy's"
            )
        super().__init__((2,), torch.int64)
        self.num_classes, self.average = num_classes, average

    def counted(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        wanted = f"logits shaped (batch, {self.num_classes}, ...) and class indices shaped (batch, ...)"
        if not (
            outputs.is_floating_point()
            and outputs.ndim == targets.ndim + 1
            and outputs.shape[1] == self.num_classes
            and outputs.shape[:1] + outputs.shape[2:] == targets.shape
        ):
            raise ValueError(f"Accuracy takes {wanted}")
        if targets.is_floating_point():
            raise TypeError(f"Accuracy takes class indices as targets, not {targets.dtype}")
        right = (outputs.argmax(dim=1) == targets).sum()
        return torch.stack([right, torch.full_like(right, targets.numel())])

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        right, total = sums.float()
        return torch.where(total != 0, right / total, 0.0)


class Perplexity(Summed):
    """exp of the mean negative log-likelihood per token: outputs are logits shaped (batch,
    sequence, vocabulary), targets token ids shaped (batch, sequence); a target of `ignore_index`
    (padding) is not counted."""

    def __init__(self, ignore_index: int | None = -100) -> None:
        super().__init__((2,), torch.get_default_dtype())
        self.ignore_index = ignore_index

    def counted(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not (outputs.is_floating_point() and outputs.ndim == 3 and outputs.shape[:2] == targets.shape):
            raise ValueError(
                "Perplexity takes logits shaped (batch, sequence, vocabulary) and token ids (batch, sequence)"
            )
        if targets.dtype != torch.int64:
            raise TypeError(f"Perplexity takes token ids of torch.int64, not {targets.dtype}")
        # torchmetrics' steps (softmax, then log), so that the values are its own to the last bit.
        probabilities = outputs.reshape(-1, outputs.shape[-1]).softmax(dim=1)
        targets = targets.reshape(-1)
        counted = (
            targets != self.ignore_index
            if self.ignore_index is not None
            else torch.ones_like(targets, dtype=torch.bool)
        )
        rows = torch.arange(targets.numel(), device=targets.device)
        chosen = probabilities[rows, torch.where(counted, targets, 0)][counted]
        return torch.stack([-chosen.log().sum(), counted.sum().to(self.sums.dtype)])

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        return torch.exp(sums[0] / sums[1])

"""The demo data and the sampler that lets a run resume mid-epoch.

`build_data` is yours to replace (return your own datasets); keep `EpochSampler` and `batches`:
they are what make a resumed run see exactly the batches an unbroken run would have seen.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from .config import DataConfig, DeviceConfig
from .errors import RunError

# The split belongs to the dataset, not to the run: changing `seed` must not move samples
# between training and validation.
SPLIT_SEED = 0


@dataclass
class Data:
    train: Dataset
    val: TensorDataset
    num_features: int
    num_classes: int


@dataclass
class Position:
    """Where the data stream stands: `batch` batches of epoch `epoch` have been consumed."""

    epoch: int = 0
    batch: int = 0


def build_data(cfg: DataConfig) -> Data:
    if cfg.name != "digits":
        raise RunError(f"data.name={cfg.name!r} has no builder; add one in data.py (see the README)")
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    targets = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(SPLIT_SEED))
    num_val = int(len(inputs) * cfg.val_fraction)
    if not 0 < num_val < len(inputs):
        raise RunError(
            f"data.val_fraction={cfg.val_fraction} leaves {num_val} of {len(inputs)} samples for validation; "
            f"both training and validation need some: try data.val_fraction=0.2"
        )
    val, train = order[:num_val], order[num_val:]
    return Data(
        train=TensorDataset(inputs[train], targets[train]),
        val=TensorDataset(inputs[val], targets[val]),
        num_features=inputs.shape[1],
        num_classes=int(targets.max()) + 1,
    )


class EpochSampler(Sampler[int]):
    """Shuffles each epoch with a permutation drawn from (seed, epoch) alone, so any position of
    any epoch can be replayed without saving generator state; `start` skips the samples that the
    run has already trained on. Sampling happens in the main process, so this holds with workers."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.epoch, self.start = 0, 0

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return iter(torch.randperm(self.size, generator=generator)[self.start :].tolist())

    def __len__(self) -> int:
        return max(self.size - self.start, 0)


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch


def build_loader(dataset: Dataset, cfg: DataConfig, device: DeviceConfig, seed: int) -> DataLoader:
    if len(dataset) < cfg.batch_size:
        raise RunError(
            f"data.batch_size={cfg.batch_size} is larger than the {len(dataset)} training samples, so no "
            f"full batch exists; use data.batch_size={len(dataset)} or less"
        )
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=EpochSampler(len(dataset), seed),
        drop_last=True,  # equal batches: a position is a batch count
        num_workers=cfg.num_workers,
        pin_memory=device.pin_memory,
        # Its own generator, reseeded each epoch by `batches`: without one, every new iterator
        # draws worker seeds from the global torch generator, and a resumed run's dropout masks
        # would drift from the unbroken run's. Torch seeds each worker's random, NumPy and torch
        # generators from it: workers draw apart, and draw the same in the same epoch of any run
        # that starts that epoch (a mid-epoch resume gives the rest of the epoch fresh draws).
        generator=torch.Generator(),
    )


def batches(loader: DataLoader, position: Position) -> Iterator[list[torch.Tensor]]:
    """Endless batches from `position` on, advancing it as they are handed out."""
    sampler = loader.sampler
    assert isinstance(sampler, EpochSampler)
    while True:
        sampler.set_position(position.epoch, position.batch * loader.batch_size)
        loader.generator.manual_seed(epoch_seed(sampler.seed, position.epoch))
        for batch in loader:
            position.batch += 1
            yield batch
        position.epoch += 1
        position.batch = 0

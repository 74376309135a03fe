"""The runner's side of the data: the order in which samples are drawn, which lets a run resume
mid-epoch, and the loaders. The datasets themselves come from the `data` component (datasets.py).

`EpochSampler` and `batches` are what make a resumed run see exactly the batches an unbroken run
would have seen.
"""

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, Sampler

from .config import DeviceConfig
from .errors import RunError


@dataclass
class Data:
    """What a `data` component returns: the datasets, and what a model needs to know of them."""

    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]  # of one sample's input
    num_classes: int


@dataclass
class Position:
    """Where the data stream stands: `batch` batches of epoch `epoch` have been consumed. A
    checkpoint part (state_dict, load_state_dict)."""

    epoch: int = 0
    batch: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if set(state) != {"epoch", "batch"} or any(type(value) is not int or value < 0 for value in state.values()):
            raise ValueError(f"a data position is two counts, epoch and batch; found {state}")
        self.epoch, self.batch = state["epoch"], state["batch"]


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


def build_loader(dataset: Dataset, cfg: DictConfig, device: DeviceConfig, seed: int) -> DataLoader:
    """The training loader: `data.batch_size` samples a batch, in the order of `EpochSampler`."""
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
        num_workers=cfg.get("num_workers", 0),
        pin_memory=device.pin_memory,
        # Its own generator, reseeded each epoch by `batches`: without one, every new iterator
        # draws worker seeds from the global torch generator, and a resumed run's dropout masks
        # would drift from the unbroken run's. Torch seeds each worker's random, NumPy and torch
        # generators from it: workers draw apart, and draw the same in the same epoch of any run
        # that starts that epoch (a mid-epoch resume gives the rest of the epoch fresh draws).
        generator=torch.Generator(),
    )


def evaluation_loader(dataset: Dataset, batch_size: int, num_workers: int, device: DeviceConfig) -> DataLoader:
    """In order, every sample once. Its own generator: a loader without one draws its seed from
    the global generator, and evaluating would then shift the random numbers of training."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=device.pin_memory,
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

"""The loaders: the order in which a run draws its samples, which lets it resume mid-epoch
(`EpochSampler`, and `batches`, what make a resumed run see exactly the batches an unbroken run
would have seen), over the datasets the `data` component gives (contract.py)."""

from collections.abc import Iterator
from fractions import Fraction
from functools import partial

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset, IterableDataset, Sampler, Subset, TensorDataset

from ..config import DeviceConfig
from ..distributed import World
from ..errors import RunError
from .order import SHUFFLED, epoch_order
from .position import Position
from .streams import StreamLoader
from .workers import Loader

DRAWN_AT_ONCE = 4096  # samples of the order computed together: 32 KB


class EpochSampler(Sampler[int | torch.Tensor]):
    """Shuffles each epoch with a permutation drawn from (seed, epoch) alone, so any position of
    any epoch can be replayed without saving generator state; `start` skips the samples that the
    run has already trained on. Each step's samples are computed as it comes (order.py), so neither
    the dataset's size nor the position costs memory or time. Sampling happens in the main process,
    so this holds with workers.

    With several processes, each global batch (`batch_size` samples per process) is cut from the
    one permutation, rank 0 taking its first `batch_size`, rank 1 the next, and so on: together
    they train on what one process would with a batch `world_size` times larger. With `accumulated`
    batches a step (trainer.grad_accum_steps), a rank's share is `accumulated` batches in a row, and
    an epoch ends with the last whole step: each step trains on the samples, and each rank on the
    share, of a batch `accumulated` times larger, epoch after epoch.

    It yields sample indices, or with `whole_batches` each batch's indices as one tensor, for a
    dataset that takes a batch in one lookup."""

    def __init__(
        self,
        size: int,
        seed: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        whole_batches: bool = False,
        accumulated: int = 1,
    ) -> None:
        self.size, self.seed, self.batch_size, self.rank, self.world_size = size, seed, batch_size, rank, world_size
        self.whole_batches, self.accumulated = whole_batches, accumulated
        self.epoch, self.start, self.order = 0, 0, SHUFFLED

    def set_position(self, position: Position) -> None:
        self.epoch, self.start, self.order = position.epoch, position.sample, position.order

    def __iter__(self) -> Iterator[int | torch.Tensor]:
        drawn = epoch_order(self.order, self.size, epoch_seed(self.seed, self.epoch))
        share = self.accumulated * self.batch_size  # this rank's samples of each step
        steps = max(self.size - self.start, 0) // self.step_size  # whole steps only
        # Steps drawn in one call: the order's cost is numpy's per call, not per sample, and a call a
        # step capped the loader at about 8,000 samples a second (bench/shards.py).
        at_once = max(1, DRAWN_AT_ONCE // share)
        for block in range(0, steps, at_once):
            count = min(at_once, steps - block)
            firsts = self.start + (block + np.arange(count)) * self.step_size + self.rank * share
            positions = (firsts[:, None] + np.arange(share)).reshape(-1)
            mine = torch.from_numpy(drawn(positions)).view(count * self.accumulated, self.batch_size)
            if self.whole_batches:
                yield from mine
            else:
                yield from mine.view(-1).tolist()

    def __len__(self) -> int:
        batches = max(self.size - self.start, 0) // self.step_size * self.accumulated
        return batches if self.whole_batches else batches * self.batch_size

    @property
    def step_size(self) -> int:
        """Samples an optimizer step takes from the permutation, over all processes."""
        return self.world_size * self.accumulated * self.batch_size


def global_batch(config: DictConfig | dict, processes: int) -> int:
    """Samples an optimizer step trains on: `data.batch_size` per process and accumulated batch."""
    return config["data"]["batch_size"] * config["trainer"]["grad_accum_steps"] * processes


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch


def rank_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of a rank's loader workers in `epoch`: apart for each rank, since workers that
    augment must not draw the same for different samples."""
    return epoch_seed(seed, epoch) + 7919 * rank


def build_loader(
    dataset: Dataset, cfg: DictConfig, device: DeviceConfig, seed: int, world: World, accumulated: int = 1
) -> Loader | StreamLoader:
    """This process's training loader: `data.batch_size` samples a batch, `accumulated` batches a
    step (trainer.grad_accum_steps), its share of each step in the order of `EpochSampler`, or of a
    stream (streams.py)."""
    if isinstance(dataset, IterableDataset):
        settings = {
            "num_workers": cfg.get("num_workers", 0),
            "pin_memory": device.pin_memory,
            "generator": torch.Generator(),  # reseeded each epoch, as below
        }
        seeds = partial(rank_seed, seed, world.rank)
        return StreamLoader(dataset, cfg.batch_size, accumulated, world, cfg.get("lanes"), settings, seeds)
    if len(dataset) < cfg.batch_size * accumulated * world.size:
        times = f" x {accumulated} accumulated" if accumulated > 1 else ""
        processes = f" x {world.size} processes" if world.size > 1 else ""
        raise RunError(
            f"data.batch_size={cfg.batch_size}{times}{processes} is larger than the {len(dataset)} training samples, "
            f"so no full step exists; use data.batch_size={len(dataset) // (accumulated * world.size)} or less"
        )
    # A TensorDataset takes a batch of indices in one indexing of each tensor: fetched a sample at
    # a time and stacked, the demo's batches took as long as its model's step.
    whole_batches = isinstance(dataset, TensorDataset)
    return Loader(
        dataset,
        batch_size=None if whole_batches else cfg.batch_size,  # None: each index the sampler yields is a batch
        sampler=EpochSampler(len(dataset), seed, cfg.batch_size, world.rank, world.size, whole_batches, accumulated),
        drop_last=not whole_batches,  # equal batches: a position is a count of whole global batches
        num_workers=cfg.get("num_workers", 0),
        pin_memory=device.pin_memory,
        # Its own generator, reseeded each epoch by `batches`: without one, every new iterator
        # draws worker seeds from the global torch generator, and a resumed run's dropout masks
        # would drift from the unbroken run's. Torch seeds each worker's random, NumPy and torch
        # generators from it: workers draw apart, and draw the same in the same epoch of any run
        # that starts that epoch (a mid-epoch resume gives the rest of the epoch fresh draws).
        generator=torch.Generator(),
    )


def evaluation_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    device: DeviceConfig,
    world: World | None = None,
    limit: int | float = 1.0,
) -> Loader:
    """In order, every sample once, or the first ones that `limit` (trainer.limit_val_batches,
    `validated`) keeps; with a `world`, this process's share of them: every world.size-th sample (the
    metrics then add up the shares, validation.py). Its own generator: a loader without one draws its
    seed from the global generator, and evaluating would then shift the random numbers of training."""
    samples = validated(len(dataset), batch_size, limit)
    share = range(world.rank, samples, world.size) if world is not None else range(samples)
    settings = {
        "num_workers": num_workers,
        "pin_memory": device.pin_memory,
        "generator": torch.Generator(),
    }
    if isinstance(dataset, TensorDataset):  # a batch in one lookup, as in build_loader; an empty share, no batch
        lookups = torch.tensor(share, dtype=torch.long).split(batch_size) if share else ()
        return Loader(dataset, batch_size=None, sampler=lookups, **settings)
    return Loader(Subset(dataset, share), batch_size=batch_size, **settings)


def validated(size: int, batch_size: int, limit: int | float) -> int:
    """How many of a validation split's `size` samples, from its first, trainer.limit_val_batches=`limit`
    keeps: an integer, that many batches of `batch_size` (over all processes together, so that every
    number of processes validates the same samples); a fraction, that share of them (of the decimal
    as written: 0.57 of 100 is 57, where the float's product is 56.99...), at least one."""
    if isinstance(limit, int):
        return min(size, limit * batch_size)
    return max(1, int(Fraction(repr(limit)) * size))


def batches(loader: Loader | StreamLoader, position: Position) -> Iterator[list[torch.Tensor]]:
    """Endless batches from `position` on, advancing it by a global batch as each is handed out."""
    if isinstance(loader, StreamLoader):
        yield from loader.batches(position)
        return
    sampler = loader.sampler
    assert isinstance(sampler, EpochSampler)
    while True:
        sampler.set_position(position)
        loader.generator.manual_seed(rank_seed(sampler.seed, sampler.rank, position.epoch))
        for batch in loader:
            position.sample += sampler.batch_size * sampler.world_size
            yield batch
        position.epoch += 1
        position.sample = 0

"""The runner's side of the data: the order in which samples are drawn, which lets a run resume
mid-epoch, and the loaders. The datasets themselves come from the `data` component (datasets.py),
which reads its files with `read_file`.

`EpochSampler` and `batches` are what make a resumed run see exactly the batches an unbroken run
would have seen.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset, IterableDataset, Sampler, Subset, TensorDataset

from . import components
from .checkpoint.files import NotRegular, read_regular
from .config import DeviceConfig
from .distributed import World
from .errors import RunError
from .order import LISTED, SHUFFLED, epoch_order
from .streams import LANES, STREAM, StreamLoader
from .workers import Loader


class Data:
    """What a `data` component returns: the datasets, and facts about them that the other
    components may need, each given to a constructor parameter of its name (components.py):
    `Data(train, val, input_shape=(1, 8, 8), num_classes=10)` for the digits,
    `Data(train, val, vocab_size=98, block_size=64)` for a language model. A `test` split, if
    given, is held out of training and validation alike: only eval.py reads it."""

    def __init__(self, train: Dataset, val: Dataset, test: Dataset | None = None, **facts: Any) -> None:
        self.train, self.val, self.test, self.facts = train, val, test, facts

    def state_dict(self) -> dict:
        """A checkpoint part: what the training split says it is, where it can tell (the ready
        token shards record theirs, ready/shards.py), so that a resume on other data is refused."""
        return self.train.state_dict() if hasattr(self.train, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if state and hasattr(self.train, "load_state_dict"):
            self.train.load_state_dict(state)


class DataError(RunError):
    """A problem with the data that the person running the job can fix (a shard changed since the
    checkpoint, a file damaged under the run), raised by a data component at build, at a resume or
    mid-run, and said in one line without a traceback: a ValueError is one only at build time."""


def read_file(path: Path) -> bytes:
    """The bytes of `path`, a file of a data component's (a `<label>.txt`); refused, in one line that
    names it (ValueError), where it is no regular file or cannot be read. Opened without blocking: a
    FIFO would hold the run, its home locked, waiting for a writer that may never come."""
    try:
        return read_regular(path)
    except NotRegular as refused:
        reason = f"it is {refused.what}, not a file"
    except OSError as error:
        reason = error.strerror or type(error).__name__
    raise ValueError(f"cannot read {path} ({reason}); put a readable file there, or move it out of the data's folder")


def build_data(cfg: DictConfig) -> Data:
    """The `data` component, which must return a Data."""
    data = components.build("data", cfg)
    if not isinstance(data, Data):
        raise RunError(f"data ({cfg._target_}) returned a {type(data).__name__}; it must return data.Data")
    for split in ("val", "test"):
        if isinstance(getattr(data, split), IterableDataset):
            raise RunError(
                f"data ({cfg._target_}) gave a stream as its {split} split; validation reads every sample of a "
                f"dataset with a length (and the continuity probe picks some): give it one, a stream only for train"
            )
    return data


@dataclass
class Position:
    """Where the data stands: `sample` samples of epoch `epoch` have been trained on, over all
    processes, so that a resume with another number of processes continues the same order; the
    `order` the samples are drawn in (order.py, streams.py), and for a stream the `layout` it is
    read in (its lanes; or the processes and workers that read one without lanes). A checkpoint
    part (state_dict, load_state_dict): a few integers and a name."""

    epoch: int = 0
    sample: int = 0
    order: str = SHUFFLED
    layout: dict[str, int] = field(default_factory=dict)

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "sample": self.sample, "order": self.order, **self.layout}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        # A checkpoint written before the orders were named was drawn in the one there was then.
        drawn = state.get("order", LISTED)
        if drawn not in LAYOUTS:
            raise ValueError(f"a data position's order is one of {', '.join(LAYOUTS)}; found {drawn!r}")
        counts = {key: value for key, value in state.items() if key != "order"}
        if set(counts) != {"epoch", "sample", *LAYOUTS[drawn]} or any(
            type(value) is not int or value < 0 for value in counts.values()
        ):
            raise ValueError(
                f"a data position is {', '.join(['epoch', 'sample', *LAYOUTS[drawn]])}, counts; found {state}"
            )
        self.epoch, self.sample, self.order = state["epoch"], state["sample"], drawn
        self.layout = {key: counts[key] for key in LAYOUTS[drawn]}


# What each order's position holds beyond the epoch and the sample.
LAYOUTS = {SHUFFLED: (), LISTED: (), LANES: ("lanes",), STREAM: ("processes", "workers")}


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
    metrics then add up the shares, evaluation.py). Its own generator: a loader without one draws its
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

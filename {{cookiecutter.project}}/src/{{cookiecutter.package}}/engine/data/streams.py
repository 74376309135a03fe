"""Training data that is a stream: a `torch.utils.data.IterableDataset` of yours, read in order
rather than by index (a corpus in shards, a generator). The run's data position counts the samples
trained on over all processes, as for a dataset with a length (position.py, loaders.py).

A stream that offers its samples in lanes resumes exactly on any number of processes and workers:
`lane(index, lanes, start)` returns an iterator over the samples of lane `index` of `lanes`, from
its `start`-th sample on (a shard list split by lane, a generator seeded by lane). The run fixes the
number of lanes when it starts (`data.lanes`), and each optimizer step takes the same number of
samples from every lane, the next ones of each: so the samples of every step are the same whatever
the processes and workers that read them, and a position is just the samples taken per lane. Each
process reads a block of the lanes, each of its workers a block of those, a step's samples of one
lane at a time; the process puts its share of the step together in lane order. An epoch ends when
a lane does, and the next one reads every lane from its start again.

A stream without `lane` is read as it is, by each process and its workers (sharding it among them
is the stream's own business: torch.utils.data.get_worker_info, the process's rank): a resume skips
the batches already trained on, and so continues exactly only on the same processes and workers.
"""

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ..errors import RunError
from .workers import Loader

LANES = "lanes"  # a stream read in lanes
STREAM = "stream"  # a stream read as it is
DEFAULT_LANES = 64
WAYS = {LANES: "in lanes", STREAM: "as a stream without lanes", "feistel": "by index", "randperm": "by index"}


def has_lanes(dataset: IterableDataset) -> bool:
    return callable(getattr(dataset, "lane", None))


def lanes_for(setting: int | None, step_size: int, readers: int) -> int:
    """The number of lanes a new run cuts its stream into: the setting, refused in one line unless
    it divides the global batch (`step_size` samples) and the processes x workers (`readers`)
    divide it."""
    lanes = setting or DEFAULT_LANES
    if step_size % lanes:
        works = [n for n in range(1, step_size + 1) if step_size % n == 0 and n % readers == 0]
        raise RunError(
            f"data.lanes={lanes} does not divide the {step_size} samples of a step (data.batch_size x "
            f"trainer.grad_accum_steps x processes); set data.lanes to one of {', '.join(map(str, works)) or 'none'}"
        )
    check_readers(lanes, readers)
    return lanes


def check_readers(lanes: int, readers: int) -> None:
    if lanes % readers:
        works = [n for n in range(1, lanes + 1) if lanes % n == 0]
        raise RunError(
            f"{readers} readers (processes x data.num_workers) cannot share this run's {lanes} lanes; use processes "
            f"and workers whose product divides {lanes}: {', '.join(map(str, works))}"
        )


class LaneReader(IterableDataset):
    """What a process's workers read of the lanes `mine`: each a block of them, from sample `start`
    of each, `per_lane` samples of each lane a step, collated and tagged with its lane. A lane that
    ends gives (lane, None): the epoch is over."""

    def __init__(self, stream: IterableDataset, lanes: int, mine: range, start: int, per_lane: int) -> None:
        self.stream, self.lanes, self.mine, self.start, self.per_lane = stream, lanes, mine, start, per_lane

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        block = len(self.mine) // workers
        own = self.mine[worker * block : (worker + 1) * block]
        readers = [iter(self.stream.lane(lane, self.lanes, self.start)) for lane in own]
        while True:
            for lane, reader in zip(own, readers, strict=True):
                chunk = list(itertools.islice(reader, self.per_lane))
                if len(chunk) < self.per_lane:
                    yield lane, None
                    return
                yield lane, default_collate(chunk)


class StreamLoader:
    """This process's training batches from a stream, `accumulated` batches of `batch_size` a step,
    with the Loader `settings` of loaders.py; `seeds(epoch)` seeds its workers' generators."""

    def __init__(
        self,
        stream: IterableDataset,
        batch_size: int,
        accumulated: int,
        world: Any,
        lanes: int | None,
        settings: dict,
        seeds: Callable[[int], int],
    ) -> None:
        self.stream, self.batch_size, self.accumulated, self.setting = stream, batch_size, accumulated, lanes
        self.rank, self.processes, self.settings, self.seeds = world.rank, world.size, settings, seeds
        self.workers = settings["num_workers"]
        self.step_size = batch_size * accumulated * world.size

    def batches(self, position: Any) -> Iterator[Any]:
        """Endless batches from `position` on, advancing it by a global batch as each is handed out."""
        order = LANES if has_lanes(self.stream) else STREAM
        if position.epoch == position.sample == 0 and position.order not in (LANES, STREAM):  # a fresh start
            readers = self.processes * max(self.workers, 1)
            position.order = order
            position.layout = (
                {"lanes": lanes_for(self.setting, self.step_size, readers)}
                if order == LANES
                else {"processes": self.processes, "workers": self.workers}
            )
        if position.order != order:
            raise RunError(
                f"this run's data was read {WAYS[position.order]}, and it is now {WAYS[order]} "
                f"({type(self.stream).__name__}); resume with the data it trained on, or start a new run with "
                f"name=<new name>"
            )
        yield from (self._lanes(position) if order == LANES else self._as_it_is(position))

    def _loader(self, dataset: IterableDataset, epoch: int, **settings: Any) -> Loader:
        self.settings["generator"].manual_seed(self.seeds(epoch))
        return Loader(dataset, **settings, **self.settings)

    def _lanes(self, position: Any) -> Iterator[Any]:
        lanes = position.layout["lanes"]
        if self.setting is not None and self.setting != lanes:
            raise RunError(
                f"data.lanes={self.setting}, but this run cut its stream into {lanes} lanes when it started, and the "
                f"samples of each step follow from that; resume with data.lanes={lanes}, or start a new run with "
                f"name=<new name>"
            )
        check_readers(lanes, self.processes * max(self.workers, 1))
        if self.step_size % lanes:
            raise RunError(
                f"this run's {lanes} lanes do not divide the {self.step_size} samples of a step now; resume with the "
                f"data.batch_size, trainer.grad_accum_steps and processes whose product it divides"
            )
        per_lane, block = self.step_size // lanes, lanes // self.processes
        mine = range(self.rank * block, (self.rank + 1) * block)
        source = f"{type(self.stream).__module__}.{type(self.stream).__qualname__}.lane"
        while True:
            reader = LaneReader(self.stream, lanes, mine, position.sample // lanes, per_lane)
            chunks = iter(self._loader(reader, position.epoch, batch_size=None))
            while True:
                step = dict(itertools.islice(chunks, len(mine)))
                if len(step) < len(mine) or any(chunk is None for chunk in step.values()):
                    break
                share = joined([step[lane] for lane in mine], source)
                for first in range(0, self.batch_size * self.accumulated, self.batch_size):
                    position.sample += self.batch_size * self.processes
                    yield cut(share, first, first + self.batch_size)
            if not position.sample:
                raise RunError(
                    f"a lane of the stream ({type(self.stream).__name__}) gave fewer than {per_lane} samples"
                )
            position.epoch += 1
            position.sample = 0

    def _as_it_is(self, position: Any) -> Iterator[Any]:
        if position.layout != {"processes": self.processes, "workers": self.workers}:
            raise RunError(
                f"this run's stream ({type(self.stream).__name__}) has no lane(index, lanes, start), so it continues "
                f"exactly only as it was read: by {position.layout['processes']} processes and "
                f"data.num_workers={position.layout['workers']}; resume with those, or give the stream a lane method "
                f"(docs/your-code.md)"
            )
        while True:
            loader = self._loader(self.stream, position.epoch, batch_size=self.batch_size, drop_last=True)
            trained = position.sample // (self.batch_size * self.processes)
            for batch in itertools.islice(loader, trained, None):
                position.sample += self.batch_size * self.processes
                yield batch
            if not position.sample:
                raise RunError(
                    f"the stream ({type(self.stream).__name__}) gave no batch of data.batch_size={self.batch_size}"
                )
            position.epoch += 1
            position.sample = 0


def joined(parts: list[Any], source: str, where: str = "") -> Any:
    """Collated batches as one: tensors concatenated along their first dimension, at any depth;
    refused in one line naming `source`, what gave the samples, where they hold anything else."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {key: joined([part[key] for part in parts], source, f"{where}[{key!r}]") for key in first}
    if isinstance(first, list | tuple) and not any(isinstance(item, str | bytes) for item in first):
        return type(first)(
            joined(list(values), source, f"{where}[{place}]") for place, values in enumerate(zip(*parts, strict=True))
        )
    found = type(first[0] if isinstance(first, list | tuple) else first).__name__
    raise RunError(
        f"{source} gave samples whose {f'item {where}' if where else 'value'} is a {found}, and a step of lanes "
        f"joins tensors alone; make it yield numbers, arrays or tensors (text as token ids), or tuples and dicts of them"
    )


def cut(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a collated batch."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {key: cut(value, start, stop) for key, value in batch.items()}
    return type(batch)(cut(value, start, stop) for value in batch)

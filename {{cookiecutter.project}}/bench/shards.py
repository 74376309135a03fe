"""What reading token shards through the project costs: samples per second from local shards through
the training loader (engine/data/formats/shards.py's windows in the order of engine/data.py) against a raw
reader of the same files (numpy memory maps, the same windows in the same order, torch's DataLoader),
with 0 and 2 workers; and the time a resume mid-epoch waits for its first batch.

    python bench/shards.py [--shards 8] [--shard-tokens 4e6] [--block-size 1024] [--batches 200]

Target: the project's loader at 0.9x of the raw reader or better. The shards are random tokens,
written to a temporary folder and removed after.
"""

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from {{cookiecutter.package}}.engine.data.formats.shards import described, token_shards
from {{cookiecutter.package}}.engine.data.loaders import batches, build_loader
from {{cookiecutter.package}}.engine.data.position import Position
from {{cookiecutter.package}}.engine.distributed import World


class RawWindows(Dataset):
    """The same windows as the project's, from memory maps: what a hand-written reader does."""

    def __init__(self, paths: list[Path], block_size: int) -> None:
        self.paths, self.block_size = paths, block_size
        self.maps: list[np.memmap] | None = None  # opened in the process that reads
        counts = [(path.stat().st_size // 2 - 1) // block_size for path in paths]
        self.starts = np.cumsum([0, *counts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.maps is None:
            self.maps = [np.memmap(path, dtype=np.uint16, mode="r") for path in self.paths]
        number = int(np.searchsorted(self.starts, index, side="right")) - 1
        first = (index - int(self.starts[number])) * self.block_size
        window = torch.from_numpy(self.maps[number][first : first + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def rate(loader, count: int) -> float:
    """Samples a second over `count` batches, after the first (the workers' start)."""
    iterator = iter(loader)
    next(iterator)
    began, samples = time.perf_counter(), 0
    for _ in range(count):
        samples += len(next(iterator)[0])
    return samples / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-tokens", type=float, default=4e6)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200, help="batches timed a measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements; the best is shown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        generator = np.random.default_rng(0)
        for number in range(args.shards):
            tokens = generator.integers(0, 50304, int(args.shard_tokens), dtype=np.uint16)
            tokens.tofile(Path(folder) / f"shard_{number:05d}.bin")
        described(Path(folder), "uint16", vocab_size=50304)
        began = time.perf_counter()
        data = token_shards(Path(folder), args.block_size, val_shards=1)
        checked = time.perf_counter() - began
        raw = RawWindows([data.train.folder / shard.file for shard in data.train.shards], args.block_size)
        print(f"{len(data.train)} training windows of {args.block_size + 1} tokens in {args.shards - 1} shards")
        print(f"manifest checked in {checked * 1000:.1f} ms (a stat a shard)")
        compare(data.train, raw, int, args, "raw memmap", ">= 0.9")


def compare(dataset: Dataset, raw: Dataset, index_of: Callable[[int], int], args, against: str, target: str) -> None:
    """Samples a second of the training loader of `dataset` and of a plain DataLoader of `raw` given
    the same samples in the same order (`index_of` a sample of `dataset`, its index in `raw`), with 0
    and 2 workers; then the wait of a resume at 50% of the epoch for its first batch."""
    world = World(torch.device("cpu"))
    for workers in (0, 2):
        cfg = OmegaConf.create({"batch_size": args.batch_size, "num_workers": workers})
        loader = build_loader(dataset, cfg, OmegaConf.create({"pin_memory": False}), seed=0, world=world)
        order = [index_of(index) for index in loader.sampler]
        plain = DataLoader(raw, batch_size=args.batch_size, sampler=order, num_workers=workers)
        # Taken in turns, the best of each: a machine whose load changes meanwhile favours neither.
        turns = []
        for _ in range(args.repeats):
            turns.append((rate(batches(loader, Position()), args.batches), rate(plain, args.batches)))
        ours, theirs = np.max(turns, axis=0)
        print(
            f"num_workers={workers}: project {ours:,.0f} samples/s, {against} {theirs:,.0f} samples/s, "
            f"ratio {ours / theirs:.2f} (target {target})"
        )
        position = Position(epoch=0, sample=len(dataset) // 2 // args.batch_size * args.batch_size)
        began = time.perf_counter()
        next(batches(loader, position))
        print(f"num_workers={workers}: a resume at 50% of the epoch waits {time.perf_counter() - began:.3f} s")


if __name__ == "__main__":
    main()

"""The order of an epoch: which sample the training data gives at each position, a pure function of
the run's seed, the epoch and the dataset's size, computed for the positions asked for and never
listed whole. So an epoch of a billion samples costs no memory, and any position of it, the first
batch of a resume included, costs the same as the first.

`Shuffle` permutes the integers below 4^h, the smallest power of four that holds the dataset, with a
keyed Feistel network (the way Google's Grain orders its records): each round swaps the two h-bit
halves and mixes one into the other with a hash keyed by (seed, epoch, round), which is a bijection
whatever the hash. A position whose image falls past the dataset's end is permuted again until it
lands inside ("cycle-walking"): that follows the permutation's own cycle, so the result is still a
bijection of [0, size), and as the domain is less than four times the size, a few passes do.

Checkpoints written before this order existed hold a data position without its `order`: they
resume in theirs (`LISTED`, a torch.randperm of the epoch), so their runs continue as they began.
"""

import numpy as np
import torch

SHUFFLED = "feistel"
LISTED = "randperm"  # the order of checkpoints that name none
ORDERS = (SHUFFLED, LISTED)
ROUNDS = 6
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio, splitmix64's increment


class Shuffle:
    """A permutation of [0, size), drawn from `key` (the run's seed and the epoch, epoch_seed):
    `shuffle(positions)` gives the sample at each position, as an int64 array."""

    def __init__(self, size: int, key: int) -> None:
        if size < 1:
            raise ValueError(f"an order needs at least one sample; size={size}")
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)  # bits of each half: 4^half >= size
        # splitmix64's sequence of round keys, from the key taken as 64 bits
        self.keys = [mix(np.uint64((key + GOLDEN * (round + 1)) % 2**64)) for round in range(ROUNDS)]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if positions.size and (positions.min() < 0 or positions.max() >= self.size):
            raise IndexError(f"positions must lie in [0, {self.size})")
        found = self._permute(positions.astype(np.uint64))
        outside = np.flatnonzero(found >= self.size)
        while outside.size:
            found[outside] = self._permute(found[outside])
            outside = outside[found[outside] >= self.size]
        return found.astype(np.int64)

    def _permute(self, values: np.ndarray) -> np.ndarray:
        bits = np.uint64(self.half)
        low = np.uint64((1 << self.half) - 1)
        left, right = values >> bits, values & low
        for key in self.keys:
            left, right = right, left ^ (mix(right ^ key) & low)
        return (left << bits) | right


def mix(values: np.ndarray | np.uint64) -> np.ndarray | np.uint64:
    """splitmix64's finalizer: every bit of the result depends on every bit of `values`. numpy's
    unsigned arithmetic wraps around, as the hash needs."""
    with np.errstate(over="ignore"):
        values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return values ^ (values >> np.uint64(31))


class Listed:
    """The order of checkpoints that name none: the epoch's torch.randperm, listed whole."""

    def __init__(self, size: int, key: int) -> None:
        self.permutation = torch.randperm(size, generator=torch.Generator().manual_seed(key)).numpy()

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self.permutation[positions]


def epoch_order(order: str, size: int, key: int) -> Shuffle | Listed:
    """The epoch whose permutation `key` draws, in `order`: a function from positions to samples."""
    return Shuffle(size, key) if order == SHUFFLED else Listed(size, key)

"""The order of an epoch (engine/data/order.py): a permutation at every size, computed per position, that a
resume at any position continues exactly; checkpoints from before it resume in the order they had."""

import copy
import tracemalloc

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from {{cookiecutter.package}}.engine.data.loaders import EpochSampler, batches, build_loader, epoch_seed
from {{cookiecutter.package}}.engine.data.order import LISTED, SHUFFLED, Shuffle
from {{cookiecutter.package}}.engine.data.position import Position
from {{cookiecutter.package}}.engine.distributed import World

BILLION = 10**9


@pytest.mark.parametrize("key", [0, 1, -7, 2**70 + 3])
def test_each_epoch_is_a_permutation_at_every_small_size(key):
    for size in [*range(1, 300), 1023, 1024, 1025, 4095, 4096, 4097]:
        drawn = Shuffle(size, key)(np.arange(size))
        assert np.array_equal(np.sort(drawn), np.arange(size)), size


def test_epochs_and_seeds_draw_orders_of_their_own():
    orders = {tuple(Shuffle(1000, epoch_seed(seed, epoch))(np.arange(1000))) for seed in (0, 1) for epoch in range(5)}
    assert len(orders) == 10
    assert tuple(range(1000)) not in orders


def test_a_billion_samples_are_drawn_distinct_and_evenly_from_anywhere_in_the_epoch():
    shuffle = Shuffle(BILLION, epoch_seed(0, 3))
    for first in (0, BILLION // 2, BILLION - 100_000):
        drawn = shuffle(np.arange(first, first + 100_000))
        assert drawn.min() >= 0 and drawn.max() < BILLION
        assert len(np.unique(drawn)) == len(drawn)
        # 100 equal ranges of samples, 1,000 draws expected in each: a chi-square of 99 degrees of
        # freedom past 160 happens by chance once in ten thousand; seeded, this one is what it is.
        counts = np.bincount(drawn // (BILLION // 100), minlength=100)
        assert ((counts - 1000) ** 2 / 1000).sum() < 160
        # Neighbouring positions land far apart: no trace of the positions' order is left.
        assert abs(np.corrcoef(np.arange(len(drawn)), drawn)[0, 1]) < 0.02


def test_the_sampler_lists_no_epoch_whatever_the_size():
    """The samples of each step are computed as they are drawn: the first batch of an epoch of ten
    million samples, at its start or near its end, allocates kilobytes, not a list of the epoch."""
    for start in (0, 9_999_000):
        sampler = EpochSampler(10_000_000, seed=0, batch_size=32, rank=1, world_size=2)
        sampler.set_position(Position(epoch=1, sample=start))
        tracemalloc.start()
        first = [next(iter(sampler)) for _ in range(32)]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(first) == 32 and peak < 1_000_000, f"{peak} bytes to draw a batch at sample {start}"


def stream(size: int, position: Position, world: World | None = None):
    dataset = TensorDataset(torch.arange(size))
    cfg = OmegaConf.create({"batch_size": 4, "num_workers": 0})
    device = OmegaConf.create({"pin_memory": False})
    world = world or World(torch.device("cpu"))
    return batches(build_loader(dataset, cfg, device, seed=5, world=world, accumulated=2), position)


@pytest.mark.parametrize("cuts", [(3,), (6,), (6, 7, 19), (1, 2, 3)], ids=str)
def test_a_resume_at_any_position_continues_the_order_exactly(cuts):
    """Steps of 8 samples (4 a batch, 2 batches a step) from 50: 6 steps an epoch, 2 samples left
    out of each. A cut at 6 falls at the end of an epoch; three cuts in a row resume thrice."""
    unbroken = [batch[0].tolist() for batch, _ in zip(stream(50, Position()), range(2 * 24), strict=False)]
    resumed, position = [], Position()
    for cut in (*cuts, 24):
        drawn = stream(50, position)
        while len(resumed) < 2 * cut:
            resumed.append(next(drawn)[0].tolist())
        position = copy.deepcopy(position)  # what a checkpoint holds, restored into a new process
    assert resumed == unbroken
    # Each epoch is 48 distinct samples of the 50, and the next epoch another order.
    epochs = [sum(unbroken[i : i + 12], []) for i in range(0, 48, 12)]
    assert all(len(set(epoch)) == 48 for epoch in epochs) and epochs[0] != epochs[1]


def test_a_checkpoint_that_names_no_order_resumes_in_the_order_it_was_trained_in():
    """Before the orders were named, each epoch was torch.randperm of (seed, epoch), cut into global
    steps of which each rank takes its share: such a run goes on drawing exactly that."""
    position = Position()
    position.load_state_dict({"epoch": 2, "sample": 24})
    assert position.order == LISTED
    permutation = torch.randperm(100, generator=torch.Generator().manual_seed(epoch_seed(0, 2)))
    for rank in (0, 1):
        sampler = EpochSampler(100, seed=0, batch_size=3, rank=rank, world_size=2, whole_batches=True)
        sampler.set_position(position)
        steps = permutation[24:96].view(12, 2, 1, 3)[:, rank].reshape(-1, 3)  # as the old sampler cut it
        assert [batch.tolist() for batch in sampler] == steps.tolist()


def test_a_new_run_saves_its_order_and_an_unknown_one_is_refused():
    assert Position().state_dict() == {"epoch": 0, "sample": 0, "order": SHUFFLED}
    with pytest.raises(ValueError, match="order is one of feistel, randperm, lanes, stream; found .zigzag."):
        Position().load_state_dict({"epoch": 0, "sample": 0, "order": "zigzag"})

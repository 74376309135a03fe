"""A stream trains (engine/data/streams.py): in lanes, every step takes the same samples whatever the
processes and workers that read them, across resumes and epochs; without lanes, it resumes on the
processes and workers it was read by, and says so at a resume that changes them."""

import copy
import re

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import IterableDataset, TensorDataset, get_worker_info

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.data.contract import Data
from {{cookiecutter.package}}.engine.data.loaders import batches, build_loader
from {{cookiecutter.package}}.engine.data.position import Position
from {{cookiecutter.package}}.engine.distributed import World
from {{cookiecutter.package}}.engine.errors import RunError

SAMPLES = 640  # 10 a lane of 64


def sample(number: int) -> tuple[torch.Tensor, int]:
    """A digit-shaped image that carries its sample's number, and a label."""
    return torch.full((1, 8, 8), float(number)), number % 10


class Lanes(IterableDataset):
    """Sample n lies in lane n % lanes: a shard list split by lane, read from any start."""

    def lane(self, index: int, lanes: int, start: int):
        yield from (sample(number) for number in range(index + start * lanes, SAMPLES, lanes))

    def __iter__(self):
        return iter(sample(number) for number in range(SAMPLES))


class AsItIs(IterableDataset):
    """A stream without lanes, which its workers share by taking turns."""

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return iter(sample(number) for number in range(worker, SAMPLES, workers))


def steps(stream, processes: int, workers: int, position: Position, count: int, batch_size: int = 4):
    """The sample numbers of each of `count` steps, over all processes: each process's loader as it
    would be in a job of `processes`, 2 batches a step, the step's global batch 16 samples."""
    accumulated = 16 // (batch_size * processes)
    cfg = OmegaConf.create({"batch_size": batch_size, "num_workers": workers, "lanes": 8})
    device = OmegaConf.create({"pin_memory": False})
    ranks, positions = [], []
    for rank in range(processes):
        world = World(torch.device("cpu"), rank=rank, size=processes)
        positions.append(copy.deepcopy(position))
        ranks.append(
            batches(build_loader(stream, cfg, device, seed=0, world=world, accumulated=accumulated), positions[-1])
        )
    drawn = []
    for _ in range(count):
        step = [next(rank)[0][:, 0, 0, 0].long().tolist() for rank in ranks for _ in range(accumulated)]
        drawn.append(sorted(sum(step, [])))
    assert all(vars(other) == vars(positions[0]) for other in positions)  # every rank counts the same
    return drawn, positions[0]


def test_a_stream_in_lanes_trains_each_step_on_the_same_samples_whatever_reads_it():
    """The samples of each step follow from the 8 lanes alone: one process with no workers, one
    with two, two processes with two workers each, and a run stopped at step 3 by two processes and
    continued by one with two workers, at step 7 by one with none, past an epoch's end (40 steps of
    16 samples are the 640), and at step 45 by two again: step after step, the same samples."""
    unbroken, _ = steps(Lanes(), 1, 0, Position(), 50)
    assert all(len(set(step)) == 16 for step in unbroken)
    assert sorted(sum(unbroken[:40], [])) == list(range(SAMPLES))  # an epoch: every sample once
    assert unbroken[40:] == unbroken[:10]  # the next reads every lane from its start again
    assert steps(Lanes(), 1, 2, Position(), 12)[0] == unbroken[:12]
    assert steps(Lanes(), 2, 2, Position(), 12, batch_size=2)[0] == unbroken[:12]
    resumed, position = steps(Lanes(), 2, 0, Position(), 3, batch_size=2)
    for readers, stop in (((1, 2), 7), ((1, 0), 45), ((2, 2), 50)):
        more, position = steps(Lanes(), *readers, position, stop - len(resumed), batch_size=2 if readers[0] == 2 else 4)
        resumed += more
    assert resumed == unbroken
    assert position.state_dict() == {"epoch": 1, "sample": 160, "order": "lanes", "lanes": 8}


def test_lanes_that_the_step_or_the_readers_do_not_divide_are_refused_naming_what_works():
    device = OmegaConf.create({"pin_memory": False})
    cfg = OmegaConf.create({"batch_size": 4, "num_workers": 0, "lanes": 12})
    one = World(torch.device("cpu"))
    with pytest.raises(RunError, match=re.escape("data.lanes=12 does not divide the 8 samples of a step")) as refused:
        next(batches(build_loader(Lanes(), cfg, device, seed=0, world=one, accumulated=2), Position()))
    assert str(refused.value).endswith("set data.lanes to one of 1, 2, 4, 8")
    cfg = OmegaConf.create({"batch_size": 4, "num_workers": 3, "lanes": 8})
    with pytest.raises(RunError, match=re.escape("3 readers (processes x data.num_workers) cannot share")):
        next(batches(build_loader(Lanes(), cfg, device, seed=0, world=one, accumulated=2), Position()))


class Texts(IterableDataset):
    """A stream whose lanes give text where the model wants numbers: bare, or as the first item of a pair."""

    def __init__(self, paired: bool) -> None:
        self.paired = paired

    def lane(self, index: int, lanes: int, start: int):
        texts = (f"sample {number}" for number in range(index + start * lanes, SAMPLES, lanes))
        yield from ((text, 1) for text in texts) if self.paired else texts

    def __iter__(self):
        return self.lane(0, 1, 0)


@pytest.mark.parametrize("paired, said", [(False, "value is a str"), (True, "item [0] is a str")])
def test_a_stream_whose_lanes_give_text_is_refused_in_one_line_naming_its_lane_method_and_the_item(paired, said):
    device = OmegaConf.create({"pin_memory": False})
    cfg = OmegaConf.create({"batch_size": 4, "num_workers": 0, "lanes": 8})
    loader = build_loader(Texts(paired), cfg, device, seed=0, world=World(torch.device("cpu")), accumulated=2)
    with pytest.raises(RunError) as refused:
        next(batches(loader, Position()))
    message = str(refused.value)
    assert message.startswith(f"{__name__}.Texts.lane gave samples whose {said}, and a step of lanes joins tensors")
    assert "\n" not in message and message.endswith("(text as token ids), or tuples and dicts of them")


def test_a_stream_without_lanes_resumes_as_it_was_read_and_refuses_other_readers():
    unbroken, _ = steps(AsItIs(), 1, 2, Position(), 12)
    first, position = steps(AsItIs(), 1, 2, Position(), 5)
    assert position.state_dict() == {"epoch": 0, "sample": 80, "order": "stream", "processes": 1, "workers": 2}
    assert first + steps(AsItIs(), 1, 2, position, 7)[0] == unbroken
    with pytest.raises(RunError, match=r"^this run's stream \(AsItIs\) has no lane\(index, lanes, start\)") as refused:
        steps(AsItIs(), 1, 0, position, 1)
    assert "by 1 processes and data.num_workers=2; resume with those" in str(refused.value)


def stream_data(**_) -> Data:
    numbers = torch.arange(32)
    val = TensorDataset(numbers.float().view(-1, 1, 1, 1).expand(-1, 1, 8, 8).contiguous(), numbers % 10)
    return Data(Lanes(), val, input_shape=(1, 8, 8), num_classes=10)


@pytest.mark.slow  # three short trainings
def test_a_run_on_a_stream_in_lanes_stops_and_resumes_bit_for_bit(make_cfg, sigterm_at, tmp_path):
    common = [f"data._target_={__name__}.stream_data", "+data.lanes=16", "trainer.max_steps=30", "model.dropout=0"]
    unbroken = recipe.train(make_cfg(*common, "name=unbroken", f"checkpoint.dir={tmp_path / 'unbroken'}"))
    sigterm_at(12)
    with pytest.raises(SystemExit):
        recipe.train(make_cfg(*common, "name=stopped"))
    resumed = recipe.train(make_cfg(*common, "name=stopped", "resume=last"))
    assert resumed["train/loss"] == unbroken["train/loss"]


def test_a_val_split_that_is_a_stream_is_refused_in_one_line(make_cfg):
    with pytest.raises(RunError, match=r"gave a stream as its val split; validation reads every sample"):
        recipe.train(make_cfg(f"data._target_={__name__}.streams_only"))


def streams_only(**_) -> Data:
    return Data(Lanes(), Lanes(), input_shape=(1, 8, 8), num_classes=10)

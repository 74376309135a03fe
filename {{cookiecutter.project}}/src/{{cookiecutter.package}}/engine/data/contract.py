"""What a `data` component is to the engine: it returns a `Data` (the datasets and the facts the
other components may need), reads its files with `read_file`, and says a problem with the data in
one line with `DataError`. The one part of the engine that your data components import (through
`engine.data`)."""

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.utils.data import Dataset, IterableDataset

from .. import components
from ..errors import RunError
from ..files import NotRegular, read_regular

# The split belongs to the dataset, not to the run: changing `seed` must not move samples between
# training and validation. The ready datasets draw theirs with this seed.
SPLIT_SEED = 0


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
    mid-run (in a loader worker too: workers.py), and said in one line without a traceback: a
    ValueError is one only at build time."""


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

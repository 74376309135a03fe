"""The data loaders' worker processes (data.num_workers), which end with the run however it ends: a
`Loader` is torch's DataLoader whose workers die with the process that started them, and end as soon
as a reading of the loader does, or as the process exits."""

import atexit
import ctypes
import multiprocessing
import os
import signal
import sys
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from ..errors import RunError
from ..signals import SIGNALS


class Loader(DataLoader):
    """torch's DataLoader, each of its workers started by `end_with_the_run`, and ended as the
    reading that started it ends, by its last batch, an error or a reader that stops early. Torch
    ends them once it collects the reading's iterator; but an error that a worker raised (a shard cut
    short under the run) holds that iterator in its traceback until the process exits, and by then
    torch leaves its workers be and multiprocessing ends them with SIGTERM, which they ignore: the
    run said its line and never exited. A RunError a worker raised reaches the run as the line it
    said, as it would have without workers."""

    def __init__(self, dataset: Dataset, **settings: Any) -> None:
        super().__init__(dataset, worker_init_fn=ending_with_this_process(), **settings)

    def __iter__(self) -> Iterator[Any]:
        reading = super().__iter__()
        if isinstance(reading, _MultiProcessingDataLoaderIter):
            READING.add(reading)
        try:
            yield from reading
        except RunError as error:
            if isinstance(reading, _MultiProcessingDataLoaderIter):
                error.args = (said_in_a_worker(error),)
            raise
        finally:
            if isinstance(reading, _MultiProcessingDataLoaderIter):
                reading._shutdown_workers()


# The readings whose workers may still run: those of other loaders than the one that failed (the
# training reading, when a validation's worker refused), which the error's traceback holds until
# the process exits.
READING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def end_the_readings_left() -> None:
    """At exit, before multiprocessing's own end of the workers (atexit runs the last registered
    first), which sends them SIGTERM, which they ignore, and waits for them for good."""
    for reading in list(READING):
        reading._shutdown_workers()


def said_in_a_worker(error: RunError) -> str:
    """What a worker's RunError said. Torch raises it again in the run from one message that holds
    the worker's whole traceback ("Caught DataError in DataLoader worker process 0. Original
    Traceback ..."), whose last line is the error's own: `<module>.<class>: <what it said>`."""
    last = str(error).rstrip().splitlines()[-1]
    return last.removeprefix(f"{type(error).__module__}.{type(error).__qualname__}: ")


def ending_with_this_process() -> partial:
    """What a data-loader worker of this process runs first (`worker_init_fn`), so that it ends
    when this process does, however that happens."""
    # As the loader will start them, without fixing the start method for the rest of the program.
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    # Workers started by a fork server are that server's children, not this process's.
    parent = os.getpid() if method != "forkserver" else None
    return partial(end_with_the_run, parent)


def end_with_the_run(parent: int | None, worker_id: int) -> None:
    """Torch's workers look for a dead parent every 5 s, and never if it died while they were
    starting up: one killed run could leave workers behind for good, holding its memory, its
    terminal's output and the pipes of whoever started it. On Linux the kernel now kills a worker
    as its parent ends; a parent already gone by then ends the worker here. The signals that stop
    a run at a step boundary (SLURM sends them to every process of a job) are the run's to take:
    a worker they killed would fail the step they were meant to let finish."""
    for number in SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(0)


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

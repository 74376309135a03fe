"""A standby leg (`standby=true`): started while another leg trains the run, it pays a start's
price then (PyTorch's imports: 2 s of the 2.2 s a restart costs on two CPU cores), waits for that
leg to end, however it ends (a signal, kill -9, a crash, the run's end), and continues the run from
its newest checkpoint a fraction of a second later; where no leg holds the home, it goes on at once:

    python run.py resume=auto &                 # trains; once it holds checkpoints/<name>/ ...
    python run.py resume=auto standby=true      # ... this waits, warmed up, and takes over

It waits on the home's lock (checkpoint/claim.py), which the OS frees with its holder's process,
and reads nothing of the home before it holds it: the settings, the checkpoint and the account of
time it continues are those the ended leg left. Its time counts from then (goodput.py). A standby
shares its leg's machine, or a file system with POSIX locks: a machine taken away takes its standby
with it, and a torchrun job restarts its workers itself (`--max-restarts`).
"""

import contextlib
import importlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from .. import priority, tracking
from ..config import continuing
from ..errors import RunError
from ..signals import SIGNALS, Stopped
from . import goodput

if TYPE_CHECKING:  # with torch, which run.py imports after this module
    from ..remembered import CommandLine

log = logging.getLogger(__name__)


def warm_up() -> None:
    """What a leg imports before its first step, torch's first optimizer step included (it imports
    torch._dynamo: a second), and its MLflow sender's imports, at the lowest priority: the cores
    are the training leg's until this one takes over. Called before torch is imported (run.py):
    this module does not import it."""
    tracking.start_sender(idle=True)
    priority.lowest(lambda: [importlib.import_module(name, __package__) for name in ("..train", "torch._dynamo")])


@contextlib.contextmanager
def taking_over(cfg: DictConfig, said: "CommandLine | None") -> Iterator[float]:
    """Yields when this leg's time counts from. For a standby leg, waits until the leg that holds
    the run's home has ended, then holds the home for the block and yields the time it took over;
    where it found the home free, and for a leg that does not stand by, goodput.leg_begins() (a
    standby's start-up, warm-up included, is then the run's, as any leg's is). What the command line
    `said` is compared with on a resume, the project's defaults, is composed before the wait."""
    began = goodput.leg_begins()
    if not cfg.standby:
        yield began
        return
    check(cfg)
    from ..checkpoint.claim import after_holder  # with torch: not imported before run.py's warm_up

    if said is not None:
        said.defaults()  # a quarter of a second of Hydra's, which no checkpoint changes

    home, waiting = Path(cfg.checkpoint.dir), time.perf_counter()
    with contextlib.ExitStack() as held:
        with _stopped_by_signals():  # first: a signal once the line below is said ends the wait cleanly
            log.info(f"standing by: this leg continues the run when the leg that holds {home} ends")
            waited = held.enter_context(after_holder(home))
        if not waited:
            log.info(f"no leg holds {home}: this one goes on at once")
            yield began
            return
        log.info(f"took over {home} after standing by {time.perf_counter() - waiting:.1f} s")
        yield time.time()


def check(cfg: DictConfig) -> None:
    """A standby continues a run, in one process."""
    if cfg.resume not in ("auto", "last"):
        instead = "a fresh run" if cfg.resume is None else f"resume={cfg.resume}"
        raise RunError(
            f"standby=true continues the run whose leg it waits for, not {instead}: "
            f"start it with {continuing(cfg, 'auto')} (or resume=last)"
        )
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise RunError(
            "standby=true waits in one process for one process; a torchrun job restarts its workers itself "
            "(torchrun --max-restarts=N): drop standby=true"
        )


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """A stop signal ends the wait, and the process, before anything is read or written."""

    def stop(number: int, frame: FrameType | None) -> None:
        received = signal.Signals(number)
        log.info(f"standby stopped by {received.name} before it took over; nothing was read or written")
        raise Stopped(received, None)

    before = {number: signal.signal(number, stop) for number in SIGNALS}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)

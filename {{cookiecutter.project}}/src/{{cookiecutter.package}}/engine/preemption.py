"""Graceful preemption: SIGTERM (a scheduler taking the node back, or its time limit), SIGUSR1 or
SIGUSR2 (a scheduler's warning before either, `sbatch --signal`) or SIGINT (Ctrl-C) lets the
current step finish, and the runner then saves a checkpoint before it exits (and, under SLURM,
asks to come back: restarts.py). With several processes, a signal that reaches any of them stops
them all at the same step."""

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time too: the MLflow sender imports SIGNALS, and never torch
    from .distributed import World

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Preemption:
    """While active, the first of SIGNALS only sets `received` (submitit's own SIGUSR2 handler,
    which would requeue mid-step without a save, waits outside). A second SIGINT interrupts at once,
    for a person who really means it; any other signal again is only said (SLURM signals every
    process of a job, and torchrun passes the same signal on to its workers)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self, world: "World") -> bool:
        """Whether any process has received a signal; then every process holds it in `received`.
        A collective step, taken by all processes at each step boundary, so that all stop at the
        same step and save the same checkpoint."""
        number = world.max(self.received or 0)
        if number:
            self.received = signal.Signals(number)
        return bool(number)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            log.warning(f"{signal.Signals(signum).name} received: already finishing this step, then saving")
            return
        self.received = signal.Signals(signum)
        log.warning(f"{self.received.name} received: finishing this step, then saving a checkpoint")


class Stopped(SystemExit):
    """A run that a signal stopped after its checkpoint was saved: exits 128 + the signal, as a
    process the signal had killed would. `comeback` says how the job comes back by itself (a
    SLURM requeue), or is None when a person must continue it with resume=last."""

    def __init__(self, received: signal.Signals, comeback: str | None) -> None:
        super().__init__(128 + received)
        self.received, self.comeback = received, comeback

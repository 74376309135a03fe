"""Graceful preemption: SIGTERM (a scheduler taking the node back, or its time limit), SIGUSR1 or
SIGUSR2 (a scheduler's warning before either, `sbatch --signal`) or SIGINT (Ctrl-C) lets the
current step finish, or the current batch of a validation, which is then left unfinished (the resumed
run validates that step again), and the runner then saves a checkpoint before it exits (and, under
SLURM, asks to come back: restarts.py). With several processes, a signal that reaches any of them
stops them all at the same step.

A callback's hook is code of the user's that may never return: while one holds the run, a stop
interrupts it at once (the hold the recipe hands over: callbacks/time_limit.py), and the run stops
as at any stop, whether the hook lets the interrupt out or swallows it."""

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import ClassVar, Protocol

from ..distributed import World
from ..signals import SIGNALS, Stopped

log = logging.getLogger(__name__)

FAILED = 1 << 8  # above every signal's number: one flag of `agreed` that the others' maximum keeps


class Interruptible(Protocol):
    """What a stop interrupts: the hold of the hook that holds the run, if any, and its watchdog,
    which interrupts a hook past its time with the signal `kick` (callbacks/time_limit.py's Hold)."""

    bound_s: float | None
    kick: int
    continuation: Callable[[], str] | None

    def kicked(self, signum: int, frame: FrameType | None) -> None: ...

    def watch(self) -> None: ...

    def close(self) -> None: ...

    def stops(self, received: signal.Signals, frame: FrameType | None) -> None: ...


class Preemption:
    """While active, the first of SIGNALS only sets `received` (submitit's own SIGUSR2 handler,
    which would requeue mid-step without a save, waits outside), and interrupts a hook that holds
    the run. A second SIGINT leaves at once, without a save, for a person who really means it; any
    other signal again is only said (SLURM signals every process of a job, and torchrun passes the
    same signal on to its workers). `hold` bounds each hook (its bound_s None: no bound), and its
    `continuation` says, at that second Ctrl-C, how to go on from the newest checkpoint."""

    installed: ClassVar["Preemption | None"] = None  # the one whose handlers take this process's signals

    def __init__(self, hold: Interruptible) -> None:
        self.received: signal.Signals | None = None
        self.failed: str | None = None  # why every process stops at once, unsaved (`agreed`)
        self.cut = ""  # for the stop line, what it cut short: " during validation, left at a batch boundary ..."
        self._since: float | None = None  # when this process received the first signal
        self._agreed = False
        self._asked: str | None = None  # where `agreed` was last asked: `during`
        self.hold = hold
        self._previous: dict = {}
        self._twice = False
        # The handler's lines, written by a thread of its own: a signal may come while this process
        # writes to the log's stream (a full pipe holds it there), and a write from the handler would
        # then be a reentrant one, which Python refuses (logging printed its traceback in their place).
        # SimpleQueue's put is safe in a handler; starting a thread there is not (it takes locks).
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._writer = threading.Thread(target=self._write_lines, name="signal-lines")
            self._writer.start()
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            if (hold := self.hold).bound_s is not None:
                self._previous[hold.kick] = signal.signal(hold.kick, hold.kicked)
                hold.watch()
            Preemption.installed = self
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        self.hold.close()  # before its kick's handler goes: the signal's default ends the process
        if Preemption.installed is self:
            Preemption.installed = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._writer is not None:
            self._lines.put(None)
            self._writer.join()
        if self._twice and isinstance(error, KeyboardInterrupt):
            then = f"; {self.hold.continuation()}" if self.hold.continuation else ""
            log.warning(f"stopped at once by a second Ctrl-C: nothing more is saved{then}")
            raise Stopped(signal.SIGINT, None) from None

    def agreed(self, world: World, failed: str | None = None, during: str | None = None) -> bool:
        """Whether any process has received a signal; then every process holds it in `received`.
        A collective step, taken by all processes at each step boundary, so that all stop at the
        same step and save the same checkpoint, and at each batch of a validation (`during` names
        it: the stop line then says that it cut it short, and how long after the signal). `failed`:
        why this process must stop without a save (a run whose claim on checkpoint.remote another
        machine took, which rank 0 alone hears of); then every process holds the first such reason
        in `failed`, and none the signal, and every later call agrees at once."""
        if self.failed is not None:  # set on every process at once: none takes the collective step
            return True
        number = world.max((self.received or 0) | (FAILED if failed else 0))
        if number & FAILED:  # a second collective step, taken only then
            self.failed = next(reason for reason in world.gather(failed) if reason)
            return True
        if number:
            self.received = signal.Signals(number)
            if not self._agreed and during is not None and self._asked == during:  # asked there before the signal too
                after = f" {time.monotonic() - self._since:.2f} s after the signal" if self._since else ""
                self.cut = f" during {during}, left at a batch boundary{after}"
            self._agreed = True
        self._asked = during
        return bool(number)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if self.received is not None and received == signal.SIGINT:
            self._twice = True
            raise KeyboardInterrupt
        again, self.received = self.received is not None, self.received or received
        self._since = self._since or time.monotonic()
        self.hold.stops(received, frame)  # raises into a hook that holds the run
        if again:
            line = f"{received.name} received: already finishing this step or validation batch, then saving"
        else:
            line = f"{received.name} received: finishing this step or validation batch, then saving a checkpoint"
        self._lines.put(line)

    def _write_lines(self) -> None:
        while (line := self._lines.get()) is not None:
            log.warning(line)

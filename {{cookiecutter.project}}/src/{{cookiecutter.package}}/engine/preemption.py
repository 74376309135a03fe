"""Graceful preemption: SIGTERM (a scheduler taking the node back, or its time limit), SIGUSR1 or
SIGUSR2 (a scheduler's warning before either, `sbatch --signal`) or SIGINT (Ctrl-C) lets the
current step finish, and the runner then saves a checkpoint before it exits (and, under SLURM,
asks to come back: restarts.py). With several processes, a signal that reaches any of them stops
them all at the same step.

A callback's hook is code of the user's that may never return: while one holds the run (`with
preemption.hold:`), a stop interrupts it at once, and so does the end of its time
(`trainer.hook_timeout_s`), by raising Interrupted into it; hooks.py says what the run does then."""

import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # at run time too: the MLflow sender imports SIGNALS, and never torch
    from .distributed import World

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Interrupted(BaseException):
    """Raised into the hook that holds the run: by a stop signal (`received`), or by SIGALRM at the end
    of its time. Not an Exception, so that a hook's own `except Exception` lets it pass."""

    def __init__(self, received: signal.Signals) -> None:
        super().__init__(received.name)
        self.received = received


class Hold:
    """The hook that holds the run, if any, since when, and for how long it may (`bound_s`, None: for
    ever). Kept without a system call per hook, however often hooks run: the timer, once armed,
    runs out `bound_s` later, and only the first hook after that arms it again; when it runs out
    during a hook, that hook is given the rest of its time, or interrupted."""

    def __init__(self, bound_s: float | None) -> None:
        self.bound_s = bound_s
        self.since: float | None = None  # time.monotonic() as the hook began; None: no hook holds the run
        self._armed = False

    def __enter__(self) -> None:
        self.since = time.monotonic()
        if self.bound_s is not None and not self._armed:
            self._arm(self.bound_s)

    def __exit__(self, *exc_info: object) -> None:
        self.since = None

    def alarm(self, signum: int, frame: FrameType | None) -> None:
        """SIGALRM's handler."""
        self._armed = False
        if self.since is None:
            return
        left = self.since + self.bound_s - time.monotonic()
        if left <= 0:
            raise Interrupted(signal.SIGALRM)
        self._arm(left)

    def disarm(self) -> None:
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._armed = False

    def _arm(self, seconds: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        self._armed = True


class Preemption:
    """While active, the first of SIGNALS only sets `received` (submitit's own SIGUSR2 handler,
    which would requeue mid-step without a save, waits outside), and interrupts a hook that holds
    the run. A second SIGINT leaves at once, without a save, for a person who really means it; any
    other signal again is only said (SLURM signals every process of a job, and torchrun passes the
    same signal on to its workers). `hook_timeout_s` bounds each hook (None: no bound)."""

    installed: ClassVar["Preemption | None"] = None  # the one whose handlers take this process's signals

    def __init__(self, hook_timeout_s: float | None = None) -> None:
        self.received: signal.Signals | None = None
        self.hold = Hold(hook_timeout_s)
        self._previous: dict = {}
        self._twice = False

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            if self.hold.bound_s is not None and signal.getitimer(signal.ITIMER_REAL)[0]:
                log.warning("trainer.hook_timeout_s is not applied: this process's SIGALRM timer is in use")
                self.hold.bound_s = None
            if self.hold.bound_s is not None:
                self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self.hold.alarm)
            Preemption.installed = self
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        self.hold.disarm()  # before SIGALRM's handler goes: its default ends the process
        if Preemption.installed is self:
            Preemption.installed = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._twice and isinstance(error, KeyboardInterrupt):
            log.warning("stopped at once by a second Ctrl-C: nothing more is saved; continue with resume=last")
            raise Stopped(signal.SIGINT, None) from None

    def agreed(self, world: "World") -> bool:
        """Whether any process has received a signal; then every process holds it in `received`.
        A collective step, taken by all processes at each step boundary, so that all stop at the
        same step and save the same checkpoint."""
        number = world.max(self.received or 0)
        if number:
            self.received = signal.Signals(number)
        return bool(number)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if self.received is not None and received == signal.SIGINT:
            self._twice = True
            raise KeyboardInterrupt
        again, self.received = self.received is not None, self.received or received
        if self.hold.since is not None:
            raise Interrupted(received)
        if again:
            log.warning(f"{received.name} received: already finishing this step, then saving")
        else:
            log.warning(f"{received.name} received: finishing this step, then saving a checkpoint")


class Stopped(SystemExit):
    """A run that a signal stopped, after its checkpoint was saved unless it says otherwise: exits
    128 + the signal, as a process the signal had killed would. `comeback` says how the job comes back by itself (a
    SLURM requeue), or is None when a person must continue it with resume=last."""

    def __init__(self, received: signal.Signals, comeback: str | None) -> None:
        super().__init__(128 + received)
        self.received, self.comeback = received, comeback

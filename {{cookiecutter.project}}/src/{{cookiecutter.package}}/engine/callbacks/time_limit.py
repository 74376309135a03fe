"""A callback's hook is code of the user's that may never return, nor let go when told to. While one
holds the run (`with hold.by(who, hook)`), a stop (preemption.py) interrupts it at once, and so does
the end of its time, `trainer.hook_timeout_s`, by raising Interrupted into it; hooks.py says what the
run does then, from what reached the hook (Holding), whether the hook let the interrupt out or not.

The time is kept by a watchdog thread, which a hook cannot cancel as it could a timer
(`signal.alarm(0)`), nor take over as it could SIGALRM's handler (a library's own timeout): at the
bound, the watchdog sends the main thread a real-time signal of the run's own (KICK), again every
REPEAT_S until the hook returns, each one raising Interrupted into it there, even in a `time.sleep`.
A hook that swallows them all, or takes KICK over too, holds the run `grace_s` longer at most: then
the watchdog ends the process in one line, as a kill would (the MLflow run shows RUNNING until a
resume continues it; nothing after the newest checkpoint is saved)."""

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from ..errors import RunError, reported

# Linux's last real-time signal, which libraries' timers leave alone (SIGALRM is theirs); elsewhere SIGALRM.
# Sent to the main thread alone (pthread_kill), whose blocking call (a sleep, a read) it wakes.
KICK = getattr(signal, "SIGRTMAX", signal.SIGALRM)
REPEAT_S = 0.1  # how often an overrunning hook is interrupted again, until it returns
GRACE_S = 10.0  # the most an overrunning hook may hold the run after its bound, interrupted


class Interrupted(BaseException):
    """Raised into the hook that holds the run: by a stop signal, or at the end of its time. Not an
    Exception, so that a hook's own `except Exception` lets it pass; one that catches it anyway is
    still stopped: its Holding keeps what reached it."""


@dataclass(eq=False)
class Holding:
    """One hook's hold of the run: whose (`who`, `hook`), since when, and what reached it: the end of
    its time (`overran`, set by the watchdog) or a stop (`stopped`)."""

    hold: "Hold"
    who: str
    hook: str
    since: float = 0.0
    overran: bool = False
    stopped: signal.Signals | None = None

    def __enter__(self) -> "Holding":
        self.since = time.monotonic()
        self.hold.holding = self  # last: from here on, a stop or the watchdog interrupts the hook
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.hold.holding = None  # first: from here on, nothing interrupts it


# Where a signal handler finds the main thread taking or letting go of the run: not in the hook.
LETTING_GO = (Holding.__enter__.__code__, Holding.__exit__.__code__)


class Hold:
    """The hook that holds the run, if any (`holding`), and for how long it may (`bound_s`; None: for
    ever). A hook pays for its bound no system call: the watchdog looks at the hook that holds the run
    at least once a bound, and wakes at its end."""

    kick = KICK  # what the watchdog interrupts the main thread with: its handler is `kicked`

    def __init__(self, bound_s: float | None, continuation: Callable[[], str] | None = None) -> None:
        self.bound_s = bound_s
        self.continuation = continuation  # how to go on from the newest checkpoint, for the line at its end
        self.grace_s = min(bound_s, GRACE_S) if bound_s is not None else None
        self.holding: Holding | None = None
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._main = threading.main_thread().ident

    def by(self, who: str, hook: str) -> Holding:
        """The hold of `who`'s `hook`, to enter around the call of it."""
        return Holding(self, who, hook)

    def overran(self, holding: Holding) -> str:
        """The line that says `holding` ran past its bound."""
        return (
            f"{holding.who} did not return from {holding.hook} within trainer.hook_timeout_s={self.bound_s:g} s "
            f"(raise it if the hook needs longer)"
        )

    def watch(self) -> None:
        """From the main thread, with `kicked` as KICK's handler: the watchdog starts."""
        self._watchdog = threading.Thread(target=self._watch, name="hook watchdog", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join()

    def kicked(self, signum: int, frame: FrameType | None) -> None:
        """KICK's handler, in the main thread: the watchdog's interrupt of a hook past its bound."""
        holding = self.holding
        if holding is not None and holding.overran and frame is not None and frame.f_code not in LETTING_GO:
            raise Interrupted("trainer.hook_timeout_s")

    def stops(self, received: signal.Signals, frame: FrameType | None) -> None:
        """A stop, in the main thread: raised into the hook that holds the run, if one does, which keeps it."""
        holding = self.holding
        if holding is not None and frame is not None and frame.f_code not in LETTING_GO:
            holding.stopped = holding.stopped or received
            raise Interrupted(received.name)

    def _watch(self) -> None:
        wait = self.bound_s
        while not self._closed.wait(wait):
            holding = self.holding
            wait = self.bound_s if holding is None else holding.since + self.bound_s - time.monotonic()
            if wait <= 0:
                self._interrupt(holding)

    def _interrupt(self, holding: Holding) -> None:
        """Interrupts `holding`'s hook until it lets go of the run; past its grace, ends the process."""
        holding.overran = True
        ends = holding.since + self.bound_s + self.grace_s
        while self.holding is holding:
            left = ends - time.monotonic()
            if left <= 0:
                self._end(holding)
            if signal.getsignal(KICK) == self.kicked:  # a hook that took KICK over waits out its grace
                signal.pthread_kill(self._main, KICK)
            if self._closed.wait(min(REPEAT_S, left)):
                return

    def _end(self, holding: Holding) -> None:
        """The process ends, from the watchdog: its main thread is the hook's. Said as any RunError is."""

        then = f", then {self.continuation()}" if self.continuation else ""

        def refuse() -> None:
            raise RunError(
                f"{self.overran(holding)}, nor {self.grace_s:g} s after it was interrupted: the process ends here, "
                f"as at a kill; nothing after the newest checkpoint is saved; fix it{then}"
            )

        try:
            reported(refuse)
        finally:
            os._exit(2)

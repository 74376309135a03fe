"""Graceful preemption: SIGTERM (a scheduler taking the node back) or SIGINT (Ctrl-C) lets the
current step finish, and the runner then saves a checkpoint before it exits. With several
processes, a signal that reaches any of them stops them all at the same step."""

import logging
import signal
import threading
from types import FrameType

from .distributed import World

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """While active, the first SIGTERM or SIGINT only sets `received`; a second one interrupts at
    once, for a person who really means it."""

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

    def agreed(self, world: World) -> bool:
        """Whether any process has received a signal; then every process holds it in `received`.
        A collective step, taken by all processes at each step boundary, so that all stop at the
        same step and save the same checkpoint."""
        number = world.max(self.received or 0)
        if number:
            self.received = signal.Signals(number)
        return bool(number)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum)
        log.warning(f"{self.received.name} received: finishing this step, then saving a checkpoint")

"""Goodput: the share of a run's wall time that trained new steps, and where the rest went, over
all the legs of the run (each process that trained it, from its start to its end or its kill).

Each leg keeps a stopwatch whose laps tile its time from the process's start, each lap given to
one bucket, so that the buckets add up to the leg's wall time:
  startup     the process's start to its first step: imports, config, building, the checks
  restore     loading the checkpoint it resumes from
  compile     torch.compile's work, wherever it fell (torch counts its own seconds)
  validation  evaluating, at the validation steps and for each checkpoint's rank
  save        the part of each save that training waits for
  retrained   training again the steps an earlier leg had trained past its newest checkpoint
  train       training new steps: the goodput
  end         after the last step: callbacks, the models out, MLflow's last metrics

Rank 0 keeps each leg's account in the home's `goodput.json`, written at its first step, at most
once a second while it trains, and at its end: a leg killed without warning (kill -9) loses at most
the last second of its account; a run that ends having saved nothing removes it. A leg reads the
legs before it there, logs the sums as `goodput/*` metrics at its end, and says them in one line.
The time between two legs (a queue, a machine coming up) is not the run's: it is said, and left
out. The account is numbers only, read only from the run's own home (checkpoint.dir), never
through a link; anything else in its place starts a new account.
"""

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .checkpoint.files import NotRegular, read_own, write_text

log = logging.getLogger(__name__)

BUCKETS = ("startup", "restore", "compile", "validation", "save", "retrained", "train", "end")
SAID = {"startup": "start-up", "retrained": "steps trained again", "save": "saves"}  # the rest as named
LEDGER = "goodput.json"
WRITE_EVERY_S = 1.0
MOST_LEGS = 100_000  # far more than any run restarts; a bound on what a damaged file can make this read


def process_start(pid: int | str = "self") -> float:
    """When this process (or `pid`) started, in `time.time()` seconds: from Linux's /proc (to 10 ms);
    where there is none, now, and the imports before it are not counted."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])  # starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def compile_seconds() -> float:
    """torch.compile's seconds in this process so far; 0 where it never ran (nor was imported)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return float(dynamo.calculate_time_spent().get("total_wall_time", 0.0)) if dynamo else 0.0


class Clock:
    """This leg's stopwatch and the run's account. `during(bucket)` times a stretch of the recipe;
    between them, the time goes to the stretch the recipe is in (start-up, then training, then the end)."""

    def __init__(self, began: float | None = None) -> None:
        """`began`: when this leg's time starts counting (a standby's takeover: standby.py), if not at
        the process's start."""
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.started = process_start() if began is None else began
        self._lap = time.perf_counter() - (time.time() - self.started)  # the process's start, on this clock
        self._compiled = 0.0
        self._in = "startup"
        self._home: Path | None = None  # where the account is kept: rank 0's, once the run holds its home
        self._anchored = False  # whether the home holds a checkpoint of this run
        self._warned = False
        self._before: list[dict] = []  # the legs before this one
        self._reached = 0  # the furthest step an earlier leg trained
        self._step = 0
        self._written = -math.inf
        self._said = ""

    def keep(self, home: Path, continuing: bool, anchored: bool) -> None:
        """Rank 0, once it holds `home`: reads the legs before this one when the run is `continuing`
        (a resume); a fresh run starts a new account. `anchored`: `home` holds the checkpoint this
        leg resumed from."""
        self._home, self._anchored = home, anchored
        self._before = earlier_legs(home) if continuing else []
        self._reached = max((leg["step"] for leg in self._before), default=0)

    @contextmanager
    def during(self, bucket: str) -> Iterator[None]:
        self.lap(self._in)
        try:
            yield
        finally:
            self.lap(bucket)

    def lap(self, bucket: str) -> None:
        """The time since the last lap, to `bucket`, less torch.compile's share of it."""
        now, compiled = time.perf_counter(), compile_seconds()
        spent = now - self._lap
        compiling = min(compiled - self._compiled, spent)
        self.seconds["compile"] += compiling
        self.seconds[bucket] += spent - compiling
        self._lap, self._compiled = now, compiled

    def training(self, step: int) -> None:
        """The first step of this leg is about to run, from `step`."""
        self.lap(self._in)
        self._step = step
        self._in = "retrained" if step < self._reached else "train"
        self._write()  # from here on, a leg killed is counted by the next

    def stepped(self, step: int) -> None:
        """After each step: from the step an earlier leg reached, the steps are new. Cheap: a step
        pays one comparison."""
        if step == self._reached and self._in == "retrained":
            self.lap("retrained")
            self._in = "train"

    def beat(self, step: int) -> None:
        """At a logging step: the account on disk, at most once a second."""
        self._step = max(self._step, step)
        if time.perf_counter() - self._written >= WRITE_EVERY_S:
            self.lap(self._in)
            self._write()

    def saved(self) -> None:
        """A checkpoint of this run is in its home."""
        self._anchored = True

    def ending(self) -> None:
        """The last step is done: what follows is the end."""
        self.lap(self._in)
        self._in = "end"

    def totals(self, step: int) -> dict[str, float]:
        """The `goodput/*` metrics, over the legs so far and this one up to now."""
        self._step = max(self._step, step)
        self.lap(self._in)
        legs = [*self._before, self._leg()]
        seconds = {bucket: sum(leg["seconds"][bucket] for leg in legs) for bucket in BUCKETS}
        # Read off the wall clock, not summed from the buckets: that they add up to it is checked.
        wall = sum(leg["ended"] - leg["started"] for leg in legs)
        between = sum(max(0.0, leg["started"] - before["ended"]) for before, leg in zip(legs, legs[1:], strict=False))
        return {
            "goodput/fraction": seconds["train"] / wall if wall > 0 else 0.0,
            "goodput/wall_s": wall,
            **{f"goodput/{bucket}_s": value for bucket, value in seconds.items()},
            "goodput/legs": len(legs),
            "goodput/between_legs_s": between,
        }

    def close(self, step: int) -> None:
        """At the leg's end: the account on disk, and the line `summary` says."""
        totals = self.totals(step)
        if self._anchored or self._before:
            self._write()
        elif self._home is not None:  # a run that saved nothing leaves its home as it found it
            with contextlib.suppress(OSError):
                (self._home / LEDGER).unlink(missing_ok=True)
        lost = sorted(((totals[f"goodput/{b}_s"], b) for b in BUCKETS if b != "train"), reverse=True)
        spent = ", ".join(f"{SAID.get(bucket, bucket)} {value:.1f} s" for value, bucket in lost if value >= 0.05)
        legs = int(totals["goodput/legs"])
        between = totals["goodput/between_legs_s"]
        apart = f"; the {between:.1f} s between legs is not the run's" if legs > 1 else ""
        self._said = (
            f"goodput {totals['goodput/fraction']:.2f} over {legs} leg{'s' * (legs > 1)} "
            f"({totals['goodput/wall_s']:.1f} s): {spent or 'nothing else'}{apart}"
        )

    def summary(self) -> str:
        """One line: the run's goodput over its legs, and the largest buckets of the rest."""
        return self._said

    def _leg(self) -> dict:
        return {"started": self.started, "ended": time.time(), "step": self._step, "seconds": dict(self.seconds)}

    def _write(self) -> None:
        self._written = time.perf_counter()
        if self._home is None:
            return
        try:
            write_text(self._home / LEDGER, json.dumps({"legs": [*self._before, self._leg()]}))
        except OSError as error:  # a full disk: tried again at the next beat, said once
            if not self._warned:
                log.warning(f"{self._home / LEDGER} could not be written ({error.strerror or error}); training goes on")
            self._warned = True


def earlier_legs(home: Path) -> list[dict]:
    """The legs `home`'s account holds; none, with one line, where it is no account this module wrote."""
    path = home / LEDGER
    try:
        found = json.loads(read_own(path))
    except FileNotFoundError:
        return []
    except NotRegular as refused:
        problem = f"is {refused.what}"
    except OSError as error:
        problem = f"cannot be read ({error.strerror or error})"
    except (ValueError, RecursionError):
        problem = "is damaged"
    else:
        legs = found.get("legs") if isinstance(found, dict) else None
        if isinstance(legs, list) and len(legs) <= MOST_LEGS and all(map(is_leg, legs)):
            return legs
        problem = "is not an account this project wrote"
    log.warning(f"{path} {problem}: goodput counts from this leg on")
    return []


def is_leg(leg: object) -> bool:
    def number(value: object) -> bool:
        return type(value) in (int, float) and math.isfinite(value) and value >= 0

    return (
        isinstance(leg, dict)
        and number(leg.get("started"))
        and number(leg.get("ended"))
        and leg["ended"] >= leg["started"]
        and type(leg.get("step")) is int
        and leg["step"] >= 0
        and isinstance(leg.get("seconds"), dict)
        and set(leg["seconds"]) == set(BUCKETS)
        and all(map(number, leg["seconds"].values()))
    )

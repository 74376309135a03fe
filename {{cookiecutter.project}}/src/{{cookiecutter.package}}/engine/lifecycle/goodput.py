"""Goodput: the share of a run's wall time that trained new steps, and where the rest went, over
all the legs of the run (each process that trained it, from its start to its end or its kill).

Each leg keeps a stopwatch whose laps tile its time from its start, each lap given to one bucket,
so that the buckets add up to the leg's wall time:
  startup     the leg's start to its first step: imports, config, building, the checks
  restore     loading the checkpoint it resumes from
  compile     torch.compile's work, wherever it fell (torch counts its own seconds)
  validation  evaluating, at the validation steps and for each checkpoint's rank
  save        the part of each save that training waits for
  hooks       the callbacks' hooks (hooks.py)
  retrained   training again the steps an earlier leg had trained past its newest checkpoint
  train       training new steps: the goodput
  end         after the last step: callbacks, the models out, MLflow's last metrics

A leg starts when its Python interpreter does (interpreter_start: not a shell's time before it), or,
in a process that ran a leg already (a sweep's next job), when it is asked for (leg_begins), or at
a standby's takeover (standby.py).

Rank 0 keeps each leg's account in the home's `goodput.json`, written at its first step, at most
once a second while it trains, and at its end: a leg killed without warning (kill -9) loses at most
the last second of its account; a run that ends having saved nothing removes it. With
checkpoint.remote the account is mirrored too, between checkpoints as well (mirror.py): a machine
lost past its newest remote checkpoint hands the next one the steps it trained, retrained there. A
leg reads the legs before it there, logs the sums as `goodput/*` metrics at its end, and says them
in one line.
The time between two legs (a queue, a machine coming up) is not the run's: it is said, and left
out. The account keeps its last legs one by one and the earlier ones summed into one, so that its
size stays bounded however often the run restarts. It is numbers only, read only from the run's
own home (checkpoint.dir), never through a link, and only where each number is one a leg of this
run can have written; anything else in its place starts a new account.
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
from itertools import pairwise
from pathlib import Path

from ..files import NotRegular, read_own, write_text

log = logging.getLogger(__name__)

BUCKETS = ("startup", "restore", "compile", "validation", "save", "hooks", "retrained", "train", "end")
LATER = ("hooks",)  # buckets that an account written before they were counted lacks: 0 there
SAID = {"startup": "start-up", "hooks": "callbacks", "retrained": "steps trained again", "save": "saves"}
WRITE_EVERY_S = 1.0
KEPT_LEGS = 100  # one by one, this leg included; those before, summed into one: the file stays under 50 kB
MOST_LEGS = 1_000_000  # far more than any run restarts; a bound on what a damaged file can make this read
EARLIEST = 1_704_067_200.0  # 2024-01-01: no leg of a run of this project started before
CLOCKS_APART_S = 300.0  # how far ahead of this machine's clock another's may have written a leg's end

_interpreter: float | None = None  # this interpreter's start, as its script read it first thing (run.py)
_begun = False  # whether a leg has begun in this process


def interpreter_started(at: float) -> None:
    """run.py's first reading: `at`, when this interpreter started (interpreter_start says how)."""
    global _interpreter
    _interpreter = at


def interpreter_start() -> float:
    """When this Python interpreter started, in `time.time()` seconds. Linux records a process's start
    at its fork, not at its exec: a shell that execs python (`bash -c "pip install ... && python
    run.py"` runs its last command so) lends the process its own start, its wait included. So run.py
    reads the time as its first line, less the CPU time the process has used by then: the
    interpreter's own start (CPU work) and a shell's few milliseconds of its own, its children's not.
    Where no script did (an in-process test, a launcher's worker), the process's start."""
    return process_start() if _interpreter is None else _interpreter


def leg_begins() -> float:
    """When a leg that begins now counts from: the interpreter's start for this process's first (its
    imports are its start-up); now for a later one, a sweep's next job, which Hydra's basic launcher
    runs in the same process: the jobs before it are not its time."""
    global _begun
    first, _begun = not _begun, True
    return interpreter_start() if first else time.time()


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
        """`began`: when this leg's time starts counting (standby.taking_over says), if not at this
        interpreter's start."""
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.started = interpreter_start() if began is None else began
        self._lap = time.perf_counter() - (time.time() - self.started)  # the leg's start, on this clock
        self._compiled = compile_seconds()  # an earlier leg's in this process (a sweep's job) is not this one's
        self._in = "startup"
        self._home: Path | None = None  # where the account is kept: rank 0's, once the run holds its home
        self._anchored = False  # whether the home holds a checkpoint of this run
        self._warned = False
        self._before: list[dict] = []  # the legs before this one, the earliest summed into one
        self._reached = 0  # the furthest step an earlier leg trained
        self._step = 0
        self._written = -math.inf
        self._said = ""

    def keep(self, home: Path, continuing: bool, anchored: bool, max_steps: int) -> None:
        """Rank 0, once it holds `home`: reads the legs before this one when the run is `continuing`
        (a resume), none past `max_steps`; a fresh run starts a new account. `anchored`: `home` holds
        the checkpoint this leg resumed from."""
        self._home, self._anchored = home, anchored
        before = earlier_legs(home, max_steps) if continuing else []
        cut = max(0, len(before) - (KEPT_LEGS - 2))  # summed into one, beside the rest and this leg
        self._before = [summed(before[:cut]), *before[cut:]] if cut > 1 else before
        self._reached = max((leg["step"] for leg in self._before), default=0)

    @contextmanager
    def during(self, bucket: str) -> Iterator[None]:
        self.lap(self._in)
        outer, self._in = self._in, bucket  # a stretch within this one (a hook within a save) laps it first
        try:
            yield
        finally:
            self.lap(bucket)
            self._in = outer

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
        """At a logging step: the account on disk, a second after the last write ended at the earliest."""
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
        run = summed([*self._before, self._leg()])
        return {
            "goodput/fraction": run["seconds"]["train"] / run["wall"] if run["wall"] > 0 else 0.0,
            "goodput/wall_s": run["wall"],
            **{f"goodput/{bucket}_s": value for bucket, value in run["seconds"].items()},
            "goodput/legs": run["legs"],
            "goodput/between_legs_s": run["between"],
        }

    def close(self, step: int) -> None:
        """At the leg's end: the account on disk, and the line `summary` says."""
        totals = self.totals(step)
        if self._anchored or self._before:
            self._write()
        elif self._home is not None:  # a run that saved nothing leaves its home as it found it
            with contextlib.suppress(OSError):
                ledger(self._home).unlink(missing_ok=True)
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
        if self._home is not None:
            try:
                write_text(ledger(self._home), json.dumps({"legs": [*self._before, self._leg()]}))
            except OSError as error:  # a full disk: tried again at the next beat, said once
                if not self._warned:
                    log.warning(
                        f"{ledger(self._home)} could not be written ({error.strerror or error}); training goes on"
                    )
                self._warned = True
        self._written = time.perf_counter()  # from the write's end: a slow write is not followed at once


def summed(legs: list[dict]) -> dict:
    """`legs` as one leg: from the earliest start to the latest end, their buckets, wall times and
    count summed, and the time between them kept apart ("between"), as the totals take it."""
    gaps = sum(max(0.0, leg["started"] - before["ended"]) for before, leg in pairwise(legs))
    return {
        "started": min(leg["started"] for leg in legs),
        "ended": max(leg["ended"] for leg in legs),
        "step": max(leg["step"] for leg in legs),
        "seconds": {bucket: sum(leg["seconds"][bucket] for leg in legs) for bucket in BUCKETS},
        "legs": sum(leg.get("legs", 1) for leg in legs),
        "wall": sum(leg.get("wall", leg["ended"] - leg["started"]) for leg in legs),
        "between": gaps + sum(leg.get("between", 0.0) for leg in legs),
    }


def ledger(home: Path) -> Path:
    """The run's account in its home, by the name home.py gives it beside the checkpoints'."""
    from ..checkpoint.home import GOODPUT  # torch (home.py's schema): not before run.py starts its sender

    return home / GOODPUT


def earlier_legs(home: Path, max_steps: int) -> list[dict]:
    """The legs `home`'s account holds, each with every bucket; none, with one line, where it is no
    account this module wrote, or holds a number no leg of this run can have written."""
    path = ledger(home)
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
        if not (isinstance(legs, list) and len(legs) <= MOST_LEGS and all(map(is_leg, legs))):
            problem = "is not an account this project wrote"
        elif not (problem := implausible(legs, max_steps, time.time())):
            return [{**leg, "seconds": {bucket: leg["seconds"].get(bucket, 0.0) for bucket in BUCKETS}} for leg in legs]
    log.warning(f"{path} {problem}: goodput counts from this leg on")
    return []


def is_leg(leg: object) -> bool:
    """`leg` has the form of one this module writes: numbers where they go, a summed one's as well."""

    def number(value: object) -> bool:
        return type(value) in (int, float) and math.isfinite(value) and value >= 0

    summed_one = ("legs", "wall", "between")
    return (
        isinstance(leg, dict)
        and number(leg.get("started"))
        and number(leg.get("ended"))
        and type(leg.get("step")) is int
        and leg["step"] >= 0
        and isinstance(leg.get("seconds"), dict)
        and set(BUCKETS) - set(LATER) <= set(leg["seconds"]) <= set(BUCKETS)
        and all(map(number, leg["seconds"].values()))
        and (not any(key in leg for key in summed_one) or all(number(leg.get(key)) for key in summed_one))
        and type(leg.get("legs", 1)) is int
    )


def implausible(legs: list[dict], max_steps: int, now: float) -> str | None:
    """What in `legs` no leg of this run can have written (a time outside its life, buckets beyond
    its wall time, a step past `max_steps`, a count of legs beyond any run's), said; None if nothing."""
    if sum(leg.get("legs", 1) for leg in legs) > MOST_LEGS:
        return f"holds more than {MOST_LEGS} legs, more than any run restarts"
    for leg in legs:
        span, count = leg["ended"] - leg["started"], leg.get("legs", 1)
        wall = leg.get("wall", span)
        if leg["ended"] > now + CLOCKS_APART_S:
            return "holds a leg that ends in the future"
        if leg["started"] < EARLIEST:
            return "holds a leg that starts before any run of this project"
        if span < 0:
            return "holds a leg that ends before it starts"
        if count < 1 or wall > count * span or leg.get("between", 0.0) > span:
            return "holds legs summed into more time than they span"
        # A second a leg: a step of the system's clock within a leg moves its ends, not its buckets.
        if sum(leg["seconds"].values()) > wall + count:
            return "holds a leg whose buckets add up to more than its wall time"
        if leg["step"] > max_steps:
            return f"holds a leg at step {leg['step']}, past trainer.max_steps={max_steps}"
    return None

"""The exceptions that reach the person running the job, each said in one line."""

import os
import re
import shlex
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# What a terminal acts on rather than shows (ESC starts a sequence that can rewrite the screen), and
# line breaks, which would forge a line of their own: never printed from a value the run was given.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class RunError(Exception):
    """A problem the person running the job can fix: printed as one line, without a traceback.

    The message says what was asked, what was found, and what to type instead.
    """


class CheckpointError(RunError):
    """A checkpoint that cannot be used: damaged, unsafe, incomplete, or from an unknown format."""


class SaveError(RunError):
    """A checkpoint that could not be written (a full disk, a folder gone read-only)."""


def listed(names: list[str], most: int = 8, between: str = ", ") -> str:
    """Up to `most` of `names`, the rest counted: a message stays one readable line."""
    more = len(names) - most
    return between.join(names[:most]) + (f" and {more} more" if more > 0 else "")


def readable(size: int) -> str:
    """Bytes in the largest binary unit they fill, to 4 figures: 160 KiB, 1.273 GiB."""
    power = min((max(size, 1).bit_length() - 1) // 10, 4)
    return f"{size / 1024**power:.4g} {('bytes', 'KiB', 'MiB', 'GiB', 'TiB')[power]}"


def shown(value: object) -> str:
    """`value` as a message may print it: a name or path read from a checkpoint or a file is data
    from anywhere, so its control characters are dropped."""
    return CONTROL.sub("", str(value))


def typed(value: object) -> str:
    """`value` as one shell word in a command a message offers, safe to paste: quoted where the
    shell would read it otherwise (`; curl ...|sh`), its control characters dropped."""
    return shlex.quote(shown(value))


def first_line(error: BaseException) -> str:
    """What `error` says, in one line."""
    # SQLAlchemy (MLflow's sqlite store) puts its own notes ("raised as a result of Query-invoked
    # autoflush") before what the database said, which its DBAPIError keeps as `orig`.
    if isinstance(getattr(error.__cause__, "orig", None), BaseException):
        error = error.__cause__.orig
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def reported(work: Callable[[], T]) -> T:
    """`work()`; a RunError it raises is printed as one line, without a traceback, and the process
    exits with 2. Every process prints it: the one that failed may not be rank 0."""
    try:
        return work()
    except RunError as error:
        rank = os.environ.get("RANK", "0")
        print(f"{'' if rank == '0' else f'[rank {rank}] '}error: {shown(error)}", file=sys.stderr)
        raise SystemExit(2) from None

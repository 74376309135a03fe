"""A run's checkpoint folder, its home: the run's claim on it, the checkpoints' names, the
`latest` and `best` pointers, retention, and the checkpoints a resume sets aside.

A run holds its home for its whole life with an OS lock, so a second run with the same name stops
at once instead of overwriting the first; and it deletes only files whose names it writes itself.
"""

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import RunError
from .files import NotPlain, open_plain, remove, sync_folder, temporary, write_atomically

try:
    import fcntl
except ImportError:  # Windows: no POSIX locks
    fcntl = None

log = logging.getLogger(__name__)

POINTER = "latest"
BEST = "best"  # names the checkpoint of the best optimized_metric, which retention keeps
SCORES = "scores.json"  # each checkpoint's optimized_metric at its step, for `best`
LOCK = "run.lock"
NAME = re.compile(r"step_(\d{8,})(\.pt)?")  # as path_of writes them: a user's step_7.pt is not ours
# The temporary files and folders the package writes (files.temporary), and so the only ones it
# removes: `step_00000100.pt.<tag>.tmp`, `step_00000100.<tag>.tmp/`, `latest.<tag>.tmp`,
# `best.<tag>.tmp`, `scores.json.<tag>.tmp` and the write test's `write-test.<tag>.tmp`.
TEMPORARY = re.compile(r"(step_\d{8,}(\.pt)?|latest|best|scores\.json|write-test)\.\d+-[0-9a-f]+\.tmp")


@contextlib.contextmanager
def claim(home: Path, fresh: str | None = None) -> Iterator[None]:
    """Holds `home` for the life of the `with` block, after checking that it can be written.
    `fresh`: the name of a run that starts without `resume=`, which refuses a home that holds
    checkpoints: its saves would replace theirs.

    The lock is a POSIX record lock (`lockf`) on `run.lock`. The OS drops it when the process
    ends, however it ends, so kill -9 never leaves a stale lock; and unlike `flock`, processes
    forked by the run (data-loader workers, which off Linux outlive a killed parent by seconds) do
    not inherit it. The file names the holder for whoever finds it locked.
    """
    with _open_lock(home) as lock:  # closing it releases the lock
        if _lock(lock, home):
            _write_down(lambda: _name_the_holder(lock), home)
        _write_down(lambda: _check_writable(home), home)
        for leftover in home.iterdir():  # from a run that died mid-save; none can be writing now
            if TEMPORARY.fullmatch(leftover.name):
                remove(leftover)
        if fresh is not None and has_checkpoints(home):
            raise RunError(
                f"{home} already holds checkpoints of {fresh!r}; continue them with resume=last, "
                f"or start a separate run with name=<new name> (or checkpoint.dir=<path>)"
            )
        yield


def _open_lock(home: Path) -> BinaryIO:
    path = home / LOCK
    try:
        home.mkdir(parents=True, exist_ok=True)
        # Not truncated on open: the holder's name stays readable until we hold the lock.
        descriptor = open_plain(path, os.O_RDWR)
    except NotPlain as refused:
        raise RunError(
            f"{path} is {refused.what}, which this run would write through; it writes only files of its own there: "
            f"remove it (rm {path}) and run again"
        ) from None
    except OSError as error:
        raise RunError(_unusable(home, error)) from None
    # Unbuffered: a write that fails (a full disk) fails at once, and closing has nothing left to fail on.
    return os.fdopen(descriptor, "r+b", buffering=0)


def _lock(lock: BinaryIO, home: Path) -> bool:
    """Takes the lock, or raises naming its holder; False where locks are not to be had."""
    if fcntl is None:
        log.warning(f"this platform has no POSIX locks: a second run on {home} would not be stopped")
        return False
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            log.warning(f"cannot lock {home} ({error.strerror}): a second run on it would not be stopped")
            return False
        lock.seek(0)
        holder = lock.read().decode(errors="replace").strip() or "another run (starting up)"
        raise RunError(
            f"{home} is in use by {holder}; wait for that run to end (or stop it), "
            f"or train separately with name=<another name>"
        ) from None
    return True


def _name_the_holder(lock: BinaryIO) -> None:
    lock.seek(0)
    lock.truncate(0)
    lock.write(f"PID {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())


def _check_writable(home: Path) -> None:
    """Writes, syncs and removes a small file, so that a folder that cannot take checkpoints (read
    only, immutable, a full disk) stops the run now, not at its first save hours later."""
    probe = temporary(home / "write-test")
    try:
        with open(probe, "xb") as file:
            file.write(bytes(4096))
            file.flush()
            os.fsync(file.fileno())
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)


def _write_down(write: Callable[[], None], home: Path) -> None:
    try:
        write()
    except OSError as error:
        raise RunError(_unusable(home, error)) from None


def _unusable(home: Path, error: OSError) -> str:
    if error.errno == errno.ENAMETOOLONG:
        longest = max(home.parts, key=lambda part: len(part.encode()))
        return (
            f"cannot write checkpoints to {home}: its part {longest[:40]!r}... is {len(longest.encode())} bytes, "
            f"more than the file system allows in a name; choose a shorter name=<name> or checkpoint.dir=<path>"
        )
    reason = (
        "it is a file, not a folder" if error.errno in (errno.EEXIST, errno.ENOTDIR) else error.strerror or str(error)
    )
    return (
        f"cannot write checkpoints to {home} ({reason}); free space or fix its permissions, "
        f"or choose another folder with checkpoint.dir=<path>"
    )


def path_of(home: Path, step: int, folder: bool = False) -> Path:
    """The checkpoint of `step`: a file, or a folder of shards."""
    return home / (f"step_{step:08d}" if folder else f"step_{step:08d}.pt")


def steps(home: Path) -> list[tuple[int, Path]]:
    """The checkpoints in `home`, with their steps, in no order."""
    if not home.is_dir():
        return []
    return [
        (int(match[1]), path)
        for path in home.iterdir()
        if (match := NAME.fullmatch(path.name)) and (match[2] is None) == path.is_dir()  # step_N/ or step_N.pt
    ]


def has_checkpoints(home: Path) -> bool:
    return any(steps(home))


def completed(path: Path, keep_last: int, score: dict | None = None) -> None:
    """After `path` was renamed into its home: `latest` points at it, both renames are durable, and
    the newest `keep_last` checkpoints remain; given its `score` (checkpoint.keep_best: the
    optimized_metric at its step), ranked, and the best remains too. `latest` is for people and
    tools (a resume goes by step numbers, as a crash between two renames can leave it one save
    behind): no fsync of its own; `best` decides what is deleted, and is durable."""
    home = path.parent
    write_atomically(home / POINTER, lambda file: file.write(path.name.encode()), durable=False)
    sync_folder(home)
    newest = [older for _, older in sorted(steps(home), reverse=True)]
    kept = {older.name for older in newest[:keep_last]}
    if score is not None:
        try:
            best = rank(home, {path.name: score["value"]}, score["metric"], score["mode"], kept)
        except OSError as error:  # a full disk: the checkpoint is whole, and deletes wait for a ranking
            log.warning(f"{path.name} is saved but not ranked ({error.strerror or error}); nothing is pruned for now")
            return
        kept.add(best)
    for older in newest:
        if older.name not in kept:
            remove(older)


def step_of(path: Path) -> int:
    """The step of a checkpoint by its name (path_of's)."""
    return int(NAME.fullmatch(path.name)[1])


def best_of(home: Path) -> Path | None:
    """The checkpoint `best` names, if it is still there."""
    try:
        name = (home / BEST).read_text().strip()
    except OSError:
        return None
    path = home / name
    return path if NAME.fullmatch(name) and path.exists() else None


def rank(home: Path, scored: dict[str, float], metric: str, mode: str, kept: set[str] | None = None) -> str | None:
    """Adds `scored` to the scores of the checkpoints in `home` (those of another metric or mode are
    dropped), points `best` at the best of them, the earliest of equals (none left: no `best`), and
    returns its name; with `kept`, the names retention keeps, the scores of the others go."""
    scores = {**_scores(home, metric, mode), **scored}
    present = {path.name for _, path in steps(home)}
    scores = {name: value for name, value in scores.items() if name in present and math.isfinite(value)}
    best = (min if mode == "min" else max)(sorted(scores), key=scores.__getitem__) if scores else None
    if kept is not None:
        scores = {name: value for name, value in scores.items() if name in kept or name == best}
    ledger = json.dumps({"metric": metric, "mode": mode, "scores": scores}, indent=1)
    write_atomically(home / SCORES, lambda file: file.write(ledger.encode()), durable=True)
    if best is None:
        with contextlib.suppress(FileNotFoundError):
            (home / BEST).unlink()
    else:
        write_atomically(home / BEST, lambda file: file.write(best.encode()), durable=True)
    return best


def rerank(home: Path) -> None:
    """`best` again, among the checkpoints still in `home` (after some were set aside)."""
    if (judged := _ledger(home)) is not None:
        rank(home, {}, judged["metric"], judged["mode"])


def _ledger(home: Path) -> dict | None:
    """`scores.json`, if it is one this module wrote; anything else is as none (damaged or foreign)."""
    try:
        ledger = json.loads((home / SCORES).read_text())
    except (OSError, ValueError):
        return None
    if not (
        isinstance(ledger, dict) and isinstance(ledger.get("scores"), dict) and ledger.get("mode") in ("min", "max")
    ):
        return None
    return ledger if isinstance(ledger.get("metric"), str) else None


def _scores(home: Path, metric: str, mode: str) -> dict[str, float]:
    ledger = _ledger(home)
    if ledger is None or (ledger["metric"], ledger["mode"]) != (metric, mode):
        return {}
    return {name: value for name, value in ledger["scores"].items() if isinstance(value, int | float)}


def set_aside_newer(home: Path, step: int) -> Path | None:
    """Moves the checkpoints of `home` past `step` into a subfolder, and returns it: a run resumed
    from an earlier step must not be pruned away by, or lose `resume=last` to, the future it
    abandons, and nothing saved is deleted."""
    newer = [path for number, path in steps(home) if number > step]
    if not newer:
        return None
    name = f"set-aside-{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step}"
    for attempt in itertools.count():  # a new folder: one that is there already (a link, say) is not ours
        folder = home / (name if attempt == 0 else f"{name}-{attempt}")
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            break
    for path in newer:
        os.replace(path, folder / path.name)
    rerank(home)
    return folder

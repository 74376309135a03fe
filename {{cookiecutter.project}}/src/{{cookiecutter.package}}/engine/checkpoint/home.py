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

from ..errors import CheckpointError, RunError
from .files import (
    NotPlain,
    NotRegular,
    load_restricted,
    open_plain,
    open_regular,
    read_regular,
    remove,
    sync_folder,
    temporary,
    write_atomically,
)
from .schema import STATE

try:
    import fcntl
except ImportError:  # Windows: no POSIX locks
    fcntl = None

log = logging.getLogger(__name__)

POINTER = "latest"
BEST = "best"  # names the checkpoint of the best optimized_metric, which retention keeps
SCORES = "scores.json"  # the ranking for `best`: each checkpoint's optimized_metric, which it also holds itself
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
    not inherit it. The file names the holder for whoever finds it locked, once the run knows the
    home is its own: a run refused over another run's checkpoints leaves their lock file as it was.
    A run that fails with nothing saved there (one refused at start) leaves the home as it found it:
    the lock file and the folders the claim made go.
    """
    made = [folder for folder in (home, *home.parents) if not os.path.lexists(folder)]  # the deepest first
    made_lock = not os.path.lexists(home / LOCK)
    found = set(os.listdir(home)) if os.path.isdir(home) else set()
    try:
        lock, locked = _lock(home)
        with lock:  # closing it releases the lock
            try:
                if fresh is not None and has_checkpoints(home):
                    raise RunError(_taken(home, fresh))
                if locked:
                    _write_down(lambda: _name_the_holder(lock), home)
                _write_down(lambda: _check_writable(home), home)
                for leftover in home.iterdir():  # from a run that died mid-save; none can be writing now
                    if TEMPORARY.fullmatch(leftover.name):
                        remove(leftover)
                yield
            except BaseException:  # while the lock is held: a run that opened the file meanwhile finds it gone (_lock)
                if made_lock:
                    with contextlib.suppress(OSError):
                        if set(os.listdir(home)) <= found | {LOCK}:  # nothing saved
                            (home / LOCK).unlink()
                raise
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):  # only while empty: whatever appeared there stays, and what holds it
                folder.rmdir()
        raise


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


def _lock(home: Path) -> tuple[BinaryIO, bool]:
    """The lock file, opened and locked, or a RunError naming its holder; False where locks are not
    to be had. A run refused at start removes the lock file it made, while it holds it: one locked
    just after that is no longer the home's, and the home's is opened anew."""
    while True:
        lock = _open_lock(home)
        if fcntl is None:
            log.warning(f"this platform has no POSIX locks: a second run on {home} would not be stopped")
            return lock, False
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
                log.warning(f"cannot lock {home} ({error.strerror}): a second run on it would not be stopped")
                return lock, False
            lock.seek(0)
            holder = lock.read().decode(errors="replace").strip() or "another run (starting up)"
            lock.close()
            raise RunError(
                f"{home} is in use by {holder}; wait for that run to end (or stop it), "
                f"or train separately with name=<another name>"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(home / LOCK, follow_symlinks=False)):
                return lock, True
        lock.close()


def _taken(home: Path, fresh: str) -> str:
    """The refusal of a fresh run over the checkpoints in `home`, naming the run they are of."""
    owner = _owner(home)
    if owner is None or owner == fresh:
        of = "" if owner is None else f" of {owner!r}"
        return (
            f"{home} already holds checkpoints{of}; continue them with resume=last, "
            f"or start a separate run with name=<new name> (or checkpoint.dir=<path>)"
        )
    return (
        f"{home} holds the checkpoints of another run, {owner!r}; continue that run with name={owner} "
        f"checkpoint.dir={home} resume=last, or give {fresh!r} a folder of its own with checkpoint.dir=<path>"
    )


def _owner(home: Path) -> str | None:
    """The name of the run whose newest checkpoint is in `home`, from the config it holds, or None
    where that cannot be read. No tensor is read: a refusal costs no checkpoint's load."""
    newest = max(steps(home))[1]
    try:
        state = load_restricted(newest / STATE if newest.is_dir() else newest, newest, device="meta")
    except CheckpointError:  # a file that is no checkpoint of ours: only a name is lost
        return None
    config = state.get("config") if isinstance(state, dict) else None
    name = config.get("name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


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


Score = tuple[str, str, float]  # what ranks a checkpoint: its optimized_metric, optimized_mode and value


def completed(path: Path, keep_last: int, score: dict | None = None) -> None:
    """After `path` was renamed into its home: `latest` points at it, both renames are durable, and
    the newest `keep_last` checkpoints remain; given its `score` (checkpoint.keep_best: the
    optimized_metric at its step), ranked, and those the ranking keeps remain too. `latest` is for
    people and tools (a resume goes by step numbers, as a crash between two renames can leave it one
    save behind): no fsync of its own; the ranking decides what is deleted, and is durable."""
    home = path.parent
    write_atomically(home / POINTER, lambda file: file.write(path.name.encode()), durable=False)
    sync_folder(home)
    newest = [older for _, older in sorted(steps(home), reverse=True)]
    kept = {older.name for older in newest[:keep_last]}
    if score is not None:
        try:
            kept |= rank(home, {path.name: score}, score["metric"], score["mode"], kept)
        except OSError as error:  # a full disk: the checkpoint is whole, and deletes wait for a ranking
            log.warning(f"{path.name} is saved but not ranked ({error.strerror or error}); nothing is pruned for now")
            return
    for older in newest:
        if older.name not in kept:
            remove(older)


def step_of(path: Path) -> int:
    """The step of a checkpoint by its name (path_of's)."""
    return int(NAME.fullmatch(path.name)[1])


def best_of(home: Path) -> Path | None:
    """The checkpoint `best` names, if it is still there. Anything else found there (other text, a
    link to a binary file, a FIFO) names none."""
    try:
        with open_regular(home / BEST) as file:
            name = file.read(64).decode().strip()  # a name path_of writes is shorter
    except (OSError, UnicodeDecodeError):
        return None
    path = home / name
    return path if NAME.fullmatch(name) and path.exists() else None


def rank(home: Path, scored: dict[str, dict], metric: str, mode: str, kept: set[str] | None = None) -> set[str]:
    """Ranks the checkpoints in `home` by `metric` and `mode`: `scored` (names, and their scores as a
    checkpoint holds them) added to the scores `scores.json` records, or, where it cannot be trusted,
    to those the checkpoints hold. `best` names the best, the earliest of equals (none: no `best`).
    A checkpoint ranked by another metric or mode (a resume that changed optimized_metric) is not
    comparable: the best of each such ranking is held, kept until someone deletes it. Returns the
    names retention keeps for the ranking: the best and those held. With `kept`, the names retention
    keeps besides, the scores of the others go. The ranking is durable before anything is deleted."""
    ledger = _ledger(home)
    if isinstance(ledger, dict):
        known, held_before = ledger["known"], ledger["held"]
    else:
        known, held_before = _rebuilt(home, ledger, set(scored)), set()
    known |= {name: found for name, score in scored.items() if (found := _checked(name, score))}
    present = {path.name for _, path in steps(home)}
    rankings: dict[tuple[str, str], dict[str, float]] = {}
    for name, (by, order, value) in known.items():
        if name in present and math.isfinite(value):
            rankings.setdefault((by, order), {})[name] = value
    scores = rankings.pop((metric, mode), {})
    best = _best(scores, mode)
    held = {
        name: {"metric": by, "mode": order, "value": values[name]}
        for (by, order), values in rankings.items()
        if (name := _best(values, order))
    }
    if kept is not None:
        scores = {name: value for name, value in scores.items() if name in kept or name == best}
    text = json.dumps({"metric": metric, "mode": mode, "scores": scores, "held": held}, indent=1)
    write_atomically(home / SCORES, lambda file: file.write(text.encode()), durable=True)
    if best is None:
        with contextlib.suppress(FileNotFoundError):
            (home / BEST).unlink()
    else:
        write_atomically(home / BEST, lambda file: file.write(best.encode()), durable=True)
    for name in sorted(held.keys() - held_before):
        by, order = held[name]["metric"], held[name]["mode"]
        log.warning(
            f"{name}, the best by {by} ({order}), is kept apart from this run's ranking by {metric} ({mode}): "
            f"delete it yourself once done with it, or resume with optimized_metric={by} optimized_mode={order} "
            f"to rank by it again"
        )
    return {best, *held} - {None}


def _best(scores: dict[str, float], mode: str) -> str | None:
    return (min if mode == "min" else max)(sorted(scores), key=scores.__getitem__) if scores else None


def rerank(home: Path) -> None:
    """`best` again, among the checkpoints still in `home` (after some were set aside)."""
    if isinstance(judged := _ledger(home), dict):
        rank(home, {}, judged["metric"], judged["mode"])


def _ledger(home: Path) -> dict | str:
    """`scores.json`, if it is one this module wrote: its `metric` and `mode`, the scores it records
    (`known`) and the names it holds apart (`held`); else what is wrong with it (missing, a FIFO,
    damaged, foreign), and the checkpoints are ranked by the scores they hold."""
    try:
        ledger = json.loads(read_regular(home / SCORES))
    except FileNotFoundError:
        return "is missing"
    except NotRegular as refused:
        return f"is {refused.what}"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except (ValueError, RecursionError):  # not JSON, not text, or nested past what the parser takes
        return "is damaged"
    if not (
        isinstance(ledger, dict)
        and isinstance(ledger.get("metric"), str)
        and ledger.get("mode") in ("min", "max")
        and isinstance(ledger.get("scores"), dict)
        and isinstance(ledger.get("held", {}), dict)  # rankings written before held ones hold none
    ):
        return "is not a ranking this project wrote"
    by = {"metric": ledger["metric"], "mode": ledger["mode"]}
    known = {name: _score({**by, "value": value}) for name, value in ledger["scores"].items()}
    known |= {name: _score(score) for name, score in ledger.get("held", {}).items()}
    if None in known.values():
        return "holds a score that is no metric's value"
    return {**by, "known": known, "held": set(ledger.get("held", {}))}


def _rebuilt(home: Path, problem: str, scored: set[str]) -> dict[str, Score]:
    """The scores the checkpoints in `home` hold themselves (but those of `scored`), for a ranking
    `scores.json` cannot give: each read without its tensors."""
    unranked = [path for _, path in sorted(steps(home)) if path.name not in scored]
    if unranked:
        log.warning(f"{home / SCORES} {problem}: the checkpoints are ranked again by the scores they hold")
    known = {}
    for path in unranked:
        try:
            state = load_restricted(path / STATE if path.is_dir() else path, path, device="meta")
        except CheckpointError as error:
            log.warning(f"{error}; it is not ranked")
            continue
        if isinstance(state, dict) and (found := _checked(path.name, state.get("score"))):
            known[path.name] = found
    return known


def _checked(name: str, score: object) -> Score | None:
    """The score a checkpoint holds (None: none); one that is no metric's value (a crafted file) is
    not ranked, with a warning."""
    if (found := _score(score)) is None and score is not None:
        log.warning(f"{name} holds a score that is no metric's value; it is not ranked")
    return found


def _score(score: object) -> Score | None:
    """`{"metric", "mode", "value"}` as a Score, if the value is a number a float holds (an integer
    past 1e308 is not: OverflowError)."""
    if not (isinstance(score, dict) and isinstance(score.get("metric"), str) and score.get("mode") in ("min", "max")):
        return None
    value = score.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return score["metric"], score["mode"], float(value)
    except OverflowError:
        return None


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

"""A run's claim on its checkpoint folder (home.py): held for the run's whole life with an OS
lock, so a second run with the same name stops at once instead of overwriting the first; a fresh
run over another run's checkpoints, or a folder that cannot take checkpoints, stops before
anything is written; and a run refused at its start leaves the folder as it found it.
"""

import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError, RunError, shown, typed
from ..files import NotPlain, load_restricted, open_plain, remove, temporary
from .home import LOCK, TEMPORARY, has_checkpoints, steps
from .schema import STATE

try:
    import fcntl
except ImportError:  # Windows: no POSIX locks
    fcntl = None

log = logging.getLogger(__name__)


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
    except IsADirectoryError:
        raise RunError(
            f"{path} is a folder, where this run keeps its lock file (one it writes itself): move the folder out of "
            f"the checkpoint folder (mv {path} <elsewhere>) and run again"
        ) from None
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
        if _is_the_homes(lock, home):
            return lock, True
        lock.close()


def _is_the_homes(lock: BinaryIO, home: Path) -> bool:
    """Whether `lock` is still the home's lock file, not one that a run refused at its start removed."""
    with contextlib.suppress(FileNotFoundError):
        return os.path.samestat(os.fstat(lock.fileno()), os.stat(home / LOCK, follow_symlinks=False))
    return False


@contextlib.contextmanager
def after_holder(home: Path) -> Iterator[bool]:
    """Waits, however long, until the run that holds `home` ends, however it ends (the OS frees its
    lock with its process, kill -9 too), then holds the home's lock until the block ends, and yields
    whether it had to wait. `claim`, in this process, takes the lock over (a POSIX lock is the
    process's), so that no other run starts in between."""
    waited = False
    while fcntl is not None and os.path.lexists(home / LOCK):  # a home no run has held: nothing to wait for
        with _open_lock(home) as lock:
            try:
                fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks: `claim` says so
                    break
                waited = True
                fcntl.lockf(lock, fcntl.LOCK_EX)  # a signal's handler may end the wait by raising
            if _is_the_homes(lock, home):
                yield waited
                return
    yield waited


def _taken(home: Path, fresh: str) -> str:
    """The refusal of a fresh run over the checkpoints in `home`, naming the run they are of."""
    owner = _owner(home)
    if owner is None or owner == fresh:
        of = "" if owner is None else f" of {owner!r}"
        return (
            f"{home} already holds checkpoints{of}; continue them with name={typed(fresh)} checkpoint.dir={typed(home)} resume=last, "
            f"or start a separate run with name=<new name> (or checkpoint.dir=<path>)"
        )
    return (  # the owner's name is read from a checkpoint: data from anywhere, pasted into a command
        f"{home} holds the checkpoints of another run, {shown(owner)!r}; continue that run with name={typed(owner)} "
        f"checkpoint.dir={typed(home)} resume=last, or give {fresh!r} a folder of its own with checkpoint.dir=<path>"
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

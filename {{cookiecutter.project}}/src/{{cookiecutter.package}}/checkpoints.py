"""Checkpoint files: the run's claim on its folder, atomic writes, the `latest` pointer,
retention, safe loading, and what `resume=` means.

A checkpoint is one file, `step_00001200.pt`, or under strategy=fsdp one folder, `step_00001200/`,
holding every process's shards of the model and optimizer (sharded.py) and a `state.pt` with the
rest. Either is written under a temporary name, fsynced and only then renamed to its own, so a
crash at any instant, of any process, mid-save included, leaves the previous checkpoint the newest
whole one. What the rename cannot prevent, a file damaged after it was written (a truncated copy,
a bad disk), checksums reveal: the CRC-32C of a checkpoint file's bytes, taken as they are written
and stored in the file (`_seal`), and that of each shard file; `load` checks them, which
torch.load alone does not.

A run holds its checkpoint folder (its home) for its whole life with an OS lock, so a second run
with the same name stops at once instead of overwriting the first; and it deletes only files
whose names it writes itself.
"""

import contextlib
import errno
import itertools
import logging
import mmap
import os
import pickle
import re
import secrets
import shutil
import socket
import stat
import struct
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import crc32c
import torch

from .errors import RunError

try:
    import fcntl
except ImportError:  # Windows: no POSIX locks
    fcntl = None

log = logging.getLogger(__name__)

# The layout below; a checkpoint of any other is refused in one line that names its format.
FORMAT_VERSION = 3
POINTER = "latest"
LOCK = "run.lock"
NAME = re.compile(r"step_(\d{8,})(\.pt)?")  # as path_of writes them: a user's step_7.pt is not ours
STATE = "state.pt"  # in a folder checkpoint: everything but the shards
# Temporary files and folders this module writes, and so the only ones it removes:
# `step_00000100.pt.<tag>.tmp`, `step_00000100.<tag>.tmp/`, `latest.<tag>.tmp` and the write
# test's `write-test.<tag>.tmp`.
TEMPORARY = re.compile(r"(step_\d{8,}(\.pt)?|latest|write-test)\.\d+-[0-9a-f]+\.tmp")
# A zip record's local header: its signature, then (past 22 bytes) the lengths of its name and
# extra field, which come before its data.
LOCAL_HEADER = struct.Struct("<4s22xHH")
# The end of a zip archive: 22 bytes, the last two the length of the archive's comment. A file
# checkpoint's comment is the CRC-32C of every byte torch.save wrote (`_seal`).
END_OF_ARCHIVE = 22
SEAL = re.compile(rb"crc32c:([0-9a-f]{8})")
SEAL_SIZE = len("crc32c:") + 8


class CheckpointError(RunError):
    """A checkpoint that cannot be used: damaged, unsafe, incomplete, or from an unknown format."""


class SaveError(RunError):
    """A checkpoint that could not be written (a full disk, a folder gone read-only)."""


@contextlib.contextmanager
def claim(home: Path) -> Iterator[None]:
    """Holds `home` for the life of the `with` block, after checking that it can be written.

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
                _remove(leftover)
        yield


def _open_lock(home: Path) -> BinaryIO:
    """The lock file, opened without following a link: it is truncated and written, and a link
    (`run.lock -> ~/thesis.txt`) would carry that write out of the folder, onto whatever it names."""
    path = home / LOCK
    try:
        home.mkdir(parents=True, exist_ok=True)
        # Not truncated on open: the holder's name stays readable until we hold the lock.
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise RunError(_not_ours(path, "a symbolic link")) from None
        raise RunError(_unusable(home, error)) from None
    found = os.fstat(descriptor)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink > 1:  # a FIFO, a device, a hard link to another file
        os.close(descriptor)
        raise RunError(_not_ours(path, "not a plain file" if not stat.S_ISREG(found.st_mode) else "a hard link"))
    # Unbuffered: a write that fails (a full disk) fails at once, and closing has nothing left to fail on.
    return os.fdopen(descriptor, "r+b", buffering=0)


def _not_ours(path: Path, what: str) -> str:
    return (
        f"{path} is {what}, which this run would write through; it writes only files of its own there: "
        f"remove it (rm {path}) and run again"
    )


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
    probe = _temporary(home / "write-test")
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


def _remove(path: Path) -> None:
    """Deletes a file or folder this module wrote; one it may not delete (made immutable by its
    owner, say) stays, with a warning, and the run goes on."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as error:
        log.warning(f"could not remove {path} ({error.strerror}); it stays")


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


def save(state: dict, home: Path, step: int, keep_last: int) -> Path:
    """Writes `state` as the checkpoint of `step`, points `latest` at it, and keeps the newest
    `keep_last` checkpoints. A write that fails raises SaveError and leaves no file behind."""
    path = path_of(home, step)
    try:
        home.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, lambda file: _torch_save(state, file), durable=True)
        # For people and tools only (resume goes by step numbers), so it needs no fsync of its own.
        _write_atomically(home / POINTER, lambda file: file.write(path.name.encode()), durable=False)
        _sync_folder(home)  # both renames survive a power cut
    except OSError as error:
        raise SaveError(f"could not write {path} ({error.strerror or error})") from None
    _prune(home, keep_last)
    return path


def save_folder(state: dict, temporary: Path, home: Path, step: int, keep_last: int) -> Path:
    """Completes the sharded checkpoint of `step`, whose shards every process has written into
    `temporary`: writes `state` (the rest, with the shards' checksums) beside them, renames the
    folder to its own name, points `latest` at it, and keeps the newest `keep_last`. A write that
    fails raises SaveError and leaves no folder behind."""
    path = path_of(home, step, sharded=True)
    try:
        _write_atomically(temporary / STATE, lambda file: _torch_save(state, file), durable=True)
        _sync_folder(temporary)
        if path.exists():  # the same step saved before, by a run that resumed from an earlier one
            _remove(path)
        os.replace(temporary, path)
        _write_atomically(home / POINTER, lambda file: file.write(path.name.encode()), durable=False)
        _sync_folder(home)
    except OSError as error:
        _remove(temporary)
        raise SaveError(f"could not write {path} ({error.strerror or error})") from None
    _prune(home, keep_last)
    return path


def temporary_folder(home: Path, step: int) -> Path:
    """Where the processes write the shards of `step` before it is complete."""
    return _temporary(path_of(home, step, sharded=True))


def discard(temporary: Path) -> None:
    """A sharded save that failed: its shards are removed."""
    _remove(temporary)


def path_of(home: Path, step: int, sharded: bool = False) -> Path:
    return home / (f"step_{step:08d}" if sharded else f"step_{step:08d}.pt")


def load(path: Path, verify: bool = True) -> dict:
    """Reads a checkpoint onto the CPU without running any code inside it; a folder checkpoint's
    shards are checked, not read (sharded.read loads them into the model where it is placed).

    `weights_only=True` refuses anything but tensors and plain containers, so a crafted pickle
    cannot execute. Loading onto the CPU lets a checkpoint written on any device resume on any
    other: the runner places everything afterwards. `verify=False` skips the checksums: for the
    processes of a job whose rank 0 has checked the same files, and for checkpoint.verify=false.
    """
    if path.is_dir():
        return _load_folder(path, verify)
    state = _read(path, verify)
    _check_format(path, state)
    if problems := _structure_problems(state):
        raise CheckpointError(f"{path} is not a complete checkpoint: {'; '.join(problems)}")
    return state


def _load_folder(path: Path, verify: bool) -> dict:
    if not (path / STATE).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {STATE}")
    from . import sharded  # torch.distributed.checkpoint (1 s to import) only where a folder is read

    state = _read(path / STATE, verify)
    _check_format(path, state)
    rest = {part: keys for part, keys in PARTS.items() if part not in IN_SHARDS}
    if problems := _structure_problems(state, rest, {**META, "shards": dict}):
        raise CheckpointError(f"{path} is not a complete checkpoint: {'; '.join(problems)}")
    if verify:
        try:
            sharded.verify(path, state["shards"])
        except sharded.Refused as refusal:
            raise CheckpointError(f"{path} was refused: {refusal}; load only checkpoints this project wrote") from None
    return state


def _check_format(path: Path, state: object) -> None:
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} has format {found!r}; this project reads format {FORMAT_VERSION}: resume it with the "
            f"version of the project that wrote it, or start a new run with name=<new name>"
        )


def _read(path: Path, verify: bool) -> object:
    """torch.load onto the CPU, restricted to tensors and plain values; with `verify`, the file's
    checksums are checked in other threads while torch reads, and a damaged file is named as
    damaged, whatever torch made of it, before its contents are returned to anyone."""
    with ThreadPoolExecutor(max_workers=1) as checker:
        damaged = checker.submit(_check_checksums, path) if verify else None
        try:
            state = _load_restricted(path)
        except CheckpointError:
            if damaged is not None:
                damaged.result()
            raise
        if damaged is not None:
            damaged.result()
    return state


def _load_restricted(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # Only the name of what was refused: torch's own text goes on to suggest weights_only=False.
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        reason = f"it asks for {named[1]}" if named else "it holds more than tensors and plain values"
        raise CheckpointError(
            f"{path} was refused: {reason}, which only unrestricted unpickling could rebuild, and that can "
            f"run arbitrary code; load only checkpoints this project wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, UnicodeDecodeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} is unreadable ({reason}); it may be truncated or not a checkpoint") from None


def _check_checksums(path: Path) -> None:
    """Checks the file against the checksums written at save, reading it through a memory map
    (no copy; what torch.load reads meanwhile comes from the same pages): the CRC-32C of the whole
    file that `_seal` stored, or, in a file written before seals, each record's CRC-32 that
    torch.save stores (zip archives, uncompressed), in parallel threads. Both checksums release
    the GIL while they compute; CRC-32C is four times as fast."""
    try:
        with (
            open(path, "rb") as file,
            zipfile.ZipFile(file) as archive,
            mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as view,
        ):
            seal = SEAL.fullmatch(archive.comment)
            damaged = _unsealed_part(view, int(seal[1], 16)) if seal else _damaged_record(view, archive)
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise CheckpointError(f"{path} is unreadable ({error}); it may be truncated or not a checkpoint") from None
    if damaged is not None:
        raise CheckpointError(f"{path} is damaged: {damaged} no longer matches the checksum written at save")


def _unsealed_part(view: memoryview, sealed: int) -> str | None:
    """None if the bytes before the seal are still those torch.save wrote (whose last two, the
    comment length, were 0), else what changed."""
    found = crc32c.crc32c(bytes(2), crc32c.crc32c(view[: len(view) - SEAL_SIZE - 2]))
    return None if found == sealed else "its content"


def _damaged_record(view: memoryview, archive: zipfile.ZipFile) -> str | None:
    records = archive.infolist()
    with ThreadPoolExecutor(max_workers=min(len(records), os.cpu_count() or 1) or 1) as pool:
        matches = pool.map(lambda record: _record_matches(view, record), records)
        return next((f"its record {r.filename}" for r, ok in zip(records, matches, strict=True) if not ok), None)


def _record_matches(view: memoryview, record: zipfile.ZipInfo) -> bool:
    """Whether the record's bytes still have the CRC-32 written at save. They follow the record's
    local header: 30 bytes, then the name and an extra field of the lengths it gives. torch.save
    stores records uncompressed; a compressed one is not its writing."""
    if record.compress_type != zipfile.ZIP_STORED:
        return False
    header = bytes(view[record.header_offset : record.header_offset + LOCAL_HEADER.size])
    if len(header) < LOCAL_HEADER.size:
        return False
    signature, name_length, extra_length = LOCAL_HEADER.unpack(header)
    start = record.header_offset + LOCAL_HEADER.size + name_length + extra_length
    end = start + record.compress_size
    if signature != zipfile.stringFileHeader or end > len(view):
        return False
    return zlib.crc32(view[start:end]) == record.CRC


# What a checkpoint holds, declared once. Each part is the state_dict of the run's attribute of
# that name (train.Run), Stateful as torch.distributed.checkpoint takes them, with the keys it must
# hold. A restore loads them in this order: the model before the optimizer, whose state follows
# the parameters' device, and the random state last, so that nothing after it draws. META
# describes the run that saved.
PARTS = {
    "model": (),
    "optimizer": ("state", "param_groups"),
    "scheduler": ("last_epoch",),
    "scaler": (),  # empty when the scaler is off
    "position": ("epoch", "sample"),
    "probe": ("indices", "loss"),
    "tracker": ("run_id",),
    "rng": ("ranks",),
}
IN_SHARDS = ("model", "optimizer")  # the parts every process writes, sharded, under strategy=fsdp (sharded.py)
META = {"format_version": int, "step": int, "config": dict, "device": dict, "amp": dict, "versions": dict}


def _structure_problems(state: dict, parts: dict = PARTS, meta: dict = META) -> list[str]:
    """What is missing or malformed, checked at load: such a checkpoint is named in one line (and
    skipped by resume=last) instead of failing mid-restore. The values inside a part are the
    part's own to check, when it loads them."""
    problems = [f"{key} is missing" for key in (*meta, *parts) if key not in state]
    expected = {**meta, **dict.fromkeys(parts, dict)}
    problems += [
        f"{key} is a {type(state[key]).__name__}"
        for key, kind in expected.items()
        if key in state and not isinstance(state[key], kind)
    ]
    if problems:
        return problems
    problems += [f"{part}.{key} is missing" for part, keys in parts.items() for key in keys if key not in state[part]]
    if type(state["step"]) is not int or state["step"] < 0:
        problems.append(f"step={state['step']!r} is not a count")
    if not isinstance(state["device"].get("type"), str):
        problems.append("device.type is missing")
    if odd := [key for key, value in state.get("model", {}).items() if not torch.is_tensor(value)]:
        problems.append(f"model holds non-tensors at {', '.join(map(str, odd[:3]))}")
    return problems


def find(resume: str | None, home: Path, verify: bool = True) -> tuple[Path, dict] | None:
    """What `resume=` names, loaded: None (start fresh), `last`, `auto` or a path.

    `last` and `auto` take the newest checkpoint in `home` that loads; `last` fails when there is
    none, `auto` starts fresh. A path names a checkpoint (a file, or a folder of shards), or a
    folder to search the same way. `verify=False` (checkpoint.verify) skips the checksums.
    """
    if resume is None:
        return None
    if resume in ("last", "auto"):
        found = newest_valid(home, verify)
        if found is None and has_checkpoints(home):
            raise RunError(
                f"resume={resume}: {home} holds checkpoints, but none loads (see the warnings above); "
                f"pass resume=<a checkpoint you trust>, or move them away to start fresh"
            )
        if found is None and resume == "last":
            raise RunError(
                f"resume=last found no valid checkpoint in {home}; train without resume first, "
                f"or pass resume=auto to start fresh when there is none"
            )
        if found is None:
            log.info(f"resume=auto: no checkpoint in {home}; starting fresh")
        return found
    path = Path(resume).expanduser().resolve()
    if path.is_dir() and not (path / STATE).exists():
        found = newest_valid(path, verify)
        if found is None:
            raise RunError(
                f"resume={resume}: no valid checkpoint in that folder; pass a checkpoint file or resume=last"
            )
        return found
    if path.exists():
        return path, load(path, verify)
    raise RunError(f"resume={resume}: no such file or folder; pass resume=last, resume=auto or a checkpoint path")


def newest_valid(home: Path, verify: bool = True) -> tuple[Path, dict] | None:
    """The newest checkpoint in `home` that loads, falling back, with a warning, past damaged ones.

    It goes by the step numbers in the file names, not by the `latest` pointer (which is there
    for people and tools): a crash between two renames can leave the pointer one save behind.
    """
    for _, path in sorted(_steps(home), reverse=True):
        try:
            return path, load(path, verify)
        except CheckpointError as error:
            log.warning(f"skipping a checkpoint: {error}; falling back to an older one")
    return None


def has_checkpoints(home: Path) -> bool:
    return any(_steps(home))


def set_aside_newer(home: Path, step: int) -> Path | None:
    """Moves the checkpoints of `home` past `step` into a subfolder, and returns it: a run resumed
    from an earlier step must not be pruned away by, or lose `resume=last` to, the future it
    abandons, and nothing saved is deleted."""
    newer = [path for number, path in _steps(home) if number > step]
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
    return folder


def _steps(home: Path) -> list[tuple[int, Path]]:
    if not home.is_dir():
        return []
    return [
        (int(match[1]), path)
        for path in home.iterdir()
        if (match := NAME.fullmatch(path.name)) and (match[2] is None) == path.is_dir()  # step_N/ or step_N.pt
    ]


def _prune(home: Path, keep_last: int) -> None:
    for _, path in sorted(_steps(home), reverse=True)[keep_last:]:
        _remove(path)


def write_text(path: Path, text: str) -> None:
    """Replaces `path` with a file holding `text`, whole or not at all, and never writes through
    a link that stands there."""
    _write_atomically(path, lambda file: file.write(text.encode()), durable=False)


def _write_atomically(path: Path, write: Callable[[BinaryIO], object], durable: bool) -> None:
    temporary = _temporary(path)
    try:
        with open(temporary, "xb") as file:
            write(file)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:  # a full disk or an interrupt: no half-written file stays behind
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise


def _temporary(path: Path) -> Path:
    """A name no other writer uses; it keeps an extension, as torch.save rejects some without."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _torch_save(state: dict, file: BinaryIO) -> None:
    """torch.save, then its seal; raising what really went wrong when a write fails: torch
    reports a full disk, or a Ctrl-C mid-write, as 'unexpected pos 704 vs 598'."""
    writer = _RecordingWriter(file)
    try:
        torch.save(state, writer)
    except RuntimeError:
        if writer.failure is not None:
            raise writer.failure from None
        raise
    _seal(file, writer)


def _seal(file: BinaryIO, writer: "_RecordingWriter") -> None:
    """Stores the CRC-32C of what torch.save wrote as the zip archive's comment: the last two bytes
    it wrote (a comment length of 0) become the seal's length, and the seal follows. Any zip
    reader, torch.load included, reads the archive as before; `_check_checksums` checks the whole
    file at 13 GB/s instead of each record's CRC-32 at 3."""
    if writer.tail[:4] != zipfile.stringEndArchive or writer.tail[-2:] != bytes(2):
        return  # not the ending torch.save writes: left unsealed, checked by its records
    file.seek(-2, os.SEEK_END)
    file.write(SEAL_SIZE.to_bytes(2, "little") + b"crc32c:%08x" % writer.checksum)


class _RecordingWriter:
    """Passes torch.save's bytes to the file, keeping their CRC-32C, the last END_OF_ARCHIVE of
    them, and the error of a write that failed."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.failure = file, None
        self.checksum, self.tail = 0, b""

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except BaseException as failure:
            self.failure = failure
            raise
        self.checksum = crc32c.crc32c(data, self.checksum)
        self.tail = (self.tail + bytes(data[-END_OF_ARCHIVE:]))[-END_OF_ARCHIVE:]
        return written

    def flush(self) -> None:
        self.file.flush()


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

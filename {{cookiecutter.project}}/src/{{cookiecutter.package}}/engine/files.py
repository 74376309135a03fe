"""How the checkpoint package writes and checks bytes: atomic writes, one streaming checksum, one
parallel verifier, one restricted loader, and the one test that a path about to be written holds a
plain file of its own.

The checksum is CRC-32C, not zlib's CRC-32: the CPU computes it (SSE 4.2, ARMv8) about four times
as fast, and a save or a restore that checks every byte pays for its speed. It releases the GIL, so
checks run in parallel threads, one file or part per core, and meanwhile torch reads the same pages.
"""

import contextlib
import errno
import io
import logging
import mmap
import os
import pickle
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import crc32c

from .errors import CheckpointError, SaveError, readable

log = logging.getLogger(__name__)

checksum = crc32c.crc32c  # (bytes, running value=0) -> the running value


def write_atomically(path: Path, write: Callable[[BinaryIO], object], durable: bool) -> None:
    """`path` replaced by what `write` writes, whole or not at all; `durable`: on disk (fsynced)
    before the rename. The rename replaces a link that stands at `path` instead of writing through it."""
    scratch = temporary(path)
    try:
        with open(scratch, "xb") as file:
            write(file)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(scratch, path)
    except BaseException:  # a full disk or an interrupt: no half-written file stays behind
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)
        raise


def write_new(path: Path, write: Callable[[Path], object]) -> None:
    """`path` created, on disk, from the file `write` writes at the path it is given, whole or not
    at all. Whatever stands at `path` already (a file, a link) stays as it is: FileExistsError.
    It gets the mode of a file created there (the umask's), whatever mode `write` gave it:
    safetensors writes 0600, through a file of its own that it renames onto the scratch."""
    scratch = temporary(path)
    try:
        # Also where a folder takes no file (read-only, full, /proc) fails plainly, as an OSError.
        with open(scratch, "xb") as file:
            mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
        write(scratch)
        with open(scratch, "rb") as file:
            os.fchmod(file.fileno(), mode)
            os.fsync(file.fileno())
        os.link(scratch, path)  # unlike a rename, refuses a name that is taken
    finally:
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)
    sync_folder(path.parent)


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda file: file.write(text.encode()), durable=False)


def temporary(path: Path) -> Path:
    """A name beside `path` that no other writer uses; it keeps an extension, as torch.save rejects
    some names without one. home.TEMPORARY recognizes it."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def sync_folder(folder: Path) -> None:
    """The renames in `folder` survive a power cut."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove(path: Path) -> None:
    """Deletes a file or folder the package wrote; one it may not delete (made immutable by its
    owner, say) stays, with a warning, and the run goes on."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as error:
        log.warning(f"could not remove {path} ({error.strerror}); it stays")


class NotPlain(OSError):
    """Something other than a plain file of one name stands where a file is about to be written."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(errno.EEXIST, f"{path} is {what}")
        self.what = what


def open_plain(path: Path, flags: int) -> int:
    """A descriptor of the file `path`, opened with `flags` and created if need be, without following
    a link: a link (`run.lock -> ~/thesis.txt`), a hard link or a FIFO would carry the write out to
    another file. Raises NotPlain, saying what stands there, instead."""
    try:
        descriptor = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotPlain(path, "a symbolic link") from None
        raise
    found = os.fstat(descriptor)
    if stat.S_ISREG(found.st_mode) and found.st_nlink == 1:
        return descriptor
    os.close(descriptor)
    raise NotPlain(path, "a hard link" if stat.S_ISREG(found.st_mode) else "not a plain file")


class NotRegular(OSError):
    """Something other than a regular file stands where a file is about to be read."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {what}, not a regular file")
        self.what = what


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, unless it is not a regular file (`regular_descriptor`)."""
    return os.fdopen(regular_descriptor(path), "rb")


def regular_descriptor(path: Path) -> int:
    """A descriptor of `path` for reading, unless it is not a regular file (NotRegular): reading a
    FIFO waits for a writer that may never come, and a device (`/dev/zero`) never ends. Its stat
    comes first, so a FIFO is never opened (the open alone would wake a writer waiting on it); the
    open does not block, and what it opened is checked again, for a FIFO put there in between. A
    link is followed to what it names."""
    stat_regular(path)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(path, kind(mode))
        os.set_blocking(descriptor, True)
        return descriptor
    except BaseException:
        os.close(descriptor)
        raise


def stat_regular(path: Path) -> os.stat_result:
    """The `os.stat` of `path` (a link followed), refused (NotRegular) where it is no regular file,
    for a reader that opens it later, as open_regular refuses it."""
    found = os.stat(path)
    if not stat.S_ISREG(found.st_mode):
        raise NotRegular(path, kind(found.st_mode))
    return found


def read_regular(path: Path) -> bytes:
    with open_regular(path) as file:
        return file.read()


def read_own(path: Path) -> bytes:
    """The bytes of `path`, a file the package writes, refused (NotRegular) where it is a link,
    symbolic or hard: it would share another run's file, and the package's writes replace a link
    rather than write through it. Also refused where it is no regular file, as read_regular does."""
    found = os.lstat(path)
    if stat.S_ISLNK(found.st_mode):
        raise NotRegular(path, "a symbolic link")
    if stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
        raise NotRegular(path, "a hard link")
    return read_regular(path)


def kind(mode: int) -> str:
    """What a file of `mode` (its st_mode) is, in words, where it is not a regular file."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"


class Checksummed:
    """A file being written front to back, passing on what `write` gets while keeping its size,
    its CRC-32C, its last `tail_size` bytes and the error of a write that failed (torch.save
    reports a full disk, or a Ctrl-C mid-write, as 'unexpected pos 704 vs 598')."""

    def __init__(self, stream: io.IOBase | BinaryIO, tail_size: int = 0) -> None:
        self.stream, self.tail_size = stream, tail_size
        self.size, self.crc, self.tail = 0, 0, b""
        self.failure: BaseException | None = None

    def write(self, data) -> int:
        try:
            written = self.stream.write(data)
        except BaseException as failure:
            self.failure = failure
            raise
        self.crc = checksum(data, self.crc)
        self.size += written
        if self.tail_size:
            self.tail = (self.tail + bytes(data[-self.tail_size :]))[-self.tail_size :]
        return written

    def seek(self, *arguments) -> int:  # a writer that went back would invalidate the running CRC
        raise io.UnsupportedOperation("checksummed streams are written front to back")

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[memoryview]:
    """The bytes of `path` without a copy: what torch.load reads meanwhile comes from the same pages."""
    with open_regular(path) as file:
        if os.fstat(file.fileno()).st_size == 0:  # what mmap cannot map
            yield memoryview(b"")
            return
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as pages, memoryview(pages) as view:
            yield view


def first_failing(checks: Mapping[str, Callable[[], bool]]) -> str | None:
    """The name of the first of `checks` that fails, each run in a thread of its own, up to one per
    core; None when all pass."""
    names = list(checks)
    if not names:
        return None
    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
        passed = list(pool.map(lambda name: checks[name](), names))
    return next((name for name, ok in zip(names, passed, strict=True) if not ok), None)


def load_restricted(source: Path | BinaryIO, name: object, device: str = "cpu") -> object:
    """torch.load onto the CPU admitting only tensors and plain values (`weights_only`), so that a
    crafted pickle cannot run code; what it refuses or cannot read is a CheckpointError naming
    `name`. On the CPU, a checkpoint written on any device resumes on any other; on `device="meta"`,
    no tensor's bytes are read: the plain values, for the price of the pickle."""
    import torch  # not at import: the MLflow sender uses open_plain and never reads a checkpoint

    try:
        if isinstance(source, Path):
            with open_regular(source) as file:
                return torch.load(file, map_location=device, weights_only=True)
        return torch.load(source, map_location=device, weights_only=True)
    except NotRegular as refused:
        raise CheckpointError(
            f"{name} is {refused.what}, not a checkpoint file: name a checkpoint file or folder"
        ) from None
    except pickle.UnpicklingError as error:
        # Only the name of what was refused: torch's own text goes on to suggest weights_only=False.
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        reason = f"it asks for {named[1]}" if named else "it holds more than tensors and plain values"
        raise CheckpointError(
            f"{name} was refused: {reason}, which only unrestricted unpickling could rebuild, and that can "
            f"run arbitrary code; load only checkpoints this project wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, UnicodeDecodeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{name} is unreadable ({reason}); it may be truncated or not a checkpoint") from None


def check_room(free: int, size: int, what: str) -> None:
    """Refuses `what` (writing `size` bytes, said as what goes where) where the disk has `free`
    bytes free, before its first byte: a write that fails midway is learnt late (at a run's last
    save) or taken for another failure (a store's)."""
    if free < size:
        raise no_room(free, size, what)


def no_room(free: int, size: int, what: str) -> SaveError:
    """The line that refuses `what` for want of room: what it takes, what there is, what to do."""
    return SaveError(
        f"{what}: it takes {readable(size)}, and the disk there has {readable(free)} free; free space there, or "
        f"choose a folder with room with checkpoint.dir=<path>, then run again"
    )

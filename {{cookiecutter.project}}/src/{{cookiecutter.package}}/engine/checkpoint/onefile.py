"""The one-file format (strategy=single and ddp): every part in `step_00001200.pt`, written by
rank 0 with torch.save and sealed with the CRC-32C of its bytes.

The seal is the zip archive's comment, so any zip reader, torch.load included, reads the file as
before; `read` checks it in another thread while torch reads, which torch.load alone does not do:
a file damaged after it was written (a truncated copy, a bad disk) is named as damaged, whatever
torch made of it, before its contents reach anyone.
"""

import os
import re
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import CheckpointError, SaveError
from ..files import Checksummed, checksum, first_failing, load_restricted, mapped, open_regular, write_atomically
from .home import completed, path_of

# The end of a zip archive: 22 bytes, the last two the length of the archive's comment.
END_OF_ARCHIVE = 22
SEAL = re.compile(rb"crc32c:([0-9a-f]{8})")
SEAL_SIZE = len("crc32c:") + 8
# A zip record's local header: its signature, then (past 22 bytes) the lengths of its name and
# extra field, which come before its data.
LOCAL_HEADER = struct.Struct("<4s22xHH")


def save(state: dict, home: Path, keep_last: int) -> Path:
    """Rank 0: `state` as the checkpoint of its step in `home`, then `latest` and retention
    (home.completed). A write that fails raises SaveError and leaves no file behind."""
    path = path_of(home, state["step"])
    try:
        home.mkdir(parents=True, exist_ok=True)
        write(state, path)
        completed(path, keep_last, state.get("score"))
    except OSError as error:
        raise SaveError(f"could not write {path} ({error.strerror or error})") from None
    return path


def write(state: dict, path: Path) -> None:
    """`state` as the file `path`, sealed and on disk, or no file at all."""
    write_atomically(path, lambda file: _save_sealed(state, file), durable=True)


def _save_sealed(state: dict, file: BinaryIO) -> None:
    written = Checksummed(file, tail_size=END_OF_ARCHIVE)
    try:
        torch.save(state, written)
    except RuntimeError:
        if written.failure is not None:  # what really went wrong, not torch's 'unexpected pos'
            raise written.failure from None
        raise
    # The last two bytes torch.save wrote are the comment's length, 0: they become the seal's
    # length, and the seal follows. Any other ending is not torch.save's: left unsealed, checked
    # by its records' CRC-32.
    if written.tail[:4] == zipfile.stringEndArchive and written.tail[-2:] == bytes(2):
        file.seek(-2, os.SEEK_END)
        file.write(SEAL_SIZE.to_bytes(2, "little") + b"crc32c:%08x" % written.crc)


def read(path: Path, verify: bool, device: str = "cpu") -> object:
    """The file's contents, on the CPU (or, on "meta", without its tensors' bytes), restricted to
    tensors and plain values; with `verify`, its checksums checked in another thread while torch reads."""
    with ThreadPoolExecutor(max_workers=1) as checker:
        damaged = checker.submit(_check, path) if verify else None
        try:
            state = load_restricted(path, path, device)
        finally:
            if damaged is not None:
                damaged.result()  # a damaged file is named as such, not as whatever torch made of it
    return state


def seal(path: Path) -> str:
    """The file's identity, `crc32c:<hex>`: its seal (no byte read but the archive's end), or, for
    a file that ends otherwise, the CRC-32C of all its bytes."""
    with open_regular(path) as file, zipfile.ZipFile(file) as archive:
        if found := SEAL.fullmatch(archive.comment):
            return f"crc32c:{found[1].decode()}"
    with mapped(path) as view:
        return f"crc32c:{checksum(view):08x}"


def _check(path: Path) -> None:
    """The file against the checksums written at save: the seal over all its bytes, or, in a file
    that ends otherwise, each record's CRC-32 that torch.save stores (uncompressed zip records)."""
    try:
        with open_regular(path) as file, zipfile.ZipFile(file) as archive, mapped(path) as view:
            seal = SEAL.fullmatch(archive.comment)
            if seal:
                checks = {"its content": lambda: _sealed(view) == int(seal[1], 16)}
            else:
                checks = {
                    f"its record {r.filename}": (lambda r=r: _record_matches(view, r)) for r in archive.infolist()
                }
            damaged = first_failing(checks)
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise CheckpointError(f"{path} is unreadable ({error}); it may be truncated or not a checkpoint") from None
    if damaged is not None:
        raise CheckpointError(f"{path} is damaged: {damaged} no longer matches the checksum written at save")


def _sealed(view: memoryview) -> int:
    """The CRC-32C of the bytes torch.save wrote: all before the seal, whose last two were 0."""
    return checksum(bytes(2), checksum(view[: len(view) - SEAL_SIZE - 2]))


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

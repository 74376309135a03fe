"""Checkpoint files: atomic writes, the `latest` pointer, retention, safe loading, and what
`resume=` means.

A checkpoint is one file, `step_00001200.pt`. It is written to a temporary name, flushed,
fsynced and then renamed over the target, so a crash at any instant, mid-save included, leaves the
previous checkpoint whole. What the rename cannot prevent, a file damaged after it was written (a
truncated copy, a bad disk), the CRC-32 that torch.save stores for every record reveals: `load`
checks them all, which torch.load alone does not.
"""

import logging
import os
import pickle
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import RunError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
POINTER = "latest"
NAME = re.compile(r"step_(\d+)\.pt")


class CheckpointError(RunError):
    """A checkpoint that cannot be used: damaged, unsafe, or from an unknown format."""


def save(state: dict, home: Path, step: int, keep_last: int) -> Path:
    """Writes `state` as the checkpoint of `step`, points `latest` at it, and keeps the newest
    `keep_last` checkpoints."""
    home.mkdir(parents=True, exist_ok=True)
    path = path_of(home, step)
    _write_atomically(path, lambda file: torch.save(state, file), durable=True)
    # For people and tools only (resume goes by step numbers), so it needs no fsync of its own.
    _write_atomically(home / POINTER, lambda file: file.write(path.name.encode()), durable=False)
    _sync_folder(home)  # both renames survive a power cut
    _prune(home, keep_last)
    return path


def path_of(home: Path, step: int) -> Path:
    return home / f"step_{step:08d}.pt"


def load(path: Path) -> dict:
    """Reads a checkpoint onto the CPU without running any code inside it.

    `weights_only=True` refuses anything but tensors and plain containers, so a crafted pickle
    cannot execute. Loading onto the CPU lets a checkpoint written on any device resume on any
    other: the runner places everything afterwards.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"{path} is unreadable ({error}); it may be truncated or not a checkpoint") from None
    if damaged is not None:
        raise CheckpointError(f"{path} is damaged: its record {damaged} no longer matches the checksum written at save")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = str(error).strip().splitlines()
        reason = next((line.strip() for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"{path} was refused: it holds objects that only unrestricted unpickling could rebuild, "
            f"which can run arbitrary code ({reason}); load only checkpoints this project wrote"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, UnicodeDecodeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} is unreadable ({reason}); it may be truncated or not a checkpoint") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path} has format {found!r}; this project reads format {FORMAT_VERSION}")
    return state


def find(resume: str | None, home: Path) -> tuple[Path, dict] | None:
    """What `resume=` names, loaded: None (start fresh), `last`, `auto` or a path.

    `last` and `auto` take the newest checkpoint in `home` that loads; `last` fails when there is
    none, `auto` starts fresh. A path names a checkpoint file, or a folder to search the same way.
    """
    if resume is None:
        return None
    if resume in ("last", "auto"):
        found = newest_valid(home)
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
    if path.is_dir():
        found = newest_valid(path)
        if found is None:
            raise RunError(
                f"resume={resume}: no valid checkpoint in that folder; pass a checkpoint file or resume=last"
            )
        return found
    if path.is_file():
        return path, load(path)
    raise RunError(f"resume={resume}: no such file or folder; pass resume=last, resume=auto or a checkpoint path")


def newest_valid(home: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint in `home` that loads, falling back, with a warning, past damaged ones.

    It goes by the step numbers in the file names, not by the `latest` pointer (which is there
    for people and tools): a crash between two renames can leave the pointer one save behind.
    """
    for _, path in sorted(_steps(home), reverse=True):
        try:
            return path, load(path)
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
    folder = home / f"set-aside-{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step}"
    folder.mkdir()
    for path in newer:
        os.replace(path, folder / path.name)
    return folder


def _steps(home: Path) -> list[tuple[int, Path]]:
    if not home.is_dir():
        return []
    return [(int(match[1]), path) for path in home.iterdir() if (match := NAME.fullmatch(path.name))]


def _prune(home: Path, keep_last: int) -> None:
    for _, path in sorted(_steps(home), reverse=True)[keep_last:]:
        path.unlink(missing_ok=True)
    for leftover in home.glob("*.tmp"):  # from a save that crashed before its rename
        leftover.unlink(missing_ok=True)


def _write_atomically(path: Path, write: Callable[[BinaryIO], object], durable: bool) -> None:
    # The temporary name keeps an extension: torch.save rejects some dot-names without one.
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        write(file)
        if durable:
            file.flush()
            os.fsync(file.fileno())
    os.replace(temporary, path)


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

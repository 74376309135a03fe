"""What `resume=` names, and a checkpoint another setting names (`init.checkpoint`, eval.py's
`checkpoint=`), found and read: a checkpoint of either format, checked before anyone uses it, or
the newest one of a folder that is whole; found by rank 0 and read by every process. And, before
that, the config it was saved with (remembered.py)."""

import logging
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from ..config import NAME, home_of
from ..distributed import World
from ..errors import CheckpointError, RunError
from ..files import kind
from . import home as homes
from . import onefile, schema
from .schema import Checkpoint

log = logging.getLogger(__name__)


def load(path: Path, verify: bool = True) -> Checkpoint:
    """The checkpoint at `path` (a file, or a folder of shards), read onto the CPU without running
    any code inside it, and checked. `verify=False` skips the checksums: for the processes of a job
    whose rank 0 has checked the same files, and for checkpoint.verify=false."""
    if path.is_dir():
        from . import sharded  # torch.distributed.checkpoint (1 s to import) only where a folder is read

        return Checkpoint(path, sharded.read(path, verify))
    state = onefile.read(path, verify)
    schema.check(path, state, sharded=False)
    return Checkpoint(path, state)


def find(resume: str | None, home: Path, verify: bool = True) -> Checkpoint | None:
    """What `resume=` names, loaded: None (start fresh), `last`, `auto` or a path.

    `last` and `auto` take the newest checkpoint in `home` that loads; `last` fails when there is
    none, `auto` starts fresh. A path names a checkpoint (a file, or a folder of shards), or a
    folder to search the same way.
    """
    if resume is None:
        return None
    if resume in ("last", "auto"):
        found = newest_valid(home, verify)
        if found is None and homes.has_checkpoints(home):
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
    return at(Path(resume).expanduser().resolve(), verify, f"resume={resume}", "resume=last, resume=auto")


def config_of(resume: str | None, home: Path, verify: bool) -> tuple[Path, dict] | None:
    """Where the checkpoint `resume=` names is, and the config of the run that saved it (`config_at`);
    None at a fresh start."""
    if resume is None:
        return None
    return config_at(home if resume in ("last", "auto") else Path(resume).expanduser().resolve(), verify)


def config_at(path: Path, verify: bool) -> tuple[Path, dict] | None:
    """The checkpoint that `path` names, and the config it was saved with (`state_at`); None where
    none reads: the whole read, which follows, says why."""
    found = state_at(path, verify)
    return found and (found[0], found[1]["config"])


def state_at(path: Path, verify: bool) -> tuple[Path, dict] | None:
    """The checkpoint that `path` names, and what it holds but its tensors' bytes (the pickle alone),
    read before anything is built, by every process: of a checkpoint file or folder, or of the newest
    in a home that is whole (or the home a pointer names). With `verify`, not before the checksum of
    the file that holds it holds: a damaged file is not a config to build from, and is passed over as
    `newest_valid` passes over it. None where none reads."""
    try:
        path = home_named(path)
    except RunError:  # a `best` that names nothing: the whole read says so
        return None
    candidates = [path]
    if path.is_dir() and not (path / schema.STATE).exists():
        candidates = [found for _, found in sorted(homes.steps(path), reverse=True)]
    for candidate in candidates:
        state_file = candidate / schema.STATE if candidate.is_dir() else candidate
        try:
            state = onefile.read(state_file, verify, device="meta")
            schema.check(candidate, state, sharded=candidate.is_dir())
        except (CheckpointError, OSError):
            continue
        return candidate, state
    return None


def at(path: Path, verify: bool, asked: str, instead: str) -> Checkpoint:
    """The checkpoint at `path`, loaded: a file or a folder of shards, or the newest valid one of a
    home (or of the home whose `latest` it is). `asked` and `instead` word the refusals."""
    path = home_named(path)
    if path.is_dir() and not (path / schema.STATE).exists():
        if (found := newest_valid(path, verify)) is None:
            raise RunError(f"{asked}: no valid checkpoint in {path}; pass {instead} or a checkpoint file or folder")
        return found
    if path.exists() and not (path.is_dir() or path.is_file()):  # a FIFO: a read would wait for a writer
        raise RunError(
            f"{asked}: {path} is {kind(path.stat().st_mode)}, not a checkpoint file or folder; pass {instead} or a "
            f"checkpoint's path"
        )
    if path.exists():
        return load(path, verify)
    raise RunError(f"{asked}: no such file or folder; pass {instead} or a checkpoint's path")


def locate(cfg: DictConfig, named: str) -> Path:
    """Where a checkpoint setting points: a plain name is a run's, its home (its newest valid
    checkpoint), when that run has saved; else, and for any other text, a path: a checkpoint file,
    a folder of shards, a home, or a home's `latest` or `best`."""
    if run_named(named) and homes.has_checkpoints(home := home_of(cfg, named)):
        return home
    return Path(named).expanduser().absolute()


def run_named(named: str) -> bool:
    """Whether a checkpoint setting's text can be a run's name (`name=`'s, with no folder in it)."""
    return "/" not in named and NAME.fullmatch(named) is not None


def found_by_main(world: World, find_it: Callable[[], Checkpoint | None]) -> Checkpoint | None:
    """The checkpoint `find_it` finds on rank 0 (and checks, with checkpoint.verify), read on the
    other processes from the same path without checking it again."""
    found = None

    def locate() -> Path | None:
        nonlocal found
        found = find_it()
        return found and found.path

    path = world.on_main(locate)
    if path is None or world.is_main:
        return found
    return load(path, verify=False)


def home_named(path: Path) -> Path:
    """What a path names, its pointers followed: `<home>/latest` stands for the home, whose newest
    valid checkpoint is read (the pointer may name one that is damaged); `<home>/best`, for the
    checkpoint it names."""
    if path.name == homes.POINTER and path.is_file():
        return path.parent
    if path.name == homes.BEST and path.is_file():
        if (best := homes.best_of(path.parent)) is None:
            raise RunError(f"{path} names no checkpoint that is still there; pass another checkpoint")
        return best
    return path


def newest_valid(home: Path, verify: bool = True) -> Checkpoint | None:
    """The newest checkpoint in `home` that loads, falling back, with a warning, past damaged ones.
    It goes by the step numbers in the names, not by the `latest` pointer."""
    for _, path in sorted(homes.steps(home), reverse=True):
        try:
            return load(path, verify)
        except CheckpointError as error:
            log.warning(f"skipping a checkpoint: {error}; falling back to an older one")
    return None

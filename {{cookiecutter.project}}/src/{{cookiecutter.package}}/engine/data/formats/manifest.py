"""The manifest of a folder of shards, which the ready datasets read from disk share (token shards,
shards.py; Arrow shards of Hugging Face `datasets`, arrow.py): a JSON file in the folder that says,
per shard, its bytes, its samples and its sha256, computed once when the manifest is written, and
the size and mtime the shard had then; its fingerprint is the hash of those entries, less the
mtimes, so that a copy of the folder keeps it.

At start each shard costs one `os.stat`: a shard of another size, missing, or not in the manifest
is refused in one line naming it; only a shard whose mtime moved at the same size (a copy, or a
same-sized replacement) is read again, to compare its hash. The training split is a checkpoint
part (`CheckedShards`): a resume on shards other than the checkpoint's is refused naming one,
unless `data.accept_changed_shards=true`; a shard that cannot be read mid-run stops the run in one
line naming it and the sample (`ShardDamaged`).
"""

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, TypeVar, get_type_hints

from ...files import NotRegular, open_regular, regular_descriptor, stat_regular
from ..contract import DataError

log = logging.getLogger(__name__)

CHUNK = 1 << 24  # bytes hashed at a time: a shard of any size in little memory


class Shard(Protocol):
    """What every manifest entry says (a dataclass of its format's, with more)."""

    file: str
    bytes: int
    sha256: str
    mtime_ns: int


S = TypeVar("S", bound=Shard)


def loaded(folder: Path, name: str, entry: type[S], fix: str, valid=None) -> tuple[dict, list[S]]:
    """The manifest `name` of `folder` and its shards as `entry`s, its fingerprint checked against
    them; `valid(manifest, shards)` raises ValueError on what else its format needs. Else one line
    naming the file, and `fix`."""
    path = folder / name
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        shards = [typed(entry(**fields)) for fields in manifest["shards"]]
        if manifest.get("fingerprint") != fingerprint(shards):
            raise ValueError("its fingerprint does not match its entries")
        if not shards:
            raise ValueError("it lists no shard")
        if odd := [shard for shard in shards if Path(shard.file).name != shard.file]:
            raise ValueError(f"{odd[0].file} is not a file name of this folder")
        if valid is not None:
            valid(manifest, shards)
    except FileNotFoundError:
        raise DataError(f"{folder} has no {name}: {fix}") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path} cannot be read ({type(error).__name__}: {error}); {fix}") from None
    return manifest, shards


def typed(shard: S) -> S:
    """`shard`, each of its fields of the type its format declares, a count not below 0; else
    ValueError naming the shard and the field. A manifest edited by hand and sealed again (its
    fingerprint computed anew) holds whatever JSON allows: text where a count belongs, `true`."""
    for name, wanted in get_type_hints(type(shard)).items():
        value = getattr(shard, name)
        if type(value) is not wanted or (wanted is int and value < 0):
            raise ValueError(
                f"the {name} of its entry {json.dumps(shard.file)} is {json.dumps(value)}, not {KINDS.get(wanted, wanted)}"
            )
    return shard


KINDS = {int: "a count (a whole number, 0 or more)", str: "text"}


def matched(folder: Path, name: str, shards: list[Shard], present: list[str], fix: str, added: str) -> list:
    """The `os.stat` of each shard, once `present` (the folder's shard files, by name) holds no file
    the manifest lacks and each shard is the file its manifest describes; else one line naming the
    first that is not: `added` says what to do with a file not in the manifest, `fix` with the rest."""
    listed = {shard.file for shard in shards}
    if extra := [file for file in present if file not in listed]:
        raise DataError(f"{folder / extra[0]} is not in {name}: {added}")
    found = []
    for shard in shards:
        try:
            found.append(regular(folder / shard.file, fix))
        except FileNotFoundError:
            raise DataError(f"{folder / shard.file}, listed in {name}, is missing; {fix}") from None
        if found[-1].st_size != shard.bytes:
            raise DataError(
                f"{folder / shard.file} is {found[-1].st_size} bytes, its manifest says {shard.bytes}: it changed "
                f"since it was written; {fix}"
            )
        if found[-1].st_mtime_ns != shard.mtime_ns and hashed(folder / shard.file) != shard.sha256:
            raise DataError(f"{folder / shard.file} is not the file its manifest hashed; {fix}")
    return found


def regular(path: Path, fix: str) -> os.stat_result:
    """The `os.stat` of the shard `path`; refused in one line, with `fix`, where it is no regular file:
    reading a FIFO waits for a writer that may never come, and a device never ends."""
    try:
        return stat_regular(path)
    except NotRegular as refused:
        raise DataError(f"{path} is {refused.what}, not a file; {fix}") from None


def fingerprint(shards: list[Any]) -> str:
    """The hash of what the shards hold, not of when they were written: a copy keeps it."""
    entries = [{key: value for key, value in asdict(shard).items() if key != "mtime_ns"} for shard in shards]
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def hashed(path: Path, each: Callable[[bytes], None] = lambda chunk: None) -> str:
    """The sha256 of `path`, read once, each chunk also handed to `each` (a format's own survey)."""
    digest = hashlib.sha256()
    with open_regular(path) as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
            each(chunk)
    return digest.hexdigest()


def written(folder: Path, name: str, shards: list[Any], **facts: Any) -> dict:
    """The manifest of `shards`, with the format's `facts`, written into `folder` whole or not at all."""
    manifest = {**facts, "fingerprint": fingerprint(shards), "shards": [asdict(shard) for shard in shards]}
    temporary = folder / f".{name}.{os.getpid()}"
    temporary.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    temporary.rename(folder / name)
    return manifest


class ShardDamaged(DataError):
    """A shard that could not be read mid-run (in a loader worker too: workers.py)."""


class CheckedShards:
    """What a dataset read from the shards of a manifest shares: as the training split, a checkpoint
    part that records its shards and refuses a resume on others, unless accepted; and the line that
    names a shard that cannot be read under the run. Its subclass sets the four attributes."""

    folder: Path
    shards: list[Shard]
    fingerprint: str
    accept_changed: bool

    def opened(self, shard: Shard, index: int) -> int:
        """A descriptor of `shard`, for sample `index`; else the line that names it: a shard gone,
        unreadable, or no regular file under the run (a FIFO put there is never opened)."""
        try:
            return regular_descriptor(self.folder / shard.file)
        except NotRegular as refused:
            raise self.damaged(shard, index, f"it is {refused.what} now") from None
        except OSError as error:
            raise self.damaged(shard, index, error.strerror or type(error).__name__) from None

    def damaged(self, shard: Shard, index: int, what: str) -> ShardDamaged:
        return ShardDamaged(
            f"cannot read sample {index} from {self.folder / shard.file} ({what}; its manifest says "
            f"{shard.bytes} bytes): the shard changed under the run; put back the file of sha256 {shard.sha256[:16]}..."
        )

    def state_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "shards": {shard.file: shard.sha256 for shard in self.shards}}

    def load_state_dict(self, state: dict) -> None:
        """Refuses, in one line naming a shard, a resume on training shards other than those of the
        checkpoint, unless accepted: the same position in other data is other samples."""
        saved, now = state["shards"], {shard.file: shard.sha256 for shard in self.shards}
        changes = [f"{file} replaced" for file in now if file in saved and saved[file] != now[file]]
        changes += [f"{file} added" for file in now if file not in saved]
        changes += [f"{file} removed" for file in saved if file not in now]
        if not changes:
            return
        more = f" and {len(changes) - 1} more" if len(changes) > 1 else ""
        said = f"the training shards of {self.folder} changed since the checkpoint: {changes[0]}{more}"
        if not self.accept_changed:
            raise DataError(
                f"{said}; put the checkpoint's shards back, or add data.accept_changed_shards=true to go on with "
                f"these (the rest of the epoch then draws from them)"
            )
        log.warning(f"{said}; going on with them, as data.accept_changed_shards=true says")

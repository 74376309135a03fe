"""What torch.distributed.checkpoint (DCP) reads and writes in a sharded checkpoint's folder
(sharded.py), made safe: every file the folder names, or holds as a link, must be a regular file
inside it (`inside`); `.metadata` goes through an unpickler that admits only DCP's own metadata
classes; the shards are opened as regular files only, and the values in them through the
restricted loader; each file's CRC-32C is taken as DCP writes it.
"""

import contextlib
import io
import pickle
import stat
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from ..errors import CheckpointError, first_line
from ..files import Checksummed, checksum, kind, load_restricted, mapped, open_regular

METADATA = ".metadata"


def file_checksum(path: Path) -> int:
    with mapped(path) as view:
        return checksum(view)


def inside(folder: Path, name: str) -> Path:
    """`folder / name`, refused unless it resolves, links followed, inside `folder`, to a regular
    file or to nothing (missing: the caller's to name): a checkpoint may come from anywhere, and
    what it names must not carry a read out of it (into the weights, and out again by export.py),
    nor into a FIFO that waits for a writer."""
    try:
        found = (folder / name).resolve()
    except (OSError, RuntimeError) as error:  # a loop of links: RuntimeError before Python 3.13
        refuse(folder, f"its {name} cannot be followed ({first_line(error)})")
    if folder.resolve() not in found.parents:
        refuse(folder, f"{name} leads outside its folder")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(mode := found.stat().st_mode):
            refuse(folder, f"its {name} is {kind(mode)}, not a regular file")
    return folder / name


def refuse(folder: Path, reason: str) -> None:
    raise CheckpointError(f"{folder} was refused: {reason}; load only checkpoints this project wrote")


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The folder's `.metadata`, rebuilt by the restricted unpickler, and refused unless each file it
    names for the shards is a file of the folder (_inside)."""
    folder = path.parent
    try:
        with open_regular(inside(folder, path.name)) as file:
            metadata = _MetadataUnpickler(file, folder).load()
    except CheckpointError:
        raise
    except Exception as error:  # whatever a damaged pickle raises
        refuse(folder, f"its {METADATA} is unreadable ({type(error).__name__})")
    if not isinstance(metadata, dcp_metadata.Metadata):
        refuse(folder, f"its {METADATA} holds a {type(metadata).__name__}, not DCP's metadata")
    storage = getattr(metadata, "storage_data", None)
    entries = storage.values() if isinstance(storage, dict) else [None]
    names = [getattr(entry, "relative_path", None) for entry in entries]
    if not all(isinstance(name, str) for name in names):
        refuse(folder, f"its {METADATA} does not name a file for each of its shards")
    for name in sorted(set(names)):
        inside(folder, name)
    return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds only what DCP's metadata is made of; any other global (os.system, a class of the
    attacker's choosing) is refused before it can be called."""

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks up a tensor layout by name
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def __init__(self, file: io.BufferedReader, folder: Path) -> None:
        super().__init__(file)
        self.folder = folder

    def find_class(self, module: str, name: str) -> object:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.folder} was refused: its {METADATA} asks for {module}.{name}, which is not DCP metadata and could "
            f"run code; load only checkpoints this project wrote"
        )


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, taking each file's size and CRC-32C from the bytes as it writes them."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.files: dict[str, list[int]] = {}  # written by this process: name -> [size, CRC-32C]
        self.fs = _ChecksummingFileSystem(self.files)


class _ChecksummingFileSystem(FileSystem):
    def __init__(self, files: dict[str, list[int]]) -> None:
        self.files = files

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            written = Checksummed(stream)
            yield written
        self.files[Path(path).name] = [written.size, written.crc]

    def rename(self, path, new_path) -> None:  # DCP writes .metadata under a temporary name
        super().rename(path, new_path)
        self.files[Path(new_path).name] = self.files.pop(Path(path).name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by the restricted unpickler, and the shards opened
    as open_regular opens a file: one made a FIFO since read_metadata looked is refused, not waited on."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.fs = _RegularFiles()

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        # As FileSystemReader.read_metadata finishes it.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RegularFiles(FileSystem):
    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        with open_regular(Path(path)) as stream:
            yield stream


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values (learning rates, betas) as plain values only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        load_restricted(value, "a value beside its shards")  # refused before DCP's own, unrestricted load
        value.seek(0)
        super().load_bytes(read_item, value)

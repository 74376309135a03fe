"""The model and optimizer of a sharded run (strategy=fsdp) in a checkpoint folder, through
torch.distributed.checkpoint (DCP): every process writes its own shards, and any number of
processes (one without a process group included) reads them back, each taking what it holds.

DCP trusts its files more than this project does: it unpickles `.metadata` with plain
`pickle.load`, and loads non-tensor values with `torch.load(weights_only=False)`, so a crafted
checkpoint could run code. Here the metadata goes through an unpickler that admits only DCP's own
metadata classes, and the values through `weights_only=True`. And since DCP keeps no checksums,
each shard file's CRC-32C is taken as it is written (checkpoints.py stores them beside the
shards) and checked before a load. CRC-32C, not zlib's CRC-32: the CPU computes it (SSE 4.2, ARMv8),
about 4x faster here, and a save or restore that checks every byte pays for its speed.

The folder's layout (temporary name, rename, `latest`, retention) is checkpoints.py's.
"""

import contextlib
import io
import mmap
import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .distributed import World

METADATA = ".metadata"


class Refused(Exception):
    """A shard folder that must not be loaded: damaged, incomplete or crafted."""


class WriteFailed(Exception):
    """A save that some process could not complete (a full disk): the first cause, in one line."""


def write(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, world: World) -> dict[str, list[int]]:
    """Writes this process's shards of the model and optimizer into `folder` (a collective step,
    fsynced file by file), and returns, on every process, the size and CRC-32C of each file in it."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    writer = ChecksummingWriter(folder)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer)
    except CheckpointException as error:  # raised on every process, with every process's traceback
        raise WriteFailed(first_cause(error)) from None
    return {name: entry for share in world.gather(writer.files) for name, entry in share.items()}


def read(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Loads the shards of `folder` into `model` and `optimizer`, whatever the number of processes
    that wrote them (a collective step): each process reads the parts of each tensor it holds."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner())
    except CheckpointException as error:
        raise Refused(f"its shards do not load ({first_cause(error)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_whole(model: nn.Module, optimizer: torch.optim.Optimizer, saved_model: dict, saved_optimizer: dict) -> None:
    """Loads a one-file checkpoint (written by strategy=single or ddp) into a sharded model and
    its optimizer: every process holds the whole of it and keeps its shards."""
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, saved_model, options=whole)
    # The file keys the optimizer's state by parameter number, in the order the optimizer was given
    # the parameters (those that train, in model order); torch's sharded loader wants their names.
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    by_name = {
        "state": {names[number]: value for number, value in saved_optimizer["state"].items()},
        "param_groups": [
            {**group, "params": [names[n] for n in group["params"]]} for group in saved_optimizer["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=whole)


def first_cause(error: CheckpointException) -> str:
    rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
    return f"on rank {rank}: {type(cause).__name__}: {cause}".splitlines()[0]


def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model's tensors in `folder`, by name, with their whole shapes (from the metadata)."""
    entries = read_metadata(folder / METADATA).state_dict_metadata
    return {
        key.removeprefix("model."): tuple(entry.size)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }


def verify(folder: Path, files: dict[str, list[int]]) -> None:
    """Raises Refused, naming the file, unless every file listed at save is there, whole and
    unchanged, and the metadata is DCP's own. The files are checked in parallel threads (crc32c
    releases the GIL while it computes), one file per core: DCP writes one or more per process."""
    for name, (size, _) in sorted(files.items()):
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            raise Refused(f"its shard file {name} is {'missing' if not path.is_file() else 'truncated or extended'}")
    names = sorted(files)
    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1) or 1) as pool:
        found = dict(zip(names, pool.map(lambda name: checksum(folder / name), names), strict=True))
    for name in names:
        if found[name] != files[name][1]:
            raise Refused(f"its shard file {name} no longer matches the checksum written at save")
    if METADATA not in files:
        raise Refused(f"it has no {METADATA}")
    read_metadata(folder / METADATA)


def checksum(path: Path) -> int:
    """The file's CRC-32C, read through a memory map: no copy of its bytes is made (half the time
    of reading it in chunks, here)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return 0  # what mmap cannot map, and the CRC of nothing
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return crc32c.crc32c(mapped)


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except Refused:
        raise
    except Exception as error:  # whatever a damaged pickle raises
        raise Refused(f"its {METADATA} is unreadable ({type(error).__name__})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise Refused(f"its {METADATA} holds a {type(metadata).__name__}, not DCP's metadata")
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

    def find_class(self, module: str, name: str) -> object:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise Refused(f"its {METADATA} asks for {module}.{name}, which is not DCP metadata and could run code")


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, taking each file's size and CRC-32C from the bytes as it writes them
    (front to back: nothing is read back afterwards)."""

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
            counted = _Checksummed(stream)
            yield counted
        self.files[Path(path).name] = [counted.size, counted.crc]

    def rename(self, path, new_path) -> None:  # DCP writes .metadata under a temporary name
        super().rename(path, new_path)
        self.files[Path(new_path).name] = self.files.pop(Path(path).name)


class _Checksummed:
    """A file being written, counting and checksumming what passes through `write`."""

    def __init__(self, stream: io.IOBase) -> None:
        self.stream, self.size, self.crc = stream, 0, 0

    def write(self, data) -> int:
        self.crc = crc32c.crc32c(data, self.crc)
        written = self.stream.write(data)
        self.size += written
        return written

    def seek(self, *arguments) -> int:  # a writer that went back would invalidate the running CRC
        raise io.UnsupportedOperation("checksummed streams are written front to back")

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        # As FileSystemReader.read_metadata finishes it.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values (learning rates, betas) as plain values only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # refuses anything else before DCP's own, unrestricted load
        value.seek(0)
        super().load_bytes(read_item, value)

"""The sharded format (strategy=fsdp): the folder `step_00001200/`, in which every process writes
its shards of the model and optimizer through torch.distributed.checkpoint (DCP), and rank 0 the
rest, `state.pt`, with each shard file's size and CRC-32C. Any number of processes (one without a
process group included) reads it back, each taking what it holds.

DCP trusts its files more than this project does: it unpickles `.metadata` with plain
`pickle.load`, and loads non-tensor values with `torch.load(weights_only=False)`, so a crafted
checkpoint could run code. Here the metadata goes through an unpickler that admits only DCP's own
metadata classes, and the values through the restricted loader. And since DCP keeps no checksums,
each file's is taken as it is written and checked before a load. DCP also reads whatever file the
metadata names, `../../elsewhere/__0_0.distcp` or a FIFO: here every file a folder names, or
holds as a link, must be a regular file inside it, checked before any is read, with or without
checksums (the checksums are in `state.pt`, which whoever crafted the folder rewrote too).
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ..distributed import World
from ..errors import CheckpointError, SaveError
from ..files import (
    first_failing,
    remove,
    sync_folder,
    temporary,
)
from . import onefile, schema
from .background import Snapshot, Writer
from .dcp_files import (
    METADATA,
    ChecksummingWriter,
    SafePlanner,
    SafeReader,
    file_checksum,
    inside,
    read_metadata,
    refuse,
)
from .home import completed, path_of
from .schema import STATE


def save(
    state: dict, model: nn.Module, optimizer: torch.optim.Optimizer, home: Path, keep_last: int, world: World
) -> Path:
    """Every process: its shards of the model and optimizer into a folder under a temporary name;
    then rank 0 completes it with `state` (the other parts). A write that fails, on any process,
    raises SaveError on all and leaves no folder behind."""
    scratch = _scratch(home, state["step"], world)
    try:
        files, error = _write(shards_of(model, optimizer), scratch, state["step"]), None
    except SaveError as failure:
        files, error = {}, str(failure)
    return _completed(state, scratch, files, error, home, keep_last, world)


@dataclass
class Pending:
    """A save whose shards a writer thread is writing."""

    state: dict  # the other parts, copied at the save
    scratch: Path


def begin(
    state: dict,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    home: Path,
    world: World,
    background: tuple[Snapshot, Writer, dist.ProcessGroup],
) -> Pending:
    """Every process: copies `state` and its shards into buffers of its own, then hands the shards
    to its writer thread, which writes them over the process group given, not the one training
    uses. `finish` completes the save."""
    snapshot, writer, group = background
    scratch = _scratch(home, state["step"], world)
    copied = snapshot.take({"rest": state, "shards": shards_of(model, optimizer)})
    writer.start(lambda: _write(copied["shards"], scratch, state["step"], group))
    return Pending(copied["rest"], scratch)


def finish(pending: Pending, writer: Writer, home: Path, keep_last: int, world: World) -> Path:
    """Every process, once its writer is done: the save `begin` started, completed by rank 0, or
    a SaveError on every process when the write failed on any."""
    try:
        files, error = writer.wait(), None
    except SaveError as failure:
        files, error = {}, str(failure)
    return _completed(pending.state, pending.scratch, files, error, home, keep_last, world)


def background_group(timeout_s: int) -> dist.ProcessGroup:
    """The process group of background writes (gloo: their copies are in CPU memory), created on
    every process at once."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def shards_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def temporary_folder(home: Path, step: int) -> Path:
    """Where the processes write the shards of `step` before it is complete."""
    return temporary(path_of(home, step, folder=True))


def _scratch(home: Path, step: int, world: World) -> Path:
    return world.broadcast(temporary_folder(home, step) if world.is_main else None)


def _write(shards: dict, folder: Path, step: int, group: dist.ProcessGroup | None = None) -> dict[str, list[int]]:
    """Writes this process's shards into `folder` (a collective step over `group`, fsynced file
    by file), and returns the size and CRC-32C of each file it wrote."""
    writer = ChecksummingWriter(folder)
    try:
        dcp.save(shards, storage_writer=writer, process_group=group)
    except CheckpointException as error:  # raised on every process, with every process's traceback
        raise SaveError(f"could not write the shards of step {step} to {folder} ({first_cause(error)})") from None
    return writer.files


def _completed(
    state: dict, scratch: Path, files: dict, error: str | None, home: Path, keep_last: int, world: World
) -> Path:
    """Every process, with what it wrote or the error it met: the folder completed by rank 0 when
    every process wrote its shards; else removed, and a SaveError on every process."""
    shares = world.gather((files, error))
    failed = next((error for _, error in shares if error), None)
    if failed is not None:
        world.on_main(lambda: remove(scratch))
        raise SaveError(failed)
    shards = {name: entry for files, _ in shares for name, entry in files.items()}
    return world.on_main(lambda: complete({**state, "shards": shards}, scratch, home, keep_last))


def complete(state: dict, scratch: Path, home: Path, keep_last: int) -> Path:
    """Rank 0, once every process has written its shards into `scratch`: `state` (the rest, with
    the shards' checksums) beside them, then the folder renamed to its own name, `latest` and
    retention. Until the rename no resume can pick it, so a process that dies mid-save leaves the
    previous checkpoint the newest."""
    path = path_of(home, state["step"], folder=True)
    try:
        onefile.write(state, scratch / STATE)
        sync_folder(scratch)
        if path.exists():  # the same step saved before, by a run that resumed from an earlier one
            remove(path)
        os.replace(scratch, path)
        completed(path, keep_last, state.get("score"))
    except OSError as error:
        remove(scratch)
        raise SaveError(f"could not write {path} ({error.strerror or error})") from None
    return path


def read(path: Path, verify: bool) -> dict:
    """The folder's `state.pt`, checked; with `verify`, its shard files too (not read: `load_into`
    reads them into the model where it is placed)."""
    if not (state_file := inside(path, STATE)).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {STATE}")
    state = onefile.read(state_file, verify)
    schema.check(path, state, sharded=True)
    if verify:
        _verify(path, state["shards"])
    return state


def _verify(folder: Path, files: dict[str, list[int]]) -> None:
    """Refuses the folder, naming the file, unless every file listed at save is there, whole and
    unchanged, and the metadata is DCP's own."""
    for name, (size, _) in sorted(files.items()):
        file = inside(folder, name)
        if not file.is_file() or file.stat().st_size != size:
            missing = not file.is_file()
            refuse(folder, f"its shard file {name} is {'missing' if missing else 'truncated or extended'}")
    unchanged = {name: (lambda name=name: file_checksum(folder / name) == files[name][1]) for name in sorted(files)}
    if (damaged := first_failing(unchanged)) is not None:
        refuse(folder, f"its shard file {damaged} no longer matches the checksum written at save")
    if METADATA not in files:
        refuse(folder, f"it has no {METADATA}")
    read_metadata(folder / METADATA)


def load_into(model: nn.Module, optimizer: torch.optim.Optimizer, saved: schema.Checkpoint) -> None:
    """The model and optimizer of `saved` into a model that may be sharded (a collective step):
    from a folder, each process reads the parts of each tensor it holds, whatever the number of
    processes that wrote them; from one file (strategy=single or ddp), each keeps its shards."""
    if not saved.sharded:
        _load_whole(model, optimizer, saved.part("model"), saved.part("optimizer"))
        return
    state = shards_of(model, optimizer)
    # The config decides the hyperparameters (schedulers.keep_configured): one the checkpoint lacks
    # (a key its groups did not have yet, as param_groups.py's name) is not asked of it.
    stored = read_metadata(saved.path / METADATA).state_dict_metadata
    for number, group in enumerate(state["optimizer"]["param_groups"]):
        for key in [key for key in group if key != "params" and f"optimizer.param_groups.{number}.{key}" not in stored]:
            del group[key]
    try:
        dcp.load(state, storage_reader=SafeReader(saved.path), planner=SafePlanner())
    except CheckpointException as error:
        refuse(saved.path, f"its shards do not load ({first_cause(error)})")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _load_whole(model: nn.Module, optimizer: torch.optim.Optimizer, saved_model: dict, saved_optimizer: dict) -> None:
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, saved_model, options=whole)
    # The file keys the optimizer's state by parameter number, in the order of the optimizer's
    # groups (param_groups.py); torch's sharded loader wants their names.
    name_of = {param: name for name, param in model.named_parameters()}
    names = [name_of[param] for group in optimizer.param_groups for param in group["params"]]
    by_name = {
        "state": {names[number]: value for number, value in saved_optimizer["state"].items()},
        "param_groups": [
            {**group, "params": [names[n] for n in group["params"]]} for group in saved_optimizer["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=whole)


def load_model(model: nn.Module, saved: schema.Checkpoint, ignored: set[str]) -> None:
    """The model weights of `saved` but the keys `ignored` (fine-tuning: checkpoint/initial.py),
    into a model that may be sharded, on every process at once; the optimizer's are not read."""
    if not saved.sharded:
        whole = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, saved.weights(leaving=ignored), options=whole)
        return
    state = {key: value for key, value in get_model_state_dict(model).items() if key not in ignored}
    try:
        dcp.load({"model": state}, storage_reader=SafeReader(saved.path), planner=SafePlanner())
    except CheckpointException as error:
        refuse(saved.path, f"its shards do not load ({first_cause(error)})")
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


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

"""Arrow shards: a dataset as Hugging Face `datasets` saves it (`dataset.save_to_disk(folder)`), read
with pyarrow alone, a sample at a time and never whole, and checked against a manifest before
anything trains. Samples of any shape: a column of numbers, or of lists of numbers nested to any
depth (`Value`, `Sequence`/`List`, `Array2D`... features), gives a tensor per sample, float32 for
floats and int64 for integers.

The folder holds its rows in `data-0000K-of-0000N.arrow` files (Arrow IPC streams, the shards),
listed by its `state.json`, its features in `dataset_info.json`; a `DatasetDict` is a folder of
such folders named by `dataset_dict.json`. Arrow lays each column out in the file as in memory: a
process maps each file once to learn where each record batch's columns lie (their headers, not
their data), then reads a sample with one `os.pread` a column (and one a level of variable-length
lists). Not the memory map itself: a shard truncated under it would kill the reader with SIGBUS,
naming nothing, where a short read is named (ShardDamaged).

The manifest (manifest.py) is `continuum-manifest.json`, written beside the dataset's own files,
which stay as they are: per shard its bytes, samples and sha256, and per column its type and shape,
the facts a model is built from. Once per folder, for a folder of another tool's:

    python -m {{cookiecutter.package}}.engine.data.formats.arrow describe <folder>

The digits as such a folder (a DatasetDict of train and validation), no download:

    python -m {{cookiecutter.package}}.engine.data.formats.arrow write-digits <folder>
"""

import argparse
import bisect
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from ..contract import Data, DataError
from .manifest import CheckedShards
from .save_to_disk import (
    ArrowShard,
    Saved,
    checked,
    dataset_dict,
    described,
    is_list,
    mapped,
    numbers,
    storage,
    write_digits,
)


def arrow_folder(
    dir: Path,
    inputs: str | list[str],
    target: str,
    train_split: str = "train",
    val_split: str | None = "validation",
    test_split: str | None = None,
    val_every: int = 10,
    accept_changed_shards: bool = False,
) -> Data:
    """The folder `dir` that save_to_disk wrote: each sample the `inputs` column (or a dict of the
    `inputs` columns) and the `target` column. A DatasetDict gives its `train_split`, its `val_split`
    and, with `test_split`, a test split that only eval.py reads; a Dataset, or `val_split` null,
    gives every `val_every`-th row to validation (rows val_every - 1, 2 * val_every - 1, ...: none
    drawn by a seed, and a dataset sorted by label is still split evenly). Its facts: `input_shape`
    (or `input_shapes`, by column), `block_size` and `vocab_size` for inputs of token ids (`tokens`),
    `num_classes` and `labels` for an integer target that is no next tokens (a ClassLabel's names,
    or else its largest value + 1), and the training split's `fingerprint`."""
    if val_every < 2:
        raise ValueError(f"val_every={val_every} must be 2 or more: every val_every-th row is for validation")
    names = [inputs] if isinstance(inputs, str) else list(inputs)
    if not names or target in names:
        raise ValueError(f"inputs={inputs} must name one column or more, and not the target, {target}")
    train, held, test = splits(Path(dir).expanduser(), train_split, val_split, test_split)
    kinds = {name: kind(train, name, "inputs" if name in names else "target") for name in [*names, target]}
    for other in filter(None, (held, test)):
        if (theirs := {name: kind(other, name, "") for name in kinds}) != kinds:
            name = next(name for name in kinds if theirs[name] != kinds[name])
            raise DataError(
                f"column {name} holds samples of shape {theirs[name][0]} ({theirs[name][1]}) in {other.folder}, of "
                f"{kinds[name][0]} ({kinds[name][1]}) in {train.folder}: the splits of a dataset must agree"
            )
    columns, keyed = [(name, *kinds[name]) for name in [*names, target]], not isinstance(inputs, str)
    facts = {"input_shapes": {name: kinds[name][0] for name in names}} if keyed else {"input_shape": kinds[inputs][0]}
    found = [saved for saved in (train, held, test) if saved is not None]
    facts.update(text := {} if keyed else tokens(inputs, target, kinds, found))
    if kinds[target][1] == "int64" and not (text and kinds[target] == kinds[inputs]):  # next tokens are no classes
        facts.update(classes(target, found))
    every = val_every if held is None else 0
    return Data(
        train=ArrowRows(train, columns, keyed, every, accept=accept_changed_shards),
        val=ArrowRows(held, columns, keyed) if held else ArrowRows(train, columns, keyed, every, val=True),
        test=ArrowRows(test, columns, keyed) if test else None,
        fingerprint=train.fingerprint,
        **facts,
    )


def splits(root: Path, train: str, val: str | None, test: str | None) -> tuple[Saved, Saved | None, Saved | None]:
    """The training, validation and test folders of `root`, each checked against its manifest: those of
    a DatasetDict named by its splits, or a Dataset as the training folder alone."""
    if (root / "dataset_dict.json").is_file():
        found = dataset_dict(root)
        for setting, split in (("train_split", train), ("val_split", val), ("test_split", test)):
            if split is not None and split not in found:
                instead = ", or data.val_split=null: every val_every-th training row" if setting == "val_split" else ""
                raise DataError(
                    f"{root} holds the splits {', '.join(found)}, not {split}; use data.{setting}=<split>{instead}"
                )
        return tuple(checked(root / split, root) if split is not None else None for split in (train, val, test))
    if (root / "state.json").is_file():
        if test is not None:
            raise DataError(f"{root} is one Dataset, without splits: use data.test_split=null, or save a DatasetDict")
        return checked(root, root), None, None
    raise DataError(
        f"data.dir={root} holds neither state.json nor dataset_dict.json: point it at a folder that Hugging Face "
        f"datasets' save_to_disk wrote (a Dataset or a DatasetDict)"
    )


def kind(saved: Saved, name: str, role: str) -> tuple[tuple[int, ...], str]:
    """The shape of column `name`'s samples and the tensor type they are read as; else one line."""
    setting = f"data.{role}={name}" if role else f"column {name}"
    facts = saved.columns.get(name)
    if facts is None:
        raise DataError(f"{setting} is no column of {saved.folder}; its columns: {', '.join(saved.columns)}")
    if "dtype" not in facts:
        raise DataError(
            f"{setting} holds {facts['type']}, not numbers or lists of numbers; turn it into numbers with "
            f"dataset.map before save_to_disk, or name another column"
        )
    if facts["nulls"]:
        raise DataError(
            f"{setting} has {facts['nulls']} missing values (nulls) in {saved.folder}: fill them with dataset.map, or "
            f"filter their rows out, before save_to_disk"
        )
    if facts["shape"] is None:
        raise DataError(
            f"{setting} holds samples of different shapes in {saved.folder}, and a batch stacks samples of one: pad "
            f"or cut them to one with dataset.map before save_to_disk"
        )
    return tuple(facts["shape"]), "float32" if np.dtype(facts["dtype"]).kind == "f" else "int64"


def tokens(inputs: str, target: str, kinds: dict, splits: list[Saved]) -> dict:
    """Of inputs that are token ids (one row of integers from 0 a sample): what a language model is
    built from, `block_size` (the row's length) and `vocab_size` (the largest token + 1, of the
    target's rows too where they are tokens, as a next-token task's are). Nothing for other inputs,
    nor from a manifest written before it kept the largest token."""
    if len(kinds[inputs][0]) != 1 or kinds[inputs][1] != "int64":
        return {}
    surveyed = [saved.columns[inputs] for saved in splits]
    if any("max" not in facts or facts["min"] < 0 for facts in surveyed):
        return {}
    if kinds[target] == kinds[inputs]:  # its padding may be -100, the positions cross-entropy ignores
        surveyed += [saved.columns[target] for saved in splits if "max" in saved.columns[target]]
    return {"block_size": kinds[inputs][0][0], "vocab_size": max(facts["max"] for facts in surveyed) + 1}


def classes(target: str, splits: list[Saved]) -> dict:
    """`num_classes`, and `labels` where the features name them (a ClassLabel's names); else the
    largest value + 1, up to MOST_CLASSES: the model has an output a class."""
    if (low := min(saved.columns[target].get("min", 0) for saved in splits)) < 0:
        raise DataError(f"data.target={target} holds {low}, and classes count from 0; filter those rows out")
    largest, holder = max((saved.columns[target].get("max", 0), str(saved.folder)) for saved in splits)
    feature = splits[0].features.get(target, {})
    if feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"), list):
        if largest >= len(names := feature["names"]):
            raise DataError(
                f"data.target={target} holds {largest} in {holder}, past the {len(names)} names of its ClassLabel "
                f"(classes 0 to {len(names) - 1}); filter those rows out, or save the dataset with a name for each class"
            )
        return {"num_classes": len(names), "labels": names}
    if largest >= MOST_CLASSES:
        raise DataError(
            f"data.target={target} holds {largest} in {holder}, which would make {largest + 1} classes, a model "
            f"output each: number the classes from 0 before save_to_disk (dataset.class_encode_column), or name a "
            f"column of class numbers"
        )
    return {"num_classes": largest + 1}


# Past any label set a model is trained to pick from (ImageNet-21k's 21,841 classes, a tokenizer's
# 256,000 tokens): a target this large is an id, and its output layer would not fit in memory.
MOST_CLASSES = 1 << 24


class ArrowRows(CheckedShards, Dataset):
    """The rows of one Dataset folder (or, with `every`, its training or validation rows), each a
    pair (inputs, target) or a dict by column, read with `os.pread` from files each process opens
    for itself. A checkpoint part as the training split: it records its shards (manifest.py)."""

    def __init__(
        self, saved: Saved, columns: list, keyed: bool, every: int = 0, val: bool = False, accept: bool = False
    ) -> None:
        self.folder, self.shards, self.fingerprint, self.accept_changed = (
            saved.folder, saved.shards, saved.fingerprint, accept,
        )  # fmt: skip
        self.seen, self.keyed, self.every, self.val = saved.seen, keyed, every, val
        self.names = [name for name, *_ in columns]
        self.columns = [(shape, dtype, math.prod(shape)) for _, shape, dtype in columns]
        self.starts = np.cumsum([0] + [shard.samples for shard in saved.shards]).tolist()
        self._open: dict[int, tuple[int, list[int], list[list]]] = {}

    def __len__(self) -> int:
        total = self.starts[-1]
        return total if not self.every else total // self.every if self.val else total - total // self.every

    def row(self, index: int) -> int:
        """The dataset's row of sample `index`: every `every`-th row is validation, the rest training."""
        if not self.every:
            return index
        if self.val:
            return index * self.every + self.every - 1
        return index // (self.every - 1) * self.every + index % (self.every - 1)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list:
        """The samples `indices`, as torch's loader asks for a batch: each column's numbers read from
        the file straight into a row of one array for the batch, which becomes one tensor; each
        shard's file checked once a batch to be the one the start found (not written over, nor cut)."""
        columns = [np.empty((len(indices), count), dtype=dtype) for _, dtype, count in self.columns]
        checked = set()
        for place, index in enumerate(indices):
            if not 0 <= index < len(self):
                raise IndexError(f"sample {index} of {len(self)}")
            row = self.row(index)
            number = bisect.bisect_right(self.starts, row) - 1
            shard, (descriptor, starts, plans) = self.shards[number], self._opened(number, index)
            if number not in checked:
                if changed := since(os.fstat(descriptor), self.seen[number]):
                    raise self.damaged(shard, index, changed)
                checked.add(number)
            local = row - self.starts[number]
            batch = bisect.bisect_right(starts, local) - 1
            for column, plan in zip(columns, plans[batch], strict=True):
                self._values(column[place], descriptor, plan, local - starts[batch], shard, index)
        tensors = [
            torch.from_numpy(column).view(len(indices), *shape)
            for column, (shape, _, _) in zip(columns, self.columns, strict=True)
        ]
        samples = [tuple(tensor[place] for tensor in tensors) for place in range(len(indices))]
        return [dict(zip(self.names, sample, strict=True)) for sample in samples] if self.keyed else samples

    def _values(self, into: np.ndarray, descriptor: int, plan: tuple, at: int, shard: ArrowShard, index: int) -> None:
        """The numbers of item `at` of a column whose layout `plan` says (`layout`), read into the row
        `into`: straight where the file holds them as the tensor does, else converted."""
        levels, values_at, dtype = plan
        for offsets_at, size, offset in levels:
            if offsets_at is None:  # fixed-size lists: `size` numbers each
                at = (offset + at) * size
            else:  # a list: where each item's items start, integers of `size` bytes
                where = offsets_at + (offset + at) * size
                at = int.from_bytes(self._read(descriptor, bytearray(size), where, shard, index), "little", signed=True)
        where = values_at + at * dtype.itemsize
        if dtype == into.dtype:
            self._read(descriptor, memoryview(into).cast("B"), where, shard, index)
        else:
            read = self._read(descriptor, bytearray(into.size * dtype.itemsize), where, shard, index)
            into[:] = np.frombuffer(read, dtype)

    def _read(self, descriptor: int, into: bytearray | memoryview, offset: int, shard: ArrowShard, index: int):
        """`into` filled from `offset` of the file, and returned."""
        try:
            read = os.preadv(descriptor, [into], offset)
        except OSError as error:
            raise self.damaged(shard, index, error.strerror or type(error).__name__) from None
        if read < len(into):
            raise self.damaged(shard, index, f"it is {os.fstat(descriptor).st_size} bytes now")
        return into

    def _opened(self, number: int, index: int) -> tuple[int, list[int], list[list]]:
        """Shard `number`'s descriptor, the first row of each record batch, and each batch's columns'
        layouts; the file checked to be the one the start's stat found."""
        if number not in self._open:
            shard = self.shards[number]
            descriptor = self.opened(shard, index)
            try:
                if changed := since(os.fstat(descriptor), self.seen[number]):
                    raise self.damaged(shard, index, changed)
                starts, plans = layout(descriptor, self.names)
            except (pa.ArrowException, ValueError, KeyError) as error:
                os.close(descriptor)
                raise self.damaged(shard, index, f"no Arrow stream of these columns: {error}") from None
            except BaseException:
                os.close(descriptor)
                raise
            self._open[number] = (descriptor, starts, plans)
        return self._open[number]

    def __getstate__(self) -> dict:
        # A worker started by spawn opens its own files: descriptors do not cross processes.
        return {**self.__dict__, "_open": {}}

    def __del__(self) -> None:
        for descriptor, *_ in self._open.values():
            os.close(descriptor)


def since(found: os.stat_result, seen: tuple[int, int, int]) -> str:
    """How the file `found` differs from the one the start's stat `seen` (inode, size, mtime); or ""."""
    if found.st_ino != seen[0]:
        return f"another file is there now, of {found.st_size} bytes"
    if (found.st_size, found.st_mtime_ns) != seen[1:]:
        return f"it is {found.st_size} bytes now, written since the run started"
    return ""


def layout(descriptor: int, names: list[str]) -> tuple[list[int], list[list]]:
    """Where the columns `names` of each record batch lie in the file: read from its headers through
    a memory map, whose pages of data are never touched. Per column, the levels of lists down to the
    numbers (a fixed-size list's size, or where a list's offsets are) and where the numbers are."""
    whole = mapped(descriptor)  # unmapped as this returns: only offsets are kept
    starts, plans = [0], []
    for batch in pa.ipc.open_stream(whole):
        if batch.num_rows:
            plans.append([plan(storage(batch.column(name)), whole) for name in names])
            starts.append(starts[-1] + batch.num_rows)
    return starts[:-1], plans


def plan(array: pa.Array, whole: pa.Buffer) -> tuple:
    """Where one column of one record batch lies (`layout`): its levels of lists, where its numbers
    start, and their type."""
    levels = []
    while is_list(array.type):
        if not pa.types.is_fixed_size_list(array.type):
            offsets_at = at(array.buffers()[1], whole)
            levels.append((offsets_at, 8 if pa.types.is_large_list(array.type) else 4, array.offset))
        elif levels and levels[-1][0] is None and not array.offset:  # fixed-size in fixed-size: one product
            levels[-1] = (None, levels[-1][1] * array.type.list_size, levels[-1][2])
        else:
            levels.append((None, array.type.list_size, array.offset))
        array = array.values
    dtype = numbers(array.type)
    return tuple(levels), at(array.buffers()[1], whole) + array.offset * dtype.itemsize, dtype


def at(buffer: pa.Buffer | None, whole: pa.Buffer) -> int:
    """The file offset of `buffer`, a slice of the memory map `whole`."""
    if buffer is None:  # no numbers at all: nothing is read from it
        return 0
    if not whole.address <= buffer.address <= whole.address + whole.size:
        raise ValueError("its buffers are not in the file as they are read (compressed, or of another byte order)")
    return buffer.address - whole.address


def main() -> None:
    parser = argparse.ArgumentParser(description="Arrow shards as save_to_disk writes them: described, or written.")
    commands = parser.add_subparsers(dest="command", required=True)
    describing = commands.add_parser(
        "describe", help="the manifest of a folder that save_to_disk wrote, beside its files"
    )
    describing.add_argument("folder", type=Path, help="a Dataset or a DatasetDict folder")
    writing = commands.add_parser("write-digits", help="scikit-learn's digits as a DatasetDict folder, described")
    writing.add_argument("folder", type=Path, help="the new folder")
    writing.add_argument("--shards", type=int, default=2, help="files of the training split")
    args = parser.parse_args()
    try:
        manifests = described(args.folder) if args.command == "describe" else write_digits(args.folder, args.shards)
    except DataError as error:
        parser.exit(2, f"error: {error}\n")
    for folder, manifest in manifests.items():
        samples = sum(shard["samples"] for shard in manifest["shards"])
        print(
            f"{folder}: {len(manifest['shards'])} shards, {samples} samples, fingerprint {manifest['fingerprint'][:16]}"
        )


if __name__ == "__main__":
    main()

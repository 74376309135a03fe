"""A folder as Hugging Face `datasets`' `save_to_disk` lays it out, which arrow.py reads: its shards
(`data-0000K-of-0000N.arrow`, Arrow IPC streams) listed by `state.json`, its features in
`dataset_info.json`; a DatasetDict a folder of such folders, named by `dataset_dict.json`. Here:
the manifest that describes such a folder, written once beside its files (which stay as they are)
and checked at each start, and a folder of the digits written as `datasets` would write it.
"""

import json
import mmap
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ...files import regular_descriptor
from ..contract import SPLIT_SEED, DataError
from .digits import read_digits
from .manifest import hashed, loaded, matched, regular, written
from .shards import building

MANIFEST = "continuum-manifest.json"
DESCRIBE = "python -m {{cookiecutter.package}}.engine.data.formats.arrow describe"
WRITE_BATCH = 256  # rows a record batch of write_digits; `datasets` writes 1,000: small here, so a file holds several


@dataclass(frozen=True)
class ArrowShard:
    """One `.arrow` file as its manifest describes it."""

    file: str
    bytes: int
    samples: int
    sha256: str
    mtime_ns: int


@dataclass
class Saved:
    """One Dataset folder, checked against its manifest: its shards, the inode, size and mtime the
    start's stat found each at, its columns' facts (`surveyed`) and its features."""

    folder: Path
    shards: list[ArrowShard]
    seen: list[tuple[int, int, int]]
    columns: dict[str, dict]
    features: dict
    fingerprint: str


def checked(folder: Path, root: Path) -> Saved:
    """The Dataset folder `folder` (of the folder `root` that data.dir names), after one `os.stat`
    per shard says its files are the ones its manifest describes; else one line naming the file and
    the command that describes `root` again."""
    command = f"{DESCRIBE} {shlex.quote(str(root))}"
    fix = f"describe it again ({command}) to train on these files, or put back those it described"
    files = data_files(folder)
    manifest, shards = loaded(folder, MANIFEST, ArrowShard, f"describe it once: {command}", valid)
    if gone := [shard.file for shard in shards if shard.file not in files]:
        raise DataError(
            f"{folder / gone[0]}, listed in {MANIFEST}, is not in state.json: the dataset was saved again; {fix}"
        )
    found = matched(folder, MANIFEST, shards, files, fix, f"describe it again ({command}) to train on it")
    try:
        features = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8")).get("features") or {}
    except (OSError, ValueError, AttributeError):
        features = {}  # the features only name classes; without them, the labels' largest value says how many
    seen = [(stat.st_ino, stat.st_size, stat.st_mtime_ns) for stat in found]
    return Saved(folder, shards, seen, manifest["columns"], features, manifest["fingerprint"])


def valid(manifest: dict, shards: list[ArrowShard]) -> None:
    """What a manifest of Arrow shards says beyond its entries: its columns' facts."""
    if not isinstance(manifest.get("columns"), dict):
        raise ValueError("it holds no columns")


def data_files(folder: Path) -> list[str]:
    """The shards `state.json` lists, in the order of their rows."""
    try:
        files = [entry["filename"] for entry in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{folder / 'state.json'} cannot be read ({type(error).__name__}: {error}); point data.dir at a folder "
            f"that save_to_disk wrote"
        ) from None
    if odd := [file for file in files if not isinstance(file, str) or Path(file).name != file]:
        raise DataError(f"{folder / 'state.json'} lists {odd[0]!r}, no file name of its folder")
    return files


def dataset_dict(root: Path) -> list[str]:
    """The splits of the DatasetDict `root`."""
    try:
        splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{root / 'dataset_dict.json'} cannot be read ({type(error).__name__}: {error})") from None
    if odd := [split for split in splits if not isinstance(split, str) or Path(split).name != split]:
        raise DataError(f"{root / 'dataset_dict.json'} names the split {odd[0]!r}, no folder of {root}")
    return splits


def described(root: Path) -> dict[Path, dict]:
    """The manifest of each Dataset folder of `root` (itself, or each split of a DatasetDict), each
    shard read once to hash it and survey its columns, written beside its files."""
    if (root / "dataset_dict.json").is_file():
        folders = [root / split for split in dataset_dict(root)]
    elif (root / "state.json").is_file():
        folders = [root]
    else:
        raise DataError(f"{root} holds neither state.json nor dataset_dict.json: name a folder that save_to_disk wrote")
    manifests = {}
    for folder in folders:
        shards, columns = [], {}
        for file in data_files(folder):
            path = folder / file
            try:
                before = regular(path, "put its .arrow file there, or save the dataset again with save_to_disk")
                sha256, (samples, found) = hashed(path), surveyed(path)
                after = os.stat(path)
            except OSError as error:
                raise DataError(
                    f"{path}, listed in state.json, cannot be read ({error.strerror}); save it again"
                ) from None
            if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                raise DataError(f"{path} changed while it was described; describe {root} again once it is written")
            shards.append(ArrowShard(file, before.st_size, samples, sha256, before.st_mtime_ns))
            for name, facts in found.items():
                columns[name] = merged(columns[name], facts) if name in columns else facts
        if not shards:
            raise DataError(f"{folder / 'state.json'} lists no .arrow file")
        try:
            manifests[folder] = written(folder, MANIFEST, shards, columns=columns)
        except OSError as error:
            raise DataError(
                f"cannot write {folder / MANIFEST} ({error.strerror}): describe a copy of the dataset that you may "
                f"write to"
            ) from None
    return manifests


def surveyed(path: Path) -> tuple[int, dict[str, dict]]:
    """The rows of the Arrow stream `path`, and the facts of its columns (`survey`)."""
    rows, columns = 0, {}
    descriptor = regular_descriptor(path)
    try:
        for batch in pa.ipc.open_stream(mapped(descriptor)):
            rows += batch.num_rows
            for name, facts in ((name, survey(batch.column(name))) for name in batch.schema.names if batch.num_rows):
                columns[name] = merged(columns[name], facts) if name in columns else facts
    except pa.ArrowException as error:
        raise DataError(f"{path} is no Arrow stream ({error}); save the dataset again with save_to_disk") from None
    finally:
        os.close(descriptor)
    return rows, columns


def mapped(descriptor: int) -> pa.Buffer:
    """The file `descriptor` as one buffer, mapped, not read; unmapped once no buffer of pyarrow's holds it."""
    size = os.fstat(descriptor).st_size
    return pa.py_buffer(mmap.mmap(descriptor, size, prot=mmap.PROT_READ) if size else b"")


def survey(array: pa.Array) -> dict:
    """Of a column of numbers or of lists of them: the type of its numbers (`dtype`), the shape of its
    samples (null where they differ), its nulls, and an integer column's least and largest value (a
    label's, or a token's); of another, its `type`."""
    array, shape, levels = storage(array), [], 0
    nulls = array.null_count
    while is_list(array.type):
        lengths = pc.min_max(pc.list_value_length(array))
        shape.append(lengths["min"].as_py() if lengths["min"] == lengths["max"] else None)
        array, levels = array.flatten(), levels + 1
        nulls += array.null_count
    if (dtype := numbers(array.type)) is None:
        return {"type": str(array.type)}
    facts = {"dtype": dtype.name, "shape": None if None in shape else shape}
    facts["nulls"] = nulls
    if pa.types.is_integer(array.type) and len(array) > nulls:
        least_and_largest = pc.min_max(array)
        facts.update(min=least_and_largest["min"].as_py(), max=least_and_largest["max"].as_py())
    return facts


def merged(facts: dict, more: dict) -> dict:
    """The facts of a column over two parts of it: shapes that differ make null."""
    if "dtype" not in facts or "dtype" not in more or facts["dtype"] != more["dtype"]:
        kinds = {facts.get("dtype", facts.get("type")), more.get("dtype", more.get("type"))}
        return {"type": " and ".join(sorted(kinds)) + " in parts"} if len(kinds) > 1 else facts
    together = {**facts, "shape": facts["shape"] if facts["shape"] == more["shape"] else None}
    together["nulls"] = facts["nulls"] + more["nulls"]
    for key, pick in (("min", min), ("max", max)):
        if found := [part[key] for part in (facts, more) if key in part]:
            together[key] = pick(found)
    return together


def numbers(kind: pa.DataType) -> np.dtype | None:
    """The NumPy type of Arrow's integers and floats; None for any other. Not `to_pandas_dtype`,
    which imports pandas, a second of each start."""
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return None
    letter = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
    return np.dtype(f"<{letter}{kind.bit_width // 8}")


def is_list(kind: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)


def storage(array: pa.Array) -> pa.Array:
    """`datasets`' own types (Array2D...) are an extension over nested lists: read as those."""
    return array.storage if isinstance(array, pa.ExtensionArray) else array


def write_digits(folder: Path, shards: int = 2) -> dict[Path, dict]:
    """scikit-learn's digits as a DatasetDict that save_to_disk would write: `pixels` of shape
    (1, 8, 8), float32 in [0, 1], and `label`, a ClassLabel; the validation split the same samples
    as `digits`' (val_fraction 0.2), the training split in `shards` files. Returns the manifests."""
    if shards < 1:
        raise DataError(f"--shards={shards}: the training split needs one file or more")
    rows = read_digits()
    pixels, labels = rows[:, :-1].astype(np.float32) / 16.0, rows[:, -1].astype(np.int64)  # pixel values are 0..16
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SPLIT_SEED)).numpy()
    held = int(len(rows) * 0.2)
    features = {
        "pixels": {"feature": {"feature": {"feature": {"dtype": "float32", "_type": "Value"}, "length": 8,
                   "_type": "Sequence"}, "length": 8, "_type": "Sequence"}, "length": 1, "_type": "Sequence"},
        "label": {"names": [str(digit) for digit in range(10)], "_type": "ClassLabel"},
    }  # fmt: skip
    kind = pa.list_(pa.list_(pa.list_(pa.float32(), 8), 8), 1)
    schema = pa.schema(
        [("pixels", kind), ("label", pa.int64())],
        metadata={"huggingface": json.dumps({"info": {"features": features}})},
    )
    with building(folder) as draft:
        for split, chosen, count in (("train", order[held:], shards), ("validation", order[:held], 1)):
            (draft / split).mkdir()
            files = [f"data-{number:05d}-of-{count:05d}.arrow" for number in range(count)]
            for file, part in zip(files, np.array_split(chosen, count), strict=True):
                with pa.OSFile(str(draft / split / file), "wb") as sink, pa.ipc.new_stream(sink, schema) as stream:
                    for start in range(0, len(part), WRITE_BATCH):
                        taken = part[start : start + WRITE_BATCH]
                        flat = pa.array(pixels[taken].reshape(-1))
                        nested = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(
                            pa.FixedSizeListArray.from_arrays(flat, 8), 8), 1)  # fmt: skip
                        stream.write_batch(pa.record_batch([nested, pa.array(labels[taken])], schema=schema))
            state = {
                "_data_files": [{"filename": file} for file in files],
                "_fingerprint": f"digits-{split}",
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            }
            (draft / split / "state.json").write_text(json.dumps(state, indent=2))
            info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
            (draft / split / "dataset_info.json").write_text(json.dumps(info, indent=2))
        (draft / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
        manifests = described(draft)
    return {folder / path.relative_to(draft): manifest for path, manifest in manifests.items()}

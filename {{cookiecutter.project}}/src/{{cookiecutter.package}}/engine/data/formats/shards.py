"""Token shards: a folder of token files as nanoGPT and Megatron prepare them (`<name>.bin`, the
tokens as uint16 or uint32 one after another), read a window at a time, never whole, and checked
against the folder's `manifest.json` before anything trains.

The manifest says, per shard, its bytes, tokens, dtype and sha256 (computed once, when it is
written); it is checked, and the training split recorded by the checkpoint, as every manifest of
the ready datasets is (manifest.py): a stat per shard at start, a resume on changed shards refused
naming one unless `data.accept_changed_shards=true`.

Shards from a folder of text files, byte-level (a token is a UTF-8 byte, 256 of them), no download:

    python -m {{cookiecutter.package}}.engine.data.formats.shards write <text folder> <shard folder> [--shard-tokens N]
"""

import argparse
import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..contract import Data, DataError
from .manifest import CHUNK, CheckedShards, hashed, loaded, matched, regular, written

MANIFEST = "manifest.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
WRITE = "python -m {{cookiecutter.package}}.engine.data.formats.shards write <text folder> <shard folder>"


@dataclass(frozen=True)
class Shard:
    """One shard as its manifest describes it."""

    file: str
    bytes: int
    tokens: int
    dtype: str
    sha256: str
    mtime_ns: int


def token_shards(dir: Path, block_size: int, val_shards: int = 1, accept_changed_shards: bool = False) -> Data:
    """The shards of `dir`, checked against its manifest, in windows of `block_size + 1` tokens: sample i
    of a shard starts at token i * block_size, its first block_size tokens the inputs, the same shifted
    by one the next-token targets; a window never spans two shards. The last `val_shards` shards, in the
    order of their names, are the validation set. Its facts: `vocab_size`, `block_size`, and the
    folder's `fingerprint`."""
    if block_size < 1 or val_shards < 1:
        raise ValueError(f"block_size={block_size} and val_shards={val_shards} must be 1 or more")
    folder = Path(dir).expanduser()
    manifest = checked(folder)
    shards = [Shard(**entry) for entry in manifest["shards"]]
    if short := [shard for shard in shards if shard.tokens < block_size + 1]:
        raise DataError(
            f"{folder / short[0].file} holds {short[0].tokens} tokens, fewer than a window of block_size + 1 = "
            f"{block_size + 1}; use data.block_size={short[0].tokens - 1} or less, or write fewer, larger shards "
            f"(--shard-tokens)"
        )
    if val_shards >= len(shards):
        raise DataError(
            f"data.val_shards={val_shards} leaves none of the {len(shards)} shards of {folder} to train on; use "
            f"data.val_shards={len(shards) - 1} or less, or write more shards (--shard-tokens)"
        )
    split = len(shards) - val_shards
    return Data(
        train=TokenWindows(folder, shards[:split], block_size, manifest["fingerprint"], accept_changed_shards),
        val=TokenWindows(folder, shards[split:], block_size, manifest["fingerprint"]),
        vocab_size=manifest["vocab_size"],
        block_size=block_size,
        fingerprint=manifest["fingerprint"],
    )


class TokenWindows(CheckedShards, Dataset):
    """Windows of `block_size + 1` tokens of `shards`, read with one `os.pread` each from files
    opened by the process that reads them (each loader worker its own). A memory map would read as
    fast, but a shard truncated under it kills the process with SIGBUS, naming nothing; a short read
    is named. A checkpoint part: it records the shards it was, and refuses a resume on others."""

    def __init__(
        self, folder: Path, shards: list[Shard], block_size: int, fingerprint: str, accept_changed: bool = False
    ) -> None:
        self.folder, self.shards, self.block_size = folder, shards, block_size
        self.fingerprint, self.accept_changed = fingerprint, accept_changed
        self.itemsize = [np.dtype(DTYPES[shard.dtype]).itemsize for shard in shards]
        self.starts = np.cumsum([0] + [(shard.tokens - 1) // block_size for shard in shards])
        self._files: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        number = int(np.searchsorted(self.starts, index, side="right")) - 1
        shard, itemsize = self.shards[number], self.itemsize[number]
        size = (self.block_size + 1) * itemsize
        offset = (index - int(self.starts[number])) * self.block_size * itemsize
        try:
            read = os.pread(self._file(number, index), size, offset)
        except OSError as error:
            raise self.damaged(shard, index, error.strerror or type(error).__name__) from None
        if len(read) < size:
            raise self.damaged(shard, index, f"it is {os.fstat(self._file(number, index)).st_size} bytes now")
        window = torch.from_numpy(np.frombuffer(read, dtype=DTYPES[shard.dtype]).astype(np.int64))
        return window[:-1], window[1:]

    def _file(self, number: int, index: int) -> int:
        if number not in self._files:
            self._files[number] = self.opened(self.shards[number], index)
        return self._files[number]

    def __getstate__(self) -> dict:
        # A worker started by spawn opens its own files: descriptors do not cross processes.
        return {**self.__dict__, "_files": {}}

    def __del__(self) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)


def checked(folder: Path) -> dict:
    """The manifest of `folder`, after one `os.stat` per shard says its files are the ones it
    describes (and, for a shard whose mtime moved at the same size, its hash); else one line naming
    the file and what to do."""
    rewrite = f"write the shards again ({WRITE}) or put their manifest back"
    if not folder.is_dir():
        raise DataError(f"data.dir={folder} is no folder; point data.dir at a folder of token shards")
    manifest, shards = loaded(folder, MANIFEST, Shard, rewrite, valid)
    present = sorted(path.name for path in folder.glob("*.bin"))
    added = f"move it out of the folder, or write the shards again ({WRITE}) to train on it"
    matched(folder, MANIFEST, shards, present, rewrite, added)
    return manifest


def valid(manifest: dict, shards: list[Shard]) -> None:
    """What a manifest of token shards says beyond its entries: the vocabulary, and a token type."""
    vocabulary = manifest.get("vocab_size")
    if type(vocabulary) is not int or vocabulary < 1:
        raise ValueError(
            f"its vocab_size is {json.dumps(vocabulary)}, not a count of tokens (a whole number, 1 or more)"
        )
    if odd := [shard for shard in shards if shard.dtype not in DTYPES]:
        raise ValueError(f"{odd[0].dtype} of {odd[0].file} is not one of {list(DTYPES)}")
    if odd := [shard for shard in shards if shard.tokens * np.dtype(DTYPES[shard.dtype]).itemsize != shard.bytes]:
        shard = odd[0]
        raise ValueError(
            f"the tokens of {shard.file}, {shard.tokens} of {shard.dtype}, are not its {shard.bytes} bytes"
        )


def write(texts: Path, folder: Path, shard_tokens: int = 1 << 24) -> dict:
    """Byte-level shards of the files under `texts` (their UTF-8 bytes, one after another in the order
    of their paths, as uint16), about `shard_tokens` tokens each and none shorter, with their manifest:
    written into a new folder beside `folder`, renamed to it once complete. Returns the manifest."""
    files = sorted(path for path in texts.rglob("*") if path.is_file() and not path.name.startswith("."))
    if shard_tokens < 2 or not files:
        raise DataError(f"{texts} holds no file to write, or --shard-tokens={shard_tokens} is below 2")
    total = sum(path.stat().st_size for path in files)
    count = max(1, math.ceil(total / shard_tokens))
    ends = [round(total * number / count) for number in range(1, count + 1)]  # equal shards: none is short
    with building(folder) as draft:
        written, output = 0, None
        for path in files:
            with open(path, "rb") as source:
                while chunk := source.read(CHUNK):
                    while chunk:
                        shard = next((number for number, end in enumerate(ends) if written < end), None)
                        if shard is None:
                            raise DataError(f"the files of {texts} grew while being written; write the shards again")
                        if output is None or Path(output.name).name != f"shard_{shard:05d}.bin":
                            output = reopened(output, draft / f"shard_{shard:05d}.bin")
                        take = chunk[: ends[shard] - written]
                        output.write(np.frombuffer(take, dtype=np.uint8).astype(np.uint16).tobytes())
                        written, chunk = written + len(take), chunk[len(take) :]
        reopened(output, None)
        if written != total:
            raise DataError(f"the files of {texts} shrank while being written; write the shards again")
        return described(draft, "uint16", vocab_size=256)


def reopened(output, path: Path | None):
    """`path` opened to write, after `output` is flushed to disk and closed."""
    if output is not None:
        output.flush()
        os.fsync(output.fileno())
        output.close()
    return open(path, "wb") if path is not None else None


def described(folder: Path, dtype: str, vocab_size: int) -> dict:
    """The manifest of the `.bin` files of `folder`, each read once to hash it and to find its largest
    token, written into the folder. A token past the vocabulary would stop a run only when a batch
    first holds it (on a GPU, as a device-side assert), so such shards are refused here."""
    if dtype not in DTYPES:
        raise DataError(f"--dtype={dtype} is not a token type here; use one of {', '.join(DTYPES)}")
    shards = []
    for path in sorted(folder.glob("*.bin")):
        found = regular(path, "put the token file there, or move it out of the folder")
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        if found.st_size % itemsize:
            raise DataError(f"{path} is {found.st_size} bytes, not a whole number of {dtype} tokens")
        sha256, largest = surveyed(path, dtype)
        if largest >= vocab_size:
            raise DataError(
                f"{path} holds token {largest}, which --vocab-size={vocab_size} leaves out of the model's "
                f"embedding; give the tokenizer's vocabulary size (at least {largest + 1})"
            )
        shards.append(Shard(path.name, found.st_size, found.st_size // itemsize, dtype, sha256, found.st_mtime_ns))
    if not shards:
        raise DataError(f"{folder} holds no <name>.bin shard")
    return written(folder, MANIFEST, shards, vocab_size=vocab_size)


def surveyed(path: Path, dtype: str) -> tuple[str, int]:
    """The sha256 of a shard and its largest token, in one read (a chunk holds whole tokens: CHUNK is a
    multiple of their size)."""
    peaks = [0]
    sha256 = hashed(path, lambda chunk: peaks.append(int(np.frombuffer(chunk, dtype=DTYPES[dtype]).max())))
    return sha256, max(peaks)


@contextmanager
def building(folder: Path) -> Iterator[Path]:
    """A new folder beside `folder`, renamed to it when the block ends, removed if it fails: a folder of
    shards is complete or absent."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise DataError(f"{folder} exists and is not an empty folder; name a new one, or move it away")
    draft = folder.with_name(f".{folder.name}.writing-{os.getpid()}")
    draft.mkdir(parents=True)
    try:
        yield draft
        if folder.exists():
            folder.rmdir()  # empty, as checked: a rename does not replace a folder
        draft.rename(folder)
    finally:
        shutil.rmtree(draft, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Token shards: written from text files, or described.")
    commands = parser.add_subparsers(dest="command", required=True)
    writing = commands.add_parser(
        "write", help="byte-level uint16 shards of a folder of text files, and their manifest"
    )
    writing.add_argument("texts", type=Path, help="a folder of text files, read in the order of their paths")
    writing.add_argument("folder", type=Path, help="the new shard folder")
    writing.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens a shard, about")
    describing = commands.add_parser("manifest", help="the manifest of shards written by another tool (nanoGPT's)")
    describing.add_argument("folder", type=Path, help="a folder of <name>.bin token files")
    describing.add_argument("--dtype", choices=list(DTYPES), default="uint16")
    describing.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's, e.g. 50304 for GPT-2's")
    args = parser.parse_args()
    try:
        if args.command == "write":
            manifest = write(args.texts, args.folder, args.shard_tokens)
        else:
            manifest = described(args.folder, args.dtype, args.vocab_size)
    except DataError as error:
        parser.exit(2, f"error: {error}\n")
    tokens = sum(shard["tokens"] for shard in manifest["shards"])
    print(
        f"{args.folder}: {len(manifest['shards'])} shards, {tokens} tokens, fingerprint {manifest['fingerprint'][:16]}"
    )


if __name__ == "__main__":
    main()

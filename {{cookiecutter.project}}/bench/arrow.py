"""What reading Arrow shards through the project costs: samples per second from a folder as Hugging
Face datasets' save_to_disk writes it, through the training loader (engine/data/formats/arrow.py's rows in
the order of engine/data.py), against a raw pyarrow reader of the same files (zero-copy numpy views
of memory-mapped tables, the same rows in the same order, torch's DataLoader), with 0 and 2 workers;
the start's check and the first sample; and the time a resume mid-epoch waits for its first batch.

    python bench/arrow.py [--rows 50000] [--shards 8] [--batches 200]

Target: the project's loader at 0.9x of the raw reader or better with workers. The raw reader maps
the files, which the project does not (a file cut under a map kills its reader with SIGBUS, naming
nothing): the project reads a sample with a pread a column. The images are random, written to a
temporary folder and removed after.
"""

import argparse
import bisect
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from shards import compare
from torch.utils.data import Dataset

from {{cookiecutter.package}}.engine.data.formats.arrow import arrow_folder
from {{cookiecutter.package}}.engine.data.formats.save_to_disk import described

SHAPE = (1, 28, 28)


class RawRows(Dataset):
    """The same rows as the project's, from memory-mapped tables: what a hand-written reader does."""

    def __init__(self, paths: list[Path], rows: int) -> None:
        self.paths, self.rows = paths, rows
        self.views: list[tuple[np.ndarray, np.ndarray]] | None = None  # opened in the process that reads

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.views is None:
            self.views, self.starts = [], [0]
            for path in self.paths:
                table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
                for pixels, labels in zip(table.column("pixels").chunks, table.column("label").chunks, strict=True):
                    flat = pixels.flatten().flatten().flatten().to_numpy(zero_copy_only=True)
                    self.views.append((flat.reshape(-1, *SHAPE), labels.to_numpy(zero_copy_only=True)))
                    self.starts.append(self.starts[-1] + len(labels))
        batch = bisect.bisect_right(self.starts, index) - 1
        pixels, labels = self.views[batch]
        at = index - self.starts[batch]
        return torch.from_numpy(pixels[at].astype(np.float32)), torch.tensor(int(labels[at]))


def written(folder: Path, rows: int, shards: int) -> list[Path]:
    """`rows` random images and labels in `shards` files, as save_to_disk lays a Dataset out."""
    kind = pa.list_(pa.list_(pa.list_(pa.float32(), SHAPE[2]), SHAPE[1]), SHAPE[0])
    schema = pa.schema([("pixels", kind), ("label", pa.int64())])
    generator, files = np.random.default_rng(0), []
    for number, part in enumerate(np.array_split(np.arange(rows), shards)):
        files.append(folder / f"data-{number:05d}-of-{shards:05d}.arrow")
        with pa.OSFile(str(files[-1]), "wb") as sink, pa.ipc.new_stream(sink, schema) as stream:
            for start in range(0, len(part), 1000):
                count = min(1000, len(part) - start)
                nested = pa.array(generator.random(count * int(np.prod(SHAPE)), dtype=np.float32))
                for size in reversed(SHAPE):
                    nested = pa.FixedSizeListArray.from_arrays(nested, size)
                labels = pa.array(generator.integers(0, 10, count))
                stream.write_batch(pa.record_batch([nested, labels], schema=schema))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": file.name} for file in files]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200, help="batches timed a measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements; the best is shown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root)
        files = written(folder, args.rows, args.shards)
        began = time.perf_counter()
        described(folder)
        size = sum(file.stat().st_size for file in files) / 1e6
        print(f"{args.rows} rows of {SHAPE} in {args.shards} shards, {size:.0f} MB")
        print(f"described (each shard hashed and surveyed, once): {time.perf_counter() - began:.2f} s")
        began = time.perf_counter()
        data = arrow_folder(folder, "pixels", "label")
        checked = time.perf_counter() - began
        began = time.perf_counter()
        data.train[len(data.train) - 1]
        first = time.perf_counter() - began
        print(f"start checked in {checked * 1000:.1f} ms (a stat a shard); first sample {first * 1000:.2f} ms")
        compare(data.train, RawRows(files, args.rows), data.train.row, args, "raw pyarrow views", ">= 0.9 with workers")


if __name__ == "__main__":
    main()

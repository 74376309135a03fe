"""The examples' data. Each data option is a function (or class) that a file in configs/data/
names with `_target_`, returning the training and validation datasets and the facts the model,
task, loss and metrics may need about them (`data.Data`). Its settings are its type-annotated
parameters, as a model's are.

A dataset may be of any kind whose samples the loader can batch: (input, target) pairs, dicts or
tuples of tensors; the task (tasks.py) says what a batch holds. The runner's loader (data.py)
decides their order, and resumes it mid-epoch.
"""

import gzip
import importlib.util
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .data import Data

# The split belongs to the dataset, not to the run: changing `seed` must not move samples
# between training and validation.
SPLIT_SEED = 0


def digits(val_fraction: float, test_fraction: float = 0.0) -> Data:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes, no download), as 1x8x8 images;
    with `test_fraction`, a test split that only eval.py reads, taken from the end of the training
    samples (validation stays the same samples)."""
    if not 0 < val_fraction < 1 or not 0 <= test_fraction < 1 - val_fraction:
        raise ValueError(
            f"val_fraction={val_fraction} must be above 0 and below 1, and test_fraction={test_fraction} at least 0 "
            f"and below 1 - val_fraction: training needs samples"
        )
    rows = read_digits()
    images = torch.tensor(rows[:, :-1], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0  # pixel values are 0..16
    targets = torch.tensor(rows[:, -1], dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))
    num_val, num_test = int(len(images) * val_fraction), int(len(images) * test_fraction)
    if not 0 < num_val < len(images) - num_test:
        raise ValueError(
            f"val_fraction={val_fraction} leaves {num_val} of {len(images)} samples for validation; "
            f"both training and validation need some: try data.val_fraction=0.2"
        )
    val, train, test = order[:num_val], order[num_val : len(images) - num_test], order[len(images) - num_test :]
    return Data(
        train=TensorDataset(images[train], targets[train]),
        val=TensorDataset(images[val], targets[val]),
        test=TensorDataset(images[test], targets[test]) if num_test else None,
        input_shape=tuple(images.shape[1:]),
        num_classes=int(targets.max()) + 1,
    )


def read_digits() -> np.ndarray:
    """The digits as scikit-learn ships them: a row per image, 64 pixels and then the label. Read
    from its file directly: importing sklearn.datasets to read it would add 1.5 s to every start."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():  # a scikit-learn that keeps it elsewhere: ask it
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        return np.column_stack([images, labels])
    with gzip.open(path) as file:
        return np.loadtxt(file, delimiter=",")


# The characters a character-level model reads: tab, newline and printable ASCII; any other
# character reads as the last one, so that the vocabulary is the same on every machine.
CHARACTERS = "\t\n" + "".join(map(chr, range(32, 127)))
UNKNOWN = len(CHARACTERS)


def python_source(block_size: int, max_chars: int, val_fraction: float) -> Data:
    """Text every machine with Python has, without a download: the standard library's own modules,
    read in the order of their names up to `max_chars` characters, cut into sequences of
    `block_size` characters, each with the same shifted by one as its next-character targets. The
    last `val_fraction` of the text is for validation: a split that depends on no seed."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be above 0 and below 1")
    text = read_standard_library(max_chars)
    lookup = {character: index for index, character in enumerate(CHARACTERS)}
    tokens = torch.tensor([lookup.get(character, UNKNOWN) for character in text], dtype=torch.long)
    count = (len(tokens) - 1) // block_size
    if count < 2:
        raise ValueError(
            f"the {len(text)} characters read (max_chars={max_chars}) hold fewer than two sequences of "
            f"block_size={block_size}"
        )
    inputs = tokens[: count * block_size].view(count, block_size)
    targets = tokens[1 : count * block_size + 1].view(count, block_size)
    split = count - max(1, int(count * val_fraction))
    return Data(
        train=TensorDataset(inputs[:split], targets[:split]),
        val=TensorDataset(inputs[split:], targets[split:]),
        vocab_size=len(CHARACTERS) + 1,
        block_size=block_size,
    )


def read_standard_library(max_chars: int) -> str:
    """The text of the standard library's top-level modules, in the order of their file names."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= max_chars:
            break
    return "".join(parts)[:max_chars]

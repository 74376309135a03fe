"""The demo's data. Each data option is a function (or class) that a file in configs/data/ names
with `_target_`, returning the training and validation datasets and what a model needs to know
about them (`data.Data`). Its settings are its type-annotated parameters, as a model's are.

The datasets may be of any kind whose samples are (input, target) pairs of tensors: the runner's
loader (data.py) decides their order, and resumes it mid-epoch.
"""

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .data import Data

# The split belongs to the dataset, not to the run: changing `seed` must not move samples
# between training and validation.
SPLIT_SEED = 0


def digits(val_fraction: float) -> Data:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes, no download), as 1x8x8 images."""
    if not 0 < val_fraction < 1:
        raise ValueError(
            f"val_fraction={val_fraction} must be above 0 and below 1: both training and validation need samples"
        )
    rows = read_digits()
    images = torch.tensor(rows[:, :-1], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0  # pixel values are 0..16
    targets = torch.tensor(rows[:, -1], dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))
    num_val = int(len(images) * val_fraction)
    if not 0 < num_val < len(images):
        raise ValueError(
            f"val_fraction={val_fraction} leaves {num_val} of {len(images)} samples for validation; "
            f"both training and validation need some: try data.val_fraction=0.2"
        )
    val, train = order[:num_val], order[num_val:]
    return Data(
        train=TensorDataset(images[train], targets[train]),
        val=TensorDataset(images[val], targets[val]),
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

"""scikit-learn's digits as its file holds them: a row per image, 64 pixels and then the label. Read
by the ready `digits` data (ready/datasets.py) and by arrow's `write-digits`, which writes the same
split as a save_to_disk folder.
"""

import gzip
import importlib.util
from pathlib import Path

import numpy as np


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

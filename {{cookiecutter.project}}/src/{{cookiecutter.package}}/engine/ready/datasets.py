"""The ready data. Each data option is a function (or class) that a file in configs/data/
names with `_target_`, returning the training and validation datasets and the facts the model,
task, loss and metrics may need about them (`data.Data`). Its settings are its type-annotated
parameters, as a model's are; one annotated `Path` says where the data is, not what it is: eval.py
and export.py take a new one for a run whose data moved. Its files are read with `data.read_file`.

A dataset may be of any kind whose samples the loader can batch: (input, target) pairs, dicts or
tuples of tensors; the task (tasks.py) says what a batch holds. The runner's loader (engine/data/loaders.py)
decides their order, and resumes it mid-epoch.
"""

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from ..data import SPLIT_SEED, Data, read_file
from ..data.formats.digits import read_digits


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


# Pads a text to the block: no example holds it, as each is one line.
PAD = CHARACTERS.index("\n")


def text_folder(dir: Path | None, block_size: int, val_fraction: float, max_lines: int | None = None) -> Data:
    """Labelled texts for a classifier: a folder of `<label>.txt` files, one example a line (blank
    lines skipped), the labels in the order of their names as classes 0, 1, ...; with `dir` null,
    the example: lines of the standard library's own source by kind (`read_line_kinds`). Each
    text is read in the characters of `python_source`, cut to `block_size` and padded to it with
    PAD, so that a language model of that data starts the classifier. `max_lines` caps each
    label's examples; a fixed `val_fraction` of them, drawn by SPLIT_SEED, is for validation.

    Its facts: what the model takes (`vocab_size`, `block_size`, `num_classes`, `pad`), and what
    turns a string into inputs and a class into its name (`characters`, `labels`), which export.py
    writes beside the weights."""
    if not 0 < val_fraction < 1 or block_size < 1:
        raise ValueError(
            f"val_fraction={val_fraction} must be above 0 and below 1, and block_size={block_size} above 0"
        )
    examples = read_labelled(Path(dir).expanduser()) if dir is not None else read_line_kinds()
    if max_lines is not None:
        examples = {label: lines[:max_lines] for label, lines in examples.items()}
    labels = sorted(examples)
    lookup = {character: index for index, character in enumerate(CHARACTERS)}
    texts = [text[:block_size] for label in labels for text in examples[label]]
    tokens = torch.full((len(texts), block_size), PAD, dtype=torch.long)
    for row, text in enumerate(texts):
        tokens[row, : len(text)] = torch.tensor([lookup.get(character, UNKNOWN) for character in text])
    targets = torch.tensor([index for index, label in enumerate(labels) for _ in examples[label]])
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(SPLIT_SEED))
    num_val = int(len(texts) * val_fraction)
    if not 0 < num_val < len(texts):
        raise ValueError(
            f"val_fraction={val_fraction} leaves {num_val} of {len(texts)} examples for validation; both training "
            f"and validation need some: give more examples, or another data.val_fraction"
        )
    val, train = order[:num_val], order[num_val:]
    return Data(
        train=TensorDataset(tokens[train], targets[train]),
        val=TensorDataset(tokens[val], targets[val]),
        vocab_size=len(CHARACTERS) + 1,
        block_size=block_size,
        num_classes=len(labels),
        pad=PAD,
        characters=CHARACTERS,
        labels=labels,
    )


def read_labelled(folder: Path) -> dict[str, list[str]]:
    """The examples of each `<label>.txt` in `folder`, its non-blank lines."""
    form = "a folder of <label>.txt files, one example a line (or data.dir=null: the example)"
    if not folder.is_dir():
        raise ValueError(f"data.dir={folder} is no folder; point data.dir at {form}")
    files = sorted(folder.glob("*.txt"))
    if len(files) < 2:
        found = f"only {files[0].name}" if files else "no <label>.txt file"
        raise ValueError(
            f"data.dir={folder} holds {found}, and a classifier needs two labels; point data.dir at {form}"
        )
    examples = {}
    for path in files:
        lines = read_file(path).decode("utf-8", errors="replace").splitlines()
        examples[path.stem] = [line for line in lines if line.strip()]
        if not examples[path.stem]:
            raise ValueError(f"{path} holds no example (one a line); add some, or remove the file and its label")
    return examples


def read_line_kinds() -> dict[str, list[str]]:
    """Labelled text every machine with Python has: the lines of the standard library's top-level
    modules, unindented, each once, in the order of their file names, by kind (`line_kind`)."""
    examples: dict[str, dict[str, None]] = {label: {} for label in ("code", "comment", "definition", "import")}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if text := line.strip():
                examples[line_kind(text)].setdefault(text)  # a dict: each line once, in order
    return {label: list(lines) for label, lines in examples.items()}


def line_kind(text: str) -> str:
    """What an unindented line of Python is: a `comment`, a `definition` (def, class), an `import`,
    or else `code`."""
    if text.startswith("#"):
        return "comment"
    if text.startswith(("def ", "async def ", "class ")):
        return "definition"
    if text.startswith("import ") or text.startswith("from ") and " import " in text:
        return "import"
    return "code"

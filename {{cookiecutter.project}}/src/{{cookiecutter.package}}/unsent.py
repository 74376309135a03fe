"""The file of the metrics that a run could not deliver to MLflow, `unsent-metrics-<run id>.jsonl`
in its checkpoint folder: written by the sender process when the store fails, and by the training
process when the sender dies; read by `python -m <package>.tracking replay`. JSON lines, so that
writing it needs neither MLflow nor torch.
"""

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from .checkpoint.files import NotPlain, open_plain

log = logging.getLogger(__name__)


def spill_path(folder: Path, run_id: str) -> Path:
    """The file of the metrics (and the end) that a run could not deliver, for `replay`."""
    return folder / f"unsent-metrics-{run_id}.jsonl"


def spill(path: Path, rows: Iterable[dict]) -> Path:
    """Appends `rows` to the spill file `path` as JSON lines, and returns the file written: `path`,
    or, where something other than a plain file of its own stands there (a link, which the write
    would follow out of the folder), a file beside it named after this process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = open_plain(path, os.O_RDWR | os.O_APPEND)
    except NotPlain as refused:
        log.warning(f"{refused.strerror}, not a plain file of this run's; not writing through it")
        path = path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}")
        descriptor = open_plain(path, os.O_RDWR | os.O_APPEND)  # NotPlain again: an OSError for the caller
    with open(descriptor, "a") as file:
        # A writer killed mid-line (the sender, say) leaves a line without its end: start afresh.
        if file.tell() > 0 and os.pread(descriptor, 1, file.tell() - 1) != b"\n":
            file.write("\n")
        file.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def replay_command(spill_file: Path, tracking_uri: str = "<uri>") -> str:
    return f"python -m {__package__}.tracking replay {spill_file} --tracking-uri {tracking_uri}"

"""What a run has not delivered to MLflow yet, kept in its checkpoint folder so that it outlives
the processes: `unsent-metrics-<run id>.jsonl`, the metrics (and the end, and the files) that a run
could not deliver, written by the sender process when the store fails and by the training process
when the sender dies, and read by `python -m <package>.engine.tracking replay`; and `unsent-files/`, where
the training process writes a file (an artifact, an image) before handing it over, and where it
stays until it is delivered. JSON lines, so that writing the file needs neither MLflow nor torch.
"""

import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from ..errors import shown
from ..files import NotPlain, kind, open_plain, read_regular, remove

log = logging.getLogger(__name__)

STAGING = "unsent-files"  # in the checkpoint folder: on its file system, and kept with it
# The rows of a spill file, as `spill` writes them: each key and the types its value may have. A
# row with a status is the end of a run; one with a file, a file (an image, with its key); else a metric.
METRIC = {"run_id": str, "key": str, "value": (int, float), "timestamp": int, "step": int}
END = {"run_id": str, "status": str, "end_time": int, "resumes": int}
STATUSES = ("FINISHED", "FAILED", "KILLED")  # how a run ends (Tracker.finish)
ARTIFACT = {"path": str, "artifact_path": (str, type(None))}
IMAGE = {"path": str, "key": str, "step": int, "timestamp": int}


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


def unsent_rows(path: Path) -> list[tuple[int, dict]]:
    """The rows of the spill file `path` that `replay` can send, each with the number of its line. A
    line that holds none (cut short by a writer killed mid-line, or edited) is skipped, and named."""
    rows = []
    for number, line in enumerate(read_regular(path).decode(errors="replace").splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped(path, number, f"cut short ({line[:60]})")
            continue
        if not (isinstance(row, dict) and sendable(row)):
            skipped(path, number, f"no metric, file or end of a run ({line[:60]})")
            continue
        rows.append((number, row))
    return rows


def sendable(row: dict) -> bool:
    """Whether `row` is a metric, a file or the end of a run, each key there with a value of its type."""
    if "status" in row:
        return fits(row, END) and row["status"] in STATUSES
    if "file" in row:
        what = row["file"]
        image = isinstance(what, dict) and "key" in what
        return isinstance(row.get("run_id"), str) and fits(what, IMAGE if image else ARTIFACT)
    return fits(row, METRIC)


def fits(row: object, shape: dict) -> bool:
    """Whether `row` holds each key of `shape` with a value of its type; true and false are no numbers."""
    return isinstance(row, dict) and all(
        key in row and isinstance(row[key], kind) and not isinstance(row[key], bool) for key, kind in shape.items()
    )


def skipped(path: Path, line: int, why: str) -> None:
    """Says that `replay` skips line `line` of `path`, and why (which quotes the line: an edited file's)."""
    log.warning(
        f"skipping line {line} of {path}: {shown(why)}; the rest is sent. To send that line too, fix it and run "
        f"replay again: what was sent is not stored twice"
    )


def replay_command(spill_file: Path, tracking_uri: str = "<uri>") -> str:
    return f"python -m {__package__} replay {spill_file} --tracking-uri {tracking_uri}"


def staged(folder: Path, name: str) -> Path:
    """`folder / name`, a file handed over for MLflow, named relative to the checkpoint folder
    `folder`; refused (ValueError) unless a regular file of one name in its `unsent-files/`, reached
    through no link that leads out of it: the file is read out to the store and then deleted, and a
    spill file may have been edited. FileNotFoundError where nothing is there: delivered already."""
    path = folder / name
    found = os.lstat(path)
    mode = found.st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is {'a symbolic link' if stat.S_ISLNK(mode) else kind(mode)}, not a regular file")
    if found.st_nlink != 1:  # the run writes each file anew: another name of it may be outside
        raise ValueError(f"{path} is a hard link, not a file of the run's own")
    if folder.resolve() / STAGING not in path.resolve().parents:  # a folder on the way is a link, or ..
        raise ValueError(f"{path} is not a file in {folder / STAGING}")
    return path


def discard(folder: Path, name: str) -> None:
    """Deletes the file `name` handed over (staged), and the folder it was written in once that is
    empty; what is refused, or gone, is left as it is."""
    try:
        path = staged(folder, name)
    except (OSError, ValueError):
        return
    remove(path)
    if path.parent != folder / STAGING:
        with contextlib.suppress(OSError):  # not empty: another file was written there
            path.parent.rmdir()


def drop_staging(folder: Path) -> None:
    """Removes the checkpoint folder `folder`'s `unsent-files/` once it is empty, every file in it
    delivered; one that holds a file (waiting for `replay`), or is a link (rmdir does not follow
    one), stays as it is."""
    with contextlib.suppress(OSError):  # not empty, never made, or not a folder
        (folder / STAGING).rmdir()

"""A run's checkpoint folder, its home: the checkpoints' names, the `latest` and `best` pointers,
the ranking and retention, and the checkpoints a resume sets aside (the run's hold on the folder
is claim.py's). A run deletes only files whose names it writes itself.
"""

import contextlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError
from ..files import (
    NotRegular,
    load_restricted,
    open_regular,
    read_own,
    remove,
    sync_folder,
    write_atomically,
)
from .schema import STATE

log = logging.getLogger(__name__)

POINTER = "latest"
BEST = "best"  # names the checkpoint of the best optimized_metric, which retention keeps
SCORES = "scores.json"  # the ranking for `best`: each checkpoint's optimized_metric, which it also holds itself
LOCK = "run.lock"
GOODPUT = "goodput.json"  # the account of where the run's time went (lifecycle/goodput.py), mirrored too
ASIDE = "set-aside-"  # the folders a resume from an earlier step moves the newer checkpoints into (aside)
NAME = re.compile(r"step_(\d{8,})(\.pt)?")  # as path_of writes them: a user's step_7.pt is not ours
# The temporary files and folders the package writes (files.temporary), and so the only ones it
# removes: `step_00000100.pt.<tag>.tmp`, `step_00000100.<tag>.tmp/`, `latest.<tag>.tmp`, `best.<tag>.tmp`,
# `scores.json.<tag>.tmp` (goodput.json's, compile-cache.bin's) and the write test's `write-test.<tag>.tmp`.
TEMPORARY = re.compile(
    r"(step_\d{8,}(\.pt)?|latest|best|scores\.json|goodput\.json|compile-cache\.bin|write-test)\.\d+-[0-9a-f]+\.tmp"
)


def path_of(home: Path, step: int, folder: bool = False) -> Path:
    """The checkpoint of `step`: a file, or a folder of shards."""
    return home / (f"step_{step:08d}" if folder else f"step_{step:08d}.pt")


def steps(home: Path) -> list[tuple[int, Path]]:
    """The checkpoints in `home`, with their steps, in no order."""
    if not home.is_dir():
        return []
    return [
        (int(match[1]), path)
        for path in home.iterdir()
        if (match := NAME.fullmatch(path.name)) and (match[2] is None) == path.is_dir()  # step_N/ or step_N.pt
    ]


def has_checkpoints(home: Path) -> bool:
    return any(steps(home))


Score = tuple[str, str, float]  # what ranks a checkpoint: its optimized_metric, optimized_mode and value


def completed(path: Path, keep_last: int, score: dict | None = None) -> None:
    """After `path` was renamed into its home: `latest` points at it, both renames are durable, and
    the newest `keep_last` checkpoints remain; given its `score` (checkpoint.keep_best: the
    optimized_metric at its step), ranked, and those the ranking keeps remain too. `latest` is for
    people and tools (a resume goes by step numbers, as a crash between two renames can leave it one
    save behind): no fsync of its own; the ranking decides what is deleted, and is durable."""
    home = path.parent
    write_atomically(home / POINTER, lambda file: file.write(path.name.encode()), durable=False)
    sync_folder(home)
    with _pruning:
        newest = [older for _, older in sorted(steps(home), reverse=True)]
        kept = {older.name for older in newest[:keep_last]} | _pinned(home)
        if score is not None:
            try:
                kept |= rank(home, {path.name: score}, score["metric"], score["mode"], kept)
            except OSError as error:  # a full disk: the checkpoint is whole, and deletes wait for a ranking
                log.warning(
                    f"{path.name} is saved but not ranked ({error.strerror or error}); nothing is pruned for now"
                )
                return
        for older in newest:
            if older.name not in kept:
                remove(older)


class Mirrored(Protocol):
    """What mirrors a home elsewhere (mirror.py): the checkpoints it has not copied yet, which
    retention keeps, and the step a resume restored, past which its copies are an abandoned future."""

    def pinned(self) -> set[str]: ...

    def resumed_at(self, step: int) -> None: ...


# The mirror of each home, if any. Retention runs in the thread that wrote a checkpoint, and again in
# the mirror's once a copy is remote; one at a time.
_mirrors: dict[Path, Mirrored] = {}
_pruning = threading.Lock()


@contextlib.contextmanager
def mirrored(home: Path, mirror: Mirrored) -> Iterator[None]:
    """For the life of the block, retention in `home` keeps what `mirror` has not copied yet, and a
    resume's set-aside tells it the step it resumed from."""
    _mirrors[home.resolve()] = mirror
    try:
        yield
    finally:
        _mirrors.pop(home.resolve(), None)


def _pinned(home: Path) -> set[str]:
    mirror = _mirrors.get(home.resolve())
    return mirror.pinned() if mirror is not None else set()


def prune(home: Path, keep_last: int, released: set[str]) -> list[str]:
    """Retention again for the checkpoints `released` from their pins, which `completed` kept: each
    goes unless it is among the newest `keep_last`, is `best` or held apart by the ranking, or is
    pinned still. Returns the names it removed."""
    with _pruning:
        newest = [older for _, older in sorted(steps(home), reverse=True)]
        kept = {older.name for older in newest[:keep_last]} | _pinned(home)
        if isinstance(ledger := _ledger(home), dict):
            kept |= ledger["held"]
        if (best := best_of(home)) is not None:
            kept.add(best.name)
        removed = [older for older in newest if older.name in released and older.name not in kept]
        for older in removed:
            remove(older)
    return [older.name for older in removed]


def step_of(path: Path) -> int:
    """The step of a checkpoint by its name (path_of's)."""
    return int(NAME.fullmatch(path.name)[1])


def best_of(home: Path) -> Path | None:
    """The checkpoint `best` names, if it is still there. Anything else found there (other text, a
    link to a binary file, a FIFO) names none."""
    try:
        with open_regular(home / BEST) as file:
            name = file.read(64).decode().strip()  # a name path_of writes is shorter
    except (OSError, UnicodeDecodeError):
        return None
    path = home / name
    return path if NAME.fullmatch(name) and path.exists() else None


def rank(home: Path, scored: dict[str, dict], metric: str, mode: str, kept: set[str] | None = None) -> set[str]:
    """Ranks the checkpoints in `home` by `metric` and `mode`: `scored` (names, and their scores as a
    checkpoint holds them) added to the scores `scores.json` records, or, where it cannot be trusted,
    to those the checkpoints hold. `best` names the best, the earliest of equals (none: no `best`).
    A checkpoint ranked by another metric or mode (a resume that changed optimized_metric) is not
    comparable: the best of each such ranking is held, kept until someone deletes it. Returns the
    names retention keeps for the ranking: the best and those held. With `kept`, the names retention
    keeps besides, the scores of the others go. A checkpoint the ranking does not list (saved by a
    run killed before it ranked it, or beside a ranking from elsewhere) is ranked by the score it
    holds, so that retention never deletes a best it was not told of. The ranking is durable before
    anything is deleted."""
    ledger = _ledger(home)
    known, held_before = (ledger["known"], ledger["held"]) if isinstance(ledger, dict) else ({}, set())
    on_disk = [path for _, path in sorted(steps(home))]
    unlisted = [path for path in on_disk if path.name not in known.keys() | scored.keys()]
    if unlisted and not isinstance(ledger, dict):
        log.warning(f"{home / SCORES} {ledger}: the checkpoints are ranked again by the scores they hold")
    known |= _own_scores(unlisted)
    known |= {name: found for name, score in scored.items() if (found := _checked(name, score))}
    present = {path.name for path in on_disk}
    rankings: dict[tuple[str, str], dict[str, float]] = {}
    for name, (by, order, value) in known.items():
        if name in present and math.isfinite(value):
            rankings.setdefault((by, order), {})[name] = value
    scores = rankings.pop((metric, mode), {})
    best = _best(scores, mode)
    held = {
        name: {"metric": by, "mode": order, "value": values[name]}
        for (by, order), values in rankings.items()
        if (name := _best(values, order))
    }
    if kept is not None:
        scores = {name: value for name, value in scores.items() if name in kept or name == best}
    text = json.dumps({"metric": metric, "mode": mode, "scores": scores, "held": held}, indent=1)
    write_atomically(home / SCORES, lambda file: file.write(text.encode()), durable=True)
    if best is None:
        with contextlib.suppress(FileNotFoundError):
            (home / BEST).unlink()
    else:
        write_atomically(home / BEST, lambda file: file.write(best.encode()), durable=True)
    for name in sorted(held.keys() - held_before):
        by, order = held[name]["metric"], held[name]["mode"]
        log.warning(
            f"{name}, the best by {by} ({order}), is kept apart from this run's ranking by {metric} ({mode}): "
            f"delete it yourself once done with it, or resume with optimized_metric={by} optimized_mode={order} "
            f"to rank by it again"
        )
    return {best, *held} - {None}


def _best(scores: dict[str, float], mode: str) -> str | None:
    return (min if mode == "min" else max)(sorted(scores), key=scores.__getitem__) if scores else None


def rerank(home: Path) -> None:
    """`best` again, among the checkpoints still in `home` (after some were set aside)."""
    if isinstance(judged := _ledger(home), dict):
        rank(home, {}, judged["metric"], judged["mode"])


def _ledger(home: Path) -> dict | str:
    """`scores.json`, if it is one this module wrote: its `metric` and `mode`, the scores it records
    (`known`) and the names it holds apart (`held`); else what is wrong with it (missing, a link, a
    FIFO, damaged, foreign), and the checkpoints are ranked by the scores they hold. A link, symbolic
    or hard, is not read: it shares another run's ranking (this module writes none; its writes
    replace one)."""
    try:
        ledger = json.loads(read_own(home / SCORES))
    except FileNotFoundError:
        return "is missing"
    except NotRegular as refused:
        return f"is {refused.what}"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except (ValueError, RecursionError):  # not JSON, not text, or nested past what the parser takes
        return "is damaged"
    if not (
        isinstance(ledger, dict)
        and isinstance(ledger.get("metric"), str)
        and ledger.get("mode") in ("min", "max")
        and isinstance(ledger.get("scores"), dict)
        and isinstance(ledger.get("held", {}), dict)  # rankings written before held ones hold none
    ):
        return "is not a ranking this project wrote"
    by = {"metric": ledger["metric"], "mode": ledger["mode"]}
    known = {name: _score({**by, "value": value}) for name, value in ledger["scores"].items()}
    known |= {name: _score(score) for name, score in ledger.get("held", {}).items()}
    if None in known.values():
        return "holds a score that is no metric's value"
    return {**by, "known": known, "held": set(ledger.get("held", {}))}


def _own_scores(checkpoints: list[Path]) -> dict[str, Score]:
    """The scores `checkpoints` hold themselves, by name: each read without its tensors."""
    known = {}
    for path in checkpoints:
        try:
            state = load_restricted(path / STATE if path.is_dir() else path, path, device="meta")
        except CheckpointError as error:
            log.warning(f"{error}; it is not ranked")
            continue
        if isinstance(state, dict) and (found := _checked(path.name, state.get("score"))):
            known[path.name] = found
    return known


def score_of(state: dict) -> Score | None:
    """The score a checkpoint's state holds, if it is a metric's value (a crafted one is not)."""
    return _score(state.get("score"))


def _checked(name: str, score: object) -> Score | None:
    """The score a checkpoint holds (None: none); one that is no metric's value (a crafted file) is
    not ranked, with a warning."""
    if (found := _score(score)) is None and score is not None:
        log.warning(f"{name} holds a score that is no metric's value; it is not ranked")
    return found


def _score(score: object) -> Score | None:
    """`{"metric", "mode", "value"}` as a Score, if the value is a number a float holds (an integer
    past 1e308 is not: OverflowError)."""
    if not (isinstance(score, dict) and isinstance(score.get("metric"), str) and score.get("mode") in ("min", "max")):
        return None
    value = score.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return score["metric"], score["mode"], float(value)
    except OverflowError:
        return None


def aside(step: int) -> str:
    """The name of a folder that a resume from `step`, now, sets the newer checkpoints aside in."""
    return f"{ASIDE}{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step}"


def set_aside_newer(home: Path, step: int) -> Path | None:
    """Moves the checkpoints of `home` past `step` into a subfolder, and returns it: a run resumed
    from an earlier step must not be pruned away by, or lose `resume=last` to, the future it
    abandons, and nothing saved is deleted; nor, by its mirror (checkpoint.remote), their copies."""
    if (mirror := _mirrors.get(home.resolve())) is not None:
        mirror.resumed_at(step)
    newer = [path for number, path in steps(home) if number > step]
    if not newer:
        return None
    name = aside(step)
    for attempt in itertools.count():  # a new folder: one that is there already (a link, say) is not ours
        folder = home / (name if attempt == 0 else f"{name}-{attempt}")
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            break
    for path in newer:
        os.replace(path, folder / path.name)
    rerank(home)
    return folder

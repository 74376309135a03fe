"""A run continued on a new machine: the newest valid checkpoint of `checkpoint.remote`, fetched
into a home that holds none, or only older ones (a machine back from a preemption while another
trained on), before anything reads the home (the config a resume runs with is the checkpoint's).

A checkpoint is fetched under a temporary name (home.TEMPORARY: a kill leaves nothing a resume
picks, and the next claim removes it), checked as any checkpoint is at a resume (its seal and its
shards' checksums, its format), checked to be the one its manifest names, and only then renamed
into place. One that fails is skipped, with a warning, for the one before it. The run's ranking,
`best` and goodput account follow, read later as any home's are (as data), and the checkpoint
`best` names where it is not the newest: retention keeps it in the home, and so the remote keeps
it (mirror.py), and eval.py's `checkpoint=best` reads it. All of it, or none: where the rest fails (a
disk that filled meanwhile, a store that stopped answering), the checkpoints fetched go too, for the
next leg to fetch it all again.
"""

import contextlib
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ...errors import CheckpointError, SaveError
from ...files import check_room, no_room, remove, sync_folder, temporary, write_atomically
from .. import onefile, schema
from ..home import BEST, GOODPUT, NAME, POINTER, SCORES, steps
from . import manifest
from .store import Store, StoreError

log = logging.getLogger(__name__)


def fetch(store: Store, run: str, home: Path, known: dict[int, dict | str], after: int = -1) -> Path | None:
    """Into `home`: the newest checkpoint of the manifests `known` (manifest.committed) past step
    `after` that is whole and checks, then the rest of the run's home. None: none does."""
    listing: dict[str, int] = {}
    skipped: set[int] = set()
    for step in sorted((step for step in known if step > after), reverse=True):
        path = _fetch_one(store, run, home, known[step], step, listing, "falling back to an older one")
        if path is not None:
            what = f"cannot fetch {store.at(f'{run}/{path.name}')} and the rest of the run's home into {home}"
            with _whole(home, path, sum(known[step]["files"].values()), what) as needs:
                _fetch_rest(store, run, home, path, known, skipped, listing, needs)
            return path
        skipped.add(step)
    return None


@contextlib.contextmanager
def _whole(home: Path, fetched: Path, size: int, what: str) -> Iterator[Callable[[int], None]]:
    """The block that fetches the rest of the run's home after the checkpoint `fetched`, or none of
    the fetch: a home that holds the run's newest checkpoint is taken as whole by the next leg, which
    fetches nothing more (the account, `best` and its checkpoint would be lost). A disk without room
    for the rest is said as `what`, with the room all of it takes: `fetched`'s `size`, and the bytes
    the block adds through the function it is given."""
    before = {path for _, path in steps(home)} - {fetched}
    needed = [size]
    try:
        yield needed.append
    except BaseException as error:
        for _, path in steps(home):
            if path not in before:
                remove(path)
        if isinstance(error, SaveError) or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
            raise no_room(shutil.disk_usage(home).free, sum(needed), what) from None
        raise


def _fetch_one(
    store: Store, run: str, home: Path, found: dict | str, step: int, listing: dict[str, int], instead: str
) -> Path | None:
    """The checkpoint of `step` whose manifest is `found`, fetched and checked; None, with a warning
    that ends with what is done `instead`, where it is not whole or does not check. `listing`: the
    run's objects, listed at the first call."""
    where = store.at(f"{run}/{manifest.key_of(step)}")
    if isinstance(found, str):
        log.warning(f"skipping the remote checkpoint of step {step}: {where} {found}; {instead}")
        return None
    if not listing:
        listing.update(store.list(run))
    name = manifest.name_of(found)
    if missing := [key for key, size in manifest.objects(found).items() if listing.get(key) != size]:
        log.warning(
            f"skipping {store.at(f'{run}/{name}')}: its object {missing[0]} is missing or of another size; {instead}"
        )
        return None
    began = time.monotonic()
    try:
        path = _download(store, run, found, home)
    except CheckpointError as error:
        log.warning(f"skipping {store.at(f'{run}/{name}')}: {error}; {instead}")
        return None
    size = sum(found["files"].values())
    log.info(f"fetched {name} from {store.at(run)} ({size / 2**20:.1f} MiB in {time.monotonic() - began:.1f} s)")
    return path


def _download(store: Store, run: str, found: dict, home: Path) -> Path:
    name = manifest.name_of(found)
    final = home / name
    scratch = temporary(final)
    total, where = sum(found["files"].values()), store.at(f"{run}/{name}")
    check_room(shutil.disk_usage(home).free, total, f"cannot fetch {where} into {home}")
    try:
        if found["kind"] == "folder":
            scratch.mkdir()
            for file, size in found["files"].items():
                store.get_file(f"{run}/{name}/{file}", scratch / file, size)
        else:
            store.get_file(f"{run}/{name}", scratch, found["files"][name])
        try:
            _check(scratch, found)
        except CheckpointError as error:  # named as the checkpoint, not as its temporary
            raise CheckpointError(str(error).replace(str(scratch), name)) from None
        os.replace(scratch, final)
        sync_folder(home)
    except BaseException as error:
        remove(scratch)
        if isinstance(error, StoreError) and error.errno == errno.ENOSPC:  # a disk filled meanwhile: the disk's
            raise no_room(shutil.disk_usage(home).free, total, f"cannot fetch {where} into {home}") from None
        raise
    return final


def _check(path: Path, found: dict) -> None:
    """The download at `path` as any checkpoint is checked (its seal, its shards' checksums), and
    as the one its manifest names (its step, its seal)."""
    folder = found["kind"] == "folder"
    if folder:
        from ..resume import load  # the one read of a folder: state.pt, and its shards' checksums

        state = load(path, verify=True).state
    else:
        state = onefile.read(path, verify=True, device="meta")  # checked whole; no tensor is read
        schema.check(path, state, sharded=False)
    seal = onefile.seal(path / schema.STATE if folder else path)
    if state["step"] != found["step"] or seal != found["seal"]:
        raise CheckpointError(f"it is not the checkpoint its manifest names (step {state['step']}, {seal})")


def _fetch_rest(
    store: Store,
    run: str,
    home: Path,
    fetched: Path,
    known: dict,
    skipped: set[int],
    listing: dict[str, int],
    needs: Callable[[int], None],
) -> None:
    """The run's ranking, `best` and goodput account, and `latest`: the remote's are newer than any
    the home has (its checkpoint is). First the checkpoint `best` names, where the home lacks it (and
    it was not `skipped` already: a warning said why). `needs` is told the bytes of each."""
    found = {}
    for name in (SCORES, BEST, GOODPUT):
        with contextlib.suppress(FileNotFoundError):
            found[name] = store.get_bytes(f"{run}/{name}")
    for data in (*found.values(), fetched.name.encode()):
        needs(len(data))
    best = found.get(BEST, b"").decode(errors="replace").strip()
    if (named := NAME.fullmatch(best)) and not (home / best).exists():
        lacking = f"`best` names a checkpoint {home} does not hold"
        if (step := int(named[1])) not in known:
            log.warning(f"{best}, the run's best, is not in {store.at(run)}; {lacking}")
        elif step not in skipped:
            needs(sum(known[step]["files"].values()) if isinstance(known[step], dict) else 0)
            _fetch_one(store, run, home, known[step], step, listing, lacking)
    for name, data in found.items():
        write_atomically(home / name, lambda file, data=data: file.write(data), durable=True)
    write_atomically(home / POINTER, lambda file: file.write(fetched.name.encode()), durable=False)

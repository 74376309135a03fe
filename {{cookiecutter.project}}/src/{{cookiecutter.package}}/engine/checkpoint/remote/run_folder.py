"""What the recipe does with `checkpoint.remote` (docs/preemptible-machines.md): before the run
reads its home, hold the run's remote folder (claim.py) and, resuming into a home that holds
no checkpoint, fetch the newest remote one (fetch.py); while it trains, mirror the home there
(mirror.py); at its end, wait for the newest upload within `checkpoint.remote_wait_s` and say what
is remote.

All of it is built from the command line's settings, before a resume merges the checkpoint's: where
a run's checkpoints go is never a checkpoint's to say, as `checkpoint.dir` is not.
"""

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from ... import distributed
from ...errors import RunError
from ..claim import claim
from ..home import ASIDE, BEST, GOODPUT, LOCK, NAME, POINTER, SCORES, steps
from . import manifest
from .claim import CLAIM, MOST_LEASE_S, holding
from .fetch import fetch
from .mirror import Mirror
from .store import Store, StoreError

log = logging.getLogger(__name__)

# The run's files in its remote folder, beside its checkpoints (a mounted folder's lock among them).
FILES = (POINTER, BEST, SCORES, GOODPUT, CLAIM, LOCK)


class RemoteRun:
    """The run's remote folder, held: its store, its claim, and the manifests found there."""

    def __init__(self, store: Store, run: str, claimed, known: dict, wait_s: float) -> None:
        self.store, self.run, self.claimed, self.known, self.wait_s = store, run, claimed, known, wait_s
        self.mirror: Mirror | None = None
        self.settled = False

    @property
    def lost(self) -> str | None:
        """Why this machine no longer holds the run, once another took it over."""
        return None if self.claimed is None else self.claimed.lost

    def mirroring(self, home: Path, keep_last: int) -> Mirror:
        """Rank 0, holding `home`: the mirror of its checkpoints, started."""
        fence = self.claimed.renew if self.claimed is not None else lambda: None
        leg = self.claimed.leg if self.claimed is not None else ""
        self.mirror = Mirror(self.store, self.run, home, keep_last, leg, self.known, fence)
        if self.claimed is not None:  # a claim gone from the store: what else did it lose?
            self.claimed.listen(self.mirror.recheck)
        return self.mirror

    def settle(self) -> None:
        """The run's end: the newest checkpoint remote within checkpoint.remote_wait_s, said."""
        if self.mirror is not None and not self.settled and (said := self.mirror.settle(self.wait_s)):
            log.info(said)
        self.settled = True


# The remote folder this process holds for each home, for the block of `held`: the home's
# Checkpointer (checkpoint/manager.py) mirrors its checkpoints there and asks it whether it is lost.
_held_for: dict[Path, RemoteRun] = {}


def held_for(home: Path) -> RemoteRun | None:
    """The run's remote folder that this process holds for `home`: None without checkpoint.remote,
    and on every process of a launch but its first."""
    return _held_for.get(home.resolve())


@contextlib.contextmanager
def held(cfg: DictConfig, swept: bool) -> Iterator[RemoteRun | None]:
    """`checkpoint.remote`, held for the block by the launch's first process (None on the others and
    without one), which fetches its newest checkpoint into a home that has none, or an older one,
    while the other processes wait: none reads the home before it is filled. Refused in one line,
    on every process: a URL that is no store's folder or carries a secret, a store that does not
    answer or refuses, a run another machine holds, a fresh run over the run's remote checkpoints,
    and `resume=last` with none here or there. `swept`: the run is a sweep's job (folder_of)."""
    if cfg.checkpoint.get("remote") is None:
        yield None
        return
    with distributed.main_first(cfg, "hold checkpoint.remote and fetch from it") as done:
        if done is None:
            yield None
            return
        with _held(cfg, swept) as remote:
            done()
            yield remote


@contextlib.contextmanager
def _held(cfg: DictConfig, swept: bool) -> Iterator[RemoteRun]:
    settings = cfg.checkpoint
    _check_times(settings)
    _refuse_nested_clash(cfg.name)
    store, home, name = Store(settings.remote), Path(settings.dir), folder_of(cfg.name, Path(settings.dir), swept)
    if store.folder is not None and _overlap(store.folder / name, home):
        raise RunError(
            f"checkpoint.remote={store.url} holds the run's home {home}, or lies in it: give a folder elsewhere (the "
            f"mount that outlives this machine)"
        )
    fresh = cfg.resume is None
    try:
        with contextlib.ExitStack() as stack:
            claimed = stack.enter_context(holding(store, name, home, settings.remote_lease_s))
            known = manifest.committed(store, name)
            if aborted := store.abort_uploads(name, _owned):
                log.info(f"aborted {aborted} upload(s) to {store.at(name)} that an earlier leg left incomplete")
            if fresh and any(isinstance(found, dict) for found in known.values()):
                raise RunError(
                    f"{store.at(name)} already holds checkpoints of {name!r}; continue them with resume=auto "
                    f"(or resume=last), or start a separate run with name=<new name>"
                )
            here = max((step for step, _ in steps(home)), default=-1)
            there = max((step for step, found in known.items() if isinstance(found, dict)), default=-1)
            # A new machine's empty home, or one older than the remote: a machine back from a
            # preemption while another trained on.
            if cfg.resume in ("auto", "last") and there > here:
                # Its files are this process's to write, not another run's; held for the block, for
                # a POSIX lock is the process's: closing this one would free the home that a standby
                # (standby.py) held before it, or that the run claims again later (train.py).
                stack.enter_context(claim(home))
                there = -1 if fetch(store, name, home, known, after=here) is None else there
            if cfg.resume == "last" and max(here, there) < 0:
                raise RunError(
                    f"resume=last found no valid checkpoint in {home} nor in {store.at(name)}; train without "
                    f"resume first, or pass resume=auto to start fresh when there is none"
                )
            remote = RemoteRun(store, name, claimed, known, settings.remote_wait_s)
            _held_for[home.resolve()] = remote
            try:
                yield remote
            finally:  # a run that failed before its end (in its set-up, say) stops its mirror too
                del _held_for[home.resolve()]
                remote.settle()
    except StoreError as error:
        raise RunError(
            f"checkpoint.remote: {error}; the run would not know its remote checkpoints: check the store and its "
            f"credentials (or the network), then run again"
        ) from None


def _check_times(settings: DictConfig) -> None:
    """checkpoint.remote_wait_s and remote_lease_s in their ranges, or one line naming the range."""
    if settings.remote_wait_s < 0:
        raise RunError(
            f"checkpoint.remote_wait_s={settings.remote_wait_s:g} must be 0 or more: the seconds a run's end waits "
            f"for its newest checkpoint to be remote"
        )
    if not 0 < settings.remote_lease_s <= MOST_LEASE_S:
        raise RunError(
            f"checkpoint.remote_lease_s={settings.remote_lease_s:g} must be more than 0 and at most {MOST_LEASE_S:g} "
            f"(seconds): no machine reads a claim of a longer lease"
        )


def fetched_to_read(cfg: DictConfig, name: str, home: Path) -> Path | None:
    """For eval.py and export.py (`name=`, `checkpoint=last|best`): the newest valid checkpoint of
    the run `name` from `checkpoint.remote` into its `home`, where that holds none; with the run's
    ranking, `best` and account. Without a claim: a reader writes only files renamed into place
    whole. None: no remote, a home with checkpoints, or none remote that checks. A sweep job's home
    (`checkpoint.dir=checkpoints/<name>/<its folder>`) reads the job's remote folder, not the run's."""
    if cfg.checkpoint.get("remote") is None or steps(home):
        return None
    store = Store(cfg.checkpoint.remote)
    try:
        job = folder_of(name, home, swept=True)
        swept = home.name != name.rpartition("/")[2] and bool(manifest.committed(store, job))
        folder = folder_of(name, home, swept)
        known = manifest.committed(store, folder)
        if not known:  # a name no run has (a typo): no empty home left behind
            return None
        home.mkdir(parents=True, exist_ok=True)
        return fetch(store, folder, home, known)
    except StoreError as error:
        raise RunError(f"checkpoint.remote: {error}; check the store and its credentials, then run again") from None


def folder_of(name: str, home: Path, swept: bool) -> str:
    """The folder under checkpoint.remote of the run `name` whose home is `home`, named as its home
    is under checkpoints/: `<name>`, and a sweep job's (`swept`) `<name>/<its home's folder>`
    (sweeps.Job: its overrides), so that no two jobs share one."""
    return f"{name}/{home.name}" if swept else name


def _refuse_nested_clash(name: str) -> None:
    """Refuses a run named under another (`a/b` under `a`) by a name that run `a` uses in its remote
    folder: a folder of its own would take `a/b`'s objects for `a`'s (and its start abort `a/b`'s
    uploads), and in a mounted folder one of its files and `a/b`'s folder cannot both be."""
    parts = name.split("/")
    for number in range(1, len(parts)):
        if _owned(f"{parts[number]}/") or parts[number] in FILES:
            raise RunError(
                f"name={name}: {parts[number]} is a name that the run {'/'.join(parts[:number])} uses in its remote "
                f"folder (its folders step_<N>/, committed/, set-aside-*/ and its files {', '.join(FILES)}), which "
                f"would mix the two runs' objects; give the run another name"
            )


def _owned(key: str) -> bool:
    """Whether `key`, relative to the run's remote folder, is the run's own: a file in it, or in its
    checkpoints' folders, its manifests' or its set-asides'; never one of a run named under it (`a/b`
    under `a`), whose uploads in flight are its own."""
    top, under, _ = key.partition("/")
    return not under or top == manifest.FOLDER or NAME.fullmatch(top) is not None or top.startswith(ASIDE)


def _overlap(one: Path, other: Path) -> bool:
    one, other = one.resolve(), other.resolve()
    return one == other or one in other.parents or other in one.parents

"""The run's home, mirrored to `checkpoint.remote` by rank 0 in a thread of its own, so that no step
waits for a store: each checkpoint once it is in its home, newest first, its objects, then its
manifest (manifest.py), which makes it visible; then `scores.json`, `best`, `latest` and the goodput
account. Between checkpoints the account is uploaded too, whenever it changed, at most every
ACCOUNT_EVERY_S: a machine lost past its newest remote checkpoint has told the store which steps it
trained, and the next one counts training them again as such (goodput.py), not as time between legs.
A store that is down or refuses costs a warning, and the uploads are retried, with a growing pause,
for the life of the run.

Nothing local goes before a copy remote covers it: retention in the home keeps (home.mirrored) every
checkpoint not yet remote that is newer than the newest remote one, and prunes it once one is.
Remote retention deletes what local retention deleted (one of the newest `keep_last` remote ones
stays, for a machine that fetched only the newest), and only a checkpoint a manifest of this run
lists: the manifest first, then the objects it lists, so that no resume sees half of one.
"""

import json
import logging
import threading
import time
from pathlib import Path

from ...errors import listed
from ..home import BEST, GOODPUT, POINTER, SCORES, aside, best_of, mirrored, prune, step_of, steps
from . import manifest
from .claim import Lost
from .store import Store, StoreError

log = logging.getLogger(__name__)

MOST_PAUSE_S = 60.0  # between retries of a store that fails
# The goodput account's upload between checkpoints: one small object. What a lost machine trained in
# its last such stretch is counted between legs, not as steps trained again.
ACCOUNT_EVERY_S = 10.0


class Mirror:
    """Rank 0: uploads what `landed` names, in a daemon thread, until `settle`. `known`: the remote
    manifests of the run, by step, as the start found them (manifest.committed); `fence()` is called
    before each manifest is written, and raises Lost where this machine no longer holds the run."""

    def __init__(
        self,
        store: Store,
        run: str,
        home: Path,
        keep_last: int,
        leg: str,
        known: dict[int, dict | str],
        fence=lambda: None,
    ) -> None:
        self.store, self.run, self.home, self.keep_last, self.leg = store, run, home, keep_last, leg
        self._fence = fence
        self._remote = {step: found for step, found in known.items() if isinstance(found, dict)}
        self._pending: dict[int, Path] = {}
        self._landed: dict[int, tuple[str, float]] = {}  # step: its name, and when it landed (time.monotonic())
        self._took: dict[int, float] = {}  # step: seconds from landing to its manifest
        self._asked = self._done = 0  # the rest (ranking, pointers, goodput) asked for, and published
        self._account: tuple[int, int] | None = None  # the goodput account last uploaded: its inode and mtime
        self.failure: StoreError | None = None  # the last failure, until an upload succeeds
        self._closing = False
        self._crowded = False  # said that the checkpoints waiting outnumber keep_last
        self._changed = threading.Condition()
        self._resumed: int | None = None  # the step a resume restored, to set the newer copies aside at
        self._recheck: str | None = None  # why the store's manifests are to be listed again (recheck)
        self._pins = mirrored(home, self)
        self._pins.__enter__()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def landed(self, path: Path) -> None:
        """The checkpoint `path` is in the home (called from the thread that wrote it): to upload."""
        with self._changed:
            step = step_of(path)
            self._pending[step], self._landed[step] = path, (path.name, time.monotonic())
            self._asked += 1
            self._changed.notify_all()
            waiting = len(self._pending)
        if waiting > self.keep_last and not self._crowded:  # a long outage: the disk fills
            self._crowded = True
            log.warning(
                f"{waiting} checkpoints wait for {self.store.at(self.run)}, more than checkpoint.keep_last="
                f"{self.keep_last}: the home keeps each until a newer one is remote"
            )

    def pinned(self) -> set[str]:
        """The checkpoints retention must keep: not yet remote, and newer than the newest remote one."""
        with self._changed:
            newest = max(self._remote, default=-1)
            return {path.name for step, path in self._pending.items() if step > newest}

    def resumed_at(self, step: int) -> None:
        """A resume restored `step` (home.set_aside_newer): the remote copies past it are set aside
        before anything is uploaded, as the home's are, so that no resume=auto elsewhere takes them;
        and its checkpoint is uploaded where the remote lacks it (the leg before was killed, or
        preempted, before its upload ended: a standby's takeover, the same machine back)."""
        restored = next((path for number, path in steps(self.home) if number == step), None)
        with self._changed:
            self._resumed = step
            if restored is not None and step not in self._remote:
                self._pending[step] = restored
            self._asked += 1
            self._changed.notify_all()

    def wait_for(self, step: int, timeout: float) -> bool:
        """Whether the checkpoint of `step` is remote within `timeout` seconds (for benchmarks and tests)."""
        with self._changed:
            return self._changed.wait_for(lambda: step in self._remote, timeout=timeout)

    def settle(self, wait_s: float) -> str | None:
        """Waits, up to `wait_s`, for the newest checkpoint and the rest (the goodput account as it
        is now, ranking, pointers) to be remote; says in one line what is and what is not (None: this
        leg saved nothing). The thread goes on where it must, and ends with the process."""
        with self._changed:
            self._closing = True
            self._asked += 1
            self._changed.notify_all()
            settled = self._changed.wait_for(
                lambda: isinstance(self.failure, Lost) or (not self._pending and self._done >= self._asked),
                timeout=wait_s,
            )
            newest = max(self._landed, default=None)
            there = self.store.at(self.run)
            self._pins.__exit__(None, None, None)  # what a later leg's retention decides
            if newest is None:
                return None
            name = self._landed[newest][0]
            if newest in self._took:
                also = "" if settled else f"; {len(self._pending)} older upload(s) never arrived"
                return f"remote: {name} is in {there} (uploaded {self._took[newest]:.1f} s after the save){also}"
            why = str(self.failure) if self.failure else "still uploading"
            older = max((step for step in self._remote if step < newest), default=None)
            instead = "none" if older is None else manifest.name_of(self._remote[older])
            return (
                f"remote: {name} is not in {there} within checkpoint.remote_wait_s={wait_s:g} ({why}); "
                f"the newest checkpoint there is {instead}, and {name} stays in {self.home}"
            )

    def _loop(self) -> None:
        pause = 0.0
        while True:
            with self._changed:
                due = self._changed.wait_for(
                    lambda: self._pending or self._done < self._asked or self._closing, timeout=ACCOUNT_EVERY_S
                )
                resumed, recheck = self._resumed, self._recheck
                if self._closing and not self._pending and self._done >= self._asked:
                    return
            try:
                if recheck is not None:
                    self._restore(recheck)
                    with self._changed:
                        self._recheck = None if self._recheck == recheck else self._recheck
                if resumed is not None:
                    self._set_aside(resumed)
                    with self._changed:
                        self._resumed = None if self._resumed == resumed else self._resumed
                if due:
                    self._once()
                else:  # a quiet stretch: the account, where it changed
                    self._publish_account()
            except Lost as lost:
                log.warning(f"{lost}; this machine uploads nothing more")
                with self._changed:  # a stop need not wait for uploads that no longer come
                    self.failure = lost
                    self._changed.notify_all()
                return
            except (StoreError, OSError) as error:  # OSError: a local file (a disk that fails)
                if not isinstance(error, StoreError):
                    error = StoreError(f"{type(error).__name__}: {error}", transient=True)
                if self.failure is None:
                    log.warning(f"checkpoint.remote: {error}; training goes on, and uploads are retried")
                self.failure = error
                pause = min(max(1.0, 2 * pause), MOST_PAUSE_S)
                with self._changed:  # a stop shortens the pause: its bound is short
                    self._changed.wait(1.0 if self._closing else pause)
                continue
            if self.failure is not None:
                log.info("checkpoint.remote: uploads work again")
            self.failure, pause, self._crowded = None, 0.0, False

    def _once(self) -> None:
        """The newest checkpoint not yet remote, uploaded; the local ones it covers, released from
        their pins; the rest; remote retention."""
        with self._changed:
            step = max(self._pending, default=None)
            path = self._pending.get(step)
            asked = self._asked
        if path is not None:
            if path.exists():  # else pruned: a newer copy was remote, and covers it
                self._upload(step, path)
            with self._changed:
                self._pending.pop(step, None)
                newest = max(self._remote, default=-1)
                covered = {older.name for number, older in self._pending.items() if number < newest}
            if covered:
                prune(self.home, self.keep_last, covered)
        self._publish_rest()
        with self._changed:
            self._done = max(self._done, asked)
            self._changed.notify_all()
        self._prune_remote()

    def _upload(self, step: int, path: Path) -> None:
        described = manifest.build(path, self.run, self.leg)
        for key in manifest.objects(described):
            self.store.put_file(self.home / key, f"{self.run}/{key}")
        self._fence()  # a machine that took the run over since: no manifest of this one appears
        data = json.dumps(described, indent=1).encode()
        self.store.put_bytes(f"{self.run}/{manifest.key_of(step)}", data)
        with self._changed:
            self._remote[step] = described
            if step in self._landed:
                self._took[step] = time.monotonic() - self._landed[step][1]

    def _publish_rest(self) -> None:
        """The ranking, `best` where it names a remote checkpoint, `latest` naming the newest remote
        one, and the goodput account: each as the home has it now."""
        if (self.home / SCORES).is_file():
            self.store.put_file(self.home / SCORES, f"{self.run}/{SCORES}")
        self._publish_account()
        with self._changed:
            remote = {manifest.name_of(found): step for step, found in self._remote.items()}
        best = best_of(self.home)
        if best is not None and best.name in remote:
            self.store.put_bytes(f"{self.run}/{BEST}", best.name.encode())
        if remote:
            self.store.put_bytes(f"{self.run}/{POINTER}", max(remote, key=remote.get).encode())

    def _publish_account(self) -> None:
        """The home's goodput account, where it changed since its last upload and a checkpoint of
        this run is remote (without one, no machine continues from there)."""
        with self._changed:
            anchored = bool(self._remote)
        try:
            found = (self.home / GOODPUT).stat()
        except FileNotFoundError:
            return
        written = (found.st_ino, found.st_mtime_ns)  # each write a new file (files.write_text): a new inode
        if anchored and written != self._account:
            self._fence()  # a machine that took the run over since keeps its own account
            self.store.put_file(self.home / GOODPUT, f"{self.run}/{GOODPUT}")
            self._account = written

    def _set_aside(self, step: int) -> None:
        """The remote checkpoints past `step`, each moved into `set-aside-<time>-after-step-<step>/`:
        its objects copied, its manifest copied, then removed (from here no resume sees it), then
        the objects it lists. An object that no retry would move is said, and its manifest moved
        without it: one already gone (deleted by hand or a lifecycle rule, or never there: a manifest
        from elsewhere), or one the store refuses to copy (archived by a lifecycle rule), which stays
        where it is."""
        with self._changed:
            newer = {number: found for number, found in self._remote.items() if number > step}
        if not newer:
            return
        folder = aside(step)
        missing: list[str] = []
        refused: dict[str, str] = {}  # key: the store's reason
        for number, found in sorted(newer.items()):
            self._copy_aside(found, folder, missing, refused)
            self.store.put_bytes(f"{self.run}/{folder}/{manifest.key_of(number)}", json.dumps(found, indent=1).encode())
            self._delete(number, found, kept=set(refused))
        said = f"resuming from step {step}: the newer checkpoints of {self.store.at(self.run)} are moved to {folder}/"
        unmoved = [f"{listed(missing, 3)} missing from the store: not moved"] if missing else []
        if refused:
            shown = listed([f"{key} ({why})" for key, why in refused.items()], 3)
            unmoved.append(f"{shown} refused by the store: not moved, left where it is")
        if unmoved:
            log.warning(f"{said} ({'; '.join(unmoved)})")
        else:
            log.info(said)

    def _copy_aside(self, found: dict, folder: str, missing: list[str], refused: dict[str, str]) -> None:
        """The objects the manifest `found` lists, copied into `folder`; those gone added to
        `missing`, those the store refuses to copy for good (a StoreError that is not transient) to
        `refused`, with its reason. A failure a retry may get past is raised: the set-aside is retried."""
        for key, size in manifest.objects(found).items():
            try:
                self.store.copy(f"{self.run}/{key}", f"{self.run}/{folder}/{key}", size)
            except FileNotFoundError:
                missing.append(key)
            except StoreError as error:
                if error.transient:
                    raise
                refused[key] = str(error).removeprefix(f"{self.store.at(f'{self.run}/{key}')}: ")

    def recheck(self, said: str) -> None:
        """The claim was gone from the store, and is this machine's again (`said`, claim.py; "": said
        already): the store may have lost the run's checkpoints with it (emptied, or its bucket made
        again). What it lacks of the home's is uploaded again; said in one line with `said`."""
        with self._changed:
            self._recheck = said
            self._asked += 1
            self._changed.notify_all()

    def _restore(self, said: str) -> None:
        """What the store holds of the run, listed again; the home's checkpoints it lacks, to upload."""
        known = manifest.committed(self.store, self.run)
        with self._changed:
            gone = sorted(step for step in self._remote if not isinstance(known.get(step), dict))
            self._remote = {step: found for step, found in known.items() if isinstance(found, dict)}
            lacking = {step: path for step, path in steps(self.home) if step not in self._remote}
            self._pending.update(lacking)
        if gone:
            names = ", ".join(path.name for _, path in sorted(lacking.items())) or "none"
            lost = (
                f"{self.store.at(self.run)} lost {len(gone)} checkpoint(s) with its claim: uploading again those of "
                f"{self.home} it lacks ({names})"
            )
            said = f"{said}; {lost}" if said else lost
        if said:
            log.warning(said)

    def _prune_remote(self) -> None:
        """The remote checkpoints of this run that local retention removed, but for the newest
        `keep_last` there: each manifest, then the objects it lists."""
        local = {path.name for _, path in steps(self.home)}
        with self._changed:
            kept = set(sorted(self._remote, reverse=True)[: self.keep_last])
            gone = {step: found for step, found in self._remote.items() if step not in kept}
        for step, found in sorted(gone.items()):
            if manifest.name_of(found) not in local:
                self._delete(step, found)

    def _delete(self, step: int, found: dict, kept: set[str] = frozenset()) -> None:
        """The remote checkpoint of `step`: its manifest first (from then no resume sees it), then
        the objects the manifest `found` lists but those `kept`, and a folder checkpoint's emptied folder."""
        self.store.delete(f"{self.run}/{manifest.key_of(step)}")
        with self._changed:
            self._remote.pop(step, None)
        for key in manifest.objects(found).keys() - kept:
            self.store.delete(f"{self.run}/{key}")
        if found["kind"] == "folder":
            self.store.tidy(f"{self.run}/{manifest.name_of(found)}")

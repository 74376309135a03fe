"""The run's claim on its remote folder, so that two machines that resume the same run at once do
not both train it: `<remote>/<name>/claim.json`, made with S3's conditional write (If-None-Match:
only where there is none), renewed every third of its lease with another (If-Match: only where it
is still the version this machine wrote), and released at the end. A claim whose lease ran out, by
the store's own clock (its Date header less the object's Last-Modified: no two machines' clocks are
compared), or whose holder was a process of this machine (its host name, boot and PID namespace)
that ended, is taken over, by one machine only: a second conditional write loses. A holder on
another machine whose lease runs out within this machine's own is waited for: renewed meanwhile, it
lives, and this machine is refused; not renewed, it is taken over. Each renewal writes a new version
(its count changes), so that a renewal shows. A claim this module cannot read (another program's,
damaged) is held, as far as this machine can tell, for the longest lease it accepts, and a takeover
of it is said. A machine whose claim was taken over learns it at its next renewal, and stops; the
mirror renews right before each manifest, so that it publishes nothing after it lost the run. A
claim gone from the store (deleted, the bucket emptied) is made again by its holder's next renewal,
only where no other machine made one first (If-None-Match): else that is a lost claim.

A mounted folder is claimed as a home is (claim.py: a POSIX lock on `run.lock`).
"""

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from ...errors import RunError, shown
from ..claim import claim
from .store import Conflict, Read, Store, StoreError

log = logging.getLogger(__name__)

CLAIM = "claim.json"
# checkpoint.remote_lease_s at most, and what a claim read from the store may say of its lease; a
# claim this module cannot read is taken to hold for this long.
MOST_LEASE_S = 3600.0
POLL_S = 1.0  # how often a machine waiting for a holder's lease to run out reads its claim
RELEASE_S = 5.0  # a run's end waits no longer to release its claim: unreleased, it runs out


class Lost(StoreError):
    """The run's claim on the remote was taken by another machine: this one publishes nothing more."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, transient=False)


class RemoteClaim:
    """This machine's claim on `<store>/<run>/`, held and renewed in a daemon thread from `take` to
    `release`. `lost`: why this machine no longer holds it, once it does not."""

    def __init__(self, store: Store, run: str, home: Path, lease_s: float) -> None:
        self.store, self.run, self.lease_s = store, run, lease_s
        self.key, self.leg = f"{run}/{CLAIM}", uuid.uuid4().hex
        self.at = store.at(run)
        self._holder = {
            "holder": f"PID {os.getpid()} on {socket.gethostname()}",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pid_space": pid_space(),
            "home": str(home.absolute()),
            "leg": self.leg,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lease_s": lease_s,
            "released": False,
            "renewals": 0,
        }
        self._etag: str | None = None
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self.lost: str | None = None
        self._listener: Callable[[str], None] | None = None  # told of a remake (listen)
        self._unheard = False  # a remake said before anyone listened

    def take(self) -> None:
        """Holds the run's folder, or raises a RunError naming the machine that does."""
        body = json.dumps(self._holder).encode()
        for _ in range(8):  # each round lost to another machine's conditional write: read it again
            try:
                self._etag = self.store.put_bytes(self.key, body, create=True)
                break
            except Conflict:
                pass
            try:
                found = self.store.read(self.key)
            except FileNotFoundError:  # released by a delete in between
                continue
            holder = _holder(found)
            if not _free(found, holder):
                found = self._outlive(found, holder)
                if found is None:  # deleted while this machine waited
                    continue
                holder = _holder(found)
            try:
                self._etag = self.store.put_bytes(self.key, body, if_match=found.etag)
            except Conflict:
                continue
            if holder is None or not holder["released"]:
                log.warning(f"took over {self.at} from {_who(holder)}, {_why_free(found, holder)}")
            break
        else:
            raise RunError(f"{self.at}: the claim kept changing under this machine's writes; run again")
        threading.Thread(target=self._renewing, name="checkpoint-claim", daemon=True).start()

    def _outlive(self, found: Read, holder: dict | None) -> Read | None:
        """The live claim `found`, waited for where its holder is on another machine and its lease
        runs out within this machine's own (a machine taken away, and its replacement started at
        once): returned once its lease ran out or it was released (None: deleted), to take over.
        Refused at once, or once it was renewed meanwhile (it lives)."""
        left = _lease(holder) - found.age_s
        if _here(holder) or left > self.lease_s:
            raise self._refused(found, holder)
        log.info(
            f"{self.at} is held by {_who(holder)}, whose lease runs out in {left:.0f} s unless renewed: waiting to "
            f"see which (up to {left + 2 * POLL_S:.0f} s)"
        )
        deadline = time.monotonic() + left + 2 * POLL_S  # the store's clock says whole seconds
        now = found
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            try:
                now = self.store.read(self.key)
            except FileNotFoundError:
                return None
            if _free(now, _holder(now)):
                return now
            if now.etag != found.etag:
                raise self._refused(now, _holder(now), "renewed while this machine waited: it lives")
        raise self._refused(now, holder)

    def _refused(self, found: Read, holder: dict | None, why: str = "") -> RunError:
        lease = _lease(holder)
        return RunError(
            f"{self.at} is in use by {_who(holder)} (lease renewed {found.age_s:.0f} s ago, runs out in "
            f"{lease - found.age_s:.0f} s{'; ' + why if why else ''}); wait for that run to end (or stop it), or train "
            f"separately with name=<another name>"
        )

    def renew(self) -> None:
        """The claim's lease, started again; Lost where another machine holds the run now. A store
        that does not answer delays the renewal (StoreError). A claim gone from the store is made
        again, where no other machine made one first."""
        with self._lock:
            if self.lost is not None:
                raise Lost(self.lost)
            self._holder["renewals"] += 1
            body = json.dumps(self._holder).encode()
            try:
                self._etag = self.store.put_bytes(self.key, body, if_match=self._etag)
            except FileNotFoundError:  # deleted by hand or a lifecycle rule, or the bucket emptied
                self._take_again(body)
            except Conflict:
                self._lose()

    def listen(self, listener: Callable[[str], None]) -> None:
        """`listener` told each time the claim was gone from the store and is this machine's again,
        with the line to say (the mirror, run_folder.py, says it with what else the store lost); at
        once, with "" (said already), where that happened before it listened: the renewals run from
        `take`, through a fetch."""
        with self._lock:
            self._listener, unheard, self._unheard = listener, self._unheard, False
        if unheard:
            listener("")

    def _take_again(self, body: bytes) -> None:
        try:
            self._etag = self.store.put_bytes(self.key, body, create=True)
        except Conflict:
            self._lose()
        said = f"the claim on {self.at} was gone from the store (deleted, or the store emptied): this machine holds it again"
        if self._listener is not None:
            self._listener(said)
        else:
            log.warning(said)
            self._unheard = True

    def _lose(self) -> None:
        """Raises Lost, naming the claim's holder, unless the claim is this machine's write whose
        answer never came (a renewal that timed out here, yet landed)."""
        found = self._found()
        holder = found and _holder(found)
        if holder is not None and holder.get("leg") == self.leg:
            self._etag = found.etag
            return
        self.lost = f"lost the claim on {self.at} to {_who(holder) if found else 'another machine'}"
        raise Lost(self.lost) from None

    def release(self) -> None:
        """The claim, marked released (a conditional PUT: more stores take it than a conditional
        DELETE), unless another machine holds it by now: that is said."""
        self._ended.set()
        with self._lock:
            if self.lost is not None or self._etag is None:
                return
            released = json.dumps({**self._holder, "released": True}).encode()
            for _ in range(2):  # again with the version of a renewal that landed unanswered (_lose)
                try:
                    self.store.put_bytes(self.key, released, if_match=self._etag, within=RELEASE_S)
                    return
                except FileNotFoundError:  # gone from the store already: nothing holds the run
                    return
                except Conflict:
                    try:
                        self._lose()
                    except Lost as lost:  # taken over since the last renewal: not this machine's to release
                        log.warning(f"{lost} before this run's end")
                        return
                except StoreError as error:
                    log.warning(
                        f"could not release the claim on {self.at} ({error}); it runs out {self.lease_s:g} s after"
                    )
                    return

    def _renewing(self) -> None:
        while not self._ended.wait(self.lease_s / 3):
            try:
                self.renew()
            except Lost as lost:
                log.warning(f"{lost}; this machine stops at its next logging step")
                return
            except StoreError:  # an outage delays the renewal; another machine may take the run meanwhile
                continue

    def _found(self) -> Read | None:
        try:
            return self.store.read(self.key)
        except (StoreError, FileNotFoundError):
            return None


def _holder(found: Read) -> dict | None:
    """The claim in `found`, if it is one this module writes (data from another machine)."""
    try:
        holder = json.loads(found.data)
    except (ValueError, RecursionError):
        return None
    if not (
        isinstance(holder, dict)
        and isinstance(holder.get("holder"), str)
        and isinstance(holder.get("home"), str)
        and type(holder.get("released")) is bool
        and type(holder.get("lease_s")) in (int, float)
        and 0 < holder["lease_s"] <= MOST_LEASE_S
    ):
        return None
    return holder


def _lease(holder: dict | None) -> float:
    """The lease of the claim `holder`; of one this module cannot read, the longest it accepts."""
    return MOST_LEASE_S if holder is None else holder["lease_s"]


def _free(found: Read, holder: dict | None) -> bool:
    """Whether the claim `found` may be taken over: released, its lease run out, or its holder a
    process of this machine that ended."""
    return (holder is not None and holder["released"]) or found.age_s > _lease(holder) or _ended_here(holder)


def _why_free(found: Read, holder: dict | None) -> str:
    if holder is None:
        return f"unchanged for {found.age_s:.0f} s, longer than any lease this project writes ({MOST_LEASE_S:g} s)"
    if _ended_here(holder):
        return "which ended"
    return f"whose lease ran out {found.age_s - holder['lease_s']:.0f} s ago"


def pid_space() -> str | None:
    """This machine's boot and this process's PID namespace (Linux; None elsewhere): the PIDs it can
    look up. A host name alone does not say it: VMs made from one image share theirs, and containers
    with the host's network take the host's."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _here(holder: dict | None) -> bool:
    """Whether the claim's holder is a process this one can look up by its PID: of this host name,
    this boot, this PID namespace."""
    return holder is not None and holder.get("host") == socket.gethostname() and holder.get("pid_space") == pid_space()


def _ended_here(holder: dict | None) -> bool:
    """Whether the claim's holder was a process of this machine that is gone (a kill -9, and the
    job's next leg, or a standby, on the same machine): no need to wait for its lease."""
    if not _here(holder):
        return False
    pid = holder.get("pid")
    if type(pid) is not int or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _who(holder: dict | None) -> str:
    if holder is None:
        return "a claim this project did not write"
    return f"{shown(holder['holder'][:200])} (home {shown(holder['home'][:300])})"


@contextlib.contextmanager
def holding(store: Store, run: str, home: Path, lease_s: float) -> Iterator[RemoteClaim | None]:
    """The run's folder in `store`, held for the block: by a RemoteClaim on S3, by a lock on a
    mounted folder; elsewhere (gs://, az://) not at all, said once."""
    if store.folder is not None:
        with claim(store.folder / run):
            yield None
        return
    if not store.conditional:
        log.warning(
            f"{store.url} takes no conditional writes that this project uses: a second machine on it is not stopped"
        )
        yield None
        return
    remote = RemoteClaim(store, run, home, lease_s)
    remote.take()
    try:
        yield remote
    finally:
        remote.release()

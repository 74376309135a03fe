"""The store behind `checkpoint.remote`: a folder of an object store (`s3://`, `gs://`, `az://`,
through fsspec and the store's own package) or of a mounted file system (a path, or `file://`),
under which the run's home is mirrored (mirror.py). Every call answers within a deadline: s3fs,
asked to PUT to a server that stopped answering, waits forever whatever its read timeout says.

An object appears under its name whole or not at all: a single PUT and a completed multipart
upload are atomic on S3, and a mounted folder gets a temporary name, then a rename.

Credentials come from the store's own environment, never from the URL (url.py).
"""

import asyncio
import contextlib
import email.utils
import errno
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ...errors import RunError, shown
from ...files import open_regular, remove, write_atomically, write_new
from .url import PACKAGES, checked

T = TypeVar("T")

DEADLINE_S = 60.0  # for a call that moves little: a claim, a manifest, a listing
SLOWEST = 4 * 2**20  # bytes a second an upload or download is given at least, beyond DEADLINE_S
PART = 64 * 2**20  # multipart chunk: S3 allows 10,000 parts, so up to 640 GB a file
# botocore's own timeouts and retries, within the deadline around each call.
S3_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}
# Their INFO lines say where credentials were found ("Found credentials in environment variables"),
# a run's log is no place for that; what fails reaches the run as a StoreError.
QUIET = ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "azure")
# files.temporary's names: a mounted folder's copies in flight, or left by a kill.
SCRATCH = re.compile(r".+\.\d+-[0-9a-f]+\.tmp")
# S3 codes a retry may get past; any other answer (AccessDenied, NoSuchBucket) needs a person.
PASSING = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "RequestTimeTooSkewed"}


class StoreError(Exception):
    """A store call that failed, said in one line without the URL's secrets (it holds none).
    `transient`: the store did not answer, or answered that a retry may succeed. `errno`: that of
    the OSError behind it, if one was (ENOSPC: a download's write found the local disk full)."""

    def __init__(self, reason: str, transient: bool, errno: int | None = None) -> None:
        super().__init__(reason)
        self.transient, self.errno = transient, errno


class Conflict(StoreError):
    """A conditional write that lost: the object exists (If-None-Match), or changed (If-Match)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, transient=False)


@dataclass(frozen=True)
class Read:
    """An object's bytes, its ETag, and its age by the store's own clock (no machine's clock is
    compared with another's)."""

    data: bytes
    etag: str
    age_s: float


class Store:
    """The folder `url` of a store (`checked` first): objects put whole, got, listed and deleted by
    keys relative to it (`name/step_00000100.pt`), each call within a deadline."""

    def __init__(self, url: str, deadline_s: float = DEADLINE_S) -> None:
        url = checked(url).rstrip("/")
        self.url, self.deadline_s = shown(url), deadline_s  # checked: no secret in it
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        self.folder: Path | None = None
        if scheme in ("", "file") or len(scheme) == 1:
            self.folder = Path(parts.path if scheme == "file" else url).expanduser().absolute()
            self.conditional = False
            return
        self.fs = _filesystem(scheme, url)
        self.root = self.fs._strip_protocol(url).rstrip("/")
        # The claim's conditional writes (If-None-Match, If-Match) are S3's, known to work there.
        self.conditional = scheme == "s3"

    def at(self, key: str) -> str:
        """Where `key` is, as a message says it."""
        return f"{self.url}/{key}"

    def put_file(self, local: Path, key: str) -> None:
        """The file `local` as the object `key`, whole or not at all."""
        size = local.stat().st_size
        if self.folder is not None:
            target = self.folder / key

            def copy() -> None:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open_regular(local) as source:
                    write_atomically(target, lambda file: shutil.copyfileobj(source, file, PART), durable=True)

            return self._locally(copy, self._bound(size), key)
        self._call("_put_file", str(local), self._path(key), chunksize=PART, timeout=self._bound(size), key=key)

    def put_bytes(
        self, key: str, data: bytes, create: bool = False, if_match: str | None = None, within: float | None = None
    ) -> str | None:
        """`data` as the object `key`; `create`: only where there is none yet; `if_match`: only where
        it is still the version of that ETag. Either condition that fails raises Conflict. Returns
        the new version's ETag, where the store says one (S3). `within`: a deadline of its own."""
        if self.folder is not None:
            if if_match is not None:
                raise StoreError("a mounted folder takes no conditional writes", transient=False)
            target = self.folder / key

            def write() -> None:
                target.parent.mkdir(parents=True, exist_ok=True)
                if create:
                    try:
                        write_new(target, lambda path: path.write_bytes(data))
                    except FileExistsError:
                        raise Conflict(f"{self.at(key)} exists") from None
                else:
                    write_atomically(target, lambda file: file.write(data), durable=True)

            return self._locally(write, within or self.deadline_s, key)
        if not (create or if_match):
            self._call("_pipe_file", self._path(key), data, key=key, timeout=within)
            return None
        bucket, name, _ = self.fs.split_path(self._path(key))
        condition = {"IfNoneMatch": "*"} if create else {"IfMatch": if_match}
        answer = self._call(
            "_call_s3", "put_object", Bucket=bucket, Key=name, Body=data, **condition, key=key, timeout=within
        )
        return answer.get("ETag")

    def copy(self, key: str, to: str, size: int) -> None:
        """The object `key` (of `size` bytes) copied to `to`, within the store (S3: server-side)."""
        if self.folder is not None:
            return self.put_file(self.folder / key, to)
        self._call("_cp_file", self._path(key), self._path(to), timeout=self._bound(size), key=key)

    def get_file(self, key: str, local: Path, size: int) -> None:
        """The object `key` (of `size` bytes, which bounds the wait) into the new file `local`."""
        if self.folder is not None:

            def copy() -> None:
                with open_regular(self.folder / key) as source, open(local, "xb") as file:
                    shutil.copyfileobj(source, file, PART)

            return self._locally(copy, self._bound(size), key)
        self._call("_get_file", self._path(key), str(local), timeout=self._bound(size), key=key)

    def get_bytes(self, key: str) -> bytes:
        """The object `key`, small (a manifest, a ranking); FileNotFoundError where there is none."""
        if self.folder is not None:
            return self._locally(lambda: (self.folder / key).read_bytes(), self.deadline_s, key)
        return self._call("_cat_file", self._path(key), key=key)

    def read(self, key: str) -> Read:
        """The object `key` with its ETag and age, in one request (S3); FileNotFoundError where there
        is none."""
        if self.folder is not None:
            raise StoreError("a mounted folder keeps no versions of its files", transient=False)
        bucket, name, _ = self.fs.split_path(self._path(key))

        async def get() -> Read:
            answer = await self.fs._call_s3("get_object", Bucket=bucket, Key=name)
            async with answer["Body"] as body:
                data = await body.read()
            now = email.utils.parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
            return Read(data, answer["ETag"], (now - answer["LastModified"]).total_seconds())

        return self._call(get, key=key)

    def list(self, prefix: str) -> dict[str, int]:
        """The objects under `prefix/`, by their keys relative to it, with their sizes; a mounted
        folder's temporary files (a copy in flight, or one a kill left) are not among them."""
        if self.folder is not None:

            def walk() -> dict[str, int]:
                top = self.folder / prefix
                found = {}
                for folder, _, names in os.walk(top):
                    for name in names:
                        path = Path(folder, name)
                        if not SCRATCH.fullmatch(name) and stat.S_ISREG((info := path.lstat()).st_mode):
                            found[path.relative_to(top).as_posix()] = info.st_size
                return found

            return self._locally(walk, self.deadline_s, prefix)
        top = self._path(prefix)
        try:
            found = self._call("_find", top, detail=True, key=prefix)
        except FileNotFoundError:
            return {}
        return {path[len(top) + 1 :]: info["size"] for path, info in found.items() if info["type"] == "file"}

    def delete(self, key: str) -> None:
        """The object `key`, gone (one that is not there already is)."""
        if self.folder is not None:
            return self._locally(lambda: remove(self.folder / key), self.deadline_s, key)
        with contextlib.suppress(FileNotFoundError):
            self._call("_rm_file", self._path(key), key=key)

    def abort_uploads(self, prefix: str, own: Callable[[str], bool]) -> int:
        """The uploads under `prefix/` that never completed, aborted; how many: S3's multipart
        uploads (a kill mid-upload leaves them, invisible, and their parts are billed), a mounted
        folder's temporary files. Only for a run that holds `prefix`, whose uploads no other machine
        makes, and only where `own(key)` (a key relative to `prefix`, a folder's ending in `/`) says
        they are its: a run named under it (`a/b` under `a`) makes uploads of its own."""
        if self.folder is not None:

            def clean() -> int:
                top, left = self.folder / prefix, []
                for folder, folders, names in os.walk(top):
                    inside = Path(folder).relative_to(top)
                    folders[:] = [name for name in folders if own(f"{(inside / name).as_posix()}/")]
                    left += [Path(folder, name) for name in names if SCRATCH.fullmatch(name)]
                for path in left:
                    remove(path)
                return len(left)

            return self._locally(clean, self.deadline_s, prefix)
        if not self.conditional:
            return 0
        bucket, name, _ = self.fs.split_path(self._path(prefix))

        async def abort() -> int:
            found = await self.fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{name}/")
            ours = [upload for upload in found.get("Uploads", []) if own(upload["Key"][len(name) + 1 :])]
            for upload in ours:
                await self.fs._call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            return len(ours)

        return self._call(abort, key=prefix)

    def tidy(self, prefix: str) -> None:
        """A mounted folder's folder `prefix`, gone if empty (an object store has no folders)."""
        if self.folder is not None:

            def remove_if_empty() -> None:
                with contextlib.suppress(OSError):  # not empty: what else is there is not this run's
                    (self.folder / prefix).rmdir()

            self._locally(remove_if_empty, self.deadline_s, prefix)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _bound(self, size: int) -> float:
        return self.deadline_s + size / SLOWEST

    def _call(self, method: str | Callable, *arguments, key: str, timeout: float | None = None, **options) -> Any:
        """`method` of the filesystem (or a coroutine function), awaited within the deadline on
        fsspec's own event loop; what it raises becomes a StoreError, or FileNotFoundError."""
        from fsspec.asyn import sync

        function = getattr(self.fs, method) if isinstance(method, str) else method
        try:
            return sync(self.fs.loop, function, *arguments, timeout=timeout or self.deadline_s, **options)
        except FileNotFoundError as error:
            if _code(error) == "NoSuchBucket":
                raise StoreError(f"{self.at(key)}: the bucket does not exist", transient=False) from None
            raise FileNotFoundError(errno.ENOENT, f"{self.at(key)} does not exist") from None
        except Exception as error:  # noqa: BLE001 - every failure of a store's call is said as one
            raise _failure(error, self.at(key), timeout or self.deadline_s) from None

    def _locally(self, work: Callable[[], T], timeout: float, key: str) -> T:
        """`work` on a mounted folder, within `timeout`: a thread of its own, left behind (a daemon,
        so that no exit waits for it) where the folder stops answering, as an NFS server's does."""
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                box["value"] = work()
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = error
            finally:
                done.set()

        threading.Thread(target=run, name="checkpoint-remote-call", daemon=True).start()
        if not done.wait(timeout):
            raise StoreError(f"{self.at(key)}: no answer within {timeout:.0f} s", transient=True)
        if "error" not in box:
            return box["value"]
        error = box["error"]
        if isinstance(error, StoreError | FileNotFoundError):
            raise error
        if isinstance(error, OSError):
            raise StoreError(f"{self.at(key)}: {error.strerror or error}", transient=True, errno=error.errno) from None
        raise error


def _filesystem(scheme: str, url: str):
    """The fsspec filesystem of `scheme`, fresh (no cached instance, no cached listing: a listing a
    minute old hides another machine's claim), or a RunError that says what to install."""
    import fsspec

    for library in QUIET:
        logging.getLogger(library).setLevel(logging.WARNING)
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if scheme == "s3":
        options["config_kwargs"] = S3_CONFIG
    try:
        fs = fsspec.filesystem(scheme, **options)
    except ImportError:
        raise RunError(
            f"checkpoint.remote={shown(url)} needs the package {PACKAGES[scheme]}: pip install "
            f"{PACKAGES[scheme]}" + (" (or the project's extra: pip install -e '.[remote]')" if scheme == "s3" else "")
        ) from None
    if scheme == "s3":
        fs.retries = 2  # s3fs's own retries, on top of botocore's: within the deadline, not beyond
    return fs


def _code(error: BaseException) -> str | None:
    """The store's error code (S3's `AccessDenied`) behind `error`, if it carries one."""
    seen: BaseException | None = error
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            return response["Error"].get("Code")
        seen = seen.__cause__ or seen.__context__
    return None


def _failure(error: Exception, where: str, timeout: float) -> StoreError:
    """`error`, from a store's call on `where`, as a StoreError: transient where a retry may get
    past it (no answer, a connection refused, a 5xx, a conflict of two conditional writes)."""
    from fsspec.exceptions import FSTimeoutError

    if isinstance(error, FSTimeoutError | asyncio.TimeoutError | TimeoutError):
        return StoreError(f"{where}: no answer within {timeout:.0f} s", transient=True)
    code = _code(error)
    if isinstance(error, FileExistsError) or code in ("PreconditionFailed", "412"):
        return Conflict(f"{where} was changed by another writer ({code or 'it exists'})")
    if code == "ConditionalRequestConflict":  # two conditional writes at once: read it again
        return Conflict(f"{where} is being written by another writer ({code})")
    if code is not None:
        return StoreError(f"{where}: {code}", transient=code in PASSING or code.startswith("5"))
    if isinstance(error, PermissionError):
        return StoreError(f"{where}: access denied", transient=False)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # botocore's NoCredentialsError, PartialCredentialsError: a person must give them
    return StoreError(
        f"{where}: {type(error).__name__}: {reason}",
        transient="Credentials" not in type(error).__name__,
        errno=error.errno if isinstance(error, OSError) else None,
    )

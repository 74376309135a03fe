"""torch.compile's work kept in the run's home, `compile-cache.bin`: a leg restarted on another machine
(a SLURM requeue), whose Inductor cache is empty, loads the graphs the legs before it compiled instead
of compiling them again. `load` runs before the model is compiled; `save`, after each checkpoint lands.

What torch loads from it is pickled code, and a home can be a folder from anywhere (a copied run's,
continued with resume=last), where a checksum anyone can recompute proves nothing. So the file is
signed (HMAC-SHA256) with this user's own key, ~/.cache/{{cookiecutter.package}}/compile-cache.key: only a file this
user's runs wrote loads, never through a link, and only on the torch, Python and device that wrote
it. The key is used only where it is a file of this user's own that no one else can read or write:
a key others could read, or a link to one, would sign a planted cache. Anything else costs one line
and a compile from scratch: the cache never stops a run.
"""

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import platform
import secrets
import stat
import sys
from pathlib import Path

import torch

from .errors import shown
from .files import kind, temporary, write_atomically
from .lifecycle.goodput import compile_seconds

log = logging.getLogger(__name__)

NAME = "compile-cache.bin"
MAGIC = b"{{cookiecutter.package}} compile cache 1\n"  # then `here`'s line, torch's payload, and the HMAC of all before
MOST = 512 * 2**20  # bytes: far more than a model's graphs take, a bound on what a planted file makes a run read
_looked = -1  # the graphs compiled or found in a cache in this process when `save` last looked: -1, never since `load`
_held: set[str] = set()  # the graphs (Inductor's keys) the home's cache holds, as loaded or last written
_loaded: set[str] = set()  # the graphs the home's cache put in Inductor's cache in this process
_key_said = ""  # what is wrong with the key, once said: a leg says it once, not at its load and every save


class Elsewhere(ValueError):
    """A cache of another torch, Python or device: what a resume on another device finds, which is no fault."""


class KeyUnfit(ValueError):
    """The key cannot be made or read, or is not fit to sign with: said once a leg, at its load or first save."""


def key_path() -> Path:
    """In the user's home, not XDG_CACHE_HOME: a requeue lands on another machine, which must find the same key."""
    return Path.home() / ".cache" / "{{cookiecutter.package}}" / "compile-cache.key"


def load(home: Path, device: torch.device) -> None:
    """`home`'s compile cache into torch's caches, if this user's runs wrote it on this torch, Python and device."""
    global _looked, _key_said
    _looked, _key_said, path = -1, "", home / NAME  # the next save writes the cache unless it holds every graph then
    _held.clear()
    _loaded.clear()
    try:
        payload = _opened(_read(path), device)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as error:
        problem = f"cannot be read ({error.strerror or error})" if isinstance(error, OSError) else error
        if _first(error):
            say = log.info if isinstance(error, Elsewhere) else log.warning
            say(f"compile cache {path} {problem}: compiling afresh")
        return
    torchs = _TorchSays()  # torch logs a payload it cannot read as a 10-line traceback; this run says one line
    logging.getLogger("torch.compiler._cache").addFilter(torchs)
    try:
        loaded = torch.compiler.load_cache_artifacts(payload)
    except Exception as error:  # torch's own format, of another build: compiling is the way on
        loaded, torchs.said = None, f"{type(error).__name__}: {error}"
    finally:
        logging.getLogger("torch.compiler._cache").removeFilter(torchs)
    if loaded is None:
        said = shown(torchs.said.strip().splitlines()[0] if torchs.said.strip() else "torch read nothing from it")
        log.warning(f"compile cache {path} could not be loaded ({said}): compiling afresh")
        return
    _held.update(loaded.inductor_artifacts)
    _loaded.update(loaded.inductor_artifacts)


class _TorchSays(logging.Filter):
    """What torch's cache module says while it loads a cache, kept in one line instead of printed."""

    def __init__(self) -> None:
        super().__init__()
        self.said = ""

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        because = f": {type(failure).__name__}: {failure}" if failure else ""
        self.said = self.said or record.getMessage() + because
        return record.levelno < logging.WARNING


def save(home: Path, device: torch.device, main: bool) -> None:
    """On rank 0 (`main`), where this process used graphs that `home`'s compile cache does not hold
    (compiled afresh, or found in Inductor's cache on this machine, as after a cache refused), all of
    them into that cache, replaced whole. Looked at once after `load`, then when a graph was compiled
    or found since: otherwise a comparison of two numbers. A failure costs one warning, and the
    graphs wait for the next write."""
    global _looked
    used = sum(compiled().values())
    if not main or used == _looked:
        return
    _looked, path = used, home / NAME
    try:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None or set(artifacts[1].inductor_artifacts) <= _held:  # nothing the home's cache lacks
            return
        body = MAGIC + here(device).encode() + b"\n" + artifacts[0]
        signature = hmac.new(_key(), body, hashlib.sha256).digest()
        write_atomically(path, lambda file: file.write(body + signature), durable=False)
        _held.update(artifacts[1].inductor_artifacts)
    except Exception as error:  # a full disk, the key, or torch's serializer: the run goes on
        reason = getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"
        problem = error if isinstance(error, ValueError) else f"could not be written ({reason})"
        if _first(error):
            log.warning(f"compile cache {path} {problem}: a restart compiles afresh")


def compiled() -> dict[str, int]:
    """The graphs Inductor compiled afresh in this process, and those it took from a cache (home's, machine's)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    inductor = dynamo.counters["inductor"] if dynamo else {}
    return {"compiled": inductor.get("fxgraph_cache_miss", 0), "cached": inductor.get("fxgraph_cache_hit", 0)}


def said() -> str:
    """The leg's one line on torch.compile: the graphs compiled, those the home's compile cache gave,
    and those Inductor found in its own cache on this machine (a cache refused, or of other graphs)."""
    fresh, cached = compiled().values()
    used: set[str] = set()
    if _loaded and (artifacts := torch.compiler.save_cache_artifacts()) is not None:
        used = set(artifacts[1].inductor_artifacts)
    ours = min(len(_loaded & used), cached)
    elsewhere = f", {cached - ours} from Inductor's cache on this machine" if cached > ours else ""
    took = f"{compile_seconds():.1f} s"
    return f"torch.compile: {fresh} graphs compiled, {ours} from the compile cache{elsewhere} ({took})"


def here(device: torch.device) -> str:
    """What a cache must have been written on to load: the same torch, Python (its bytecode) and device."""
    name = getattr(torch, device.type).get_device_name(device) if device.type in ("cuda", "xpu") else platform.machine()
    return f"torch {torch.__version__}, Python {sys.version_info[0]}.{sys.version_info[1]} on {device.type} ({name})"


def _read(path: Path) -> bytes:
    """The bytes of `path`, a regular file of at most MOST bytes, never read through a link; else a ValueError."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ValueError("is a symbolic link") if error.errno == errno.ELOOP else error from None
    with os.fdopen(descriptor, "rb") as file:
        found = os.fstat(file.fileno())
        if not (regular := stat.S_ISREG(found.st_mode)) or found.st_size > MOST:
            raise ValueError(f"is over {MOST >> 20} MiB" if regular else f"is {kind(found.st_mode)}")
        return file.read(MOST + 1)


def _opened(found: bytes, device: torch.device) -> bytes:
    """The payload of `found`, or a ValueError saying what is wrong with it: its signature is checked
    first, so that a header is read only from a file this user's runs wrote."""
    if len(found) < len(MAGIC) + 32 or not found.startswith(MAGIC):
        raise ValueError("is not a compile cache this project wrote")
    if not hmac.compare_digest(found[-32:], hmac.new(_key(), found[:-32], hashlib.sha256).digest()):
        raise ValueError(f"is damaged, or was not written by this user's runs (its signature is not {key_path()}'s)")
    written, _, payload = found[len(MAGIC) : -32].partition(b"\n")
    if (written := written.decode(errors="replace")) != (running := here(device)):
        raise Elsewhere(f"was written by {shown(written)}; this run is {running}")
    return payload


def _key() -> bytes:
    """This user's key, made at its first use. A ValueError where it cannot be made or read, or where
    it is no file of this user's own that no one else can read or write."""
    path = key_path()
    try:
        _make_key(path)
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            key = b"" if (unfit := _unfit(os.fstat(file.fileno()))) else file.read(33)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise KeyUnfit(f"needs the key {path}, which cannot be made or read ({error.strerror or error})") from None
        unfit = "a symbolic link"
    if unfit:
        raise KeyUnfit(f"refuses the key {path}, which is {unfit}: delete it (rm {path}), and a new one is made")
    if len(key) != 32:
        raise KeyUnfit(
            f"needs the key {path}, which cannot be made or read (it holds {len(key)} bytes, not a key: delete it, "
            f"and a new one is made)"
        )
    return key


def _first(error: Exception) -> bool:
    """Whether `error` is to be said: what is wrong with the key, once a leg, not at its load and every save."""
    global _key_said
    if not isinstance(error, KeyUnfit):
        return True
    first, _key_said = str(error) != _key_said, str(error)
    return first


def _make_key(path: Path) -> None:
    """The key at `path` where there is none: written beside it and linked into place, so that a run
    starting meanwhile never reads half a key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        return
    scratch = temporary(path)
    try:
        with os.fdopen(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as file:
            file.write(secrets.token_bytes(32))
        with contextlib.suppress(FileExistsError):  # another run made it first: its key is the one
            os.link(scratch, path)
    finally:
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)


def _unfit(found: os.stat_result) -> str:
    """What makes a key of `found` (its stat) unfit to sign with, or "" where it is fit: a key others
    can read would let them sign a cache this user's runs then load."""
    if not stat.S_ISREG(found.st_mode):
        return kind(found.st_mode)
    if found.st_uid != os.getuid():
        return f"another user's (uid {found.st_uid})"
    if stat.S_IMODE(found.st_mode) & 0o077:
        return f"open to others (mode {stat.S_IMODE(found.st_mode):04o}, not 0600)"
    return ""

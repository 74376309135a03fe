"""torch.compile's work kept in the run's home, `compile-cache.bin`: a leg restarted on another machine
(a SLURM requeue), whose Inductor cache is empty, loads the graphs the legs before it compiled instead
of compiling them again. `load` runs before the model is compiled; `save`, after each checkpoint lands.

What torch loads from it is pickled code, and a home can be a folder from anywhere (a copied run's,
continued with resume=last), where a checksum anyone can recompute proves nothing. So the file is
signed (HMAC-SHA256) with this user's own key, ~/.cache/{{cookiecutter.package}}/compile-cache.key: only a file this
user's runs wrote loads, never through a link, and only on the torch, Python and device that wrote
it. Anything else costs one line and a compile from scratch: the cache never stops a run.
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

from .checkpoint.files import kind, temporary, write_atomically
from .errors import shown
from .goodput import compile_seconds

log = logging.getLogger(__name__)

NAME = "compile-cache.bin"
MAGIC = b"{{cookiecutter.package}} compile cache 1\n"  # then `here`'s line, torch's payload, and the HMAC of all before
MOST = 512 * 2**20  # bytes: far more than a model's graphs take, a bound on what a planted file makes a run read
_written = 0  # the graphs compiled afresh in this process when the home's cache was last written


class Elsewhere(ValueError):
    """A cache of another torch, Python or device: what a resume on another device finds, which is no fault."""


def key_path() -> Path:
    """In the user's home, not XDG_CACHE_HOME: a requeue lands on another machine, which must find the same key."""
    return Path.home() / ".cache" / "{{cookiecutter.package}}" / "compile-cache.key"


def load(home: Path, device: torch.device) -> None:
    """`home`'s compile cache into torch's caches, if this user's runs wrote it on this torch, Python and device."""
    path = home / NAME
    try:
        payload = _opened(_read(path), device)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as error:
        problem = f"cannot be read ({error.strerror or error})" if isinstance(error, OSError) else error
        (log.info if isinstance(error, Elsewhere) else log.warning)(f"compile cache {path} {problem}: compiling afresh")
        return
    try:
        torch.compiler.load_cache_artifacts(payload)
    except Exception as error:  # torch's own format, of another build: compiling is the way on
        log.warning(f"compile cache {path} could not be loaded ({type(error).__name__}: {error}): compiling afresh")


def save(home: Path, device: torch.device, main: bool) -> None:
    """On rank 0 (`main`), when graphs were compiled afresh since the last write, all of this process's
    into `home`'s compile cache, replaced whole; otherwise a comparison of two numbers. A failure costs
    one warning, and the graphs wait for the next write."""
    global _written
    fresh = compiled()["compiled"]
    if not main or fresh == _written:
        return
    _written, path = fresh, home / NAME
    try:
        key = _key()
        if (artifacts := torch.compiler.save_cache_artifacts()) is not None:
            body = MAGIC + here(device).encode() + b"\n" + artifacts[0]
            signature = hmac.new(key, body, hashlib.sha256).digest()
            write_atomically(path, lambda file: file.write(body + signature), durable=False)
    except Exception as error:  # a full disk, the key, or torch's serializer: the run goes on
        reason = getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"
        problem = error if isinstance(error, ValueError) else f"could not be written ({reason})"
        log.warning(f"compile cache {path} {problem}: a restart compiles afresh")


def compiled() -> dict[str, int]:
    """The graphs Inductor compiled afresh in this process, and those it took from a cache (home's, machine's)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    inductor = dynamo.counters["inductor"] if dynamo else {}
    return {"compiled": inductor.get("fxgraph_cache_miss", 0), "cached": inductor.get("fxgraph_cache_hit", 0)}


def said() -> str:
    """The leg's one line on torch.compile."""
    fresh, cached = compiled().values()
    return f"torch.compile: {fresh} graphs compiled, {cached} from the compile cache ({compile_seconds():.1f} s)"


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
    """This user's key, made at its first use: written beside its path and linked into place, so that a
    run starting meanwhile never reads half a key. A ValueError where it cannot be made or read."""
    path = key_path()
    scratch = temporary(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.path.lexists(path):
            with os.fdopen(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as file:
                file.write(secrets.token_bytes(32))
            with contextlib.suppress(FileExistsError):  # another run made it first: its key is the one
                os.link(scratch, path)
        if len(key := path.read_bytes()) == 32:
            return key
        raise OSError(errno.EINVAL, f"it holds {len(key)} bytes, not a key: delete it, and a new one is made")
    except OSError as error:
        raise ValueError(f"needs the key {path}, which cannot be made or read ({error.strerror or error})") from None
    finally:
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)

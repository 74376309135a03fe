"""What a run ran from: the git commit of the folder it started in (the project's), whether the
project's files had uncommitted changes and what they were, the template commit that made the
project (its `.cruft.json`), and the installed packages.

The diff goes to the tracking store, where others may read it: an untracked file is named there,
its content copied only when mlflow.untracked_content asks for it, and only a source, config or
text file's of the types COPIED, never a hidden one's (`.netrc`, `.aws/config`), one named like a
secret's, nor one outside the project's folder (a larger repository's `.aws/`). What looks like a
credential in any file's changes, a tracked README's too, is masked (masking.py), and said in the diff.

The MLflow sender process finds these (mlflow_store.record_origin) after it has answered the run's
id, so none of it is paid before step 1; nothing here imports torch or MLflow.
"""

import json
import logging
import os
import stat
import subprocess
from fnmatch import fnmatchcase
from importlib import metadata
from pathlib import Path, PurePosixPath

from ..errors import listed, shown
from ..files import read_regular
from .masking import MASK, mask

log = logging.getLogger(__name__)

GIT_SECONDS = 30  # a git that hangs (a slow network filesystem) costs the sender this, never the run
UNTRACKED_BYTES = 1 << 20  # a larger untracked file is taken for data, not source: named, not copied
UNKNOWN = "unknown"  # template.version of a project made without a template commit to name; git.dirty git cannot tell
# The types of untracked file whose content mlflow.untracked_content copies: a project's Python, its
# configs and its notes, where a credential would be a slip (and is masked). Left out are the forms
# credential files take: INI and .cfg (.pypirc, boto, .s3cfg), JSON (cloud service accounts, Docker's
# config.json), shell (exports of tokens), keys and certificates (.pem, .p12), and files without a type
# (.netrc, kubeconfig, id_rsa). C++ and CUDA sources are a project's own kernels.
COPIED = (".py", ".pyi", ".yaml", ".yml", ".toml", ".md", ".rst", ".txt", ".c", ".cpp", ".h", ".cu")
# A file of those types is named and not copied where its name, or that of a folder on its way,
# matches one of these (in any case), or begins with a dot: where tools keep state and credentials.
SECRET_NAMES = ("*credential*", "*secret*", "*token*", "*passw*", "*apikey*", "*_key*", "*-key*")
NAMED_ONLY = (
    "# Untracked files, named only: their content is copied only with mlflow.untracked_content=true, and only "
    f"that of a file of its own of at most {UNTRACKED_BYTES >> 20} MiB, of a type among {' '.join(COPIED)}, "
    "neither hidden nor named like a secret\n"
)


class GitFailed(Exception):
    """git did not answer: missing, hung, or failed (a corrupt index); what it said, in one line."""


def origin(folder: Path, untracked_content: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The tags and the files (text by name, the artifacts under `provenance/`) that say what a run
    started in `folder` ran from. Outside a git checkout, or in one without a commit, the git tags
    and the diff are left out, as MLflow leaves out `mlflow.source.git.commit`. A checkout git
    cannot read (a corrupt index, git missing) costs a warning and is tagged git.dirty=unknown:
    a failure is never recorded as a clean tree."""
    tags = {"template.version": template_version(folder)}
    files = {"requirements.txt": requirements()}
    try:
        if not (commit := _git(folder, "rev-parse", "--verify", "--quiet", "HEAD", ok=(1,)).strip()):
            return tags, files  # a checkout without a commit yet: none to name
        tags["mlflow.source.git.commit"] = commit
        diff, large = uncommitted(folder, untracked_content)
    except GitFailed as failure:
        checkout = "mlflow.source.git.commit" in tags or any((up / ".git").exists() for up in (folder, *folder.parents))
        if not checkout:
            return tags, files  # nothing of git's to record
        log.warning(
            f"git failed in {folder} ({failure}): the run is tagged git.dirty={UNKNOWN}, and its provenance/git.diff "
            f"is left out"
        )
        tags["git.dirty"] = UNKNOWN
        return tags, files
    if diff:
        files["git.diff"] = diff
    if large:
        log.warning(
            f"provenance/git.diff names but leaves out the untracked files over {UNTRACKED_BYTES >> 20} MiB, taken for "
            f"data: {', '.join(map(shown, large))} (add them to .gitignore, or commit them)"
        )
    tags["git.dirty"] = str(bool(diff)).lower()
    return tags, files


def template_version(folder: Path) -> str:
    """The template commit that made the project: `commit` of its `.cruft.json` (cruft's file,
    written by the template when it bakes the project, and updated by `cruft update`)."""
    try:
        commit = json.loads(read_regular(folder / ".cruft.json")).get("commit")
    except (OSError, ValueError, AttributeError):  # absent, unreadable, or not cruft's
        return UNKNOWN
    return commit if isinstance(commit, str) and commit else UNKNOWN


def uncommitted(folder: Path, with_content: bool) -> tuple[str, list[str]]:
    """The changes to the files under `folder` against HEAD, as a diff `git apply` takes at the top
    of the checkout: tracked files, staged or not, then each untracked file that git does not
    ignore, named in a header that `git apply` skips, or (`with_content`) as a new file where it is
    `copied`, a file of its own, of at most UNTRACKED_BYTES; what looks like a credential, masked and
    said in a header; and the untracked files left out for their size. Nothing outside `folder`: in a
    larger repository, the rest is not the project's."""
    top, prefix = _git(folder, "rev-parse", "--show-toplevel", "--show-prefix").split("\n")[:2]
    diff = _git(folder, "diff", "HEAD", "--no-color", "--no-ext-diff", "--", ".")
    untracked = _git(folder, "ls-files", "--others", "--exclude-standard", "--full-name", "-z", "--", ".")
    named, large = [], []
    for name in filter(None, untracked.split("\0")):
        size = _own_size(Path(top) / name) if with_content and copied(name.removeprefix(prefix)) else None
        if size is not None and size > UNTRACKED_BYTES:
            large.append(name)
        if size is None or size > UNTRACKED_BYTES:
            named.append(name)
            continue
        # git's own form for a new file; it exits 1 when the two differ, as they do.
        diff += _git(Path(top), "diff", "--no-index", "--no-color", "--no-ext-diff", "--", "/dev/null", name, ok=(1,))
    diff, masked = mask(diff)
    if masked:
        places = listed([f"{shown(name)} ({lines} line{'s' * (lines > 1)})" for name, lines in masked.items()])
        log.warning(
            f"provenance/git.diff masks what looks like a credential in {places}: keep it out of the project's "
            f"files (in an environment variable, or a file that git ignores)"
        )
        what = "a private key, a cloud key, a token, a password"
        diff = (
            f"# Masked as {MASK}, what looks like a credential ({what}) in {places}: there, this diff does not apply\n"
            + diff
        )
    if named:
        diff = NAMED_ONLY + "".join(f"#   {shown(name)}\n" for name in named) + diff
    return diff, large


def copied(name: str) -> bool:
    """Whether the content of the untracked file `name` (a path under the project's folder) may be
    copied: of a type COPIED, and neither it nor a folder on its way hidden or named like a secret."""
    path = PurePosixPath(name)
    return path.suffix.lower() in COPIED and not any(
        part.startswith(".") or fnmatchcase(part.lower(), pattern) for part in path.parts for pattern in SECRET_NAMES
    )


def _own_size(path: Path) -> int | None:
    """The size of `path` if it is a regular file of one name; None for a link (it may lead out of
    the project: `notes.txt -> ~/.aws/credentials`), a hard link, or a file gone since."""
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) and found.st_nlink == 1 else None


def requirements() -> str:
    """The installed distributions as `name==version` lines, what `pip install -r` takes; of a
    name installed twice, the one Python imports (the first on sys.path)."""
    found: dict[str, str] = {}
    for distribution in metadata.distributions():
        fields = _head(distribution)
        if name := fields.get("Name"):
            found.setdefault(name, fields.get("Version", ""))
    return "".join(f"{name}=={version}\n" for name, version in sorted(found.items(), key=lambda item: item[0].lower()))


def _head(distribution: metadata.Distribution) -> dict[str, str]:
    """The fields of a distribution's metadata before its body, each as first given. The body (the
    long description, most of the file) is never parsed: `Distribution.metadata` parses it whole,
    which over an environment's hundreds of packages cost each run's sender a fifth of a second."""
    text = distribution.read_text("METADATA") or distribution.read_text("PKG-INFO") or ""
    fields: dict[str, str] = {}
    for line in text.partition("\n\n")[0].splitlines():
        key, colon, value = line.partition(":")
        if colon and not key[:1].isspace():
            fields.setdefault(key, value.strip())
    return fields


def _git(folder: Path, *arguments: str, ok: tuple[int, ...] = ()) -> str:
    """git's output in `folder`; GitFailed where git is missing, hangs, or fails (not a checkout, a
    corrupt index), saying why."""
    try:
        command = ["git", "-C", str(folder), *arguments]
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=GIT_SECONDS)
    except FileNotFoundError:
        raise GitFailed("git is not installed") from None
    except OSError as error:
        raise GitFailed(f"git does not start: {error.strerror or error}") from None
    except subprocess.TimeoutExpired:
        raise GitFailed(f"git {arguments[0]} took over {GIT_SECONDS} s") from None
    if done.returncode not in (0, *ok):
        said = done.stderr.strip().splitlines()
        raise GitFailed(shown(said[0]) if said else f"git {arguments[0]} exited with {done.returncode}")
    return done.stdout

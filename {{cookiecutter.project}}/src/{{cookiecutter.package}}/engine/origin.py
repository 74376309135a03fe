"""What a run ran from: the git commit of the folder it started in, whether that tree had
uncommitted changes and what they were, the template commit that made the project (its
`.cruft.json`), and the installed packages.

The MLflow sender process finds these (mlflow_store.record_origin) after it has answered the run's
id, so none of it is paid before step 1; nothing here imports torch or MLflow.
"""

import json
import logging
import subprocess
from importlib import metadata
from pathlib import Path

from .checkpoint.files import read_regular

log = logging.getLogger(__name__)

GIT_SECONDS = 30  # a git that hangs (a slow network filesystem) costs the sender this, never the run
UNTRACKED_BYTES = 1 << 20  # a larger untracked file is taken for data, not source: named, not copied
UNKNOWN = "unknown"  # template.version of a project made without a template commit to name


def origin(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The tags and the files (text by name, the artifacts under `provenance/`) that say what a run
    started in `folder` ran from. Outside a git checkout, or without git, the git tags and the
    diff are left out, as MLflow leaves out `mlflow.source.git.commit`."""
    tags = {"template.version": template_version(folder)}
    files = {"requirements.txt": requirements()}
    if (found := _git(folder, "rev-parse", "--show-toplevel", "HEAD")) is not None:
        top, commit = found.split("\n")[:2]
        tags["mlflow.source.git.commit"] = commit
        diff, large = uncommitted(Path(top))
        if diff:
            files["git.diff"] = diff
        if large:
            log.warning(
                f"provenance/git.diff leaves out the untracked files over {UNTRACKED_BYTES >> 20} MiB, taken for "
                f"data: {', '.join(large)} (add them to .gitignore, or commit them)"
            )
        tags["git.dirty"] = str(bool(diff or large)).lower()
    return tags, files


def template_version(folder: Path) -> str:
    """The template commit that made the project: `commit` of its `.cruft.json` (cruft's file,
    written by the template when it bakes the project, and updated by `cruft update`)."""
    try:
        commit = json.loads(read_regular(folder / ".cruft.json")).get("commit")
    except (OSError, ValueError, AttributeError):  # absent, unreadable, or not cruft's
        return UNKNOWN
    return commit if isinstance(commit, str) and commit else UNKNOWN


def uncommitted(top: Path) -> tuple[str, list[str]]:
    """The changes of the checkout at `top` against its HEAD, as a diff `git apply` takes: tracked
    files, staged or not, then each untracked file that git does not ignore, as a new file; and
    the untracked files left out of it for their size."""
    diff = _git(top, "diff", "HEAD", "--no-color", "--no-ext-diff") or ""
    untracked = (_git(top, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
    large = []
    for name in filter(None, untracked):
        path = top / name
        if not path.is_file():  # a link, or gone since
            continue
        if path.stat().st_size > UNTRACKED_BYTES:
            large.append(name)
            continue
        # git's own form for a new file; it exits 1 when the two differ, as they do.
        diff += _git(top, "diff", "--no-index", "--no-color", "--no-ext-diff", "--", "/dev/null", name, ok=(1,)) or ""
    return diff, large


def requirements() -> str:
    """The installed distributions as `name==version` lines, what `pip install -r` takes; of a
    name installed twice, the one Python imports (the first on sys.path)."""
    found: dict[str, str] = {}
    for distribution in metadata.distributions():
        if name := distribution.metadata["Name"]:
            found.setdefault(name, distribution.version)
    return "".join(f"{name}=={version}\n" for name, version in sorted(found.items(), key=lambda item: item[0].lower()))


def _git(folder: Path, *arguments: str, ok: tuple[int, ...] = ()) -> str | None:
    """git's output in `folder`; None where git is missing, hangs, or fails (not a checkout, no commit)."""
    try:
        command = ["git", "-C", str(folder), *arguments]
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=GIT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode in (0, *ok) else None

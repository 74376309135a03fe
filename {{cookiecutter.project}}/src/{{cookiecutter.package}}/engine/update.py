"""The two steps around `cruft update` in the update line of docs/updating.md, each of which stops in
one line where cruft would go wrong without a word:

    python -m {{cookiecutter.package}}.engine.update before && cruft update -y && python -m {{cookiecutter.package}}.engine.update after

`before`: cruft renders the template under the package name of `.cruft.json`'s answers and patches
the files at those paths, leaving out those its `skip` lists; a renamed package gets no fix of the
engine (nothing there to patch, no `.rej`, and "Good work!"), and a file of yours left off the list
gets the template's changes merged into it. `after`: stops at what the merge left to do by hand, then
moves a `configs/` of the one-root layout (every group, option and setting in one folder of yours,
which no update could reach) to the two roots: the engine's `engine/configs/`, which updates bring,
and yours, which keeps only what differs from it.

The bake's hook reads `yours` too, so this module imports nothing outside the standard library and
PyYAML, which cookiecutter brings.
"""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from .errors import RunError, listed, reported, shown

PACKAGE = __name__.partition(".")[0]
# The modules of yours that name your own components; the ready ones they import are the engine's.
COMPONENTS = ("models", "datasets", "tasks", "metrics", "callbacks", "schedulers")
# Where a project keeps the template's answers, and the key of the engine's configs that the one-root
# layout's config.yaml replaces.
STATE = ".cruft.json"
SCHEMA = "config_schema"
HEADER = """\
# Your choices, over the engine's defaults (src/{package}/engine/configs/, which `cruft update` keeps
# current): what this file and this folder give wins (docs/configuration.md). Written by
# `python -m {package}.engine.update after` from the earlier config.yaml, less what the engine's gives alike.
"""


def yours(package: str) -> list[str]:
    """The files the README calls yours, as `.cruft.json`'s `skip` names them: `cruft update` leaves
    them out of the two renders it compares, so it never writes them."""
    return [*(f"src/{package}/{name}.py" for name in COMPONENTS), "configs"]


def before(project: Path) -> None:
    """Refuses an update that would skip the engine's fixes or merge into your files."""
    state = recorded(project)
    package = state["context"]["cookiecutter"]["package"]
    if not (project / "src" / package / "engine").is_dir():
        found = sorted(path.parent.name for path in (project / "src").glob("*/engine"))
        own = found[0] if len(found) == 1 else "<your package>"
        raise RunError(
            f"the template's engine is src/{shown(package)}/engine/ ({STATE}'s answer package), which this "
            f"project does not have (its own: src/{shown(own)}/engine/): cruft update would patch none of the "
            f'engine\'s files and say nothing; set "package": "{shown(own)}" in {STATE}, commit, then run this again'
        )
    skipped = state.get("skip") or []
    if missing := [path for path in yours(package) if path not in skipped]:
        wanted = json.dumps([*skipped, *missing])
        raise RunError(
            f"{STATE}'s skip leaves out {listed(missing, most=3)}, which are yours: cruft update would merge the "
            f'template\'s versions into them; set "skip": {wanted} in {STATE} (docs/updating.md), commit, '
            f"then run this again"
        )


def after(project: Path) -> None:
    """Stops at a merge left to finish by hand; then moves a one-root `configs/` to the two roots."""
    unmerged = git(project, "diff", "--name-only", "--diff-filter=U").split()
    rejected = [str(path.relative_to(project)) for path in project.rglob("*.rej") if ".git" not in path.parts]
    if unmerged or rejected:
        raise RunError(
            f"the update left {listed(unmerged + rejected)} to merge by hand (<<<<<<< in a file, or a .rej "
            f"beside it): edit them, git add, then run this again"
        )
    package = recorded(project)["context"]["cookiecutter"]["package"]
    engine = project / "src" / package / "engine" / "configs"
    searched = f"pkg://{package}.engine.configs"
    config = project / "configs" / "config.yaml"
    choices = read(config)
    if searched in ((choices.get("hydra") or {}).get("searchpath") or []):
        return
    removed, kept = moved(project / "configs", engine)
    settings = differences({k: v for k, v in choices.items() if k != "defaults"}, read(engine / "engine.yaml"))
    settings.setdefault("hydra", {}).setdefault("searchpath", []).append(searched)
    defaults = [entry for entry in choices.get("defaults", []) if entry != SCHEMA]
    text = yaml.safe_dump({"defaults": ["engine", *defaults], **settings}, sort_keys=False)
    config.write_text(HEADER.format(package=package) + text, encoding="utf-8")
    print(
        f"configs/ now holds your choices over the engine's src/{package}/engine/configs/: removed {removed} "
        f"files that were the engine's alike; kept {listed(kept) or 'none'}, which win over the engine's; "
        f"config.yaml keeps {listed(keys(settings)) or 'no setting'} (the earlier one: git show HEAD:configs/config.yaml)"
    )


def moved(configs: Path, engine: Path) -> tuple[int, list[str]]:
    """Removes from `configs/` each file the engine's configs hold alike; returns how many, and the
    paths of the files kept: your experiments, your own options, and files that differ from the
    engine's (your edits, or defaults of the template of your bake: yours now, as they were)."""
    removed, kept = 0, []
    for path in sorted(configs.rglob("*")):
        relative = path.relative_to(configs)
        if not path.is_file() or relative.parts[0] == "experiment" or relative == Path("config.yaml"):
            continue
        theirs = engine / relative
        if theirs.is_file() and theirs.read_bytes() == path.read_bytes():
            path.unlink()
            removed += 1
        else:
            kept.append(f"configs/{relative.as_posix()}")
    for folder in sorted((path for path in configs.rglob("*") if path.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    return removed, kept


def differences(mine: dict, theirs: dict) -> dict:
    """What of `mine` the engine's `theirs` does not give alike, key by key at any depth."""
    found = {}
    for key, value in mine.items():
        if isinstance(value, dict) and isinstance(theirs.get(key), dict):
            if nested := differences(value, theirs[key]):
                found[key] = nested
        elif key not in theirs or theirs[key] != value:
            found[key] = value
    return found


def keys(settings: dict, prefix: str = "") -> list[str]:
    """The dotted keys of `settings`' values, the search path (the layout's, not a choice) left out."""
    found = []
    for key, value in settings.items():
        if f"{prefix}{key}" == "hydra.searchpath":
            continue
        found += keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return found


def recorded(project: Path) -> dict:
    """`.cruft.json`: the template's answers, its commit, and the skip list."""
    try:
        return json.loads((project / STATE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunError(f"{project} holds no {STATE}; run this in the project's folder, where run.py is") from None


def read(file: Path) -> dict:
    """A YAML config as a dict: an empty file is an empty config."""
    return yaml.safe_load(file.read_text(encoding="utf-8")) or {}


def git(project: Path, *arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=project, capture_output=True, text=True, check=True).stdout


def main() -> None:
    steps = {"before": before, "after": after}
    if len(sys.argv) != 2 or sys.argv[1] not in steps:
        raise SystemExit(f"usage: python -m {__package__}.update before|after (docs/updating.md)")
    reported(lambda: steps[sys.argv[1]](Path.cwd()))


if __name__ == "__main__":
    main()

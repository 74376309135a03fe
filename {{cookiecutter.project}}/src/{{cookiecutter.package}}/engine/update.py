"""The two steps around `cruft update` in the update line of docs/updating.md, each of which stops in
one line where cruft would go wrong without a word:

    python -m {{cookiecutter.package}}.engine.update before && cruft update -y && python -m {{cookiecutter.package}}.engine.update after

`before`: cruft renders the template under the package name of `.cruft.json`'s answers and patches
the files at those paths, leaving out those its `skip` lists; a renamed package gets no fix of the
engine (nothing there to patch, no `.rej`, and "Good work!"), and a file of yours left off the list
gets the template's changes merged into it. `after`: stops at what the merge left to do by hand; then
brings what cruft's skip list kept out of `configs/`: a `configs/` of the one-root layout (every
group, option and setting in one folder of yours, which no update could reach) moves to the two
roots, the engine's `engine/configs/`, which updates bring, and yours, which keeps only what you
changed; and the template's new experiments arrive in `configs/experiment/`. What you changed is
told from what the bake wrote by rendering the template at the bake's commit with its answers.

The bake's hook reads `yours` too, so this module imports nothing outside the standard library and
PyYAML, which cookiecutter brings, but where `after` needs it (cookiecutter, which cruft brings, and
OmegaConf).
"""

import json
import subprocess
import sys
import tempfile
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
    """Stops at a merge left to finish by hand; then brings to `configs/` what the template added
    there since the bake (moving a one-root `configs/` to the two roots first), and says what arrived
    and what stayed yours."""
    unmerged = git(project, "diff", "--name-only", "--diff-filter=U").split()
    rejected = [str(path.relative_to(project)) for path in project.rglob("*.rej") if ".git" not in path.parts]
    if unmerged or rejected:
        raise RunError(
            f"the update left {listed(unmerged + rejected)} to merge by hand (<<<<<<< in a file, or a .rej "
            f"beside it): edit them, git add, then run this again"
        )
    state = recorded(project)
    package = state["context"]["cookiecutter"]["package"]
    configs = project / "configs"
    one_root = f"pkg://{package}.engine.configs" not in searchpath(read(configs / "config.yaml"))
    earlier = baked_state(project, state)
    if earlier.get("commit") == state.get("commit") and not one_root:
        return
    with tempfile.TemporaryDirectory() as clone:
        baked, new = (rendered(clone, each) for each in (earlier, state))
        if one_root:
            print("\n".join(two_roots(configs, baked, project / "src" / package / "engine" / "configs")))
        if lines := experiments(configs, baked, new):
            print("\n".join(lines))


def baked_state(project: Path, state: dict) -> dict:
    """`.cruft.json` as it was before this update, the record of what the files were baked as: the
    newest committed one of another template commit (cruft update writes the new one uncommitted)."""
    for revision in git(project, "rev-list", "HEAD", "--", STATE).split():
        earlier = json.loads(git(project, "show", f"{revision}:{STATE}"))
        if earlier.get("commit") != state.get("commit"):
            return earlier
    return state


def rendered(clone: str, state: dict) -> Path | None:
    """`configs/` as the template at `state`'s commit renders it with `state`'s answers (cruft's own
    render, hooks left out); None where the commit is unknown (a template that was no checkout)."""
    from cookiecutter.generate import generate_context, generate_files

    if state.get("commit") is None:
        return None
    template = Path(clone, "template")
    try:
        if not template.is_dir():
            git(Path(clone), "clone", "-q", "--no-checkout", state["template"], str(template))
        git(template, "checkout", "-q", "--force", state["commit"])
    except subprocess.CalledProcessError:
        raise RunError(
            f"git could not check out the template that {STATE} names at {shown(state['commit'])}, to tell your "
            f"configs/ from what the bake wrote (its message is left out: a URL may hold a token); run git clone "
            f"on that template to see why, then run this again"
        ) from None
    folder = template / (state.get("directory") or "")
    answers = {key: value for key, value in state["context"]["cookiecutter"].items() if not key.startswith("_")}
    context = generate_context(str(folder / "cookiecutter.json"), extra_context=answers)
    output = Path(tempfile.mkdtemp(dir=clone))
    return Path(generate_files(str(folder), context, str(output), accept_hooks=False)) / "configs"


def two_roots(configs: Path, baked: Path | None, engine: Path) -> list[str]:
    """Moves a one-root `configs/` to the two roots: a file as the bake wrote it gives way to the
    engine's; a file you changed keeps your values and gains the engine's new keys and changed
    defaults; config.yaml keeps the settings you changed. Returns what it says about it."""
    removed, kept = 0, []
    for path in sorted(configs.rglob("*.yaml")):
        relative = path.relative_to(configs)
        theirs = engine / relative
        if relative.parts[0] == "experiment" or relative == Path("config.yaml"):
            continue
        if not theirs.is_file():
            kept.append(f"configs/{relative.as_posix()} (yours)")
            continue
        mine, was, now = read(path), as_baked(baked, relative), read(theirs)
        taken = merged(mine, was, now)
        if taken == now:
            path.unlink()
            removed += 1
            continue
        if taken != mine:
            # Hydra reads a file's package from its header comment, which YAML drops.
            first = path.read_text(encoding="utf-8").partition("\n")[0]
            header = f"{first}\n" if first.startswith("# @package") else ""
            path.write_text(header + yaml.safe_dump(taken, sort_keys=False), encoding="utf-8")
        arrived = keys(differences(taken, mine))
        kept.append(
            f"configs/{relative.as_posix()} (yours: {listed(keys(differences(taken, now)), most=4)}"
            + (f"; the engine's: {listed(arrived, most=4)})" if arrived else ")")
        )
    for folder in sorted((path for path in configs.rglob("*") if path.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    package = engine.parents[1].name
    settings = config_yaml(configs / "config.yaml", as_baked(baked, Path("config.yaml")), package)
    return [
        f"configs/ now holds your choices over src/{package}/engine/configs/ (docs/updating.md):",
        f"  from the engine now: {removed} files you never changed",
        f"  kept: {listed(kept, most=6, between='; ') or 'none'}",
        f"  config.yaml keeps {listed(keys(settings)) or 'no setting'} (the earlier one: git show HEAD:configs/config.yaml)",
    ]


def config_yaml(config: Path, baked: dict, package: str) -> dict:
    """Rewrites the one-root config.yaml as yours over the engine's engine.yaml: your defaults list and
    the settings you changed since the bake that the engine's does not give alike; returns them."""
    choices = read(config)
    changed = differences({key: value for key, value in choices.items() if key != "defaults"}, baked)
    settings = differences(changed, read(config.parents[1] / "src" / package / "engine" / "configs" / "engine.yaml"))
    settings.setdefault("hydra", {}).setdefault("searchpath", []).append(f"pkg://{package}.engine.configs")
    defaults = [entry for entry in choices.get("defaults", []) if entry != SCHEMA]
    text = yaml.safe_dump({"defaults": ["engine", *defaults], **settings}, sort_keys=False)
    config.write_text(HEADER.format(package=package) + text, encoding="utf-8")
    return settings


def as_baked(baked: Path | None, relative: Path) -> dict:
    """The file at `relative` of the render of the bake, {} where there is none."""
    return read(baked / relative) if baked is not None and (baked / relative).is_file() else {}


def merged(mine: dict, was: dict, now: dict) -> dict:
    """`now` with what `mine` changed from `was`, key by key at any depth: a key you set or added
    keeps your value, one you removed stays removed, the rest is `now`'s."""
    found = {}
    for key in [*mine, *(key for key in now if key not in mine)]:
        if key not in mine:
            if key not in was:
                found[key] = now[key]
        elif key not in now:
            if key not in was or mine[key] != was[key]:
                found[key] = mine[key]
        elif all(isinstance(value.get(key), dict) for value in (mine, now)):
            found[key] = merged(mine[key], was.get(key) if isinstance(was.get(key), dict) else {}, now[key])
        else:
            found[key] = now[key] if key in was and mine[key] == was[key] else mine[key]
    return found


def experiments(configs: Path, baked: Path | None, new: Path | None) -> list[str]:
    """Brings the template's experiments that `experiment=` would miss: one it added since the bake,
    and a new version of one you never changed; one you changed or removed stays as you left it."""
    if new is None:
        return []
    arrived, refreshed = [], []
    for theirs in sorted((new / "experiment").glob("*.yaml")):
        mine, was = configs / "experiment" / theirs.name, baked / "experiment" / theirs.name if baked else None
        if not mine.is_file() and not (was and was.is_file()):
            arrived.append(theirs.stem)
        elif mine.is_file() and was and was.is_file() and read(mine) == read(was) != read(theirs):
            refreshed.append(theirs.stem)
        else:
            continue
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.write_bytes(theirs.read_bytes())
    return [
        *([f"new experiments in configs/experiment/: {listed(arrived, most=12)}"] if arrived else []),
        *([f"updated experiments you never changed: {listed(refreshed, most=12)}"] if refreshed else []),
    ]


def differences(mine: dict, theirs: dict) -> dict:
    """What of `mine` `theirs` does not give alike, key by key at any depth."""
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
    """A YAML config as Hydra reads it (`1e-2` a float, `${...}` as written): an empty file is {}."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(file)) or {}


def searchpath(config: dict) -> list[str]:
    """Where Hydra looks after `configs/`, as config.yaml gives it."""
    return (config.get("hydra") or {}).get("searchpath") or []


def git(project: Path, *arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=project, capture_output=True, text=True, check=True).stdout


def main() -> None:
    steps = {"before": before, "after": after}
    if len(sys.argv) != 2 or sys.argv[1] not in steps:
        raise SystemExit(f"usage: python -m {__package__}.update before|after (docs/updating.md)")
    reported(lambda: steps[sys.argv[1]](Path.cwd()))


if __name__ == "__main__":
    main()

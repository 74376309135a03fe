"""Trim the baked project to the answers given (drop IPEX files and files Jinja left empty), write
where it came from (`.cruft.json`), then say what to type next.

Cookiecutter renders this file with Jinja and runs it from the generated project root.
"""

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.config import BUILTIN_ABBREVIATIONS
from cookiecutter.repository import expand_abbreviations, is_repo_url, is_zip_file

PACKAGE = "{{ cookiecutter.package }}"
PROJECT = "{{ cookiecutter.project }}"
# Cookiecutter keeps a boolean answer a Python bool, which Jinja renders as True or False.
IPEX = "{{ cookiecutter.ipex }}" == "True"

IPEX_ONLY_FILES = (Path("src", PACKAGE, "engine", "ipex.py"), Path("tests", "test_ipex.py"))
# Every answer, with the template as given (`_template`: a path or a git URL) and the local
# checkout baked from (`_repo_dir`), as JSON: a raw string keeps its escapes, and in JSON three
# double quotes never meet.
CONTEXT = json.loads(r"""{{ cookiecutter | tojson }}""")
# Where this bake ran, not what it answered: cookiecutter sets them again at every bake.
LOCAL = ("_output_dir", "_repo_dir", "_checkout")
# An empty marker file is the point of py.typed (PEP 561); any other empty file is a
# Jinja-conditional file whose condition was false.
KEEP_EMPTY = frozenset({"py.typed"})
# The files the README calls yours, which `cruft update` never writes: the list the engine's update
# check holds a project's `.cruft.json` to, read from the project just made.
sys.path.insert(0, "src")
sys.dont_write_bytecode = True  # no __pycache__ in the project just made
YOURS = importlib.import_module(f"{PACKAGE}.engine.update").yours(PACKAGE)


def main() -> None:
    """Remove what this bake does not use, so the tree holds only code that can run."""
    if not IPEX:
        for path in IPEX_ONLY_FILES:
            path.unlink(missing_ok=True)
    for path in Path().rglob("*"):
        if path.is_file() and path.name not in KEEP_EMPTY and not path.read_bytes().strip():
            path.unlink()


def record_origin() -> None:
    """`.cruft.json`, cruft's record of a project's template (`cruft check` and `cruft update` read
    it): the template as cruft clones it, its commit, and the answers. The commit is also the runs'
    MLflow tag `template.version`; null where the template is not a git checkout of its own, or git
    is missing (then the tag says unknown): that never fails a bake. Cruft's own bakes (`cruft
    create`, and the two renders an update compares) carry `_commit`; cruft writes the file then."""
    if "_commit" in CONTEXT:
        return
    baked_from = typed_at(CONTEXT["_repo_dir"])
    template = expand_abbreviations(CONTEXT["_template"], BUILTIN_ABBREVIATIONS)
    if is_repo_url(template) or is_zip_file(template):
        template = template.removeprefix("git+")  # cookiecutter's mark of git, which git refuses
    else:
        template = baked_from  # cruft clones a folder by a path that holds from anywhere
    answers = {key: value for key, value in CONTEXT.items() if key not in LOCAL}
    state = {
        "template": template,
        "commit": head(baked_from),
        "checkout": CONTEXT.get("_checkout"),
        "context": {"cookiecutter": {**answers, "_template": template}},
        "directory": None,
        "skip": YOURS,  # kept by cruft update, which rewrites the rest of the file
    }
    text = json.dumps(state, indent=2, ensure_ascii=False) + "\n"  # as cruft writes it
    Path(".cruft.json").write_text(text, encoding="utf-8")


def typed_at(path: str) -> str:
    """A local path as cookiecutter names it: relative to the folder its command was typed in (the
    shell's PWD), while this hook runs in the new project."""
    return os.path.normpath(os.path.join(os.environ.get("PWD", ""), path))


def head(checkout: str) -> str | None:
    """The commit checked out at `checkout`, if it is the top of a git checkout: a template copied
    into another repository is not at that repository's commit."""
    try:
        found = subprocess.run(
            ["git", "-C", checkout, "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if found.returncode != 0:
        return None
    top, commit = found.stdout.splitlines()[:2]
    return commit if os.path.samefile(top, checkout) else None


NEXT_STEPS = f"""
Created {PROJECT}. Next, as its README says:
  cd {PROJECT}
  git init && git add -A && git commit -m "Baked"   # cruft update merges against this commit
  python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[dev]'
      (torch first, so that you choose the build: CPU, CUDA or XPU; see pytorch.org)
  .venv/bin/python run.py                   # train the demo: seconds on a CPU
  .venv/bin/python run.py trainer.max_steps=600 resume=last   # continue it
  .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db
      then open http://127.0.0.1:5000/#/experiments?workflowType=machine_learning
"""
# `cruft create` writes `.cruft.json` itself, after this hook, and without the skip list.
UNDER_CRUFT_CREATE = f"""\
  Before a first cruft update, add your files to .cruft.json as docs/updating.md shows:
    "skip": {json.dumps(YOURS)}
"""


def shown_to_a_person() -> bool:
    """Whether someone watches this bake: a bake by cookiecutter, or by `cruft create`; not one of
    the two renders that `cruft update` compares and throws away (cruft's bakes all carry
    `_commit`), each made in a fresh temporary folder of its own."""
    if "_commit" not in CONTEXT:
        return True
    return Path.cwd().parent.parent.resolve() != Path(tempfile.gettempdir()).resolve()


if __name__ == "__main__":
    main()
    record_origin()
    if shown_to_a_person():
        print(NEXT_STEPS + (UNDER_CRUFT_CREATE if "_commit" in CONTEXT else ""))

"""Trim the baked project to the answers given (drop IPEX files and files Jinja left empty), write
where it came from (`.cruft.json`), then say what to type next.

Cookiecutter renders this file with Jinja and runs it from the generated project root.
"""

import json
import subprocess
from pathlib import Path

PACKAGE = "{{ cookiecutter.package }}"
PROJECT = "{{ cookiecutter.project }}"
# Cookiecutter keeps a boolean answer a Python bool, which Jinja renders as True or False.
IPEX = "{{ cookiecutter.ipex }}" == "True"

IPEX_ONLY_FILES = (Path("src", PACKAGE, "ipex.py"), Path("tests", "test_ipex.py"))
# Every answer, with the template as given (`_template`: a path or a git URL) and the local
# checkout baked from (`_repo_dir`), as JSON: a raw string keeps its escapes, and in JSON three
# double quotes never meet.
CONTEXT = json.loads(r"""{{ cookiecutter | tojson }}""")
# Where this bake ran, not what it answered: cookiecutter sets them again at every bake.
LOCAL = ("_output_dir", "_repo_dir", "_checkout")
# An empty marker file is the point of py.typed (PEP 561); any other empty file is a
# Jinja-conditional file whose condition was false.
KEEP_EMPTY = frozenset({"py.typed"})


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
    it): the template as given, its commit, and the answers. The commit is also the runs' MLflow
    tag `template.version`; null where the template is not a git checkout, or git is missing
    (then the tag says unknown): that never fails a bake."""
    try:
        checkout = CONTEXT["_repo_dir"]
        found = subprocess.run(
            ["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
        commit = found.stdout.strip() if found.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    answers = {key: value for key, value in CONTEXT.items() if key not in LOCAL}
    state = {
        "template": CONTEXT["_template"],
        "commit": commit,
        "checkout": CONTEXT.get("_checkout"),
        "context": {"cookiecutter": answers},
        "directory": None,
        "skip": [],
    }
    text = json.dumps(state, indent=2, ensure_ascii=False) + "\n"  # as cruft writes it
    Path(".cruft.json").write_text(text, encoding="utf-8")


NEXT_STEPS = f"""
Created {PROJECT}. Next, as its README says:
  cd {PROJECT}
  python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[dev]'
      (torch first, so that you choose the build: CPU, CUDA or XPU; see pytorch.org)
  .venv/bin/python run.py                   # train the demo: seconds on a CPU
  .venv/bin/python run.py trainer.max_steps=600 resume=last   # continue it
  .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db
      then open http://127.0.0.1:5000/#/experiments?workflowType=machine_learning
"""


if __name__ == "__main__":
    main()
    record_origin()
    print(NEXT_STEPS)

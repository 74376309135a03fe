"""Trim the baked project to the answers given (drop IPEX files and files Jinja left empty), then
say what to type next.

Cookiecutter renders this file with Jinja and runs it from the generated project root.
"""

from pathlib import Path

PACKAGE = "{{ cookiecutter.package }}"
PROJECT = "{{ cookiecutter.project }}"
# Cookiecutter keeps a boolean answer a Python bool, which Jinja renders as True or False.
IPEX = "{{ cookiecutter.ipex }}" == "True"

IPEX_ONLY_FILES = (Path("src", PACKAGE, "ipex.py"), Path("tests", "test_ipex.py"))
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
    print(NEXT_STEPS)

"""Trim the baked project to the answers given: drop IPEX files and files Jinja left empty.

Cookiecutter renders this file with Jinja and runs it from the generated project root.
"""

from pathlib import Path

PACKAGE = "{{ cookiecutter.package }}"
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


if __name__ == "__main__":
    main()

"""Runs ruff (fix, then format) over the template's Python files, which Jinja makes unparsable.

Jinja tags on lines of their own become comments and `{{cookiecutter.package}}` a placeholder
name while ruff runs, with the generated project's own ruff settings; then both come back.
Usage: python scripts/format_template.py  (what `make format` runs)
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1] / "{{cookiecutter.project}}"
PACKAGE, PLACEHOLDER = "{{cookiecutter.package}}", "cc_package_"
TAG_LINE = re.compile(r"^(\s*)(\{%-?.*?-?%\})\s*$")
HIDDEN_TAG = re.compile(r"^[ \t]*# JINJA (\{%.*%\})[ \t]*$", re.MULTILINE)
CLOSING = re.compile(r"\b(endif|else|elif|endfor)\b")


def hide_jinja(text: str) -> str:
    """Each tag line becomes a comment indented like the code it belongs to: the block it
    closes, or the block it opens."""
    lines = text.split("\n")
    hidden = []
    for number, line in enumerate(lines):
        tag = TAG_LINE.match(line)
        if tag is None:
            hidden.append(line)
            continue
        near = reversed(lines[:number]) if CLOSING.search(tag[2]) else lines[number + 1 :]
        neighbour = next((line for line in near if line.strip() and not TAG_LINE.match(line)), "")
        indent = neighbour[: len(neighbour) - len(neighbour.lstrip())]
        hidden.append(f"{indent}# JINJA {tag[2]}")
    return "\n".join(hidden).replace(PACKAGE, PLACEHOLDER)


def ruff_settings(pyproject: str) -> str:
    """The project's pyproject.toml, readable by ruff: without Jinja."""
    plain = "\n".join(line for line in pyproject.splitlines() if not TAG_LINE.match(line))
    # `py{{ cookiecutter.python_min | replace(".", "") }}` (target-version) wants digits alone.
    plain = re.sub(r"\{\{[^}]*replace\([^}]*\}\}", "310", plain)
    return re.sub(r"\{\{.*?\}\}", "3.10", plain)  # a value every other field there accepts


def main() -> None:
    ruff = shutil.which("ruff") or sys.exit("ruff is not on PATH: make setup installs it")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        settings = ruff_settings((TEMPLATE / "pyproject.toml").read_text())
        (work / "pyproject.toml").write_text(settings)
        copies = {}
        for source in TEMPLATE.rglob("*.py"):
            copy = work / str(source.relative_to(TEMPLATE)).replace(PACKAGE, PLACEHOLDER)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(hide_jinja(source.read_text()))
            copies[copy] = source
        subprocess.run([ruff, "check", "--fix", "."], cwd=work, check=False)
        subprocess.run([ruff, "format", "--quiet", "."], cwd=work, check=True)
        for copy, source in copies.items():
            restored = HIDDEN_TAG.sub(r"\1", copy.read_text().replace(PLACEHOLDER, PACKAGE))
            if restored != source.read_text():
                source.write_text(restored)
                print(f"reformatted {source.relative_to(TEMPLATE.parent)}")


if __name__ == "__main__":
    main()

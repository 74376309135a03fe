"""Refuse a bake whose answers would give a broken project, before any file is written.

Cookiecutter renders this file with Jinja, so the answers below are literal strings.
Exit status 1 makes cookiecutter delete the half-made project folder.
"""

import keyword
import re
import sys

PACKAGE = "{{ cookiecutter.package }}"
DEFAULT_DEVICE = "{{ cookiecutter.default_device }}"
PYTHON_MIN = "{{ cookiecutter.python_min }}"

DEVICES = ("auto", "cpu", "cuda", "xpu")
# Import names of what the generated project installs or imports; a package with one of
# these names would be imported instead of the dependency (src/ is first on sys.path).
DEPENDENCIES = frozenset(
    {
        "torch",
        "hydra",
        "omegaconf",
        "mlflow",
        "sklearn",
        "numpy",
        "tqdm",
        "pytest",
        "yaml",
        "ruff",
        "intel_extension_for_pytorch",
    }
)


def problem() -> tuple[str, str, str] | None:
    """Return the first thing wrong with the answers: what is wrong, which question, and what to
    answer instead."""
    if not PACKAGE.isidentifier():
        fixed = re.sub(r"\W|^(?=\d)", "_", PACKAGE) or "<name>"
        return f"package {PACKAGE!r} is not a valid Python identifier", "package", fixed
    if keyword.iskeyword(PACKAGE):
        return f"package {PACKAGE!r} is a Python keyword", "package", "<another name>"
    if PACKAGE in DEPENDENCIES:
        return f"package {PACKAGE!r} would shadow a dependency", "package", "<another name>"
    if PACKAGE in sys.stdlib_module_names:
        return (
            f"package {PACKAGE!r} would shadow the standard-library module",
            "package",
            "<another name>",
        )
    if DEFAULT_DEVICE not in DEVICES:
        return (
            f"default_device {DEFAULT_DEVICE!r} is not one of {', '.join(DEVICES)}",
            "default_device",
            "cpu",
        )
    version = re.fullmatch(r"3\.(\d+)", PYTHON_MIN)
    if version is None or int(version.group(1)) < 10:
        return f"python_min {PYTHON_MIN!r} is not 3.N with N >= 10", "python_min", "3.10"
    return None


if __name__ == "__main__":
    found = problem()
    if found is not None:
        # Cookiecutter prints its own traceback after this line (it logs a failed hook with
        # logger.exception); the line says what to do, whether the answers were typed at its
        # questions or passed after --no-input.
        what, question, answer = found
        print(
            f"error: {what}; run cookiecutter again and answer the {question} question "
            f"with {answer} (or pass {question}={answer} with --no-input)",
            file=sys.stderr,
        )
        sys.exit(1)

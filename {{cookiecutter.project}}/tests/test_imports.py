"""The package's modules import one another in one direction only: every import counts, those
inside functions and those only for type checkers included, since each is a dependency a reader
must follow. And the package is two places: your components beside `engine/`, which imports none
of them (configs/ names them by `_target_`) and of which they need only its public part: `data`
(`Data`, `read_file`) and the ready components of `engine/ready/`, which need no more of it."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import {{cookiecutter.package}}
from {{cookiecutter.package}}.engine.data.contract import Data

PACKAGE = Path({{cookiecutter.package}}.__file__).parent
NAME = "{{cookiecutter.package}}"
ENGINE = f"{NAME}.engine"
READY = f"{ENGINE}.ready"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports; `from . import x` counts x when it is a module."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules and name != here}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def a_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, str] = {}
    trail: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        trail.append(module)
        for imported in sorted(edges.get(module, ())):
            if state.get(imported) == "open":
                return [*trail[trail.index(imported) :], imported]
            if imported not in state and (circle := visit(imported)):
                return circle
        state[module] = "done"
        trail.pop()
        return None

    for module in sorted(edges):
        if module not in state and (circle := visit(module)):
            return circle
    return None


def test_the_walk_sees_the_imports_that_make_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert a_circle(edges) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    recipe = graph()[f"{ENGINE}.train"]
    assert {f"{ENGINE}.checkpoint.manager", f"{ENGINE}.parts", f"{ENGINE}.validation"} <= recipe


def test_no_module_of_the_package_imports_itself_back():
    circle = a_circle(graph())
    assert circle is None, "an import circle: " + " -> ".join(circle)


def public(edges: dict[str, set[str]]) -> set[str]:
    """What your side (every module beside engine/) may take from the engine: the type a data
    component returns and how it reads a file (data.read_file, and the safe reads of files.py, the
    engine's foundation), the ready components, and the data formats' readers (data options too)."""
    foundation = {ENGINE, f"{ENGINE}.data", f"{ENGINE}.files"}
    return foundation | {module for module in edges if module.startswith((READY, f"{ENGINE}.data.formats"))}


def test_the_engine_imports_none_of_your_modules_and_they_need_only_its_public_part():
    edges = graph()
    yours = {module for module in edges if module.count(".") == 1 and module != ENGINE}
    assert {f"{NAME}.{module}" for module in ("models", "datasets", "tasks", "callbacks", "schedulers")} <= yours
    reaching = {module: sorted(imported & yours) for module, imported in edges.items() if module.startswith(ENGINE)}
    assert not {module: names for module, names in reaching.items() if names}, "the engine imports your files"
    ready = {module for module in edges if module.startswith(READY)}
    assert {f"{READY}.{module}" for module in ("models", "datasets", "tasks", "callbacks", "schedulers")} <= ready
    # The ready components are written as yours are, so that yours may subclass or copy them.
    needing = {module: sorted(edges[module] - yours - public(edges)) for module in yours | ready}
    assert not {module: names for module, names in needing.items() if names}, "components import engine internals"


def test_the_data_path_of_before_the_engine_gives_data_for_one_release_and_names_the_new_one(monkeypatch):
    monkeypatch.delitem(sys.modules, f"{NAME}.data", raising=False)  # imported afresh, so that it warns
    with pytest.warns(FutureWarning) as warned:
        old = importlib.import_module(f"{NAME}.data")
    assert old.Data is Data
    assert [str(warning.message) for warning in warned] == [
        f"{NAME}.data is {ENGINE}.data now: import Data from there; {NAME}.data goes in the next release"
    ]


def test_each_console_script_is_the_main_of_an_engine_command():
    """`{{cookiecutter.project}}-compare` and `-tracking` once installed: `python -m` of the engine's modules."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    scripts = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {"compare": f"{ENGINE}.compare:main", "tracking": f"{ENGINE}.tracking.tracker:main"}
    assert scripts == {f"{{cookiecutter.project}}-{command}": target for command, target in commands.items()}
    for target in scripts.values():
        module, _, function = target.partition(":")
        path = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert function in defined, f"{target}: {path} defines no {function}"


def test_every_module_of_the_package_reads_in_one_sitting():
    """No module of the package over 400 lines: past that, a concern has grown a second one."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"


@pytest.mark.parametrize("script", ["run.py", "eval.py"])
def test_a_command_that_tracks_imports_neither_torch_nor_mlflow_before_its_mlflow_sender_starts(script):
    """The sender (tracking.start_sender, the script's first act) imports MLflow in a process of its
    own while the script imports torch, seconds each: whatever the script imports before it delays both."""
    imported = "import runpy, sys; runpy.run_path(sys.argv[1]); print(*sorted({'torch', 'mlflow'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", imported, script], cwd=PACKAGE.parents[1], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout.strip()) == (0, ""), result.stderr


def test_a_run_imports_nothing_of_what_it_does_without(project):
    """MLflow is its sender's (it never imports it), matplotlib a callback's that draws, torchmetrics
    and scipy libraries the ready metrics do without, and sklearn, pandas the digits' file does not need."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "run.py", "trainer.max_steps=1"],
        cwd=project, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    timed = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rpartition("|")[2].strip() for line in timed}
    assert {"torch", "hydra"} <= imported
    assert not {"mlflow", "matplotlib", "torchmetrics", "scipy", "sklearn", "pandas"} & imported

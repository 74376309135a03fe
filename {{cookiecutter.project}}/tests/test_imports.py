"""The package's modules import one another in one direction only: every import counts, those
inside functions and those only for type checkers included, since each is a dependency a reader
must follow. And the package is two places: your components beside `engine/`, which imports none
of them (configs/ names them by `_target_`) and of which they need only `data.Data`."""

import ast
from pathlib import Path

import {{cookiecutter.package}}

PACKAGE = Path({{cookiecutter.package}}.__file__).parent
NAME = "{{cookiecutter.package}}"
ENGINE = f"{NAME}.engine"
# What your side (every module beside engine/) takes from the engine: the type a data component returns.
PUBLIC = {ENGINE, f"{ENGINE}.data"}


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
    assert {f"{ENGINE}.checkpoint.manager", f"{ENGINE}.parts", f"{ENGINE}.evaluation"} <= recipe


def test_no_module_of_the_package_imports_itself_back():
    circle = a_circle(graph())
    assert circle is None, "an import circle: " + " -> ".join(circle)


def test_the_engine_imports_none_of_your_modules_and_they_need_only_its_public_part():
    edges = graph()
    yours = {module for module in edges if module.count(".") == 1 and module != ENGINE}
    assert {f"{NAME}.{module}" for module in ("models", "datasets", "tasks", "callbacks", "schedulers")} <= yours
    reaching = {module: sorted(imported & yours) for module, imported in edges.items() if module.startswith(ENGINE)}
    assert not {module: names for module, names in reaching.items() if names}, "the engine imports your files"
    needing = {module: sorted(edges[module] - yours - PUBLIC) for module in yours}
    assert not {module: names for module, names in needing.items() if names}, "your files import engine internals"


def test_every_module_of_the_package_reads_in_one_sitting():
    """No module of the package over 400 lines: past that, a concern has grown a second one."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"

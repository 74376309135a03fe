"""Which `_target_` a checkpoint's config may name: a checkpoint is data from anywhere, and each
`_target_` in the config it was saved with is a class or function that a resume, eval.py or export.py
would build (hydra.utils.instantiate: at any depth, in `_args_` lists too). So one is built only
where this project could have named it itself: at a key where its `configs/` name it (read as YAML:
`configs/model/cnn.yaml`'s target at `model._target_`, the sweep callback of `engine/configs/engine.yaml`
at `hydra.callbacks.sweep._target_` and nowhere else), where this command's own config names it
(what its configs and its command line give: a target typed is one accepted knowingly), or, at any
key, a class or function defined in the project's package outside the engine (models, datasets,
tasks, callbacks, schedulers and the modules a user adds), found in the source of its files. Nothing
is imported to decide: anything else is refused before any module it names runs.
"""

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml
from hydra.plugins.config_source import ConfigSource

from .errors import RunError, shown, typed
from .moved import current

ENGINE = __name__.rpartition(".")[0]
PACKAGE = ENGINE.partition(".")[0]
FOLDER = Path(__file__).resolve().parents[1]  # the package's files: src/<package>/
Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def check(config: dict, own: dict, roots: Sequence[Path], source: Path) -> None:
    """Refuses, in one line, the first `_target_` of `config` (what a command builds from, with the
    values of the checkpoint `source`) that neither `own` (this command's config) nor the config
    folders `roots` name at its key, and that the package does not define. A target is compared by
    its path now: a config written before the engine's folders may name an old one (moved.py)."""
    allowed = {(key, current(target)) for key, target in named(own)}
    in_configs: set[tuple[str, str]] | None = None  # read only when a target is not this command's own
    for key, target in named(config):
        if (key, current(target)) in allowed:
            continue
        if in_configs is None:
            in_configs = {(at, current(name)) for root in roots for at, name in targets_in(root)}
        if (key, current(target)) in in_configs or defined_here(target):
            continue
        raise RunError(
            f"{shown(source)} holds a config that names {shown(key)}={shown(target)}, which neither configs/ nor this "
            f"project's package names: a checkpoint from elsewhere runs no code of its choosing; if you trust it, "
            f"type {typed(f'++{key}={target}')} on the command line"
        )


def named(node: object, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """Each `_target_` in `node`, nested dicts and lists, with its key: `loss._args_.0._target_`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_":
                yield ".".join((*path, key)), (value if isinstance(value, str) else repr(value))
            else:
                yield from named(value, (*path, str(key)))
    elif isinstance(node, list):
        for number, value in enumerate(node):
            yield from named(value, (*path, str(number)))


def targets_in(configs: Path) -> set[tuple[str, str]]:
    """Every `_target_` in the YAML files of `configs/`, at any depth, with the key it has in a
    composed config: under the file's config group (`model/cnn.yaml`: `model`), or where its
    `# @package` line puts it (an experiment's `_global_`: at the top, setting keys of any group). A
    file that a defaults list places elsewhere (`- model@encoder: mlp`) is not followed there: a
    checkpoint's target at that key is refused, and typed on the command line to accept it."""
    found = set()
    for file in sorted(configs.rglob("*.yaml")):
        try:
            text = file.read_text()
            node = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            package = ConfigSource._get_header_dict(text)["package"]  # Hydra's own reading of the header
        except (OSError, yaml.YAMLError, ValueError):  # a file Hydra cannot read either names nothing
            continue
        if isinstance(node, dict):
            node.pop("defaults", None)  # which other files Hydra composes, not keys of the config
        found |= set(named(node, placed(file.parent.relative_to(configs).parts, package)))
    return found


def placed(group: tuple[str, ...], package: str | None) -> tuple[str, ...]:
    """The key a config file's content goes under, as Hydra (version_base 1.2 and later) places it:
    its group's, or the one its `# @package` line names, from the top (`_global_` being the top)."""
    if package is None:
        return group
    path = package.rpartition("_global_")[2].removeprefix(".") if "_global_" in package else package
    return tuple(path.split(".")) if path else ()


def defined_here(target: str) -> bool:
    """Whether `target` is `<module>.<name>` (or `<module>.<class>.<method>`) of a class or function
    that a module of the package, outside the engine, defines: `my_trainer.models.WideMLP` of yours,
    not `my_trainer.models.nn.Linear` (torch's, reached through the module's import), nor a name of
    `__main__.py` (a program, run by importing it). Followed as Hydra follows it (a module's name,
    else its submodule), through the package's source files alone, none of them imported."""
    parts = target.split(".")
    if parts[0] != PACKAGE or not all(part.isidentifier() for part in parts):
        return False
    found = module(FOLDER.parent, PACKAGE)
    for depth, part in enumerate(parts[1:], start=2):
        if found is None:
            return False
        folder, scope = found
        inner = module(folder, part) if folder is not None else None
        if (definition := defined(scope, part)) is not None:
            # A name that a submodule has too is whichever was set last when Hydra looks: not decided here.
            rest = parts[depth:]
            return inner is None and (not rest or method(definition, rest))
        found = inner
    return False


def method(found: Definition, rest: list[str]) -> bool:
    """Whether `rest` names a function that the class `found` defines in its body."""
    if len(rest) != 1 or not isinstance(found, ast.ClassDef):
        return False
    return isinstance(defined(found.body, rest[0]), ast.FunctionDef | ast.AsyncFunctionDef)


def module(folder: Path, name: str) -> tuple[Path | None, list[ast.stmt]] | None:
    """The module `name` in the package folder `folder`, as Python's import finds it (a package,
    else a file, else a folder without `__init__.py`): its own folder (None for a file, which has no
    submodules) and its top-level statements. None where there is none, or where it is the engine, a
    program (`__main__`), or reached through a link out of the package's folder."""
    if name.startswith("__"):
        return None
    for path in (folder / name / "__init__.py", folder / f"{name}.py", folder / name):
        if path.is_file() or path.is_dir():
            real = path.resolve()
            if not real.is_relative_to(FOLDER) or real.is_relative_to(FOLDER / "engine"):
                return None
            if real.is_dir():
                return real, []
            return (real.parent if path.name == "__init__.py" else None), source(real)
    return None


def source(file: Path) -> list[ast.stmt]:
    """The top-level statements of a module's file; none where it does not parse."""
    try:
        return ast.parse(file.read_bytes(), filename=str(file)).body
    except (OSError, SyntaxError, ValueError):
        return []


def defined(scope: list[ast.stmt], name: str) -> Definition | None:
    """The class or function `name` that the statements `scope` (a module's, or a class body) bind,
    where that is the name's one binding there: a name that an import, an assignment, a second
    definition or a `from ... import *` may bind instead is not known from the source."""
    found = [node for bound, node in bindings(scope) if bound in (name, "*")]
    return found[0] if len(found) == 1 and isinstance(found[0], Definition) else None


def bindings(scope: list[ast.stmt]) -> Iterator[tuple[str, ast.AST]]:
    """Each name the statements `scope` bind in their own namespace, with what binds it, through
    `if`, `try`, `for`, `with` and the like, but not inside a nested class or function: a `class`
    or `def`, an assignment's target, an import (`*` for `from ... import *`), `except ... as`."""
    pending: list[ast.AST] = list(scope)
    while pending:
        node = pending.pop()
        if isinstance(node, Definition):
            yield node.name, node
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            yield node.id, node
        elif isinstance(node, ast.alias):
            yield (node.name if node.name == "*" else node.asname or node.name.partition(".")[0]), node
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            yield node.name, node
        elif isinstance(node, ast.MatchMapping) and node.rest:
            yield node.rest, node
        if not isinstance(node, ast.Lambda):
            pending += ast.iter_child_nodes(node)
